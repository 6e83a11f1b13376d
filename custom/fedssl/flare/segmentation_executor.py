"""Client executor for federated fine-tuning of the U-Net with N annotated patients per site.

Paper: "Distributed contrastive learning for medical image segmentation" (Wu, Zeng, Wang, Shi, Hu; Medical
Image Analysis, 2022), section 5.  Each round: evaluate the received global model on the site's validation
patients of the fold (Dice over LV, MYO, RV; reported in the result meta, never used to pick a checkpoint),
then train ``local_epochs`` epochs on the site's N labelled patients
(:class:`fedssl.train.segmentation.SegmentationLocalTrainer`) and upload the weights with the number of
labelled slices.

Which patients: :func:`fedssl.train.protocol.site_split`, the split of the local protocol: the fold's split
seeded by ``site_seed(split_seed, site name)``, its N annotated patients by ``fold_seed(split_seed, site name,
fold)`` (reproducible from fold, N, split_seed and the site name).  Batch order
and augmentations: ``site_seed(seed, site name)``; the initial U-Net: ``seed`` (the server's broadcast
replaces it before the first step).
"""

from __future__ import annotations

from nvflare.apis.dxo import DXO
from nvflare.apis.fl_context import FLContext

from fedssl.core.checks import require, require_amp, require_int
from fedssl.core.seeds import site_seed
from fedssl.core.trainer import RoundStats
from fedssl.data.acdc import load_site
from fedssl.flare.site_executor import pick_device
from fedssl.flare.trainer_executor import TrainerExecutor
from fedssl.models.unet import require_unet_args
from fedssl.train.protocol import site_split
from fedssl.train.segmentation import SegmentationLocalTrainer, init_unet


class SegmentationExecutor(TrainerExecutor):
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
        max_steps_per_epoch: int = 0,
        seed: int = 0,
        split_seed: int = 0,
        device: str = "auto",
        amp: bool = False,
    ):
        """
        Args (paper settings as defaults): n_labelled = N annotated patients of the site (1, 2, 4, 8);
        fold of the 5-fold split (8 train / 2 validation patients per site); Adam lr 5e-4, batch 10,
        cosine over all rounds; local_epochs per round (paper: 1); max_steps_per_epoch caps each local
        epoch (0 = no cap); seed: the job seed (initial U-Net; the site's batches and augmentations use
        site_seed(seed, site)); split_seed: the seed of the patient split (per site site_seed(split_seed, site);
        the annotated patients fold_seed(split_seed, site, fold)), the same as the local protocol's
        (``fedssl fcl finetune``) so both fine-tune on the same patients.
        """
        super().__init__()
        name = type(self).__name__
        require(isinstance(data_root, str), name, "data_root", data_root, 'use a path string or ""')
        require(isinstance(n_labelled, int) and n_labelled >= 1, name, "n_labelled", n_labelled, "paper: 1, 2, 4 or 8")
        require(isinstance(n_folds, int) and n_folds >= 2, name, "n_folds", n_folds, "paper: 5")
        require(isinstance(fold, int) and 0 <= fold < n_folds, name, "fold", fold, f"use 0..{n_folds - 1}")
        require(lr > 0, name, "lr", lr, "paper: 5e-4")
        require(isinstance(batch_size, int) and batch_size >= 1, name, "batch_size", batch_size, "paper: 10")
        require(isinstance(local_epochs, int) and local_epochs >= 1, name, "local_epochs", local_epochs, "paper: 1")
        require_int(name, "max_steps_per_epoch", max_steps_per_epoch, 0, "use 0 (full epoch) or a positive step count")
        require_int(name, "seed", seed, 0, "use the job's non-negative integer seed")
        require_int(name, "split_seed", split_seed, 0, "use a non-negative integer (the local protocol's: 0)")
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
        self.max_steps_per_epoch = max_steps_per_epoch
        self.seed = seed
        self.split_seed = split_seed
        require_amp(type(self).__name__, amp)
        self.device, self.amp = device, amp
        self._val = float("nan")  # Dice of the last received global model

    def build_trainer(self, fl_ctx: FLContext, num_rounds: int) -> SegmentationLocalTrainer:
        site = self.site_name(fl_ctx)
        volumes = load_site(self.resolve_root(self.data_root, fl_ctx), with_labels=True,
                            target_spacing=self.target_spacing, image_size=self.image_size, site=site)
        split = site_split({site: volumes}, self.fold, self.n_labelled, n_folds=self.n_folds,
                           split_seed=self.split_seed)[site]
        unet = init_unet("random", features=self.features, seed=self.seed)
        trainer = SegmentationLocalTrainer(unet, split["train_volumes"], split["val_volumes"],
                                           num_rounds=num_rounds, lr=self.lr, batch_size=self.batch_size,
                                           local_epochs=self.local_epochs, max_steps_per_epoch=self.max_steps_per_epoch,
                                           seed=site_seed(self.seed, site), device=pick_device(self.device),
                                           amp=self.amp)
        self.log_info(fl_ctx, f"{site}: fold {self.fold}, labelled patients {split['train_patients']} "
                              f"({len(split['train_volumes'])} volumes, split seed site_seed({self.split_seed}, {site})), "
                              f"validation patients {split['val_patients']} ({len(split['val_volumes'])} volumes)")
        return trainer

    def receive(self, dxo: DXO, fl_ctx: FLContext, round_idx: int) -> dict:
        super().receive(dxo, fl_ctx, round_idx)
        self._val = self.trainer.evaluate("val")["dice"]  # the received global model, before local training
        return {"val_dice_global": self._val}

    def result_meta(self, stats: RoundStats, dxo: DXO, fl_ctx: FLContext) -> dict:
        return {"val_dice": self._val}

    def describe_round(self, stats: RoundStats) -> str:
        return f"loss {stats.loss:.4f}, global model validation Dice {self._val:.3f}"
