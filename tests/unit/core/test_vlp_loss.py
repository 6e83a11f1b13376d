"""FedDRA's local objective (fedssl.core.vlp) against direct formulas on tiny tensors."""

import math

import pytest
import torch

from fedssl.core.vlp import FedDRAConfig, anchor_loss, convirt_loss, trainable_names


def direct_infonce(a, b, tau, w):
    a = a / a.norm(dim=1, keepdim=True)
    b = b / b.norm(dim=1, keepdim=True)
    s = (a @ b.t()) / tau
    n = s.shape[0]
    i2t = -sum(math.log(math.exp(s[i, i]) / sum(math.exp(s[i, j]) for j in range(n))) for i in range(n)) / n
    t2i = -sum(math.log(math.exp(s[i, i]) / sum(math.exp(s[j, i]) for j in range(n))) for i in range(n)) / n
    return w * i2t + (1 - w) * t2i


def test_convirt_loss_matches_the_direct_formula():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 3, generator=g, dtype=torch.float64), torch.randn(4, 3, generator=g, dtype=torch.float64)
    for w in (0.5, 0.75):
        assert float(convirt_loss(a, b, 0.1, w)) == pytest.approx(direct_infonce(a, b, 0.1, w), rel=1e-9)
    # asymmetric weights matter (the two directions differ on this batch)
    assert float(convirt_loss(a, b, 0.1, 1.0)) != pytest.approx(float(convirt_loss(a, b, 0.1, 0.0)))


def test_anchor_loss_by_hand():
    zx, zy = torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    sx, sy = torch.tensor([[0.0, 1.0], [0.0, 1.0]]), torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    # pair 0: ||(1,-1)||^2 + 0 = 2 ; pair 1: 0 + ||(1,-1)||^2 = 2 -> mean 2
    assert float(anchor_loss(zx, zy, sx, sy)) == pytest.approx(2.0)
    zx.requires_grad_(True)
    sx.requires_grad_(True)
    anchor_loss(zx, zy, sx, sy).backward()
    assert sx.grad is None  # the anchor is a constant


def test_config_loss_adds_mu_times_the_anchor_and_checks_its_args():
    g = torch.Generator().manual_seed(1)
    a, b, sa, sb = (torch.randn(3, 4, generator=g) for _ in range(4))
    cfg = FedDRAConfig(mu=5.0, tau=0.07)
    total, terms = cfg.loss(a, b, sa, sb)
    assert float(total) == pytest.approx(terms["loss_mi"] + 5.0 * terms["loss_anchor"], rel=1e-5)
    off, terms_off = FedDRAConfig(mu=0.0).loss(a, b, sa, sb)
    assert "loss_anchor" not in terms_off and float(off) == pytest.approx(terms["loss_mi"], rel=1e-6)
    for bad in (dict(mu=-1.0), dict(tau=0.0), dict(image_weight=1.5), dict(mu=float("nan"))):
        with pytest.raises(ValueError, match=f"argument {next(iter(bad))}="):
            FedDRAConfig(**bad)


def test_stage_parameter_sets():
    names = ["image_encoder.blocks.0.w", "text_encoder.layer.0.w", "image_align.w", "text_proj.weight"]
    prefixes = ("image_align.", "text_align.", "image_proj.", "text_proj.")
    assert trainable_names(names, "align", prefixes) == ["image_align.w", "text_proj.weight"]
    assert trainable_names(names, "full_model", prefixes) == names
    with pytest.raises(ValueError):
        trainable_names(names, "stage3", prefixes)
