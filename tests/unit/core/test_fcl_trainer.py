import pytest
import torch

from fedssl.core.fcl import FCLConfig, FCLTrainer, cosine_lr
from fedssl.models.unet import TINY_FEATURES, MoCoUNetEncoder


def identity_augment(x, g):
    return x


def batches(n, v=2, s=2, hw=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        yield torch.rand(v, s, 1, hw, hw, generator=g), torch.arange(s).repeat(v, 1)


def make(**kw):
    torch.manual_seed(0)
    cfg = FCLConfig(bank_size=16, num_rounds=2, lr=0.01, **kw)
    return FCLTrainer(MoCoUNetEncoder(TINY_FEATURES, proj_dim=8), cfg, identity_augment, seed=0)


def test_round_updates_bank_momentum_and_is_finite():
    tr = make()
    before = {k: v.clone() for k, v in tr.model.momentum.state_dict().items()}
    remote = (torch.nn.functional.normalize(torch.randn(8, 8), dim=1), torch.randint(0, 2, (8,)))
    stats = tr.train_round(batches(3), steps_per_round=3, round_idx=0, remote=remote)
    assert stats["steps"] == 3 and stats["loss"] > 0
    assert tr.bank.filled == 12  # 3 steps x 2 volumes x 2 partitions
    assert sorted(set(tr.bank.partitions[:12].tolist())) == [0, 1]
    changed = any(not torch.equal(before[k], v) for k, v in tr.model.momentum.state_dict().items())
    assert changed


def test_checkpoint_round_trip_resumes_identically():
    a = make()
    a.train_round(batches(2), 2, 0)
    b = make()
    b.load_state_dict(a.state_dict())
    sa = a.train_round(batches(1, seed=5), 2, 1)
    sb = b.train_round(batches(1, seed=5), 2, 1)
    assert sa["loss"] == pytest.approx(sb["loss"], rel=1e-6)


def test_cosine_lr():
    assert cosine_lr(0.05, 0.0) == pytest.approx(0.05)
    assert cosine_lr(0.05, 0.5) == pytest.approx(0.025)
    assert cosine_lr(0.05, 1.0) == pytest.approx(0.0)


def test_bad_config_names_argument():
    with pytest.raises(ValueError, match="tau"):
        FCLConfig(tau=0)
