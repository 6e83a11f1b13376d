"""The masked-image-modelling losses of SSL-FL (Yan et al., IEEE TMI 2023) section III-C, free of any FLARE type.

Losses:

* MAE (SSL-FL (Yan et al., IEEE TMI 2023) eq. 4): ``sum_{i in M} |x_i - x^_i|^2 / |M|``, the mean squared pixel error of
  each patch averaged over the masked patches only (visible patches do not count); with ``norm_pix`` the target
  patch is normalised by its own mean and variance (MAE's ``norm_pix_loss``).
* BEiT (SSL-FL (Yan et al., IEEE TMI 2023) eq. 3): ``-sum_{i in M} log p(z_i | x^M) / |M|``, cross-entropy of the
  visual-token id of each masked patch.

One client's local training loop with these losses (Alg. 1) is :class:`fedssl.train.mim_loop.MIMTrainer`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fedssl.core.patches import normalize_patches


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
