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

from fedssl.core.checks import require, require_amp, require_choice, require_int, require_workers
from fedssl.data.images import DATASETS, load_image_records
from fedssl.flare.classifier_executor import ClassifierExecutor
from fedssl.flare.site_executor import pick_device
from fedssl.flare.trainer_executor import TrainerExecutor
from fedssl.models.resnet import require_resnet_args
from fedssl.train.resnet_classifier import ResNetClassifierLocalTrainer


class ResNetClassifierExecutor(ClassifierExecutor):
    checkpoint_name = "resnet_cls_client_state.pt"

    def __init__(self, dataset: str = "derm5", data_root: str = "", image_size: int = 64, width: int = 64,
                 lr: float = 1e-4, batch_size: int = 128, local_epochs: int = 1, weight_decay: float = 0.0,
                 label_fraction: float = 0.1, max_steps_per_epoch: int = 0, eval_batch_size: int = 256, seed: int = 0,
                 device: str = "auto", depth: int = 18, amp: bool = False, workers: int = 0):
        """Args (paper settings as defaults):
            data_root: the device folder with ``train``, ``val``, ``test`` ("" = site config / FEDSSL_DATA_ROOT).
            label_fraction: L, the labelled fraction of the device's training images (paper: 0.1, 0.2, 0.4, 0.8).
            weight_decay: 0 = Adam (the paper's optimiser).
            depth: 18 (FedCLF's ResNet-18) or 50 (ResNet-50, FedMAE-KS's CNN baselines).
            workers: DataLoader worker processes that build the next batches (0 = in the training process; the
                same batches either way), pinned on a CUDA device.
            the rest: see :class:`~fedssl.train.resnet_classifier.ResNetClassifierLocalTrainer`.
        """
        args = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        TrainerExecutor.__init__(self)
        name = type(self).__name__
        require_choice(name, "dataset", dataset, DATASETS)
        require(isinstance(data_root, str), name, "data_root", data_root, 'use a path string ({site} allowed) or ""')
        require_int(name, "image_size", image_size, 8, "use the crop size in pixels (images are 72 px high)")
        require_resnet_args(name, width, depth=depth)
        require(isinstance(lr, (int, float)) and lr > 0, name, "lr", lr, "use a positive learning rate (paper: 1e-4)")
        require_int(name, "batch_size", batch_size, 1, "use a positive batch size (paper: 128)")
        require_int(name, "local_epochs", local_epochs, 1, "use a positive number of epochs per round (paper: 1)")
        require(isinstance(weight_decay, (int, float)) and weight_decay >= 0, name, "weight_decay", weight_decay,
                "use 0 (Adam, the paper's) or a positive decay")
        require(isinstance(label_fraction, (int, float)) and 0 < label_fraction <= 1, name, "label_fraction",
                label_fraction, "use a fraction in (0, 1]; paper: 0.1, 0.2, 0.4 or 0.8")
        require_int(name, "max_steps_per_epoch", max_steps_per_epoch, 0, "use 0 (full epoch) or a positive count")
        require_int(name, "eval_batch_size", eval_batch_size, 1, "use a positive batch size")
        require_int(name, "seed", seed, 0, "use a non-negative integer")
        require_amp(name, amp)
        require_workers(name, workers)
        self.__dict__.update(args)  # stored verbatim
        self.settings = args
        self.test_root = ""
        self.val_metrics = None

    def split_dir(self, fl_ctx: FLContext, split: str) -> str:
        return os.path.join(self.resolve_root(self.data_root, fl_ctx), split)

    def build_trainer(self, fl_ctx: FLContext, num_rounds: int) -> ResNetClassifierLocalTrainer:
        site = self.site_name(fl_ctx)
        train, val = (load_image_records(self.split_dir(fl_ctx, s), self.dataset, site=site) for s in ("train", "val"))
        settings = {k: v for k, v in self.settings.items() if k not in ("data_root", "device")}
        trainer = ResNetClassifierLocalTrainer(train, val, num_rounds=num_rounds, site=site,
                                               device=pick_device(self.device), **settings)
        self.log_info(fl_ctx, f"{site}: {trainer.summary}")
        return trainer

    def test_dir(self, fl_ctx: FLContext) -> str:
        return self.split_dir(fl_ctx, "test")
