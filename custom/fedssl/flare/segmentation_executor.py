"""Client executor for federated fine-tuning of the U-Net with N annotated patients per site (seed 004 sec. 5).

Each round: evaluate the received global model on the site's validation patients of the fold (Dice over
LV, MYO, RV; reported in the result meta, never used to pick a checkpoint), then train one local epoch
on the site's N labelled patients and upload the weights with the number of labelled slices.
"""

from __future__ import annotations

import numpy as np
import torch
from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.apis.signal import Signal
from nvflare.app_common.app_constant import AppConstants

from fedssl.data.acdc import load_site
from fedssl.eval.protocol import site_split
from fedssl.eval.segmentation import SegmentationTrainer, dice_per_volume, mean_dice, steps_per_epoch
from fedssl.flare.site_executor import SiteExecutor, pick_device
from fedssl.flare.validation import require, require_int, require_unet_args
from fedssl.models.unet import build_unet


class SegmentationExecutor(SiteExecutor):
    checkpoint_name = "seg_client_state.pt"
    metrics_name = "seg_metrics.jsonl"

    def __init__(
        self,
        data_root: str = "",
        image_size: int = 192,
        target_spacing: float = 1.25,
        features: list = (48, 96, 192, 384, 768, 48),
        n_labelled: int = 1,
        fold: int = 0,
        n_folds: int = 5,
        lr: float = 5e-4,
        batch_size: int = 10,
        local_epochs: int = 1,
        max_steps_per_round: int = 0,
        seed: int = 0,
        device: str = "auto",
    ):
        """
        Args (paper settings as defaults): n_labelled = N annotated patients of the site (1, 2, 4, 8);
        fold of the 5-fold split (8 train / 2 validation patients per site); Adam lr 5e-4, batch 10,
        cosine over all rounds; local_epochs per round (paper: 1); max_steps_per_round caps each local
        epoch (0 = no cap).
        """
        super().__init__()
        name = type(self).__name__
        require(isinstance(n_labelled, int) and n_labelled >= 1, name, "n_labelled", n_labelled, "paper: 1, 2, 4 or 8")
        require(isinstance(n_folds, int) and n_folds >= 2, name, "n_folds", n_folds, "paper: 5")
        require(isinstance(fold, int) and 0 <= fold < n_folds, name, "fold", fold, f"use 0..{n_folds - 1}")
        require(lr > 0, name, "lr", lr, "paper: 5e-4")
        require(isinstance(batch_size, int) and batch_size >= 1, name, "batch_size", batch_size, "paper: 10")
        require(isinstance(local_epochs, int) and local_epochs >= 1, name, "local_epochs", local_epochs, "paper: 1")
        require_int(name, "max_steps_per_round", max_steps_per_round, 0, "use 0 (full epoch) or a positive step count")
        require_unet_args(name, features, image_size)
        self.data_root = data_root
        self.image_size = image_size
        self.target_spacing = target_spacing
        self.features = list(features)
        self.n_labelled = n_labelled
        self.fold = fold
        self.n_folds = n_folds
        self.lr = lr
        self.batch_size = batch_size
        self.local_epochs = local_epochs
        self.max_steps_per_round = max_steps_per_round
        self.seed = seed
        self.device = device
        self._trainer: SegmentationTrainer | None = None
        self._split: dict | None = None

    def _setup(self, fl_ctx: FLContext, num_rounds: int) -> None:
        site = self.site_name(fl_ctx)
        root = self.resolve_root(self.data_root, fl_ctx)
        volumes = load_site(root, with_labels=True, target_spacing=self.target_spacing,
                            image_size=self.image_size, site=site)
        self._split = site_split({site: volumes}, self.fold, self.n_labelled, n_folds=self.n_folds)[site]
        steps = steps_per_epoch(self._split["train_volumes"], self.batch_size, self.max_steps_per_round or None)
        torch.manual_seed(self.seed)
        unet = build_unet(self.features)
        self._trainer = SegmentationTrainer(unet, lr=self.lr, batch_size=self.batch_size, total_steps=steps * self.local_epochs * num_rounds,
                                            seed=self.seed, device=pick_device(self.device))
        state = self.load_checkpoint(fl_ctx)
        if state is not None:
            self._trainer.load_state_dict(state["trainer"])
        self.log_info(fl_ctx, f"{site}: fold {self.fold}, {self.n_labelled} labelled patients "
                              f"({len(self._split['train_volumes'])} volumes), {len(self._split['val_volumes'])} validation volumes")

    def train(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        round_idx = int(shareable.get_header(AppConstants.CURRENT_ROUND, 0))
        num_rounds = int(shareable.get_header(AppConstants.NUM_ROUNDS, 1))
        if self._trainer is None:
            self._setup(fl_ctx, num_rounds)
        trainer, split = self._trainer, self._split
        dxo = from_shareable(shareable)
        trainer.unet.load_state_dict({k: torch.as_tensor(np.asarray(v)) for k, v in dxo.data.items()})
        val = mean_dice(dice_per_volume(trainer.unet, split["val_volumes"], device=trainer.device))
        step0 = trainer.step
        losses = [trainer.train_epoch(split["train_volumes"], max_steps=self.max_steps_per_round or None)
                  for _ in range(self.local_epochs)]
        loss = sum(losses) / len(losses)
        self.save_checkpoint(fl_ctx, {"round": round_idx, "trainer": trainer.state_dict()})
        self.append_metrics(fl_ctx, {"round": round_idx, "loss": loss, "val_dice_global": val["mean"]})
        self.log_info(fl_ctx, f"round {round_idx + 1}/{num_rounds}: loss {loss:.4f}, "
                              f"global model validation Dice {val['mean']:.3f}")
        weights = {k: v.detach().cpu().numpy() for k, v in trainer.unet.state_dict().items()}
        n_slices = sum(v.n_slices for v in split["train_volumes"])
        meta = {"num_samples": n_slices, MetaKey.NUM_STEPS_CURRENT_ROUND: trainer.step - step0, "loss": loss,
                "val_dice": val["mean"]}
        return DXO(data_kind=DataKind.WEIGHTS, data=weights, meta=meta).to_shareable()
