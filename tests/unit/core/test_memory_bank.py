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
    feats, parts = sample_negatives(local, torch.zeros(4, dtype=torch.long), remote, torch.ones(8, dtype=torch.long), 4, g)
    vals = feats[:, 0].tolist()
    assert len(vals) == 4 and len(set(vals)) == 4 and set(vals) <= set(range(12))
    # NS off: all of Q (eq. 1); FE off: only the local bank
    all_feats, _ = sample_negatives(local, torch.zeros(4, dtype=torch.long), remote, torch.ones(8, dtype=torch.long), 4, g, sample=False)
    assert all_feats.shape[0] == 12
    only_local, _ = sample_negatives(local, torch.zeros(4, dtype=torch.long), None, None, 4, g)
    assert sorted(only_local[:, 0].tolist()) == [0, 1, 2, 3]


def test_sampling_is_uniform_over_local_and_remote():
    g = torch.Generator().manual_seed(0)
    local = torch.zeros(10, 1)
    remote = torch.ones(30, 1)
    frac_remote = np.mean([sample_negatives(local, torch.zeros(10, dtype=torch.long), remote,
                                            torch.zeros(30, dtype=torch.long), 10, g)[0].mean().item() for _ in range(300)])
    assert abs(frac_remote - 0.75) < 0.03


def test_remote_bank_never_contains_own_features():
    banks = {s: (np.full((3, 2), i, np.float32), np.full(3, i, np.int64)) for i, s in enumerate(["site-1", "site-2", "site-3"])}
    f, p = remote_bank_for(banks, "site-2", np.random.default_rng(0))
    assert f.shape == (6, 2) and sorted(set(p.tolist())) == [0, 2]
    assert f.base is None or f.base is not banks["site-1"][0]  # new arrays
    alone, _ = remote_bank_for({"site-1": banks["site-1"]}, "site-1", np.random.default_rng(0))
    assert alone.shape == (0, 2)


def test_check_bank_rejects_bad_uploads():
    ok_f, ok_p = np.zeros((4, 2), np.float32), np.zeros(4, np.int64)
    check_bank(ok_f, ok_p, "site-1", dim=2)
    bad = ok_f.copy()
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="site-1.*non-finite"):
        check_bank(bad, ok_p, "site-1")
    with pytest.raises(ValueError, match="shape"):
        check_bank(ok_f, np.zeros(3, np.int64), "site-1")
    with pytest.raises(ValueError, match="feature bank"):
        check_bank(np.zeros((4, 3), np.float32), ok_p, "site-1", dim=2)
