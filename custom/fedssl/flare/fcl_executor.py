"""Client executor for FCL pre-training (FCL (Wu et al., MedIA 2022) section 3) and its switches (FedMoCo, Local CL, ablations).

The math is :class:`fedssl.train.fcl.FCLLocalTrainer`, the round protocol
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
the round, filled bank slots, their fraction, the bank size and ``feature_std``, the round's mean spread of the
normalised query features (0 = collapse; :mod:`fedssl.core.spread`) -- no feature, no name.
"""

from __future__ import annotations

from nvflare.apis.dxo import DXO
from nvflare.apis.fl_context import FLContext

from fedssl.core.checks import require, require_choice, require_amp, require_int, require_workers
from fedssl.core.fcl import FCLConfig
from fedssl.core.trainer import RoundStats
from fedssl.data.acdc import load_site
from fedssl.flare.constants import BANK_FEATURES, BANK_PARTITIONS, REMOTE_FEATURES, REMOTE_PARTITIONS, SITE_RECORD_META
from fedssl.flare.site_executor import pick_device
from fedssl.flare.trainer_executor import TrainerExecutor
from fedssl.models.unet import require_unet_args
from fedssl.train.fcl import FCLLocalTrainer

#: the executor arguments that go to the trainer as they are
TRAINER_ARGS = ("n_partitions", "features", "proj_dim", "batch_size", "lr", "tau", "momentum", "bank_size",
                "negative_sampling", "structural_matching", "plain_moco", "max_steps_per_round", "seed", "amp", "workers")


