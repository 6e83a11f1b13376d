"""Batched, generator-driven 2D augmentations for FCL (FCL (Wu et al., MedIA 2022)).

Two entry points:

* :func:`augment_views` - contrastive view augmentation (random resized crop, flips,
  brightness/contrast jitter) used to make the query / key views of a slice during pre-training;
  :func:`augment_rotation_view` is the same without the vertical flip, for rotation prediction (FedRotation).
* :func:`augment_segmentation` - joint image/label augmentation (flips, rotation +-15 deg,
  scaling 0.9-1.1, image-only brightness/contrast jitter) used during fine-tuning.

Both work on whole batches at once: every geometric transform of the batch is folded into one
``[N, 2, 3]`` affine matrix and applied with a single :func:`torch.nn.functional.grid_sample`
call. All random numbers are drawn from the caller's :class:`torch.Generator` (on the generator's
device, normally the CPU) and then moved to the tensor's device, so the same generator state gives
the same output on CPU and CUDA, and runs are reproducible.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["augment_views", "augment_rotation_view", "augment_segmentation"]

# Parameter ranges (kept as module constants so callers / tests can refer to them).
VIEW_CROP_SCALE: tuple[float, float] = (0.7, 1.0)
VIEW_CROP_RATIO: tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0)
BRIGHTNESS: float = 0.2
CONTRAST: tuple[float, float] = (0.8, 1.2)
SEG_MAX_ROTATION_DEG: float = 15.0
SEG_SCALE: tuple[float, float] = (0.9, 1.1)


def _check_image_batch(x: torch.Tensor, name: str = "x") -> None:
    if x.dim() != 4 or x.shape[1] != 1:
        raise ValueError(f"{name} must be a [N, 1, H, W] tensor, got shape {tuple(x.shape)}")
    if not torch.is_floating_point(x):
        raise TypeError(f"{name} must be a floating point tensor, got dtype {x.dtype}")


def _uniform(n: int, low: float, high: float, generator: torch.Generator) -> torch.Tensor:
    """``n`` float64 samples from U(low, high) drawn on the generator's device."""
    u = torch.rand(n, generator=generator, dtype=torch.float64, device=generator.device)
    return low + (high - low) * u


