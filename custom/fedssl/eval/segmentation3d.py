"""3D segmentation metrics: sliding-window inference over a whole volume, then MONAI's Dice and 95th-percentile
Hausdorff distance (in mm, from the voxel spacing) per foreground class."""

from __future__ import annotations

import math
import warnings
from typing import Mapping, Sequence

import numpy as np
import torch
from torch import nn


@torch.no_grad()
def predict_volume3d(model: nn.Module, image: torch.Tensor, roi_size: Sequence[int], *, device: torch.device,
                     sw_batch_size: int = 4, overlap: float = 0.25,
                     amp_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Label map ``[X, Y, Z]`` (long) of ``image`` ``[1, X, Y, Z]`` by Gaussian-weighted sliding windows."""
    from monai.inferers import sliding_window_inference

    was_training = model.training
    model.eval()
    try:
        with torch.autocast(device_type=device.type, dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
            logits = sliding_window_inference(image[None].to(device), tuple(int(r) for r in roi_size), sw_batch_size,
                                              model, overlap=overlap, mode="gaussian")
    finally:
        model.train(was_training)
    return logits.float().argmax(dim=1)[0].cpu()


def volume_metrics(pred: torch.Tensor, label: torch.Tensor, classes: Mapping[int, str],
                   spacing: Sequence[float]) -> dict[str, float]:
    """Dice and HD95 (mm) of every class of ``classes`` for one volume (``pred``, ``label``: ``[X, Y, Z]``).

    A class absent from both prediction and label has Dice 1 and HD95 0; absent from exactly one, Dice 0 and
    HD95 NaN (undefined: reported, left out of means)."""
    from monai.metrics import DiceMetric, HausdorffDistanceMetric

    n = max(classes) + 1
    p = torch.nn.functional.one_hot(pred.long(), n).permute(3, 0, 1, 2)[None].float()
    y = torch.nn.functional.one_hot(label.long(), n).permute(3, 0, 1, 2)[None].float()
    dice = DiceMetric(include_background=False, reduction="none", ignore_empty=False)(p, y)[0]
    with warnings.catch_warnings():  # MONAI warns about its own internal argument, and about empty classes,
        warnings.filterwarnings("ignore", category=FutureWarning, module="monai")  # which are handled below
        warnings.filterwarnings("ignore", category=UserWarning, module="monai")
        hd = HausdorffDistanceMetric(include_background=False, percentile=95, reduction="none")(
            p, y, spacing=[float(s) for s in spacing])[0]
    out: dict[str, float] = {}
    for c, name in classes.items():
        in_pred, in_label = bool(p[0, c].any()), bool(y[0, c].any())
        out[f"dice_{name}"] = float(dice[c - 1])
        if not in_pred and not in_label:
            out[f"hd95_{name}"] = 0.0
        elif in_pred != in_label:
            out[f"hd95_{name}"] = float("nan")
        else:
            out[f"hd95_{name}"] = float(hd[c - 1])
    return out


def mean_metrics(rows: Sequence[Mapping[str, float]], classes: Mapping[int, str]) -> dict[str, float]:
    """Per class the mean over volumes (NaN HD95 left out, counted in ``hd95_undefined``), and the means over
    classes ``dice`` / ``hd95``."""
    out: dict[str, float] = {}
    undefined = 0
    for name in classes.values():
        d = [r[f"dice_{name}"] for r in rows]
        h = [r[f"hd95_{name}"] for r in rows if math.isfinite(r[f"hd95_{name}"])]
        undefined += len(rows) - len(h)
        out[f"dice_{name}"] = float(np.mean(d)) if d else float("nan")
        out[f"hd95_{name}"] = float(np.mean(h)) if h else float("nan")
    out["dice"] = float(np.mean([out[f"dice_{n}"] for n in classes.values()]))
    finite = [out[f"hd95_{n}"] for n in classes.values() if math.isfinite(out[f"hd95_{n}"])]
    out["hd95"] = float(np.mean(finite)) if finite else float("nan")
    out["hd95_undefined"] = float(undefined)
    return out
