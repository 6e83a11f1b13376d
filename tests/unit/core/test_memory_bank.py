import numpy as np
import pytest
import torch

from fedssl.core.memory_bank import FeatureBank, FreshRows, check_bank, remote_bank_for, sample_negatives


def test_fifo_replaces_oldest_and_wraps():
    bank = FeatureBank(capacity=4, dim=2, seed=0)
    assert bank.partitions.tolist() == [-1, -1, -1, -1]
    f = torch.eye(2).repeat(3, 1)  # 6 rows
    bank.enqueue(f[:3], torch.tensor([0, 1, 2]))
    assert bank.partitions.tolist() == [0, 1, 2, -1] and bank.ptr == 3 and bank.filled == 3
    bank.enqueue(f[3:6], torch.tensor([3, 4, 5]))  # wraps: slot 3, then 0, 1
    assert bank.partitions.tolist() == [4, 5, 2, 3] and bank.ptr == 2 and bank.filled == 4


def test_state_round_trip_and_export():
    bank = FeatureBank(8, 3, seed=1)
    bank.enqueue(torch.ones(2, 3), torch.tensor([1, 1]))
    other = FeatureBank(8, 3, seed=2)
    other.load_state_dict(bank.state_dict())
    assert torch.equal(other.features, bank.features) and other.ptr == bank.ptr
    f, p = other.export()
    assert f.dtype == np.float32 and p.dtype == np.int64 and f.shape == (8, 3)


def test_sample_negatives_draws_k_without_replacement_from_union():
    g = torch.Generator().manual_seed(0)
    local = torch.arange(4, dtype=torch.float32).view(4, 1)
    remote = torch.arange(4, 12, dtype=torch.float32).view(8, 1)
    feats, parts = sample_negatives(local, torch.zeros(4, dtype=torch.long), remote, torch.ones(8, dtype=torch.long), 4,
                                    g)
    vals = feats[:, 0].tolist()
    assert len(vals) == 4 and len(set(vals)) == 4 and set(vals) <= set(range(12))
    # NS off: all of Q (eq. 1); FE off: only the local bank
    all_feats, _ = sample_negatives(local, torch.zeros(4, dtype=torch.long), remote, torch.ones(8, dtype=torch.long), 4,
                                    g, sample=False)
    assert all_feats.shape[0] == 12
    only_local, _ = sample_negatives(local, torch.zeros(4, dtype=torch.long), None, None, 4, g)
    assert sorted(only_local[:, 0].tolist()) == [0, 1, 2, 3]


def test_sampling_is_uniform_over_local_and_remote():
    g = torch.Generator().manual_seed(0)
    local = torch.zeros(10, 1)
    remote = torch.ones(30, 1)
    frac_remote = np.mean([sample_negatives(local, torch.zeros(10, dtype=torch.long), remote,
                                            torch.zeros(30, dtype=torch.long), 10, g)[0].mean().item()
                                            for _ in range(300)])
    assert abs(frac_remote - 0.75) < 0.03


def _unit_rows(n, dim, value):
    f = np.zeros((n, dim), np.float32)
    f[:, value % dim] = 1.0
    return f


def test_remote_bank_never_contains_own_features_and_gives_back_what_was_shared():
    """Site i's rows are the unit vector e_i with partition id i: what site-2 receives shows whose rows it got."""
    banks = {s: (_unit_rows(3, 4, i), np.full(3, i, np.int64)) for i, s in enumerate(["site-1", "site-2", "site-3"])}
    f, p = remote_bank_for(banks, "site-2", 4, np.random.default_rng(0))
    assert f.shape == (3, 4) and p.shape == (3,)  # site-2 shared 3 rows: 3 of the 6 the two others shared
    assert set(p.tolist()) <= {0, 2} and not np.any(f[:, 1])  # never site-2's own rows
    assert f.base is None or f.base is not banks["site-1"][0]  # new arrays
    capped, _ = remote_bank_for(banks, "site-2", 2, np.random.default_rng(0))
    assert capped.shape == (2, 4)  # at most K
    alone, pa = remote_bank_for({"site-1": banks["site-1"]}, "site-1", 4, np.random.default_rng(0))
    assert alone.shape == (0, 4) and pa.shape == (0,)  # no partner, nothing back (and no padding)


