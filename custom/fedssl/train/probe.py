"""Frozen-encoder probes: is a pre-trained encoder, as it is, better than a random one (issue 14 item 4)?

Fine-tuning changes the encoder, so a fine-tuning score mixes what pre-training learnt with what the labels teach.
A probe freezes the encoder and trains only what sits on top of it on the same labelled data:

* :func:`frozen_encoder_probe` (ACDC, FCL (Wu et al., MedIA 2022) section 5): the local fine-tuning protocol of one
  site -- the same fold split, labelled patients and pooled validation patients of all sites
  (:func:`fedssl.train.protocol.local_split`), the same
  optimiser, schedule, batches and augmentations (:class:`fedssl.train.segmentation.SegmentationTrainer`) -- with the
  U-Net's encoder frozen: its parameters do not require gradients and are not in the optimiser, and its modules
  stay in eval mode (MONAI's BasicUNet normalises with instance norm, which keeps no running statistics; a
  BatchNorm would keep its own, a dropout would stay off), so only the decoder learns.  The encoder comes out
  bit-identical.
* :func:`linear_probe` (ViT, SSL-FL (Yan et al., IEEE TMI 2023)): the frozen encoder's mean-pooled patch tokens
  (:func:`fedssl.eval.features.vit_features`) of the site's labelled images (the split of
  :class:`fedssl.train.classifier.ClassifierLocalTrainer`) fit a logistic-regression head; accuracy on held-out
  images (the site's validation split, or the given test images).

A pre-trained encoder that beats a random one here learnt features the task can use; one that does not, did not
(whatever fine-tuning then makes of it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedssl.core.seeds import site_seed
from fedssl.data.images import ImageDataset, ImageRecord, batches, class_names, select_labelled, train_val_split
from fedssl.data.volume import Volume
from fedssl.eval.features import vit_features
from fedssl.eval.segmentation import ACDC_CLASSES, dice_per_volume, mean_dice
from fedssl.models.unet import ENCODER_MODULES, NORMS, fill_batch_statistics
from fedssl.models.vit import ViTClassifier, load_pretrained_encoder
from fedssl.train.protocol import local_split
from fedssl.train.segmentation import (SegmentationTrainer, epochs_with_floor, init_unet, slices_from_volumes,
                                      steps_per_epoch)


class FrozenEncoderUNet(nn.Module):
    """A U-Net whose encoder (``conv_0`` ... ``down_4``) is frozen: no gradient, always in eval mode."""

    def __init__(self, unet: nn.Module):
        super().__init__()
        self.unet = unet
        for p in self.encoder_parameters():
            p.requires_grad_(False)
        self.train()

    def encoder_modules(self) -> list[nn.Module]:
        return [getattr(self.unet, name) for name in ENCODER_MODULES]

    def encoder_parameters(self) -> list[nn.Parameter]:
        return [p for m in self.encoder_modules() for p in m.parameters()]

    def decoder_parameters(self) -> list[nn.Parameter]:
        """Every parameter outside the encoder (the decoder and the output layer): what the probe trains."""
        frozen = {id(p) for p in self.encoder_parameters()}
        return [p for p in self.unet.parameters() if id(p) not in frozen]

    def train(self, mode: bool = True) -> "FrozenEncoderUNet":
        super().train(mode)
        for m in self.encoder_modules():
            m.eval()
        return self

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The encoder's bottleneck of ``x`` (the contracting path alone)."""
        for m in self.encoder_modules():
            x = m(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.unet(x)


class DecoderTrainer(SegmentationTrainer):
    """:class:`SegmentationTrainer` (Adam, cosine schedule, batches, augmentation) whose optimiser holds only the
    decoder's parameters of a :class:`FrozenEncoderUNet`."""

    def __init__(self, unet: FrozenEncoderUNet, **kwargs: Any):
        super().__init__(unet, **kwargs)
        self.optimizer = torch.optim.Adam(unet.decoder_parameters(), lr=self.lr)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.scheduler.lr_lambdas[0])


def frozen_encoder_probe(site_volumes: Mapping[str, Sequence[Volume]], init: object, *, site: str, n_labelled: int,
                         fold: int, features: Sequence[int], epochs: int, batch_size: int = 10, lr: float = 5e-4,
                         seed: int = 0, device: str | torch.device = "cpu", max_steps_per_epoch: int | None = None,
                         n_folds: int = 5, split_seed: int = 0, method: str = "", min_steps: int = 0,
                         norm: str = NORMS[0]) -> dict:
    """Train only the decoder of a U-Net whose encoder is ``init`` (``"random"`` or an encoder state dict, as
    :func:`fedssl.train.segmentation.init_unet`) on the ``n_labelled`` patients of ``site`` in ``fold``; Dice on the
    fold's validation patients of all sites.  One row, as the local protocol's, with ``"mode": "probe"``::

        {"method", "mode", "n_labelled", "fold", "site", "dice", "RV", "MYO", "LV", "train_patients",
         "n_train_volumes", "val_patients", "n_val_volumes", "final_loss", "epochs"}

    The decoder's initial weights come from ``seed`` (identical for every ``init``), the batches and augmentations
    from ``site_seed(seed, site)``, so two encoders probed with the same arguments see the same data in the same
    order and start from the same decoder.  ``min_steps``: the step floor of the fine-tuning protocol
    (:func:`fedssl.train.segmentation.epochs_with_floor`); ``norm``: the U-Net's, the pre-training's.  With "batch"
    the frozen encoder normalises by its running statistics; a random encoder, which has none, first gets those of
    the site's labelled slices (:func:`fedssl.models.unet.fill_batch_statistics`; a pre-trained one keeps its
    own)."""
    train_ids, train_vols, val_ids, val_vols = local_split(site_volumes, site, n_labelled, fold, n_folds=n_folds,
                                                           split_seed=split_seed)
    model = FrozenEncoderUNet(init_unet(init, features=features, seed=seed, norm=norm))
    images = slices_from_volumes(train_vols)[0]  # a random encoder's BatchNorm statistics: of the labelled slices
    fill_batch_statistics(nn.ModuleList(model.encoder_modules()),
                          [images[i:i + batch_size] for i in range(0, len(images), batch_size)],
                          forward=model.encode)
    per_epoch = steps_per_epoch(train_vols, batch_size, max_steps_per_epoch)
    epochs = epochs_with_floor(epochs, per_epoch, min_steps)
    total = epochs * per_epoch
    trainer = DecoderTrainer(model, lr=lr, batch_size=batch_size, total_steps=total, seed=site_seed(seed, site),
                             device=device)
    losses = [trainer.train_epoch(train_vols, max_steps=max_steps_per_epoch) for _ in range(epochs)]
    summary = mean_dice(dice_per_volume(model.unet, val_vols, device=device))
    return {"method": method, "mode": "probe", "n_labelled": int(n_labelled), "fold": int(fold), "site": site,
            "dice": summary["mean"], **{name: summary[name] for name in ACDC_CLASSES.values()},
            "train_patients": train_ids, "n_train_volumes": len(train_vols), "val_patients": val_ids,
            "n_val_volumes": len(val_vols), "final_loss": losses[-1], "epochs": len(losses)}


