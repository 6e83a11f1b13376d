"""mBRSET, FedDRA's out-of-distribution ophthalmology set (appendix A.2.2, Table 4: "MBRSET was collected in
low-income areas using portable devices ... few-shot classification tasks on diabetic retinopathy and edema
status ... These are binary classification problems").

Layout read: the PhysioNet mBRSET release as we know it: ``labels_mbrset.csv`` with (among others) the columns
``patient``, ``file`` (image file name), ``final_icdr`` (0-4) and ``final_edema`` ("yes" / "no", or 1 / 0), images
under ``images/``.  The real release's column names could not be checked here; a file without them is refused
with the columns it needs.  Binary targets: DR = ``final_icdr >= 1`` (the paper says binary without a threshold;
"any DR" is assumed), edema = ``final_edema``.  mBRSET has no official split: 80 / 20 by patient
(:func:`fedssl.data.vlp.patient_test_split`, as BRSET here).

:func:`write_synthetic_mbrset` writes that layout from the retina renderer with a portable handheld camera
(dimmer, blurrier, noisier, narrower field than MESSIDOR-2's and BRSET's), so it is out of distribution for a
model pre-trained on those two.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from fedssl.core.checks import require_int
from fedssl.data.cxr import _read_rows, _require_columns, checked_rows
from fedssl.data.image_synthetic import save_image
from fedssl.data.vlp import _check_root, _err, _refuse_layout, patient_test_split

MBRSET_CSV = "labels_mbrset.csv"
MBRSET_COLUMNS = ("patient", "age", "sex", "file", "laterality", "final_icdr", "final_edema")
#: the two binary tasks of Table 4
MBRSET_TASKS = ("dr", "edema")
_EDEMA = {"yes": 1, "no": 0, "1": 1, "0": 0}

#: a portable handheld fundus camera (Phelcom Eyer-like): dim, soft, noisy, narrow field
PORTABLE_CAMERA = {"gains": np.array([1.05, 0.92, 0.85], np.float32), "brightness": 0.75, "gamma": 1.25,
                   "blur": 0.9, "resolution": 0.55, "noise": 0.045, "fov": 0.42, "vignette": 0.7,
                   "dust": (0.5, 0.5, 0.3)}


def load_mbrset(root: object, site: str = "?", seed: int = 0, test_fraction: float = 0.2,
                check_images: bool = True) -> dict[str, list[tuple[str, int, int]]]:
    """``{"train": [(image path, dr 0/1, edema 0/1)], "test": [...]}``, CSV order within each split."""
    rp = _check_root(root, site, "mBRSET")
    csv_path = rp / MBRSET_CSV
    if not csv_path.is_file():
        raise _refuse_layout(rp, site, f"{MBRSET_CSV} (columns patient, file, final_icdr, final_edema) with images "
                             "under images/", "use the PhysioNet mBRSET release")
    header, rows = _read_rows(csv_path, site)
    pos = _require_columns(header, ("patient", "file", "final_icdr", "final_edema"), csv_path, site)
    recs = []
    for line, r in checked_rows(header, rows, csv_path, site, "restore the CSV", error=_err):
        patient, name = r[pos["patient"]].strip(), r[pos["file"]].strip()
        if not patient or not name:
            raise _err(site, csv_path, "empty patient or file", "every row needs both", line)
        icdr, edema = r[pos["final_icdr"]].strip(), r[pos["final_edema"]].strip().lower()
        if icdr not in ("0", "1", "2", "3", "4"):
            raise _err(site, csv_path, f"final_icdr={icdr!r} is not an ICDR grade 0-4", "restore the CSV", line)
        if edema not in _EDEMA:
            raise _err(site, csv_path, f"final_edema={edema!r} is not yes/no", "restore the CSV", line)
        path = rp / "images" / name
        if check_images and not path.is_file():
            raise _err(site, csv_path, f"image images/{name} not found", "unpack every mBRSET image", line)
        recs.append((patient, str(path.absolute()), int(int(icdr) >= 1), _EDEMA[edema]))
    if not recs:
        raise _err(site, csv_path, "label file holds no row", "restore the label file")
    test = patient_test_split([p for p, *_ in recs], seed=seed, test_fraction=test_fraction)
    out: dict[str, list[tuple[str, int, int]]] = {"train": [], "test": []}
    for patient, path, dr, edema in recs:
        out["test" if patient in test else "train"].append((path, dr, edema))
    return out


def write_synthetic_mbrset(out: object, n_images: int = 200, image_px: int = 64, seed: int = 0) -> dict:
    """mBRSET's layout (module docstring): both eyes of most patients, ICDR grades skewed to 0 (about 70 %), edema
    more likely with higher grades; images from the portable camera.

    Returns:
        ``{"root", "n_images", "n_patients", "dr": n with DR, "edema": n with edema}``.
    """
    from fedssl.data.vlp_synthetic import _grade_and_edema, _retina, _write_csv

    require_int("write_synthetic_mbrset", "n_images", n_images, 1, "use a positive number of images")
    require_int("write_synthetic_mbrset", "image_px", image_px, 16, "use at least 16 px")
    rp = Path(os.fspath(out))
    (rp / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([seed, 41])
    rows, i, patient, dr, edema = [], 0, 0, 0, 0
    while i < n_images:
        patient += 1
        age, sex = int(rng.integers(30, 85)), int(rng.integers(0, 2))
        for eye in ("right", "left"):
            if i >= n_images:
                break
            i += 1
            g, e = _grade_and_edema(rng, (0.7, 0.1, 0.1, 0.05, 0.05), "brset")
            name = f"{patient}.{1 if eye == 'right' else 2}.jpg"
            save_image(_retina(rng, g, e, PORTABLE_CAMERA, image_px, eye), str(rp / "images" / name))
            rows.append([str(patient), str(age), str(sex), name, eye, str(g), "yes" if e else "no"])
            dr += int(g >= 1)
            edema += e
    _write_csv(rp / MBRSET_CSV, MBRSET_COLUMNS, rows)
    return {"root": str(rp), "n_images": n_images, "n_patients": patient, "dr": dr, "edema": edema}


__all__ = ["MBRSET_CSV", "MBRSET_TASKS", "PORTABLE_CAMERA", "load_mbrset", "write_synthetic_mbrset"]
