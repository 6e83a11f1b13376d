"""Synthetic chest X-rays in the real NIH ChestX-ray14, CheXpert and MIMIC-CXR-JPG layouts.

No real CXR data can be downloaded here, so these writers produce small data sets that the loaders of
:mod:`fedssl.data.cxr` read exactly like the real ones, with the structure surgical aggregation exploits:

- every finding of the 20-class union leaves its own visible, learnable mark (a class-specific shape or
  texture at a class-specific place: a bright disk in a lung field for Mass, a fluid level at a lung base
  for Pleural Effusion, a widened heart for Cardiomegaly, a tube line for Support Devices ...), several
  findings per image;
- a source only *labels* its own classes (NIH 14, CheXpert 13), but its images also show, unlabelled, the
  findings it does not annotate (``unlabelled_prevalence``), as real NIH images show support devices:
  treating a missing class as negative (vanilla FL) is then wrong, as in the paper;
- per-source appearance (gamma, brightness, noise, blur, aspect ratio) makes the sites non-IID;
- patients have several images (NIH follow-ups, CheXpert/MIMIC studies with frontal and lateral views),
  and a patient's anatomy is the same in all of them, so patient-level splitting matters.

CSV quirks of the real files are reproduced: NIH ``variant="2017"`` (trailing commas, unquoted bracketed
headers spanning two columns, ``058Y`` ages) and ``"2020"``; CheXpert ``-1`` / blank labels, lateral views
and the ``CheXpert-v1.0-small/`` path prefix; MIMIC's three CSVs and ``files/pXX/pNNNNNNNN/sNNNNNNNN/`` tree.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
from PIL import Image

from fedssl.data.cxr import ALL_CLASSES, CHEXPERT_CLASSES, NIH_CLASSES, NIH_RAW_CLASSES, write_nih_partition

__all__ = [
    "SOURCES",
    "DEVICES",
    "render_cxr",
    "write_synthetic_nih",
    "write_synthetic_chexpert",
    "write_synthetic_mimic_cxr",
    "write_synthetic_surgical",
    "write_synthetic_ablation",
]

#: Per-source appearance: gamma, brightness offset, contrast, noise sigma, blur passes, width/height ratio.
SOURCES: dict[str, dict[str, float]] = {
    "nih": {"gamma": 1.0, "offset": 0.0, "contrast": 1.0, "noise": 0.03, "blur": 0, "aspect": 1.0},
    "chexpert": {"gamma": 0.8, "offset": 0.05, "contrast": 0.9, "noise": 0.05, "blur": 0, "aspect": 0.85},
    "mimic": {"gamma": 1.25, "offset": -0.03, "contrast": 1.1, "noise": 0.04, "blur": 1, "aspect": 1.0},
}


#: Lines, tubes and a pacemaker as MIMIC-CXR's ICU studies show them, with or without any finding: each a set of
#: bright segments (x0, y0, x1, y1, half-width; image fractions, the patient's right on the image's left) at its
#: usual place: an endotracheal tube in the trachea, an enteric tube down past the diaphragm, a right internal
#: jugular line to the superior vena cava, a left chest-wall pacemaker with two leads into the heart.
DEVICES: dict[str, tuple[tuple[float, float, float, float, float], ...]] = {
    "endotracheal tube": ((0.5, 0.0, 0.5, 0.27, 0.016),),
    "enteric tube": ((0.47, 0.0, 0.47, 0.5, 0.012), (0.47, 0.5, 0.6, 0.86, 0.012)),
    "right jugular line": ((0.36, 0.02, 0.44, 0.2, 0.012), (0.44, 0.2, 0.46, 0.38, 0.012)),
    "pacemaker": ((0.7, 0.13, 0.8, 0.13, 0.035), (0.72, 0.15, 0.55, 0.55, 0.01), (0.72, 0.15, 0.5, 0.68, 0.01)),
}


# ----------------------------------------------------------------------------------------------- rendering
class _Canvas:
    def __init__(self, h: int, w: int):
        self.img = np.zeros((h, w), dtype=np.float32)
        ys, xs = np.mgrid[0:h, 0:w].astype(np.float32)
        self.y, self.x = (ys + 0.5) / h, (xs + 0.5) / w
        self.h, self.w = h, w

    def ellipse(self, cx, cy, rx, ry) -> np.ndarray:
        return ((self.x - cx) / rx) ** 2 + ((self.y - cy) / ry) ** 2 <= 1.0

    def radius(self, cx, cy, rx, ry) -> np.ndarray:
        return np.sqrt(((self.x - cx) / rx) ** 2 + ((self.y - cy) / ry) ** 2)

    def gauss(self, cx, cy, sigma) -> np.ndarray:
        return np.exp(-(((self.x - cx) ** 2 + (self.y - cy) ** 2) / (2 * sigma**2))).astype(np.float32)

    def line(self, x0, y0, x1, y1, width) -> np.ndarray:
        """Pixels within ``width`` (image fraction, at least ~0.7 pixel) of the segment."""
        px, py = self.x - x0, self.y - y0
        dx, dy = x1 - x0, y1 - y0
        t = np.clip((px * dx + py * dy) / max(dx * dx + dy * dy, 1e-9), 0, 1)
        d = np.sqrt((px - t * dx) ** 2 + (py - t * dy) ** 2)
        return d <= max(width, 0.7 / min(self.h, self.w))


def _anatomy(rng: np.random.Generator) -> dict:
    """A patient's anatomy (kept across the patient's images)."""
    j = lambda s: float(rng.normal(0, s))  # noqa: E731
    return {
        "lung_dx": 0.18 + j(0.01), "lung_cy": 0.45 + j(0.015), "lung_rx": 0.13 + j(0.008),
        "lung_ry": 0.25 + j(0.012), "heart_rx": 0.11 + j(0.006), "heart_ry": 0.09 + j(0.005),
        "torso": 0.45 + j(0.03), "lung": 0.18 + j(0.02),
    }


def _lung(an: dict, side: int) -> tuple[float, float, float, float]:
    return 0.5 + side * an["lung_dx"], an["lung_cy"], an["lung_rx"], an["lung_ry"]


def render_cxr(findings: Sequence[str], rng: np.random.Generator, size: int = 64, source: str = "nih",
               anatomy: dict | None = None, frontal: bool = True, devices: Sequence[str] = ()) -> np.ndarray:
    """A uint8 grayscale frontal (or lateral) CXR ``[size, round(size * aspect)]`` showing ``findings``, and on a
    frontal view the named ``devices`` (:data:`DEVICES`: each at its usual place, drawn without a draw from ``rng``,
    so an image without devices is the same as before they existed)."""
    if source not in SOURCES:
        raise ValueError(f"source={source!r}: use one of {sorted(SOURCES)}")
    unknown = [f for f in findings if f not in ALL_CLASSES]
    if unknown:
        raise ValueError(f"findings {unknown} are not classes of {list(ALL_CLASSES)}")
    unknown = [d for d in devices if d not in DEVICES]
    if unknown:
        raise ValueError(f"devices {unknown} are not among {list(DEVICES)}")
    app = SOURCES[source]
    an = anatomy if anatomy is not None else _anatomy(rng)
    h, w = size, max(8, int(round(size * app["aspect"])))
    cv = _Canvas(h, w)
    img = cv.img
    img += 0.05
    img[cv.ellipse(0.5, 0.55, 0.42, 0.47)] = an["torso"]
    if not frontal:  # lateral: a side silhouette, one lung shadow, spine at the back
        img[cv.ellipse(0.5, 0.5, 0.28, 0.38)] = an["lung"] + 0.05
        img[(cv.x > 0.72) & (cv.x < 0.8) & (cv.y > 0.1)] = 0.65
        return _finish(img, rng, app)
    f = set(findings)
    ry_scale = 1.2 if "Emphysema" in f else 1.0
    lung_val = an["lung"] - (0.1 if "Emphysema" in f else 0.0)
    lungs = {}
    for side in (-1, 1):
        cx, cy, rx, ry = _lung(an, side)
        lungs[side] = cv.ellipse(cx, cy + (ry_scale - 1) * ry * 0.5, rx, ry * ry_scale)
        img[lungs[side]] = lung_val
    # mediastinum, spine, heart
    med_half = 0.12 if "Enlarged Cardiomediastinum" in f else 0.055
    img[(np.abs(cv.x - 0.5) < med_half) & (cv.y > 0.14) & (cv.y < 0.52)] = 0.55
    img[(np.abs(cv.x - 0.5) < 0.03) & (cv.y > 0.08)] = 0.62
    hs = (1.8, 1.3) if "Cardiomegaly" in f else (1.0, 1.0)
    img[cv.ellipse(0.54, 0.63, an["heart_rx"] * hs[0], an["heart_ry"] * hs[1])] = 0.58
    # findings, each its own mark; the side (lung) is drawn at random
    for name in ALL_CLASSES:
        if name in f and name in _MARKS:
            _MARKS[name](cv, img, an, lungs, rng)
    for name in DEVICES:
        if name in devices:
            for x0, y0, x1, y1, width in DEVICES[name]:
                img[cv.line(x0, y0, x1, y1, width)] = 1.0
    return _finish(img, rng, app)


def _finish(img: np.ndarray, rng: np.random.Generator, app: dict) -> np.ndarray:
    img = img + rng.normal(0, app["noise"], img.shape).astype(np.float32)
    for _ in range(int(app["blur"])):
        p = np.pad(img, 1, mode="edge")
        img = (p[:-2, 1:-1] + p[2:, 1:-1] + p[1:-1, :-2] + p[1:-1, 2:] + 2 * p[1:-1, 1:-1]) / 6.0
    img = np.clip(img, 0, 1) ** app["gamma"]
    img = np.clip((img - 0.5) * app["contrast"] + 0.5 + app["offset"], 0, 1)
    return (img * 255 + 0.5).astype(np.uint8)


def _side(rng) -> int:
    return int(rng.choice([-1, 1]))


def _point_in_lung(an, side, rng, ylo=-0.6, yhi=0.6) -> tuple[float, float]:
    cx, cy, rx, ry = _lung(an, side)
    return cx + float(rng.uniform(-0.45, 0.45)) * rx, cy + float(rng.uniform(ylo, yhi)) * ry


def _atelectasis(cv, img, an, lungs, rng):
    s = _side(rng)
    cx, cy, rx, ry = _lung(an, s)
    y = cy + float(rng.uniform(0.0, 0.3)) * ry
    img[cv.line(cx - 0.8 * rx, y - 0.02, cx + 0.8 * rx, y + 0.02, 0.025) & lungs[s]] += 0.5


def _effusion(cv, img, an, lungs, rng):
    s = _side(rng)
    cx, cy, rx, ry = _lung(an, s)
    level = cy + float(rng.uniform(0.35, 0.5)) * ry
    img[lungs[s] & (cv.y > level - 0.04 * (cv.x - cx) * s)] = 0.68


def _infiltration(cv, img, an, lungs, rng):
    s = _side(rng)
    cx, cy, rx, ry = _lung(an, s)
    region = lungs[s] & (cv.y < cy + 0.3 * ry)
    img[region & (rng.random(img.shape) < 0.4)] += 0.45


def _mass(cv, img, an, lungs, rng):
    s = _side(rng)
    x, y = _point_in_lung(an, s, rng, -0.4, 0.3)
    img[cv.ellipse(x, y, 0.075, 0.075)] = 0.8


def _nodule(cv, img, an, lungs, rng):
    for _ in range(2):
        s = _side(rng)
        x, y = _point_in_lung(an, s, rng)
        img[cv.ellipse(x, y, 0.042, 0.042)] = 0.85


def _pneumonia(cv, img, an, lungs, rng):
    s = _side(rng)
    x, y = _point_in_lung(an, s, rng, 0.1, 0.5)
    img += 0.6 * cv.gauss(x, y, 0.065) * lungs[s]


def _pneumothorax(cv, img, an, lungs, rng):
    s = _side(rng)
    cx, cy, rx, ry = _lung(an, s)
    r = cv.radius(cx, cy, rx, ry)
    crescent = lungs[s] & (r > 0.5) & ((cv.x - cx) * s > 0) & (cv.y < cy + 0.2 * ry)
    img[crescent] = 0.0
    img[lungs[s] & (np.abs(r - 0.5) < 0.1) & ((cv.x - cx) * s > 0) & (cv.y < cy + 0.2 * ry)] = 0.75


def _consolidation(cv, img, an, lungs, rng):
    s = _side(rng)
    x, y = _point_in_lung(an, s, rng, 0.0, 0.45)
    img[(np.abs(cv.x - x) < 0.08) & (np.abs(cv.y - y) < 0.08)] = 0.7


def _edema(cv, img, an, lungs, rng):
    both = lungs[-1] | lungs[1]
    img += 0.3 * (cv.gauss(0.5 - an["lung_dx"] * 0.55, an["lung_cy"], 0.07) +
                  cv.gauss(0.5 + an["lung_dx"] * 0.55, an["lung_cy"], 0.07)) * both


def _fibrosis(cv, img, an, lungs, rng):
    s = _side(rng)
    cx, cy, rx, ry = _lung(an, s)
    step = max(3, cv.h // 16)
    grid = ((np.round(cv.y * cv.h).astype(int) % step == 0) | (np.round(cv.x * cv.w).astype(int) % step == 0))
    img[grid & lungs[s] & (cv.y < cy)] += 0.35


def _pleural_thickening(cv, img, an, lungs, rng):
    s = _side(rng)
    cx, cy, rx, ry = _lung(an, s)
    r = cv.radius(cx, cy, rx, ry)
    img[lungs[s] & (r > 0.7) & ((cv.x - cx) * s > 0.3 * rx)] = 0.75


def _hernia(cv, img, an, lungs, rng):
    x = 0.5 + float(rng.uniform(-0.03, 0.03))
    r = cv.radius(x, 0.8, 0.065, 0.065)
    img[r <= 1.0] = 0.08
    img[(r > 0.7) & (r <= 1.0)] = 0.85


def _lung_opacity(cv, img, an, lungs, rng):
    img[lungs[_side(rng)]] += 0.22


def _lung_lesion(cv, img, an, lungs, rng):
    s = _side(rng)
    x, y = _point_in_lung(an, s, rng, -0.5, 0.2)
    r = cv.radius(x, y, 0.09, 0.09)
    img[(r > 0.5) & (r <= 1.0)] = 0.8


def _pleural_other(cv, img, an, lungs, rng):
    s = _side(rng)
    cx, cy, rx, ry = _lung(an, s)
    img[lungs[s] & (cv.y < cy - 0.7 * ry)] = 0.75


def _fracture(cv, img, an, lungs, rng):
    s = _side(rng)
    x = 0.5 + s * 0.38
    y0 = float(rng.uniform(0.25, 0.45))
    pts = [(x + s * 0.02 * (i % 2), y0 + 0.04 * i) for i in range(5)]
    for (a, b), (c, d) in zip(pts[:-1], pts[1:]):
        img[cv.line(a, b, c, d, 0.035)] = 0.95  # >= 2 px at 64 px: survives the augmentation's resampling


def _support_devices(cv, img, an, lungs, rng):
    img[cv.line(0.5, 0.0, 0.5 + float(rng.uniform(-0.03, 0.03)), 0.6, 0.02)] = 1.0  # a tube, >= 1 px after blur
    x = 0.5 + _side(rng) * 0.27
    img[(np.abs(cv.x - x) < 0.04) & (np.abs(cv.y - 0.18) < 0.03)] = 1.0


_MARKS: dict[str, Callable] = {
    "Atelectasis": _atelectasis, "Pleural Effusion": _effusion, "Infiltration": _infiltration, "Mass": _mass,
    "Nodule": _nodule, "Pneumonia": _pneumonia, "Pneumothorax": _pneumothorax, "Consolidation": _consolidation,
    "Edema": _edema, "Fibrosis": _fibrosis, "Pleural Thickening": _pleural_thickening, "Hernia": _hernia,
    "Lung Opacity": _lung_opacity, "Lung Lesion": _lung_lesion, "Pleural Other": _pleural_other,
    "Fracture": _fracture, "Support Devices": _support_devices,
    # Cardiomegaly, Emphysema, Enlarged Cardiomediastinum change the anatomy itself (render_cxr)
}


# ----------------------------------------------------------------------------------------------- sampling
def _check(n_patients: int, image_size: int, prevalence: float, unlabelled: float) -> None:
    if not isinstance(n_patients, int) or n_patients < 1:
        raise ValueError(f"n_patients={n_patients!r}: use a positive int")
    if not isinstance(image_size, int) or image_size < 16:
        raise ValueError(f"image_size={image_size!r}: use an int >= 16")
    for name, v in (("prevalence", prevalence), ("unlabelled_prevalence", unlabelled)):
        if not 0.0 <= float(v) <= 1.0:
            raise ValueError(f"{name}={v!r}: use a probability in [0, 1]")


def _draw_findings(rng, labelled: Sequence[str], prevalence: float, unlabelled: float) -> tuple[list[str], list[str]]:
    """(labelled positives, every finding shown): labelled classes at ``prevalence``, others unlabelled."""
    pos = [c for c in labelled if rng.random() < prevalence]
    extra = [c for c in ALL_CLASSES if c not in labelled and rng.random() < unlabelled]
    return pos, pos + extra


def _save(img: np.ndarray, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".png":
        Image.fromarray(img).save(path)
    else:
        Image.fromarray(img).save(path, quality=95)


def _summary(root: Path, csv_path: Path, n_images: int, n_patients: int, positives: dict) -> dict:
    return {"root": str(root), "csv": str(csv_path), "n_images": n_images, "n_patients": n_patients,
            "positives": dict(positives)}


# --------------------------------------------------------------------------------------------------- NIH
def write_synthetic_nih(root: str | os.PathLike, n_patients: int = 40, seed: int = 0, image_size: int = 64,
                        variant: str = "2020", prevalence: float = 0.2, unlabelled_prevalence: float = 0.1,
                        max_images_per_patient: int = 3, image_dirs: int = 1) -> dict:
    """NIH ChestX-ray14 layout: ``Data_Entry_2017_v2020.csv`` (``variant="2020"``) or ``Data_Entry_2017.csv``
    (``"2017"``: trailing commas, ``058Y`` ages) + ``images/`` (``image_dirs > 1``: ``images_00N/images/``)."""
    if variant not in ("2020", "2017"):
        raise ValueError(f"variant={variant!r}: use '2020' (Data_Entry_2017_v2020.csv) or '2017'")
    _check(n_patients, image_size, prevalence, unlabelled_prevalence)
    rp = Path(root)
    rp.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([seed, 1])
    raw = dict(zip(NIH_CLASSES, NIH_RAW_CLASSES))
    header = ("Image Index,Finding Labels,Follow-up #,Patient ID,Patient Age,Patient Gender,View Position,"
              "OriginalImage[Width,Height],OriginalImagePixelSpacing[x,y]")
    trail = "," if variant == "2017" else ""
    lines = [header + trail]
    positives = {c: 0 for c in NIH_CLASSES}
    n_img = 0
    for pid in range(1, n_patients + 1):
        an = _anatomy(rng)
        age, sex = int(rng.integers(18, 90)), str(rng.choice(["M", "F"]))
        for fu in range(int(rng.integers(1, max_images_per_patient + 1))):
            pos, shown = _draw_findings(rng, NIH_CLASSES, prevalence, unlabelled_prevalence)
            name = f"{pid:08d}_{fu:03d}.png"
            folder = rp / (f"images_{n_img % image_dirs + 1:03d}/images" if image_dirs > 1 else "images")
            _save(render_cxr(shown, rng, image_size, "nih", an), folder / name)
            labels = "|".join(raw[c] for c in NIH_CLASSES if c in pos) or "No Finding"
            age_s = f"{age:03d}Y" if variant == "2017" else str(age)
            lines.append(f"{name},{labels},{fu},{pid},{age_s},{sex},{rng.choice(['PA', 'AP'])},"
                         f"{image_size},{image_size},0.143,0.143{trail}")
            for c in pos:
                positives[c] += 1
            n_img += 1
    csv_path = rp / ("Data_Entry_2017_v2020.csv" if variant == "2020" else "Data_Entry_2017.csv")
    csv_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return _summary(rp, csv_path, n_img, n_patients, positives)


# ---------------------------------------------------------------------------------------------- CheXpert
CHEXPERT_COLUMNS = ("Path", "Sex", "Age", "Frontal/Lateral", "AP/PA", "No Finding") + CHEXPERT_CLASSES


def _negative_value(rng) -> str:
    """Negatives as the real files write them: blank (not mentioned), 0.0, or -1.0 (uncertain)."""
    return str(rng.choice(["", "0.0", "-1.0"], p=[0.6, 0.3, 0.1]))


def write_synthetic_chexpert(root: str | os.PathLike, n_patients: int = 40, seed: int = 0, image_size: int = 64,
                             prevalence: float = 0.2, unlabelled_prevalence: float = 0.1, max_studies: int = 2,
                             lateral_fraction: float = 0.3, n_valid_patients: int = 0,
                             prefix: str = "CheXpert-v1.0-small") -> dict:
    """CheXpert layout under ``root``: ``train.csv`` / ``valid.csv`` whose ``Path`` starts with ``prefix``
    (resolved by the loader against ``root``) and ``train/patientNNNNN/studyK/viewV_{frontal,lateral}.jpg``.
    The summary's ``n_images`` / ``positives`` count the frontal images of ``train.csv``."""
    _check(n_patients, image_size, prevalence, unlabelled_prevalence)
    rp = Path(root)
    rp.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([seed, 2])
    positives = {c: 0 for c in CHEXPERT_CLASSES}
    n_img = 0
    for split, pids in (("train", range(1, n_patients + 1)),
                        ("valid", range(n_patients + 1, n_patients + 1 + n_valid_patients))):
        rows = []
        for pid in pids:
            an = _anatomy(rng)
            sex, age = str(rng.choice(["Male", "Female"])), int(rng.integers(18, 90))
            for st in range(1, int(rng.integers(1, max_studies + 1)) + 1):
                pos, shown = _draw_findings(rng, CHEXPERT_CLASSES, prevalence, unlabelled_prevalence)
                views = ["frontal"] + (["lateral"] if rng.random() < lateral_fraction else [])
                vals = ["1.0" if c in pos else _negative_value(rng) for c in CHEXPERT_CLASSES]  # per study
                for v, view in enumerate(views, start=1):
                    rel = f"{split}/patient{pid:05d}/study{st}/view{v}_{view}.jpg"
                    _save(render_cxr(shown, rng, image_size, "chexpert", an, frontal=view == "frontal"), rp / rel)
                    rows.append([f"{prefix}/{rel}", sex, str(age), view.capitalize(),
                                 str(rng.choice(["AP", "PA"])) if view == "frontal" else "",
                                 "" if pos else "1.0"] + vals)
                    if view == "frontal" and split == "train":
                        n_img += 1
                        for c in pos:
                            positives[c] += 1
        with open(rp / f"{split}.csv", "w", newline="", encoding="utf-8") as fh:
            w = csv.writer(fh)
            w.writerow(CHEXPERT_COLUMNS)
            w.writerows(rows)
    return _summary(rp, rp / "train.csv", n_img, n_patients, positives)