def _pooled(model: nn.Module, dataset: ImageDataset, batch_size: int, device: str | torch.device
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean-pooled tokens ``[N, D]``, labels ``[N]``) of every image of ``dataset`` (fixed order)."""
    feats, labels = [], []
    for x, y in batches(dataset, batch_size, seed=0, epoch=0):
        feats.append(vit_features(model, x, batch_size=batch_size, device=device))
        labels.append(y)
    return torch.cat(feats), torch.cat(labels)


def fit_logistic(x: torch.Tensor, y: torch.Tensor, n_classes: int, *, steps: int = 300, lr: float = 0.05,
                 weight_decay: float = 1e-4, seed: int = 0) -> nn.Linear:
    """Multinomial logistic regression on ``x [N, D]`` (standardise first), full-batch Adam for ``steps`` steps."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = nn.Linear(x.shape[1], n_classes)
    opt = torch.optim.Adam(head.parameters(), lr=lr, weight_decay=weight_decay)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(head(x), y).backward()
        opt.step()
    return head


def linear_probe(records: Sequence[ImageRecord], init: object, *, dataset: str, site: str = "", image_size: int,
                 patch_size: int, embed_dim: int, depth: int, num_heads: int, layer_scale: float | None = None,
                 rel_pos_bias: str = "none",
                 label_fraction: float = 1.0, val_fraction: float = 0.1,
                 test_records: Sequence[ImageRecord] | None = None, steps: int = 300, batch_size: int = 64,
                 seed: int = 0, device: str | torch.device = "cpu", method: str = "") -> dict:
    """Logistic regression on the frozen encoder's mean-pooled patch tokens (standardised with the labelled images'
    mean and std).  ``init``: ``"random"`` (a ViT from ``seed``) or a pre-training global model (path or state dict,
    ``encoder.*`` keys).  Labelled images: ``select_labelled(train, label_fraction)`` of the site's
    ``train_val_split`` (seeded by ``site_seed(seed, site)``, as fine-tuning); held out: ``test_records`` or the
    validation split.  Returns ``{"method", "mode": "linear_probe", "site", "label_fraction", "accuracy",
    "train_accuracy", "n_labelled", "n_test"}``."""
    data_seed = site_seed(seed, site)
    train, val = train_val_split(records, val_fraction, seed=data_seed)
    labelled = select_labelled(train, label_fraction, seed=data_seed)
    held_out = list(test_records) if test_records is not None else val
    if not labelled or not held_out:
        raise ValueError(f"{site or 'the site'}: {len(labelled)} labelled and {len(held_out)} held-out images; the "
                         "linear probe needs both (raise val_fraction or pass test_records)")
    classes = class_names(dataset)
    model = ViTClassifier(len(classes), image_size=image_size, patch_size=patch_size, embed_dim=embed_dim,
                          depth=depth, num_heads=num_heads, drop_path_rate=0.0, seed=seed, layer_scale=layer_scale,
                          rel_pos_bias=rel_pos_bias)
    if not (isinstance(init, str) and init == "random"):
        load_pretrained_encoder(model, init)
    model.requires_grad_(False)
    xs, ys = _pooled(model, ImageDataset(labelled, image_size, "eval", dataset, site=site), batch_size, device)
    xt, yt = _pooled(model, ImageDataset(held_out, image_size, "eval", dataset, site=site), batch_size, device)
    mean, std = xs.mean(dim=0), xs.std(dim=0, unbiased=False).clamp(min=1e-6)
    head = fit_logistic((xs - mean) / std, ys, len(classes), steps=steps, seed=seed)
    with torch.no_grad():
        acc = float((head((xt - mean) / std).argmax(dim=1) == yt).float().mean())
        train_acc = float((head((xs - mean) / std).argmax(dim=1) == ys).float().mean())
    return {"method": method, "mode": "linear_probe", "site": site, "label_fraction": label_fraction,
            "accuracy": acc, "train_accuracy": train_acc, "n_labelled": len(labelled), "n_test": len(held_out)}
