"""FedCLF's 10 devices from the four public dermatology sources ("Federated Self-Supervised Learning for
Dermatological Disease Diagnosis", sec. V-A "Datasets" and "Federated setting").

Sources and the layouts read (anything else is an :class:`~fedssl.data.images.ImageDataError` naming the path):

* **ISIC 2019** training set, as ISIC ships it: ``ISIC_2019_Training_GroundTruth.csv`` (one-hot
  ``image,MEL,NV,BCC,AK,BKL,DF,VASC,SCC[,UNK]``) + ``ISIC_2019_Training_Input/<image>.jpg`` (the ``derm`` layout of
  :mod:`fedssl.data.images`).  Only the five FedCLF classes are kept (MEL 4,522, NV 12,875, BCC 3,323, DF 239,
  SCC 628 = 21,587 images, the paper's "about 21k"); the images of the other classes are dropped and counted.
* **AtlasDerm**, **Dermnet**, **DarkDerm**: a class-per-folder image tree ``<root>/<category>/**/<image>`` (jpg,
  jpeg, png; subfolders of a category are read too).  Category folders map to the five classes through
  :data:`CATEGORY_ALIASES` (case, spaces, ``_`` and ``-`` ignored, e.g. "Basal Cell Carcinoma", "basal_cell_carcinoma",
  "BCC"); folders of other categories (AtlasDerm has ~560) are skipped and listed in the report.  A root without
  category folders, or with none of the five classes, is refused.

:func:`build_devices` writes ``site-1`` ... ``site-7`` (seeded random, near-equal shards of ISIC's five-class
images), ``site-8`` (AtlasDerm), ``site-9`` (Dermnet) and ``site-10`` (DarkDerm) -- FLARE's site names for the
paper's devices -- each split 60/20/20 into ``train``, ``val`` and ``test`` (stratified per class, seeded) in the
``derm5`` class-folder layout, every image resized with bilinear interpolation so that its shorter edge is 72 px,
aspect ratio kept, and saved as PNG; ``devices.json`` records the sources, the per-split class counts, the
settings and what was skipped.  No image of one device is written into another's folder.  The folders are written
under ``<out>.partial`` and renamed to ``out`` when complete, so a build that stops (a corrupt image) leaves no
half-built ``out``; the next build replaces the leftovers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Sequence
from typing import Any

import numpy as np

from fedssl.data.images import (
    DERM5_CLASSES,
    DERM_CLASSES,
    IMAGE_EXTENSIONS,
    ImageDataError,
    ImageRecord,
    load_image_records,
)

#: the paper's device sources, in device order (devices 1-7 are ISIC shards)
N_ISIC_DEVICES = 7
CLASS_TREE_SOURCES = ("AtlasDerm", "Dermnet", "DarkDerm")
#: sec. V-A: ISIC 2019 five-class subset and the three other sets' five-class subsets
PAPER_SOURCE_SIZES = {"ISIC 2019": 21587, "AtlasDerm": 618, "Dermnet": 276, "DarkDerm": 216}
#: the ISIC 2019 ground truth's counts of the five classes (sum 21,587)
ISIC_FIVE_CLASS_COUNTS = {"MEL": 4522, "NV": 12875, "BCC": 3323, "DF": 239, "SCC": 628}
FRACTIONS = (0.6, 0.2, 0.2)
SPLITS = ("train", "val", "test")
SHORT_EDGE = 72
#: an ISIC device needs an image in each of train / val / test
MIN_PER_DEVICE = 3
#: normalised category-folder name -> FedCLF class
CATEGORY_ALIASES = {
    **dict.fromkeys(("bcc", "basalcellcarcinoma", "basalcellcarcinomas", "basalioma"), "BCC"),
    **dict.fromkeys(("df", "dermatofibroma", "dermatofibromas", "fibroushistiocytoma"), "DF"),
    **dict.fromkeys(("mel", "melanoma", "melanomas", "malignantmelanoma", "melanomamalignant"), "MEL"),
    **dict.fromkeys(("nv", "nevus", "nevi", "naevus", "naevi", "melanocyticnevus", "melanocyticnevi",
                     "melanocyticnaevus", "melanocyticnaevi"), "NV"),
    **dict.fromkeys(("scc", "squamouscellcarcinoma", "squamouscellcarcinomas", "cutaneoussquamouscellcarcinoma"),
                    "SCC"),
}


def normalise_category(name: str) -> str:
    return re.sub(r"[\s_\-]+", "", name.strip().lower())


def read_isic_five(root: str, site: str = "ISIC 2019") -> tuple[list[ImageRecord], dict[str, int]]:
    """The ISIC 2019 images of the five classes, relabelled to ``derm5`` (source "ISIC 2019"), and the counts of the
    dropped images per other class."""
    records = load_image_records(root, "derm", site=site)
    kept, dropped = [], {}
    for r in records:
        name = DERM_CLASSES[r.label]
        if name in DERM5_CLASSES:
            kept.append(ImageRecord(r.path, DERM5_CLASSES.index(name), "ISIC 2019"))
        else:
            dropped[name] = dropped.get(name, 0) + 1
    return kept, dict(sorted(dropped.items()))


def read_class_tree(root: str, source: str) -> tuple[list[ImageRecord], dict[str, Any]]:
    """The five-class images of a class-per-folder tree and ``{"skipped_categories": [...], "non_images": n}``."""
    if not os.path.isdir(root):
        raise ImageDataError(f"[source {source}] the folder does not exist: {root}. Fix: give the root of the "
                             f"{source} class-per-folder image tree (<root>/<category>/<image>)")
    folders = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)) and not d.startswith("."))
    if not folders:
        raise ImageDataError(f"[source {source}] no category folder in {root}. Fix: {source} must be a "
                             "class-per-folder tree <root>/<category>/<image>, with categories such as 'Basal Cell "
                             "Carcinoma'")
    records, skipped, non_images = [], [], 0
    for folder in folders:
        cls = CATEGORY_ALIASES.get(normalise_category(folder))
        if cls is None:
            skipped.append(folder)
            continue
        for dirpath, dirnames, files in os.walk(os.path.join(root, folder)):
            dirnames.sort()
            for f in sorted(files):
                if f.startswith("."):
                    continue
                if os.path.splitext(f)[1].lower() not in IMAGE_EXTENSIONS:
                    non_images += 1
                    continue
                records.append(ImageRecord(os.path.join(dirpath, f), DERM5_CLASSES.index(cls), source))
    if not records:
        raise ImageDataError(f"[source {source}] none of the five classes {DERM5_CLASSES} has an image in {root} "
                             f"(category folders found: {folders[:10]}). Fix: name the category folders as in "
                             "fedssl.data.fedclf_devices.CATEGORY_ALIASES (e.g. 'Melanoma', 'Dermatofibroma')")
    return records, {"skipped_categories": skipped, "non_images": non_images}


def isic_shards(records: Sequence[ImageRecord], n: int, seed: int) -> list[list[ImageRecord]]:
    """``n`` random near-equal shards (sizes differ by at most one) of ``records``, seeded."""
    order = np.random.default_rng([seed, 1]).permutation(len(records))
    return [[records[int(i)] for i in part] for part in np.array_split(order, n)]


def split_device(records: Sequence[ImageRecord], seed: int, fractions: Sequence[float] = FRACTIONS) -> dict[str, list]:
    """Stratified random train / val / test split: per class, ``round(f_val * n_c)`` validation and
    ``round(f_test * n_c)`` test images (each at least 1 when the class has >= 3 images), the rest training."""
    out: dict[str, list] = {s: [] for s in SPLITS}
    rng = np.random.default_rng([seed, 2])
    for c in range(len(DERM5_CLASSES)):
        members = [r for r in records if r.label == c]
        members = [members[int(i)] for i in rng.permutation(len(members))]
        n = len(members)
        n_val, n_test = (int(np.floor(f * n + 0.5)) for f in fractions[1:])
        if n >= 3:
            n_val, n_test = max(n_val, 1), max(n_test, 1)
        n_val, n_test = min(n_val, n), min(n_test, max(n - n_val, 0))
        out["val"] += members[:n_val]
        out["test"] += members[n_val:n_val + n_test]
        out["train"] += members[n_val + n_test:]
    return out


def resize_short_edge(path: str, short_edge: int, site: str):
    """The image at ``path`` as RGB, resized (bilinear) so that its shorter edge is ``short_edge`` px."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            im = im.convert("RGB")
            w, h = im.size
            size = (short_edge, round(h * short_edge / w)) if w <= h else (round(w * short_edge / h), short_edge)
            return im.resize(size, Image.BILINEAR)
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise ImageDataError(f"[site {site}] cannot decode image ({type(e).__name__}: {e}): {path}. Fix: replace or "
                             "remove the file") from None


