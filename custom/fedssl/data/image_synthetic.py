"""Synthetic stand-ins for Kaggle DR (retina), ISIC 2019 (derm), COVID-FL and SSL-FL's Derm (derm_mel),
written in their real layouts.

:func:`write_synthetic_images` writes a FULL data set in the layout the real one comes in: retina/derm a
folder that :func:`fedssl.data.images.load_image_records` reads; covidfl/derm_mel SSL-FL's release layout
(:mod:`fedssl.data.sslfl_release`), which ``fedssl sslfl partition`` cuts into site folders.
The class is visible in the pixels, with realistic nuisance, and every image comes from a source
(camera / clinic / hospital) whose acquisition shifts its appearance:

* retina (``trainLabels.csv`` + ``train/<id>_<left|right>.jpeg``, 5:4 frames): a fundus disc on black with
  choroidal texture, macula, optic disc (side given by the eye, some images mirrored) and four vessel arcades
  (artery + vein, branching twice) leaving the disc.  DR lesions per level 0-4 with per-level count and opacity
  distributions (:data:`_RETINA_LESIONS`): 1 = a few faint microaneurysms (often invisible, as in real grade 1);
  2 = + dot-blot / flame haemorrhages, hard-exudate clusters, cotton-wool spots; 3 = many haemorrhages, venous
  beading; 4 = + neovascularisation, pre-retinal haemorrhage, fibrous tissue.  Confounders at every level (pale
  reflexes, drusen, pigment clumps).  Cameras differ in colour cast, exposure, gamma, blur, effective resolution,
  noise, field of view, vignetting and a dust speck; every image adds uneven illumination and over / under
  exposure.  ``difficulty`` (default :data:`RETINA_DIFFICULTY`, calibrated) scales lesion opacity by 1 / (1 + d)
  and every nuisance amplitude by d.  Level mix as Kaggle DR: 73.5 / 7 / 15 / 2.5 / 2 %, so about 73 % of the
  images are label 0.
* derm (``ISIC_2019_Training_GroundTruth.csv`` + ``ISIC_2019_Training_Input/ISIC_<7 digits>.jpg``, 4:3):
  a skin background (tone per source) with a lesion whose colour, size, border irregularity and texture
  depend on the class (MEL large, irregular, variegated brown/blue-black; NV small, round, uniform
  brown; BCC pink with red branching vessels; AK red, scaly; BKL tan, sharp, striped; DF small ring
  with a white centre; VASC red-purple lobules; SCC red with a keratin centre), plus hairs and, for
  some sources, the black dermoscope vignette. Class mix as ISIC 2019 (NV 51 %, MEL 18 %, ...).
* covidfl (grey PNG): a chest radiograph (body, lungs, heart, spine, ribs); pneumonia = one dense lobar
  consolidation in one lung, covid = several hazy peripheral ground-glass opacities in both lungs,
  normal = clear lungs. Eight real sites named as in SSL-FL's split files with different class mixes (e.g.
  ``bimcv`` only covid, ``gz`` paediatric pneumonia/normal) and sizes (RSNA the largest); every site holds
  out 20 % of each of its classes as test images (section IV-A: "Each data site has the same proportion of
  train and test sets"), and ``12_clients/split_real`` cuts RSNA into ``rsna-0`` .. ``rsna-4`` as SSL-FL's
  release does (8 real sites -> 12 clients).
* derm_mel (SSL-FL's Derm, section IV-A): half melanoma, half benign (the other ISIC 2019 classes in their
  ISIC proportions), rendered as for derm; 75 % training, 25 % test (~7,500 / ~2,500 in the paper).

Per-source appearance: brightness, colour cast (RGB gains), contrast / gamma, noise level and blur.
Per image: random position, size, rotation, pigmentation, noise. Everything is seeded by ``seed``.
"""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np

from fedssl.core.dirichlet import SSLFL_COVIDFL_SUB_SITES, real_site_split
from fedssl.data.images import (
    COVIDFL_CLASSES,
    SSLFL_DATASETS,
    DERM_CLASSES,
    DERM_CSV,
    DERM_DIR,
    DERM_MEL_CLASSES,
    ISIC_COLUMNS,
    RETINA_CSV,
    RETINA_DIR,
    ImageRecord,
    train_val_split,
)
from fedssl.data.sslfl_release import write_release

__all__ = ["write_synthetic_images", "RETINA_LEVEL_MIX", "RETINA_DIFFICULTY", "check_difficulty",
           "retina_lesion_opacity", "DERM_CLASS_MIX", "COVIDFL_SITES", "COVIDFL_TEST_FRACTION",
           "DERM_MEL_TEST_FRACTION", "render"]

PathLike = Union[str, "os.PathLike[str]"]

#: Kaggle DR training set: level 0..4 fractions (25810 / 2443 / 5292 / 873 / 708 of 35126)
RETINA_LEVEL_MIX = (0.735, 0.070, 0.150, 0.025, 0.020)
#: ISIC 2019 training set class fractions (MEL 4522, NV 12875, BCC 3323, AK 867, BKL 2624, DF 239, VASC 253, SCC 628)
DERM_CLASS_MIX = (0.1785, 0.5083, 0.1312, 0.0342, 0.1036, 0.0094, 0.0100, 0.0248)
#: (real site, class mix over covid/pneumonia/normal, relative size) - SSL-FL's eight COVID-FL sources, named as
#: in its split files; RSNA the largest (SSL-FL cuts only it into sub-clients), Guangzhou paediatric next
COVIDFL_SITES: tuple[tuple[str, tuple[float, float, float], float], ...] = (
    ("rsna", (0.0, 0.45, 0.55), 9.0),
    ("gz", (0.0, 0.73, 0.27), 5.0),
    ("bimcv", (1.0, 0.0, 0.0), 2.5),
    ("ricord_c", (1.0, 0.0, 0.0), 1.0),
    ("cohen", (0.70, 0.20, 0.10), 0.8),
    ("sirm", (1.0, 0.0, 0.0), 0.6),
    ("ml-workgroup", (1.0, 0.0, 0.0), 0.6),
    ("eurorad", (0.6, 0.4, 0.0), 0.5),
)
#: held-out share of every class of every COVID-FL site (SSL-FL section IV-A: 80 %-20 % train-test)
COVIDFL_TEST_FRACTION = 0.2
#: SSL-FL's Derm: ~7,500 training and ~2,500 test images
DERM_MEL_TEST_FRACTION = 0.25
_DEFAULT_SOURCES = {"retina": 4, "derm": 4, "covidfl": len(COVIDFL_SITES), "derm_mel": 3}


# --------------------------------------------------------------------------------------------------------------
# drawing primitives (float images in [0, 1], H x W x 3, soft anti-aliased edges)


