"""Client executor for FedCLF pre-training ("Federated Self-Supervised Learning for Dermatological Disease
Diagnosis", sec. III) and its baselines: FE / W/o FE (Fig. 6), FedMoCo, Local CL, FedSimCLR, FedRotation.

The math is :class:`fedssl.train.fedclf.FedCLFLocalTrainer`, the round protocol
:class:`fedssl.flare.trainer_executor.TrainerExecutor`.  Per round: load the global model (Local CL: only before
the device's first local round), hand the remote bank of the download (``Q_r``, eq. 2) to the trainer, train one
local epoch on the device's unlabelled training images, upload the networks, the sample count and (feature
exchange: ``queue`` "fe" or "fe_neg") the local bank ``Q_l`` (eq. 1).  The server side is FCL's: the
``FeatureBankCollector`` validates each bank, the ``FeatureBankShuttle`` sends each device the others' filled
features, shuffled, without names, always the same number of rows.

Local CL (``federated=false``) exchanges nothing and needs ``queue="none"``; the server then runs its aggregator
with ``exclude_patterns=["*"]`` and ``collectors=[]``.  Each result carries, under the ``summary_record`` meta,
bounded counts (images, steps, bank fill, feature spread, remote fraction of ``Q_CL``): no feature, no name.
"""

from __future__ import annotations

import os

from nvflare.apis.dxo import DXO
from nvflare.apis.fl_context import FLContext

from fedssl.core.checks import require, require_choice, require_amp, require_int, require_workers
from fedssl.core.fedclf import METHODS, QUEUE_MODES, FedCLFConfig
from fedssl.core.trainer import RoundStats
from fedssl.data.images import load_image_records
from fedssl.flare.constants import BANK_FEATURES, BANK_PARTITIONS, REMOTE_FEATURES, SITE_RECORD_META
from fedssl.flare.site_executor import pick_device
from fedssl.flare.trainer_executor import TrainerExecutor
from fedssl.models.resnet import require_resnet_args
from fedssl.train.fedclf import FedCLFLocalTrainer

#: the executor arguments that go to the trainer as they are
TRAINER_ARGS = ("method", "queue", "dataset", "image_size", "width", "proj_dim", "batch_size", "lr", "tau", "momentum",
                "bank_size", "max_steps_per_round", "seed", "depth", "amp", "workers")
#: the site records the summary keeps (bounded numbers only)
RECORD_KEYS = ("bank_filled", "bank_fill", "feature_std", "queue_remote_fraction", "rotation_accuracy")