# ------------------------------------------------------------------------------------------------- MIMIC
def write_synthetic_mimic_cxr(root: str | os.PathLike, n_patients: int = 40, seed: int = 0, image_size: int = 64,
                              prevalence: float = 0.2, max_studies: int = 2, lateral_fraction: float = 0.3,
                              split_fractions: Sequence[float] = (0.7, 0.1, 0.2), expanded_labels: bool = True) -> dict:
    """MIMIC-CXR-JPG layout: the three ``mimic-cxr-2.0.0-*.csv`` files and ``files/pXX/pNNNNNNNN/sNNNNNNNN/``.

    Labels are per study (``subject_id, study_id``).  With ``expanded_labels`` the label file also carries the
    seven NIH-only columns (as the CXR-LT expanded labels the paper uses), so all 20 classes are annotated and
    images show only labelled findings; without, it has CheXpert's 14 columns and NIH-only findings appear
    unlabelled at ``prevalence / 2``.
    """
    _check(n_patients, image_size, prevalence, 0.0)
    fr = np.asarray(split_fractions, dtype=float)
    if fr.shape != (3,) or np.any(fr < 0) or abs(fr.sum() - 1) > 1e-6:
        raise ValueError(f"split_fractions={list(split_fractions)!r}: three fractions (train, validate, test) summing "
                         "to 1")
    rp = Path(root)
    rp.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([seed, 3])
    labelled = list(CHEXPERT_CLASSES) + ([c for c in NIH_CLASSES if c not in CHEXPERT_CLASSES] if expanded_labels
                                         else [])
    label_cols = ["No Finding"] + labelled
    lab_rows, split_rows, meta_rows = [], [], []
    positives = {c: 0 for c in labelled}
    n_img = 0
    for i in range(n_patients):
        subject = 10000000 + int(rng.integers(0, 10**7 - 1)) // n_patients * n_patients + i  # unique, 8 digits
        split = str(rng.choice(["train", "validate", "test"], p=fr))
        an = _anatomy(rng)
        for _ in range(int(rng.integers(1, max_studies + 1))):
            study = 50000000 + int(rng.integers(0, 10**7))
            pos, shown = _draw_findings(rng, labelled, prevalence, 0.0 if expanded_labels else prevalence / 2)
            lab_rows.append([str(subject), str(study), "" if pos else "1.0"] +
                            ["1.0" if c in pos else _negative_value(rng) for c in labelled])
            views = ["PA" if rng.random() < 0.6 else "AP"] + (["LATERAL"] if rng.random() < lateral_fraction else [])
            for view in views:
                dicom = "-".join(f"{int(rng.integers(0, 2**32)):08x}" for _ in range(5))
                path = rp / "files" / f"p{str(subject)[:2]}" / f"p{subject}" / f"s{study}" / f"{dicom}.jpg"
                _save(render_cxr(shown, rng, image_size, "mimic", an, frontal=view != "LATERAL"), path)
                split_rows.append([dicom, str(study), str(subject), split])
                meta_rows.append([dicom, str(subject), str(study), "CHEST (PA AND LAT)", view, str(image_size),
                                  str(image_size), "21800506", "213014.531", "",
                                  "postero-anterior" if view == "PA" else view.lower(), "Erect"])
                if view != "LATERAL":
                    n_img += 1
                    for c in pos:
                        positives[c] += 1

    def write(name, header, rows):
        with open(rp / name, "w", newline="", encoding="utf-8") as fh:
            w = csv.writer(fh)
            w.writerow(header)
            w.writerows(rows)

    write("mimic-cxr-2.0.0-chexpert.csv", ["subject_id", "study_id"] + label_cols, lab_rows)
    write("mimic-cxr-2.0.0-split.csv", ["dicom_id", "study_id", "subject_id", "split"], split_rows)
    write("mimic-cxr-2.0.0-metadata.csv",
          ["dicom_id", "subject_id", "study_id", "PerformedProcedureStepDescription", "ViewPosition", "Rows",
           "Columns", "StudyDate", "StudyTime", "ProcedureCodeSequence_CodeMeaning", "ViewCodeSequence_CodeMeaning",
           "PatientOrientationCodeSequence_CodeMeaning"], meta_rows)
    return _summary(rp, rp / "mimic-cxr-2.0.0-chexpert.csv", n_img, n_patients, positives)


