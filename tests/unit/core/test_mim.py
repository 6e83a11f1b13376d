import math

import pytest
import torch

from fedssl.core.masking import block_masks
from fedssl.core.mim import beit_loss, harmonic_inpaint, inpainting_prediction, mae_loss
from fedssl.core.patches import patchify
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


def _ramp(b: int = 2, h: int = 16, w: int = 16) -> torch.Tensor:
    """A different linear image in each channel: the harmonic fill of any hole inside it is the image itself."""
    yy, xx = torch.meshgrid(torch.arange(h).float(), torch.arange(w).float(), indexing="ij")
    return torch.stack([0.3 * yy - 0.2 * xx + 1, 0.1 * xx, -0.05 * yy + 2]).expand(b, 3, h, w).clone()


def test_harmonic_inpainting_rebuilds_a_linear_image_and_keeps_the_visible_pixels():
    img = _ramp()
    mask = torch.zeros(2, 1, 16, 16)
    mask[:, :, 4:12, 2:14] = 1
    out = harmonic_inpaint(img, mask)
    assert torch.allclose(out, img, atol=1e-4)
    noisy = img + torch.randn(img.shape, generator=torch.Generator().manual_seed(0))
    out = harmonic_inpaint(noisy, mask)
    assert torch.equal(out[mask.expand_as(out) == 0], noisy[mask.expand_as(noisy) == 0])


def test_a_hole_at_the_border_sees_the_border_replicated():
    """An image that changes down the rows only, with a hole reaching the left and right borders: with the border
    replicated the fill is the image itself (zero padding would pull the hole's ends towards 0)."""
    yy = torch.arange(8).float().view(1, 1, 8, 1).expand(1, 1, 8, 8) + 5.0
    mask = torch.zeros(1, 1, 8, 8)
    mask[:, :, 2:6, :] = 1
    assert torch.allclose(harmonic_inpaint(yy, mask), yy, atol=1e-4)


def test_one_hidden_pixel_becomes_the_mean_of_its_four_neighbours():
    img = torch.zeros(1, 1, 3, 3)
    img[0, 0, 0, 1], img[0, 0, 1, 0], img[0, 0, 1, 2], img[0, 0, 2, 1] = 1.0, 2.0, 3.0, 6.0
    img[0, 0, 1, 1] = 100.0  # hidden: its value must not matter
    mask = torch.zeros(1, 1, 3, 3)
    mask[0, 0, 1, 1] = 1
    assert harmonic_inpaint(img, mask)[0, 0, 1, 1].item() == pytest.approx(3.0, abs=1e-4)  # (1 + 2 + 3 + 6) / 4


def test_inpainting_needs_a_visible_pixel_and_matching_shapes():
    with pytest.raises(ValueError, match="no visible pixel"):
        harmonic_inpaint(torch.rand(1, 3, 4, 4), torch.ones(1, 1, 4, 4))
    with pytest.raises(ValueError, match="mask"):
        harmonic_inpaint(torch.rand(1, 3, 4, 4), torch.ones(1, 3, 4, 4))


def test_inpainting_prediction_hides_the_masked_patches_in_row_major_order():
    """16 x 16 image, 4 px patches (a 4 x 4 grid): patch 6 is row 1, column 2.  Hiding it in a linear image, the
    prediction is exact (loss 0, with and without norm_pix); a bump of 1 inside it is lost (loss 3/48: 3 of its 48
    values off by 1), and the same bump in patch 9 (row 2, column 1) is not masked there, so the loss is 0 again."""
    img = _ramp(b=1)
    mask = torch.zeros(1, 16, dtype=torch.bool)
    mask[0, 6] = True
    pred = inpainting_prediction(img, mask, 4)
    assert pred.shape == (1, 16, 48)
    assert mae_loss(pred, patchify(img, 4), mask).item() == pytest.approx(0.0, abs=1e-8)
    assert mae_loss(inpainting_prediction(img, mask, 4, norm_pix=True), patchify(img, 4), mask,
                    norm_pix=True).item() == pytest.approx(0.0, abs=1e-6)
    bumped = img.clone()
    bumped[0, :, 5, 9] += 1.0  # pixel (5, 9) lies in patch (1, 2) = 6
    # the hole's fill depends on its visible ring only, so it is the linear image's: the error is the bump, in 3 of
    # the patch's 48 values
    assert mae_loss(inpainting_prediction(bumped, mask, 4), patchify(bumped, 4), mask).item() == pytest.approx(
        3 / 48, abs=1e-6)
    other = img.clone()
    other[0, :, 9, 5] += 1.0  # patch (2, 1) = 9, visible
    assert mae_loss(inpainting_prediction(other, mask, 4), patchify(other, 4), mask).item() == pytest.approx(
        0.0, abs=1e-8)