class _Canvas:
    def __init__(self, h: int, w: int):
        self.h, self.w = h, w
        self.yy, self.xx = np.mgrid[0:h, 0:w].astype(np.float32) + 0.5

    def ellipse(self, cy, cx, ry, rx, angle=0.0, soft=1.0) -> np.ndarray:
        c, s = math.cos(angle), math.sin(angle)
        u = (self.xx - cx) * c + (self.yy - cy) * s
        v = -(self.xx - cx) * s + (self.yy - cy) * c
        d = np.sqrt((u / rx) ** 2 + (v / ry) ** 2)
        return np.clip((1.0 - d) * min(rx, ry) / max(soft, 1e-3) + 0.5, 0.0, 1.0)

    def gauss(self, cy, cx, sy, sx, angle=0.0) -> np.ndarray:
        c, s = math.cos(angle), math.sin(angle)
        u = (self.xx - cx) * c + (self.yy - cy) * s
        v = -(self.xx - cx) * s + (self.yy - cy) * c
        return np.exp(-0.5 * ((u / sx) ** 2 + (v / sy) ** 2))

    def polar_blob(self, cy, cx, r0, harmonics, angle=0.0, aspect=1.0, soft=1.0) -> np.ndarray:
        c, s = math.cos(angle), math.sin(angle)
        u = (self.xx - cx) * c + (self.yy - cy) * s
        v = (-(self.xx - cx) * s + (self.yy - cy) * c) / aspect
        d = np.sqrt(u * u + v * v)
        th = np.arctan2(v, u)
        r = np.full_like(d, r0)
        for k, a, ph in harmonics:
            r = r + r0 * a * np.cos(k * th + ph)
        return np.clip((r - d) / max(soft, 1e-3) + 0.5, 0.0, 1.0)

    def polyline(self, pts: np.ndarray, width: float) -> np.ndarray:
        d = np.full((self.h, self.w), np.inf, dtype=np.float32)
        for (y0, x0), (y1, x1) in zip(pts[:-1], pts[1:]):
            dy, dx = y1 - y0, x1 - x0
            L2 = dy * dy + dx * dx + 1e-9
            t = np.clip(((self.yy - y0) * dy + (self.xx - x0) * dx) / L2, 0.0, 1.0)
            d = np.minimum(d, np.hypot(self.yy - (y0 + t * dy), self.xx - (x0 + t * dx)))
        return np.clip(width / 2.0 - d + 0.5, 0.0, 1.0)


def _paint(img: np.ndarray, alpha: np.ndarray, colour) -> None:
    a = alpha[..., None]
    img *= 1.0 - a
    img += a * np.asarray(colour, dtype=np.float32)


def _curve(rng: np.random.Generator, y0, x0, heading, length, n, wiggle) -> np.ndarray:
    pts = [(y0, x0)]
    step = length / n
    for _ in range(n):
        heading += rng.normal(0.0, wiggle)
        y0, x0 = y0 + step * math.sin(heading), x0 + step * math.cos(heading)
        pts.append((y0, x0))
    return np.asarray(pts, dtype=np.float32)


def _blur(img: np.ndarray, radius: float) -> np.ndarray:
    if radius <= 0.05:
        return img
    # separable Gaussian blur
    k = max(1, int(math.ceil(3 * radius)))
    x = np.arange(-k, k + 1, dtype=np.float32)
    w = np.exp(-0.5 * (x / radius) ** 2)
    w /= w.sum()
    pad = np.pad(img, ((k, k), (k, k), (0, 0)), mode="edge")
    tmp = sum(w[i] * pad[i : i + img.shape[0], :, :] for i in range(2 * k + 1))
    return sum(w[i] * tmp[:, i : i + img.shape[1], :] for i in range(2 * k + 1))


def _source_params(dataset: str, seed: int, n_sources: int) -> list[dict]:
    """Per-source acquisition parameters (retina: the fundus cameras of :func:`_retina_sources`)."""
    if dataset == "retina":
        return _retina_sources(seed, n_sources)
    out = []
    for s in range(n_sources):
        g = np.random.default_rng([seed, 7919, s])
        out.append({
            "brightness": float(g.uniform(0.78, 1.22)),
            "gains": (g.uniform(0.82, 1.18, size=3).astype(np.float32) if dataset != "covidfl"
                      else np.ones(3, np.float32)),
            "gamma": float(g.uniform(0.75, 1.35)),
            "contrast": float(g.uniform(0.8, 1.2)),
            "noise": float(g.uniform(0.01, 0.05)),
            "blur": float(g.uniform(0.0, 0.9)),
            "tone": float(g.uniform(0.0, 1.0)),  # derm skin tone / covidfl patient age group
            "vignette": bool(g.random() < 0.5),  # derm: dermoscope ring; covidfl: collimation frame
            "hair": float(g.uniform(0.0, 1.0)),
            "marker": bool(g.random() < 0.5),  # covidfl: burnt-in side marker
        })
    return out


def _acquire(img: np.ndarray, p: dict, rng: np.random.Generator, size: int) -> np.ndarray:
    """Per-source acquisition model: blur, colour cast, brightness, contrast, gamma, noise."""
    img = _blur(img, p["blur"] * size / 64.0)
    img = img * p["gains"] * p["brightness"]
    m = img.mean()
    img = (img - m) * p["contrast"] + m
    img = np.clip(img, 0.0, 1.0) ** p["gamma"]
    img = img + rng.normal(0.0, p["noise"], size=img.shape).astype(np.float32)
    return np.clip(img, 0.0, 1.0)


# --------------------------------------------------------------------------------------------------------------
# retina
#
# Sizes are fractions of the fundus radius R.  Kaggle DR grades follow the international clinical DR scale:
# 1 = microaneurysms only; 2 = more than that (dot-blot / flame haemorrhages, hard exudates, cotton-wool spots);
# 3 = many haemorrhages in all quadrants, venous beading; 4 = neovascularisation (at the disc or elsewhere),
# pre-retinal haemorrhage, fibrous tissue.  Lesions are drawn the size they have *relative to a ViT patch* in
# SSL-FL (224 px, patch 16: a fundus radius of ~7 patches), not relative to the eye: the bundle's tiny ViT sees
# 32 px with patch 4 (a radius of ~4 patches), so a lesion of a fraction f of R in a real 224 px image is drawn
# at ~1.75 f (``_LESION_SCALE``); at the real fraction most lesions would vanish below one pixel.  Even so a
# microaneurysm stays about a pixel wide, so many grade-1 images are indistinguishable from grade 0, as many
# real grade-1 images are at 224 px.

#: calibrated default of ``difficulty`` for retina (README "Calibration of the synthetic retina"), chosen on ViT
#: from scratch only: federated fine-tuning on Split-3 (alpha 0.5, 5 sites, 100 % labels, bench profile, 2,800
#: images written at 40 px, balanced), test accuracy % for seeds 0 / 1: d 0.0 -> 77.4; 0.5 -> 66.6 / 69.9;
#: 0.6 -> 59.1 / 63.5; 1.0 -> 49.7.  SSL-FL Table II's scratch row is 64.13 % (target 59.1-69.1): 0.6 has the
#: two-seed mean closest to it (61.3)
RETINA_DIFFICULTY = 0.6

