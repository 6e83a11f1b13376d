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

from fedssl.core.checks import takes_settings
from fedssl.core.trainer import RoundStats
from fedssl.data.acdc import load_site
from fedssl.flare.site_executor import pick_device
from fedssl.flare.trainer_executor import TrainerExecutor
from fedssl.train.protocol import site_split
from fedssl.train.segmentation import SegmentationLocalTrainer, SegmentationSettings, init_unet


class SegmentationExecutor(TrainerExecutor):
    checkpoint_name = "seg_client_state.pt"
    metrics_name = "seg_metrics.jsonl"

    @takes_settings(SegmentationSettings)
    def __init__(self, **args):
        """The arguments are the fields of :class:`fedssl.train.segmentation.SegmentationSettings` (paper settings
        as defaults, documented there), each stored verbatim and checked at once; an unknown name is refused."""
        super().__init__()
        self.configure(SegmentationSettings, args)
        self._val = float("nan")  # Dice of the last received global model

    def build_trainer(self, fl_ctx: FLContext, num_rounds: int) -> SegmentationLocalTrainer:
        site = self.site_name(fl_ctx)
        volumes = load_site(self.resolve_root(self.data_root, fl_ctx), with_labels=True,
                            target_spacing=self.target_spacing, image_size=self.image_size, site=site)
        split = site_split({site: volumes}, self.fold, self.n_labelled, n_folds=self.n_folds,
                           split_seed=self.split_seed)[site]
        unet = init_unet("random", features=list(self.features), seed=self.seed, norm=self.norm)
        trainer = SegmentationLocalTrainer(unet, split["train_volumes"], split["val_volumes"], self.settings,
                                           num_rounds=num_rounds, site=site, device=pick_device(self.device))
        self.log_info(fl_ctx, f"{site}: fold {self.fold}, labelled patients {split['train_patients']} "
                              f"({len(split['train_volumes'])} volumes, split seed site_seed({self.split_seed}, "
                              f"{site})), validation patients {split['val_patients']} ({len(split['val_volumes'])} "
                              "volumes)")
        return trainer

    def receive(self, dxo: DXO, fl_ctx: FLContext, round_idx: int) -> dict:
        super().receive(dxo, fl_ctx, round_idx)
        self._val = self.trainer.evaluate("val")["dice"]  # the received global model, before local training
        return {"val_dice_global": self._val}

    def result_meta(self, stats: RoundStats, dxo: DXO, fl_ctx: FLContext) -> dict:
        return {"val_dice": self._val}

    def describe_round(self, stats: RoundStats) -> str:
        return f"loss {stats.loss:.4f}, global model validation Dice {self._val:.3f}"
