"""Synthetic stand-ins for Kaggle DR (retina), ISIC 2019 (derm), COVID-FL and SSL-FL's Derm (derm_mel),
written in their real layouts.

:func:`write_synthetic_images` writes a FULL data set in the layout the real one comes in: retina/derm a
folder that :func:`fedssl.data.images.load_image_records` reads; covidfl/derm_mel SSL-FL's release layout
(:mod:`fedssl.data.sslfl_release`), which ``fedssl sslfl partition`` cuts into site folders.
The class is visible in the pixels, with realistic nuisance, and every image comes from a source
(camera / clinic / hospital) whose acquisition shifts its appearance:

* retina (``trainLabels.csv`` + ``train/<id>_<left|right>.jpeg``, 5:4 frames): a fundus disc on black
  with vignetting, optic disc (side given by the eye, some images mirrored), macula and vessels; DR
  lesions grow with the level 0-4 (microaneurysms -> + blot haemorrhages and yellow exudates -> more ->
  + neovascular tangles); pale reflex spots appear at every level (a confounder of exudates). Level mix
  as Kaggle DR: 73.5 / 7 / 15 / 2.5 / 2 %, so about 73 % of the images are label 0.
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
    DATASETS,
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

__all__ = ["write_synthetic_images", "RETINA_LEVEL_MIX", "DERM_CLASS_MIX", "COVIDFL_SITES", "COVIDFL_TEST_FRACTION",
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


def _render_retina(level: int, eye: str, p: dict, rng: np.random.Generator, size: int) -> np.ndarray:
    h, w = size, int(round(size * 1.25))
    cv = _Canvas(h, w)
    img = np.zeros((h, w, 3), np.float32)
    cy, cx = h / 2 + rng.uniform(-0.04, 0.04) * h, w / 2 + rng.uniform(-0.05, 0.05) * h
    R = min(rng.uniform(0.42, 0.49) * h, h / 2 - 1)
    pig = rng.uniform(0.7, 1.1)
    base = np.array([0.85, 0.36, 0.14], np.float32) * pig
    fundus = cv.ellipse(cy, cx, R, R, soft=1.0)
    d2 = ((cv.yy - cy) ** 2 + (cv.xx - cx) ** 2) / (R * R)
    shade = (1.0 - 0.38 * np.clip(d2, 0, 1))[..., None]
    img += fundus[..., None] * base * shade
    # optic disc side: right eye -> right of the image; some images are mirrored (as in Kaggle DR)
    side = 1.0 if eye == "right" else -1.0
    if rng.random() < 0.15:
        side = -side
    ang = (0.0 if side > 0 else math.pi) + rng.uniform(-0.3, 0.3)
    dy, dx = 0.55 * R * math.sin(ang), 0.55 * R * math.cos(ang)
    od_r = rng.uniform(0.11, 0.15) * R
    # macula, opposite the optic disc
    _paint(img, 0.45 * cv.gauss(cy - 0.3 * dy, cx - 0.3 * dx, 0.09 * R, 0.09 * R), base * 0.45)
    # vessels: arcs leaving the optic disc
    for k in range(int(rng.integers(4, 7))):
        heading = ang + math.pi + rng.uniform(-1.3, 1.3)
        pts = _curve(rng, cy + dy, cx + dx, heading, rng.uniform(0.6, 1.1) * R, 10, 0.18)
        a = cv.polyline(pts, rng.uniform(0.012, 0.022) * h) * fundus
        _paint(img, 0.8 * a, base * np.array([0.62, 0.25, 0.3], np.float32))
    _paint(img, cv.ellipse(cy + dy, cx + dx, od_r, od_r * rng.uniform(0.85, 1.0), soft=1.5),
           np.array([1.0, 0.86, 0.58], np.float32) * min(1.0, pig + 0.15))

    def spot() -> tuple[float, float]:
        for _ in range(20):
            r, t = R * 0.85 * math.sqrt(rng.random()), rng.uniform(0, 2 * math.pi)
            y, x = cy + r * math.sin(t), cx + r * math.cos(t)
            if math.hypot(y - cy - dy, x - cx - dx) > 1.6 * od_r:
                return y, x
        return cy, cx

    # confounder at every level: pale reflex spots (fainter and more diffuse than exudates)
    for _ in range(int(rng.integers(0, 3))):
        y, x = spot()
        _paint(img, 0.35 * cv.gauss(y, x, 0.025 * h, 0.04 * h, rng.uniform(0, math.pi)), np.array([0.95, 0.75, 0.55]))
    n_ma = [0, int(rng.integers(3, 7)), int(rng.integers(4, 11)), int(rng.integers(8, 16)),
            int(rng.integers(8, 16))][level]
    n_hem = [0, 0, int(rng.integers(1, 4)), int(rng.integers(3, 8)), int(rng.integers(3, 8))][level]
    n_ex = [0, 0, int(rng.integers(0, 5)), int(rng.integers(3, 9)), int(rng.integers(3, 9))][level]
    dark_red = np.array([0.42, 0.05, 0.04], np.float32)
    for _ in range(n_ma):
        y, x = spot()
        r = rng.uniform(0.026, 0.04) * h
        _paint(img, cv.ellipse(y, x, r, r, soft=0.7), dark_red)
    for _ in range(n_hem):
        y, x = spot()
        r = rng.uniform(0.045, 0.075) * h
        _paint(img, 0.9 * cv.polar_blob(y, x, r, [(3, 0.15, rng.uniform(0, 6.3))], soft=1.2), dark_red * 1.15)
    for _ in range(n_ex):
        y, x = spot()
        r = rng.uniform(0.025, 0.045) * h
        _paint(img, cv.ellipse(y, x, r, r * rng.uniform(0.6, 1.0), rng.uniform(0, 3.1), soft=0.7),
               np.array([1.0, 0.92, 0.42], np.float32))
    if level == 4:  # neovascularisation: fine tangled vessels near the disc or elsewhere
        for _ in range(int(rng.integers(2, 4))):
            y, x = spot()
            pts = _curve(rng, y, x, rng.uniform(0, 6.3), 0.35 * R, 12, 0.9)
            _paint(img, 0.9 * cv.polyline(pts, 0.02 * h) * fundus, dark_red * 1.3)
    img *= fundus[..., None] * 0.97 + 0.03
    return _acquire(img, p, rng, size) * (fundus[..., None] > 0.02)


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
           eye: str = "left") -> np.ndarray:
    """One synthetic image as float ``[H, W, 3]`` in [0, 1]: retina ``cls`` = DR level 0-4, derm an ISIC
    class name (derm_mel too), covidfl a COVID-FL class name; ``source`` from the per-source appearance table."""
    if dataset == "retina":
        return _render_retina(int(cls), eye, source, rng, size)
    if dataset in ("derm", "derm_mel"):
        return _render_derm(str(cls), source, rng, size)
    if dataset == "covidfl":
        return _render_covidfl(str(cls), source, rng, size)
    raise ValueError(f"dataset={dataset!r}: use one of {list(DATASETS)}")


# --------------------------------------------------------------------------------------------------------------
# writer


def _allocate(n: int, mix, minimum: int = 0) -> list[int]:
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


def _save(img: np.ndarray, path: str, grey: bool = False) -> None:
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
    site_n = _allocate(n_images, [wt for _, _, wt in sites], minimum=2 * len(COVIDFL_CLASSES))
    labels: dict[str, str] = {}
    phases: dict[str, list[str]] = {"train": [], "test": []}
    train_src: list[str] = []
    i = 0
    for s, ((name, mix, _), n_site) in enumerate(zip(sites, site_n)):
        site_labels = rng.permutation(np.repeat(np.arange(3), _allocate(n_site, mix, minimum=2)))
        test = _held_out(site_labels, COVIDFL_TEST_FRACTION, seed + s)
        for j, c in enumerate(site_labels):
            image, phase = f"{name}_{j:05d}.png", "test" if j in test else "train"
            g = np.random.default_rng([seed, i, 3])
            _save(render("covidfl", COVIDFL_CLASSES[c], params[s], g, image_size), str(out / phase / image), grey=True)
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
                                                            _allocate(n_images - n_mel, benign_mix))])
    isic = rng.permutation(isic)
    mel = isic == DERM_CLASSES.index("MEL")
    test = _held_out(mel.astype(int), DERM_MEL_TEST_FRACTION, seed)
    src = rng.integers(0, len(params), size=n_images)
    labels: dict[str, str] = {}
    phases: dict[str, list[str]] = {"train": [], "test": []}
    for i, (c, s) in enumerate(zip(isic, src)):
        image, phase = f"ISIC_{i:07d}.jpg", "test" if i in test else "train"
        g = np.random.default_rng([seed, i, 4])
        _save(render("derm_mel", DERM_CLASSES[c], params[s], g, image_size), str(out / phase / image))
        labels[image] = DERM_MEL_CLASSES[int(mel[i])]
        phases[phase].append(image)
        images[f"{phase}/{image}"] = f"clinic-{s + 1}"
    write_release(out, "derm_mel", labels, phases, {})
    return {"classes": list(DERM_MEL_CLASSES), "test_fraction": DERM_MEL_TEST_FRACTION,
            "class_counts": {c: sum(v == c for v in labels.values()) for c in DERM_MEL_CLASSES}}


def write_synthetic_images(root: PathLike, dataset: str, n_images: int, seed: int = 0, image_size: int = 64,
                           n_sources: Optional[int] = None) -> dict:
    """Write a full synthetic ``dataset`` of ``n_images`` images under ``root`` in its real layout.

    Args:
        root: output folder (created; must not already hold the dataset's CSV / image folders).
        dataset: "retina", "derm", "covidfl" or "derm_mel".
        n_images: total number of images.
        seed: everything (classes, sources, pixels) is a function of the seed.
        image_size: image height in pixels (retina width 1.25x, derm/derm_mel 4/3x, covidfl square).
        n_sources: acquisition sources (retina/derm cameras, default 4; derm_mel 3 (ISIC 2017/2019/2020);
            covidfl real sites, 1-8, default 8).

    Returns:
        ``{"dataset", "root", "n_images", "classes", "class_counts", "sources": {source: n}, "images":
        {image path relative to root: source}}`` (retina ``class_counts`` are per DR level 0-4); covidfl and
        derm_mel add ``test_fraction``, covidfl ``clients`` (client -> training images of split_real).
    """
    if dataset not in DATASETS:
        raise ValueError(f"dataset={dataset!r}: use one of {list(DATASETS)}")
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
        counts = _allocate(n_images, RETINA_LEVEL_MIX, minimum=1 if n_images >= 20 else 0)
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
            _save(render("retina", int(lv), params[s], g, image_size, eye=eye), str(img_dir / f"{name}.jpeg"))
            rows.append((name, int(lv)))
            images[f"{RETINA_DIR}/{name}.jpeg"] = f"camera-{s + 1}"
        with open(csv_path, "w", newline="") as f:
            wr = csv.writer(f)
            wr.writerow(["image", "level"])
            wr.writerows(rows)
        info["classes"] = ["level_0", "level_1", "level_2", "level_3", "level_4"]
        info["class_counts"] = {f"level_{k}": int(c) for k, c in enumerate(counts)}
    elif dataset == "derm":
        csv_path, img_dir = out / DERM_CSV, out / DERM_DIR
        if csv_path.exists():
            raise ValueError(f"{csv_path} already exists; write into an empty folder")
        img_dir.mkdir(exist_ok=True)
        counts = _allocate(n_images, DERM_CLASS_MIX, minimum=2)
        labels = rng.permutation(np.repeat(np.arange(len(DERM_CLASSES)), counts))
        src = rng.integers(0, n_sources, size=n_images)
        rows = []
        for i, (c, s) in enumerate(zip(labels, src)):
            name = f"ISIC_{i:07d}"
            g = np.random.default_rng([seed, i, 2])
            _save(render("derm", DERM_CLASSES[c], params[s], g, image_size), str(img_dir / f"{name}.jpg"))
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
