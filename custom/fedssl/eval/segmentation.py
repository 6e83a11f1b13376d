"""Supervised fine-tuning and Dice evaluation of the 2D U-Net (FCL, seed 004 section 5).

Paper setting ("Training details"): the U-Net is initialised from the pre-trained global encoder and
fine-tuned with Adam, batch size 10, learning rate 0.0005 and a cosine schedule, for 200 epochs
(local / centralised fine-tuning) or 200 rounds of one local epoch (federated fine-tuning).
"Evaluation": the Dice similarity coefficient, here the mean of the 3D Dice of LV, MYO and RV
computed with MONAI ``DiceMetric`` per validation volume.

Everything here is plain PyTorch/MONAI (no FLARE import) so that the FLARE executors and the offline
protocols in :mod:`fedssl.eval.protocol` share one implementation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from monai.losses import DiceCELoss
from monai.metrics import DiceMetric
from monai.networks.nets import BasicUNet
from torch import nn

from fedssl.data.transforms import augment_segmentation
from fedssl.data.volume import Volume
from fedssl.models.unet import build_unet, load_encoder_into_unet

#: ACDC foreground labels (0 is background).
ACDC_CLASSES: dict[int, str] = {1: "RV", 2: "MYO", 3: "LV"}

#: Key prefixes that only a full U-Net state dict has (decoder / output layer), not an encoder one.
_DECODER_PREFIXES: tuple[str, ...] = ("upcat_", "final_conv.")


# ---------------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------------


@torch.no_grad()
def predict_volume(model: nn.Module, image: np.ndarray, *, device: str | torch.device = "cpu", batch_size: int = 16) -> torch.Tensor:
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
    """3D Dice per foreground class of every labelled volume (seed 004 section 5, "Evaluation").

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


# ---------------------------------------------------------------------------------------------------
# Initialisation
# ---------------------------------------------------------------------------------------------------


