"""Dice evaluation of the 2D U-Net (FCL, FCL (Wu et al., MedIA 2022) section 5; training:
:mod:`fedssl.train.segmentation`).

"Evaluation": the Dice similarity coefficient, here the mean of the 3D Dice of LV, MYO and RV
computed with MONAI ``DiceMetric`` per validation volume.

Everything here is plain PyTorch/MONAI (no FLARE import) so that the FLARE executors and the offline
protocols in :mod:`fedssl.train.protocol` share one implementation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from monai.metrics import DiceMetric
from torch import nn

from fedssl.data.acdc import ACDC_CLASSES  # noqa: F401 -- re-exported: eval users import it from here
from fedssl.data.volume import Volume

#: ACDC foreground labels (0 is background).


# ---------------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------------


@torch.no_grad()
def predict_volume(model: nn.Module, image: np.ndarray, *, device: str | torch.device = "cpu",
                   batch_size: int = 16) -> torch.Tensor:
    """Slice-by-slice argmax prediction of one ``[Z, H, W]`` volume -> ``[Z, H, W]`` long tensor (CPU)."""
    if image.ndim != 3:
        raise ValueError(f"image has shape {tuple(image.shape)}; expected a [Z, H, W] volume")
    if batch_size <= 0:
        raise ValueError(f"batch_size={batch_size}: must be a positive integer")
    x = torch.as_tensor(np.ascontiguousarray(image), dtype=torch.float32).unsqueeze(1)  # [Z, 1, H, W]
    preds = []
    for start in range(0, x.shape[0], batch_size):
        logits = model(x[start : start + batch_size].to(device))
        preds.append(logits.argmax(dim=1).cpu())
    return torch.cat(preds, dim=0)


def _one_hot_volume(label: torch.Tensor, num_classes: int) -> torch.Tensor:
    """``[Z, H, W]`` label map -> ``[1, C, Z, H, W]`` one-hot (the B, C, spatial layout of DiceMetric)."""
    oh = torch.nn.functional.one_hot(label.long(), num_classes)  # [Z, H, W, C]
    return oh.permute(3, 0, 1, 2).unsqueeze(0).to(torch.uint8)


def dice_per_volume(
    model: nn.Module,
    volumes: Sequence[Volume],
    *,
    device: str | torch.device = "cpu",
    batch_size: int = 16,
    classes: Mapping[int, str] = ACDC_CLASSES,
) -> list[dict]:
    """3D Dice per foreground class of every labelled volume (FCL (Wu et al., MedIA 2022) section 5, "Evaluation").

    Each volume is predicted slice by slice (argmax over the model's output channels), and the Dice
    ``2|A n B| / (|A| + |B|)`` of each foreground class is computed on the whole 3D volume with MONAI
    ``DiceMetric(include_background=False, reduction="none", ignore_empty=False)`` on one-hot tensors.

    Empty-class convention: a class absent from both the prediction and the ground truth scores
    Dice 1 (nothing to find, nothing predicted); absent from the ground truth but predicted scores 0.
    No class is ever NaN, so every volume contributes to every class mean.

    Returns one dict per volume: ``{"patient_id", "phase", "site", <class names>..., "mean"}`` where
    ``mean`` is the average over the classes (ACDC: LV, MYO, RV). Raises ValueError for a volume
    without label. The model is put in eval mode and restored to its previous mode afterwards.
    """
    classes = dict(classes)
    if not classes or 0 in classes:
        raise ValueError(f"classes={classes!r}: give the foreground labels (>= 1) and their names")
    for v in volumes:
        if v.label is None:
            raise ValueError(
                f"volume {v.patient_id}/{v.phase} (site {v.site!r}) has no label; Dice needs annotated volumes"
            )
    metric = DiceMetric(include_background=False, reduction="none", ignore_empty=False)
    was_training = model.training
    model.eval()
    rows: list[dict] = []
    try:
        for v in volumes:
            pred = predict_volume(model, v.image, device=device, batch_size=batch_size)
            gt = torch.as_tensor(np.asarray(v.label, dtype=np.int64))
            if tuple(gt.shape) != tuple(pred.shape):
                raise ValueError(
                    f"volume {v.patient_id}/{v.phase}: label shape {tuple(gt.shape)} != image shape {tuple(pred.shape)}"
                )
            num_classes = max(int(pred.max()), int(gt.max()), max(classes)) + 1
            scores = metric(_one_hot_volume(pred, num_classes), _one_hot_volume(gt, num_classes))[0]  # [C-1]
            metric.reset()
            row: dict[str, Any] = {"patient_id": v.patient_id, "phase": v.phase, "site": v.site}
            for label_value, name in classes.items():
                row[name] = float(scores[label_value - 1])
            row["mean"] = float(np.mean([row[name] for name in classes.values()]))
            rows.append(row)
    finally:
        model.train(was_training)
    return rows


def mean_dice(rows: Sequence[Mapping[str, Any]], classes: Mapping[int, str] = ACDC_CLASSES) -> dict:
    """Average the per-volume rows of :func:`dice_per_volume` -> ``{<class names>..., "mean", "n_volumes"}``."""
    if not rows:
        raise ValueError("no Dice rows to average (empty validation set?)")
    out: dict[str, Any] = {name: float(np.mean([r[name] for r in rows])) for name in classes.values()}
    out["mean"] = float(np.mean([r["mean"] for r in rows]))
    out["n_volumes"] = len(rows)
    return out