def write_synthetic_surgical(out: str | os.PathLike, n_patients: int = 200, seed: int = 0, image_size: int = 32,
                             n_external_patients: int | None = None, nih_variant: str = "2020",
                             prevalence: float = 0.2, unlabelled_prevalence: float = 0.1) -> dict:
    """The paper's class-heterogeneous setting on synthetic data, one folder per FLARE site::

        out/site-1/   NIH ChestX-ray14 layout (14 classes)
        out/site-2/   CheXpert layout (13 classes, 7 shared with NIH)
        out/mimic/    MIMIC-CXR-JPG layout, all 20 classes annotated (external test set; load with split="all")

    The three writers draw from seeds ``seed``, ``seed + 1`` and ``seed + 2``.
    Returns ``{"site-1": summary, "site-2": summary, "mimic": summary}`` (the writers' summaries).
    """
    o = Path(out)
    n_ext = n_patients // 2 if n_external_patients is None else n_external_patients
    return {
        "site-1": write_synthetic_nih(o / "site-1", n_patients, seed=seed, image_size=image_size, variant=nih_variant,
                                      prevalence=prevalence, unlabelled_prevalence=unlabelled_prevalence),
        "site-2": write_synthetic_chexpert(o / "site-2", n_patients, seed=seed + 1, image_size=image_size,
                                           prevalence=prevalence, unlabelled_prevalence=unlabelled_prevalence),
        "mimic": write_synthetic_mimic_cxr(o / "mimic", max(1, n_ext), seed=seed + 2, image_size=image_size,
                                           prevalence=prevalence),
    }


def write_synthetic_ablation(out: str | os.PathLike, n_clients: int, n_shared: int, n_patients: int = 200,
                             seed: int = 0, image_size: int = 64, holdout: float = 0.2) -> dict:
    """The paper's ablation setting (sec. 2.4.1) on synthetic data: one NIH-like source ``out/nih`` of
    ``n_patients`` (seed ``seed``), cut by :func:`fedssl.data.cxr.write_nih_partition` into ``n_clients`` IID
    site folders ``out/site-k`` with ``n_shared`` classes held by every client and the held-out NIH test set
    ``out/nih_test``, plus a MIMIC-like external set ``out/mimic`` (seed ``seed + 2``, ``n_patients // 2``).
    Returns the partition summary with ``"mimic"`` added."""
    o = Path(out)
    write_synthetic_nih(o / "nih", n_patients, seed=seed, image_size=image_size)
    summary = write_nih_partition(o / "nih", o, n_clients, n_shared, seed=seed, holdout=holdout)
    summary["mimic"] = write_synthetic_mimic_cxr(o / "mimic", max(1, n_patients // 2), seed=seed + 2,
                                                 image_size=image_size)
    return summary
