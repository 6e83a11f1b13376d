"""FedCLF local pre-training and its baselines on one device, free of any FLARE type.

"Federated Self-Supervised Learning for Dermatological Disease Diagnosis" (FedCLF / FedMAE-KS), section III:
MoCo with a main and a momentum network; a local FIFO bank ``Q_l`` of the K latest momentum features (eq. 1,
uploaded every round); the remote bank ``Q_r`` = the other devices' banks (eq. 2, through the feature exchange);
the negatives ``Q_CL`` of the contrastive loss (eq. 6), built per round by the queue mode:

* ``"none"`` -- W/o FE (FedMoCo, Local CL; Fig. 6): ``Q_CL`` is MoCo's own queue, the local bank, and after each
  mini-batch its oldest B entries are replaced by the batch's momentum features;
* ``"fe"`` -- FE (eq. 4): ``Q_CL`` starts as ``Q_l`` and its oldest 2B entries are replaced by the batch's B
  momentum features plus B features drawn uniformly from ``Q_r`` (eq. 3);
* ``"fe_neg"`` -- FE+Neg (eq. 5), FedCLF: ``Q_CL`` starts as ``Q_r`` and its oldest B entries are replaced by B
  features drawn uniformly from ``Q_r``: no local negative at all.

Before a device has received a remote bank (the first round; the bank exchanged at the end of a round is the
next round's ``Q_r``), ``Q_r`` is the device's own bank as it stands at the start of the round: at round 0 MoCo's
initial random unit vectors, so no data of anyone.

The baselines of Tables I-III share the trainer: ``method="simclr"`` (FedSimCLR: NT-Xent over the two views of
the batch, Chen et al., ICML 2020) and ``method="rotation"`` (FedRotation: 4-way rotation prediction, Gidaris et
al., ICLR 2018).  SGD with momentum, cosine learning rate over all rounds (paper: lr 0.03, 100 rounds).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

from fedssl.core.checks import require, require_choice, require_int
from fedssl.core.fcl import cosine_lr
from fedssl.core.fcl_loss import contrastive_term
from fedssl.core.memory_bank import FeatureBank
from fedssl.core.rng import owned_global_rng
from fedssl.core.seeds import derived_seed
from fedssl.core.spread import SpreadMeter
from fedssl.core.state_dict import ema_update
from fedssl.core.trainer import MixedPrecision

METHODS = ("moco", "simclr", "rotation")
QUEUE_MODES = ("none", "fe", "fe_neg")
#: the rotation classes of FedRotation: k x 90 degrees
ROTATIONS = 4


@dataclass
class FedCLFConfig:
    """Paper settings (sec. V-A "Training details") where it gives them; MoCo v2's (Chen et al., 2020) where it
    is silent: tau 0.2, momentum 0.999, SGD momentum 0.9, weight decay 1e-4.  K: see ``jobs/fedclf_derm``."""

    method: str = "moco"
    queue: str = "fe_neg"
    tau: float = 0.2
    momentum: float = 0.999
    bank_size: int = 4096
    lr: float = 0.03
    sgd_momentum: float = 0.9
    weight_decay: float = 1e-4
    num_rounds: int = 100

    def __post_init__(self) -> None:
        name = type(self).__name__
        require_choice(name, "method", self.method, METHODS)
        require_choice(name, "queue", self.queue, QUEUE_MODES)
        require(self.method == "moco" or self.queue == "none", name, "queue", self.queue,
                f"only method='moco' has a negative queue; use queue='none' with method={self.method!r}")
        require(isinstance(self.tau, (int, float)) and self.tau > 0, name, "tau", self.tau, "use a temperature > 0 (MoCo v2: 0.2)")
        require(isinstance(self.momentum, (int, float)) and 0.0 <= self.momentum < 1.0, name, "momentum", self.momentum,
                "use a momentum in [0, 1) (MoCo v2: 0.999)")
        require_int(name, "bank_size", self.bank_size, 1, "use the bank size K (a positive integer)")
        require(isinstance(self.lr, (int, float)) and self.lr > 0, name, "lr", self.lr, "use a learning rate > 0 (paper: 0.03)")
        require_int(name, "num_rounds", self.num_rounds, 1, "use the number of rounds (paper: 100)")


class NegativeQueue:
    """``Q_CL``: a FIFO of ``[M, D]`` features whose oldest entries are replaced after each mini-batch; each entry
    remembers whether it came from the remote bank (for the round's ``queue_remote_fraction``)."""

    def __init__(self, features: torch.Tensor, remote: bool, oldest: int = 0):
        if features.dim() != 2 or features.shape[0] < 1:
            raise ValueError(f"a negative queue needs features [M, D] with M >= 1, got {tuple(features.shape)}")
        self.features = features.detach().clone()
        self.is_remote = torch.full((features.shape[0],), bool(remote))
        self.ptr = int(oldest) % int(features.shape[0])

    def __len__(self) -> int:
        return int(self.features.shape[0])

    @torch.no_grad()
    def replace_oldest(self, new: torch.Tensor, remote: torch.Tensor) -> None:
        """Put ``new [n, D]`` (``remote [n]`` bool) in place of the ``n`` oldest entries (n > M: the last M)."""
        n = int(new.shape[0])
        if n > len(self):
            new, remote, n = new[-len(self):], remote[-len(self):], len(self)
        idx = (self.ptr + torch.arange(n)) % len(self)
        self.features[idx.to(self.features.device)] = new.detach().to(self.features)
        self.is_remote[idx] = remote.cpu()
        self.ptr = int((self.ptr + n) % len(self))

    @property
    def remote_fraction(self) -> float:
        return float(self.is_remote.float().mean())


def sample_remote(remote: torch.Tensor, b: int, generator: torch.Generator) -> torch.Tensor:
    """Eq. (3): ``b`` features of ``remote [R, D]`` at indices drawn uniformly from [0, R - 1]."""
    idx = torch.randint(int(remote.shape[0]), (b,), generator=generator)
    return remote[idx.to(remote.device)]


def initial_queue(queue: str, bank: FeatureBank, remote: torch.Tensor) -> NegativeQueue:
    """``Q_CL`` at the start of a round: the local bank, oldest entry first where the bank's is (``none``, ``fe``),
    or the remote bank (``fe_neg``; the server shuffled it, so any entry may go first)."""
    return NegativeQueue(remote, True) if queue == "fe_neg" else NegativeQueue(bank.features, False, bank.ptr)


def queue_update(queue: str, keys: torch.Tensor, remote: torch.Tensor,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The features that replace the oldest of ``Q_CL`` after a mini-batch of momentum ``keys [B, D]`` and whether
    each is remote: ``none`` the keys; ``fe`` (eq. 4) the keys and B remote draws; ``fe_neg`` (eq. 5) B remote draws."""
    b = int(keys.shape[0])
    if queue == "none":
        return keys, torch.zeros(b, dtype=torch.bool)
    drawn = sample_remote(remote, b, generator).to(keys)
    if queue == "fe":
        return torch.cat([keys, drawn]), torch.cat([torch.zeros(b, dtype=torch.bool), torch.ones(b, dtype=torch.bool)])
    return drawn, torch.ones(b, dtype=torch.bool)


def info_nce(q: torch.Tensor, k: torch.Tensor, negatives: torch.Tensor, tau: float) -> torch.Tensor:
    """Eq. (6), batch mean: -log(e^{q.k+/tau} / (e^{q.k+/tau} + sum_{n in Q_CL} e^{q.n/tau}))."""
    return contrastive_term(q, k.unsqueeze(1), negatives, tau).mean()


def nt_xent(z1: torch.Tensor, z2: torch.Tensor, tau: float) -> torch.Tensor:
    """SimCLR's NT-Xent over the 2B normalised views of a batch: each view's positive is its other view, the
    2(B - 1) other views are its negatives."""
    z = torch.cat([z1, z2])  # [2B, D]
    b = int(z1.shape[0])
    logits = z @ z.t() / tau
    logits = logits.masked_fill(torch.eye(2 * b, dtype=torch.bool, device=z.device), float("-inf"))
    target = torch.cat([torch.arange(b, 2 * b), torch.arange(0, b)]).to(z.device)
    return F.cross_entropy(logits, target)


def rotated_batch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every image of ``x [B, C, H, W]`` (square) rotated by 0, 90, 180 and 270 degrees: ``[4B, C, H, W]`` and the
    rotation labels ``[4B]`` (block r holds rotation r)."""
    if x.shape[-1] != x.shape[-2]:
        raise ValueError(f"rotation prediction needs square images, got {tuple(x.shape[-2:])}")
    views = torch.cat([torch.rot90(x, r, dims=(-2, -1)) for r in range(ROTATIONS)])
    labels = torch.arange(ROTATIONS).repeat_interleave(int(x.shape[0])).to(x.device)
    return views, labels


class FedCLFTrainer:
    """The model, optimiser, local bank and generator of one device across rounds.

    ``model``: ``method="moco"`` a network with ``main``, ``momentum`` (MoCo pair) and ``proj_dim``; ``"simclr"``
    one with ``main`` (normalised features); ``"rotation"`` one whose forward gives the 4 rotation logits.  The
    local bank exists for every method (it is what ``export_bank`` uploads with feature exchange), but only MoCo
    fills and uses it."""

    def __init__(self, model: torch.nn.Module, cfg: FedCLFConfig, device: str | torch.device = "cpu", seed: int = 0,
                 amp: bool = False):
        """``amp``: the network's forward passes in bfloat16 autocast on GPUs that support it
        (:class:`fedssl.core.trainer.MixedPrecision`; nothing on a CPU); losses, queue and bank stay float32.
        ``seed`` (the device's) drives the generator (remote draws), the initial bank and the seed of every round's
        owned global RNG (:func:`fedssl.core.rng.owned_global_rng`)."""
        self.seed = int(seed)
        self.model = model.to(device)
        self.cfg = cfg
        self.device = torch.device(device)
        self.precision = MixedPrecision(self.device, amp)
        self.generator = torch.Generator().manual_seed(seed)
        dim = int(getattr(model, "proj_dim", 1))
        self.bank = FeatureBank(cfg.bank_size, dim, seed=seed)
        trained = model.main.parameters() if cfg.method == "moco" else model.parameters()
        self.optimizer = torch.optim.SGD(trained, lr=cfg.lr, momentum=cfg.sgd_momentum, weight_decay=cfg.weight_decay)
        #: the last round's Q_CL (MoCo), for inspection; rebuilt at the start of every round
        self.queue: NegativeQueue | None = None

    def _moco_step(self, v1: torch.Tensor, v2: torch.Tensor, queue: NegativeQueue,
                   remote: torch.Tensor, spread: SpreadMeter) -> torch.Tensor:
        with self.precision.autocast():
            q = self.model.main(v1)
            with torch.no_grad():
                k = self.model.momentum(v2)
        q, k = q.float(), k.float()
        spread.add(q)
        loss = info_nce(q, k, queue.features.to(self.device), self.cfg.tau)
        self._step(loss)
        ema_update(self.model.momentum, self.model.main, self.cfg.momentum)
        keys = k.detach().cpu()
        self.bank.enqueue(keys, torch.zeros(keys.shape[0], dtype=torch.long))
        queue.replace_oldest(*queue_update(self.cfg.queue, keys, remote, self.generator))
        return loss

    def _simclr_step(self, v1: torch.Tensor, v2: torch.Tensor, spread: SpreadMeter) -> torch.Tensor:
        with self.precision.autocast():
            z1, z2 = self.model.main(v1), self.model.main(v2)
        z1, z2 = z1.float(), z2.float()
        spread.add(z1)
        loss = nt_xent(z1, z2, self.cfg.tau)
        self._step(loss)
        return loss

    def _rotation_step(self, v1: torch.Tensor) -> tuple[torch.Tensor, float]:
        x, y = rotated_batch(v1)
        with self.precision.autocast():
            logits = self.model(x)
        logits = logits.float()
        loss = F.cross_entropy(logits, y)
        self._step(loss)
        return loss, float((logits.argmax(1) == y).float().mean())

    def _step(self, loss: torch.Tensor) -> None:
        if not torch.isfinite(loss):
            raise FloatingPointError(f"{self.cfg.method} loss became {loss.item()}; lower lr")
        self.precision.step(loss, self.optimizer)

    def train_round(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], steps_per_round: int, round_idx: int,
                    remote: torch.Tensor | None = None,
                    progress: Callable[[int, float], None] | None = None) -> dict:
        """One local epoch over ``batches`` of two augmented views ``(v1 [B, 3, S, S], v2 [B, 3, S, S])`` (rotation
        uses ``v1``); ``remote``: ``Q_r [R, D]`` (unit features) or None.  Returns the mean loss, steps, the final
        lr, the bank fill, ``feature_std`` (0 = collapse), the ``Q_CL`` size and its remote fraction at the end
        (MoCo), or the rotation accuracy.  Runs in the owned global RNG of (seed, ``round_idx``)."""
        with owned_global_rng(derived_seed(self.seed, "fedclf_round", round_idx), self.device):
            return self._train_round(batches, steps_per_round, round_idx, remote, progress)

    def _train_round(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], steps_per_round: int, round_idx: int,
                     remote: torch.Tensor | None, progress: Callable[[int, float], None] | None) -> dict:
        cfg = self.cfg
        self.model.train()
        if cfg.method == "moco":
            self.model.momentum.train()
            remote = self.bank.features.clone() if remote is None else remote.detach().to(torch.float32).cpu()
            queue = self.queue = initial_queue(cfg.queue, self.bank, remote)
        losses, accuracies, spread, lr = [], [], SpreadMeter(), cfg.lr
        for step, (v1, v2) in enumerate(batches):
            lr = cosine_lr(cfg.lr, (round_idx * steps_per_round + step) / (cfg.num_rounds * steps_per_round))
            for g in self.optimizer.param_groups:
                g["lr"] = lr
            v1, v2 = v1.to(self.device, non_blocking=True), v2.to(self.device, non_blocking=True)
            if cfg.method == "moco":
                loss = self._moco_step(v1, v2, queue, remote, spread)
            elif cfg.method == "simclr":
                loss = self._simclr_step(v1, v2, spread)
            else:
                loss, acc = self._rotation_step(v1)
                accuracies.append(acc)
            losses.append(float(loss.item()))
            if progress is not None:
                progress(step, losses[-1])
        if not losses:
            raise ValueError("no training batch in this round: the device has fewer images than one batch")
        out = {"loss": sum(losses) / len(losses), "steps": len(losses), "lr_end": lr}
        if cfg.method == "moco":
            out.update(bank_filled=self.bank.filled, queue_size=len(queue), queue_remote_fraction=queue.remote_fraction)
        if spread.mean is not None:
            out["feature_std"] = spread.mean
        if accuracies:
            out["rotation_accuracy"] = sum(accuracies) / len(accuracies)
        return out

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "bank": self.bank.state_dict(),
                "generator": self.generator.get_state(), "config": asdict(self.cfg)}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.bank.load_state_dict(state["bank"])
        self.generator.set_state(state["generator"])
