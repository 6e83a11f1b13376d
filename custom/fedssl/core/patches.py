"""Images <-> per-patch pixel vectors, shared by the MAE target (SSL-FL (Yan et al., IEEE TMI 2023) eq. 4) and the patch
tokenizer.

The vector of one patch is ordered (row p, column q, channel c), as in MAE's ``patchify``
(``nchpwq -> nhwpqc``), so a prediction ``[B, L, p*p*C]`` unpatchifies back into the image.
"""

from __future__ import annotations

import torch


def patchify(imgs: torch.Tensor, patch_size: int) -> torch.Tensor:
    """``[B, C, H, W]`` -> ``[B, L, p*p*C]`` with ``L = (H/p)(W/p)`` in row-major patch order."""
    if imgs.dim() != 4:
        raise ValueError(f"patchify expects images [B, C, H, W], got shape {tuple(imgs.shape)}")
    b, c, h, w = imgs.shape
    p = int(patch_size)
    if p <= 0 or h % p or w % p:
        raise ValueError(
            f"image size {h}x{w} is not divisible by patch size {p}; resize the images to a multiple of {p}"
        )
    gh, gw = h // p, w // p
    x = imgs.reshape(b, c, gh, p, gw, p)
    x = torch.einsum("nchpwq->nhwpqc", x)
    return x.reshape(b, gh * gw, p * p * c)


def unpatchify(x: torch.Tensor, patch_size: int, grid_h: int, grid_w: int, channels: int = 3) -> torch.Tensor:
    """Inverse of :func:`patchify`: ``[B, L, p*p*C]`` -> ``[B, C, H, W]``."""
    b, n, d = x.shape
    p = int(patch_size)
    if n != grid_h * grid_w or d != p * p * channels:
        raise ValueError(f"unpatchify: got [B, {n}, {d}], expected [B, {grid_h * grid_w}, {p * p * channels}]")
    x = x.reshape(b, grid_h, grid_w, p, p, channels)
    x = torch.einsum("nhwpqc->nchpwq", x)
    return x.reshape(b, channels, grid_h * p, grid_w * p)


def normalize_patches(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Per-patch normalisation over the last dimension, ``(x - mean) / sqrt(var + eps)`` (MAE's norm_pix_loss
    target; unbiased variance as in MAE).  A flat patch maps to the zero vector."""
    mean = x.mean(dim=-1, keepdim=True)
    var = x.var(dim=-1, keepdim=True)
    return (x - mean) / (var + eps) ** 0.5