#: per DR level 0-4: mean counts (microaneurysms, haemorrhages, hard-exudate clusters, cotton-wool spots) and
#: the lesions' base opacity (before the difficulty scaling); level 1 has only a few faint microaneurysms
_RETINA_LESIONS = {
    0: {"ma": 0.0, "hem": 0.0, "ex": 0.0, "cws": 0.0, "opacity": 0.0},
    1: {"ma": 2.0, "hem": 0.0, "ex": 0.0, "cws": 0.0, "opacity": 0.55},
    2: {"ma": 6.0, "hem": 3.0, "ex": 1.2, "cws": 0.6, "opacity": 0.8},
    3: {"ma": 14.0, "hem": 12.0, "ex": 2.0, "cws": 1.5, "opacity": 0.9},
    4: {"ma": 8.0, "hem": 5.0, "ex": 1.5, "cws": 1.0, "opacity": 0.9},
}
#: lesion size / its real size relative to the fundus radius (see above: 7 / 4 patches per fundus radius)
_LESION_SCALE = 1.75
_DARK_RED = np.array([0.40, 0.05, 0.04], np.float32)
_EXUDATE = np.array([1.0, 0.90, 0.40], np.float32)
_PALE = np.array([0.98, 0.90, 0.80], np.float32)


def retina_lesion_opacity(difficulty: float) -> float:
    """Factor on every DR lesion's opacity: ``1 / (1 + difficulty)`` (1 at 0, 1/2 at 1, 1/4 at 3)."""
    return 1.0 / (1.0 + difficulty)


def _retina_sources(seed: int, n_sources: int) -> list[dict]:
    """Fundus cameras: colour cast, exposure, gamma, blur, effective resolution, noise, field of view, vignetting
    and a dust speck on the optics; each is scaled by the difficulty at rendering time (difficulty 0: identical
    ideal cameras)."""
    out = []
    for s in range(n_sources):
        g = np.random.default_rng([seed, 7919, s])
        out.append({
            "gains": g.uniform(0.8, 1.2, size=3).astype(np.float32),
            "brightness": float(g.uniform(0.75, 1.25)),
            "gamma": float(g.uniform(0.8, 1.25)),
            "blur": float(g.uniform(0.1, 0.9)),  # pixels at 64 px high
            "resolution": float(g.uniform(0.45, 1.0)),  # effective sensor resolution (fraction of the image)
            "noise": float(g.uniform(0.01, 0.04)),
            "fov": float(g.uniform(0.44, 0.56)),  # fundus radius / image height (> 0.5: top and bottom cut)
            "vignette": float(g.uniform(0.2, 0.6)),
            "dust": (float(g.uniform(0.2, 0.8)), float(g.uniform(0.2, 0.8)), float(g.uniform(0.0, 0.5))),
        })
    return out


def _smooth_field(rng: np.random.Generator, h: int, w: int, cells: int) -> np.ndarray:
    """A smooth random field ``[h, w]`` (unit-variance grid of ``cells`` x ``cells`` bilinearly interpolated)."""
    grid = rng.normal(0.0, 1.0, size=(cells + 1, cells + 1))
    xs, ys = np.linspace(0, cells, w), np.linspace(0, cells, h)
    rows = np.stack([np.interp(xs, np.arange(cells + 1), r) for r in grid])
    return np.stack([np.interp(ys, np.arange(cells + 1), c) for c in rows.T], axis=1).astype(np.float32)


def _vessel_tree(rng: np.random.Generator, y: float, x: float, heading: float, bend: float, length: float,
                 width: float, depth: int) -> list[tuple[np.ndarray, float]]:
    """Segments ``(points, width)`` of a vessel leaving (y, x): a gently curving trunk that forks into two thinner,
    shorter branches ``depth`` times (Murray-like width ratio 0.75)."""
    pts = [(y, x)]
    for _ in range(6):
        heading += bend + rng.normal(0.0, 0.12)
        y, x = y + length / 6 * math.sin(heading), x + length / 6 * math.cos(heading)
        pts.append((y, x))
    out = [(np.asarray(pts, np.float32), width)]
    if depth > 0:
        for sign in (-1.0, 1.0):
            out += _vessel_tree(rng, y, x, heading + sign * rng.uniform(0.35, 0.8), bend * 0.5,
                                length * rng.uniform(0.55, 0.75), width * 0.75, depth - 1)
    return out


def _vessels_alpha(cv: _Canvas, segments: list[tuple[np.ndarray, float]]) -> np.ndarray:
    """Coverage ``[h, w]`` of many polylines ``(points, width)`` at once (anti-aliased as :meth:`_Canvas.polyline`)."""
    p0 = np.concatenate([pts[:-1] for pts, _ in segments])
    p1 = np.concatenate([pts[1:] for pts, _ in segments])
    half = np.concatenate([np.full(len(pts) - 1, max(width, 0.5) / 2.0, np.float32) for pts, width in segments])
    yy, xx = cv.yy.reshape(1, -1), cv.xx.reshape(1, -1)
    d = p1 - p0
    L2 = (d ** 2).sum(axis=1, keepdims=True) + 1e-9
    t = np.clip(((yy - p0[:, :1]) * d[:, :1] + (xx - p0[:, 1:]) * d[:, 1:]) / L2, 0.0, 1.0)
    dist = np.hypot(yy - (p0[:, :1] + t * d[:, :1]), xx - (p0[:, 1:] + t * d[:, 1:]))
    return np.clip(half[:, None] - dist + 0.5, 0.0, 1.0).max(axis=0).reshape(cv.h, cv.w)


def _paint_spot(img: np.ndarray, cv: _Canvas, y: float, x: float, r: float, opacity: float, colour,
                aspect: float = 1.0, angle: float = 0.0) -> None:
    """A round lesion of radius ``r`` pixels; below a pixel it is a blurred dot whose peak opacity falls with its
    area (a sub-pixel microaneurysm is a faint smudge, as in a down-sampled fundus photograph)."""
    sigma = max(r, 0.6)
    peak = opacity * min(1.0, (r / sigma) ** 2)
    _paint(img, peak * cv.gauss(y, x, sigma, sigma * aspect, angle), colour)


