"""Client executor for federated fine-tuning of the ResNet-18 classifier on a FedCLF device ("Federated
Self-Supervised Learning for Dermatological Disease Diagnosis", sec. V-A: federated fine-tuning, 100 rounds,
batch 128, Adam lr 1e-4, label fraction L per device).

The round protocol and the ``test`` task are :class:`fedssl.flare.classifier_executor.ClassifierExecutor`'s
(validation of the received global model for IntimeModelSelector, fine-tuning, upload weighted by labelled
images; FinalEvaluation's test of the model selected on validation); what differs is the model
(:class:`fedssl.train.resnet_classifier.ResNetClassifierLocalTrainer`) and the data: a device folder holds its own
60/20/20 split, ``<data_root>/train``, ``<data_root>/val`` and ``<data_root>/test`` (class folders).
"""

from __future__ import annotations

import os

from nvflare.apis.fl_context import FLContext

from fedssl.core.checks import takes_settings
from fedssl.data.images import load_image_records
from fedssl.flare.classifier_executor import ClassifierExecutor
from fedssl.flare.site_executor import pick_device
from fedssl.flare.trainer_executor import TrainerExecutor
from fedssl.train.resnet_classifier import ResNetClassifierLocalTrainer, ResNetClassifierSettings


class ResNetClassifierExecutor(ClassifierExecutor):
    checkpoint_name = "resnet_cls_client_state.pt"

    @takes_settings(ResNetClassifierSettings)
    def __init__(self, **args):
        """The arguments are the fields of :class:`fedssl.train.resnet_classifier.ResNetClassifierSettings` (paper
        settings as defaults, documented there), each stored verbatim and checked at once; an unknown name is
        refused."""
        TrainerExecutor.__init__(self)
        self.configure(ResNetClassifierSettings, args)
        self.test_root = ""
        self.val_metrics = None

    def split_dir(self, fl_ctx: FLContext, split: str) -> str:
        return os.path.join(self.resolve_root(self.data_root, fl_ctx), split)

    def build_trainer(self, fl_ctx: FLContext, num_rounds: int) -> ResNetClassifierLocalTrainer:
        site = self.site_name(fl_ctx)
        train, val = (load_image_records(self.split_dir(fl_ctx, s), self.dataset, site=site) for s in ("train", "val"))
        trainer = ResNetClassifierLocalTrainer(train, val, self.settings, num_rounds=num_rounds, site=site,
                                               device=pick_device(self.device))
        self.log_info(fl_ctx, f"{site}: {trainer.summary}")
        return trainer

    def test_dir(self, fl_ctx: FLContext) -> str:
        return self.split_dir(fl_ctx, "test")
