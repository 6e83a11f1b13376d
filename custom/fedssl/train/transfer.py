"""FCL transfer learning, ACDC -> HVSMR (FCL (Wu et al., MedIA 2022) section 5.4, Table 5).

Section 5.4: "We pre-train the encoder on ACDC by different methods and use the pre-trained encoder as the
initialization for fine-tuning on the HVSMD dataset with limited annotations."  Table 5: "M is the number of
annotated patients for fine-tuning. The average dice score and standard deviation on 5-fold cross-validation are
reported", M in {1, 2, 4, 8}.  HVSMR has 10 labelled subjects (section 5), so a fold holds 8 training and 2
validation subjects and the M annotated subjects are drawn from the fold's 8.  Preprocessing (section 5): percentile
min-max per volume, 2D axial slices resampled to 0.7 x 0.7 mm (:mod:`fedssl.data.hvsmr`).  Fine-tuning is the
paper's only fine-tuning recipe (section 5, "Training details"): Adam, batch 10, lr 0.0005, cosine, 200 epochs
(:func:`fedssl.train.segmentation.train_segmentation`); the U-Net outputs 3 classes (background, myocardium, blood
pool) and only its encoder comes from ACDC pre-training (the decoder is random).  Metric: Dice ("DSC") of each
class on each 3D validation volume (:func:`fedssl.eval.segmentation.dice_per_volume`), the row's ``dice`` is the
mean over myocardium and blood pool; the summary is mean +- std (population) over folds, as in Table 5.

Randomness: the split, the M subjects, the batches and the augmentations use ``site_seed(seed, site)``
(:func:`fedssl.core.seeds.site_seed`; the job seed itself when ``site`` is empty); the model's initial weights
use ``seed``.  Every method is thus fine-tuned and validated on the same subjects with the same batches, so the
methods compare pairwise.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fedssl.core.checks import require, require_int
from fedssl.core.partition import kfold_split, select_labelled
from fedssl.core.seeds import site_seed
from fedssl.data.hvsmr import HVSMR_CLASSES
from fedssl.data.volume import Volume
from fedssl.eval.segmentation import dice_per_volume, mean_dice
from fedssl.train.segmentation import init_unet, train_segmentation

__all__ = ["PAPER_TRANSFER", "transfer_finetune", "summarise_transfer"]

COMPONENT = "transfer_finetune"

#: FCL section 5 / Table 5 settings of the transfer study (features: section 5, "initial number of channels 48"; norm:
#: the ACDC pre-training's, "batch" by default as jobs/fcl_acdc, see fedssl.models.unet)
PAPER_TRANSFER: dict[str, Any] = {
    "target_spacing": 0.7, "n_labelled": [1, 2, 4, 8], "n_folds": 5, "folds": [0, 1, 2, 3, 4], "epochs": 200,
    "lr": 5e-4, "batch_size": 10, "features": [48, 96, 192, 384, 768, 48], "norm": "batch",
}

Progress = Callable[[dict], None]


def _check(volumes: Sequence[Volume], inits: Mapping[str, object], n_labelled: Sequence[int],
           folds: Sequence[int], n_folds: int) -> list[str]:
    """The subject ids, after checking the arguments (one error naming argument, value and fix)."""
    require(bool(inits), COMPONENT, "inits", dict(inits), "give {method name: 'random' | encoder state dict}")
    subjects = sorted({v.patient_id for v in volumes})
    require(len(subjects) == len(volumes), COMPONENT, "volumes", [v.patient_id for v in volumes],
            "give one labelled volume per subject (HVSMR: one 3D image per subject)")
    require_int(COMPONENT, "n_folds", n_folds, 2, "use at least 2 folds (paper: 5)")
    require(len(subjects) >= n_folds, COMPONENT, "volumes", subjects, f"need at least n_folds={n_folds} subjects")
    n_train = len(subjects) - -(-len(subjects) // n_folds)  # the smallest training part of any fold
    require(bool(n_labelled) and all(isinstance(m, int) and 1 <= m <= n_train for m in n_labelled), COMPONENT,
            "n_labelled", list(n_labelled), f"use annotated-subject counts in [1, {n_train}] (paper: 1, 2, 4, 8)")
    require(bool(folds) and all(isinstance(f, int) and 0 <= f < n_folds for f in folds), COMPONENT, "folds",
            list(folds), f"use fold indices in [0, {n_folds - 1}]")
    return subjects


def _run_one(init: object, train: Sequence[Volume], val: Sequence[Volume], *, features: Sequence[int], epochs: int,
             batch_size: int, lr: float, seed: int, data_seed: int, device: str | torch.device,
             max_steps_per_epoch: int | None, norm: str) -> dict:
    """Fine-tune one U-Net (weights from ``seed``, batches from ``data_seed``) and score it on ``val``."""
    start = time.perf_counter()
    unet = init_unet(init, features=features, seed=seed, out_channels=len(HVSMR_CLASSES) + 1,  # type: ignore[arg-type]
                     norm=norm)
    losses = train_segmentation(unet, train, epochs=epochs, batch_size=batch_size, lr=lr, seed=data_seed,
                                device=device, max_steps_per_epoch=max_steps_per_epoch)
    scores = mean_dice(dice_per_volume(unet, val, device=device, classes=HVSMR_CLASSES), HVSMR_CLASSES)
    out = {"dice": scores["mean"], **{name: scores[name] for name in HVSMR_CLASSES.values()}}
    out.update(final_loss=losses[-1], seconds=round(time.perf_counter() - start, 3))
    return out


def transfer_finetune(
    volumes: Sequence[Volume],
    inits: Mapping[str, object],
    *,
    n_labelled: Sequence[int] = (1, 2, 4, 8),
    folds: Sequence[int] = (0, 1, 2, 3, 4),
    features: Sequence[int] = PAPER_TRANSFER["features"],
    epochs: int = 200,
    batch_size: int = 10,
    lr: float = 5e-4,
    seed: int = 0,
    site: str = "",
    device: str | torch.device = "cpu",
    max_steps_per_epoch: int | None = None,
    n_folds: int = 5,
    progress: Progress | None = None,
    norm: str = PAPER_TRANSFER["norm"],
) -> list[dict]:
    """Table 5's protocol on labelled HVSMR ``volumes`` (one per subject) for every method of ``inits``
    (name -> ``"random"`` or an encoder state dict pre-trained on ACDC).  One row per (fold, method, M)::

        {"method", "mode": "transfer", "n_labelled", "fold", "site", "dice", "myocardium", "blood_pool",
         "train_patients", "val_patients", "n_train_slices", "final_loss", "seconds"}

    ``progress(row)`` is called after every run; ``norm``: the U-Net's normalisation, the pre-training's.
    """
    subjects = _check(volumes, inits, n_labelled, folds, n_folds)
    by_id = {v.patient_id: v for v in volumes}
    data_seed = site_seed(seed, site)
    train_kw = dict(features=features, epochs=epochs, batch_size=batch_size, lr=lr, seed=seed, data_seed=data_seed,
                    device=device, max_steps_per_epoch=max_steps_per_epoch, norm=norm)
    rows: list[dict] = []
    for fold in folds:
        train_ids, val_ids = kfold_split(subjects, fold, n_folds=n_folds, seed=data_seed)
        val = [by_id[s] for s in val_ids]
        for method, init in inits.items():
            for m in n_labelled:
                chosen = select_labelled(train_ids, m, seed=data_seed)
                train = [by_id[s] for s in chosen]
                row: dict[str, Any] = {"method": method, "mode": "transfer", "n_labelled": int(m), "fold": int(fold),
                                       "site": site or "hvsmr"}
                row.update(_run_one(init, train, val, **train_kw))
                row.update(train_patients=chosen, val_patients=list(val_ids),
                           n_train_slices=sum(v.n_slices for v in train))
                rows.append(row)
                if progress is not None:
                    progress(row)
    return rows


def summarise_transfer(rows: Sequence[Mapping[str, Any]]) -> list[dict]:
    """Table 5's cells: per (method, M) the mean and population std over folds of the mean Dice and of each class
    -> ``{"mode": "transfer", "method", "n_labelled", "dice_mean", "dice_std", "<class>_mean", "<class>_std",
    "n"}`` in order of first appearance of the method, M ascending (the layout
    :func:`fedssl.eval.report.format_table` prints)."""
    groups: dict[tuple[str, int], list[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault((str(r["method"]), int(r["n_labelled"])), []).append(r)
    order = list(dict.fromkeys(str(r["method"]) for r in rows))
    out = []
    for (method, m), group in sorted(groups.items(), key=lambda kv: (order.index(kv[0][0]), kv[0][1])):
        cell: dict[str, Any] = {"mode": "transfer", "method": method, "n_labelled": m, "n": len(group)}
        for key in ("dice", *HVSMR_CLASSES.values()):
            values = np.array([float(r[key]) for r in group], dtype=np.float64)
            cell[f"{key}_mean"], cell[f"{key}_std"] = float(values.mean()), float(values.std())
        out.append(cell)
    return out
