"""FedDRA's segmentation downstream task: a U-Net decoder fine-tuned on the frozen pre-trained image encoder with
1 % / 10 % of RSNA's training images, scored by Dice (FedDRA sec. 5.1.1 (2), appendix A.1.2, Table 2's "Seg."
columns).

The paper gives the task, the fractions and the metric only; the rest follows the protocol it cites, MGCA's
segmenter (HKU-MedAI/MGCA ``ssl_segmenter.py``, ``mgca_segmenter.py``, ``run_seg_finetune.sh``;
:class:`SegmentationSettings`): AdamW lr 5e-4, betas (0.9, 0.999), weight decay 0.05 (the script's default, which
reaches the optimiser), batch 16 on RSNA, 50 epochs, the loss ``alpha * focal - log(soft Dice)`` with alpha 10
(GLoRIA's ``MixedLoss``, focal gamma 2), Dice at threshold 0.5 per image: an image without a box scores 1 when
nothing is predicted and 0 otherwise, an image with boxes ``2 |P n T| / (|P| + |T|)``, averaged over the test
images.  MGCA stops early on a validation loss (patience 10); there is no validation split here: the last epoch
is tested.  Decoder: :class:`fedssl.models.vlp_segmentation.ViTUNet`.

Randomness: the labelled subset is :func:`fedssl.train.vlp_probe.few_shot_subset` of the has-a-box labels (seed);
the decoder's initialisation and batch order come from the owned global generator / a numpy generator of
``derived_seed(seed, "few_shot_segmentation", fraction)``; the caller's generators are left as they were.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from fedssl.core.checks import require, require_int
from fedssl.core.rng import owned_global_rng
from fedssl.core.seeds import derived_seed
from fedssl.models.vlp_segmentation import ViTUNet
from fedssl.train.vlp_probe import few_shot_subset, fraction_key

_COMPONENT = "SegmentationSettings"


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class SegmentationSettings:
    """The protocol (module docstring); ``decoder_channels`` None = the paper-scale widths of ViTUNet."""

    fractions: tuple[float, ...] = (0.01, 0.1)
    epochs: int = 50
    batch_size: int = 16
    lr: float = 5e-4
    weight_decay: float = 0.05
    alpha: float = 10.0
    focal_gamma: float = 2.0
    threshold: float = 0.5
    decoder_channels: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        fr = self.fractions
        require(isinstance(fr, (tuple, list)) and len(fr) > 0 and all(_finite(f) and 0 < f <= 1 for f in fr),
                _COMPONENT, "fractions", fr, "pass fractions of the training set in (0, 1], e.g. [0.01, 0.1]")
        require_int(_COMPONENT, "epochs", self.epochs, 1, "use a positive number of epochs (MGCA: 50)")
        require_int(_COMPONENT, "batch_size", self.batch_size, 1, "use a positive batch size (MGCA on RSNA: 16)")
        for name, fix in (("lr", "use a learning rate > 0 (MGCA: 5e-4)"), ("alpha", "use a focal weight > 0 (10)")):
            require(_finite(getattr(self, name)) and getattr(self, name) > 0, _COMPONENT, name, getattr(self, name),
                    fix)
        require(_finite(self.weight_decay) and self.weight_decay >= 0, _COMPONENT, "weight_decay", self.weight_decay,
                "use a weight decay >= 0 (0.05)")
        require(_finite(self.focal_gamma) and self.focal_gamma >= 0, _COMPONENT, "focal_gamma", self.focal_gamma,
                "use a focusing parameter >= 0 (2)")
        require(_finite(self.threshold) and 0 < self.threshold < 1, _COMPONENT, "threshold", self.threshold,
                "use a probability threshold in (0, 1) (0.5)")


FEDDRA_SEGMENTATION = SegmentationSettings()


def dice_per_image(prob: torch.Tensor, truth: torch.Tensor, threshold: float = 0.5) -> torch.Tensor:
    """``[B]`` Dice of thresholded ``prob`` against ``truth`` (both ``[B, ...]``): an empty truth scores 1 for an
    empty prediction and 0 otherwise (MGCA's ``get_dice``)."""
    p = (prob.flatten(1) > threshold).float()
    t = (truth.flatten(1) > 0.5).float()
    inter, total = (p * t).sum(1), p.sum(1) + t.sum(1)
    empty = t.sum(1) == 0
    return torch.where(empty, (p.sum(1) == 0).float(), 2 * inter / total.clamp_min(1e-12))


def mixed_loss(logits: torch.Tensor, truth: torch.Tensor, alpha: float = 10.0, gamma: float = 2.0) -> torch.Tensor:
    """``alpha * focal(logits, truth) - log(soft Dice)`` (GLoRIA's / MGCA's ``MixedLoss``), Dice over the batch with
    smoothing 1."""
    bce = F.binary_cross_entropy_with_logits(logits, truth, reduction="none")
    p_t = torch.exp(-bce)
    focal = ((1 - p_t) ** gamma * bce).mean()
    prob = torch.sigmoid(logits).flatten()
    t = truth.flatten()
    dice = (2 * (prob * t).sum() + 1) / (prob.sum() + t.sum() + 1)
    return alpha * focal - torch.log(dice)


def _batch(dataset, indices) -> tuple[torch.Tensor, torch.Tensor]:
    items = [dataset[int(i)] for i in indices]
    return torch.stack([x for x, _ in items]), torch.stack([m for _, m in items])


def segment_once(encoder: torch.nn.Module, patch_size: int, in_chans: int, train_set, train_indices, test_set,
                 settings: SegmentationSettings, seed: int) -> dict:
    """Fine-tune one decoder on ``train_indices`` of ``train_set`` and test it: ``{"dice", "dice_positive",
    "n_train", "n_test"}`` (``dice_positive``: the mean over test images with a box; None without one)."""
    s = settings
    rng = np.random.default_rng(seed)
    with owned_global_rng(seed):
        net = ViTUNet(copy.deepcopy(encoder), patch_size, in_chans, s.decoder_channels)
        opt = torch.optim.AdamW(net.decoder_parameters(), lr=s.lr, betas=(0.9, 0.999), weight_decay=s.weight_decay)
        idx = np.asarray(list(train_indices))
        for _ in range(s.epochs):
            net.train()
            order = idx[rng.permutation(len(idx))]
            for start in range(0, len(order), s.batch_size):
                x, m = _batch(train_set, order[start:start + s.batch_size])
                if len(x) < 2 and len(order) >= 2:
                    continue  # a batch of one breaks BatchNorm statistics; the next epoch reshuffles
                loss = mixed_loss(net(x), m, s.alpha, s.focal_gamma)
                opt.zero_grad()
                loss.backward()
                opt.step()
        net.eval()
        dice, positive = [], []
        with torch.no_grad():
            for start in range(0, len(test_set), max(s.batch_size, 1)):
                x, m = _batch(test_set, range(start, min(start + s.batch_size, len(test_set))))
                d = dice_per_image(torch.sigmoid(net(x)), m, s.threshold)
                dice.extend(d.tolist())
                positive.extend(d[m.flatten(1).sum(1) > 0].tolist())
    return {"dice": float(np.mean(dice)), "dice_positive": float(np.mean(positive)) if positive else None,
            "n_train": int(len(idx)), "n_test": len(test_set)}


def few_shot_segmentation(encoder: torch.nn.Module, patch_size: int, in_chans: int, train_set, test_set, *,
                          seed: int = 0, settings: SegmentationSettings = FEDDRA_SEGMENTATION) -> dict[str, dict]:
    """``{"1%": {...}, "10%": {...}}``: :func:`segment_once` per fraction on a stratified (box / no box) subset."""
    require_int("few_shot_segmentation", "seed", seed, 0, "use a non-negative int seed")
    require(len(train_set) > 0 and len(test_set) > 0, "few_shot_segmentation", "train_set/test_set",
            (len(train_set), len(test_set)), "pass non-empty training and test sets")
    out = {}
    for f in settings.fractions:
        subset = few_shot_subset(np.asarray(train_set.has_box), f, seed)
        out[fraction_key(f)] = segment_once(encoder, patch_size, in_chans, train_set, subset, test_set, settings,
                                            derived_seed(seed, "few_shot_segmentation", fraction_key(f)))
    return out


__all__ = ["FEDDRA_SEGMENTATION", "SegmentationSettings", "dice_per_image", "few_shot_segmentation", "mixed_loss",
           "segment_once"]
