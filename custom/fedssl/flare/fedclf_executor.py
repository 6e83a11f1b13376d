"""Client executor for FedCLF pre-training ("Federated Self-Supervised Learning for Dermatological Disease
Diagnosis", sec. III) and its baselines: FE / W/o FE (Fig. 6), FedMoCo, Local CL, FedSimCLR, FedRotation.

The math is :class:`fedssl.train.fedclf.FedCLFLocalTrainer`, the round protocol
:class:`fedssl.flare.trainer_executor.TrainerExecutor`.  Per round: load the global model (Local CL: only before
the device's first local round), hand the remote bank of the download (``Q_r``, eq. 2) to the trainer, train one
local epoch on the device's unlabelled training images, upload the networks, the sample count and (feature
exchange: ``queue`` "fe" or "fe_neg") the rows ``Q_l`` took in this round (eq. 1), each shared once.  The
server side is FCL's: the ``FeatureBankCollector`` validates each upload and forwards a row once, the
``FeatureBankShuttle`` sends each device as many of the others' new features as it shared, shuffled, without
names; the device keeps them in its remote FIFO.

Local CL (``federated=false``) exchanges nothing and needs ``queue="none"``; the server then runs its aggregator
with ``exclude_patterns=["*"]`` and ``collectors=[]``.  Each result carries, under the ``summary_record`` meta,
bounded counts (images, steps, bank fill, feature spread, remote fraction of ``Q_CL``, the loss's chance level the
trainer reports): no feature, no name.
"""

from __future__ import annotations

import os

from nvflare.apis.dxo import DXO
from nvflare.apis.fl_context import FLContext

from fedssl.core.checks import takes_settings
from fedssl.core.trainer import RoundStats
from fedssl.data.images import load_image_records
from fedssl.flare.constants import BANK_FEATURES, BANK_PARTITIONS, REMOTE_FEATURES, REMOTE_PARTITIONS, SITE_RECORD_META
from fedssl.flare.site_executor import pick_device
from fedssl.flare.trainer_executor import TrainerExecutor
from fedssl.train.fedclf import FedCLFLocalTrainer, FedCLFSettings

#: the site records the summary keeps (bounded numbers only)
RECORD_KEYS = ("bank_filled", "bank_fill", "feature_std", "queue_remote_fraction", "rotation_accuracy", "chance_loss")


class FedCLFExecutor(TrainerExecutor):
    checkpoint_name = "fedclf_client_state.pt"
    metrics_name = "fedclf_metrics.jsonl"

    @takes_settings(FedCLFSettings)
    def __init__(self, **args):
        """The arguments are the fields of :class:`fedssl.train.fedclf.FedCLFSettings` (paper settings as defaults,
        sec. V-A; MoCo v2's where the paper is silent; documented there), each stored verbatim and checked at once;
        an unknown name is refused."""
        super().__init__()
        self.configure(FedCLFSettings, args)

    @property
    def exchanges_features(self) -> bool:
        return self.settings.exchanges_features

    def build_trainer(self, fl_ctx: FLContext, num_rounds: int) -> FedCLFLocalTrainer:
        site = self.site_name(fl_ctx)
        root = os.path.join(self.resolve_root(self.data_root, fl_ctx), self.split)
        records = load_image_records(root, self.dataset, site=site)
        trainer = FedCLFLocalTrainer(records, self.settings, num_rounds=num_rounds, device=pick_device(self.device),
                                     site=site)
        self.log_info(fl_ctx, f"{site}: {len(records)} unlabelled images ({self.split}), {trainer.steps_per_round} "
                              f"steps per round, method {self.method}, queue {self.queue}, device {trainer.device}")
        return trainer

    def receive(self, dxo: DXO, fl_ctx: FLContext, round_idx: int) -> dict:
        """The global model (Local CL: only before the first local round) and, with feature exchange, Q_r."""
        extra = super().receive(dxo, fl_ctx, round_idx) if self.federated or self.last_round < 0 else {}
        if self.exchanges_features:
            self.trainer.set_remote(dxo.get_meta_prop(REMOTE_FEATURES), dxo.get_meta_prop(REMOTE_PARTITIONS))
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
