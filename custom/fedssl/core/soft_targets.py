"""Soft classification targets: label smoothing, the mixed targets of mixup / CutMix, and the cross-entropy against a
soft target (pure torch).

SSL-FL's fine-tuning (rui-yan/SSL-FL ``code/util/FedAvg_utils.py`` 214-232, timm 0.3.2's ``Mixup`` and losses):

- with mixup or CutMix on, the batch's targets are ``lam * t(y) + (1 - lam) * t(y reversed)`` where ``t`` is the
  label-smoothed one-hot code (:func:`smoothed_one_hot`: ``1 - s + s / K`` on the true class, ``s / K`` on each of
  the others) and the batch is mixed with itself reversed (``x.flip(0)``); the loss is
  :func:`soft_target_cross_entropy`;
- without them, the loss is cross-entropy with label smoothing ``s`` (timm's ``LabelSmoothingCrossEntropy``, equal to
  :func:`soft_target_cross_entropy` of :func:`smoothed_one_hot`; the trainer keeps ``F.cross_entropy(...,
  label_smoothing=s)`` there);
- evaluation is plain cross-entropy on unmixed images.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


def _check_labels(labels: torch.Tensor, num_classes: int, smoothing: float) -> None:
    if labels.dim() != 1:
        raise ValueError(f"labels must be a [B] tensor of class indices, got shape {tuple(labels.shape)}")
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ValueError(f"num_classes={num_classes!r}: use the number of classes (>= 1)")
    if not 0 <= smoothing < 1:
        raise ValueError(f"smoothing={smoothing!r}: use a value in [0, 1)")
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        raise ValueError(f"labels must lie in 0..{num_classes - 1}, got {sorted(set(labels.tolist()))[:10]}")


def smoothed_one_hot(labels: torch.Tensor, num_classes: int, smoothing: float = 0.0) -> torch.Tensor:
    """float32 ``[B, K]``: ``1 - smoothing + smoothing / K`` at each label, ``smoothing / K`` elsewhere (rows sum to
    1; ``smoothing`` 0 is the plain one-hot code)."""
    _check_labels(labels, num_classes, smoothing)
    off = smoothing / num_classes
    on = 1.0 - smoothing + off
    out = torch.full((labels.shape[0], num_classes), off, dtype=torch.float32, device=labels.device)
    return out.scatter_(1, labels.long().view(-1, 1), on)


def mixed_targets(labels: torch.Tensor, num_classes: int, lam: float, smoothing: float = 0.0) -> torch.Tensor:
    """The targets of a batch mixed with itself reversed at weight ``lam``: ``lam * t(y) + (1 - lam) * t(y.flip(0))``
    with ``t`` = :func:`smoothed_one_hot` (``lam`` 1 = the batch's own smoothed targets)."""
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam={lam!r}: a mixing weight lies in [0, 1]")
    own = smoothed_one_hot(labels, num_classes, smoothing)
    return own * lam + own.flip(0) * (1.0 - lam)


def soft_target_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean over the batch of ``sum_k -targets[k] * log_softmax(logits)[k]`` (timm's ``SoftTargetCrossEntropy``)."""
    if logits.shape != targets.shape or logits.dim() != 2:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} must both be [B, K]")
    return torch.sum(-targets * F.log_softmax(logits, dim=-1), dim=-1).mean()