def _settings(seed: int, short_edge: int, fractions: Sequence[float]) -> dict:
    """What decides the devices' content (the sources' paths are recorded beside it: moving them changes nothing)."""
    return {"seed": seed, "short_edge": short_edge, "fractions": list(fractions)}


def build_devices(out: str, isic_root: str, atlas_root: str, dermnet_root: str, darkderm_root: str, *, seed: int = 0,
                  short_edge: int = SHORT_EDGE, fractions: Sequence[float] = FRACTIONS) -> dict:
    """Write the 10 device folders under ``out`` (see the module docstring) and return the ``devices.json`` report.
    A folder already built with the same settings is kept (its report returned); other settings are refused."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r}: use a non-negative integer")
    if isinstance(short_edge, bool) or not isinstance(short_edge, int) or short_edge < 8:
        raise ValueError(f"short_edge={short_edge!r}: use the shorter edge in pixels (paper: 72)")
    if len(fractions) != 3 or any(f <= 0 for f in fractions) or abs(sum(fractions) - 1.0) > 1e-9:
        raise ValueError(f"fractions={list(fractions)!r}: use three positive train/val/test fractions summing to 1 "
                         "(paper: [0.6, 0.2, 0.2])")
    sources = {"ISIC 2019": isic_root, "AtlasDerm": atlas_root, "Dermnet": dermnet_root, "DarkDerm": darkderm_root}
    settings = _settings(seed, short_edge, fractions)
    report_path = os.path.join(out, "devices.json")
    if os.path.isfile(report_path):
        with open(report_path) as f:
            report = json.load(f)
        if report.get("settings") != settings:
            raise ValueError(f"{out} holds devices built with other settings ({report.get('settings')}); build into "
                             "another folder or remove it")
        return report
    if os.path.isdir(out) and os.listdir(out):
        raise ValueError(f"{out} is not empty and holds no devices.json (a build that stopped part-way leaves none: "
                         "remove the folder and build again), or build into an empty folder")
    isic, dropped = read_isic_five(isic_root)
    if len(isic) < MIN_PER_DEVICE * N_ISIC_DEVICES:
        raise ImageDataError(f"[source ISIC 2019] {len(isic)} images of the five classes in {isic_root}: too few for "
                             f"{N_ISIC_DEVICES} devices with a train / val / test split each. Fix: at least "
                             f"{MIN_PER_DEVICE * N_ISIC_DEVICES} five-class images (the real set has 21,587)")
    devices = [("ISIC 2019", shard) for shard in isic_shards(isic, N_ISIC_DEVICES, seed)]
    skipped = {"ISIC 2019": {"dropped_classes": dropped}}
    for source, root in zip(CLASS_TREE_SOURCES, (atlas_root, dermnet_root, darkderm_root)):
        records, info = read_class_tree(root, source)
        devices.append((source, records))
        skipped[source] = info
    report: dict = {"settings": settings, "sources": {k: os.path.abspath(v) for k, v in sources.items()},
                    "classes": list(DERM5_CLASSES), "skipped": skipped, "devices": {}}
    final, out = out, f"{os.path.abspath(out).rstrip(os.sep)}.partial"
    if os.path.isdir(out):
        shutil.rmtree(out)  # the leftovers of a build that stopped part-way
    for k, (source, records) in enumerate(devices, start=1):
        site = f"site-{k}"
        parts = split_device(records, seed * 1000 + k, fractions)
        counts = {}
        for split, members in parts.items():
            for i, r in enumerate(members):  # the index keeps same-named images of subfolders apart
                folder = os.path.join(out, site, split, DERM5_CLASSES[r.label])
                os.makedirs(folder, exist_ok=True)
                stem = os.path.splitext(os.path.basename(r.path))[0]
                resize_short_edge(r.path, short_edge, site).save(os.path.join(folder, f"{i:05d}_{stem}.png"))
            counts[split] = {c: sum(r.label == i for r in members) for i, c in enumerate(DERM5_CLASSES)}
        report["devices"][site] = {"source": source, "images": len(records), "counts": counts}
    with open(os.path.join(out, "devices.json"), "w") as f:
        json.dump(report, f, indent=2)
    if os.path.isdir(final):
        os.rmdir(final)  # empty (checked above)
    os.rename(out, final)  # complete or not at all
    return report


def load_device(root: str, site: str, split: str) -> list[ImageRecord]:
    """The records of one device's split (``train``, ``val`` or ``test``) under a :func:`build_devices` folder."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: use one of {list(SPLITS)}")
    return load_image_records(os.path.join(root, site, split), "derm5", site=site)