class FedCLFExecutor(TrainerExecutor):
    checkpoint_name = "fedclf_client_state.pt"
    metrics_name = "fedclf_metrics.jsonl"

    def __init__(self, data_root: str = "", split: str = "train", dataset: str = "derm5", image_size: int = 64,
                 method: str = "moco", queue: str = "fe_neg", federated: bool = True, width: int = 64,
                 proj_dim: int = 128, batch_size: int = 128, lr: float = 0.03, tau: float = 0.2,
                 momentum: float = 0.999, bank_size: int = 4096, max_steps_per_round: int = 0, seed: int = 0,
                 device: str = "auto", depth: int = 18, amp: bool = False, workers: int = 0):
        """
        Args (paper settings as defaults, sec. V-A; MoCo v2's where the paper is silent):
            data_root: the device folder (``train/``, ``val/``, ``test/`` class folders); "" = site config /
                FEDSSL_DATA_ROOT.  Pre-training reads ``<data_root>/<split>`` without labels.
            split: "train" / "val" / "test", or "" = ``data_root`` itself (a partition site of ``fedssl sslfl
                partition``, e.g. FedMAE-KS's ISIC 2019 shards for Table III's CNN rows).
            method: "moco" (FedCLF, FE, FedMoCo, Local CL), "simclr" (FedSimCLR) or "rotation" (FedRotation).
            queue: "fe_neg" (FedCLF, eq. 5), "fe" (eq. 4) or "none" (W/o FE: FedMoCo, Local CL, SimCLR, Rotation).
            federated: false = Local CL: nothing uploaded, the aggregate never loaded.
            image_size: the crop fed to the network (images are stored at 72 px shorter edge).
            width: ResNet stage width (64 = torchvision's; smaller for CPU profiles).
            depth: 18 (FedCLF's ResNet-18) or 50 (ResNet-50, FedMAE-KS's CNN baselines).
            bank_size: K of the local bank Q_l.
            max_steps_per_round: 0 = one full local epoch; > 0 caps the steps (quick CPU profile).
            amp: bfloat16 autocast on GPUs that support it (float16 + gradient scaler on older ones).
            workers: DataLoader worker processes that build the next batches (0 = in the training process; the
                batches are the same either way); batches are pinned on a CUDA device (README "Profiles and
                overrides": which executors have it).
        """
        super().__init__()
        name = type(self).__name__
        require(isinstance(data_root, str), name, "data_root", data_root, 'use a path string or ""')
        require_choice(name, "split", split, ("train", "val", "test", ""))
        require_choice(name, "method", method, METHODS)
        require_choice(name, "queue", queue, QUEUE_MODES)
        require(isinstance(federated, bool), name, "federated", federated, "use true or false")
        require(federated or queue == "none", name, "queue", queue,
                'Local CL (federated=false) exchanges nothing: use queue="none"')
        require_int(name, "image_size", image_size, 8, "use the crop size in pixels (images are 72 px high)")
        require_resnet_args(name, width, proj_dim, depth)
        require_int(name, "batch_size", batch_size, 2, "use a batch of at least 2 images (paper: 128)")
        require_int(name, "max_steps_per_round", max_steps_per_round, 0, "use 0 (full epoch) or a positive step count")
        require_int(name, "seed", seed, 0, "use a non-negative integer")
        FedCLFConfig(method=method, queue=queue, tau=tau, momentum=momentum, bank_size=bank_size, lr=lr)
        self.data_root, self.split, self.dataset, self.image_size = data_root, split, dataset, image_size
        self.method, self.queue, self.federated, self.width, self.proj_dim = method, queue, federated, width, proj_dim
        self.batch_size, self.lr, self.tau, self.momentum, self.bank_size = batch_size, lr, tau, momentum, bank_size
        require_amp(name, amp)
        require_workers(name, workers)
        self.workers = workers
        self.max_steps_per_round, self.seed, self.device, self.depth, self.amp = max_steps_per_round, seed, device, depth, amp

    @property
    def exchanges_features(self) -> bool:
        return self.federated and self.queue != "none"

    def build_trainer(self, fl_ctx: FLContext, num_rounds: int) -> FedCLFLocalTrainer:
        site = self.site_name(fl_ctx)
        root = os.path.join(self.resolve_root(self.data_root, fl_ctx), self.split)
        records = load_image_records(root, self.dataset, site=site)
        trainer = FedCLFLocalTrainer(records, num_rounds=num_rounds, device=pick_device(self.device), site=site,
                                     **{k: getattr(self, k) for k in TRAINER_ARGS})
        self.log_info(fl_ctx, f"{site}: {len(records)} unlabelled images ({self.split}), {trainer.steps_per_round} "
                              f"steps per round, method {self.method}, queue {self.queue}, device {trainer.trainer.device}")
        return trainer

    def receive(self, dxo: DXO, fl_ctx: FLContext, round_idx: int) -> dict:
        """The global model (Local CL: only before the first local round) and, with feature exchange, Q_r."""
        extra = super().receive(dxo, fl_ctx, round_idx) if self.federated or self.last_round < 0 else {}
        self.trainer.set_remote(dxo.get_meta_prop(REMOTE_FEATURES) if self.exchanges_features else None)
        return extra

    def result_state(self, stats: RoundStats, dxo: DXO) -> dict:
        return super().result_state(stats, dxo) if self.federated else {}

    def result_meta(self, stats: RoundStats, dxo: DXO, fl_ctx: FLContext) -> dict:
        record = {"images": stats.samples, "steps_per_round": stats.steps, "bank_size": self.bank_size,
                  **{k: stats.metrics[k] for k in RECORD_KEYS if k in stats.metrics}}
        meta: dict = {SITE_RECORD_META: record}
        if self.exchanges_features:  # W/o FE, Local CL, SimCLR, Rotation: no feature leaves the device
            meta[BANK_FEATURES], meta[BANK_PARTITIONS] = self.trainer.export_bank()
        return meta

    def describe_round(self, stats: RoundStats) -> str:
        m = stats.metrics
        parts = [f"loss {stats.loss:.4f}", f"{stats.steps} steps"]
        if "queue_remote_fraction" in m:
            parts.append(f"{m['remote_features']} remote features, Q_CL {m['queue_remote_fraction']:.2f} remote, "
                         f"bank {m['bank_filled']}/{self.bank_size}")
        if "feature_std" in m:
            parts.append(f"feature spread {m['feature_std']:.3f}")
        if "rotation_accuracy" in m:
            parts.append(f"rotation accuracy {m['rotation_accuracy']:.3f}")
        return ", ".join(parts)
