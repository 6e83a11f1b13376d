"""FedCLF pre-training and its baselines on one device as a LocalTrainer ("Federated Self-Supervised Learning for
Dermatological Disease Diagnosis", FedCLF / FedMAE-KS, sections III and V-A): its settings and its loop.

:class:`FedCLFSettings` is every setting of the method, declared once: the job arguments of ``FedCLFExecutor``
(which builds and checks it) and what :class:`FedCLFLocalTrainer` reads.  The trainer holds the network, the
optimiser, the local bank ``Q_l``, the generator and the device's unlabelled training images as MoCo v2 view pairs
(:class:`fedssl.data.views.TwoViewDataset`); the queue modes and losses it trains with are
:mod:`fedssl.core.fedclf`'s.  One round = one local epoch of
``batch_size`` images (the last incomplete batch dropped, as MoCo does; at most ``max_steps_per_round`` steps,
0 = all).  The methods, each a switch of the same trainer:

=============  ==========  ============  =========================================================
method          network     queue         what is exchanged (the executor decides the federation)
=============  ==========  ============  =========================================================
FedCLF          MoCo        ``fe_neg``    weights + local bank (eq. 5: negatives only remote)
FE (Fig. 6)     MoCo        ``fe``        weights + local bank (eq. 4: local + remote negatives)
FedMoCo         MoCo        ``none``      weights (W/o FE)
Local CL        MoCo        ``none``      nothing
FedSimCLR       SimCLR      ``none``      weights
FedRotation     Rotation    ``none``      weights
=============  ==========  ============  =========================================================

Randomness: the initial weights are the same on every device (the models seed their own construction, as the
server's model component does); batch order, augmentations, the initial bank and remote draws use
:func:`fedssl.core.seeds.site_seed` of the job seed and the device name, and each round runs in the owned global RNG of
(that seed, round) (:meth:`FedCLFLocalTrainer.train_batches`), so nothing draws from, or moves, the
process's global generators.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from fedssl.core.chance import infonce_chance, nt_xent_chance, uniform_chance
from fedssl.core.checks import require, require_amp, require_choice, require_int, require_workers
from fedssl.core.fedclf import (METHODS, QUEUE_MODES, ROTATIONS, NegativeQueue, info_nce, initial_queue, nt_xent,
                                queue_update, rotated_batch)
from fedssl.core.memory_bank import FeatureBank
from fedssl.core.rng import owned_global_rng
from fedssl.core.schedule import cosine_lr
from fedssl.core.seeds import derived_seed, site_seed
from fedssl.core.spread import SpreadMeter
from fedssl.core.state_dict import ema_update
from fedssl.core.trainer import MixedPrecision, RoundStats, check_stop
from fedssl.data.images import ImageRecord
from fedssl.data.loading import load_batches, loader_options
from fedssl.data.views import TwoViewDataset
from fedssl.train.pretraining import Pretrainer
from fedssl.models.resnet import PAPER_DEPTH, PAPER_PROJ_DIM, PAPER_WIDTH, PretrainingResNet, require_resnet_args


@dataclass(frozen=True)
class FedCLFSettings:
    """Paper settings as defaults (sec. V-A "Training details": batch 128, lr 0.03 cosine, 100 rounds of 1 local
    epoch); MoCo v2's (Chen et al., 2020) where the paper is silent: tau 0.2, momentum 0.999, SGD momentum 0.9,
    weight decay 1e-4.  K: see ``jobs/fedclf_derm``.

    data_root: the device folder (``train/``, ``val/``, ``test/`` class folders); "" = site config /
        FEDSSL_DATA_ROOT.  Pre-training reads ``<data_root>/<split>`` without labels.
    split: "train" / "val" / "test", or "" = ``data_root`` itself (a partition site of ``fedssl sslfl
        partition``, e.g. FedMAE-KS's ISIC 2019 shards for Table III's CNN rows).
    dataset: the layout of the device folder (:mod:`fedssl.data.images`).
    image_size: the crop fed to the network (images are stored at 72 px shorter edge).
    method: "moco" (FedCLF, FE, FedMoCo, Local CL), "simclr" (FedSimCLR) or "rotation" (FedRotation).
    queue: "fe_neg" (FedCLF, eq. 5), "fe" (eq. 4) or "none" (W/o FE: FedMoCo, Local CL, SimCLR, Rotation).
    federated: false = Local CL: nothing uploaded, the aggregate never loaded (needs queue "none").
    width: ResNet stage width (64 = torchvision's; smaller for CPU profiles); proj_dim: the projection width.
    depth: 18 (FedCLF's ResNet-18) or 50 (ResNet-50, FedMAE-KS's CNN baselines).
    batch_size, lr, tau, momentum (of the momentum network), bank_size (K of the local bank Q_l).
    max_steps_per_round: 0 = one full local epoch; > 0 caps the steps (quick CPU profile).
    seed: the job seed (the data side of a device draws from ``site_seed(seed, device name)``).
    device: "auto" (CUDA when available), "cpu", "cuda", "cuda:1" ...
    amp: bfloat16 autocast on GPUs that support it (float16 + gradient scaler on older ones); losses, queue and bank
        stay float32.
    workers: DataLoader worker processes that build the next batches (0 = in the training process; the batches are
        the same either way); batches are pinned on a CUDA device.
    """

    data_root: str = ""
    split: str = "train"
    dataset: str = "derm5"
    image_size: int = 64
    method: str = "moco"
    queue: str = "fe_neg"
    federated: bool = True
    width: int = PAPER_WIDTH
    proj_dim: int = PAPER_PROJ_DIM
    batch_size: int = 128
    lr: float = 0.03
    tau: float = 0.2
    momentum: float = 0.999
    bank_size: int = 4096
    max_steps_per_round: int = 0
    seed: int = 0
    device: str = "auto"
    depth: int = PAPER_DEPTH
    amp: bool = False
    workers: int = 0
    #: the optimiser's fixed constants (MoCo v2)
    sgd_momentum: ClassVar[float] = 0.9
    weight_decay: ClassVar[float] = 1e-4

    def check(self, name: str) -> None:
        """Every argument checked; a ValueError names component ``name``, the argument, its value and the fix."""
        require(isinstance(self.data_root, str), name, "data_root", self.data_root, 'use a path string or ""')
        require_choice(name, "split", self.split, ("train", "val", "test", ""))
        require_choice(name, "method", self.method, METHODS)
        require_choice(name, "queue", self.queue, QUEUE_MODES)
        require(isinstance(self.federated, bool), name, "federated", self.federated, "use true or false")
        require(self.federated or self.queue == "none", name, "queue", self.queue,
                'Local CL (federated=false) exchanges nothing: use queue="none"')
        require_int(name, "image_size", self.image_size, 8, "use the crop size in pixels (images are 72 px high)")
        require_resnet_args(name, self.width, self.proj_dim, self.depth)
        require_int(name, "batch_size", self.batch_size, 2, "use a batch of at least 2 images (paper: 128)")
        require_int(name, "max_steps_per_round", self.max_steps_per_round, 0,
                    "use 0 (full epoch) or a positive step count")
        require_int(name, "seed", self.seed, 0, "use a non-negative integer")
        require(self.method == "moco" or self.queue == "none", name, "queue", self.queue,
                f"only method='moco' has a negative queue; use queue='none' with method={self.method!r}")
        require(isinstance(self.tau, (int, float)) and self.tau > 0, name, "tau", self.tau,
                "use a temperature > 0 (MoCo v2: 0.2)")
        require(isinstance(self.momentum, (int, float)) and 0.0 <= self.momentum < 1.0, name, "momentum", self.momentum,
                "use a momentum in [0, 1) (MoCo v2: 0.999)")
        require_int(name, "bank_size", self.bank_size, 1, "use the bank size K (a positive integer)")
        require(isinstance(self.lr, (int, float)) and self.lr > 0, name, "lr", self.lr,
                "use a learning rate > 0 (paper: 0.03)")
        require_amp(name, self.amp)
        require_workers(name, self.workers)

    @property
    def exchanges_features(self) -> bool:
        """Feature exchange in effect: federated with a queue that uses the remote bank."""
        return self.federated and self.queue != "none"


def view_batches(dataset: TwoViewDataset, batch_size: int, seed: int, epoch: int, max_steps: int = 0, *,
                 workers: int = 0, pin_memory: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Shuffled full batches ``(v1 [B, 3, S, S], v2 [B, 3, S, S])`` of one epoch (order from ``(seed, epoch)``);
    ``workers`` / ``pin_memory``: :func:`fedssl.data.loading.load_batches` (the same batches)."""
    dataset.set_epoch(epoch)
    order = np.random.default_rng([int(seed), int(epoch)]).permutation(len(dataset))
    starts = range(0, len(order) - batch_size + 1, batch_size)
    if max_steps:
        starts = starts[:max_steps]
    yield from load_batches(dataset, [order[start:start + batch_size] for start in starts], workers=workers,
                            pin_memory=pin_memory)


class FedCLFLocalTrainer(Pretrainer):
    """One device's pre-training (a ``LocalTrainer``) with the settings of a :class:`FedCLFSettings`.

    ``model``: by default the settings' :class:`fedssl.models.resnet.PretrainingResNet` (the same initial weights on
    every device); a network given instead (tests: a hand-checkable one) must be, for ``method="moco"``, one with
    ``main``, ``momentum`` and ``proj_dim``; ``"simclr"`` one with ``main`` (normalised features); ``"rotation"``
    one whose forward gives the 4 rotation logits.  The local bank exists for every method (it is what
    ``export_bank`` uploads with feature exchange), but only MoCo fills and uses it.  ``device``: the torch device
    (the executor resolves the settings' "auto").
    """

    method_name = "FedCLF"
    finetune_hint = "jobs/fedclf_derm_finetune"
    global_name = "the global pre-training model"

    def __init__(self, records: Sequence[ImageRecord], settings: FedCLFSettings, *, num_rounds: int,
                 device: str | torch.device = "cpu", site: str = "", model: torch.nn.Module | None = None):
        name = type(self).__name__
        settings.check(name)
        require_int(name, "num_rounds", num_rounds, 1, "use the number of rounds (paper: 100)")
        s, records = settings, list(records)
        self.settings, self.num_rounds, self.workers = s, int(num_rounds), int(s.workers)
        if len(records) < s.batch_size:
            raise ValueError(f"{site or 'this device'}: {len(records)} training images cannot fill one batch of "
                             f"{s.batch_size}; lower batch_size")
        self.data_seed = site_seed(s.seed, site)
        self.dataset = TwoViewDataset(records, s.image_size, s.dataset, site=site, seed=self.data_seed)
        if model is None:
            model = PretrainingResNet(s.method, s.width, s.proj_dim, seed=s.seed, depth=s.depth)
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.precision = MixedPrecision(self.device, s.amp)
        self.generator = torch.Generator().manual_seed(self.data_seed)
        self.bank = FeatureBank(s.bank_size, int(getattr(model, "proj_dim", 1)), seed=self.data_seed)
        trained = model.main.parameters() if s.method == "moco" else model.parameters()
        self.optimizer = torch.optim.SGD(trained, lr=s.lr, momentum=s.sgd_momentum, weight_decay=s.weight_decay)
        self.batch_size, self.max_steps_per_round = s.batch_size, int(s.max_steps_per_round)
        #: the last round's Q_CL (MoCo), for inspection; rebuilt at the start of every round
        self.queue: NegativeQueue | None = None
        #: the other devices' features as delivered, each once, kept in a FIFO of K of this device's own
        self.remote_bank = FeatureBank(s.bank_size, self.bank.dim, seed=derived_seed(self.data_seed, "remote"))
        #: Q_r [R, D] trained with: the FIFO's filled rows, or None
        self.remote: torch.Tensor | None = None

    @property
    def steps_per_round(self) -> int:
        full = len(self.dataset) // self.batch_size
        return min(full, self.max_steps_per_round) if self.max_steps_per_round else full

    # ------------------------------------------------------------------ the exchanged banks
    def set_remote(self, features: object | None, marks: object | None = None) -> None:
        """Add a delivery of the other devices' features (eq. 2; ``marks``: their fill marks, 0 = filled, default all
        filled) to this device's remote FIFO (each arrives once; the FIFO keeps the latest K); None: nothing
        delivered.  Q_r for the next rounds is the FIFO's filled rows.  ValueError on a shape other than [R, D]."""
        if features is not None:
            n = int(np.shape(features)[0]) if np.ndim(features) else 0
            self.remote_bank.receive(features, np.zeros(n, np.int64) if marks is None else marks)
        self.remote = self.remote_bank.filled_rows()[0] if self.remote_bank.filled else None

    def export_bank(self) -> tuple[np.ndarray, np.ndarray]:
        """Q_l's rows taken in since the last call, each shared once: float32 ``[n, D]`` features and int64 ``[n]``
        fill marks (0), n <= K."""
        return self.bank.export_fresh()

    # ------------------------------------------------------------------ LocalTrainer
    def train_round(self, round_idx: int, should_stop: Callable[[], bool] | None = None) -> RoundStats:
        check_stop(should_stop)
        curve = []

        def progress(step: int, loss: float) -> None:
            curve.append({"loss": loss, "lr": float(self.optimizer.param_groups[0]["lr"])})
            check_stop(should_stop)

        batches = view_batches(self.dataset, self.batch_size, self.data_seed, round_idx, self.max_steps_per_round,
                               **loader_options(self.workers, self.device))
        out = self.train_batches(batches, self.steps_per_round, round_idx, self.remote, progress)
        metrics = {k: v for k, v in out.items() if k not in ("loss", "steps")}
        metrics["lr"] = out["lr_end"]
        metrics["remote_features"] = 0 if self.remote is None else int(self.remote.shape[0])
        if "bank_filled" in out:
            metrics["bank_fill"] = out["bank_filled"] / self.bank.capacity
        return RoundStats(loss=out["loss"], steps=out["steps"], samples=len(self.dataset), metrics=metrics, curve=curve)

    # ------------------------------------------------------------------ the loop
    def train_batches(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], steps_per_round: int,
                      round_idx: int, remote: torch.Tensor | None = None,
                      progress: Callable[[int, float], None] | None = None) -> dict:
        """One local epoch over ``batches`` of two augmented views ``(v1 [B, 3, S, S], v2 [B, 3, S, S])`` (rotation
        uses ``v1``); ``remote``: ``Q_r [R, D]`` (unit features) or None.  Returns the mean loss, steps, the final
        lr, the bank fill, ``feature_std`` (0 = collapse), the ``Q_CL`` size and its remote fraction at the end
        (MoCo), or the rotation accuracy, and ``chance_loss``: the loss's chance level averaged over the steps
        (:mod:`fedssl.core.chance`: MoCo ln(|Q_CL| + 1), SimCLR ln(2B - 1), rotation ln 4).  Runs in the owned global
        RNG of (data seed, ``round_idx``)."""
        with owned_global_rng(derived_seed(self.data_seed, "fedclf_round", round_idx), self.device):
            return self._train_batches(batches, steps_per_round, round_idx, remote, progress)

    def _moco_step(self, v1: torch.Tensor, v2: torch.Tensor, queue: NegativeQueue,
                   remote: torch.Tensor, spread: SpreadMeter) -> torch.Tensor:
        with self.precision.autocast():
            q = self.model.main(v1)
            with torch.no_grad():
                k = self.model.momentum(v2)
        q, k = q.float(), k.float()
        spread.add(q)
        loss = info_nce(q, k, queue.features.to(self.device), self.settings.tau)
        self._step(loss)
        ema_update(self.model.momentum, self.model.main, self.settings.momentum)
        keys = k.detach().cpu()
        self.bank.enqueue(keys, torch.zeros(keys.shape[0], dtype=torch.long))
        queue.replace_oldest(*queue_update(self.settings.queue, keys, remote, self.generator))
        return loss

    def _simclr_step(self, v1: torch.Tensor, v2: torch.Tensor, spread: SpreadMeter) -> torch.Tensor:
        with self.precision.autocast():
            z1, z2 = self.model.main(v1), self.model.main(v2)
        z1, z2 = z1.float(), z2.float()
        spread.add(z1)
        loss = nt_xent(z1, z2, self.settings.tau)
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
            raise FloatingPointError(f"{self.settings.method} loss became {loss.item()}; lower lr")
        self.precision.step(loss, self.optimizer)

    def _train_batches(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], steps_per_round: int,
                       round_idx: int, remote: torch.Tensor | None,
                       progress: Callable[[int, float], None] | None) -> dict:
        s = self.settings
        self.model.train()
        if s.method == "moco":
            self.model.momentum.train()
            remote = self.bank.features.clone() if remote is None else remote.detach().to(torch.float32).cpu()
            queue = self.queue = initial_queue(s.queue, self.bank, remote)
        losses, accuracies, chances, spread, lr = [], [], [], SpreadMeter(), s.lr
        for step, (v1, v2) in enumerate(batches):
            lr = cosine_lr(s.lr, (round_idx * steps_per_round + step) / (self.num_rounds * steps_per_round))
            for g in self.optimizer.param_groups:
                g["lr"] = lr
            v1, v2 = v1.to(self.device, non_blocking=True), v2.to(self.device, non_blocking=True)
            if s.method == "moco":
                chances.append(infonce_chance(len(queue)))
                loss = self._moco_step(v1, v2, queue, remote, spread)
            elif s.method == "simclr":
                chances.append(nt_xent_chance(int(v1.shape[0])))
                loss = self._simclr_step(v1, v2, spread)
            else:
                chances.append(uniform_chance(ROTATIONS))
                loss, acc = self._rotation_step(v1)
                accuracies.append(acc)
            losses.append(float(loss.item()))
            if progress is not None:
                progress(step, losses[-1])
        if not losses:
            raise ValueError("no training batch in this round: the device has fewer images than one batch")
        out = {"loss": sum(losses) / len(losses), "steps": len(losses), "lr_end": lr,
               "chance_loss": sum(chances) / len(chances)}
        if s.method == "moco":
            out.update(bank_filled=self.bank.filled, queue_size=len(queue), queue_remote_fraction=queue.remote_fraction)
        if spread.mean is not None:
            out["feature_std"] = spread.mean
        if accuracies:
            out["rotation_accuracy"] = sum(accuracies) / len(accuracies)
        return out

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "bank": self.bank.state_dict(), "remote_bank": self.remote_bank.state_dict(),
                "generator": self.generator.get_state(),
                "config": {**asdict(self.settings), "num_rounds": self.num_rounds}}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.bank.load_state_dict(state["bank"])
        if "remote_bank" in state:  # checkpoints before the remote FIFO start it empty
            self.remote_bank.load_state_dict(state["remote_bank"])
            self.remote = self.remote_bank.filled_rows()[0] if self.remote_bank.filled else None
        self.generator.set_state(state["generator"])