def _flip_signs(n: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` values in {-1, +1} (each with probability 1/2) drawn on the generator's device."""
    u = torch.rand(n, generator=generator, dtype=torch.float64, device=generator.device)
    return torch.where(u < 0.5, -1.0, 1.0).to(torch.float64)


def _jitter(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Per-sample contrast (x0.8-1.2 around the sample mean) and brightness (+-0.2), clamped to [0, 1]."""
    n = x.shape[0]
    contrast = _uniform(n, CONTRAST[0], CONTRAST[1], generator)
    brightness = _uniform(n, -BRIGHTNESS, BRIGHTNESS, generator)
    contrast = contrast.to(device=x.device, dtype=x.dtype).view(n, 1, 1, 1)
    brightness = brightness.to(device=x.device, dtype=x.dtype).view(n, 1, 1, 1)
    mean = x.mean(dim=(1, 2, 3), keepdim=True)
    return ((x - mean) * contrast + mean + brightness).clamp_(0.0, 1.0)


def augment_views(x: torch.Tensor, generator: torch.Generator, *, vertical_flip: bool = True) -> torch.Tensor:
    """Contrastive view augmentation of a batch of single-channel images.

    Each sample independently gets:

    1. a random resized crop covering 70-100 % of the image area (aspect ratio in [3/4, 4/3],
       random position fully inside the image), resampled bilinearly back to ``H x W``;
    2. a random horizontal flip and (``vertical_flip``) a random vertical flip (p = 0.5 each; without it the
       vertical flip's draw is still made, so the other draws stay the same);
    3. contrast jitter x0.8-1.2 around the sample mean and brightness jitter +-0.2;
    4. clamping to [0, 1].

    Crop and flips are one affine map per sample, applied with a single ``grid_sample`` call.

    Args:
        x: float tensor ``[N, 1, H, W]`` with values in [0, 1] (CPU or CUDA).
        generator: the :class:`torch.Generator` (normally a CPU generator) that drives every
            random choice; the same generator state gives the same output.
        vertical_flip: false = no vertical flip (:func:`augment_rotation_view`).

    Returns:
        float tensor ``[N, 1, H, W]`` in [0, 1] on ``x.device`` with ``x.dtype``.
    """
    _check_image_batch(x)
    n, _, h, w = x.shape
    if n == 0:
        return x.clone()

    scale = _uniform(n, VIEW_CROP_SCALE[0], VIEW_CROP_SCALE[1], generator)
    log_ratio = _uniform(n, math.log(VIEW_CROP_RATIO[0]), math.log(VIEW_CROP_RATIO[1]), generator)
    ratio = torch.exp(log_ratio)
    # Crop size as fractions of the full width / height (normalised half-extent of the crop).
    frac_w = torch.sqrt(scale * ratio).clamp(max=1.0)
    frac_h = torch.sqrt(scale / ratio).clamp(max=1.0)
    # Crop centre in normalised coordinates, keeping the crop inside the image.
    cx = _uniform(n, -1.0, 1.0, generator) * (1.0 - frac_w)
    cy = _uniform(n, -1.0, 1.0, generator) * (1.0 - frac_h)
    flip_x = _flip_signs(n, generator)
    flip_y = _flip_signs(n, generator)
    if not vertical_flip:
        flip_y = torch.ones_like(flip_y)

    theta = torch.zeros(n, 2, 3, dtype=torch.float64, device=generator.device)
    theta[:, 0, 0] = frac_w * flip_x
    theta[:, 0, 2] = cx
    theta[:, 1, 1] = frac_h * flip_y
    theta[:, 1, 2] = cy
    theta = theta.to(device=x.device, dtype=x.dtype)

    grid = F.affine_grid(theta, [n, 1, h, w], align_corners=False)
    out = F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)
    return _jitter(out, generator)


def augment_rotation_view(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """:func:`augment_views` without the vertical flip: the augmentation of rotation prediction (FedRotation).

    A horizontal and a vertical flip together are a 180 degree rotation, so with both flips in the augmentation
    an image rotated by r and the flipped image rotated by r + 180 degrees are the same picture under two labels:
    rotations 0 / 180 and 90 / 270 could not be told apart.  With the horizontal flip alone every (flip, rotation)
    pair gives another picture, as in RotNet's own training (Gidaris et al. 2018; gidariss/FeatureLearningRotNet
    ``dataloader.py``: random crop and ``RandomHorizontalFlip`` only)."""
    return augment_views(x, generator, vertical_flip=False)


def augment_segmentation(
    x: torch.Tensor, y: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Joint image/label augmentation for segmentation fine-tuning.

    Each sample independently gets a random horizontal flip, a random vertical flip (p = 0.5
    each), a rotation drawn from U(-15, 15) degrees and an isotropic scaling drawn from
    U(0.9, 1.1) about the image centre. The same geometric transform is applied to the image
    (bilinear) and to the label map (nearest neighbour, so labels stay in their original integer
    set; pixels brought in from outside the image become 0 = background in the label and 0 in the
    image). The image then gets contrast (x0.8-1.2 around its mean) and brightness (+-0.2) jitter
    and is clamped to [0, 1]; the label is untouched by the jitter.

    Args:
        x: float tensor ``[N, 1, H, W]`` in [0, 1].
        y: integer label tensor ``[N, H, W]`` (e.g. ACDC 0 bg, 1 RV, 2 MYO, 3 LV).
        generator: the :class:`torch.Generator` driving every random choice.

    Returns:
        ``(x_aug, y_aug)``: float ``[N, 1, H, W]`` in [0, 1] and long ``[N, H, W]``, on the
        input devices.
    """
    _check_image_batch(x)
    if y.dim() != 3 or y.shape[0] != x.shape[0] or tuple(y.shape[1:]) != tuple(x.shape[2:]):
        raise ValueError(
            f"y must be a [N, H, W] label tensor matching x {tuple(x.shape)}, got shape {tuple(y.shape)}"
        )
    if torch.is_floating_point(y) or torch.is_complex(y):
        raise TypeError(f"y must hold integer labels, got dtype {y.dtype}")
    n, _, h, w = x.shape
    if n == 0:
        return x.clone(), y.long().clone()

    flip_x = _flip_signs(n, generator)
    flip_y = _flip_signs(n, generator)
    angle = _uniform(n, -SEG_MAX_ROTATION_DEG, SEG_MAX_ROTATION_DEG, generator) * (math.pi / 180.0)
    scale = _uniform(n, SEG_SCALE[0], SEG_SCALE[1], generator)

    # Sampling map in pixel units (output pixel -> input pixel, about the centre):
    #   M = (1 / scale) * R(angle) @ diag(flip_x, flip_y)
    # Converted to grid_sample's normalised coordinates with D = diag(W/2, H/2):
    #   theta = D^-1 @ M @ D, which keeps the rotation rigid on non-square images.
    cos, sin = torch.cos(angle), torch.sin(angle)
    inv = 1.0 / scale
    m00, m01 = inv * cos * flip_x, -inv * sin * flip_y
    m10, m11 = inv * sin * flip_x, inv * cos * flip_y
    theta = torch.zeros(n, 2, 3, dtype=torch.float64, device=generator.device)
    theta[:, 0, 0] = m00
    theta[:, 0, 1] = m01 * (h / w)
    theta[:, 1, 0] = m10 * (w / h)
    theta[:, 1, 1] = m11
    theta = theta.to(device=x.device, dtype=x.dtype)

    grid = F.affine_grid(theta, [n, 1, h, w], align_corners=False)
    x_out = F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    y_in = y.to(device=x.device, dtype=x.dtype).unsqueeze(1)
    y_out = F.grid_sample(y_in, grid, mode="nearest", padding_mode="zeros", align_corners=False)
    y_out = y_out.squeeze(1).round().to(device=y.device, dtype=torch.long)
    return _jitter(x_out, generator), y_out