def test_remote_bank_size_does_not_reveal_the_number_of_sites_or_their_counts():
    """Sites that share alike each receive exactly their own count, with 2 or 5 others, whatever those shared
    beyond it; no padding row (-1) is ever sent, and an upload's unfilled rows are never forwarded."""
    def bank(filled):
        p = np.full(8, -1, np.int64)
        p[:filled] = 0
        return _unit_rows(8, 4, 0), p
    for n_others, filled, own in ((2, 4, 4), (2, 8, 4), (5, 2, 2), (5, 8, 3), (1, 8, 8)):
        banks = {f"site-{i}": bank(filled) for i in range(1, n_others + 1)}
        banks["site-0"] = bank(own)
        f, p = remote_bank_for(banks, "site-0", 8, np.random.default_rng(1))
        assert f.shape == (own, 4) and (p >= 0).all(), (n_others, filled)
    # only when the others together shared fewer does the count show their total
    f, _ = remote_bank_for({"site-0": bank(8), "site-1": bank(3)}, "site-0", 8, np.random.default_rng(1))
    assert f.shape == (3, 4)


def test_export_fresh_shares_each_row_once_and_receive_keeps_a_fifo():
    """Issue 45: a bank re-sent every round let a receiver link a row across rounds by its value or its lifetime
    (100 % of FedCLF's rows grouped with their sender) and average perturbed copies of it."""
    bank = FeatureBank(4, 2, seed=0)
    rows = torch.nn.functional.normalize(torch.randn(7, 2, generator=torch.Generator().manual_seed(0)), dim=1)
    assert bank.export_fresh()[0].shape == (0, 2)  # the initial random rows are never shared
    bank.enqueue(rows[:3], torch.tensor([0, 1, 2]))
    f, p = bank.export_fresh()
    assert torch.equal(torch.as_tensor(f), rows[:3]) and p.tolist() == [0, 1, 2]
    assert bank.export_fresh()[0].shape == (0, 2)  # nothing twice
    bank.enqueue(rows[3:], torch.tensor([3, 0, 1, 2]))  # wraps; 4 new rows = the whole bank
    f, p = bank.export_fresh()
    assert torch.equal(torch.as_tensor(f), rows[3:]) and p.tolist() == [3, 0, 1, 2]
    bank.enqueue(rows[:6], torch.arange(6) % 4)  # more than K since the last export: the latest K
    assert torch.equal(torch.as_tensor(bank.export_fresh()[0]), rows[2:6])
    # a checkpoint keeps what is still to share; an old checkpoint (no "fresh") has nothing pending
    bank.enqueue(rows[:1], torch.tensor([0]))
    other = FeatureBank(4, 2, seed=1)
    other.load_state_dict(bank.state_dict())
    assert other.export_fresh()[0].shape == (1, 2)
    other.load_state_dict({k: v for k, v in bank.state_dict().items() if k != "fresh"})
    assert other.export_fresh()[0].shape == (0, 2)
    # the receiver's FIFO: only filled rows enter, oldest first, and a remote row is never re-exported
    fifo = FeatureBank(4, 2, seed=2)
    assert fifo.receive(rows[:3].numpy(), np.array([0, -1, 2])) == 2 and fifo.filled == 2
    f, p = fifo.filled_rows()
    assert torch.equal(f, rows[[0, 2]]) and p.tolist() == [0, 2]
    fifo.receive(rows[3:7].numpy(), np.arange(4))
    assert torch.equal(fifo.filled_rows()[0], rows[3:7]) and fifo.export_fresh()[0].shape == (0, 2)
    assert fifo.receive(np.zeros((0, 2), np.float32), np.zeros(0, np.int64)) == 0
    with pytest.raises(ValueError, match=r"expected \[M, 2\]"):
        fifo.receive(np.zeros((3, 5), np.float32), np.zeros(3, np.int64))


