"""Client executor for FCL pre-training (seed 004 section 3) and its switches (FedMoCo, Local CL, ablations).

Unwrap the global model and the remote bank -> ``fedssl.core.fcl.FCLTrainer.train_round`` -> wrap the
updated main + momentum networks, the sample count and the local bank.  Only unlabelled images are read.
"""

from __future__ import annotations

import numpy as np
import torch
from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.apis.signal import Signal
from nvflare.app_common.app_constant import AppConstants

from fedssl.core.fcl import FCLConfig, FCLTrainer
from fedssl.data.acdc import PartitionSampleDataset, load_site
from fedssl.data.transforms import augment_views
from fedssl.flare.feature_bank_shuttle import REMOTE_FEATURES, REMOTE_PARTITIONS
from fedssl.flare.site_executor import SiteExecutor, TaskAborted, pick_device
from fedssl.flare.validation import require, require_choice, require_int, require_unet_args
from fedssl.models.unet import MoCoUNetEncoder


class FCLExecutor(SiteExecutor):
    checkpoint_name = "fcl_client_state.pt"
    metrics_name = "fcl_metrics.jsonl"

    def __init__(
        self,
        data_root: str = "",
        image_size: int = 192,
        target_spacing: float = 1.25,
        frames: str = "ed_es",
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
        federated: bool = True,
        max_steps_per_round: int = 0,
        seed: int = 0,
        device: str = "auto",
    ):
        """
        Args (paper settings as defaults, seed 004 section 5):
            data_root: the site's folder of ``patientNNN`` folders; "" = site config / FEDSSL_DATA_ROOT.
            batch_size: 2D images per mini-batch (= volumes per batch x n_partitions; 32 = 8 x 4).
            feature_exchange / negative_sampling / structural_matching: FE / NS / GSM (Table 6).
                FedMoCo = feature_exchange false.
            federated: false = Local CL (the site never loads the aggregated model).
            max_steps_per_round: 0 = one full local epoch; > 0 caps the steps (quick CPU profile).
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
                            ("structural_matching", structural_matching), ("federated", federated)):
            require(isinstance(value, bool), name, flag, value, "use true or false")
        require_int(name, "max_steps_per_round", max_steps_per_round, 0, "use 0 (full epoch) or a positive step count")
        self.data_root = data_root
        self.image_size = image_size
        self.target_spacing = target_spacing
        self.frames = frames
        self.n_partitions = n_partitions
        self.features = list(features)
        self.proj_dim = proj_dim
        self.batch_size = batch_size
        self.lr = lr
        self.tau = tau
        self.momentum = momentum
        self.bank_size = bank_size
        self.feature_exchange = feature_exchange
        self.negative_sampling = negative_sampling
        self.structural_matching = structural_matching
        self.federated = federated
        self.max_steps_per_round = max_steps_per_round
        self.seed = seed
        self.device = device
        # validated now (clear message at construction), rebuilt per run with the job's num_rounds
        FCLConfig(tau=tau, momentum=momentum, bank_size=bank_size, lr=lr)
        self._trainer: FCLTrainer | None = None
        self._dataset: PartitionSampleDataset | None = None
        self._last_round = -1

    # ------------------------------------------------------------------ set-up
    def _setup(self, fl_ctx: FLContext, num_rounds: int) -> None:
        site = self.site_name(fl_ctx)
        root = self.resolve_root(self.data_root, fl_ctx)
        volumes = load_site(root, with_labels=False, target_spacing=self.target_spacing,
                            image_size=self.image_size, frames=self.frames, site=site)
        self._dataset = PartitionSampleDataset(volumes, self.n_partitions, seed=self.seed)
        if len(volumes) < self.batch_size // self.n_partitions:
            raise ValueError(f"{site}: {len(volumes)} volumes cannot fill one batch of "
                             f"{self.batch_size // self.n_partitions} volumes; lower batch_size")
        cfg = FCLConfig(tau=self.tau, momentum=self.momentum, bank_size=self.bank_size, lr=self.lr,
                        num_rounds=num_rounds, feature_exchange=self.feature_exchange,
                        negative_sampling=self.negative_sampling, structural_matching=self.structural_matching)
        torch.manual_seed(self.seed)
        model = MoCoUNetEncoder(self.features, self.proj_dim)
        self._trainer = FCLTrainer(model, cfg, augment_views, device=pick_device(self.device), seed=self.seed)
        state = self.load_checkpoint(fl_ctx)
        if state is not None:
            self._trainer.load_state_dict(state["trainer"])
            self._last_round = int(state["round"])
        self.log_info(fl_ctx, f"{site}: {len(volumes)} unlabelled volumes, device {self._trainer.device}")

    # ------------------------------------------------------------------ task
    def train(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        round_idx = int(shareable.get_header(AppConstants.CURRENT_ROUND, 0))
        num_rounds = int(shareable.get_header(AppConstants.NUM_ROUNDS, 1))
        if self._trainer is None:
            self._setup(fl_ctx, num_rounds)
        trainer = self._trainer
        dxo = from_shareable(shareable)
        if self.federated or self._last_round < 0:
            state = {k: torch.as_tensor(np.asarray(v)) for k, v in dxo.data.items()}
            trainer.model.load_state_dict(state)
        remote = None
        if self.feature_exchange and dxo.get_meta_prop(REMOTE_FEATURES) is not None:
            remote = (torch.as_tensor(np.asarray(dxo.get_meta_prop(REMOTE_FEATURES))),
                      torch.as_tensor(np.asarray(dxo.get_meta_prop(REMOTE_PARTITIONS))))
        v = self.batch_size // self.n_partitions
        steps_per_round = self._dataset.n_batches(v, self.max_steps_per_round)

        def progress(step: int, loss: float) -> None:
            if abort_signal.triggered:
                raise TaskAborted()

        batches = self._dataset.batches(v, round_idx, self.max_steps_per_round)
        stats = trainer.train_round(batches, steps_per_round, round_idx, remote, progress)
        self._last_round = round_idx
        self.save_checkpoint(fl_ctx, {"round": round_idx, "trainer": trainer.state_dict()})
        n_remote = 0 if remote is None else int(remote[0].shape[0])
        self.append_metrics(fl_ctx, {"round": round_idx, "remote_features": n_remote, **stats})
        self.log_info(fl_ctx, f"round {round_idx + 1}/{num_rounds}: loss {stats['loss']:.4f} "
                              f"(local {stats['loss_local']:.4f} + remote {stats['loss_remote']:.4f}; "
                              f"{stats['steps']} steps, {n_remote} remote features)")
        weights = {k: v.detach().cpu().numpy() for k, v in trainer.model.state_dict().items()}
        meta = {"num_samples": len(self._dataset), MetaKey.NUM_STEPS_CURRENT_ROUND: stats["steps"], "loss": stats["loss"]}
        if self.feature_exchange:
            meta["bank_features"], meta["bank_partitions"] = trainer.bank.export()
        return DXO(data_kind=DataKind.WEIGHTS, data=weights, meta=meta).to_shareable()
