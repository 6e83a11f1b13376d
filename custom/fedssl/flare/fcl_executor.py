"""Client executor for FCL pre-training (FCL (Wu et al., MedIA 2022) section 3) and its switches (FedMoCo, Local CL,
ablations, and the FedRotation / FedSimCLR baselines of sec. 5 "Baselines").

The math is :class:`fedssl.train.fcl.FCLLocalTrainer` (``objective="fcl"``) or, for ``objective`` "rotation" /
"simclr", :class:`fedssl.train.fcl_baselines.FedRotationTrainer` / ``FedSimCLRTrainer``
(:func:`fedssl.train.fcl_baselines.trainer_class`; they exchange no feature and upload the whole model); the round
protocol
:class:`fedssl.flare.trainer_executor.TrainerExecutor`.  Per round: load the global model (Local CL: only before
the site's first local round), hand the remote bank of the download to the trainer, train one local epoch,
upload the main + momentum networks, the sample count and (feature exchange) the local bank.  Only unlabelled
images are read: by default every frame of each patient's 4D cine (``frames="all"``, sec. 5.1: "about 15 volumes
covering a full cardiac cycle" per patient); ED/ES stay the labelled set of fine-tuning.

Local CL (``federated=false``, the paper's "Local CL" baseline, sec. 5.1) exchanges nothing: feature exchange is
off whatever ``feature_exchange`` says, and each round uploads no weight and no bank, only the scalars every
result carries (sample and step counts, loss, the summary record).  The server must expect empty contributions:
``exclude_patterns=["*"]`` and ``collectors=[]`` on the FedAvgAggregator (the global model then stays the
initial one).  Each site's own final encoder is its checkpoint ``fcl_client_state.pt`` in its run folder, which
``fedssl fcl export-unet`` turns into a U-Net initialisation.

Every result carries, under the ``summary_record`` meta, bounded counts for the run summary: volumes, steps of
the round, filled bank slots, their fraction, the bank size, ``feature_std``, the round's mean spread of the
normalised query features (0 = collapse; :mod:`fedssl.core.spread`), and ``chance_loss_local``, the chance level of
the local loss term the trainer measured (ln(K + 1) of its negatives) -- no feature, no name.
"""

from __future__ import annotations

from nvflare.apis.dxo import DXO
from nvflare.apis.fl_context import FLContext

from fedssl.core.checks import takes_settings
from fedssl.core.trainer import RoundStats
from fedssl.data.acdc import load_site
from fedssl.flare.constants import BANK_FEATURES, BANK_PARTITIONS, REMOTE_FEATURES, REMOTE_PARTITIONS, SITE_RECORD_META
from fedssl.flare.site_executor import pick_device
from fedssl.flare.trainer_executor import TrainerExecutor
from fedssl.train.fcl import FCLSettings
from fedssl.train.fcl_baselines import trainer_class

#: the site records the summary keeps (bounded numbers only), those the round's trainer reports
RECORD_KEYS = ("bank_filled", "bank_fill", "feature_std", "chance_loss_local", "chance_loss", "rotation_accuracy",
               "remote_features")


class FCLExecutor(TrainerExecutor):
    checkpoint_name = "fcl_client_state.pt"
    metrics_name = "fcl_metrics.jsonl"

    @takes_settings(FCLSettings)
    def __init__(self, **args):
        """The arguments are the fields of :class:`fedssl.train.fcl.FCLSettings` (paper settings as defaults, FCL
        (Wu et al., MedIA 2022) section 5, documented there), each stored verbatim and checked at once; an unknown
        name is refused."""
        super().__init__()
        self.configure(FCLSettings, args)

    @property
    def exchanges_features(self) -> bool:
        """Feature exchange in effect: requested and federated (Local CL exchanges nothing)."""
        return self.settings.exchanges_features

    def build_trainer(self, fl_ctx: FLContext, num_rounds: int):
        site = self.site_name(fl_ctx)
        volumes = load_site(self.resolve_root(self.data_root, fl_ctx), with_labels=False, site=site,
                            target_spacing=self.target_spacing, image_size=self.image_size, frames=self.frames)
        trainer = trainer_class(self.objective)(volumes, self.settings, num_rounds=num_rounds,
                                                device=pick_device(self.device), site=site)
        steps = trainer.dataset.n_batches(trainer.volumes_per_batch, self.max_steps_per_round)
        self.log_info(fl_ctx, f"{site}: {len(volumes)} unlabelled volumes (frames {self.frames}), {steps} steps per "
                              f"round, objective {self.objective} ({type(trainer).__name__}), device {trainer.device}")
        if not self.federated:
            self.log_info(fl_ctx, f"{site}: Local CL: no feature exchange, no upload; the server's aggregator must "
                                  'run with exclude_patterns=["*"] and collectors=[]')
        return trainer

    def receive(self, dxo: DXO, fl_ctx: FLContext, round_idx: int) -> dict:
        """The global model (Local CL: only before the site's first local round) and the remote bank."""
        extra = super().receive(dxo, fl_ctx, round_idx) if self.federated or self.last_round < 0 else {}
        if self.exchanges_features:
            self.trainer.set_remote(dxo.get_meta_prop(REMOTE_FEATURES), dxo.get_meta_prop(REMOTE_PARTITIONS))
        return extra

    def result_state(self, stats: RoundStats, dxo: DXO) -> dict:
        """The whole model (FCL: main + momentum networks); Local CL uploads no weight."""
        return super().result_state(stats, dxo) if self.federated else {}

    def result_meta(self, stats: RoundStats, dxo: DXO, fl_ctx: FLContext) -> dict:
        """The summary record (bounded counts) and, with feature exchange, the rows the bank took in this round."""
        record = {"volumes": stats.samples, "steps_per_round": stats.steps,
                  **{k: stats.metrics[k] for k in RECORD_KEYS if k in stats.metrics}}
        if self.objective == "fcl":
            record["bank_size"] = self.bank_size
        meta: dict = {SITE_RECORD_META: record}
        if self.exchanges_features:  # FedMoCo and Local CL: no feature leaves the site
            meta[BANK_FEATURES], meta[BANK_PARTITIONS] = self.trainer.export_bank()
            record["rows_shared"] = int(len(meta[BANK_PARTITIONS]))  # a count: what Table 7's bytes are made of
        return meta

    def describe_round(self, stats: RoundStats) -> str:
        m = stats.metrics
        if self.objective != "fcl":
            return ", ".join([f"loss {stats.loss:.4f} (chance {m['chance_loss']:.4f})", f"{stats.steps} steps",
                              *[f"{k.replace('_', ' ')} {m[k]:.3f}" for k in ("rotation_accuracy", "feature_std")
                                if k in m]])
        return (f"loss {stats.loss:.4f} (local {m['loss_local']:.4f} + remote {m['loss_remote']:.4f}; "
                f"{stats.steps} steps, {m['remote_features']} remote features, bank {m['bank_filled']}/"
                f"{self.bank_size} filled, feature spread {m['feature_std']:.3f})")
