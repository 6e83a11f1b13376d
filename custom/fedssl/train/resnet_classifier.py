"""Fine-tuning of the ResNet-18 classifier on one device ("Federated Self-Supervised Learning for Dermatological
Disease Diagnosis", FedCLF / FedMAE-KS, sec. V-A "Evaluation" and "Training details").

* :class:`ResNetClassifierLocalTrainer` (a ``LocalTrainer``, federated fine-tuning: Adam, batch 128, lr 1e-4,
  100 rounds of one local epoch).  Unlike the ViT trainer it takes the device's own train / validation split (the
  paper splits each device 60/20/20 into train / val / test); the labelled subset is ``select_labelled(train, L)``
  with L in {10, 20, 40, 80}% per device, drawn per class with ``site_seed(split_seed, device)``: the training
  ``seed`` (weights, batch order, augmentations) does not move it.  It reuses every method of
  :class:`fedssl.train.classifier.ClassifierLocalTrainer` (evaluation, test records, checkpoint, global state).
* :func:`local_finetune_device` (Table I: local fine-tuning, Adam, batch 256, lr 1e-4, 20 epochs, x0.2 at epochs
  12 and 16): the model of the epoch with the best validation mean recall is tested.

Metrics: the paper's mean recall (balanced multi-class accuracy) and mean precision of each device's test set
(``balanced_accuracy`` and ``macro_precision`` of :func:`fedssl.core.classification.classification_metrics`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fedssl.core.checks import require, require_amp, require_choice, require_int, require_workers
from fedssl.core.seeds import site_seed
from fedssl.data.images import DATASETS, ImageDataset, ImageRecord, class_histogram, class_names, select_labelled
from fedssl.models.resnet import PAPER_DEPTH, PAPER_WIDTH, ResNetClassifier, require_resnet_args
from fedssl.train.classifier import ClassifierLocalTrainer
from fedssl.train.classifier_loop import ClassifierTrainer

#: FedCLF sec. V-A: local fine-tuning decays the lr by 0.2 at epochs 12 and 16 of 20
LOCAL_MILESTONES = (12, 16)
LOCAL_GAMMA = 0.2


@dataclass(frozen=True)
class ResNetClassifierSettings:
    """Every setting of a device's ResNet fine-tuning, declared once: the job arguments of
    ``ResNetClassifierExecutor`` and what :class:`ResNetClassifierLocalTrainer` reads (paper settings as defaults:
    federated fine-tuning, Adam lr 1e-4, batch 128, one local epoch per round).

    dataset: the device folder's layout and classes; data_root: the device folder with ``train``, ``val``, ``test``
    ("" = site config / FEDSSL_DATA_ROOT); image_size: the crop (images are 72 px high); width, depth: the ResNet
    (18: FedCLF's ResNet-18; 50: FedMAE-KS's CNN baselines); lr, batch_size, local_epochs; weight_decay: 0 = Adam (the
    paper's optimiser; AdamW with decay 0 is Adam); label_fraction: L, the labelled fraction of the device's
    training images (paper: 0.1, 0.2, 0.4, 0.8); max_steps_per_epoch: 0 = full epoch; eval_batch_size; seed: the
    training seed (the model's initial weights; the device's batch order and augmentations:
    ``site_seed(seed, device)``); split_seed: which training images are labelled (per device
    ``site_seed(split_seed, device)``), the same for every training seed; device: "auto", "cpu", "cuda[:N]"; amp:
    bfloat16 autocast on GPUs that support it; workers: DataLoader worker processes (the same batches either way).
    """

    dataset: str = "derm5"
    data_root: str = ""
    image_size: int = 64
    width: int = PAPER_WIDTH
    lr: float = 1e-4
    batch_size: int = 128
    local_epochs: int = 1
    weight_decay: float = 0.0
    label_fraction: float = 0.1
    max_steps_per_epoch: int = 0
    eval_batch_size: int = 256
    seed: int = 0
    split_seed: int = 0
    device: str = "auto"
    depth: int = PAPER_DEPTH
    amp: bool = False
    workers: int = 0

    def check(self, name: str) -> None:
        """Every argument checked; the message names component ``name``, the argument, its value and the fix."""
        require_choice(name, "dataset", self.dataset, DATASETS)
        require(isinstance(self.data_root, str), name, "data_root", self.data_root,
                'use a path string ({site} allowed) or ""')
        require_int(name, "image_size", self.image_size, 8, "use the crop size in pixels (images are 72 px high)")
        require_resnet_args(name, self.width, depth=self.depth)
        require(isinstance(self.lr, (int, float)) and self.lr > 0, name, "lr", self.lr,
                "use a positive learning rate (paper: 1e-4)")
        require_int(name, "batch_size", self.batch_size, 1, "use a positive batch size (paper: 128)")
        require_int(name, "local_epochs", self.local_epochs, 1, "use a positive number of epochs per round (paper: 1)")
        require(isinstance(self.weight_decay, (int, float)) and self.weight_decay >= 0, name, "weight_decay",
                self.weight_decay, "use 0 (Adam, the paper's) or a positive decay")
        require(isinstance(self.label_fraction, (int, float)) and 0 < self.label_fraction <= 1, name, "label_fraction",
                self.label_fraction, "use a fraction in (0, 1]; paper: 0.1, 0.2, 0.4 or 0.8")
        require_int(name, "max_steps_per_epoch", self.max_steps_per_epoch, 0, "use 0 (full epoch) or a positive count")
        require_int(name, "eval_batch_size", self.eval_batch_size, 1, "use a positive batch size")
        require_int(name, "seed", self.seed, 0, "use a non-negative integer")
        require_int(name, "split_seed", self.split_seed, 0, "use a non-negative integer")
        require_amp(name, self.amp)
        require_workers(name, self.workers)


class ResNetClassifierLocalTrainer(ClassifierLocalTrainer):
    """One device's fine-tuning of :class:`~fedssl.models.resnet.ResNetClassifier` with the settings of a
    :class:`ResNetClassifierSettings`.

    ``milestones``: epochs / rounds at which the lr is multiplied by ``gamma`` (empty: constant lr; local fine-tuning
    only, no job argument); ``device``: a torch device (the executor resolves the settings' "auto")."""

    def __init__(self, train: Sequence[ImageRecord], val: Sequence[ImageRecord], settings: ResNetClassifierSettings, *,
                 num_rounds: int, site: str = "?", device: str | torch.device = "cpu",
                 milestones: Sequence[float] = (), gamma: float = LOCAL_GAMMA):
        s = settings
        s.check(type(self).__name__)
        self.settings, self.workers = s, int(s.workers)
        if not val:
            raise ValueError(f"{site}: no validation image; the device's val split selects the model")
        self.site, self.dataset, self.image_size, self.seed = site, s.dataset, s.image_size, s.seed
        self.data_seed = data_seed = site_seed(s.seed, site)
        self.batch_size, self.local_epochs, self.eval_batch_size = s.batch_size, s.local_epochs, s.eval_batch_size
        self.max_steps_per_epoch = s.max_steps_per_epoch
        self.classes = class_names(s.dataset)
        labelled = select_labelled(list(train), s.label_fraction, seed=site_seed(s.split_seed, site))
        self.train_set = ImageDataset(labelled, s.image_size, "finetune", s.dataset, site=site, seed=data_seed)
        self.val_set = ImageDataset(list(val), s.image_size, "eval", s.dataset, site=site)
        self.test_set: ImageDataset | None = None
        model = ResNetClassifier(len(self.classes), s.width, seed=s.seed, depth=s.depth).to(device)
        self.trainer = ClassifierTrainer(model, lr=s.lr, total_rounds=num_rounds, warmup_rounds=0, min_lr=0.0,
                                         weight_decay=s.weight_decay, layer_decay=1.0, head_prefix="fc.",
                                         milestones=list(milestones) or [num_rounds], gamma=gamma, device=device,
                                         seed=data_seed, amp=s.amp)
        self.summary = (f"{len(train)} training images, {len(val)} validation; {len(labelled)} labelled "
                        f"({s.label_fraction:g}) per class {class_histogram(labelled, len(self.classes))}; "
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
    device = settings.pop("device", "cpu")
    s = ResNetClassifierSettings(label_fraction=label_fraction, batch_size=batch_size, lr=lr, **settings)
    t = ResNetClassifierLocalTrainer(train, val, s, num_rounds=epochs, site=site, device=device, milestones=milestones,
                                     gamma=gamma)
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
