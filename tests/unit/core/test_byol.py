import pytest
import torch

from fedssl.core.byol import BYOLConfig, BYOLTrainer, byol_loss
from fedssl.models.unet import TINY_FEATURES, BYOLUNetEncoder


def test_loss_by_hand():
    p = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    z = torch.tensor([[1.0, 0.0], [2.0, 0.0]])  # cos = 1 and 0 -> losses 0 and 2
    assert byol_loss(p, z).item() == pytest.approx(1.0)


def test_round_trains_online_and_emas_target():
    torch.manual_seed(0)
    tr = BYOLTrainer(BYOLUNetEncoder(TINY_FEATURES, proj_dim=8, pred_hidden=16), BYOLConfig(lr=0.05, num_rounds=2),
                     lambda x, g: x + 0.01 * torch.randn(x.shape, generator=g), seed=0)
    t0 = {k: v.clone() for k, v in tr.model.target.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    stats = tr.train_round([torch.rand(4, 1, 32, 32, generator=g) for _ in range(2)], 2, 0)
    assert stats["steps"] == 2 and stats["loss"] >= 0
    assert any(not torch.equal(t0[k], v) for k, v in tr.model.target.state_dict().items())
    assert not any(p.requires_grad for p in tr.model.target.parameters())