def _fundus(cv: _Canvas, eye: str, p: dict, rng: np.random.Generator, h: int, nuisance: float):
    """Fundus disc, choroidal texture, macula, optic disc and vessel trees; returns (image, geometry)."""
    w = cv.w
    cy, cx = h / 2 + rng.uniform(-0.04, 0.04) * h, w / 2 + rng.uniform(-0.05, 0.05) * h
    fov = 0.5 + (p["fov"] - 0.5) * min(nuisance, 1.5)
    R = fov * h * rng.uniform(0.97, 1.03)
    pig = rng.uniform(0.7, 1.1)  # pigmentation
    base = np.array([0.85, 0.36, 0.14], np.float32) * pig
    fundus = cv.ellipse(cy, cx, R, R, soft=1.0)
    texture = 1.0 + 0.06 * _smooth_field(rng, h, w, 6)  # choroidal texture
    img = fundus[..., None] * base * texture[..., None]
    # optic disc: nasal, i.e. on the image's right for a right eye; some images are mirrored (as in Kaggle DR)
    side = 1.0 if eye == "right" else -1.0
    if rng.random() < 0.15:
        side = -side
    ang = (0.0 if side > 0 else math.pi) + rng.uniform(-0.25, 0.25)
    dy, dx = 0.5 * R * math.sin(ang), 0.5 * R * math.cos(ang)
    od_r = rng.uniform(0.10, 0.14) * R
    my, mx = cy - 0.25 * dy, cx - 0.25 * dx  # macula: temporal to the disc, ~2.5 disc diameters away
    _paint(img, 0.5 * cv.gauss(my, mx, 0.12 * R, 0.12 * R), base * 0.5)
    _paint(img, cv.ellipse(cy + dy, cx + dx, od_r, od_r * rng.uniform(0.85, 1.0), soft=1.2),
           np.array([1.0, 0.84, 0.56], np.float32) * min(1.0, pig + 0.2))
    _paint(img, 0.6 * cv.gauss(cy + dy, cx + dx, 0.45 * od_r, 0.45 * od_r), np.array([1.0, 0.95, 0.85], np.float32))
    # vessels: four arcades (supero/infero-temporal arcing around the macula, supero/infero-nasal), an artery
    # (lighter, thinner) and a vein (darker, wider) each
    temporal = ang + math.pi
    trees: dict[bool, list] = {False: [], True: []}
    for up in (-1.0, 1.0):
        for heading, bend, length in ((temporal + up * 0.9, -up * 0.16, 0.55 * R), (ang + up * 0.7, 0.0, 0.35 * R)):
            for vein in (False, True):
                trees[vein] += _vessel_tree(rng, cy + dy, cx + dx,
                                            heading + rng.normal(0, 0.1) + (0.15 * up if vein else 0),
                                            bend, length, (0.024 if vein else 0.017) * R * 2, 2)
    for vein, colour in ((False, (0.7, 0.32, 0.3)), (True, (0.45, 0.16, 0.2))):
        _paint(img, 0.85 * _vessels_alpha(cv, trees[vein]) * fundus, base * np.asarray(colour, np.float32))
    veins = [pts for pts, _ in trees[True]]
    geo = {"cy": cy, "cx": cx, "R": R, "disc": (cy + dy, cx + dx), "od_r": od_r, "macula": (my, mx),
           "fundus": fundus, "veins": veins, "base": base}
    return img, geo


def _place(rng: np.random.Generator, geo: dict, near=None, spread: float = 0.0) -> tuple[float, float]:
    """A point on the retina away from the optic disc (uniform over the fundus, or around ``near``)."""
    cy, cx, R = geo["cy"], geo["cx"], geo["R"]
    for _ in range(20):
        if near is None:
            r, t = 0.85 * R * math.sqrt(rng.random()), rng.uniform(0, 2 * math.pi)
            y, x = cy + r * math.sin(t), cx + r * math.cos(t)
        else:
            y, x = near[0] + rng.normal(0, spread), near[1] + rng.normal(0, spread)
        if math.hypot(y - geo["disc"][0], x - geo["disc"][1]) > 1.5 * geo["od_r"] and \
                math.hypot(y - cy, x - cx) < 0.9 * R:
            return y, x
    return cy, cx


def _confounders(img: np.ndarray, cv: _Canvas, geo: dict, rng: np.random.Generator) -> None:
    """Findings of every level that look like DR lesions: pale reflexes (like exudates / cotton-wool spots),
    drusen (small yellow dots) and pigment clumps (dark dots, like microaneurysms)."""
    R = geo["R"]
    for _ in range(int(rng.poisson(1.2))):
        y, x = _place(rng, geo)
        _paint(img, 0.3 * cv.gauss(y, x, 0.05 * R, 0.09 * R, rng.uniform(0, math.pi)), _PALE)
    for _ in range(int(rng.poisson(1.0))):
        y, x = _place(rng, geo, geo["macula"], 0.25 * R)
        _paint_spot(img, cv, y, x, rng.uniform(0.012, 0.03) * R, rng.uniform(0.2, 0.5), _EXUDATE * 0.9)
    for _ in range(int(rng.poisson(0.8))):
        y, x = _place(rng, geo)
        _paint_spot(img, cv, y, x, rng.uniform(0.015, 0.03) * R, rng.uniform(0.2, 0.5), geo["base"] * 0.35)


def _lesions(img: np.ndarray, cv: _Canvas, geo: dict, level: int, rng: np.random.Generator, visibility: float) -> None:
    """The DR lesions of ``level``; every opacity is drawn around the level's base and scaled by ``visibility``."""
    spec, R = _RETINA_LESIONS[level], geo["R"]
    S = R * _LESION_SCALE  # lesion sizes
    if level == 0:
        return

    def opacity() -> float:
        return float(np.clip(spec["opacity"] * rng.lognormal(0.0, 0.3), 0.0, 1.0)) * visibility

    for _ in range(max(1, int(rng.poisson(spec["ma"])))):  # microaneurysms: tiny red dots
        y, x = _place(rng, geo, geo["macula"], 0.45 * R)
        _paint_spot(img, cv, y, x, rng.uniform(0.01, 0.025) * S, opacity(), _DARK_RED)
    for _ in range(int(rng.poisson(spec["hem"]))):  # dot-blot (round) and flame (elongated) haemorrhages
        y, x = _place(rng, geo)
        flame = rng.random() < 0.4
        r = rng.uniform(0.03, 0.07) * S
        _paint_spot(img, cv, y, x, r, opacity(), _DARK_RED * 1.1, aspect=3.0 if flame else 1.0,
                    angle=rng.uniform(0, math.pi))
    for _ in range(int(rng.poisson(spec["ex"]))):  # hard exudates: clusters of small yellow flecks near the macula
        centre = _place(rng, geo, geo["macula"], 0.35 * R)
        a = opacity()
        for _ in range(int(rng.integers(3, 9))):
            y, x = _place(rng, geo, centre, 0.06 * S)
            _paint_spot(img, cv, y, x, rng.uniform(0.012, 0.03) * S, a, _EXUDATE)
    for _ in range(int(rng.poisson(spec["cws"]))):  # cotton-wool spots: fluffy pale patches along the arcades
        y, x = _place(rng, geo)
        _paint(img, 0.8 * opacity() * cv.gauss(y, x, 0.04 * S, 0.07 * S, rng.uniform(0, math.pi)), _PALE)
    if level >= 3 and geo["veins"]:  # venous beading: dark swellings along a vein
        pts = geo["veins"][int(rng.integers(0, len(geo["veins"])))]
        for y, x in pts[1::2]:
            _paint_spot(img, cv, float(y), float(x), 0.03 * S, 0.7 * opacity(), geo["base"] * 0.4)
    if level == 4:  # neovascularisation at the disc or elsewhere; pre-retinal haemorrhage; fibrous tissue
        for _ in range(int(rng.integers(1, 4))):
            y, x = geo["disc"] if rng.random() < 0.5 else _place(rng, geo)
            pts = _curve(rng, y, x, rng.uniform(0, 6.3), 0.3 * R, 12, 0.9)
            _paint(img, opacity() * cv.polyline(pts, max(0.012 * S, 0.5)) * geo["fundus"], _DARK_RED * 1.3)
        if rng.random() < 0.3:
            y, x = _place(rng, geo)
            _paint(img, opacity() * cv.ellipse(y, x, 0.08 * S, 0.14 * S, rng.uniform(0, 3.1), soft=1.0), _DARK_RED)
        if rng.random() < 0.2:
            y, x = geo["disc"]
            _paint(img, 0.5 * opacity() * cv.gauss(y, x, 0.1 * S, 0.2 * S, rng.uniform(0, 3.1)), _PALE)


