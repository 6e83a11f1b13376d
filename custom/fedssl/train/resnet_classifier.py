"""Fine-tuning of the ResNet-18 classifier on one device ("Federated Self-Supervised Learning for Dermatological
Disease Diagnosis", FedCLF / FedMAE-KS, sec. V-A "Evaluation" and "Training details").

* :class:`ResNetClassifierLocalTrainer` (a ``LocalTrainer``, federated fine-tuning: Adam, batch 128, lr 1e-4,
  100 rounds of one local epoch).  Unlike the ViT trainer it takes the device's own train / validation split (the
  paper splits each device 60/20/20 into train / val / test); the labelled subset is ``select_labelled(train, L)``
  with L in {10, 20, 40, 80}% per device, drawn per class with the device seed.  It reuses every method of
  :class:`fedssl.train.classifier.ClassifierLocalTrainer` (evaluation, test records, checkpoint, global state).
* :func:`local_finetune_device` (Table I: local fine-tuning, Adam, batch 256, lr 1e-4, 20 epochs, x0.2 at epochs
  12 and 16): the model of the epoch with the best validation mean recall is tested.

Metrics: the paper's mean recall (balanced multi-class accuracy) and mean precision of each device's test set
(``balanced_accuracy`` and ``macro_precision`` of :func:`fedssl.core.classification.classification_metrics`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fedssl.core.classification import ClassifierTrainer
from fedssl.core.seeds import site_seed
from fedssl.data.images import ImageDataset, ImageRecord, class_histogram, class_names, select_labelled
from fedssl.data.loading import check_workers
from fedssl.models.resnet import PAPER_DEPTH, PAPER_WIDTH, ResNetClassifier
from fedssl.train.classifier import ClassifierLocalTrainer

#: FedCLF sec. V-A: local fine-tuning decays the lr by 0.2 at epochs 12 and 16 of 20
LOCAL_MILESTONES = (12, 16)
LOCAL_GAMMA = 0.2


class ResNetClassifierLocalTrainer(ClassifierLocalTrainer):
    """One device's fine-tuning of :class:`~fedssl.models.resnet.ResNetClassifier` (paper settings as defaults:
    federated fine-tuning, Adam lr 1e-4, batch 128, one local epoch per round).

    ``milestones``: epochs / rounds at which the lr is multiplied by ``gamma`` (empty: constant lr);
    ``weight_decay`` 0 = Adam (the paper's optimiser; AdamW with decay 0 is Adam)."""

    def __init__(self, train: Sequence[ImageRecord], val: Sequence[ImageRecord], *, num_rounds: int, site: str = "?",
                 dataset: str = "derm5", image_size: int = 64, width: int = PAPER_WIDTH, lr: float = 1e-4,
                 batch_size: int = 128, local_epochs: int = 1, milestones: Sequence[float] = (), gamma: float = LOCAL_GAMMA,
                 weight_decay: float = 0.0, label_fraction: float = 1.0, max_steps_per_epoch: int = 0,
                 eval_batch_size: int = 256, seed: int = 0, device: str | torch.device = "cpu", depth: int = PAPER_DEPTH,
                 amp: bool = False, workers: int = 0):
        self.workers = check_workers(workers, type(self).__name__)
        if not val:
            raise ValueError(f"{site}: no validation image; the device's val split selects the model")
        self.site, self.dataset, self.image_size, self.seed = site, dataset, image_size, seed
        self.data_seed = data_seed = site_seed(seed, site)
        self.batch_size, self.local_epochs, self.eval_batch_size = batch_size, local_epochs, eval_batch_size
        self.max_steps_per_epoch = max_steps_per_epoch
        self.classes = class_names(dataset)
        labelled = select_labelled(list(train), label_fraction, seed=data_seed)
        self.train_set = ImageDataset(labelled, image_size, "finetune", dataset, site=site, seed=data_seed)
        self.val_set = ImageDataset(list(val), image_size, "eval", dataset, site=site)
        self.test_set: ImageDataset | None = None
        model = ResNetClassifier(len(self.classes), width, seed=seed, depth=depth).to(device)
        self.trainer = ClassifierTrainer(model, lr=lr, total_rounds=num_rounds, warmup_rounds=0, min_lr=0.0,
                                         weight_decay=weight_decay, layer_decay=1.0, head_prefix="fc.",
                                         milestones=list(milestones) or [num_rounds], gamma=gamma, device=device,
                                         seed=data_seed, amp=amp)
        self.summary = (f"{len(train)} training images, {len(val)} validation; {len(labelled)} labelled "
                        f"({label_fraction:g}) per class {class_histogram(labelled, len(self.classes))}; "
                        f"device {self.trainer.device}")

    @property
    def model(self) -> ResNetClassifier:
        return self.trainer.model


def local_finetune_device(train: Sequence[ImageRecord], val: Sequence[ImageRecord], test: Sequence[ImageRecord], *,
                          init: dict | None, site: str, label_fraction: float, epochs: int = 20,
                          milestones: Sequence[float] = LOCAL_MILESTONES, gamma: float = LOCAL_GAMMA,
                          batch_size: int = 256, lr: float = 1e-4, select_on: str = "balanced_accuracy",
                          progress: Callable[[str], None] | None = None, **settings: Any) -> dict:
    """Table I's protocol on one device: fine-tune for ``epochs`` epochs from ``init`` (a pre-training global state,
    its encoder is loaded; None = random init), keep the epoch with the best validation ``select_on``, and return
    its test metrics ``{"site", "label_fraction", "best_epoch", "val": ..., "test": ...}`` (``test`` holds
    ``balanced_accuracy`` = mean recall and ``macro_precision`` = mean precision)."""
    t = ResNetClassifierLocalTrainer(train, val, num_rounds=epochs, site=site, label_fraction=label_fraction,
                                     milestones=milestones, gamma=gamma, batch_size=batch_size, lr=lr, **settings)
    if init is not None:
        t.model.load_encoder(init, f"the pre-trained model for {site}")
    best, best_state, best_epoch = None, None, -1
    for epoch in range(epochs):
        t.train_round(epoch)
        val_metrics = t.evaluate("val")
        score = val_metrics[select_on] if val_metrics[select_on] is not None else -1.0
        if best is None or score > best[select_on]:
            best, best_epoch = {**val_metrics, select_on: score}, epoch
            best_state = copy.deepcopy(t.model.state_dict())
        if progress is not None:
            progress(f"{site} epoch {epoch + 1}/{epochs}: val {select_on} {score:.3f}")
    t.model.load_state_dict(best_state)
    t.set_test_records(test)
    return {"site": site, "label_fraction": label_fraction, "best_epoch": best_epoch,
            "val": _scalars(best), "test": _scalars(t.evaluate("test"))}


def _scalars(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k not in ("per_class", "confusion_matrix")}