class FCLExecutor(TrainerExecutor):
    checkpoint_name = "fcl_client_state.pt"
    metrics_name = "fcl_metrics.jsonl"

    def __init__(
        self,
        data_root: str = "",
        image_size: int = 192,
        target_spacing: float = 1.25,
        frames: str = "all",
        n_partitions: int = 4,
        features: list = (48, 96, 192, 384, 768, 48),
        proj_dim: int = 128,
        batch_size: int = 32,
        lr: float = 0.05,
        tau: float = 0.1,
        momentum: float = 0.99,
        bank_size: int = 4096,
        feature_exchange: bool = True,
        negative_sampling: bool = True,
        structural_matching: bool = True,
        plain_moco: bool = False,
        federated: bool = True,
        max_steps_per_round: int = 0,
        seed: int = 0,
        device: str = "auto",
        amp: bool = False,
        workers: int = 0,
    ):
        """
        Args (paper settings as defaults, FCL (Wu et al., MedIA 2022) section 5):
            data_root: the site's folder of ``patientNNN`` folders; "" = site config / FEDSSL_DATA_ROOT.
            frames: "all" = every frame of each patient's 4D cine (sec. 5.1, the default); "ed_es" = only the
                two annotated frames (20 volumes per site of 10 patients: 2 steps per round at batch 32).
            batch_size: 2D images per mini-batch (= volumes per batch x n_partitions; 32 = 8 x 4).
            feature_exchange / negative_sampling / structural_matching: FE / NS / GSM (Table 6).
            plain_moco: true = MoCo's positive (the other view of the same slice), no partition positives, no
                GSM.  FedMoCo and Table 6 "Without FE" = plain_moco true + feature_exchange false.
            federated: false = Local CL: no feature exchange, nothing uploaded, the aggregate never loaded.
            max_steps_per_round: 0 = one full local epoch; > 0 caps the steps (quick CPU profile).
            amp: bfloat16 autocast of the encoders on GPUs that support it (float16 + gradient scaler on older
                ones); loss and bank stay float32; no effect on a CPU (every site executor has this switch).
            workers: DataLoader worker processes that build the next batches (0 = in the training process; the
                batches are the same either way); batches are pinned on a CUDA device (README "Profiles and
                overrides": which executors have it).
        """
        super().__init__()
        name = type(self).__name__
        require(isinstance(data_root, str), name, "data_root", data_root, "use a path string or \"\"")
        require_unet_args(name, features, image_size)
        require(target_spacing > 0, name, "target_spacing", target_spacing, "use a spacing in mm, paper: 1.25")
        require_choice(name, "frames", frames, ("ed_es", "all"))
        require(isinstance(n_partitions, int) and n_partitions >= 1, name, "n_partitions", n_partitions, "paper: 4")
        require(isinstance(batch_size, int) and batch_size >= 2 * n_partitions, name, "batch_size", batch_size,
                f"need at least 2 volumes per batch: batch_size >= 2 * n_partitions = {2 * n_partitions}")
        for flag, value in (("feature_exchange", feature_exchange), ("negative_sampling", negative_sampling),
                            ("structural_matching", structural_matching), ("plain_moco", plain_moco),
                            ("federated", federated)):
            require(isinstance(value, bool), name, flag, value, "use true or false")
        require_int(name, "max_steps_per_round", max_steps_per_round, 0, "use 0 (full epoch) or a positive step count")
        self.data_root, self.image_size, self.target_spacing, self.frames = data_root, image_size, target_spacing, frames
        self.n_partitions, self.features, self.proj_dim = n_partitions, list(features), proj_dim
        self.batch_size, self.lr, self.tau, self.momentum, self.bank_size = batch_size, lr, tau, momentum, bank_size
        self.feature_exchange, self.negative_sampling = feature_exchange, negative_sampling
        self.structural_matching, self.plain_moco, self.federated = structural_matching, plain_moco, federated
        require_amp(name, amp)
        require_workers(name, workers)
        self.workers = workers
        self.max_steps_per_round, self.seed, self.device, self.amp = max_steps_per_round, seed, device, amp
        # validated now (clear message at construction), rebuilt per run with the job's num_rounds
        FCLConfig(tau=tau, momentum=momentum, bank_size=bank_size, lr=lr)

    @property
    def exchanges_features(self) -> bool:
        """Feature exchange in effect: requested and federated (Local CL exchanges nothing)."""
        return self.feature_exchange and self.federated

    def build_trainer(self, fl_ctx: FLContext, num_rounds: int) -> FCLLocalTrainer:
        site = self.site_name(fl_ctx)
        volumes = load_site(self.resolve_root(self.data_root, fl_ctx), with_labels=False,
                            target_spacing=self.target_spacing, image_size=self.image_size, frames=self.frames, site=site)
        trainer = FCLLocalTrainer(volumes, num_rounds=num_rounds, device=pick_device(self.device), site=site,
                                  feature_exchange=self.exchanges_features,
                                  **{k: getattr(self, k) for k in TRAINER_ARGS})
        steps = trainer.dataset.n_batches(trainer.volumes_per_batch, self.max_steps_per_round)
        self.log_info(fl_ctx, f"{site}: {len(volumes)} unlabelled volumes (frames {self.frames}), {steps} steps per "
                              f"round, device {trainer.device}")
        if not self.federated:
            self.log_info(fl_ctx, f"{site}: Local CL: no feature exchange, no upload; the server's aggregator must "
                                  'run with exclude_patterns=["*"] and collectors=[]')
        return trainer

    def receive(self, dxo: DXO, fl_ctx: FLContext, round_idx: int) -> dict:
        """The global model (Local CL: only before the site's first local round) and the remote bank."""
        extra = super().receive(dxo, fl_ctx, round_idx) if self.federated or self.last_round < 0 else {}
        features = dxo.get_meta_prop(REMOTE_FEATURES) if self.exchanges_features else None
        self.trainer.set_remote(features, dxo.get_meta_prop(REMOTE_PARTITIONS))
        return extra

    def result_state(self, stats: RoundStats, dxo: DXO) -> dict:
        """The main + momentum networks; Local CL uploads no weight."""
        return super().result_state(stats, dxo) if self.federated else {}

    def result_meta(self, stats: RoundStats, dxo: DXO, fl_ctx: FLContext) -> dict:
        """The summary record (bounded counts) and, with feature exchange, the local bank."""
        m = stats.metrics
        meta: dict = {SITE_RECORD_META: {"volumes": stats.samples, "steps_per_round": stats.steps,
                                         "bank_filled": m["bank_filled"], "bank_fill": m["bank_fill"],
                                         "bank_size": self.bank_size, "feature_std": m["feature_std"]}}
        if self.exchanges_features:  # FedMoCo and Local CL: no feature leaves the site
            meta[BANK_FEATURES], meta[BANK_PARTITIONS] = self.trainer.export_bank()
        return meta

    def describe_round(self, stats: RoundStats) -> str:
        m = stats.metrics
        return (f"loss {stats.loss:.4f} (local {m['loss_local']:.4f} + remote {m['loss_remote']:.4f}; "
                f"{stats.steps} steps, {m['remote_features']} remote features, bank {m['bank_filled']}/"
                f"{self.bank_size} filled, feature spread {m['feature_std']:.3f})")