def _resample(img: np.ndarray, factor: float) -> np.ndarray:
    """Down- and up-sample by ``factor`` (< 1): a camera with fewer effective pixels than the image."""
    if factor >= 0.98:
        return img
    from PIL import Image

    h, w = img.shape[:2]
    small = (max(4, int(round(w * factor))), max(4, int(round(h * factor))))
    return np.stack([np.asarray(Image.fromarray(img[..., c], mode="F").resize(small, Image.BILINEAR)
                                .resize((w, h), Image.BILINEAR)) for c in range(3)], axis=2)


def _camera(img: np.ndarray, cv: _Canvas, geo: dict, p: dict, rng: np.random.Generator, size: int,
            nuisance: float) -> np.ndarray:
    """Illumination and camera, each amplitude times ``nuisance``: uneven illumination (gradient + smooth field),
    vignetting, per-image over / under exposure, dust on the optics, resolution, blur, colour cast, gamma, noise."""
    h, w = img.shape[:2]
    cy, cx, R = geo["cy"], geo["cx"], geo["R"]
    r2 = np.clip(((cv.yy - cy) ** 2 + (cv.xx - cx) ** 2) / (R * R), 0, 1)
    t = rng.uniform(0, 2 * math.pi)
    ramp = ((cv.yy - cy) * math.sin(t) + (cv.xx - cx) * math.cos(t)) / R
    light = (1.0 - (0.25 + p["vignette"] * nuisance) * r2) * (1.0 + nuisance * (
        0.15 * rng.uniform(0.3, 1.0) * ramp + 0.08 * _smooth_field(rng, h, w, 3)))
    exposure = (1.0 + (p["brightness"] - 1.0) * nuisance) * math.exp(rng.normal(0.0, 0.25 * nuisance))
    img = img * np.clip(light, 0.05, None)[..., None] * exposure
    dy, dx, strength = p["dust"]
    _paint(img, strength * min(nuisance, 1.5) * cv.gauss(dy * h, dx * w, 0.04 * h, 0.04 * h), geo["base"] * 0.3)
    img = _resample(img, 1.0 - (1.0 - p["resolution"]) * min(nuisance, 1.0))
    img = _blur(img, p["blur"] * nuisance * size / 64.0)
    img = img * (1.0 + (p["gains"] - 1.0) * nuisance)
    gamma = 1.0 + (p["gamma"] - 1.0) * nuisance
    img = np.clip(img, 0.0, 1.0) ** gamma
    img = img + rng.normal(0.0, p["noise"] * nuisance, size=img.shape).astype(np.float32)
    return np.clip(img, 0.0, 1.0) * (geo["fundus"][..., None] > 0.02)


def _render_retina(level: int, eye: str, p: dict, rng: np.random.Generator, size: int,
                   difficulty: float = RETINA_DIFFICULTY) -> np.ndarray:
    """A fundus photograph of DR ``level`` 0-4 (``size`` high, 5:4) from camera ``p``.

    ``difficulty`` d >= 0 scales, in one documented way: every lesion's opacity by ``1 / (1 + d)``
    (:func:`retina_lesion_opacity`) and every illumination / camera nuisance amplitude by ``d`` (0: ideal
    camera, even light). Anatomy, lesions and camera draw from three separate streams of ``rng``, so the same
    ``rng`` gives the same eye at every level and difficulty: only the lesions, or only their visibility, change.
    """
    g_eye, g_lesion, g_camera = (np.random.default_rng(int(s)) for s in rng.integers(0, 2 ** 62, size=3))
    h, w = size, int(round(size * 1.25))
    cv = _Canvas(h, w)
    img, geo = _fundus(cv, eye, p, g_eye, h, difficulty)
    _confounders(img, cv, geo, g_eye)
    _lesions(img, cv, geo, level, g_lesion, retina_lesion_opacity(difficulty))
    return _camera(img, cv, geo, p, g_camera, size, difficulty)


# --------------------------------------------------------------------------------------------------------------
# derm

#: class -> (colour, radius range (fraction of height), irregularity range, border softness (fraction))
_DERM_STYLE = {
    "MEL": ((0.30, 0.17, 0.10), (0.20, 0.30), (0.10, 0.20), 0.015),
    "NV": ((0.50, 0.32, 0.20), (0.10, 0.20), (0.01, 0.05), 0.03),
    "BCC": ((0.86, 0.60, 0.62), (0.13, 0.24), (0.04, 0.10), 0.03),
    "AK": ((0.80, 0.42, 0.38), (0.16, 0.28), (0.06, 0.12), 0.07),
    "BKL": ((0.62, 0.46, 0.30), (0.14, 0.26), (0.03, 0.07), 0.008),
    "DF": ((0.56, 0.38, 0.28), (0.08, 0.13), (0.01, 0.04), 0.03),
    "VASC": ((0.62, 0.10, 0.26), (0.08, 0.15), (0.02, 0.06), 0.012),
    "SCC": ((0.78, 0.34, 0.30), (0.14, 0.24), (0.06, 0.12), 0.05),
}


