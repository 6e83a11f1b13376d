"""One client's supervised fine-tuning loop of a classifier (SSL-FL (Yan et al., IEEE TMI 2023) sec. III-D), free of
any FLARE type; the metrics and the head guard it feeds are in :mod:`fedssl.core.classification`.

``ClassifierTrainer``: AdamW (beta 0.9, 0.999), weight decay 0.05, learning rate warmed up then cosine-decayed,
indexed by (fractional) round as in SSL-FL; cross-entropy with optional label smoothing; optional mixup / CutMix and
random erasing of each training batch (:class:`fedssl.data.mixup.BatchAugment`, SSL-FL's Fed-MAE fine-tuning recipe),
then the soft-target cross-entropy against the mixed, smoothed targets; optional FedProx
proximal term (Li et al., MLSys 2020; SSL-FL (Yan et al., IEEE TMI 2023) sec. IV-F) ``mu/2 ||w - w_t||^2`` against the
weights received this round (``set_global``).  The model must carry a ``head_steps`` buffer: the trainer counts every
optimiser step that updated the classification head in it, so a checkpoint tells whether its head was ever trained
(:func:`fedssl.core.classification.require_trained_head`).
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from fedssl.core.classification import HEAD_STEPS
from fedssl.core.rng import owned_global_rng
from fedssl.core.schedule import warmup_cosine
from fedssl.core.seeds import derived_seed
from fedssl.core.soft_targets import mixed_targets, soft_target_cross_entropy
from fedssl.core.trainer import MixedPrecision
from fedssl.data.mixup import BatchAugment


def fedprox_term(model: nn.Module, global_params: Mapping[str, torch.Tensor], mu: float) -> torch.Tensor:
    """``mu/2 * sum ||w - w_global||^2`` over the trainable parameters that have a global counterpart."""
    total = None
    for name, w in model.named_parameters():
        if not w.requires_grad or name not in global_params:
            continue
        d = (w - global_params[name]).pow(2).sum()
        total = d if total is None else total + d
    if total is None:
        return torch.zeros((), device=next(model.parameters()).device)
    return 0.5 * mu * total


def vit_depth(model: nn.Module) -> int:
    """Number of ``encoder.blocks.<i>`` of a ViT (0 for other models)."""
    ids = {int(n.split(".")[2]) for n, _ in model.named_parameters()
           if n.startswith("encoder.blocks.") and n.split(".")[2].isdigit()}
    return max(ids) + 1 if ids else 0


def vit_layer_id(name: str, n_layers: int) -> int:
    """Layer index for layer-wise lr decay (MAE's ``get_layer_id_for_vit``): stem 0, block i -> i + 1, rest n_layers."""
    if name.startswith(("encoder.cls_token", "encoder.pos_embed", "encoder.patch_embed")):
        return 0
    if name.startswith("encoder.blocks.") and name.split(".")[2].isdigit():
        return int(name.split(".")[2]) + 1
    return n_layers


class ClassifierTrainer:
    def __init__(
        self,
        model: nn.Module,
        *,
        lr: float,
        total_rounds: int,
        warmup_rounds: float = 5,
        min_lr: float = 1e-6,
        weight_decay: float = 0.05,
        betas: tuple[float, float] = (0.9, 0.999),
        fedprox_mu: float = 0.0,
        label_smoothing: float = 0.0,
        layer_decay: float = 1.0,
        head_prefix: str = "head.",
        milestones: Sequence[float] = (),
        gamma: float = 0.1,
        device: torch.device | str = "cpu",
        seed: int = 0,
        amp: bool = False,
        batch_augment: BatchAugment | None = None,
    ):
        """
        Args:
            model: a classifier returning logits [B, C], with a ``head_steps`` buffer and its head's parameters
                named ``<head_prefix>*``.
            lr: peak learning rate after warm-up (SSL-FL fine-tuning: 3e-3 at batch 256).
            total_rounds, warmup_rounds: the schedule, in rounds (local fine-tuning: epochs).
            min_lr: floor of the cosine decay.
            weight_decay: AdamW decoupled decay (0.05); biases, norms and 1-d tokens are not decayed.
            fedprox_mu: 0 = FedAvg; > 0 adds ``mu/2 ||w - w_t||^2`` (SSL-FL's FedProx baseline: 0.001).
            label_smoothing: cross-entropy label smoothing (0 = plain cross-entropy).
            layer_decay: layer-wise learning-rate decay of ViT fine-tuning (BEiT / MAE recipe; SSL-FL's fine-tuning
                scripts use 0.65): parameter group of layer ``l`` gets ``lr * layer_decay ** (L + 1 - l)`` with
                ``l`` = 0 for the stem (``encoder.cls_token``, ``encoder.pos_embed``, ``encoder.patch_embed.*``),
                ``i + 1`` for ``encoder.blocks.<i>.*`` and ``L + 1`` (full lr) for everything else (``fc_norm``,
                ``head``); 1.0 = one learning rate for all.
            milestones, gamma: a step schedule instead of warm-up + cosine when ``milestones`` is not empty: ``lr``
                times ``gamma`` for every milestone (in rounds / epochs) passed (FedCLF's local fine-tuning: x0.2 at
                epochs 12 and 16).  A constant lr is ``milestones=[total_rounds]``.
            amp: the forward pass in bfloat16 autocast on GPUs that support it
                (:class:`fedssl.core.trainer.MixedPrecision`; nothing on a CPU); the loss is float32.
            seed: the site's data seed; with the step count it seeds each round's owned global RNG (drop path,
                dropout; :func:`fedssl.core.rng.owned_global_rng`) and the round's batch-augmentation generator.
            batch_augment: mixup / CutMix / random erasing of every training batch (None, or one with everything
                off: none, and the step is what it was without it).  Its draws come from a ``torch.Generator`` the
                trainer seeds at the start of each round from ``derived_seed(seed, "batch_augment", step)``, so a
                round is reproducible, a restarted client draws what the uninterrupted one would have, and no
                global generator is touched.  With mixing on, the loss is the soft-target cross-entropy against
                ``mixed_targets(y, K, lam, label_smoothing)`` (also for a batch the draw left unmixed, ``lam`` 1, as
                timm's ``SoftTargetCrossEntropy`` in the reference); with mixing off, ``F.cross_entropy`` with
                ``label_smoothing``.  Evaluation never augments.
        """
        if not isinstance(getattr(model, HEAD_STEPS, None), torch.Tensor):
            raise ValueError(f"{type(model).__name__} has no {HEAD_STEPS!r} buffer; register one "
                             f"(model.register_buffer('{HEAD_STEPS}', torch.zeros((), dtype=torch.long)))")
        head = [n for n, _ in model.named_parameters() if n.startswith(head_prefix)]
        if not head:
            raise ValueError(f"{type(model).__name__} has no parameters named {head_prefix}*; set head_prefix")
        if (lr <= 0 or total_rounds < 1 or warmup_rounds < 0 or fedprox_mu < 0 or not 0 <= label_smoothing < 1
                or not 0 < layer_decay <= 1 or not 0 < gamma <= 1 or any(m <= 0 for m in milestones)):
            raise ValueError(f"invalid trainer settings: lr={lr}, total_rounds={total_rounds}, "
                             f"warmup_rounds={warmup_rounds}, fedprox_mu={fedprox_mu}, "
                             f"label_smoothing={label_smoothing}, layer_decay={layer_decay}, "
                             f"milestones={list(milestones)}, gamma={gamma}")
        if batch_augment is not None:
            batch_augment.check(type(self).__name__)
        #: None when nothing is on: the training step is then exactly the one without batch augmentation
        self.batch_augment = batch_augment if batch_augment is not None and batch_augment.active else None
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.precision = MixedPrecision(self.device, amp)
        self.lr, self.total_rounds, self.warmup_rounds, self.min_lr = lr, total_rounds, warmup_rounds, min_lr
        self.fedprox_mu, self.label_smoothing, self.head_prefix = fedprox_mu, label_smoothing, head_prefix
        self.seed = int(seed)
        self.layer_decay = layer_decay
        self.milestones, self.gamma = sorted(float(m) for m in milestones), float(gamma)
        groups: dict[tuple[int, bool], dict] = {}
        n_layers = vit_depth(model) + 1
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            no_decay = p.ndim <= 1 or name.endswith((".bias", "token", "pos_embed"))
            layer = vit_layer_id(name, n_layers)
            g = groups.setdefault((layer, no_decay), {"params": [], "weight_decay": 0.0 if no_decay else weight_decay,
                                                      "lr_scale": layer_decay ** (n_layers - layer)})
            g["params"].append(p)
        self.optimizer = torch.optim.AdamW([groups[k] for k in sorted(groups)], lr=lr, betas=tuple(betas))
        self.step = 0
        self._global: dict[str, torch.Tensor] | None = None

    def set_global(self, params: Mapping[str, object] | None = None) -> None:
        """Remember w_t, the weights received this round, for the FedProx term (default: the model's current ones)."""
        if params is None:
            params = dict(self.model.named_parameters())
        self._global = {k: torch.as_tensor(np.asarray(v) if not isinstance(v, torch.Tensor) else v.detach())
                        .to(self.device, torch.float32).clone()
                        for k, v in params.items() if k in dict(self.model.named_parameters())}

    def lr_at(self, progress: float) -> float:
        if self.milestones:
            return self.lr * self.gamma ** sum(progress >= m for m in self.milestones)
        return warmup_cosine(progress, self.lr, self.warmup_rounds, self.total_rounds, self.min_lr)

    def train_round(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], round_idx: int, n_steps: int,
                    max_steps: int | None = None, abort=None) -> float:
        """One round (or epoch) over ``batches`` (``n_steps`` of them, for the schedule); returns the mean loss.

        ``abort``: optional callable checked between steps; when it returns True the round stops early.  Runs in the
        owned global RNG (:func:`fedssl.core.rng.owned_global_rng`: drop path, dropout) of (seed, the step count at
        its start), which the restart state holds.
        """
        with owned_global_rng(derived_seed(self.seed, "classifier_round", self.step), self.device):
            return self._train_round(batches, round_idx, n_steps, max_steps, abort)

    def _train_round(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], round_idx: float, n_steps: int,
                     max_steps: int | None, abort) -> float:
        if n_steps < 1:
            raise ValueError("a round needs at least one batch; the site has no labelled images to train on")
        if self.fedprox_mu > 0 and self._global is None:
            raise ValueError("FedProx needs the round's global weights: call set_global() before train_round()")
        model = self.model.train()
        losses = []
        generator = None
        if self.batch_augment is not None:
            generator = torch.Generator().manual_seed(derived_seed(self.seed, "batch_augment", self.step))
        for i, (x, y) in enumerate(batches):
            if (max_steps and i >= max_steps) or (abort is not None and abort()):
                break
            lr = self.lr_at(round_idx + i / n_steps)
            for g in self.optimizer.param_groups:
                g["lr"] = lr * g["lr_scale"]
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            lam = None
            if generator is not None:
                x, lam = self.batch_augment(x, generator)
            with self.precision.autocast():
                logits = model(x)
            if lam is None:
                loss = F.cross_entropy(logits.float(), y, label_smoothing=self.label_smoothing)
            else:
                targets = mixed_targets(y, logits.shape[1], lam, self.label_smoothing)
                loss = soft_target_cross_entropy(logits.float(), targets)
            if self.fedprox_mu > 0:
                loss = loss + fedprox_term(model, self._global, self.fedprox_mu)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"non-finite loss at round {round_idx}, step {i}; lower the learning rate")
            self.precision.step(loss, self.optimizer)
            getattr(model, HEAD_STEPS).add_(1)
            self.step += 1
            losses.append(float(loss.detach()))
        if not losses:
            raise ValueError("no batch was trained this round")
        self.last_losses = losses
        return sum(losses) / len(losses)

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "step": self.step}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
