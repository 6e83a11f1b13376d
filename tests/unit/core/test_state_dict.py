import numpy as np
import pytest
import torch

from fedssl.core.state_dict import (ContributionError, RunningAverage, check_contribution, ema_update, match_keys,
                                    merge_into, weighted_average)


def test_weighted_average_by_hand():
    a = {"w": np.array([1.0, 2.0], np.float32), "n": np.array(10, np.int64)}
    b = {"w": np.array([4.0, 8.0], np.float32), "n": np.array(20, np.int64)}
    out = weighted_average([a, b], [1, 2])  # (1*a + 2*b) / 3
    np.testing.assert_allclose(out["w"], [3.0, 6.0])
    assert out["w"].dtype == np.float32 and out["n"].dtype == np.int64 and int(out["n"]) == 17  # 16.67 -> 17
    assert a["w"].tolist() == [1.0, 2.0]  # inputs untouched


def test_weighted_average_rejects_bad_weights():
    with pytest.raises(ValueError, match="weights must not all be zero"):
        weighted_average([{"w": np.zeros(1)}], [0])
    with pytest.raises(ValueError, match=r"weight -1 must be a finite number >= 0"):
        weighted_average([{"w": np.zeros(1)}, {"w": np.zeros(1)}], [2, -1])
    with pytest.raises(ValueError, match="need one weight per state, got 1 states and 2 weights"):
        weighted_average([{"w": np.zeros(1)}], [1, 2])


def test_running_average_holds_no_contribution_and_matches_by_hand():
    run = RunningAverage()
    a, b, c = (np.array([1.0, 2.0], np.float32), np.array([4.0, 8.0], np.float32), np.array([0.5, 0.0], np.float32))
    run.add({"w": a}, 1)
    run.add({"w": b}, 2)
    a[:] = 100.0  # the caller reuses its buffer: the running sum kept no reference to it
    run.add({"w": torch.from_numpy(c)}, 1)
    # (1 * [1, 2] + 2 * [4, 8] + 1 * [0.5, 0]) / 4 = [2.375, 4.5]
    np.testing.assert_allclose(run.result()["w"], [2.375, 4.5])
    assert run.count == 3 and run.total_weight == 4.0


def test_running_average_is_order_independent_to_the_last_bit():
    rng = np.random.default_rng(0)
    states = [{"w": rng.normal(size=1000).astype(np.float32)} for _ in range(20)]
    weights = rng.integers(1, 500, size=20).tolist()
    fwd, rev = RunningAverage(), RunningAverage()
    for s, w in zip(states, weights):
        fwd.add(s, w)
    for s, w in zip(states[::-1], weights[::-1]):
        rev.add(s, w)
    assert np.array_equal(fwd.result()["w"], rev.result()["w"])


def test_running_average_chunked_sum_equals_the_plain_float64_sum(monkeypatch):
    """The sum runs through a cache-sized scratch chunk (issue 46); with a 3-value chunk every tensor spans several
    chunks and a last partial one, and the result is the plain float64 expression to the last bit."""
    import fedssl.core.state_dict as sd
    monkeypatch.setattr(sd, "SCRATCH", 3)
    rng = np.random.default_rng(1)
    states = [{"w": rng.normal(size=(4, 5)).astype(np.float32), "n": np.array(i, np.int64)} for i in range(4)]
    weights = [3, 1, 7, 2]
    run = sd.RunningAverage()
    for s, w in zip(states, weights):
        run.add(s, w)
    plain = sum(np.float64(w) * s["w"].astype(np.float64) for s, w in zip(states, weights))
    assert np.array_equal(run.result()["w"], (plain / sum(weights)).astype(np.float32))
    assert int(run.result()["n"]) == round(sum(w * i for i, w in enumerate(weights)) / sum(weights))


