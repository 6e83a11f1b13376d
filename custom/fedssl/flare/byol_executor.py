"""Client executor for FedBYOL / FCLOpt / FCLOpt-PTNU / FCLOpt-PTNU-DP (seed 004 section 4).

The server's task says which mode runs (meta ``byol_mode``).  Per round:
- ``report_distance`` (DP only): keep the downloaded global online network, reply d_pc (eq. 12);
- ``train``: load the global online network + predictor; get the target network from the download
  (FCLOpt), keep the local one (FedBYOL), or predict it from the local one with PTNU (Algorithm 2,
  distance d from the server); train one local BYOL epoch; upload what the mode uploads.
"""

from __future__ import annotations

import numpy as np
import torch
from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.apis.signal import Signal
from nvflare.app_common.app_constant import AppConstants

from fedssl.core.byol import BYOLConfig, BYOLTrainer
from fedssl.core.ptnu import ONLINE, TARGET, predict_target, proxy_distance
from fedssl.data.acdc import PartitionSampleDataset, load_site
from fedssl.data.transforms import augment_views
from fedssl.flare.fclopt_controller import DISTANCE_KEY, MODE_KEY, MODES, PROXY_KEY, UPLOAD_TARGET_KEY
from fedssl.flare.site_executor import SiteExecutor, TaskAborted, pick_device
from fedssl.flare.validation import require, require_choice, require_int, require_unet_args
from fedssl.models.unet import BYOLUNetEncoder


def _numpy(state: dict) -> dict:
    return {k: v.detach().cpu().numpy() for k, v in state.items()}


