"""FCL pre-training on one site (FCL (Wu et al., MedIA 2022) section 3, Fig. 2) as a LocalTrainer: its settings and
its loop.

:class:`FCLSettings` is every setting of the method, declared once: the job arguments of ``FCLExecutor`` (which
builds and checks it) and what :class:`FCLLocalTrainer` reads.  The trainer holds the MoCo model (main + momentum
encoder), the optimiser, the local FIFO bank of momentum features with partition ids, the generator and the site's
:class:`fedssl.data.acdc.PartitionSampleDataset` (one slice from each of the S partitions of every unlabelled
volume).  One round = one local epoch of batches of ``batch_size // n_partitions`` volumes (at most
``max_steps_per_round`` of them; 0 = all), with feature exchange (FE, eq. 1), negative sampling (NS, eq. 2) and
global structural matching (GSM, eqs. 4-5), each a switch.  ``plain_moco`` replaces FCL's cross-volume partition
positives (sec. 3.2) by MoCo's own positive, the other augmented view of the same slice (He et al., 2020), and
turns GSM off: with FE off that is FedMoCo, the "Without FE" row of Table 6 (its numbers equal FedMoCo's in
Tables 1 and 7).  ``federated=false`` is Local CL: no exchange at all (the executor uploads nothing).
``objective`` "rotation" / "simclr" are the FedRotation / FedSimCLR baselines of sec. 5 "Baselines" on the same data
and U-Net encoder, trained by :mod:`fedssl.train.fcl_baselines` (one trainer per method; the settings stay here).

What crosses the wire besides the model: the remote bank (the other sites' features, in through
:meth:`FCLLocalTrainer.set_remote`) and this site's bank (out through :meth:`FCLLocalTrainer.export_bank`).

Randomness (issue 13 item 9): the initial weights are the same at every site (``MoCoUNetEncoder`` seeds its own
construction, as the server's model component does); everything data-side (partition slices, batch order,
augmentations, the initial bank, negative draws) uses :func:`fedssl.core.seeds.site_seed` of the job seed and the
site name, so sites draw independently and each site is reproducible; each round runs in the owned global RNG of
(that seed, round) (:func:`fedssl.core.rng.owned_global_rng`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import ClassVar

import numpy as np
import torch

from fedssl.core.chance import infonce_chance
from fedssl.core.checks import require, require_amp, require_choice, require_int, require_workers
from fedssl.core.fcl_loss import fcl_loss_terms, paired_local_positives
from fedssl.core.memory_bank import FeatureBank, sample_negatives
from fedssl.core.rng import owned_global_rng
from fedssl.core.schedule import cosine_lr
from fedssl.core.seeds import derived_seed, site_seed
from fedssl.core.spread import SpreadMeter
from fedssl.core.state_dict import ema_update
from fedssl.core.trainer import MixedPrecision, RoundStats, check_stop
from fedssl.data.acdc import PartitionSampleDataset
from fedssl.data.loading import loader_options
from fedssl.data.transforms import augment_views
from fedssl.data.volume import Volume
from fedssl.models.unet import (HEADS, NORMS, OBJECTIVES, PAPER_FEATURES, MoCoUNetEncoder, require_objective,
                                require_unet_args)
from fedssl.train.pretraining import Pretrainer


@dataclass(frozen=True)
class FCLSettings:
    """Paper settings as defaults (FCL (Wu et al., MedIA 2022) section 5, "Training details").

    data_root: the site's folder of ``patientNNN`` folders; "" = site config / FEDSSL_DATA_ROOT.
    image_size, target_spacing: the slices' size in pixels and in-plane spacing in mm (paper: 192, 1.25).
    frames: "all" = every frame of each patient's 4D cine (sec. 5.1: "about 15 volumes covering a full cardiac
        cycle" per patient, the default); "ed_es" = only the two annotated frames.
    n_partitions: S, the partitions of a volume (paper: 4).  features, proj_dim: the U-Net encoder's channels and
        the projection size.
    norm: "batch" (default: BatchNorm after every convolution, as the reference code of Chaitanya et al. 2020 on
        which FCL builds) or "instance" (MONAI's default); head: "flatten" (default: the reference's flatten ->
        1024 -> proj_dim) or "grid" (2 x 2 pooled); see :mod:`fedssl.models.unet`.  Fine-tuning must use the
        same norm.
    objective: "fcl" (MoCo: FCL, FedMoCo, Local CL, :class:`FCLLocalTrainer`), "rotation" (FedRotation: 4-way
        rotation prediction, Gidaris et al. 2018, :class:`fedssl.train.fcl_baselines.FedRotationTrainer`) or
        "simclr" (FedSimCLR: NT-Xent over the batch's two views at ``tau``, Chen et al. 2020,
        :class:`fedssl.train.fcl_baselines.FedSimCLRTrainer`); FCL sec. 5 "Baselines" pre-trains the same encoder
        with FedAvg.  "rotation" and "simclr" exchange no feature (``feature_exchange`` must be false) and use none
        of the MoCo settings (``momentum``, ``bank_size``, ``negative_sampling``, ``structural_matching``,
        ``plain_moco``); the server's model must have the same objective (``shape.objective``).
    batch_size: 2D images per mini-batch (= volumes per batch x n_partitions; 32 = 8 x 4).
    lr: SGD (momentum :attr:`sgd_momentum`, weight decay :attr:`weight_decay`), cosine decay over all rounds.
    tau: the temperature (MoCo's InfoNCE, SimCLR's NT-Xent); momentum: m of the momentum encoder; bank_size: K of
        the local bank.
    feature_exchange / negative_sampling / structural_matching: FE / NS / GSM (Table 6).
    plain_moco: true = MoCo's positive (the other view of the same slice), no partition positives, no GSM.
        FedMoCo and Table 6 "Without FE" = plain_moco true + feature_exchange false.
    federated: false = Local CL: no feature exchange, nothing uploaded, the aggregate never loaded.
    max_steps_per_round: 0 = one full local epoch; > 0 caps the steps (quick CPU profile).
    seed: the job seed (the data side of a site draws from ``site_seed(seed, site)``).
    device: "auto" (CUDA when available), "cpu", "cuda", "cuda:1" ...
    amp: bfloat16 autocast of the encoders on GPUs that support it (float16 + gradient scaler on older ones); loss
        and bank stay float32; no effect on a CPU.
    workers: DataLoader worker processes that build the next batches (0 = in the training process; the batches are
        the same either way); batches are pinned on a CUDA device.
    channels_last: the encoders' weights and the batches in channels-last memory format (off by default; on an
        H200 the encoder's compute alone took 20.6 ms instead of 27.4 ms a step, 15.2 ms with ``amp``, experiments/
        fcl_step.py); the numbers differ from the default format's in the last bits.
    """

    data_root: str = ""
    image_size: int = 192
    target_spacing: float = 1.25
    frames: str = "all"
    n_partitions: int = 4
    features: Sequence[int] = PAPER_FEATURES
    norm: str = NORMS[0]
    head: str = HEADS[0]
    proj_dim: int = 128
    objective: str = OBJECTIVES[0]
    batch_size: int = 32
    lr: float = 0.05
    tau: float = 0.1
    momentum: float = 0.99
    bank_size: int = 4096
    feature_exchange: bool = True
    negative_sampling: bool = True
    structural_matching: bool = True
    plain_moco: bool = False
    federated: bool = True
    max_steps_per_round: int = 0
    seed: int = 0
    device: str = "auto"
    amp: bool = False
    workers: int = 0
    channels_last: bool = False
    #: the optimiser's fixed constants (FCL section 5: SGD momentum 0.9, weight decay 0.0001)
    sgd_momentum: ClassVar[float] = 0.9
    weight_decay: ClassVar[float] = 1e-4

    def check(self, name: str) -> None:
        """Every argument checked; a ValueError names component ``name``, the argument, its value and the fix."""
        require(isinstance(self.data_root, str), name, "data_root", self.data_root, "use a path string or \"\"")
        require_unet_args(name, self.features, self.image_size, self.norm, self.head)
        require(self.target_spacing > 0, name, "target_spacing", self.target_spacing,
                "use a spacing in mm, paper: 1.25")
        require_choice(name, "frames", self.frames, ("ed_es", "all"))
        require(isinstance(self.n_partitions, int) and self.n_partitions >= 1, name, "n_partitions", self.n_partitions,
                "paper: 4")
        least = 2 * self.n_partitions  # n_partitions is an int >= 1 here
        require(isinstance(self.batch_size, int) and self.batch_size >= least, name, "batch_size", self.batch_size,
                f"need at least 2 volumes per batch: batch_size >= 2 * n_partitions = {least}")
        for flag in ("feature_exchange", "negative_sampling", "structural_matching", "plain_moco", "federated",
                     "channels_last"):
            require(isinstance(getattr(self, flag), bool), name, flag, getattr(self, flag), "use true or false")
        require_objective(name, self.objective)
        require(self.objective == "fcl" or not self.feature_exchange, name, "feature_exchange", self.feature_exchange,
                f"objective={self.objective!r} exchanges no feature (FedAvg of the weights only, FCL sec. 5 "
                "'Baselines'): set feature_exchange=false and server.aggregator.collectors=[]")
        require_int(name, "max_steps_per_round", self.max_steps_per_round, 0,
                    "use 0 (full epoch) or a positive step count")
        require_amp(name, self.amp)
        require_workers(name, self.workers)
        for arg, ok in (("tau", self.tau > 0), ("momentum", 0.0 <= self.momentum < 1.0),
                        ("bank_size", self.bank_size > 0), ("lr", self.lr > 0)):
            require(ok, name, arg, getattr(self, arg), f"out of range (paper: {getattr(FCLSettings, arg)})")

    @property
    def exchanges_features(self) -> bool:
        """Feature exchange in effect: requested and federated (Local CL exchanges nothing)."""
        return self.feature_exchange and self.federated


def require_settings_objective(component: str, settings: FCLSettings, objective: str) -> None:
    """A trainer of ``objective`` refuses settings of another objective, naming where its trainer is."""
    require(settings.objective == objective, component, "objective", settings.objective,
            f"{component} trains objective {objective!r}; build the trainer of {settings.objective!r} with "
            "fedssl.train.fcl_baselines.trainer_class")


def site_partitions(s: FCLSettings, volumes: Iterable, site: str) -> tuple[int, PartitionSampleDataset, int]:
    """A site's pre-training data as every ACDC pre-training trainer draws it: (its data seed ``site_seed(seed,
    site)``, the partition-sampling dataset of its volumes, volumes per batch = batch_size / n_partitions).  Raises
    ValueError when the site's volumes cannot fill one batch."""
    volumes = list(volumes)
    data_seed = site_seed(s.seed, site)
    per_batch = s.batch_size // s.n_partitions
    if len(volumes) < per_batch:
        raise ValueError(f"{site or 'this site'}: {len(volumes)} volumes cannot fill one batch of {per_batch} "
                         "volumes; lower batch_size")
    return data_seed, PartitionSampleDataset(volumes, s.n_partitions, seed=data_seed), per_batch