def test_the_running_sum_split_over_threads_is_the_plain_float64_sum_to_the_last_bit(monkeypatch):
    """The running sum is split evenly over threads by value, across tensor boundaries (issue 46). With 3 threads,
    a 2-value scratch chunk and every contribution above the parallel minimum, each cut falls inside a tensor and
    every value is summed once: the result is the plain float64 expression to the last bit."""
    import fedssl.core.state_dict as sd
    monkeypatch.setattr(sd, "SUM_THREADS", 3)
    monkeypatch.setattr(sd, "PARALLEL_MIN", 4)
    monkeypatch.setattr(sd, "SCRATCH", 2)
    monkeypatch.setattr(sd, "_POOL", None)
    rng = np.random.default_rng(2)
    shapes = {"a": (5,), "b": (2, 3), "c": (), "d": (7,)}  # 19 values: cuts at 6 and 12, inside "b" and "d"
    states = [{k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()} for _ in range(3)]
    weights = [3, 1, 7]
    run = sd.RunningAverage()
    for st, w in zip(states, weights):
        run.add(st, w)
    out = run.result()
    for k in shapes:
        plain = sum(np.float64(w) * st[k].astype(np.float64) for st, w in zip(states, weights))
        assert np.array_equal(out[k], (plain / sum(weights)).astype(np.float32)), k
    assert sd._POOL is not None  # the sum did run on the pool
    threads = set(sd._POOL._threads)  # this pool's (a pool of an earlier test may live on under the same name)
    assert threads and all(t.is_alive() and t.name.startswith("fedssl-sum") for t in threads)
    sd.release_threads()  # the end of a run: no summing thread left running
    assert sd._POOL is None and not any(t.is_alive() for t in threads)
    run.clear()
    for st, w in zip(states, weights):  # the next sum starts the pool again
        run.add(st, w)
    assert sd._POOL is not None and np.array_equal(run.result()["a"], out["a"])
    sd.release_threads()  # (the earlier test's pool, restored by monkeypatch, is that test's to end)


def test_an_honest_update_is_accepted_by_the_norms_and_a_doubtful_one_by_the_exact_check(monkeypatch):
    """||x - g|| <= ||x|| + ||g||: an update whose norm plus the global model's is within the bound needs no pass
    over x - g (issue 46); one near the bound goes to the exact check, which accepts or refuses it exactly.
    g = [3, 4] (norm 5), bound 10 x 5 = 50."""
    import fedssl.core.state_dict as sd
    ref = {"w": np.array([3.0, 4.0], np.float32)}
    calls = []
    exact = sd.update_ratio
    monkeypatch.setattr(sd, "update_ratio", lambda *a, **k: calls.append(1) or exact(*a, **k))
    check_contribution(ref, {"w": np.array([6.0, 8.0], np.float32)}, "s", max_update_ratio=10.0)  # 10 + 5 <= 50
    assert calls == []
    # ||x|| + ||g|| = 50 + 5 > 50: not shown by the norms; exactly ||x - g|| = 45 <= 50, accepted
    check_contribution(ref, {"w": np.array([30.0, 40.0], np.float32)}, "s", max_update_ratio=10.0)
    assert calls == [1]
    with pytest.raises(ContributionError, match=r"norm 1\.2 x the global"):  # ||x - g|| = 6 > 1 x 5
        check_contribution(ref, {"w": np.array([-0.6, -0.8], np.float32)}, "s", max_update_ratio=1.0)
    with pytest.raises(ContributionError, match="non-finite values in 'w'"):
        check_contribution(ref, {"w": np.array([np.nan, 0.0], np.float32)}, "s", max_update_ratio=10.0)
    x = {"w": np.array([6.0, 8.0], np.float32)}  # 10 + 5 = 15 against 0.999 x 3 x 5 = 14.985: left to the exact check
    assert not sd.within_bound_by_norms(x, 25.0, 3.0) and sd.within_bound_by_norms(x, 25.0, 3.01)


def test_the_norm_shortcut_split_over_threads_counts_every_float_value_once(monkeypatch):
    """The triangle inequality's ||x||^2 runs on the summing threads (issue 46), cut by value across tensors: with
    3 threads and 19 float values the cuts fall inside "b" and "d"; the integer buffer is left out. Hand-computed:
    the squares of 1..19."""
    import fedssl.core.state_dict as sd
    monkeypatch.setattr(sd, "SUM_THREADS", 3)
    monkeypatch.setattr(sd, "PARALLEL_MIN", 4)
    monkeypatch.setattr(sd, "_POOL", None)
    values = np.arange(1, 20, dtype=np.float32)
    x = {"a": values[:5], "b": values[5:11].reshape(2, 3), "n": np.array(1000, np.int64),
         "c": values[11:12].reshape(()), "d": values[12:]}
    assert sd.parallel_squared_norm(x) == 19 * 20 * 39 / 6  # 2470
    assert sd._POOL is not None  # it did run on the pool
    sd.release_threads()
    assert sd.within_bound_by_norms(x, 0.0, 50.0) and not sd.within_bound_by_norms(x, 0.0, 49.0)  # sqrt(2470) = 49.7