def init_unet(init: str | Mapping[str, Any], *, features: Sequence[int], seed: int = 0, out_channels: int = 4) -> BasicUNet:
    """Build the fine-tuning U-Net and initialise it (seed 004 section 5: "the pre-trained encoder
    ... is used as the initialization for fine-tuning the U-Net").

    ``init`` is
      * ``"random"``: the *Random init* baseline;
      * an encoder state dict (keys ``conv_0.*``, ``down_1.*`` ... ``down_4.*``): loaded 1:1 with
        :func:`load_encoder_into_unet`, the decoder stays randomly initialised;
      * a full U-Net state dict (has ``upcat_*`` / ``final_conv.*`` keys), e.g. a fine-tuned model.
    The random weights are drawn from ``torch.manual_seed(seed)`` inside a forked RNG, so the result
    depends only on ``seed`` and the global RNG state is left untouched. A state dict that does not
    fit the U-Net built from ``features`` raises ValueError.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        unet = build_unet(features, in_channels=1, out_channels=out_channels)
    if isinstance(init, str):
        if init != "random":
            raise ValueError(f"init={init!r}: use 'random', an encoder state dict or a full U-Net state dict")
        return unet
    if not isinstance(init, Mapping):
        raise TypeError(f"init must be 'random' or a state dict (Mapping), got {type(init).__name__}")
    if any(str(k).startswith(_DECODER_PREFIXES) for k in init):
        own = unet.state_dict()
        missing, extra = sorted(set(own) - set(init))[:5], sorted(set(init) - set(own))[:5]
        bad_shape = [k for k in own if k in init and tuple(torch.as_tensor(init[k]).shape) != tuple(own[k].shape)]
        if missing or extra or bad_shape:
            raise ValueError(
                f"U-Net state dict does not match the U-Net built from features={list(features)}: "
                f"missing {missing}, unexpected {extra}, wrong shape {bad_shape[:5]}"
            )
        unet.load_state_dict({k: torch.as_tensor(v) for k, v in init.items()})
    else:
        load_encoder_into_unet(unet, init)
    return unet


# ---------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------


def slices_from_volumes(volumes: Sequence[Volume]) -> tuple[torch.Tensor, torch.Tensor]:
    """All 2D slices of the given labelled volumes -> images ``[S, 1, H, W]`` float32, labels ``[S, H, W]`` long."""
    if not volumes:
        raise ValueError("no volumes to train on")
    images, labels = [], []
    shape = None
    for v in volumes:
        if v.label is None:
            raise ValueError(f"volume {v.patient_id}/{v.phase} has no label; fine-tuning needs annotated volumes")
        if v.image.shape != v.label.shape:
            raise ValueError(f"volume {v.patient_id}/{v.phase}: image {v.image.shape} != label {v.label.shape}")
        if shape is None:
            shape = tuple(v.image.shape[1:])
        elif tuple(v.image.shape[1:]) != shape:
            raise ValueError(
                f"volume {v.patient_id}/{v.phase} has in-plane size {tuple(v.image.shape[1:])}, others {shape}; "
                "crop/pad the volumes to one size before fine-tuning"
            )
        images.append(torch.as_tensor(np.ascontiguousarray(v.image), dtype=torch.float32))
        labels.append(torch.as_tensor(np.asarray(v.label, dtype=np.int64)))
    return torch.cat(images, 0).unsqueeze(1), torch.cat(labels, 0)


def _cosine_factor(total_steps: int) -> Callable[[int], float]:
    total = max(int(total_steps), 1)

    def factor(step: int) -> float:
        # Cosine decay from lr to 0 over `total` steps, then held at 0 (never rises again).
        return 0.5 * (1.0 + math.cos(math.pi * min(step, total) / total))

    return factor


class SegmentationTrainer:
    """Slice-level supervised fine-tuning with state that persists across calls.

    Seed 004 section 5: Adam, lr 0.0005, batch size 10, cosine schedule; loss MONAI
    ``DiceCELoss(to_onehot_y=True, softmax=True)``; every batch is augmented jointly (image + mask)
    by :func:`fedssl.data.transforms.augment_segmentation`. The cosine schedule decays the lr to 0 over
    ``total_steps`` optimiser steps (e.g. epochs x batches per epoch, or rounds x local batches in
    federated fine-tuning), so a FLARE executor can call :meth:`train_epoch` once per round and keep
    the optimiser moments and the schedule between rounds. One seeded ``torch.Generator`` (CPU) drives
    both the shuffling and the augmentation, so runs are reproducible.

    ``state_dict()`` holds the optimiser, the scheduler, the generator and the step/epoch counters,
    not the model weights (checkpoint those with ``unet.state_dict()``).
    """

    def __init__(
        self,
        unet: nn.Module,
        *,
        lr: float = 5e-4,
        batch_size: int = 10,
        total_steps: int,
        seed: int = 0,
        device: str | torch.device = "cpu",
    ):
        if batch_size <= 0:
            raise ValueError(f"batch_size={batch_size}: must be a positive integer (paper: 10)")
        if total_steps <= 0:
            raise ValueError(f"total_steps={total_steps}: must be a positive integer")
        if lr <= 0:
            raise ValueError(f"lr={lr}: must be positive (paper: 5e-4)")
        self.device = torch.device(device)
        self.unet = unet.to(self.device)
        self.batch_size = int(batch_size)
        self.total_steps = int(total_steps)
        self.lr = float(lr)
        self.seed = int(seed)
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(self.seed)
        self.loss_fn = DiceCELoss(to_onehot_y=True, softmax=True)
        self.optimizer = torch.optim.Adam(self.unet.parameters(), lr=self.lr)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _cosine_factor(self.total_steps))
        self.step = 0
        self.epoch = 0

    @property
    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def train_epoch(self, volumes: Sequence[Volume], max_steps: int | None = None) -> float:
        """One pass over all slices of ``volumes`` in shuffled batches (at most ``max_steps`` batches);
        returns the mean loss over the batches."""
        if max_steps is not None and max_steps <= 0:
            raise ValueError(f"max_steps={max_steps}: must be a positive integer or None")
        images, labels = slices_from_volumes(volumes)
        order = torch.randperm(images.shape[0], generator=self.generator)
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        if max_steps is not None:
            batches = batches[:max_steps]
        self.unet.train()
        losses = []
        for idx in batches:
            x, y = augment_segmentation(images[idx], labels[idx], self.generator)
            x = x.to(self.device, non_blocking=True)
            y = y.to(self.device, non_blocking=True).long().unsqueeze(1)  # [N, 1, H, W] for to_onehot_y
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.loss_fn(self.unet(x), y)
            loss.backward()
            self.optimizer.step()
            self.scheduler.step()
            self.step += 1
            losses.append(float(loss.detach()))
        self.epoch += 1
        return float(np.mean(losses))

    def state_dict(self) -> dict:
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "generator": self.generator.get_state(),
            "step": self.step,
            "epoch": self.epoch,
            "total_steps": self.total_steps,
            "lr": self.lr,
            "batch_size": self.batch_size,
            "seed": self.seed,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if int(state["total_steps"]) != self.total_steps or int(state["batch_size"]) != self.batch_size:
            raise ValueError(
                f"trainer state was saved with total_steps={state['total_steps']}, batch_size={state['batch_size']}; "
                f"this trainer has total_steps={self.total_steps}, batch_size={self.batch_size}"
            )
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.generator.set_state(torch.as_tensor(state["generator"], dtype=torch.uint8).cpu())
        self.step = int(state["step"])
        self.epoch = int(state["epoch"])


def steps_per_epoch(volumes: Sequence[Volume], batch_size: int, max_steps_per_epoch: int | None = None) -> int:
    """Number of optimiser steps one epoch over all slices of ``volumes`` takes."""
    n_slices = sum(v.n_slices for v in volumes)
    steps = math.ceil(n_slices / batch_size)
    return min(steps, max_steps_per_epoch) if max_steps_per_epoch is not None else steps


def train_segmentation(
    unet: nn.Module,
    volumes: Sequence[Volume],
    *,
    epochs: int,
    batch_size: int = 10,
    lr: float = 5e-4,
    seed: int = 0,
    device: str | torch.device = "cpu",
    max_steps_per_epoch: int | None = None,
    progress: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Fine-tune ``unet`` on all slices of the labelled ``volumes`` for ``epochs`` epochs (seed 004
    section 5: 200 epochs, Adam, batch 10, lr 0.0005, cosine over all steps). Returns the mean loss of
    every epoch; ``progress(epoch, loss)`` (1-based epoch) is called after each one."""
    if epochs <= 0:
        raise ValueError(f"epochs={epochs}: must be a positive integer (paper: 200)")
    per_epoch = steps_per_epoch(volumes, batch_size, max_steps_per_epoch)
    trainer = SegmentationTrainer(
        unet, lr=lr, batch_size=batch_size, total_steps=epochs * per_epoch, seed=seed, device=device
    )
    losses = []
    for epoch in range(1, epochs + 1):
        losses.append(trainer.train_epoch(volumes, max_steps=max_steps_per_epoch))
        if progress is not None:
            progress(epoch, losses[-1])
    return losses
