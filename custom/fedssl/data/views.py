"""Two augmented views per image for contrastive pre-training (FedCLF, FedMoCo, FedSimCLR, FedRotation).

FedCLF ("Federated Self-Supervised Learning for Dermatological Disease Diagnosis", sec. V-A) does not state its
augmentations; MoCo v2's (Chen, Fan, Girshick & He, "Improved Baselines with Momentum Contrastive Learning",
2020) are used, as the method is MoCo:

    RandomResizedCrop(S, scale 0.2-1, ratio 3/4-4/3); ColorJitter(0.4, 0.4, 0.4, 0.1) with p = 0.8;
    RandomGrayscale p = 0.2; GaussianBlur (sigma 0.1-2.0, kernel ~ S / 10, odd) with p = 0.5; horizontal flip;
    then ImageNet normalisation.

:class:`TwoViewDataset` item ``i`` = ``(view_1 [3, S, S], view_2 [3, S, S])``, drawn from ``(seed, epoch, i)`` only,
so a run is reproducible; decoding and caching are :class:`fedssl.data.images.ImageDataset`'s (``raw``: shorter
side ``ceil(S / 0.875)``).  No label is read: pre-training sees images only.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
import torchvision.transforms.v2.functional as TF

from fedssl.data.images import IMAGENET_MEAN, IMAGENET_STD, ImageDataset, ImageRecord

#: MoCo v2's augmentation parameters
CROP_SCALE = (0.2, 1.0)
CROP_RATIO = (3.0 / 4.0, 4.0 / 3.0)
JITTER = (0.4, 0.4, 0.4, 0.1)  # brightness, contrast, saturation, hue
P_JITTER, P_GREY, P_BLUR, P_FLIP = 0.8, 0.2, 0.5, 0.5
BLUR_SIGMA = (0.1, 2.0)


def crop_box(h: int, w: int, g: np.random.Generator, scale=CROP_SCALE, ratio=CROP_RATIO) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop box ``(top, left, height, width)`` in whole pixels, drawn with ``g``
    (10 tries, then the largest centred crop of an allowed ratio)."""
    area = h * w
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * g.uniform(*scale)
        r = math.exp(g.uniform(*log_ratio))
        cw, ch = int(round(math.sqrt(target * r))), int(round(math.sqrt(target / r)))
        if 0 < cw <= w and 0 < ch <= h:
            return int(g.integers(0, h - ch + 1)), int(g.integers(0, w - cw + 1)), ch, cw
    in_ratio = w / h
    if in_ratio < ratio[0]:
        cw, ch = w, int(round(w / ratio[0]))
    elif in_ratio > ratio[1]:
        ch, cw = h, int(round(h * ratio[1]))
    else:
        cw, ch = w, h
    return (h - ch) // 2, (w - cw) // 2, ch, cw


def mocov2_view(img: torch.Tensor, size: int, g: np.random.Generator) -> torch.Tensor:
    """One MoCo v2 view of ``img`` (float ``[3, H, W]`` in [0, 1]) at ``size`` px, before normalisation."""
    top, left, ch, cw = crop_box(int(img.shape[1]), int(img.shape[2]), g)
    x = F.interpolate(img[None, :, top:top + ch, left:left + cw], size=(size, size), mode="bilinear",
                      align_corners=False, antialias=True)[0].clamp(0.0, 1.0)
    if g.random() < P_JITTER:
        b, c, s, hue = JITTER
        factors = (g.uniform(1 - b, 1 + b), g.uniform(1 - c, 1 + c), g.uniform(1 - s, 1 + s), g.uniform(-hue, hue))
        ops = (TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation, TF.adjust_hue)
        for i in g.permutation(4):
            x = ops[i](x, float(factors[i]))
    if g.random() < P_GREY:
        x = TF.rgb_to_grayscale(x, num_output_channels=3)
    if g.random() < P_BLUR:
        k = max(3, int(size / 10) // 2 * 2 + 1)
        x = TF.gaussian_blur(x, [k, k], [float(g.uniform(*BLUR_SIGMA))] * 2)
    if g.random() < P_FLIP:
        x = x.flip(-1)
    return x.clamp(0.0, 1.0)


class TwoViewDataset(torch.utils.data.Dataset):
    """Two independent MoCo v2 views of each image of one site (see the module docstring)."""

    def __init__(self, records: Sequence[ImageRecord], image_size: int, dataset: str, site: str = "?", seed: int = 0):
        self.images = ImageDataset(records, image_size, "eval", dataset, site=site)
        self.image_size = image_size
        self.seed = int(seed)
        self.epoch = 0
        self._mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
        self._std = torch.tensor(IMAGENET_STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.images)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def warm(self) -> None:
        """Decode and cache every image now, e.g. before DataLoader workers fork."""
        self.images.warm()

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        img = torch.from_numpy(self.images.raw(index)).permute(2, 0, 1).float().div_(255.0)
        g = np.random.default_rng([self.seed, self.epoch, index])
        v1, v2 = (mocov2_view(img, self.image_size, g) for _ in range(2))
        return (v1 - self._mean) / self._std, (v2 - self._mean) / self._std