def test_a_checked_contribution_of_the_models_dtype_is_not_copied():
    """86.6 M parameters arrive at the server once: the cast keeps an array already of the model's dtype (issue 46:
    the copy cost a second model's memory per contribution); another dtype is cast, and nothing is written into."""
    ref = {"a": np.zeros(3, np.float32), "n": np.zeros((), np.int64)}
    sent = {"a": np.array([1.0, 2.0, 3.0], np.float32), "n": np.array(4, np.int32)}
    out = check_contribution(ref, sent, "site-1")
    assert out["a"] is sent["a"] and sent["a"].tolist() == [1.0, 2.0, 3.0]
    assert out["n"].dtype == np.int64 and out["n"] is not sent["n"]
    for bad in (np.nan, np.inf, -np.inf):
        with pytest.raises(ContributionError, match="non-finite"):
            check_contribution(ref, {"a": np.array([1.0, bad, 3.0], np.float32), "n": sent["n"]}, "site-1")


def test_running_average_clear_starts_afresh_and_reuses_its_buffers():
    run = RunningAverage()
    run.add({"w": np.array([1.0, 3.0], np.float32)}, 1)
    run.add({"w": np.array([3.0, 5.0], np.float32)}, 1)
    np.testing.assert_allclose(run.result()["w"], [2.0, 4.0])
    run.clear()  # next round: nothing of the last one may leak into the new mean
    run.add({"w": np.array([10.0, 20.0], np.float32)}, 4)
    np.testing.assert_allclose(run.result()["w"], [10.0, 20.0])
    assert run.count == 1 and run.total_weight == 4.0
    run.clear()  # 0-d tensors (a BatchNorm step count) reuse their buffer too
    run.add({"n": np.array(7, np.int64)}, 1)
    run.clear()
    run.add({"n": np.array(3, np.int64)}, 1)
    assert int(run.result()["n"]) == 3


def test_running_average_refuses_a_different_contribution_before_adding():
    run = RunningAverage()
    run.add({"w": np.ones(2), "b": np.ones(1)}, 1)
    with pytest.raises(ValueError, match=r"missing \['b'\]"):
        run.add({"w": np.full(2, 9.0)}, 1)
    with pytest.raises(ValueError, match=r"'b' has shape \(2,\)"):
        run.add({"w": np.full(2, 9.0), "b": np.ones(2)}, 1)  # "w" is checked and fits: nothing may be added yet
    np.testing.assert_allclose(run.result()["w"], [1.0, 1.0])
    assert run.count == 1


def test_check_contribution_keys_shapes_nan():
    ref = {"a": np.zeros((2, 2)), "b": np.zeros(3)}
    check_contribution(ref, {"a": np.ones((2, 2)), "b": torch.ones(3)}, "site-1")
    with pytest.raises(ContributionError, match="site-1.*wrong keys"):
        check_contribution(ref, {"a": np.ones((2, 2))}, "site-1")
    with pytest.raises(ContributionError, match="shape"):
        check_contribution(ref, {"a": np.ones((2, 3)), "b": np.ones(3)}, "site-1")
    with pytest.raises(ContributionError, match="non-finite"):
        check_contribution(ref, {"a": np.full((2, 2), np.inf), "b": np.ones(3)}, "site-1")


def test_merge_keeps_every_key():
    assert merge_into({"a": 1, "b": 2}, {"b": 3}) == {"a": 1, "b": 3}


def test_ema_update_by_hand():
    t, o = torch.nn.Linear(1, 1, bias=False), torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        t.weight.fill_(1.0)
        o.weight.fill_(3.0)
    ema_update(t, o, 0.75)  # 0.75*1 + 0.25*3 = 1.5
    assert t.weight.item() == pytest.approx(1.5)


def test_match_keys_by_pattern():
    keys = ["encoder.cls_token", "encoder.pos_embed", "decoder.embed.weight", "decoder.pred.bias",
            "features.norm0.running_mean"]
    assert match_keys(keys, ["encoder.cls_token"]) == ["encoder.cls_token"]
    assert match_keys(keys, ["decoder.*"]) == ["decoder.embed.weight", "decoder.pred.bias"]
    assert match_keys(keys, ["*.running_mean", "encoder.cls_token"]) == ["encoder.cls_token",
                                                                         "features.norm0.running_mean"]
    assert match_keys(keys, ["encoder.cls"]) == []  # whole names only, no prefix matching
