"""Synthetic stand-ins for FedCLF's four dermatology sources, written in the layouts the real ones ship in, so that
:func:`fedssl.data.fedclf_devices.build_devices` runs on them exactly as on real data ("Federated Self-Supervised
Learning for Dermatological Disease Diagnosis", sec. V-A).

* ``isic2019/``: ``ISIC_2019_Training_GroundTruth.csv`` + ``ISIC_2019_Training_Input/*.jpg``, the five FedCLF classes
  at ISIC 2019's mix (NV 60 %, MEL 21 %, BCC 15 %, SCC 3 %, DF 1 %) plus a few AK / BKL / VASC images that the device
  builder must drop.  Dermoscopy: light skin, hairs, the dermoscope's dark ring, the lesion filling the view.
* ``atlasderm/``, ``dermnet/``: class-per-folder trees with human-readable category names ("Basal Cell Carcinoma",
  "melanocytic-nevi" ...) and one or two folders of other categories to skip.  Clinical photographs of brown skin:
  no dermoscope ring, a wider field of view (the lesion is smaller), oblique lighting, a colour cast, softer focus.
* ``darkderm/``: the same for dark skin, where a pigmented lesion stands out less from the skin around it.

Sizes follow the paper's proportions (AtlasDerm 618, Dermnet 276, DarkDerm 216 against ISIC's 21,587 five-class
images), each at least :data:`MIN_SOURCE_IMAGES` so that every class has images in every split.  The lesion
morphology is :func:`fedssl.data.image_synthetic.render`'s derm renderer.  ``difficulty`` (None =
:data:`DERM5_DIFFICULTY`) scales the acquisition nuisance of every source: the lesion-to-skin contrast is divided
by ``1 + difficulty`` and the sensor noise and blur grow with it.  Every image is a function of
``(seed, source, index)`` only.
"""

from __future__ import annotations

import csv
import os
from typing import Optional

import numpy as np

from fedssl.data.image_synthetic import allocate_counts, render, save_image
from fedssl.data.images import DERM_CSV, DERM_DIR, ISIC_COLUMNS

#: the calibrated default of ``difficulty`` (README "FedCLF"); chosen on random-init fine-tuning only
DERM5_DIFFICULTY = 1.0
#: ISIC 2019's five-class counts (sum 21,587) and the share of other-class images written to be dropped
ISIC_MIX = {"MEL": 4522, "NV": 12875, "BCC": 3323, "DF": 239, "SCC": 628}
ISIC_OTHER = {"AK": 0.4, "BKL": 0.4, "VASC": 0.2}
OTHER_FRACTION = 0.03
#: the other sources' five-class sizes relative to ISIC's (paper: 618 / 276 / 216 against 21,587)
SOURCE_RATIO = {"atlasderm": 618 / 21587, "dermnet": 276 / 21587, "darkderm": 216 / 21587}
MIN_SOURCE_IMAGES = 30
#: class mixes of the clinical sets (not published; carcinomas are common in clinical atlases, nevi less so)
CLINICAL_MIX = {"BCC": 0.28, "DF": 0.10, "MEL": 0.22, "NV": 0.22, "SCC": 0.18}
#: category folder names per source: FedCLF class -> folder; plus folders of other categories to be skipped
FOLDERS = {
    "atlasderm": {"BCC": "Basal Cell Carcinoma", "DF": "Dermatofibroma", "MEL": "Malignant Melanoma",
                  "NV": "Melanocytic Nevi", "SCC": "Squamous Cell Carcinoma"},
    "dermnet": {"BCC": "basal-cell-carcinoma", "DF": "dermatofibroma", "MEL": "melanoma", "NV": "nevus",
                "SCC": "squamous_cell_carcinoma"},
    "darkderm": {"BCC": "BCC", "DF": "DF", "MEL": "MEL", "NV": "NV", "SCC": "SCC"},
}
OTHER_FOLDERS = {"atlasderm": {"Psoriasis": "AK", "Seborrheic Keratosis": "BKL"}, "dermnet": {"rosacea": "VASC"},
                 "darkderm": {}}
