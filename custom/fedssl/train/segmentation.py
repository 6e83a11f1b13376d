"""Supervised fine-tuning of the 2D U-Net (FCL, FCL (Wu et al., MedIA 2022) section 5) and its LocalTrainer.

Paper setting ("Training details"): the U-Net is initialised from the pre-trained global encoder and
fine-tuned with Adam, batch size 10, learning rate 0.0005 and a cosine schedule, for 200 epochs
(local / centralised fine-tuning) or 200 rounds of one local epoch (federated fine-tuning).
Evaluation (Dice): :mod:`fedssl.eval.segmentation`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from monai.losses import DiceCELoss
from monai.networks.nets import BasicUNet
from torch import nn

from fedssl.core.checks import require, require_amp, require_int
from fedssl.core.rng import owned_global_rng
from fedssl.core.seeds import derived_seed, site_seed
from fedssl.core.trainer import MixedPrecision, RoundStats, check_optimizer_state, check_stop, detached, load_checked
from fedssl.data.transforms import augment_segmentation
from fedssl.data.volume import Volume
from fedssl.eval.segmentation import ACDC_CLASSES, dice_per_volume, mean_dice
from fedssl.models.unet import (NORMS, PAPER_FEATURES, build_unet, load_encoder_into_unet, require_norm,
                                require_unet_args, state_norm)

#: Key prefixes that only a full U-Net state dict has (decoder / output layer), not an encoder one.
_DECODER_PREFIXES: tuple[str, ...] = ("upcat_", "final_conv.")


# ---------------------------------------------------------------------------------------------------
# Initialisation
# ---------------------------------------------------------------------------------------------------


def init_unet(init: str | Mapping[str, Any], *, features: Sequence[int], seed: int = 0,
              out_channels: int = 4, norm: str = NORMS[0]) -> BasicUNet:
    """Build the fine-tuning U-Net and initialise it (FCL (Wu et al., MedIA 2022) section 5: "the pre-trained encoder
    ... is used as the initialization for fine-tuning the U-Net").

    ``init`` is
      * ``"random"``: the *Random init* baseline;
      * an encoder state dict (keys ``conv_0.*``, ``down_1.*`` ... ``down_4.*``): loaded 1:1 with
        :func:`load_encoder_into_unet`, the decoder stays randomly initialised;
      * a full U-Net state dict (has ``upcat_*`` / ``final_conv.*`` keys), e.g. a fine-tuned model.
    The random weights are drawn from ``torch.manual_seed(seed)`` inside a forked RNG, so the result
    depends only on ``seed`` and the global RNG state is left untouched. A state dict that does not
    fit the U-Net built from ``features`` and ``norm`` ("batch", the reference code's, or "instance";
    :func:`fedssl.models.unet.build_unet`) raises ValueError; BatchNorm running statistics load with the weights.
    """
    require_norm("init_unet", norm)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        unet = build_unet(features, in_channels=1, out_channels=out_channels, norm=norm)
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
                f"U-Net state dict does not match the U-Net built from features={list(features)}, norm={norm!r} "
                f"(the state's norm: {state_norm(init)!r}): missing {missing}, unexpected {extra}, wrong shape "
                f"{bad_shape[:5]}"
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

    FCL (Wu et al., MedIA 2022) section 5: Adam, lr 0.0005, batch size 10, cosine schedule; loss MONAI
    ``DiceCELoss(to_onehot_y=True, softmax=True)``; every batch is augmented jointly (image + mask)
    by :func:`fedssl.data.transforms.augment_segmentation`. The cosine schedule decays the lr to 0 over
    ``total_steps`` optimiser steps (e.g. epochs x batches per epoch, or rounds x local batches in
    federated fine-tuning), so a FLARE executor can call :meth:`train_epoch` once per round and keep
    the optimiser moments and the schedule between rounds. One seeded ``torch.Generator`` (CPU) drives
    both the shuffling and the augmentation, so runs are reproducible; every epoch runs in the owned global
    RNG of (seed, epoch count) (:func:`fedssl.core.rng.owned_global_rng`), so a hidden draw (a dropout) is
    reproducible too and the global generators are left as they were.

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
        amp: bool = False,
    ):
        """``amp``: the U-Net's forward pass in bfloat16 autocast on GPUs that support it
        (:class:`fedssl.core.trainer.MixedPrecision`; nothing on a CPU); the loss is float32."""
        if batch_size <= 0:
            raise ValueError(f"batch_size={batch_size}: must be a positive integer (paper: 10)")
        if total_steps <= 0:
            raise ValueError(f"total_steps={total_steps}: must be a positive integer")
        if lr <= 0:
            raise ValueError(f"lr={lr}: must be positive (paper: 5e-4)")
        self.device = torch.device(device)
        self.unet = unet.to(self.device)
        self.precision = MixedPrecision(self.device, amp)
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

    def train_epoch(self, volumes: Sequence[Volume], max_steps: int | None = None,
                    should_stop: Callable[[], bool] | None = None) -> float:
        """One pass over all slices of ``volumes`` in shuffled batches (at most ``max_steps`` batches);
        returns the mean loss over the batches.  ``should_stop`` is checked before every step
        (:class:`fedssl.core.trainer.StopRequested` when it returns True)."""
        with owned_global_rng(derived_seed(self.seed, "segmentation_epoch", self.epoch), self.device):
            return self._train_epoch(volumes, max_steps, should_stop)

    def _train_epoch(self, volumes: Sequence[Volume], max_steps: int | None,
                     should_stop: Callable[[], bool] | None) -> float:
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
            check_stop(should_stop)
            x, y = augment_segmentation(images[idx], labels[idx], self.generator)
            x = x.to(self.device, non_blocking=True)
            y = y.to(self.device, non_blocking=True).long().unsqueeze(1)  # [N, 1, H, W] for to_onehot_y
            with self.precision.autocast():
                logits = self.unet(x)
            loss = self.loss_fn(logits.float(), y)
            self.precision.step(loss, self.optimizer)
            self.scheduler.step()
            self.step += 1
            losses.append(float(loss.detach()))
        self.epoch += 1
        self.last_losses = losses
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
        check_optimizer_state(self.optimizer, state["optimizer"], "the saved segmentation state")  # it holds no weights
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


def epochs_with_floor(epochs: int, per_epoch: int, min_steps: int = 0) -> int:
    """``epochs``, or more whole epochs where ``epochs`` x ``per_epoch`` optimiser steps fall short of ``min_steps``.

    The floor is for small label budgets on a shortened schedule: the paper's 200 epochs give one annotated patient
    (about 2 steps an epoch) some 400 steps, and a CPU schedule of 60 epochs only 120; a floor restores the small-N
    runs without lengthening the large-N ones, which dominate the cost.  0 = no floor (the paper's protocol)."""
    if isinstance(min_steps, bool) or not isinstance(min_steps, int) or min_steps < 0:
        raise ValueError(f"min_steps={min_steps!r}: must be a non-negative integer (0 = no floor, the paper's "
                         "protocol)")
    if per_epoch <= 0:
        raise ValueError(f"per_epoch={per_epoch!r}: an epoch must take at least one step (no labelled slices?)")
    return max(int(epochs), -(-min_steps // per_epoch))


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
    min_steps: int = 0,
) -> list[float]:
    """Fine-tune ``unet`` on all slices of the labelled ``volumes`` for ``epochs`` epochs (FCL (Wu et al., MedIA 2022)
    section 5: 200 epochs, Adam, batch 10, lr 0.0005, cosine over all steps), or more whole epochs up to
    ``min_steps`` optimiser steps (:func:`epochs_with_floor`; 0 = none, the paper's). Returns the mean loss of
    every epoch run; ``progress(epoch, loss)`` (1-based epoch) is called after each one."""
    if epochs <= 0:
        raise ValueError(f"epochs={epochs}: must be a positive integer (paper: 200)")
    per_epoch = steps_per_epoch(volumes, batch_size, max_steps_per_epoch)
    epochs = epochs_with_floor(epochs, per_epoch, min_steps)
    trainer = SegmentationTrainer(
        unet, lr=lr, batch_size=batch_size, total_steps=epochs * per_epoch, seed=seed, device=device
    )
    losses = []
    for epoch in range(1, epochs + 1):
        losses.append(trainer.train_epoch(volumes, max_steps=max_steps_per_epoch))
        if progress is not None:
            progress(epoch, losses[-1])
    return losses


@dataclass(frozen=True)
class SegmentationSettings:
    """Every setting of a site's federated U-Net fine-tuning, declared once: the job arguments of
    ``SegmentationExecutor`` and what :class:`SegmentationLocalTrainer` reads (paper settings as defaults, FCL (Wu et
    al., MedIA 2022) section 5).

    data_root: the site's folder of ``patientNNN`` folders; "" = site config / FEDSSL_DATA_ROOT.  image_size,
    target_spacing: the slices' size in pixels and in-plane spacing in mm; features: the U-Net's channels; norm: its
    normalisation, "batch" (the reference code's) or "instance", the pre-training's (the initial U-Net's state must
    have it; FedAvg averages every tensor of it, BatchNorm running statistics included).
    n_labelled: N annotated patients of the site (1, 2, 4, 8); fold of the ``n_folds``-fold split (8 train / 2
    validation patients per site); lr: Adam 5e-4, cosine over all rounds; batch_size: 10 slices; local_epochs per
    round (paper: 1); max_steps_per_epoch caps each local epoch (0 = no cap); seed: the job seed (initial U-Net; the
    site's batches and augmentations use site_seed(seed, site)); split_seed: the seed of the patient split (per
    site site_seed(split_seed, site); the annotated patients fold_seed(split_seed, site, fold)), the same as the
    local protocol's (``fedssl fcl finetune``) so both fine-tune on the same patients; device: "auto", "cpu",
    "cuda[:N]"; amp: bfloat16 autocast on GPUs that support it.
    """

    data_root: str = ""
    image_size: int = 192
    target_spacing: float = 1.25
    features: Sequence[int] = PAPER_FEATURES
    norm: str = NORMS[0]
    n_labelled: int = 1
    fold: int = 0
    n_folds: int = 5
    lr: float = 5e-4
    batch_size: int = 10
    local_epochs: int = 1
    max_steps_per_epoch: int = 0
    seed: int = 0
    split_seed: int = 0
    device: str = "auto"
    amp: bool = False

    def check(self, name: str) -> None:
        """Every argument checked; the message names component ``name``, the argument, its value and the fix."""
        require(isinstance(self.data_root, str), name, "data_root", self.data_root, 'use a path string or ""')
        require(isinstance(self.n_labelled, int) and self.n_labelled >= 1, name, "n_labelled", self.n_labelled,
                "paper: 1, 2, 4 or 8")
        require(isinstance(self.n_folds, int) and self.n_folds >= 2, name, "n_folds", self.n_folds, "paper: 5")
        require(isinstance(self.fold, int) and 0 <= self.fold < self.n_folds, name, "fold", self.fold,
                f"use 0..{self.n_folds - 1}")
        require(self.lr > 0, name, "lr", self.lr, "paper: 5e-4")
        require(isinstance(self.batch_size, int) and self.batch_size >= 1, name, "batch_size", self.batch_size,
                "paper: 10")
        require(isinstance(self.local_epochs, int) and self.local_epochs >= 1, name, "local_epochs", self.local_epochs,
                "paper: 1")
        require_int(name, "max_steps_per_epoch", self.max_steps_per_epoch, 0,
                    "use 0 (full epoch) or a positive step count")
        require_int(name, "seed", self.seed, 0, "use the job's non-negative integer seed")
        require_int(name, "split_seed", self.split_seed, 0, "use a non-negative integer (the local protocol's: 0)")
        require_unet_args(name, self.features, self.image_size, self.norm)
        require_amp(name, self.amp)


class SegmentationLocalTrainer:
    """Federated fine-tuning of the U-Net on a site's N annotated patients (a ``LocalTrainer``) with the settings of a
    :class:`SegmentationSettings`.

    Each round: ``local_epochs`` epochs over every slice of ``train_volumes`` (each capped at
    ``max_steps_per_epoch`` batches; 0 = no cap) with one Adam optimiser and one cosine schedule over all
    ``num_rounds`` rounds; ``samples`` = labelled slices (the FedAvg weight).  ``evaluate("val")`` = Dice of
    the current model on ``val_volumes``.  The restart state is the optimiser / schedule / generator (the
    weights come from the server every round).  The site's seed ``fedssl.core.seeds.site_seed(seed, site)`` drives
    the batch order, the augmentations and the owned global RNG of every epoch and evaluation (the U-Net arrives
    initialised).  ``device``: a torch device (the executor resolves the settings' "auto").
    """

    def __init__(self, unet: nn.Module, train_volumes: Sequence[Volume], val_volumes: Sequence[Volume],
                 settings: SegmentationSettings, *, num_rounds: int, site: str = "",
                 device: str | torch.device = "cpu"):
        s = settings
        s.check(type(self).__name__)
        self.settings = s
        self.train_volumes, self.val_volumes = list(train_volumes), list(val_volumes)
        self.local_epochs, self.max_steps = int(s.local_epochs), (int(s.max_steps_per_epoch) or None)
        steps = steps_per_epoch(self.train_volumes, s.batch_size, self.max_steps)
        self.trainer = SegmentationTrainer(unet, lr=s.lr, batch_size=s.batch_size,
                                           total_steps=steps * self.local_epochs * int(num_rounds),
                                           seed=site_seed(s.seed, site), device=device, amp=s.amp)
        self.n_slices = sum(v.n_slices for v in self.train_volumes)

    @property
    def model(self) -> nn.Module:
        return self.trainer.unet

    @property
    def device(self) -> torch.device:
        return self.trainer.device

    def train_round(self, round_idx: int, should_stop: Callable[[], bool] | None = None) -> RoundStats:
        step0, losses, curve = self.trainer.step, [], []
        for _ in range(self.local_epochs):
            losses.append(self.trainer.train_epoch(self.train_volumes, max_steps=self.max_steps,
                                                   should_stop=should_stop))
            curve += [{"loss": x} for x in self.trainer.last_losses]
        return RoundStats(loss=sum(losses) / len(losses), steps=self.trainer.step - step0, samples=self.n_slices,
                          metrics={"lr": self.trainer.current_lr}, curve=curve)

    def evaluate(self, split: str = "val") -> dict[str, Any]:
        if split != "val":
            raise ValueError(f"split={split!r}: this trainer holds only a validation split ('val')")
        with owned_global_rng(derived_seed(self.trainer.seed, "evaluate", split), self.device):
            summary = mean_dice(dice_per_volume(self.model, self.val_volumes, device=self.device))
        return {"dice": summary["mean"], **{name: summary[name] for name in ACDC_CLASSES.values()}}

    def state_dict(self) -> dict:
        return self.trainer.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.trainer.load_state_dict(state)

    def global_state(self) -> dict[str, torch.Tensor]:
        return detached(self.model.state_dict())

    def load_global(self, state: Mapping[str, Any], keep_local: Sequence[str] = ()) -> list[str]:
        return load_checked(self.model, state, "the global U-Net", keep_local)
