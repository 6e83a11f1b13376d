"""The masked-image-modelling losses of SSL-FL (Yan et al., IEEE TMI 2023) section III-C, free of any FLARE type.

Losses:

* MAE (SSL-FL (Yan et al., IEEE TMI 2023) eq. 4): ``sum_{i in M} |x_i - x^_i|^2 / |M|``, the mean squared pixel error of
  each patch averaged over the masked patches only (visible patches do not count); with ``norm_pix`` the target
  patch is normalised by its own mean and variance (MAE's ``norm_pix_loss``).
* BEiT (SSL-FL (Yan et al., IEEE TMI 2023) eq. 3): ``-sum_{i in M} log p(z_i | x^M) / |M|``, cross-entropy of the
  visual-token id of each masked patch.

One client's local training loop with these losses (Alg. 1) is :class:`fedssl.train.mim_loop.MIMTrainer`.

A reference without learning for the MAE loss: :func:`inpainting_prediction` fills every masked patch from the
visible pixels around it by harmonic inpainting (each masked pixel the mean of its four neighbours, solved by
iteration), which reproduces any image that is linear across the masked region.  Its loss is what a MAE reaches
by interpolating its neighbours alone; only what a MAE gains below it can be knowledge of the images' content.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fedssl.core.patches import normalize_patches, patchify


def mae_loss(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, norm_pix: bool = False) -> torch.Tensor:
    """``pred``, ``target`` ``[B, L, p*p*C]`` (patchified pixels), ``mask [B, L]`` (True/1 = masked) -> scalar."""
    if pred.shape != target.shape or tuple(mask.shape) != tuple(pred.shape[:2]):
        raise ValueError(f"mae_loss: pred {tuple(pred.shape)}, target {tuple(target.shape)}, mask {tuple(mask.shape)}")
    target = target.float()
    if norm_pix:
        target = normalize_patches(target)
    per_patch = ((pred.float() - target) ** 2).mean(dim=-1)  # [B, L]
    m = mask.to(per_patch.dtype)
    n = m.sum()
    if n == 0:
        raise ValueError("mae_loss: no masked patch; the loss is defined on masked patches only")
    return (per_patch * m).sum() / n


def beit_loss(logits: torch.Tensor, token_ids: torch.Tensor, bool_masked_pos: torch.Tensor) -> torch.Tensor:
    """``logits [M, V]`` for the masked positions of ``bool_masked_pos [B, L]`` (row-major order),
    ``token_ids [B, L]`` -> mean cross-entropy over the masked positions."""
    mask = bool_masked_pos.to(torch.bool)
    targets = token_ids.to(logits.device)[mask.to(logits.device)]
    if logits.dim() != 2 or logits.shape[0] != targets.shape[0]:
        raise ValueError(f"beit_loss: {logits.shape[0]} logit rows for {targets.shape[0]} masked positions")
    if targets.numel() == 0:
        raise ValueError("beit_loss: no masked position")
    return F.cross_entropy(logits.float(), targets)


def harmonic_inpaint(imgs: torch.Tensor, pixel_mask: torch.Tensor, tol: float = 1e-5,
                     max_iters: int = 20_000) -> torch.Tensor:
    """``imgs [B, C, H, W]`` with the pixels where ``pixel_mask [B, 1, H, W]`` is 1 replaced by the harmonic fill of
    the others: each masked pixel the mean of its four neighbours (the image border replicated), solved by red-black
    successive over-relaxation (omega = 2 / (1 + sin(pi / max(H, W)))) from each image's and channel's visible
    mean, until no pixel moves by more than ``tol`` in a sweep (at most ``max_iters`` sweeps).  Visible pixels are
    returned unchanged.  An image with no visible pixel: ValueError."""
    if imgs.dim() != 4 or pixel_mask.shape != (imgs.shape[0], 1, *imgs.shape[2:]):
        raise ValueError(f"harmonic_inpaint: images {tuple(imgs.shape)} and mask {tuple(pixel_mask.shape)}; "
                         "use images [B, C, H, W] and a mask [B, 1, H, W]")
    x0 = imgs.float()
    masked = pixel_mask.to(x0.dtype)
    visible = 1.0 - masked
    seen = visible.sum(dim=(2, 3), keepdim=True)
    if bool((seen == 0).any()):
        raise ValueError("harmonic_inpaint: an image has no visible pixel to fill from")
    h, w = x0.shape[2:]
    omega = 2.0 / (1.0 + math.sin(math.pi / max(h, w, 2)))
    parity = (torch.arange(h).view(-1, 1) + torch.arange(w).view(1, -1)) % 2
    colours = [masked * (parity == c).to(x0.dtype) for c in (0, 1)]
    x = x0 * visible + masked * (x0 * visible).sum(dim=(2, 3), keepdim=True) / seen
    for _ in range(int(max_iters)):
        moved = 0.0
        for colour in colours:
            xp = F.pad(x, (1, 1, 1, 1), mode="replicate")
            mean = (xp[:, :, :-2, 1:-1] + xp[:, :, 2:, 1:-1] + xp[:, :, 1:-1, :-2] + xp[:, :, 1:-1, 2:]) / 4
            step = omega * (mean - x) * colour
            x = x + step
            moved = max(moved, float(step.abs().max()))
        if moved <= tol:
            break
    return x * masked + x0 * visible


def inpainting_prediction(imgs: torch.Tensor, mask: torch.Tensor, patch_size: int,
                          norm_pix: bool = False) -> torch.Tensor:
    """The harmonic inpainting of ``imgs [B, C, H, W]`` with the patches where ``mask [B, L]`` is True hidden
    (:func:`harmonic_inpaint`), patchified ``[B, L, p*p*C]`` like MAE's prediction; with ``norm_pix`` each patch
    normalised as MAE's target is (its own mean and variance), so :func:`mae_loss` compares like with like."""
    b, _, h, w = imgs.shape
    p = int(patch_size)
    grid = mask.to(torch.float32).reshape(b, 1, h // p, w // p)
    pixel_mask = grid.repeat_interleave(p, dim=2).repeat_interleave(p, dim=3)
    pred = patchify(harmonic_inpaint(imgs, pixel_mask), p)
    return normalize_patches(pred) if norm_pix else pred