#: acquisition per source: skin tone, hair, dermoscope ring, field of view (lesion scale), lighting gradient,
#: white balance, gamma, contrast, noise, blur
ACQUISITION = {
    "isic2019": dict(tone=(0.0, 0.3), hair=0.6, vignette=True, zoom=(1.0, 1.0), light=0.05,
                     gains=((0.95, 1.05), (0.92, 1.02), (0.9, 1.05)), gamma=1.0, contrast=1.0, noise=0.015, blur=0.2),
    "atlasderm": dict(tone=(0.5, 0.8), hair=0.1, vignette=False, zoom=(0.55, 0.75), light=0.35,
                      gains=((1.0, 1.12), (0.9, 1.0), (0.8, 0.92)), gamma=1.1, contrast=0.9, noise=0.03, blur=0.6),
    "dermnet": dict(tone=(0.55, 0.85), hair=0.1, vignette=False, zoom=(0.5, 0.7), light=0.4,
                    gains=((0.92, 1.02), (0.95, 1.05), (1.0, 1.12)), gamma=1.15, contrast=0.9, noise=0.035, blur=0.7),
    "darkderm": dict(tone=(0.95, 1.0), hair=0.05, vignette=False, zoom=(0.55, 0.75), light=0.3,
                     gains=((0.9, 1.0), (0.85, 0.95), (0.8, 0.9)), gamma=1.5, contrast=0.7, noise=0.035, blur=0.6),
}
SOURCES = tuple(ACQUISITION)


def check_difficulty(difficulty: Optional[float]) -> float:
    if difficulty is None:
        return DERM5_DIFFICULTY
    if isinstance(difficulty, bool) or not isinstance(difficulty, (int, float)) or not 0 <= difficulty <= 10:
        raise ValueError(f"difficulty={difficulty!r}: use a number in [0, 10] (None = the calibrated "
                         f"{DERM5_DIFFICULTY})")
    return float(difficulty)


def source_params(source: str, g: np.random.Generator, difficulty: float) -> dict:
    """One image's acquisition parameters (the renderer's keys) for ``source``."""
    a = ACQUISITION[source]
    return {"tone": float(g.uniform(*a["tone"])), "hair": a["hair"], "vignette": a["vignette"],
            "gains": np.array([g.uniform(*r) for r in a["gains"]], np.float32),
            "brightness": float(g.uniform(0.9, 1.1)),
            "gamma": a["gamma"], "contrast": a["contrast"] / (1.0 + difficulty),
            "noise": a["noise"] * (1.0 + difficulty), "blur": a["blur"] * (1.0 + 0.5 * difficulty)}


def _zoom_out(img: np.ndarray, zoom: float, noise: float, g: np.random.Generator) -> np.ndarray:
    """A wider field of view: the image shrunk by ``zoom`` and placed on skin of its border colour, with the
    sensor ``noise`` of the image so that the pasted view does not show as a patch."""
    from PIL import Image

    h, w = img.shape[:2]
    small = np.asarray(Image.fromarray((img * 255).astype(np.uint8)).resize(
        (max(1, round(w * zoom)), max(1, round(h * zoom))), Image.BILINEAR), np.float32) / 255.0
    border = np.concatenate([img[0], img[-1], img[:, 0], img[:, -1]])
    canvas = np.empty_like(img)
    canvas[:] = np.median(border, axis=0)
    top, left = int(g.integers(0, h - small.shape[0] + 1)), int(g.integers(0, w - small.shape[1] + 1))
    canvas[top:top + small.shape[0], left:left + small.shape[1]] = small
    return np.clip(canvas + noise * g.standard_normal((h, w, 3)).astype(np.float32), 0.0, 1.0)


def _lighting(img: np.ndarray, strength: float, g: np.random.Generator) -> np.ndarray:
    """Oblique lighting: a linear brightness ramp of +-``strength`` in a random direction."""
    h, w = img.shape[:2]
    angle = g.uniform(0, 2 * np.pi)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    ramp = ((xx / w - 0.5) * np.cos(angle) + (yy / h - 0.5) * np.sin(angle)) * 2 * strength
    return np.clip(img * (1.0 + ramp[..., None]), 0.0, 1.0)


