"""Client executor for FedBYOL / FCLOpt / FCLOpt-PTNU / FCLOpt-PTNU-DP (FCL (Wu et al., MedIA 2022) section 4).

The math is :class:`fedssl.train.byol.BYOLLocalTrainer`, the round protocol
:class:`fedssl.flare.trainer_executor.TrainerExecutor`.  The server's task says which mode runs (meta
``byol_mode``).  Per round:
- ``report_distance`` (DP only): keep the downloaded global online network, reply d_pc (eq. 12);
- ``train``: load the global online network + predictor; get the target network from the download
  (FCLOpt), keep the local one (FedBYOL), or predict it from the local one with PTNU (Algorithm 2,
  distance d from the server); train one local BYOL epoch; upload what the mode uploads.

Every train result carries, under the ``summary_record`` meta, ``feature_std``: the round's mean spread of the
online projections (0 = collapse; :mod:`fedssl.core.spread`), which the run summary averages over the sites per
round (``site_record_means``).
"""

from __future__ import annotations

from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.apis.signal import Signal

from fedssl.core.byol import FCLOPT_LR, BYOLConfig
from fedssl.core.checks import require, require_choice, require_amp, require_int, require_workers
from fedssl.core.ptnu import uploads_target
from fedssl.core.trainer import RoundStats
from fedssl.data.acdc import load_site
from fedssl.flare.constants import (DISTANCE_KEY, DISTANCE_TASK, MODE_KEY, MODES, PROXY_KEY, SITE_RECORD_META,
                                    UPLOAD_TARGET_KEY)
from fedssl.flare.site_executor import pick_device
from fedssl.flare.trainer_executor import TrainerExecutor
from fedssl.models.unet import require_unet_args
from fedssl.train.byol import BYOLLocalTrainer

#: the executor arguments that go to the trainer as they are
TRAINER_ARGS = ("n_partitions", "features", "proj_dim", "pred_hidden", "batch_size", "lr", "momentum", "m_d",
                "symmetric", "max_ptnu_iterations", "max_steps_per_round", "seed", "amp", "workers")


