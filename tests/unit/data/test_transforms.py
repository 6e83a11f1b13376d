"""Tests for fedssl.data.transforms (batched, generator-driven 2D augmentations)."""

from __future__ import annotations

import pytest
import torch

from fedssl.data.transforms import augment_rotation_view, augment_segmentation, augment_views


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _asymmetric_batch(n: int = 16, h: int = 32, w: int = 40) -> torch.Tensor:
    """Images with a bright block in the top-left quadrant and a bright bar on the right edge."""
    x = torch.zeros(n, 1, h, w)
    x[:, :, 4:14, 5:17] = 1.0
    x[:, :, 20:28, 30:36] = 1.0
    return x


def test_augment_views_shape_range_dtype() -> None:
    x = torch.rand(8, 1, 24, 36)
    out = augment_views(x, _gen())
    assert out.shape == x.shape
    assert out.dtype == x.dtype
    assert float(out.min()) >= 0.0 and float(out.max()) <= 1.0
    assert torch.isfinite(out).all()
    assert not torch.equal(out, x)


def test_augment_views_deterministic_and_seed_dependent() -> None:
    x = torch.rand(6, 1, 20, 20)
    a = augment_views(x, _gen(3))
    b = augment_views(x, _gen(3))
    c = augment_views(x, _gen(4))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_augment_views_samples_independent() -> None:
    # The same image repeated must get different augmentations per sample.
    x = torch.rand(1, 1, 24, 24).repeat(6, 1, 1, 1)
    out = augment_views(x, _gen(0))
    diffs = [float((out[0] - out[i]).abs().max()) for i in range(1, 6)]
    assert max(diffs) > 1e-3


def test_augment_views_consumes_generator() -> None:
    g = _gen(0)
    x = torch.rand(4, 1, 16, 16)
    a = augment_views(x, g)
    b = augment_views(x, g)  # advanced generator -> different views
    assert not torch.equal(a, b)


def _top_brighter(out: torch.Tensor) -> torch.Tensor:
    h = out.shape[-2] // 2
    return out[:, 0, :h].mean(dim=(1, 2)) > out[:, 0, h:].mean(dim=(1, 2))


def test_rotation_views_never_flip_vertically_and_keep_the_other_draws() -> None:
    """FedRotation's augmentation: no vertical flip (with the horizontal one it would be a 180 degree rotation), so
    a slice bright on top stays bright on top in every view, where augment_views turns some upside down; crop,
    horizontal flip and jitter are the same draws (a left-right symmetric image: the same views where
    augment_views did not flip vertically)."""
    x = torch.zeros(64, 1, 32, 32)
    x[:, :, :16] = 1.0
    x[:, :, :8, :] = 0.5  # not symmetric top-bottom, symmetric left-right
    rotation, views = augment_rotation_view(x, _gen(5)), augment_views(x, _gen(5))
    assert bool(_top_brighter(rotation).all())
    upright = _top_brighter(views)
    assert 0 < int(upright.sum()) < 64  # augment_views flips some
    assert torch.allclose(rotation[upright], views[upright], atol=1e-6)


def test_augment_views_rejects_bad_shape() -> None:
    with pytest.raises(ValueError):
        augment_views(torch.rand(4, 16, 16), _gen())
    with pytest.raises(ValueError):
        augment_views(torch.rand(4, 3, 16, 16), _gen())


def test_augment_segmentation_shapes_labels_and_range() -> None:
    torch.manual_seed(0)
    x = torch.rand(8, 1, 32, 32)
    y = torch.randint(0, 4, (8, 32, 32))
    xa, ya = augment_segmentation(x, y, _gen(1))
    assert xa.shape == x.shape and ya.shape == y.shape
    assert ya.dtype == torch.long
    assert set(torch.unique(ya).tolist()) <= {0, 1, 2, 3}
    assert float(xa.min()) >= 0.0 and float(xa.max()) <= 1.0


def test_augment_segmentation_deterministic() -> None:
    x = torch.rand(5, 1, 28, 28)
    y = torch.randint(0, 4, (5, 28, 28))
    a = augment_segmentation(x, y, _gen(7))
    b = augment_segmentation(x, y, _gen(7))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_augment_segmentation_same_geometry_for_image_and_label() -> None:
    # Asymmetric image; label = (image > 0.5). After augmentation the label must still mark the
    # bright pixels of the augmented image (a flip applied to only one of them would break this).
    x = _asymmetric_batch(32)
    y = (x[:, 0] > 0.5).long()
    xa, ya = augment_segmentation(x, y, _gen(11))
    for i in range(x.shape[0]):
        fg, bg = xa[i, 0][ya[i] == 1], xa[i, 0][ya[i] == 0]
        assert fg.numel() > 0 and bg.numel() > 0
        # Jitter maps 0 -> b and 1 -> c + b (c >= 0.8), so foreground is clearly brighter on average.
        assert float(fg.mean()) - float(bg.mean()) > 0.5
        # Threshold the augmented image halfway between the two levels: agrees with the label
        # everywhere except a thin interpolation boundary.
        thr = 0.5 * (float(fg.mean()) + float(bg.mean()))
        agree = ((xa[i, 0] > thr).long() == ya[i]).float().mean()
        assert float(agree) > 0.95


def test_augment_segmentation_flips_happen() -> None:
    # Over a batch of identical asymmetric images, the augmented labels must not all look alike:
    # some samples land the top-left block on the left, some on the right.
    x = _asymmetric_batch(32)
    y = (x[:, 0] > 0.5).long()
    _, ya = augment_segmentation(x, y, _gen(5))
    w = ya.shape[-1]
    left_heavy = (ya[:, :, : w // 2].sum(dim=(1, 2)) > ya[:, :, w // 2 :].sum(dim=(1, 2))).tolist()
    assert any(left_heavy) and not all(left_heavy)


def test_augment_segmentation_rejects_mismatched_label() -> None:
    with pytest.raises(ValueError):
        augment_segmentation(torch.rand(2, 1, 8, 8), torch.zeros(2, 8, 9, dtype=torch.long), _gen())
    with pytest.raises(TypeError):
        augment_segmentation(torch.rand(2, 1, 8, 8), torch.zeros(2, 8, 8), _gen())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu() -> None:
    x = torch.rand(4, 1, 16, 16)
    y = torch.randint(0, 4, (4, 16, 16))
    cpu = augment_views(x, _gen(2))
    gpu = augment_views(x.cuda(), _gen(2))
    assert gpu.device.type == "cuda"
    assert torch.allclose(cpu, gpu.cpu(), atol=1e-4)
    xs, ys = augment_segmentation(x.cuda(), y.cuda(), _gen(2))
    assert xs.device.type == "cuda" and ys.device.type == "cuda"
