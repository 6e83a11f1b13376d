"""BYOLTrainer: FCL (Wu et al., MedIA 2022) eq. 6 one-directional by default, the symmetric switch, and the target
network's EMA (eq. 7), on a 2-D linear stand-in whose loss and update are computed by hand."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedssl.core.byol import FCLOPT_LR, FEDBYOL_LR, BYOLConfig, BYOLTrainer, byol_loss
from fedssl.models.unet import TINY_FEATURES, BYOLUNetEncoder

torch.set_num_threads(1)


class LinearBYOL(nn.Module):
    """online = identity matrix (trainable), predictor = identity, target = diag(1, 2) (frozen)."""

    def __init__(self):
        super().__init__()
        self.online = nn.Linear(2, 2, bias=False)
        self.predictor = nn.Identity()
        self.target = nn.Linear(2, 2, bias=False)
        with torch.no_grad():
            self.online.weight.copy_(torch.eye(2))
            self.target.weight.copy_(torch.diag(torch.tensor([1.0, 2.0])))
        self.target.weight.requires_grad_(False)


def fixed_views(*views):
    """An ``augment`` that returns ``views`` in turn (t, t', t, t', ...), whatever the batch."""
    queue = list(views)
    return lambda x, g: queue.pop(0)


def one_step(cfg, t, t2):
    model = LinearBYOL()
    trainer = BYOLTrainer(model, cfg, fixed_views(t, t2), seed=0)
    out = trainer.train_round([torch.zeros(1, 2)], 1, 0)
    return out, model


def test_loss_by_hand():
    p = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    z = torch.tensor([[1.0, 0.0], [2.0, 0.0]])  # cos = 1 and 0 -> losses 0 and 2
    assert byol_loss(p, z).item() == pytest.approx(1.0)


T, T2 = torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 1.0]])
#: eq. 6, L(t, t'): z = q(f(t)) = (1, 0), z' = diag(1, 2) t' = (1, 2): cos = 1/sqrt(5)
L_T_T2 = 2 - 2 / math.sqrt(5)
#: the swapped term L(t', t): z = (1, 1), z' = diag(1, 2) t = (1, 0): cos = 1/sqrt(2)
L_T2_T = 2 - math.sqrt(2)


def test_default_is_eq6_one_direction():
    """FCL eq. 6: the online network sees t, the target t' -- one term, not Grill et al.'s sum."""
    assert BYOLConfig().symmetric is False
    out, _ = one_step(BYOLConfig(num_rounds=1), T, T2)
    assert out["loss"] == pytest.approx(L_T_T2, abs=1e-6)  # 1.1056; the symmetric sum would be 1.6914


def test_symmetric_switch_adds_the_swapped_term():
    out, _ = one_step(BYOLConfig(num_rounds=1, symmetric=True), T, T2)
    assert out["loss"] == pytest.approx(L_T_T2 + L_T2_T, abs=1e-6)  # 1.6914, not 2 x 1.1056 nor 1.1056


def test_target_is_the_ema_of_the_online_network_not_a_copy():
    """Views with cos(z, z') = 1 give a zero loss gradient, so the SGD step is weight decay alone:
    theta_1 = (1 - lr wd) I = 0.99995 I; eq. 7: xi_1 = m diag(1, 2) + (1 - m) theta_1."""
    out, model = one_step(BYOLConfig(num_rounds=1), T, T)
    assert out["loss"] == pytest.approx(0.0, abs=1e-6)
    theta = 1 - 0.5 * 1e-4
    torch.testing.assert_close(model.online.weight, torch.diag(torch.tensor([theta, theta])), atol=1e-7, rtol=0)
    xi = torch.tensor([[0.99 * 1 + 0.01 * theta, 0.0], [0.0, 0.99 * 2 + 0.01 * theta]])  # 0.9999995, 1.9899995
    torch.testing.assert_close(model.target.weight, xi, atol=1e-6, rtol=0)


def test_paper_learning_rates():
    """FCL section 5, "Training details": lr 0.05 in general (the baselines, FedBYOL), 0.5 for FCLOpt."""
    assert (FCLOPT_LR, FEDBYOL_LR, BYOLConfig().lr) == (0.5, 0.05, 0.5)
    assert (BYOLConfig().momentum, BYOLConfig().sgd_momentum, BYOLConfig().weight_decay) == (0.99, 0.9, 1e-4)


def test_bad_symmetric_is_named():
    with pytest.raises(ValueError, match="symmetric='yes'"):
        BYOLConfig(symmetric="yes")


def test_real_network_step_loss_and_target_ema():
    """On the BYOL U-Net: the reported loss is eq. 6 recomputed independently on the same views before the
    step, and after it every target parameter is m xi_0 + (1 - m) theta_1 (BN buffers copied)."""
    model = BYOLUNetEncoder(TINY_FEATURES, proj_dim=8, pred_hidden=16, seed=0)
    with torch.no_grad():  # a target that differs from the online network, as after some rounds
        for p in model.target.parameters():
            p.add_(0.05)
    before = copy.deepcopy(model)
    augment = lambda x, g: x + 0.01 * torch.randn(x.shape, generator=g)  # noqa: E731
    x = torch.rand(4, 1, 32, 32, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(3)
    t, t2 = augment(x, g), augment(x, g)
    z = F.normalize(before.predictor(before.online(t)), dim=1)
    z2 = F.normalize(before.target(t2), dim=1)
    expected = (2 - 2 * (z * z2).sum(1)).mean().item()
    trainer = BYOLTrainer(model, BYOLConfig(lr=0.05, num_rounds=2), augment, seed=3)
    out = trainer.train_round([x], 1, 0)
    assert out["steps"] == 1 and out["loss"] == pytest.approx(expected, rel=1e-5)
    m = 0.99
    for (name, xi1), xi0, theta1 in zip(model.target.named_parameters(), before.target.parameters(),
                                        model.online.parameters()):
        torch.testing.assert_close(xi1, m * xi0 + (1 - m) * theta1, msg=name)
    assert any(not torch.equal(a, b) for a, b in zip(model.online.parameters(), model.target.parameters()))


def test_feature_std_is_the_spread_of_the_online_projections():
    """Issue 14 item 4: online = identity, so the projections of t = (e_1, e_2) are e_1, e_2: each coordinate is
    (1, 0) over the batch, std 1/2.  The target's projections of t' = (e_1, e_1) would give 0: not those."""
    t, t2 = torch.eye(2), torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    out, _ = one_step(BYOLConfig(lr=0.1), t, t2)
    assert out["feature_std"] == pytest.approx(0.5)
    sym, _ = one_step(BYOLConfig(lr=0.1, symmetric=True), t, t2)  # the swapped term's online(t') is not counted
    assert sym["feature_std"] == pytest.approx(0.5)
