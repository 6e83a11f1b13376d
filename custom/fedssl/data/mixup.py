"""Batch-level regularisation of SSL-FL's fine-tuning: mixup, CutMix and random erasing, drawn from a caller's
:class:`torch.Generator` (pure torch; no global generator, no numpy).

What rui-yan/SSL-FL runs (``code/util/FedAvg_utils.py`` 214-232 builds timm 0.3.2's ``Mixup`` from the
``run_class_finetune_FedAvg.py`` arguments; ``engine_for_finetuning.py`` applies it to every training batch), and what
this module reproduces:

* **per batch** (timm's ``mode='batch'``, the reference's ``--mixup_mode`` default): with probability ``prob``
  (``--mixup_prob``, 1.0) the batch is mixed, else left alone (``lam`` 1).  With mixup and CutMix both on, CutMix is
  chosen with probability ``switch_prob`` (``--mixup_switch_prob``, 0.5); ``lam ~ Beta(alpha, alpha)`` of the chosen
  one (``--mixup`` 0.8, ``--cutmix`` 1.0 in the Fed-MAE scripts).  The partner of image ``i`` is image ``B - 1 - i``
  (the batch reversed; an odd batch's middle image is its own partner, so it stays as it is).
* **mixup**: ``x <- lam * x + (1 - lam) * x.flip(0)``.
* **CutMix**: a box of side ``int(H * sqrt(1 - lam))`` x ``int(W * sqrt(1 - lam))`` centred on a uniform pixel
  ``(cy, cx)``, clipped to the image (rows ``cy - h // 2`` to ``cy + h // 2``, timm 0.3.2's ``rand_bbox``, the version
  ``ssfl_conda.yml`` pins), is pasted from the partner; ``lam`` is then corrected to ``1 - box area / (H * W)``
  (``correct_lam``).  ``minmax`` (``--cutmix_minmax``, unset in the reference) instead draws the box's sides
  uniformly in ``[int(H * min), int(H * max))`` and places it uniformly inside the image (timm 1.0's
  ``rand_bbox_minmax``); ``lam`` follows from its area.
* the targets of a mixed batch are ``lam * t(y) + (1 - lam) * t(y.flip(0))``
  (:func:`fedssl.core.soft_targets.mixed_targets`, label smoothing inside ``t``) and the loss is the soft-target
  cross-entropy: the trainer does that with the ``lam`` returned here.
* **random erasing** (timm's ``RandomErasing``; ``--reprob`` / ``--remode`` / ``--recount``): per image, with
  probability ``prob``, ``count`` boxes, each of area ``U(0.02, 1/3) * H * W / count`` and aspect ratio
  ``exp(U(log 0.3, log 1/0.3))`` (10 tries to fit inside the image, else none) are filled on the *normalised*
  tensor with standard-normal noise per pixel (``pixel``), one normal colour per channel (``rand``) or zeros
  (``const``).  Note: the reference parses ``--reprob`` but its fine-tuning transform
  (``code/util/datasets.py`` ``build_transform``) never applies it, so SSL-FL's jobs keep it at 0.

All draws come from the generator passed in (on its device, normally the CPU) and are moved to the batch's device,
so the same generator state gives the same draws on a CPU and a GPU.  Two departures from timm, neither of which
changes what a batch of the reference looks like: an odd batch is mixed (timm refuses one; the reference's loader
drops the last, incomplete batch, the bundle's keeps it), and erasing runs on the batch in the trainer rather than per
image in the data loader (the same draw per image).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from fedssl.core.checks import require, require_choice, require_int

__all__ = ["BatchAugment", "sample_beta", "draw_mix", "centred_box", "box_lam", "cutmix_box", "mix_batch",
           "erasing_box", "random_erasing"]

#: how mixup / CutMix parameters are drawn: once per batch (timm's "pair" / "elem" modes are not implemented)
MIX_MODES = ("batch",)
#: random erasing fills: standard-normal noise per pixel, one normal value per channel, zeros
ERASE_MODES = ("pixel", "rand", "const")
#: timm RandomErasing's defaults (the reference does not change them): box area fraction, aspect ratio, tries
ERASE_AREA = (0.02, 1.0 / 3.0)
ERASE_ASPECT = (0.3, 1.0 / 0.3)
ERASE_TRIES = 10

Box = tuple[int, int, int, int]  # top, bottom, left, right (rows top:bottom, columns left:right)


def _uniform(generator: torch.Generator, low: float = 0.0, high: float = 1.0) -> float:
    """One float64 draw from U(low, high)."""
    u = float(torch.rand((), generator=generator, dtype=torch.float64, device=generator.device))
    return low + (high - low) * u


def _randint(low: int, high: int, generator: torch.Generator) -> int:
    """One integer uniform in ``[low, high)``."""
    return int(torch.randint(low, high, (), generator=generator, device=generator.device))


def _gamma(shape: float, generator: torch.Generator) -> float:
    """One draw from Gamma(shape, 1) (Marsaglia & Tsang 2000; shape < 1 boosted by ``U ** (1 / shape)``)."""
    if shape < 1.0:
        return _gamma(shape + 1.0, generator) * _uniform(generator) ** (1.0 / shape)
    d = shape - 1.0 / 3.0
    c = 1.0 / math.sqrt(9.0 * d)
    while True:
        z = float(torch.randn((), generator=generator, dtype=torch.float64, device=generator.device))
        v = (1.0 + c * z) ** 3
        if v <= 0.0:
            continue
        u = _uniform(generator)
        if u <= 0.0 or math.log(u) < 0.5 * z * z + d - d * v + d * math.log(v):
            return d * v


def sample_beta(alpha: float, generator: torch.Generator) -> float:
    """One draw from the symmetric Beta(alpha, alpha) (``alpha`` > 0), as ``X / (X + Y)`` of two Gamma(alpha)."""
    if not alpha > 0:
        raise ValueError(f"alpha={alpha!r}: a Beta(alpha, alpha) draw needs alpha > 0")
    x, y = _gamma(alpha, generator), _gamma(alpha, generator)
    return 0.5 if x + y == 0.0 else x / (x + y)


def draw_mix(generator: torch.Generator, mixup_alpha: float, cutmix_alpha: float, prob: float = 1.0,
             switch_prob: float = 0.5) -> tuple[float, bool]:
    """One batch's ``(lam, use_cutmix)`` (timm's ``_params_per_batch``): ``lam`` 1.0 and no CutMix when the batch is
    not mixed (probability ``1 - prob``, or both alphas 0)."""
    if not (mixup_alpha > 0 or cutmix_alpha > 0) or not _uniform(generator) < prob:
        return 1.0, False
    if mixup_alpha > 0 and cutmix_alpha > 0:
        use_cutmix = _uniform(generator) < switch_prob
    else:
        use_cutmix = cutmix_alpha > 0
    return sample_beta(cutmix_alpha if use_cutmix else mixup_alpha, generator), use_cutmix


def centred_box(height: int, width: int, lam: float, cy: int, cx: int) -> Box:
    """CutMix's box for ``lam`` centred on pixel ``(cy, cx)``: sides ``int(H * sqrt(1 - lam))`` x
    ``int(W * sqrt(1 - lam))``, rows ``cy - h // 2`` to ``cy + h // 2`` (columns alike), clipped to the image."""
    ratio = math.sqrt(1.0 - lam)
    cut_h, cut_w = int(height * ratio), int(width * ratio)
    top, bottom = min(max(cy - cut_h // 2, 0), height), min(max(cy + cut_h // 2, 0), height)
    left, right = min(max(cx - cut_w // 2, 0), width), min(max(cx + cut_w // 2, 0), width)
    return top, bottom, left, right


def box_lam(box: Box, height: int, width: int) -> float:
    """The mixing weight of the image a box was pasted into: ``1 - box area / (H * W)`` (timm's ``correct_lam``)."""
    top, bottom, left, right = box
    return 1.0 - (bottom - top) * (right - left) / float(height * width)


def cutmix_box(height: int, width: int, lam: float, generator: torch.Generator,
               minmax: tuple[float, float] | None = None) -> tuple[Box, float]:
    """The CutMix box of an ``height x width`` batch for ``lam`` (centre ``cy`` then ``cx`` drawn uniformly:
    :func:`centred_box`; or sides and corner drawn from ``minmax``) and its corrected ``lam`` (:func:`box_lam`)."""
    if minmax is None:
        cy, cx = _randint(0, height, generator), _randint(0, width, generator)
        top, bottom, left, right = centred_box(height, width, lam, cy, cx)
    else:
        lo_h, hi_h, lo_w, hi_w = (int(height * minmax[0]), int(height * minmax[1]), int(width * minmax[0]),
                                  int(width * minmax[1]))
        if lo_h >= hi_h or lo_w >= hi_w:
            raise ValueError(f"cutmix_minmax={list(minmax)} leaves no box size to draw at {height} x {width} pixels "
                             "(int(size * min) must be below int(size * max)); widen it or use null")
        cut_h, cut_w = _randint(lo_h, hi_h, generator), _randint(lo_w, hi_w, generator)
        top, left = _randint(0, height - cut_h + 1, generator), _randint(0, width - cut_w + 1, generator)
        bottom, right = top + cut_h, left + cut_w
    box = (top, bottom, left, right)
    return box, box_lam(box, height, width)


def mix_batch(x: torch.Tensor, lam: float, box: Box | None = None) -> torch.Tensor:
    """The batch mixed with itself reversed (a new tensor): CutMix pastes ``box`` of the partner when ``box`` is
    given, else mixup ``lam * x + (1 - lam) * x.flip(0)``."""
    if box is None:
        return x * lam + x.flip(0) * (1.0 - lam)
    top, bottom, left, right = box
    out = x.clone()
    out[:, :, top:bottom, left:right] = x.flip(0)[:, :, top:bottom, left:right]
    return out


def erasing_box(height: int, width: int, count: int, generator: torch.Generator) -> Box | None:
    """One random-erasing box of an ``height x width`` image (timm's ``RandomErasing._erase``), None when 10 tries
    do not fit one inside the image."""
    area = height * width
    log_aspect = (math.log(ERASE_ASPECT[0]), math.log(ERASE_ASPECT[1]))
    for _ in range(ERASE_TRIES):
        target = _uniform(generator, *ERASE_AREA) * area / count
        aspect = math.exp(_uniform(generator, *log_aspect))
        h = int(round(math.sqrt(target * aspect)))
        w = int(round(math.sqrt(target / aspect)))
        if w < width and h < height:
            top, left = _randint(0, height - h + 1, generator), _randint(0, width - w + 1, generator)
            return top, top + h, left, left + w
    return None


def _fill(mode: str, channels: int, h: int, w: int, generator: torch.Generator) -> torch.Tensor:
    if mode == "pixel":
        return torch.randn((channels, h, w), generator=generator, device=generator.device)
    if mode == "rand":
        return torch.randn((channels, 1, 1), generator=generator, device=generator.device).expand(channels, h, w)
    return torch.zeros((channels, h, w))


def random_erasing(x: torch.Tensor, generator: torch.Generator, prob: float, mode: str = "pixel",
                   count: int = 1) -> torch.Tensor:
    """Random erasing of each image of a normalised batch ``[B, C, H, W]`` (module docstring); ``x`` itself when
    nothing is erased (``prob`` 0 draws nothing), else a new tensor."""
    require_choice("random_erasing", "mode", mode, ERASE_MODES)
    if prob <= 0:
        return x
    n, channels, height, width = x.shape
    out = x
    for i in range(n):
        if not _uniform(generator) < prob:
            continue
        for _ in range(count):
            box = erasing_box(height, width, count, generator)
            if box is None:
                continue
            top, bottom, left, right = box
            fill = _fill(mode, channels, bottom - top, right - left, generator)
            if out is x:
                out = x.clone()
            out[i, :, top:bottom, left:right] = fill.to(device=x.device, dtype=x.dtype)
    return out


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class BatchAugment:
    """Mixup / CutMix and random erasing of a fine-tuning batch (module docstring), with the values of a trainer's
    settings (``fedssl.train.classifier.ClassifierSettings`` declares them, with their defaults and the reference's
    values): ``mixup_alpha``, ``cutmix_alpha`` (0 = off), ``cutmix_minmax`` (None or ``(min, max)``), ``mixup_prob``,
    ``mixup_switch_prob``, ``mixup_mode`` ("batch"), ``erasing_prob`` (0 = off), ``erasing_mode``, ``erasing_count``.

    ``augment(x, generator)`` -> ``(x', lam)``: the batch erased then mixed and the mixing weight of its targets
    (:func:`fedssl.core.soft_targets.mixed_targets`); ``lam`` None when mixing is off (plain targets)."""

    mixup_alpha: float
    cutmix_alpha: float
    cutmix_minmax: Sequence[float] | None
    mixup_prob: float
    mixup_switch_prob: float
    mixup_mode: str
    erasing_prob: float
    erasing_mode: str
    erasing_count: int

    @property
    def mixing(self) -> bool:
        """Mixup or CutMix is on (``cutmix_minmax`` turns CutMix on, as in timm)."""
        return self.mixup_alpha > 0 or self.cutmix_alpha > 0 or self.cutmix_minmax is not None

    @property
    def active(self) -> bool:
        return self.mixing or self.erasing_prob > 0

    def check(self, component: str) -> None:
        """Every value checked; the message names ``component``, the argument, its value and the fix."""
        for arg, ref in (("mixup_alpha", 0.8), ("cutmix_alpha", 1.0)):
            value = getattr(self, arg)
            require(_number(value) and value >= 0, component, arg, value,
                    f"use 0 (off) or a positive Beta alpha (SSL-FL's Fed-MAE fine-tuning scripts: {ref})")
        mm = self.cutmix_minmax
        require(mm is None or (isinstance(mm, (list, tuple)) and len(mm) == 2 and all(_number(v) for v in mm)
                               and 0 < mm[0] < mm[1] <= 1), component, "cutmix_minmax", mm,
                "use null (box size from lam, the reference's) or [min, max] with 0 < min < max <= 1")
        for arg, ref in (("mixup_prob", "1.0"), ("mixup_switch_prob", "0.5"), ("erasing_prob", "0 in SSL-FL's jobs")):
            value = getattr(self, arg)
            require(_number(value) and 0 <= value <= 1, component, arg, value,
                    f"use a probability in [0, 1] (reference: {ref})")
        require(self.mixup_mode in MIX_MODES, component, "mixup_mode", self.mixup_mode,
                "use \"batch\" (one lam and one box per batch, the reference's --mixup_mode); timm's \"pair\" and "
                "\"elem\" are not implemented")
        require(self.erasing_mode in ERASE_MODES, component, "erasing_mode", self.erasing_mode,
                f"use one of {list(ERASE_MODES)} (reference: \"pixel\")")
        require_int(component, "erasing_count", self.erasing_count, 1,
                    "use a positive number of boxes per erased image (reference: 1)")

    def __call__(self, x: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, float | None]:
        if x.dim() != 4:
            raise ValueError(f"batch augmentation needs image batches [B, C, H, W], got shape {tuple(x.shape)}")
        if self.erasing_prob > 0:
            x = random_erasing(x, generator, self.erasing_prob, self.erasing_mode, self.erasing_count)
        if not self.mixing:
            return x, None
        minmax = None if self.cutmix_minmax is None else (float(self.cutmix_minmax[0]), float(self.cutmix_minmax[1]))
        cutmix_alpha = 1.0 if minmax is not None else self.cutmix_alpha  # timm: minmax forces CutMix with alpha 1
        lam, use_cutmix = draw_mix(generator, self.mixup_alpha, cutmix_alpha, self.mixup_prob, self.mixup_switch_prob)
        if lam == 1.0:
            return x, 1.0
        if use_cutmix:
            box, lam = cutmix_box(x.shape[2], x.shape[3], lam, generator, minmax)
            return mix_batch(x, lam, box), lam
        return mix_batch(x, lam), lam