def _render_derm(cls: str, p: dict, rng: np.random.Generator, size: int) -> np.ndarray:
    h, w = size, int(round(size * 4 / 3))
    cv = _Canvas(h, w)
    light, dark = np.array([0.95, 0.80, 0.70], np.float32), np.array([0.58, 0.40, 0.29], np.float32)
    tone = np.clip(p["tone"] + rng.normal(0, 0.12), 0, 1)
    skin = light * (1 - tone) + dark * tone
    grad = rng.normal(0, 0.06, size=2)
    shade = 1.0 + grad[0] * (cv.yy / h - 0.5) + grad[1] * (cv.xx / w - 0.5)
    img = skin * shade[..., None] * (1.0 + 0.04 * rng.standard_normal((h, w, 1)).astype(np.float32))
    colour, (r_lo, r_hi), (i_lo, i_hi), soft = _DERM_STYLE[cls]
    colour = np.asarray(colour, np.float32) * rng.uniform(0.85, 1.15)
    cy, cx = h / 2 + rng.uniform(-0.12, 0.12) * h, w / 2 + rng.uniform(-0.12, 0.12) * h
    r0 = rng.uniform(r_lo, r_hi) * h
    irr = rng.uniform(i_lo, i_hi)
    harm = [(k, irr * rng.uniform(0.4, 1.0) / (1 + 0.3 * (k - 2)), rng.uniform(0, 6.3)) for k in range(2, 7)]
    rot, aspect = rng.uniform(0, math.pi), rng.uniform(0.7, 1.0)
    body = cv.polar_blob(cy, cx, r0, harm, rot, aspect, soft=max(0.6, soft * h))
    if cls == "VASC":  # lobules
        body = np.zeros_like(body)
        for _ in range(int(rng.integers(3, 6))):
            y, x = cy + rng.normal(0, 0.5) * r0, cx + rng.normal(0, 0.5) * r0
            rr = r0 * rng.uniform(0.45, 0.75)
            body = np.maximum(body, cv.ellipse(y, x, rr, rr, soft=0.8))
    _paint(img, body, colour)
    if cls == "MEL":  # variegated: blue-black and light-brown regions, asymmetric
        for _ in range(int(rng.integers(2, 5))):
            y, x = cy + rng.normal(0, 0.45) * r0, cx + rng.normal(0, 0.45) * r0
            c = (0.14, 0.14, 0.24) if rng.random() < 0.6 else (0.55, 0.36, 0.22)
            _paint(img, 0.85 * body * cv.gauss(y, x, 0.25 * r0, 0.35 * r0, rng.uniform(0, 3.1)), c)
    elif cls == "NV":  # faint pigment network
        net = 0.5 + 0.5 * np.sin(cv.xx * 2.2 / (0.06 * h)) * np.sin(cv.yy * 2.2 / (0.06 * h))
        _paint(img, 0.25 * body * net, colour * 0.7)
    elif cls == "BCC":  # branching red vessels + blue-grey nests
        for _ in range(int(rng.integers(2, 5))):
            y, x = cy + rng.normal(0, 0.3) * r0, cx + rng.normal(0, 0.3) * r0
            pts = _curve(rng, y, x, rng.uniform(0, 6.3), r0, 6, 0.6)
            _paint(img, 0.9 * body * cv.polyline(pts, 0.012 * h), (0.75, 0.12, 0.14))
        for _ in range(int(rng.integers(1, 4))):
            y, x = cy + rng.normal(0, 0.4) * r0, cx + rng.normal(0, 0.4) * r0
            nest = cv.ellipse(y, x, 0.12 * r0, 0.18 * r0, rng.uniform(0, 3.1), soft=0.8)
            _paint(img, body * nest, (0.40, 0.42, 0.52))
    elif cls == "AK":  # white scale speckles
        speck = (rng.random((h, w)) < 0.12).astype(np.float32) * body
        _paint(img, 0.6 * speck, (0.95, 0.9, 0.85))
    elif cls == "BKL":  # cerebriform stripes
        stripes = 0.5 + 0.5 * np.sin((cv.xx * math.cos(rot) + cv.yy * math.sin(rot)) / (0.025 * h))
        _paint(img, 0.4 * body * stripes, colour * 0.6)
    elif cls == "DF":  # white central patch
        _paint(img, cv.ellipse(cy, cx, 0.45 * r0, 0.45 * r0 / aspect, rot, soft=1.0), (0.92, 0.86, 0.80))
    elif cls == "SCC":  # keratin centre
        _paint(img, 0.9 * cv.polar_blob(cy, cx, 0.45 * r0, harm, rot, aspect, soft=1.0), (0.93, 0.88, 0.72))
    # hairs (more for some sources)
    for _ in range(int(rng.poisson(4 * p["hair"]))):
        pts = _curve(rng, rng.uniform(0, h), rng.uniform(0, w), rng.uniform(0, 6.3), rng.uniform(0.4, 1.0) * h, 8, 0.12)
        _paint(img, 0.85 * cv.polyline(pts, rng.uniform(0.008, 0.015) * h), (0.12, 0.08, 0.06))
    img = _acquire(img, p, rng, size)
    if p["vignette"]:  # dermoscope: black outside a circle
        rr = rng.uniform(0.55, 0.7) * w
        img *= cv.ellipse(h / 2, w / 2, rr, rr, soft=2.0)[..., None]
    return img


# --------------------------------------------------------------------------------------------------------------
# covidfl