def test_fresh_rows_forwards_a_row_once_per_site_within_its_history():
    fresh = FreshRows(history=6)
    rows = _distinct_rows(8, 2)
    f, p = fresh.keep("site-1", rows[:4], np.array([0, 1, -1, 2]))
    assert np.array_equal(f, rows[[0, 1, 3]]) and p.tolist() == [0, 1, 2]  # unfilled rows are dropped
    f, _ = fresh.keep("site-1", rows[:6], np.zeros(6, np.int64))  # a client that re-sends its bank
    assert np.array_equal(f, rows[[2, 4, 5]])  # only what it had not shared (row 2 was unfilled before)
    f, _ = fresh.keep("site-2", rows[:2], np.zeros(2, np.int64))
    assert f.shape == (2, 2)  # per site
    f, _ = fresh.keep("site-1", np.repeat(rows[6:7], 3, axis=0), np.zeros(3, np.int64))
    assert f.shape == (1, 2)  # nor twice in one upload
    fresh.keep("site-1", rows[7:8], np.zeros(1, np.int64))  # 8 digests: the oldest 2 are forgotten
    assert fresh.keep("site-1", rows[:2], np.zeros(2, np.int64))[0].shape == (2, 2)
    fresh.reset()
    assert fresh.keep("site-2", rows[:2], np.zeros(2, np.int64))[0].shape == (2, 2)


def _distinct_rows(n, dim):
    angles = 0.2 * np.arange(1, n + 1)
    f = np.zeros((n, dim), np.float32)
    f[:, 0], f[:, 1] = np.cos(angles), np.sin(angles)
    return f


def test_check_bank_casts_and_rejects_bad_uploads():
    ok_f, ok_p = _distinct_rows(4, 2).astype(np.float64), np.zeros(4, np.int32)
    f, p = check_bank(ok_f, ok_p, "site-1", dim=2, max_rows=4, n_partitions=4)
    assert f.dtype == np.float32 and p.dtype == np.int64
    cases = {
        "non-finite": (np.where(np.arange(8).reshape(4, 2) == 0, np.nan, ok_f), ok_p),
        "overflow": (np.where(np.arange(8).reshape(4, 2) == 0, 1e300, ok_f), ok_p),
        "shape": (ok_f, np.zeros(3, np.int64)),
        "width": (np.zeros((4, 3), np.float32), ok_p),
        "too many rows": (_unit_rows(5, 2, 0), np.zeros(5, np.int64)),
        "not unit": (ok_f * 2, ok_p),
        "partition range": (ok_f, np.array([0, 1, 2, 4])),
        "partition below -1": (ok_f, np.array([0, 1, 2, -2])),
        "float partitions": (ok_f, np.zeros(4, np.float32)),
        "complex": (ok_f.astype(np.complex64), ok_p),
        # issue 45: a bank of copies of one vector (or of near-copies) was accepted and shuttled
        "duplicates": (np.repeat(ok_f[:1], 4, axis=0), ok_p),
        "near-constant": (_unit_rows(4, 2, 0) + np.array([[0, 1e-7], [0, 2e-7], [0, 3e-7], [0, 4e-7]]), ok_p),
    }
    for what, (feats, parts) in cases.items():
        with pytest.raises(ValueError, match="site-1"):
            check_bank(feats, parts, "site-1", dim=2, max_rows=4, n_partitions=4)
            pytest.fail(f"{what} was accepted")


def test_a_site_that_shares_nothing_receives_nothing_real():
    """Issue 45: a device that marked its whole bank unfilled shared nothing and still received real rows.  A site
    receives as many rows as it shared, so free riding earns nothing."""
    rng = np.random.default_rng(0)
    honest = {f"site-{i}": (_distinct_rows(8, 2), np.array([0, 1, 2, 3, -1, -1, -1, -1])) for i in (1, 2, 3)}
    free = dict(honest, **{"site-4": (_distinct_rows(8, 2), np.full(8, -1))})
    f, p = remote_bank_for(free, "site-4", 8, rng)
    assert f.shape == (0, 2)
    f, p = remote_bank_for(free, "site-1", 8, rng)  # 4 filled rows shared, 4 back
    assert f.shape == (4, 2) and (p >= 0).all()
    half = dict(honest, **{"site-4": (_distinct_rows(8, 2), np.array([0, -1, -1, -1, -1, -1, -1, -1]))})
    f, p = remote_bank_for(half, "site-4", 8, rng)
    assert f.shape == (1, 2)  # one filled row shared, one real row back