class BYOLExecutor(SiteExecutor):
    task_handlers = {"train": "train", "report_distance": "report_distance"}
    checkpoint_name = "byol_client_state.pt"
    metrics_name = "byol_metrics.jsonl"

    def __init__(
        self,
        data_root: str = "",
        image_size: int = 192,
        target_spacing: float = 1.25,
        frames: str = "ed_es",
        n_partitions: int = 4,
        features: list = (48, 96, 192, 384, 768, 48),
        proj_dim: int = 128,
        pred_hidden: int = 512,
        batch_size: int = 32,
        lr: float = 0.5,
        momentum: float = 0.99,
        m_d: float = 0.995,
        max_ptnu_iterations: int = 100_000,
        max_steps_per_round: int = 0,
        seed: int = 0,
        device: str = "auto",
    ):
        """Paper settings as defaults (seed 004 section 5): lr 0.5 cosine, m 0.99, m_d 0.995, batch 32 images
        (slices sampled one per partition of each volume, as in FCL)."""
        super().__init__()
        name = type(self).__name__
        require_unet_args(name, features, image_size)
        require_choice(name, "frames", frames, ("ed_es", "all"))
        require_int(name, "n_partitions", n_partitions, 1, "paper: 4")
        require_int(name, "batch_size", batch_size, 2, "use at least 2 images per batch (paper: 32)")
        require(0 < m_d < 1, name, "m_d", m_d, "use a value in (0, 1) (paper: 0.995)")
        require_int(name, "max_ptnu_iterations", max_ptnu_iterations, 1, "use a positive bound")
        require_int(name, "max_steps_per_round", max_steps_per_round, 0, "use 0 (full epoch) or a positive step count")
        BYOLConfig(lr=lr, momentum=momentum)  # range checks with clear messages
        self.data_root = data_root
        self.image_size = image_size
        self.target_spacing = target_spacing
        self.frames = frames
        self.n_partitions = n_partitions
        self.features = list(features)
        self.proj_dim = proj_dim
        self.pred_hidden = pred_hidden
        self.batch_size = batch_size
        self.lr = lr
        self.momentum = momentum
        self.m_d = m_d
        self.max_ptnu_iterations = max_ptnu_iterations
        self.max_steps_per_round = max_steps_per_round
        self.seed = seed
        self.device = device
        self._trainer: BYOLTrainer | None = None
        self._dataset: PartitionSampleDataset | None = None
        self._has_local_target = False
        self._global_online: dict | None = None  # DP: kept from report_distance for this round's train

    def _setup(self, fl_ctx: FLContext, num_rounds: int) -> None:
        site = self.site_name(fl_ctx)
        volumes = load_site(self.resolve_root(self.data_root, fl_ctx), with_labels=False,
                            target_spacing=self.target_spacing, image_size=self.image_size, frames=self.frames, site=site)
        self._dataset = PartitionSampleDataset(volumes, self.n_partitions, seed=self.seed)
        torch.manual_seed(self.seed)
        model = BYOLUNetEncoder(self.features, self.proj_dim, self.pred_hidden)
        cfg = BYOLConfig(lr=self.lr, momentum=self.momentum, num_rounds=num_rounds)
        self._trainer = BYOLTrainer(model, cfg, augment_views, device=pick_device(self.device), seed=self.seed)
        state = self.load_checkpoint(fl_ctx)
        if state is not None:
            self._trainer.load_state_dict(state["trainer"])
            self._has_local_target = True
        self.log_info(fl_ctx, f"{site}: {len(volumes)} unlabelled volumes, device {self._trainer.device}")

    def _ensure(self, shareable: Shareable, fl_ctx: FLContext) -> None:
        if self._trainer is None:
            self._setup(fl_ctx, int(shareable.get_header(AppConstants.NUM_ROUNDS, 1)))

    def _local_target(self) -> dict:
        """This site's last target network (``target.*``); before its first round: a copy of its online net."""
        state = _numpy(self._trainer.model.state_dict())
        if self._has_local_target:
            return {k: v for k, v in state.items() if k.startswith(TARGET)}
        return {TARGET + k[len(ONLINE):]: v for k, v in state.items() if k.startswith(ONLINE)}

    def _load(self, weights: dict) -> None:
        model = self._trainer.model
        own = model.state_dict()
        unknown = sorted(set(weights) - set(own))
        if unknown:
            raise ValueError(f"the global model has keys this site's model lacks: {unknown[:3]}; same features/proj_dim?")
        own.update({k: torch.as_tensor(np.asarray(v)) for k, v in weights.items()})
        model.load_state_dict(own)

    # ------------------------------------------------------------------ tasks
    def report_distance(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        self._ensure(shareable, fl_ctx)
        dxo = from_shareable(shareable)
        if not self._has_local_target:
            self._load(dxo.data)  # round 0: the local target starts as the global online network
            self._trainer.model.target.load_state_dict(self._trainer.model.online.state_dict())
            self._has_local_target = True
        self._global_online = dict(dxo.data)
        d_pc = proxy_distance(self._global_online, self._local_target())
        return DXO(data_kind=DataKind.METRICS, data={PROXY_KEY: d_pc}, meta={PROXY_KEY: d_pc}).to_shareable()

    def train(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        self._ensure(shareable, fl_ctx)
        round_idx = int(shareable.get_header(AppConstants.CURRENT_ROUND, 0))
        num_rounds = int(shareable.get_header(AppConstants.NUM_ROUNDS, 1))
        dxo = from_shareable(shareable)
        mode = dxo.get_meta_prop(MODE_KEY)
        if mode not in MODES:
            raise ValueError(f"task has byol_mode={mode!r}; the server must run FCLOptController")
        trainer = self._trainer
        if mode == "ptnu_dp":
            if self._global_online is None:
                raise ValueError("train task without a preceding report_distance task in this round (DP)")
            weights, self._global_online = self._global_online, None
        else:
            weights = dxo.data
        local_target = self._local_target() if self._has_local_target else None
        self._load(weights)  # online + predictor (+ target for fclopt)
        if local_target is None:  # first round: the local target starts as the global online network
            local_target = self._local_target()
        ptnu_iter = None
        if mode in ("ptnu", "ptnu_dp"):
            d = float(dxo.get_meta_prop(DISTANCE_KEY))
            online = {k: v for k, v in weights.items() if k.startswith(ONLINE)}
            predicted, ptnu_iter = predict_target(local_target, online, d, self.m_d, self.max_ptnu_iterations)
            self._load(predicted)
        elif mode == "fedbyol" or (mode == "fclopt" and not any(k.startswith(TARGET) for k in weights)):
            self._load(local_target)
        self._has_local_target = True

        def progress(step: int, loss: float) -> None:
            if abort_signal.triggered:
                raise TaskAborted()

        v = max(1, self.batch_size // self.n_partitions)
        steps = self._dataset.n_batches(v, self.max_steps_per_round)
        images = (x.flatten(0, 1) for x, _ in self._dataset.batches(v, round_idx, self.max_steps_per_round))  # [V*S,1,H,W]
        stats = trainer.train_round(images, steps, round_idx, progress)
        self.save_checkpoint(fl_ctx, {"round": round_idx, "trainer": trainer.state_dict()})
        self.append_metrics(fl_ctx, {"round": round_idx, "mode": mode, "ptnu_iterations": ptnu_iter, **stats})
        self.log_info(fl_ctx, f"round {round_idx + 1}/{num_rounds} ({mode}): loss {stats['loss']:.4f}"
                              + (f", PTNU {ptnu_iter} iterations" if ptnu_iter is not None else ""))
        state = _numpy(trainer.model.state_dict())
        upload_target = mode in ("fclopt", "ptnu") or (mode == "ptnu_dp" and bool(dxo.get_meta_prop(UPLOAD_TARGET_KEY)))
        if not upload_target:
            state = {k: v for k, v in state.items() if not k.startswith(TARGET)}
        meta = {"num_samples": len(self._dataset), MetaKey.NUM_STEPS_CURRENT_ROUND: stats["steps"], "loss": stats["loss"]}
        return DXO(data_kind=DataKind.WEIGHTS, data=state, meta=meta).to_shareable()