def _render_covidfl(cls: str, p: dict, rng: np.random.Generator, size: int) -> np.ndarray:
    h = w = size
    cv = _Canvas(h, w)
    img = np.full((h, w, 1), 0.06, np.float32)
    child = p["tone"] > 0.75  # paediatric site: smaller chest
    scale = rng.uniform(0.72, 0.85) if child else rng.uniform(0.86, 1.0)
    cy, cx = h * (0.52 + rng.uniform(-0.03, 0.03)), w * (0.5 + rng.uniform(-0.04, 0.04))
    tilt = rng.uniform(-0.08, 0.08)
    _paint(img, cv.ellipse(cy + 0.06 * h, cx, 0.6 * h * scale, 0.47 * w * scale, tilt, soft=3.0), (0.5,))
    lungs = []
    for side in (-1, 1):
        ly, lx = cy - 0.02 * h * scale, cx + side * 0.2 * w * scale
        ry, rx = 0.33 * h * scale * rng.uniform(0.92, 1.05), 0.15 * w * scale * rng.uniform(0.9, 1.1)
        a = cv.ellipse(ly, lx, ry, rx, tilt + side * 0.12, soft=2.0)
        lungs.append((a, ly, lx, ry, rx, side))
        _paint(img, a, (0.16,))
    # heart (left of the patient = right of the image), spine
    _paint(img, 0.7 * cv.ellipse(cy + 0.17 * h * scale, cx + 0.06 * w * scale, 0.11 * h * scale, 0.11 * w * scale,
                                 0.3, soft=2.5), (0.5,))
    _paint(img, 0.6 * cv.ellipse(cy, cx, 0.48 * h * scale, 0.035 * w * scale, tilt, soft=1.5), (0.7,))
    lung_any = np.maximum(lungs[0][0], lungs[1][0])
    # ribs: faint curved bright bands over the lungs
    period = rng.uniform(0.07, 0.09) * h * scale
    ribs = 0.5 + 0.5 * np.sin((cv.yy - cy + 0.03 * ((cv.xx - cx) / (0.1 * w)) ** 2 * h * 0.1) / period * 2 * math.pi)
    img[..., 0] += 0.07 * lung_any * ribs ** 3
    if cls == "pneumonia":  # lobar consolidation: one dense, fairly sharp opacity in one lung
        a, ly, lx, ry, rx, side = lungs[int(rng.integers(0, 2))]
        y = ly + rng.uniform(0.0, 0.5) * ry
        x = lx + rng.uniform(-0.3, 0.3) * rx
        blob = cv.polar_blob(y, x, rng.uniform(0.5, 0.8) * rx, [(3, 0.12, rng.uniform(0, 6.3))],
                             rng.uniform(0, 3.1), rng.uniform(1.0, 1.6), soft=0.03 * h)
        img[..., 0] += rng.uniform(0.28, 0.4) * blob * a
    elif cls == "covid":  # bilateral, peripheral, lower-zone, hazy ground-glass opacities
        for a, ly, lx, ry, rx, side in lungs:
            for _ in range(int(rng.integers(2, 4))):
                y = ly + rng.uniform(-0.1, 0.7) * ry
                x = lx + side * rng.uniform(0.35, 0.8) * rx
                img[..., 0] += rng.uniform(0.16, 0.24) * cv.gauss(y, x, rng.uniform(0.12, 0.2) * ry,
                                                                 rng.uniform(0.25, 0.4) * rx) * a
    img = np.repeat(img, 3, axis=2)
    img = _acquire(img, p, rng, size)
    if p["marker"]:  # burnt-in side marker in a corner
        y0, x0 = int(0.06 * h), int((0.06 if rng.random() < 0.5 else 0.86) * w)
        img[y0 : y0 + max(2, h // 14), x0 : x0 + max(1, w // 40)] = 0.95
        img[y0 + max(2, h // 14) - max(1, h // 40) : y0 + max(2, h // 14), x0 : x0 + max(2, w // 18)] = 0.95
    if p["vignette"]:  # collimation: dark frame
        m = max(1, int(rng.uniform(0.02, 0.06) * h))
        img[:m], img[-m:], img[:, :m], img[:, -m:] = 0.0, 0.0, 0.0, 0.0
    return img


def render(dataset: str, cls: Union[int, str], source: dict, rng: np.random.Generator, size: int,
           eye: str = "left", difficulty: Optional[float] = None) -> np.ndarray:
    """One synthetic image as float ``[H, W, 3]`` in [0, 1]: retina ``cls`` = DR level 0-4, derm an ISIC
    class name (derm_mel too), covidfl a COVID-FL class name; ``source`` from the per-source appearance table.
    ``difficulty``: retina only (None = :data:`RETINA_DIFFICULTY`; see :func:`_render_retina`)."""
    difficulty = check_difficulty(dataset, difficulty)
    if dataset == "retina":
        return _render_retina(int(cls), eye, source, rng, size, difficulty)
    if dataset in ("derm", "derm_mel"):
        return _render_derm(str(cls), source, rng, size)
    if dataset == "covidfl":
        return _render_covidfl(str(cls), source, rng, size)
    raise ValueError(f"dataset={dataset!r}: use one of {list(SSLFL_DATASETS)}")


# --------------------------------------------------------------------------------------------------------------
# writer


def allocate_counts(n: int, mix, minimum: int = 0) -> list[int]:
    """Largest-remainder counts of ``n`` items over ``mix`` (entries with mix > 0 get >= ``minimum``)."""
    mix = np.asarray(mix, dtype=float)
    mix = mix / mix.sum()
    raw = mix * n
    counts = np.floor(raw).astype(int)
    for i in np.argsort(-(raw - counts), kind="stable")[: n - counts.sum()]:
        counts[i] += 1
    for i in np.flatnonzero(mix > 0):
        while counts[i] < minimum:
            j = int(np.argmax(counts))
            if counts[j] <= minimum:
                break
            counts[j] -= 1
            counts[i] += 1
    return counts.tolist()


def save_image(img: np.ndarray, path: str, grey: bool = False) -> None:
    from PIL import Image

    a = np.clip(img * 255.0 + 0.5, 0, 255).astype(np.uint8)
    if grey:
        Image.fromarray(a[..., 0], mode="L").save(path, optimize=False)
    else:
        Image.fromarray(a, mode="RGB").save(path, quality=92)


def _release_root(out: Path) -> None:
    for name in ("labels.csv", "train", "test"):
        if (out / name).exists():
            raise ValueError(f"{out / name} already exists; write into an empty folder")
    (out / "train").mkdir()
    (out / "test").mkdir()


def _held_out(labels: Sequence[int], fraction: float, seed: int) -> set[int]:
    """Indices of the test images: ``round(fraction * n_c)`` of every class (>= 1 training image kept)."""
    recs = [ImageRecord(f"{i:08d}", int(c)) for i, c in enumerate(labels)]
    _, test = train_val_split(recs, fraction, seed)
    return {int(r.path) for r in test}


def _write_covidfl(out: Path, n_images: int, params: list[dict], rng: np.random.Generator, seed: int,
                   image_size: int, images: dict[str, str]) -> dict:
    """COVID-FL in SSL-FL's release layout: per-site 80/20 split, ``12_clients/split_real`` client lists."""
    _release_root(out)
    sites = COVIDFL_SITES[: len(params)]
    site_n = allocate_counts(n_images, [wt for _, _, wt in sites], minimum=2 * len(COVIDFL_CLASSES))
    labels: dict[str, str] = {}
    phases: dict[str, list[str]] = {"train": [], "test": []}
    train_src: list[str] = []
    i = 0
    for s, ((name, mix, _), n_site) in enumerate(zip(sites, site_n)):
        site_labels = rng.permutation(np.repeat(np.arange(3), allocate_counts(n_site, mix, minimum=2)))
        test = _held_out(site_labels, COVIDFL_TEST_FRACTION, seed + s)
        for j, c in enumerate(site_labels):
            image, phase = f"{name}_{j:05d}.png", "test" if j in test else "train"
            g = np.random.default_rng([seed, i, 3])
            save_image(render("covidfl", COVIDFL_CLASSES[c], params[s], g, image_size), str(out / phase / image),
                       grey=True)
            labels[image] = COVIDFL_CLASSES[c]
            phases[phase].append(image)
            images[f"{phase}/{image}"] = name
            train_src += [name] if phase == "train" else []
            i += 1
    cuts = {k: v for k, v in SSLFL_COVIDFL_SUB_SITES.items() if k in train_src}
    clients = {client: [phases["train"][k] for k in idx]
               for client, idx in real_site_split(train_src, cuts, seed=seed)}
    write_release(out, "covidfl", labels, phases, {"split_real": clients})
    return {"classes": list(COVIDFL_CLASSES), "test_fraction": COVIDFL_TEST_FRACTION,
            "class_counts": {c: sum(v == c for v in labels.values()) for c in COVIDFL_CLASSES},
            "clients": {k: len(v) for k, v in clients.items()}}


def _write_derm_mel(out: Path, n_images: int, params: list[dict], rng: np.random.Generator, seed: int,
                    image_size: int, images: dict[str, str]) -> dict:
    """SSL-FL's Derm in its release layout: half melanoma, half benign ISIC classes, 75/25 train/test."""
    _release_root(out)
    n_mel = n_images // 2
    benign_mix = [0.0 if c == "MEL" else m for c, m in zip(DERM_CLASSES, DERM_CLASS_MIX)]
    isic = np.concatenate([np.zeros(n_mel, int), np.repeat(np.arange(len(DERM_CLASSES)),
                                                            allocate_counts(n_images - n_mel, benign_mix))])
    isic = rng.permutation(isic)
    mel = isic == DERM_CLASSES.index("MEL")
    test = _held_out(mel.astype(int), DERM_MEL_TEST_FRACTION, seed)
    src = rng.integers(0, len(params), size=n_images)
    labels: dict[str, str] = {}
    phases: dict[str, list[str]] = {"train": [], "test": []}
    for i, (c, s) in enumerate(zip(isic, src)):
        image, phase = f"ISIC_{i:07d}.jpg", "test" if i in test else "train"
        g = np.random.default_rng([seed, i, 4])
        save_image(render("derm_mel", DERM_CLASSES[c], params[s], g, image_size), str(out / phase / image))
        labels[image] = DERM_MEL_CLASSES[int(mel[i])]
        phases[phase].append(image)
        images[f"{phase}/{image}"] = f"clinic-{s + 1}"
    write_release(out, "derm_mel", labels, phases, {})
    return {"classes": list(DERM_MEL_CLASSES), "test_fraction": DERM_MEL_TEST_FRACTION,
            "class_counts": {c: sum(v == c for v in labels.values()) for c in DERM_MEL_CLASSES}}


def check_difficulty(dataset: str, difficulty: Optional[float]) -> Optional[float]:
    """The difficulty to render ``dataset`` at: retina a finite float >= 0 (None = the calibrated
    :data:`RETINA_DIFFICULTY`); the other data sets have no difficulty knob yet (None only)."""
    if dataset != "retina":
        if difficulty is not None:
            raise ValueError(f"difficulty={difficulty!r}: only the retina generator has a difficulty setting so far; "
                             f"leave it out for {dataset}")
        return None
    if difficulty is None:
        return RETINA_DIFFICULTY
    if isinstance(difficulty, bool) or not isinstance(difficulty, (int, float)) or not 0 <= difficulty < math.inf:
        raise ValueError(f"difficulty={difficulty!r}: must be a finite number >= 0 (0 = clearly visible lesions and "
                         f"an ideal camera; default {RETINA_DIFFICULTY})")
    return float(difficulty)


def write_synthetic_images(root: PathLike, dataset: str, n_images: int, seed: int = 0, image_size: int = 64,
                           n_sources: Optional[int] = None, difficulty: Optional[float] = None) -> dict:
    """Write a full synthetic ``dataset`` of ``n_images`` images under ``root`` in its real layout.

    Args:
        root: output folder (created; must not already hold the dataset's CSV / image folders).
        dataset: "retina", "derm", "covidfl" or "derm_mel".
        n_images: total number of images.
        seed: everything (classes, sources, pixels) is a function of the seed.
        image_size: image height in pixels (retina width 1.25x, derm/derm_mel 4/3x, covidfl square).
        n_sources: acquisition sources (retina/derm cameras, default 4; derm_mel 3 (ISIC 2017/2019/2020);
            covidfl real sites, 1-8, default 8).
        difficulty: retina only: lesion visibility and camera / illumination nuisance (None = the calibrated
            :data:`RETINA_DIFFICULTY`; higher = harder, see :func:`_render_retina`); must be None for the others.

    Returns:
        ``{"dataset", "root", "n_images", "classes", "class_counts", "sources": {source: n}, "images":
        {image path relative to root: source}}`` (retina ``class_counts`` are per DR level 0-4); covidfl and
        derm_mel add ``test_fraction``, covidfl ``clients`` (client -> training images of split_real); retina
        adds ``difficulty``.
    """
    if dataset not in SSLFL_DATASETS:
        raise ValueError(f"dataset={dataset!r}: use one of {list(SSLFL_DATASETS)}")
    difficulty = check_difficulty(dataset, difficulty)
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 16:
        raise ValueError(f"image_size={image_size!r}: must be an integer >= 16")
    n_sources = _DEFAULT_SOURCES[dataset] if n_sources is None else n_sources
    max_sources = len(COVIDFL_SITES) if dataset == "covidfl" else 64
    if isinstance(n_sources, bool) or not isinstance(n_sources, int) or not 1 <= n_sources <= max_sources:
        raise ValueError(f"n_sources={n_sources!r}: must be an integer in [1, {max_sources}]")
    n_classes = {"retina": 2, "derm": len(DERM_CLASSES), "covidfl": 3, "derm_mel": 2}[dataset]
    if isinstance(n_images, bool) or not isinstance(n_images, int) or n_images < 2 * n_classes * (
            n_sources if dataset == "covidfl" else 1):
        raise ValueError(f"n_images={n_images!r}: need at least 2 images per class"
                         f"{' and site' if dataset == 'covidfl' else ''} "
                         f"(>= {2 * n_classes * (n_sources if dataset == 'covidfl' else 1)})")
    out = Path(root)
    out.mkdir(parents=True, exist_ok=True)
    params = _source_params(dataset, seed, n_sources)
    rng = np.random.default_rng([seed, 104729])
    info: dict = {"dataset": dataset, "root": str(out.resolve()), "n_images": n_images,
                  "image_size": image_size, "seed": seed}
    images: dict[str, str] = {}

    if dataset == "retina":
        csv_path, img_dir = out / RETINA_CSV, out / RETINA_DIR
        if csv_path.exists():
            raise ValueError(f"{csv_path} already exists; write into an empty folder")
        img_dir.mkdir(exist_ok=True)
        counts = allocate_counts(n_images, RETINA_LEVEL_MIX, minimum=1 if n_images >= 20 else 0)
        if sum(counts[1:]) < 2:
            counts[0] -= 2 - sum(counts[1:])
            counts[2] += 2 - sum(counts[1:])
        levels = rng.permutation(np.repeat(np.arange(5), counts))
        src = rng.integers(0, n_sources, size=n_images)
        rows = []
        for i, (lv, s) in enumerate(zip(levels, src)):
            eye = "left" if i % 2 == 0 else "right"
            name = f"{10 + i // 2}_{eye}"
            g = np.random.default_rng([seed, i, 1])
            save_image(render("retina", int(lv), params[s], g, image_size, eye=eye, difficulty=difficulty),
                  str(img_dir / f"{name}.jpeg"))
            rows.append((name, int(lv)))
            images[f"{RETINA_DIR}/{name}.jpeg"] = f"camera-{s + 1}"
        with open(csv_path, "w", newline="") as f:
            wr = csv.writer(f)
            wr.writerow(["image", "level"])
            wr.writerows(rows)
        info["difficulty"] = difficulty
        info["classes"] = ["level_0", "level_1", "level_2", "level_3", "level_4"]
        info["class_counts"] = {f"level_{k}": int(c) for k, c in enumerate(counts)}
    elif dataset == "derm":
        csv_path, img_dir = out / DERM_CSV, out / DERM_DIR
        if csv_path.exists():
            raise ValueError(f"{csv_path} already exists; write into an empty folder")
        img_dir.mkdir(exist_ok=True)
        counts = allocate_counts(n_images, DERM_CLASS_MIX, minimum=2)
        labels = rng.permutation(np.repeat(np.arange(len(DERM_CLASSES)), counts))
        src = rng.integers(0, n_sources, size=n_images)
        rows = []
        for i, (c, s) in enumerate(zip(labels, src)):
            name = f"ISIC_{i:07d}"
            g = np.random.default_rng([seed, i, 2])
            save_image(render("derm", DERM_CLASSES[c], params[s], g, image_size), str(img_dir / f"{name}.jpg"))
            onehot = ["1.0" if j == c else "0.0" for j in range(len(ISIC_COLUMNS))]
            rows.append([name] + onehot)
            images[f"{DERM_DIR}/{name}.jpg"] = f"clinic-{s + 1}"
        with open(csv_path, "w", newline="") as f:
            wr = csv.writer(f)
            wr.writerow(["image", *ISIC_COLUMNS])
            wr.writerows(rows)
        info["classes"] = list(DERM_CLASSES)
        info["class_counts"] = {DERM_CLASSES[k]: int(c) for k, c in enumerate(counts)}
    elif dataset == "covidfl":
        info.update(_write_covidfl(out, n_images, params, rng, seed, image_size, images))
    else:
        info.update(_write_derm_mel(out, n_images, params, rng, seed, image_size, images))
    srcs: dict[str, int] = {}
    for s in images.values():
        srcs[s] = srcs.get(s, 0) + 1
    info["sources"] = dict(sorted(srcs.items()))
    info["images"] = images
    return info
