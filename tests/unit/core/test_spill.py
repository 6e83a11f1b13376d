"""fedssl.core.spill: a held claim in a temporary file with no name, read back a piece at a time (issue 46)."""
import os
import tracemalloc

import numpy as np
import pytest

import fedssl.core.spill as spill
from fedssl.core.state_dict import RunningAverage


def _state():
    rng = np.random.default_rng(0)
    return {"w": rng.normal(size=(3, 5)).astype(np.float32),
            "t": rng.normal(size=(4, 2)).T,  # float64, not contiguous
            "n": np.array(7, np.int64)}  # 0-d stays 0-d


def test_a_spilled_state_reads_back_whole_in_pieces_from_a_file_with_no_name(monkeypatch):
    monkeypatch.setattr(spill, "PIECE_BYTES", 16)  # 4 float32 or 2 float64 values a piece
    state = _state()
    held = spill.SpilledState(state)
    assert os.fstat(held._file.fileno()).st_nlink == 0  # unlinked from the start: nothing of a site is left on disk
    assert held.shapes == {"w": (3, 5), "t": (2, 4), "n": ()}
    for k, a in state.items():
        pieces = list((start, p.copy()) for start, p in held.pieces(k))
        assert [start for start, _ in pieces] == list(range(0, a.size, 16 // a.dtype.itemsize))
        got = np.concatenate([p for _, p in pieces]).reshape(a.shape)
        assert got.dtype == a.dtype and np.array_equal(got, a), k
    fd = held._file.fileno()
    held.close()
    with pytest.raises(OSError):
        os.fstat(fd)  # closed: the space is free


def test_the_sum_of_a_held_state_is_the_sum_of_the_state_to_the_last_bit(monkeypatch):
    """add_held sums each value as add does, first contribution or later, whatever the pieces."""
    monkeypatch.setattr(spill, "PIECE_BYTES", 24)
    rng = np.random.default_rng(1)
    states = [{"w": rng.normal(size=(7, 3)).astype(np.float32), "n": np.array(i, np.int64)} for i in range(3)]
    weights = [3, 11, 5]
    for held_at in range(3):
        direct, via = RunningAverage(), RunningAverage()
        for i, (s, w) in enumerate(zip(states, weights)):
            direct.add(s, w)
            if i == held_at:
                h = spill.SpilledState(s)
                via.add_held(h, w)
                h.close()
            else:
                via.add(s, w)
        for k in ("w", "n"):
            assert np.array_equal(direct.result()[k], via.result()[k]), (held_at, k)
            assert direct.result()[k].dtype == via.result()[k].dtype


def test_a_spilled_state_is_not_in_the_process_memory():
    """A 4 MB state spilled: the traced memory does not hold it once the caller drops its arrays."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        state = {"w": np.ones(1 << 20, np.float32)}
        held = spill.SpilledState(state)
        del state
        assert tracemalloc.get_traced_memory()[0] - before < 1 << 20
        in_memory = spill.HeldInMemory({"w": np.ones(1 << 20, np.float32)})
        assert tracemalloc.get_traced_memory()[0] - before >= 4 << 20  # the fallback does hold it
    finally:
        tracemalloc.stop()
    held.close()
    in_memory.close()


def test_hold_keeps_the_state_in_memory_when_no_file_can_be_written(tmp_path):
    state = _state()
    kept, why = spill.hold(state, directory=str(tmp_path / "missing"))
    assert isinstance(kept, spill.HeldInMemory) and why.startswith("FileNotFoundError")
    run = RunningAverage()
    run.add_held(kept, 2)
    assert np.array_equal(run.result()["w"], state["w"])
    kept, why = spill.hold(state, directory=str(tmp_path))
    assert isinstance(kept, spill.SpilledState) and why == ""
    assert os.listdir(tmp_path) == []  # the file never had a name there
    kept.close()


def test_a_held_state_that_cannot_be_read_back_whole_leaves_a_sum_with_no_mean():
    """Half of a held claim in the sum cannot be taken out again: the sum refuses to give a mean, so a partial
    contribution never becomes a global model."""
    class Failing:
        shapes, dtypes = {"w": (4,)}, {"w": np.dtype(np.float32)}

        def pieces(self, key):
            yield 0, np.ones(2, np.float32)
            raise OSError("disk gone")

    run = RunningAverage()
    run.add({"w": np.zeros(4, np.float32)}, 1)
    with pytest.raises(ValueError, match=r"read back whole \(OSError: disk gone\)"):
        run.add_held(Failing(), 1)
    with pytest.raises(ValueError, match="incomplete: a held contribution could not be read back whole"):
        run.result()
    run.clear()  # the next round starts whole
    run.add({"w": np.ones(4, np.float32)}, 1)
    assert np.array_equal(run.result()["w"], np.ones(4, np.float32))