def render_source_image(source: str, cls: str, seed: int, index: int, size: int, difficulty: float) -> np.ndarray:
    """One image of ``source`` and lesion class ``cls`` (an ISIC class name), float ``[H, W, 3]`` in [0, 1]."""
    g = np.random.default_rng([seed, SOURCES.index(source), index])
    p = source_params(source, g, difficulty)
    img = render("derm", cls, p, g, size)
    zoom = g.uniform(*ACQUISITION[source]["zoom"])
    if zoom < 1.0:
        img = _zoom_out(img, zoom, p["noise"], g)
    return _lighting(img, ACQUISITION[source]["light"], g)


def source_sizes(n_isic: int) -> dict[str, int]:
    """Five-class images per source for ``n_isic`` ISIC five-class images (the paper's proportions, floored)."""
    return {"isic2019": n_isic, **{s: max(MIN_SOURCE_IMAGES, round(n_isic * r)) for s, r in SOURCE_RATIO.items()}}


def _class_list(mix: dict, n: int, g: np.random.Generator, minimum: int) -> list[str]:
    counts = allocate_counts(n, list(mix.values()), minimum=minimum)
    return [str(c) for c in g.permutation(np.repeat(list(mix), counts))]


def _write_isic(out: str, n: int, seed: int, size: int, difficulty: float) -> dict:
    root = os.path.join(out, "isic2019")
    os.makedirs(os.path.join(root, DERM_DIR))
    g = np.random.default_rng([seed, 11])
    classes = _class_list(ISIC_MIX, n, g, minimum=3) + _class_list(ISIC_OTHER, max(3, round(OTHER_FRACTION * n)), g, 1)
    rows = []
    for i, cls in enumerate(classes):
        name = f"ISIC_{i:07d}"
        save_image(render_source_image("isic2019", cls, seed, i, size, difficulty),
                   os.path.join(root, DERM_DIR, f"{name}.jpg"))
        rows.append([name] + ["1.0" if c == cls else "0.0" for c in ISIC_COLUMNS])
    with open(os.path.join(root, DERM_CSV), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["image", *ISIC_COLUMNS])
        w.writerows(rows)
    return {"root": root, "class_counts": {c: classes.count(c) for c in dict.fromkeys(classes)}}


def _write_tree(out: str, source: str, n: int, seed: int, size: int, difficulty: float) -> dict:
    root = os.path.join(out, source)
    g = np.random.default_rng([seed, 12, SOURCES.index(source)])
    images = [(FOLDERS[source][c], c) for c in _class_list(CLINICAL_MIX, n, g, minimum=3)]
    images += [(folder, cls) for folder, cls in OTHER_FOLDERS[source].items() for _ in range(3)]  # to be skipped
    counts: dict[str, int] = {}
    for i, (folder, cls) in enumerate(images):
        os.makedirs(os.path.join(root, folder), exist_ok=True)
        save_image(render_source_image(source, cls, seed, 100_000 + i, size, difficulty),
                   os.path.join(root, folder, f"{source}_{i:05d}.jpg"))
        counts[folder] = counts.get(folder, 0) + 1
    return {"root": root, "class_counts": counts}


def write_synthetic_derm_sources(out: str, n_isic: int = 2000, seed: int = 0, image_size: int = 80,
                                 difficulty: Optional[float] = None) -> dict:
    """Write the four sources under ``out`` (``isic2019``, ``atlasderm``, ``dermnet``, ``darkderm``); returns per
    source its root and image counts per class / category folder, and the settings.  ``image_size`` is the
    image height (width 4/3 of it); the device builder resizes to 72 px on the shorter edge."""
    difficulty = check_difficulty(difficulty)
    if isinstance(n_isic, bool) or not isinstance(n_isic, int) or n_isic < 15:
        raise ValueError(f"n_isic={n_isic!r}: use at least 15 ISIC images (3 per class)")
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 16:
        raise ValueError(f"image_size={image_size!r}: use an image height >= 16 px")
    if any(os.path.exists(os.path.join(out, s)) for s in SOURCES):
        raise ValueError(f"{out} already holds synthetic sources; write into an empty folder")
    sizes = source_sizes(n_isic)
    info = {"settings": {"n_isic": n_isic, "seed": seed, "image_size": image_size, "difficulty": difficulty},
            "isic2019": _write_isic(out, n_isic, seed, image_size, difficulty)}
    for source in SOURCES[1:]:
        info[source] = _write_tree(out, source, sizes[source], seed, image_size, difficulty)
    return info