class BYOLExecutor(TrainerExecutor):
    task_handlers = {"train": "train", DISTANCE_TASK: "report_distance"}
    checkpoint_name = "byol_client_state.pt"
    metrics_name = "byol_metrics.jsonl"

    def __init__(
        self,
        data_root: str = "",
        image_size: int = 192,
        target_spacing: float = 1.25,
        frames: str = "all",
        n_partitions: int = 4,
        features: list = (48, 96, 192, 384, 768, 48),
        proj_dim: int = 128,
        pred_hidden: int = 512,
        batch_size: int = 32,
        lr: float = FCLOPT_LR,
        momentum: float = 0.99,
        m_d: float = 0.995,
        symmetric: bool = False,
        max_ptnu_iterations: int = 100_000,
        max_steps_per_round: int = 0,
        seed: int = 0,
        device: str = "auto",
        amp: bool = False,
        workers: int = 0,
    ):
        """Paper settings as defaults (FCL (Wu et al., MedIA 2022) section 5, "Training details"): lr 0.5 cosine
        (FCLOpt and its PTNU / DP variants; FedBYOL: 0.05, the paper's general rate), m 0.99, m_d 0.995, batch 32
        images (slices sampled one per partition of each volume, as in FCL); the loss is eq. 6, one direction
        (``symmetric=True``: Grill et al.'s sum over both directions).  ``seed`` is the job seed: the model starts
        from it, the site's data-side draws from ``fedssl.core.seeds.site_seed(seed, site name)``.  ``frames``:
        "all" (the default) pre-trains on every frame of each 4D cine, as FCL (sec. 5.1); "ed_es" on the two
        labelled frames only.  ``workers``: DataLoader worker processes that build the next batches (0 = in the
        training process; the same batches either way), pinned on a CUDA device."""
        super().__init__()
        name = type(self).__name__
        require_unet_args(name, features, image_size)
        require_choice(name, "frames", frames, ("ed_es", "all"))
        require_int(name, "n_partitions", n_partitions, 1, "paper: 4")
        require_int(name, "batch_size", batch_size, 2, "use at least 2 images per batch (paper: 32)")
        require(0 < m_d < 1, name, "m_d", m_d, "use a value in (0, 1) (paper: 0.995)")
        require_int(name, "max_ptnu_iterations", max_ptnu_iterations, 1, "use a positive bound")
        require_int(name, "max_steps_per_round", max_steps_per_round, 0, "use 0 (full epoch) or a positive step count")
        require(isinstance(symmetric, bool), name, "symmetric", symmetric, "use false (paper, eq. 6) or true")
        require_int(name, "seed", seed, 0, "use the job's non-negative integer seed")
        BYOLConfig(lr=lr, momentum=momentum)  # range checks with clear messages
        self.data_root, self.image_size, self.target_spacing, self.frames = data_root, image_size, target_spacing, frames
        self.n_partitions, self.features, self.proj_dim, self.pred_hidden = n_partitions, list(features), proj_dim, pred_hidden
        self.batch_size, self.lr, self.momentum, self.m_d, self.symmetric = batch_size, lr, momentum, m_d, symmetric
        self.max_ptnu_iterations, self.max_steps_per_round = max_ptnu_iterations, max_steps_per_round
        require_amp(type(self).__name__, amp)
        require_workers(name, workers)
        self.workers = workers
        self.seed, self.device, self.amp = seed, device, amp
        self.global_online: dict | None = None  # DP: kept from report_distance for this round's train
        self.mode: str | None = None  # this round's mode and PTNU iterations (None: no PTNU)
        self.ptnu_iterations: int | None = None

    def build_trainer(self, fl_ctx: FLContext, num_rounds: int) -> BYOLLocalTrainer:
        site = self.site_name(fl_ctx)
        volumes = load_site(self.resolve_root(self.data_root, fl_ctx), with_labels=False,
                            target_spacing=self.target_spacing, image_size=self.image_size, frames=self.frames, site=site)
        trainer = BYOLLocalTrainer(volumes, num_rounds=num_rounds, site=site, device=pick_device(self.device),
                                   **{k: getattr(self, k) for k in TRAINER_ARGS})
        self.log_info(fl_ctx, f"{site}: {len(volumes)} unlabelled volumes, data seed {trainer.data_seed}, "
                              f"device {trainer.device}")
        return trainer

    # ------------------------------------------------------------------ tasks
    def report_distance(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        trainer = self.ensure_trainer(shareable, fl_ctx)
        self.global_online = dict(from_shareable(shareable).data)
        d_pc = trainer.proxy_distance(self.global_online)
        return DXO(data_kind=DataKind.METRICS, data={PROXY_KEY: d_pc}, meta={PROXY_KEY: d_pc}).to_shareable()

    def receive(self, dxo: DXO, fl_ctx: FLContext, round_idx: int) -> dict:
        """The download, applied the way the round's mode says (DP: the online network of ``report_distance``)."""
        site, mode = self.site_name(fl_ctx), dxo.get_meta_prop(MODE_KEY)
        if mode not in MODES:
            raise ValueError(f"{site}: task has byol_mode={mode!r}; the server must run FCLOptController")
        if mode == "ptnu_dp":
            if self.global_online is None:
                raise ValueError(f"{site}: train task without a preceding report_distance task in this round (DP)")
            weights, self.global_online = self.global_online, None
        else:
            weights = dxo.data or {}
        distance = dxo.get_meta_prop(DISTANCE_KEY)
        self.mode = mode
        self.ptnu_iterations = self.trainer.apply_global(mode, weights, None if distance is None else float(distance))
        return {"mode": mode, "ptnu_iterations": self.ptnu_iterations}

    def result_state(self, stats: RoundStats, dxo: DXO) -> dict:
        return self.trainer.global_state(with_target=uploads_target(self.mode, dxo.get_meta_prop(UPLOAD_TARGET_KEY)))

    def result_meta(self, stats: RoundStats, dxo: DXO, fl_ctx: FLContext) -> dict:
        """The summary record: the round's feature spread (a bounded number, no feature)."""
        return {SITE_RECORD_META: {"feature_std": stats.metrics["feature_std"]}}

    def describe_round(self, stats: RoundStats) -> str:
        n = self.ptnu_iterations
        return (f"loss {stats.loss:.4f} ({self.mode}" + (f", PTNU {n} iterations" if n is not None else "")
                + f", feature spread {stats.metrics['feature_std']:.3f})")
