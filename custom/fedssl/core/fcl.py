"""One client's FCL local training (FCL (Wu et al., MedIA 2022) section 3, Fig. 2), free of any FLARE type.

MoCo with a main and a momentum encoder, a local FIFO bank of momentum features with partition ids,
feature exchange (FE, eq. 1), negative sampling (NS, eq. 2) and global structural matching (GSM,
eqs. 4-5), each a switch.  ``plain_moco`` replaces FCL's cross-volume partition positives (sec. 3.2) by MoCo's
own positive, the other augmented view of the same slice (He et al., 2020), and turns GSM off: with FE off
that is FedMoCo, the "Without FE" row of Table 6 (its numbers equal FedMoCo's in Tables 1 and 7).  The
executor implements Local CL (no exchange at all).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable, Iterable

import torch

from fedssl.core.fcl_loss import fcl_loss_terms, paired_local_positives
from fedssl.core.memory_bank import FeatureBank, sample_negatives
from fedssl.core.rng import owned_global_rng
from fedssl.core.seeds import derived_seed
from fedssl.core.spread import SpreadMeter
from fedssl.core.state_dict import ema_update
from fedssl.core.trainer import MixedPrecision


@dataclass
class FCLConfig:
    """Paper settings (FCL (Wu et al., MedIA 2022) section 5 "Training details")."""

    tau: float = 0.1
    momentum: float = 0.99  # m of the momentum encoder
    bank_size: int = 4096  # K
    lr: float = 0.05  # SGD, cosine decay over all rounds
    sgd_momentum: float = 0.9
    weight_decay: float = 1e-4
    num_rounds: int = 200
    feature_exchange: bool = True  # FE, eq. (1)
    negative_sampling: bool = True  # NS, eq. (2)
    structural_matching: bool = True  # GSM, eqs. (4)-(5); ignored with plain_moco
    plain_moco: bool = False  # positive = the other view of the same slice; no partition positives, no GSM

    def __post_init__(self) -> None:
        checks = {
            "tau": self.tau > 0,
            "momentum": 0.0 <= self.momentum < 1.0,
            "bank_size": self.bank_size > 0,
            "lr": self.lr > 0,
            "num_rounds": self.num_rounds > 0,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} is out of range (paper: {getattr(FCLConfig, name)})")


def cosine_lr(base_lr: float, progress: float) -> float:
    """lr * 0.5 * (1 + cos(pi * progress)), progress in [0, 1]."""
    return base_lr * 0.5 * (1.0 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))


class FCLTrainer:
    """Holds the MoCo model, the optimiser and the local bank of one client across rounds."""

    def __init__(
        self,
        model: torch.nn.Module,  # a fedssl.models.unet.MoCoUNetEncoder (core imports nothing from models)
        cfg: FCLConfig,
        augment: Callable[[torch.Tensor, torch.Generator], torch.Tensor],
        device: str | torch.device = "cpu",
        seed: int = 0,
        amp: bool = False,
    ):
        """``amp``: the encoders' forward passes in bfloat16 autocast on GPUs that support it (float16 with a
        gradient scaler on older ones; nothing on a CPU); the loss and the bank stay float32.  ``seed`` (the site's)
        drives the generator (augmentations, negative draws), the initial bank and the seed of every round's owned
        global RNG (:func:`fedssl.core.rng.owned_global_rng`)."""
        self.seed = int(seed)
        self.model = model.to(device)
        self.cfg = cfg
        self.augment = augment
        self.device = torch.device(device)
        self.precision = MixedPrecision(self.device, amp)
        self.generator = torch.Generator().manual_seed(seed)
        self.bank = FeatureBank(cfg.bank_size, model.proj_dim, seed=seed)
        self.optimizer = torch.optim.SGD(
            self.model.main.parameters(), lr=cfg.lr, momentum=cfg.sgd_momentum, weight_decay=cfg.weight_decay
        )

    def train_round(
        self,
        batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
        steps_per_round: int,
        round_idx: int,
        remote: tuple[torch.Tensor, torch.Tensor] | None = None,
        progress: Callable[[int, float], None] | None = None,
    ) -> dict:
        """One local epoch.  ``batches`` yields ``(x [V,S,1,H,W], part [V,S])``; ``remote`` is the
        exchanged bank ``(features [M,D], partitions [M])`` or None.  Returns loss statistics and
        ``feature_std``, the spread of the batch's query features averaged over the steps (0 = collapse, see
        :mod:`fedssl.core.spread`).  Runs in the owned global RNG of (seed, ``round_idx``)."""
        with owned_global_rng(derived_seed(self.seed, "fcl_round", round_idx), self.device):
            return self._train_round(batches, steps_per_round, round_idx, remote, progress)

    def _train_round(self, batches, steps_per_round: int, round_idx: int, remote, progress) -> dict:
        cfg = self.cfg
        if not cfg.feature_exchange:
            remote = None
        self.model.main.train()
        self.model.momentum.train()
        losses: list[float] = []
        terms: list[tuple[float, float]] = []
        spread = SpreadMeter()
        for step, (x, part) in enumerate(batches):
            v, s = int(x.shape[0]), int(x.shape[1])
            x = x.to(self.device, non_blocking=True).reshape(v * s, *x.shape[2:])  # [V*S, 1, H, W], volume-major
            part = part.to(self.device, non_blocking=True).reshape(v * s)
            lr = cosine_lr(cfg.lr, (round_idx * steps_per_round + step) / (cfg.num_rounds * steps_per_round))
            for g in self.optimizer.param_groups:
                g["lr"] = lr
            view_q = self.augment(x, self.generator)
            view_k = self.augment(x, self.generator)
            with self.precision.autocast():
                q = self.model.main(view_q)  # [N, D]
                with torch.no_grad():
                    k = self.model.momentum(view_k)  # [N, D]
            q, k = q.float(), k.float()
            spread.add(q)
            pos = k.unsqueeze(1) if cfg.plain_moco else paired_local_positives(k, v, s)  # [N, 1 or 2, D]
            neg, neg_part = sample_negatives(
                self.bank.features.to(self.device),
                self.bank.partitions.to(self.device),
                None if remote is None else remote[0].to(self.device),
                None if remote is None else remote[1].to(self.device),
                cfg.bank_size,
                self.generator,
                sample=cfg.negative_sampling,
            )
            gsm = cfg.structural_matching and not cfg.plain_moco
            loss_local, loss_remote = fcl_loss_terms(q, pos, part, neg, neg_part, cfg.tau, gsm=gsm)
            loss = loss_local + loss_remote
            if not torch.isfinite(loss):
                raise FloatingPointError(f"FCL loss became {loss.item()} at round {round_idx} step {step}; lower lr")
            self.precision.step(loss, self.optimizer)
            ema_update(self.model.momentum, self.model.main, cfg.momentum)
            self.bank.enqueue(k.detach().cpu(), part.detach().cpu())
            losses.append(float(loss.item()))
            terms.append((float(loss_local.item()), float(loss_remote.item())))
            if progress is not None:
                progress(step, losses[-1])
        if not losses:
            raise ValueError("no training batch in this round: the site has fewer volumes than one batch")
        n = len(losses)
        return {"loss": sum(losses) / n, "loss_local": sum(t[0] for t in terms) / n,
                "loss_remote": sum(t[1] for t in terms) / n, "steps": n, "lr_end": lr, "bank_filled": self.bank.filled,
                "feature_std": spread.mean}

    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "bank": self.bank.state_dict(),
            "generator": self.generator.get_state(),
            "config": asdict(self.cfg),
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.bank.load_state_dict(state["bank"])
        self.generator.set_state(state["generator"])
