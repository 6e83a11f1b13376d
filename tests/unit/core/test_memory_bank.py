import numpy as np
import pytest
import torch

from fedssl.core.memory_bank import FeatureBank, check_bank, remote_bank_for, sample_negatives


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


def test_remote_bank_never_contains_own_features_and_has_fixed_size():
    """Site i's rows are the unit vector e_i with partition id i: what site-2 receives shows whose rows it got."""
    banks = {s: (_unit_rows(3, 4, i), np.full(3, i, np.int64)) for i, s in enumerate(["site-1", "site-2", "site-3"])}
    f, p = remote_bank_for(banks, "site-2", 4, np.random.default_rng(0))
    assert f.shape == (4, 4) and p.shape == (4,)  # trimmed to K = 4 from the 6 rows of the two others
    assert set(p.tolist()) <= {0, 2} and not np.any(f[:, 1])  # never site-2's own rows
    assert f.base is None or f.base is not banks["site-1"][0]  # new arrays
    big, pb = remote_bank_for(banks, "site-2", 10, np.random.default_rng(0))
    assert big.shape == (10, 4) and sorted(pb.tolist()).count(-1) == 4  # 6 real rows, 4 unfilled-slot rows
    np.testing.assert_allclose(np.linalg.norm(big, axis=1), 1.0, rtol=1e-5)
    alone, pa = remote_bank_for({"site-1": banks["site-1"]}, "site-1", 4, np.random.default_rng(0))
    assert alone.shape == (4, 4) and (pa == -1).all()  # the size does not reveal that there is no other site


def test_remote_bank_size_does_not_reveal_the_number_of_sites_or_fill_levels():
    """Banks of K = 8: with 2 or 5 other sites, half-filled or full, the receiver gets 8 rows, all filled once
    the others hold >= 8 filled rows between them; unfilled rows (-1) of a sender are never forwarded."""
    def bank(filled):
        p = np.full(8, -1, np.int64)
        p[:filled] = 0
        return _unit_rows(8, 4, 0), p
    for n_others, filled in ((2, 4), (2, 8), (5, 2), (5, 8)):
        banks = {f"site-{i}": bank(filled) for i in range(n_others + 1)}
        f, p = remote_bank_for(banks, "site-0", 8, np.random.default_rng(1))
        assert f.shape == (8, 4) and (p >= 0).all(), (n_others, filled)


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
    receives at most N - 1 real rows per filled row it shared; honest sites that fill alike are not limited."""
    rng = np.random.default_rng(0)
    honest = {f"site-{i}": (_distinct_rows(8, 2), np.array([0, 1, 2, 3, -1, -1, -1, -1])) for i in (1, 2, 3)}
    free = dict(honest, **{"site-4": (_distinct_rows(8, 2), np.full(8, -1))})
    f, p = remote_bank_for(free, "site-4", 8, rng)
    assert (p >= 0).sum() == 0 and f.shape == (8, 2)
    f, p = remote_bank_for(free, "site-1", 8, rng)  # 4 filled rows x (4 - 1) sites = 12 >= the 8 real rows there
    assert (p >= 0).sum() == 8
    half = dict(honest, **{"site-4": (_distinct_rows(8, 2), np.array([0, -1, -1, -1, -1, -1, -1, -1]))})
    f, p = remote_bank_for(half, "site-4", 8, rng)
    assert (p >= 0).sum() == 3  # one filled row shared, three real rows back