class FCLLocalTrainer(Pretrainer):
    """One site's FCL pre-training (a ``LocalTrainer``) with the settings of an :class:`FCLSettings`.

    Build order (it fixes every random draw): the partition dataset (site seed), the batch check, the MoCo encoder
    (its own fixed seed, drawn in a forked RNG), the generator and the initial bank (site seed; the site seed also
    seeds the owned global RNG of every round).  Building one leaves torch's global generator as it was.
    ``state_dict`` = model, optimiser, bank, generator and the settings: what a restarted client resumes from.
    ``device``: the torch device (the executor resolves the settings' "auto").
    """

    method_name = "FCL"
    finetune_hint = "fedssl.experiments.fcl_finetune"
    global_name = "the global MoCo model"

    def __init__(self, volumes: Sequence[Volume], settings: FCLSettings, *, num_rounds: int,
                 device: str | torch.device = "cpu", site: str = "",
                 augment: Callable[[torch.Tensor, torch.Generator], torch.Tensor] = augment_views):
        settings.check(type(self).__name__)
        require_settings_objective(type(self).__name__, settings, "fcl")
        require(num_rounds > 0, type(self).__name__, "num_rounds", num_rounds,
                "use the job's number of rounds (paper: 200)")
        s = settings
        self.settings, self.num_rounds, self.workers = s, int(num_rounds), int(s.workers)
        self.data_seed, self.dataset, self.volumes_per_batch = site_partitions(s, volumes, site)
        self.device = torch.device(device)
        self.model = MoCoUNetEncoder(s.features, s.proj_dim, norm=s.norm, head=s.head,
                                     image_size=s.image_size).to(self.device)
        self.memory_format = torch.channels_last if s.channels_last else torch.contiguous_format
        self.model = self.model.to(memory_format=self.memory_format)
        self.augment = augment
        self.precision = MixedPrecision(self.device, s.amp)
        self.generator = torch.Generator().manual_seed(self.data_seed)
        self.bank = FeatureBank(s.bank_size, self.model.proj_dim, seed=self.data_seed)
        self.optimizer = torch.optim.SGD(self.model.main.parameters(), lr=s.lr, momentum=s.sgd_momentum,
                                         weight_decay=s.weight_decay)
        self.max_steps_per_round = int(s.max_steps_per_round)
        #: the other sites' features as delivered, each once, kept in a FIFO of K of this site's own
        self.remote_bank = FeatureBank(s.bank_size, self.model.proj_dim, seed=derived_seed(self.data_seed, "remote"))
        #: the remote bank ``(features [M, D], partitions [M])`` trained with: the FIFO's filled rows, or None
        self.remote: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def feature_exchange(self) -> bool:
        return self.settings.exchanges_features

    # ------------------------------------------------------------------ the exchanged banks
    def set_remote(self, features: object | None, partitions: object | None = None) -> None:
        """Add a delivery of the other sites' features and partition ids (eq. 1) to this site's remote FIFO (each
        remote feature arrives once; the FIFO keeps the latest K); None: nothing delivered.  The next rounds train
        with the FIFO's filled rows.  Ignored in training when feature exchange is off (FedMoCo, Local CL)."""
        if features is not None:
            if partitions is None:
                raise ValueError("a remote bank needs its partition ids (FCL's remote positives, eq. 4)")
            self.remote_bank.receive(features, partitions)
        self.remote = self.remote_bank.filled_rows() if self.remote_bank.filled else None

    def export_bank(self) -> tuple[np.ndarray, np.ndarray]:
        """What this site shares for feature exchange: the rows its bank took in since the last call, each once
        (float32 ``[n, D]`` features, int64 ``[n]`` partitions, n <= K)."""
        return self.bank.export_fresh()

    # ------------------------------------------------------------------ LocalTrainer
    def train_round(self, round_idx: int, should_stop: Callable[[], bool] | None = None) -> RoundStats:
        """One local epoch; ``should_stop`` is checked before the round and after every optimiser step."""
        check_stop(should_stop)
        v, cap = self.volumes_per_batch, self.max_steps_per_round
        steps_per_round = self.dataset.n_batches(v, cap)
        remote = self.remote if self.feature_exchange else None
        curve = []

        def progress(step: int, loss: float) -> None:
            curve.append({"loss": loss, "lr": float(self.optimizer.param_groups[0]["lr"])})
            check_stop(should_stop)

        data = self.dataset.batches(v, round_idx, cap, **loader_options(self.workers, self.device))
        out = self.train_batches(data, steps_per_round, round_idx, remote, progress)
        n_remote = 0 if remote is None else int(remote[0].shape[0])  # the FIFO's filled rows
        metrics = {"loss_local": out["loss_local"], "loss_remote": out["loss_remote"], "lr": out["lr_end"],
                   "lr_end": out["lr_end"], "remote_features": n_remote, "bank_filled": out["bank_filled"],
                   "bank_fill": out["bank_filled"] / self.bank.capacity, "feature_std": out["feature_std"],
                   "chance_loss_local": out["chance_loss_local"]}
        return RoundStats(loss=out["loss"], steps=out["steps"], samples=len(self.dataset), metrics=metrics, curve=curve)

    def train_batches(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], steps_per_round: int,
                      round_idx: int, remote: tuple[torch.Tensor, torch.Tensor] | None = None,
                      progress: Callable[[int, float], None] | None = None) -> dict:
        """The loop of one local epoch.  ``batches`` yields ``(x [V,S,1,H,W], part [V,S])``; ``remote`` is the
        exchanged bank ``(features [M,D], partitions [M])`` or None (always None with feature exchange off).
        Returns loss statistics, ``feature_std``, the spread of the batch's query features averaged over the
        steps (0 = collapse, see :mod:`fedssl.core.spread`), and ``chance_loss_local``, the chance level of the local
        term, ln(K + 1) for the K negatives each step drew (:func:`fedssl.core.chance.infonce_chance`), averaged
        over the steps.  Runs in the owned global RNG of (data seed, round)."""
        with owned_global_rng(derived_seed(self.data_seed, "fcl_round", round_idx), self.device):
            return self._train_batches(batches, steps_per_round, round_idx, remote, progress)

    def _train_batches(self, batches, steps_per_round: int, round_idx: int, remote, progress) -> dict:
        s = self.settings
        if not self.feature_exchange:
            remote = None
        self.model.main.train()
        self.model.momentum.train()  # the key network normalises by its own batch, as MoCo's code on one device
        losses: list[float] = []
        terms: list[tuple[float, float]] = []
        chances: list[float] = []
        spread = SpreadMeter()
        for step, (x, part) in enumerate(batches):
            v, n_part = int(x.shape[0]), int(x.shape[1])
            x = x.to(self.device, non_blocking=True).reshape(v * n_part, *x.shape[2:])  # [V*S, 1, H, W], volume-major
            part = part.to(self.device, non_blocking=True).reshape(v * n_part)
            lr = cosine_lr(s.lr, (round_idx * steps_per_round + step) / (self.num_rounds * steps_per_round))
            for g in self.optimizer.param_groups:
                g["lr"] = lr
            view_q = self.augment(x, self.generator).contiguous(memory_format=self.memory_format)
            view_k = self.augment(x, self.generator).contiguous(memory_format=self.memory_format)
            with self.precision.autocast():
                q = self.model.main(view_q)  # [N, D]
                with torch.no_grad():
                    k = self.model.momentum(view_k)  # [N, D]
            q, k = q.float(), k.float()
            spread.add(q)
            pos = k.unsqueeze(1) if s.plain_moco else paired_local_positives(k, v, n_part)  # [N, 1 or 2, D]
            neg, neg_part = sample_negatives(
                self.bank.features.to(self.device),
                self.bank.partitions.to(self.device),
                None if remote is None else remote[0].to(self.device),
                None if remote is None else remote[1].to(self.device),
                s.bank_size,
                self.generator,
                sample=s.negative_sampling,
            )
            gsm = s.structural_matching and not s.plain_moco
            loss_local, loss_remote = fcl_loss_terms(q, pos, part, neg, neg_part, s.tau, gsm=gsm)
            loss = loss_local + loss_remote
            if not torch.isfinite(loss):
                raise FloatingPointError(f"FCL loss became {loss.item()} at round {round_idx} step {step}; lower lr")
            self.precision.step(loss, self.optimizer)
            ema_update(self.model.momentum, self.model.main, s.momentum)
            self.bank.enqueue(k.detach().cpu(), part.detach().cpu())
            losses.append(float(loss.item()))
            terms.append((float(loss_local.item()), float(loss_remote.item())))
            chances.append(infonce_chance(int(neg.shape[0])))
            if progress is not None:
                progress(step, losses[-1])
        if not losses:
            raise ValueError("no training batch in this round: the site has fewer volumes than one batch")
        n = len(losses)
        return {"loss": sum(losses) / n, "loss_local": sum(t[0] for t in terms) / n,
                "loss_remote": sum(t[1] for t in terms) / n, "steps": n, "lr_end": lr, "bank_filled": self.bank.filled,
                "feature_std": spread.mean, "chance_loss_local": sum(chances) / n}

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
            self.remote = self.remote_bank.filled_rows() if self.remote_bank.filled else None
        self.generator.set_state(state["generator"])
