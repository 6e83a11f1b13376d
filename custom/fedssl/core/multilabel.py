"""Multi-label BCE over a head whose columns are bound to class names (surgical aggregation (Kulkarni et al., ML4H
2024), sec. 2.3).

A site's targets cover its own classes ``C_k`` (in its declared order); the head may cover the union ``C``
(vanilla FL, FL with partial loss) or exactly ``C_k`` (surgical aggregation, personalised heads):

- vanilla FL: classes the site lacks are treated as negatives (target 0, counted in the loss);
- partial loss (eq. 4): classes the site lacks are dropped from the loss (mask 0);
- surgical / personalised / individual: the head is ``C_k`` itself; targets map one to one;
- centralised (pooled data of every site, head over ``C``): each image's classes that its source does not
  label are NaN (:func:`pool_targets`) and masked out of the loss (:func:`labelled`), as partial loss does.

Pure torch; no FLARE.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

MISSING_CLASS_RULES = ("negative", "ignore")


def column_index(local_classes: Sequence[str], head_classes: Sequence[str], site: str = "?") -> list[int]:
    """Head column of each local class (by name); a local class missing from the head is an error naming the site."""
    pos = {c: i for i, c in enumerate(head_classes)}
    missing = [c for c in local_classes if c not in pos]
    if missing:
        raise ValueError(f"{site}: classes {missing} are not columns of the model head ({list(head_classes)})")
    return [pos[c] for c in local_classes]


def expand_targets(
    targets: torch.Tensor, local_classes: Sequence[str], head_classes: Sequence[str], missing: str = "negative",
    site: str = "?",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local targets [B, |C_k|] -> (targets [B, |C|], mask [B, |C|]) over the head's classes.

    ``missing="negative"``: non-local columns get target 0 and mask 1 (vanilla FL);
    ``missing="ignore"``: they get mask 0 (partial loss).
    """
    if missing not in MISSING_CLASS_RULES:
        raise ValueError(f"missing={missing!r}: use one of {list(MISSING_CLASS_RULES)}")
    if targets.ndim != 2 or targets.shape[1] != len(local_classes):
        raise ValueError(f"{site}: targets of shape {tuple(targets.shape)} do not match {len(local_classes)} local "
                         "classes")
    idx = torch.as_tensor(column_index(local_classes, head_classes, site), dtype=torch.long, device=targets.device)
    full = torch.zeros(targets.shape[0], len(head_classes), dtype=targets.dtype, device=targets.device)
    full[:, idx] = targets
    if missing == "negative":
        mask = torch.ones_like(full)
    else:
        mask = torch.zeros_like(full)
        mask[:, idx] = 1.0
    return full, mask


def masked_bce(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean binary cross-entropy with logits over the unmasked entries (all entries when ``mask`` is None).

    With a mask this is eq. 4 of the paper: only the site's classes contribute; the mean is over the
    counted (sample, class) pairs.
    """
    if logits.shape != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} differ in shape")
    loss = F.binary_cross_entropy_with_logits(logits, targets, reduction="none")
    if mask is None:
        return loss.mean()
    if mask.shape != loss.shape:
        raise ValueError(f"mask {tuple(mask.shape)} does not match logits {tuple(logits.shape)}")
    n = mask.sum()
    if n <= 0:
        raise ValueError("the mask drops every entry: no class of the site is a column of the head")
    return (loss * mask).sum() / n


def pool_targets(targets: torch.Tensor, local_classes: Sequence[str], head_classes: Sequence[str],
                 site: str = "?") -> torch.Tensor:
    """Local targets [B, |C_k|] -> [B, |C|] over the head's classes with NaN ("not labelled") in every column of a
    class the site does not annotate: pooled (centralised) training data, where a source's missing classes are
    unknown rather than negative (masked out of the loss by :func:`labelled`, as partial loss does)."""
    full, mask = expand_targets(targets, local_classes, head_classes, missing="ignore", site=site)
    return full.masked_fill(mask == 0, float("nan"))


def labelled(targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(targets with NaN -> 0, mask of the labelled entries) for :func:`masked_bce`; mask None when all are labelled."""
    unknown = torch.isnan(targets)
    if not bool(unknown.any()):
        return targets, None
    return targets.masked_fill(unknown, 0.0), (~unknown).to(targets.dtype)
