"""One client's BYOL local training for FedBYOL / FCLOpt (FCL (Wu et al., MedIA 2022) section 4.3), free of FLARE types.

Online network (encoder + projector) + predictor q, target network xi updated by EMA (eq. 7, m = 0.99) after
every step.  The loss is FCLOpt's eq. 6, one direction: L = 2 - 2 cos(q(f_theta(t)), f_xi(t')), t fed to the
online network and t' to the target network.  BYOL's own paper (Grill et al. 2020, eq. 2) adds the swapped term
L(t', t); that sum doubles the loss and its gradient, which at FCLOpt's lr 0.5 is a different optimisation, so it
is a switch (``symmetric``, default off) and not the default.  No negatives, so no features cross the wire.

Learning rates (FCL section 5, "Training details"): 0.5 for FCLOpt, FCLOpt-PTNU and FCLOpt-PTNU-DP (the
default here); 0.05, the paper's general rate, for the baselines, FedBYOL included (:data:`FEDBYOL_LR`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

from fedssl.core.fcl import cosine_lr
from fedssl.core.rng import owned_global_rng
from fedssl.core.seeds import derived_seed
from fedssl.core.spread import SpreadMeter
from fedssl.core.state_dict import ema_update
from fedssl.core.trainer import MixedPrecision


#: FCL section 5, "Training details": lr 0.5 for FCLOpt and its PTNU / DP variants
FCLOPT_LR = 0.5
#: the same passage's general rate (0.05), which the baselines use: FedBYOL's lr
FEDBYOL_LR = 0.05


def byol_loss(p: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """mean over the batch of 2 - 2 cos(p, z) (FCL eq. 6); ``z`` is treated as a constant."""
    return (2 - 2 * F.cosine_similarity(p, z.detach(), dim=1)).mean()


def view_loss(model: torch.nn.Module, t: torch.Tensor, t2: torch.Tensor,
              symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """FCL eq. 6 on the views ``t`` (online network) and ``t2`` (target network); with ``symmetric`` plus the
    swapped term L(t2, t) (Grill et al. eq. 2).  ``model`` has ``online``, ``predictor`` and ``target``.
    Returns the loss and the online projections of ``t`` (whose spread the round reports)."""
    with torch.no_grad():
        z2 = model.target(t2)
    online = model.online(t)
    loss = byol_loss(model.predictor(online), z2)
    if symmetric:
        with torch.no_grad():
            z1 = model.target(t)
        loss = loss + byol_loss(model.predictor(model.online(t2)), z1)
    return loss, online


@dataclass
class BYOLConfig:
    """Paper settings (FCL section 5, "Training details"): SGD momentum 0.9, weight decay 1e-4, cosine decay,
    m 0.99, 200 rounds; lr :data:`FCLOPT_LR` (FedBYOL: :data:`FEDBYOL_LR`); eq. 6 one-directional."""

    lr: float = FCLOPT_LR
    momentum: float = 0.99  # m of the target EMA (eq. 7)
    sgd_momentum: float = 0.9
    weight_decay: float = 1e-4
    num_rounds: int = 200
    symmetric: bool = False  # True: Grill et al.'s L(t, t') + L(t', t) instead of eq. 6

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr!r} must be > 0 (paper: 0.5 for FCLOpt, 0.05 for FedBYOL)")
        if not isinstance(self.symmetric, bool):
            raise ValueError(f"symmetric={self.symmetric!r} must be true or false (paper, eq. 6: false)")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum={self.momentum!r} must be in [0, 1) (paper: 0.99)")
        if not self.num_rounds > 0:
            raise ValueError(f"num_rounds={self.num_rounds!r} must be > 0")


class BYOLTrainer:
    def __init__(self, model: torch.nn.Module, cfg: BYOLConfig,  # model: a fedssl.models.unet.BYOLUNetEncoder
                 augment: Callable[[torch.Tensor, torch.Generator], torch.Tensor], device="cpu", seed: int = 0,
                 amp: bool = False):
        """``seed`` (data-side randomness: a site passes its site seed) drives the augmentations and seeds every
        round's owned global RNG (:func:`fedssl.core.rng.owned_global_rng`); the model arrives initialised.  ``amp``:
        the networks' forward passes in bfloat16 autocast on GPUs that support it
        (:class:`fedssl.core.trainer.MixedPrecision`; nothing on a CPU)."""
        self.seed = int(seed)
        self.model = model.to(device)
        self.cfg = cfg
        self.augment = augment
        self.device = torch.device(device)
        self.precision = MixedPrecision(self.device, amp)
        self.generator = torch.Generator().manual_seed(seed)
        params = list(self.model.online.parameters()) + list(self.model.predictor.parameters())
        self.optimizer = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.sgd_momentum, weight_decay=cfg.weight_decay)

    def train_round(self, batches: Iterable[torch.Tensor], steps_per_round: int, round_idx: int,
                    progress: Callable[[int, float], None] | None = None) -> dict:
        """One local epoch over ``batches`` of images ``[N, 1, H, W]``.  Returns the mean loss, the steps, the
        last lr and ``feature_std``: the spread of the batch's online projections averaged over the steps
        (0 = collapse, see :mod:`fedssl.core.spread`).  Runs in the owned global RNG of (seed, ``round_idx``)."""
        with owned_global_rng(derived_seed(self.seed, "byol_round", round_idx), self.device):
            return self._train_round(batches, steps_per_round, round_idx, progress)

    def _train_round(self, batches: Iterable[torch.Tensor], steps_per_round: int, round_idx: int,
                     progress: Callable[[int, float], None] | None) -> dict:
        m = self.model
        m.online.train()
        m.predictor.train()
        m.target.train()
        losses = []
        spread = SpreadMeter()
        lr = self.cfg.lr
        for step, x in enumerate(batches):
            x = x.to(self.device, non_blocking=True)
            lr = cosine_lr(self.cfg.lr, (round_idx * steps_per_round + step) / (self.cfg.num_rounds * steps_per_round))
            for g in self.optimizer.param_groups:
                g["lr"] = lr
            v1, v2 = self.augment(x, self.generator), self.augment(x, self.generator)
            with self.precision.autocast():
                loss, online = view_loss(m, v1, v2, self.cfg.symmetric)
            loss, online = loss.float(), online.float()
            spread.add(online)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"BYOL loss became {loss.item()} at round {round_idx} step {step}; lower lr")
            self.precision.step(loss, self.optimizer)
            ema_update(m.target, m.online, self.cfg.momentum)
            losses.append(float(loss.item()))
            if progress is not None:
                progress(step, losses[-1])
        if not losses:
            raise ValueError("no training batch in this round: the site has fewer images than one batch")
        return {"loss": sum(losses) / len(losses), "steps": len(losses), "lr_end": lr, "feature_std": spread.mean}

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "generator": self.generator.get_state(), "config": asdict(self.cfg)}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
