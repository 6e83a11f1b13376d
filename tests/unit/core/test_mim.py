import math

import pytest
import torch

from fedssl.core.masking import block_masks
from fedssl.core.mim import beit_loss, mae_loss
from fedssl.models import build_model


def test_mae_loss_hand_computed_on_two_patches():
    pred = torch.tensor([[[1.0, 3.0], [2.0, 2.0]]])  # [B=1, L=2, D=2]
    target = torch.zeros(1, 2, 2)
    mask = torch.tensor([[True, False]])  # patch 0 masked, patch 1 visible
    assert mae_loss(pred, target, mask).item() == pytest.approx((1 + 9) / 2)  # mean over pixels of patch 0 only
    both = torch.tensor([[True, True]])
    assert mae_loss(pred, target, both).item() == pytest.approx(((1 + 9) / 2 + (4 + 4) / 2) / 2)
    # norm_pix: target patch (1, 3) -> (1 - 2, 3 - 2) / sqrt(var 2) = (-0.7071, 0.7071); prediction 0 -> loss 0.5
    assert mae_loss(torch.zeros(1, 2, 2), pred, mask, norm_pix=True).item() == pytest.approx(0.5, rel=1e-5)


def test_mae_loss_ignores_visible_patches():
    g = torch.Generator().manual_seed(0)
    pred, target = torch.randn(4, 16, 12, generator=g), torch.randn(4, 16, 12, generator=g)
    mask = torch.rand(4, 16, generator=g) > 0.5
    base = mae_loss(pred, target, mask)
    perturbed = pred.clone()
    perturbed[~mask] += 100.0
    assert torch.equal(mae_loss(perturbed, target, mask), base)
    perturbed = pred.clone()
    perturbed[mask] += 0.1
    assert not torch.allclose(mae_loss(perturbed, target, mask), base)
    with pytest.raises(ValueError, match="no masked"):
        mae_loss(pred, target, torch.zeros(4, 16, dtype=torch.bool))


def test_mae_model_prediction_at_visible_patches_does_not_matter():
    model = build_model("tiny_vit_mae")
    imgs = torch.randn(2, 3, 32, 32)
    loss, pred, mask = model(imgs, 0.75, generator=torch.Generator().manual_seed(0))
    pred = pred.detach().clone()
    pred.requires_grad_(True)
    from fedssl.core.patches import patchify

    mae_loss(pred, patchify(imgs, 4), mask).backward()
    assert pred.grad[~mask].abs().sum() == 0 and pred.grad[mask].abs().sum() > 0
    assert loss.item() == pytest.approx(mae_loss(pred.detach(), patchify(imgs, 4), mask).item())


def test_beit_loss_only_at_masked_positions():
    mask = torch.tensor([[True, False, True], [False, False, True]])
    ids = torch.tensor([[1, 0, 2], [3, 3, 0]])
    logits = torch.zeros(3, 4)  # uniform over 4 tokens -> log 4
    assert beit_loss(logits, ids, mask).item() == pytest.approx(math.log(4))
    logits = torch.tensor([[0.0, 5.0, 0.0, 0.0], [0.0, 0.0, 5.0, 0.0], [5.0, 0.0, 0.0, 0.0]])  # right at every masked
    low = beit_loss(logits, ids, mask)
    changed = ids.clone()
    changed[~mask] = torch.tensor([2, 1, 1])  # tokens of visible patches do not count
    assert torch.equal(beit_loss(logits, changed, mask), low)
    changed = ids.clone()
    changed[0, 0] = 3
    assert beit_loss(logits, changed, mask) > low
    with pytest.raises(ValueError, match="logit rows"):
        beit_loss(torch.zeros(2, 4), ids, mask)


def test_block_masks_feed_the_beit_model():
    model = build_model("tiny_vit_beit", vocab_size=16)
    masks = block_masks(3, 8, 8, 0.4, generator=torch.Generator().manual_seed(0))
    assert model(torch.randn(3, 3, 32, 32), masks).shape == (int(masks.sum()), 16)
