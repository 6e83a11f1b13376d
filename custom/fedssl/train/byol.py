"""FedBYOL / FCLOpt / FCLOpt-PTNU / FCLOpt-PTNU-DP on one site (FCL (Wu et al., MedIA 2022) section 4) as a
LocalTrainer.

:class:`BYOLSettings` is every setting of the method, declared once: the job arguments of ``BYOLExecutor`` (which
builds and checks it) and what :class:`BYOLLocalTrainer` reads.  The trainer holds the online network + predictor,
the target network, the optimiser, the generator and the site's :class:`fedssl.data.acdc.PartitionSampleDataset`
(slices sampled one per partition of each volume, as in FCL).  One round = one local BYOL epoch (the loss is
:func:`fedssl.core.byol.view_loss`, FCLOpt's eq. 6; the target network follows the online one by EMA, eq. 7).

What the site does with the download depends on the mode (:meth:`BYOLLocalTrainer.apply_global`):

- ``fclopt``: load the global online network, predictor and target network;
- ``fedbyol``: load the global online network and predictor, keep the local target network;
- ``ptnu`` / ``ptnu_dp``: load the global online network and predictor, then predict the target network from
  the local one with PTNU (Algorithm 2) to the distance the server sent.

Before its first round a site's "local target" is a copy of the global online network.  DP's
``report_distance`` is :meth:`BYOLLocalTrainer.proxy_distance` (eq. 12).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from fedssl.core.byol import FCLOPT_LR, view_loss
from fedssl.core.checks import require, require_amp, require_choice, require_int, require_workers
from fedssl.core.ptnu import ONLINE, TARGET, predict_target, proxy_distance
from fedssl.core.rng import owned_global_rng
from fedssl.core.schedule import cosine_lr
from fedssl.core.seeds import derived_seed, site_seed
from fedssl.core.spread import SpreadMeter
from fedssl.core.state_dict import ema_update
from fedssl.core.trainer import MixedPrecision, RoundStats, check_stop, detached, load_checked
from fedssl.data.acdc import PartitionSampleDataset
from fedssl.data.loading import loader_options
from fedssl.data.transforms import augment_views
from fedssl.data.volume import Volume
from fedssl.models.unet import HEADS, NORMS, PAPER_FEATURES, BYOLUNetEncoder, require_unet_args

#: the modes of :meth:`BYOLLocalTrainer.apply_global` (the FCLOptController's ``mode``)
BYOL_MODES = ("fedbyol", "fclopt", "ptnu", "ptnu_dp")


def _numpy(state: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy().copy() for k, v in state.items()}


@dataclass(frozen=True)
class BYOLSettings:
    """Paper settings as defaults (FCL (Wu et al., MedIA 2022) section 5, "Training details"): lr 0.5 cosine
    (FCLOpt and its PTNU / DP variants; FedBYOL: :data:`fedssl.core.byol.FEDBYOL_LR`, the paper's general rate), SGD
    momentum 0.9, weight decay 1e-4, m 0.99, m_d 0.995, batch 32 images (slices sampled one per partition of each
    volume, as in FCL).

    data_root: the site's folder of ``patientNNN`` folders; "" = site config / FEDSSL_DATA_ROOT.
    image_size, target_spacing: the slices' size in pixels and in-plane spacing in mm.
    frames: "all" (the default) pre-trains on every frame of each 4D cine, as FCL (sec. 5.1); "ed_es" on the two
        labelled frames only.
    n_partitions, features, proj_dim, pred_hidden: the partitions of a volume and the BYOL U-Net's shape.
    norm, head: the U-Net's normalisation and the projector, as FCL's (:class:`fedssl.train.fcl.FCLSettings`):
        "batch" and "flatten" (the reference code's) by default, "instance" and "grid" as switches.
    batch_size: images per mini-batch; lr: SGD, cosine decay over all rounds; momentum: m of the target EMA (eq. 7).
    m_d: PTNU's m_d (Algorithm 2); max_ptnu_iterations: its bound.
    symmetric: false = eq. 6, one direction (the paper); true = Grill et al.'s sum over both directions.
    max_steps_per_round: 0 = one full local epoch; > 0 caps the steps.
    seed: the job seed: the model starts from it, the site's data-side draws from ``site_seed(seed, site name)``.
    device: "auto" (CUDA when available), "cpu", "cuda", "cuda:1" ...
    amp: bfloat16 autocast of the networks on GPUs that support it; no effect on a CPU.
    workers: DataLoader worker processes that build the next batches (0 = in the training process; the same
        batches either way), pinned on a CUDA device.
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
    pred_hidden: int = 512
    batch_size: int = 32
    lr: float = FCLOPT_LR
    momentum: float = 0.99
    m_d: float = 0.995
    symmetric: bool = False
    max_ptnu_iterations: int = 100_000
    max_steps_per_round: int = 0
    seed: int = 0
    device: str = "auto"
    amp: bool = False
    workers: int = 0
    #: the optimiser's fixed constants (FCL section 5: SGD momentum 0.9, weight decay 0.0001; FCLOpt trained alike)
    sgd_momentum: ClassVar[float] = 0.9
    weight_decay: ClassVar[float] = 1e-4

    def check(self, name: str) -> None:
        """Every argument checked; a ValueError names component ``name``, the argument, its value and the fix."""
        require_unet_args(name, self.features, self.image_size, self.norm, self.head)
        require_choice(name, "frames", self.frames, ("ed_es", "all"))
        require_int(name, "n_partitions", self.n_partitions, 1, "paper: 4")
        require_int(name, "batch_size", self.batch_size, 2, "use at least 2 images per batch (paper: 32)")
        require(0 < self.m_d < 1, name, "m_d", self.m_d, "use a value in (0, 1) (paper: 0.995)")
        require_int(name, "max_ptnu_iterations", self.max_ptnu_iterations, 1, "use a positive bound")
        require_int(name, "max_steps_per_round", self.max_steps_per_round, 0,
                    "use 0 (full epoch) or a positive step count")
        require(isinstance(self.symmetric, bool), name, "symmetric", self.symmetric, "use false (paper, eq. 6) or true")
        require_int(name, "seed", self.seed, 0, "use the job's non-negative integer seed")
        require(self.lr > 0, name, "lr", self.lr, "use a rate > 0 (paper: 0.5 for FCLOpt, 0.05 for FedBYOL)")
        require(0 <= self.momentum < 1, name, "momentum", self.momentum, "use a value in [0, 1) (paper: 0.99)")
        require_amp(name, self.amp)
        require_workers(name, self.workers)


class BYOLLocalTrainer:
    """One site's BYOL pre-training (a ``LocalTrainer``) with the settings of a :class:`BYOLSettings`.

    Randomness: the model's initial weights come from the job ``seed`` (every site builds the same network);
    everything drawn from the data (the slices sampled per partition, the batch order, the augmentations) from
    :attr:`data_seed` = ``fedssl.core.seeds.site_seed(seed, site)``, so sites draw independently and a site's
    run is reproducible from (seed, site name); each round runs in the owned global RNG of (data seed, round)
    (:meth:`train_batches`).  ``state_dict`` = model, optimiser, generator and the settings; a trainer restored
    from one has a local target network (:attr:`has_local_target`).  ``device``: the torch device (the executor
    resolves the settings' "auto"); ``model`` / ``augment``: the settings' BYOL U-Net and FCL's augmentation unless
    given (tests: hand-checkable ones).
    """

    def __init__(self, volumes: Sequence[Volume], settings: BYOLSettings, *, num_rounds: int, site: str = "",
                 device: str | torch.device = "cpu", model: torch.nn.Module | None = None,
                 augment: Callable[[torch.Tensor, torch.Generator], torch.Tensor] = augment_views):
        name = type(self).__name__
        settings.check(name)
        require_int(name, "num_rounds", num_rounds, 1, "use the job's number of rounds (paper: 200)")
        s = settings
        self.settings, self.num_rounds, self.workers = s, int(num_rounds), int(s.workers)
        #: the seed of every data-side draw at this site (partition sampling, batch order, augmentations)
        self.data_seed = site_seed(s.seed, site)
        self.dataset = PartitionSampleDataset(list(volumes), s.n_partitions, seed=self.data_seed)
        if model is None:
            model = BYOLUNetEncoder(s.features, s.proj_dim, s.pred_hidden, seed=s.seed, norm=s.norm, head=s.head,
                                    image_size=s.image_size)
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.augment = augment
        self.precision = MixedPrecision(self.device, s.amp)
        self.generator = torch.Generator().manual_seed(self.data_seed)
        params = list(self.model.online.parameters()) + list(self.model.predictor.parameters())
        self.optimizer = torch.optim.SGD(params, lr=s.lr, momentum=s.sgd_momentum, weight_decay=s.weight_decay)
        self.volumes_per_batch = max(1, s.batch_size // s.n_partitions)
        self.max_steps_per_round = int(s.max_steps_per_round)
        self.m_d, self.max_ptnu_iterations = float(s.m_d), int(s.max_ptnu_iterations)
        #: True once the site has a target network of its own (after its first round, or restored)
        self.has_local_target = False

    # ------------------------------------------------------------------ target handling
    def local_target(self) -> dict[str, np.ndarray]:
        """This site's last target network (``target.*``); before its first round: a copy of its online network.
        Copies (no alias of the live parameters), so it stays what it was when the model changes."""
        state = self.model.state_dict()
        if self.has_local_target:
            return _numpy({k: v for k, v in state.items() if k.startswith(TARGET)})
        return _numpy({TARGET + k[len(ONLINE):]: v for k, v in state.items() if k.startswith(ONLINE)})

    def load_partial(self, state: Mapping[str, Any], source: str = "the global model") -> None:
        """Load the tensors ``state`` has (any subset of the model's keys; the others stay as they are)."""
        load_checked(self.model, state, source, keep_local=True)

    def predict_target(self, local_target: Mapping[str, np.ndarray], online: Mapping[str, Any], distance: float) -> int:
        """PTNU (Algorithm 2): load the target predicted from ``local_target`` towards the global ``online``
        network (``online.*`` keys) to ``distance``; returns the number of iterations."""
        online = {k: v for k, v in online.items() if k.startswith(ONLINE)}
        predicted, iterations = predict_target(local_target, online, float(distance), self.m_d,
                                               self.max_ptnu_iterations)
        self.load_partial(predicted, "the PTNU-predicted target network")
        return iterations

    def apply_global(self, mode: str, weights: Mapping[str, Any], distance: float | None = None) -> int | None:
        """Apply the round's download the way ``mode`` does (module docstring); returns the PTNU iterations
        (None for fclopt / fedbyol).  ``distance``: the server's target distance (ptnu / ptnu_dp)."""
        if mode not in BYOL_MODES:
            raise ValueError(f"mode={mode!r}: use one of {list(BYOL_MODES)}")
        if mode in ("ptnu", "ptnu_dp") and distance is None:
            raise ValueError(f"mode {mode} needs the server's target distance; the server must run FCLOptController")
        local_target = self.local_target() if self.has_local_target else None
        self.load_partial(weights)  # online + predictor (+ target for fclopt)
        if local_target is None:  # first round: the local target starts as the global online network
            local_target = self.local_target()
        iterations = None
        if mode in ("ptnu", "ptnu_dp"):
            iterations = self.predict_target(local_target, weights, distance)
        elif mode == "fedbyol" or (mode == "fclopt" and not any(k.startswith(TARGET) for k in weights)):
            self.load_partial(local_target, "this site's target network")
        self.has_local_target = True
        return iterations

    def proxy_distance(self, global_online: Mapping[str, Any]) -> float:
        """DP (eq. 12): d_pc = d(global online network, this site's target network).  Before its first round
        the site loads the global online network and starts its target network as a copy of it."""
        if not self.has_local_target:
            self.load_partial(global_online)
            self.model.target.load_state_dict(self.model.online.state_dict())
            self.has_local_target = True
        return proxy_distance(dict(global_online), self.local_target())

    # ------------------------------------------------------------------ LocalTrainer
    def train_round(self, round_idx: int, should_stop: Callable[[], bool] | None = None) -> RoundStats:
        """One local BYOL epoch; ``should_stop`` is checked before the round and after every optimiser step."""
        check_stop(should_stop)
        v, cap = self.volumes_per_batch, self.max_steps_per_round
        steps = self.dataset.n_batches(v, cap)
        loader = loader_options(self.workers, self.device)
        images = (x.flatten(0, 1) for x, _ in self.dataset.batches(v, round_idx, cap, **loader))  # [V*S, 1, H, W]
        curve = []

        def progress(step: int, loss: float) -> None:
            curve.append({"loss": loss, "lr": float(self.optimizer.param_groups[0]["lr"])})
            check_stop(should_stop)

        out = self.train_batches(images, steps, round_idx, progress)
        return RoundStats(loss=out["loss"], steps=out["steps"], samples=len(self.dataset),
                          metrics={"lr": out["lr_end"], "lr_end": out["lr_end"], "feature_std": out["feature_std"]},
                          curve=curve)

    def train_batches(self, batches: Iterable[torch.Tensor], steps_per_round: int, round_idx: int,
                      progress: Callable[[int, float], None] | None = None) -> dict:
        """The loop of one local epoch over ``batches`` of images ``[N, 1, H, W]``.  Returns the mean loss, the
        steps, the last lr and ``feature_std``: the spread of the batch's online projections averaged over the steps
        (0 = collapse, see :mod:`fedssl.core.spread`).  Runs in the owned global RNG of (data seed, ``round_idx``)."""
        with owned_global_rng(derived_seed(self.data_seed, "byol_round", round_idx), self.device):
            return self._train_batches(batches, steps_per_round, round_idx, progress)

    def _train_batches(self, batches: Iterable[torch.Tensor], steps_per_round: int, round_idx: int,
                       progress: Callable[[int, float], None] | None) -> dict:
        m, s = self.model, self.settings
        m.online.train()
        m.predictor.train()
        m.target.train()
        losses = []
        spread = SpreadMeter()
        lr = s.lr
        for step, x in enumerate(batches):
            x = x.to(self.device, non_blocking=True)
            lr = cosine_lr(s.lr, (round_idx * steps_per_round + step) / (self.num_rounds * steps_per_round))
            for g in self.optimizer.param_groups:
                g["lr"] = lr
            v1, v2 = self.augment(x, self.generator), self.augment(x, self.generator)
            with self.precision.autocast():
                loss, online = view_loss(m, v1, v2, s.symmetric)
            loss, online = loss.float(), online.float()
            spread.add(online)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"BYOL loss became {loss.item()} at round {round_idx} step {step}; lower lr")
            self.precision.step(loss, self.optimizer)
            ema_update(m.target, m.online, s.momentum)
            losses.append(float(loss.item()))
            if progress is not None:
                progress(step, losses[-1])
        if not losses:
            raise ValueError("no training batch in this round: the site has fewer images than one batch")
        return {"loss": sum(losses) / len(losses), "steps": len(losses), "lr_end": lr, "feature_std": spread.mean}

    def evaluate(self, split: str = "val") -> dict[str, Any]:
        raise ValueError(f"split={split!r}: BYOL pre-training reads unlabelled images only; evaluate the encoder by "
                         "fine-tuning it (fedssl.experiments.fcl_finetune)")

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "generator": self.generator.get_state(),
                "config": {**asdict(self.settings), "num_rounds": self.num_rounds}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
        self.has_local_target = True

    def global_state(self, with_target: bool = True) -> dict[str, torch.Tensor]:
        """The whole model (online, predictor, target); without ``target.*`` when ``with_target`` is False."""
        state = self.model.state_dict()
        return detached(state, [k for k in state if with_target or not k.startswith(TARGET)])

    def load_global(self, state: Mapping[str, Any], keep_local: Sequence[str] = ()) -> list[str]:
        return load_checked(self.model, state, "the global BYOL model", keep_local)
