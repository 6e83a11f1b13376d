"""Loaders for the real on-disk layouts of the SSL-FL image data sets, splits, and the augmented dataset.

Layouts read (one folder per FLARE site, the same layout as the public data set):

* ``retina`` (Kaggle Diabetic Retinopathy)::

      root/trainLabels.csv            # header "image,level"; level 0-4
      root/train/<image>.jpeg

  label = 0 ("no_dr") if level == 0 else 1 ("dr"), as SSL-FL binarises Normal vs Diseased.
* ``derm`` (ISIC 2019 training set)::

      root/ISIC_2019_Training_GroundTruth.csv   # image,MEL,NV,BCC,AK,BKL,DF,VASC,SCC,UNK (one-hot floats)
      root/ISIC_2019_Training_Input/<image>.jpg

  Classes used: the eight diagnostic categories MEL, NV, BCC, AK, BKL, DF, VASC, SCC (label = column
  index). FedMAE-KS (Wu et al., "Federated Self-Supervised Learning for Dermatological Disease Diagnosis", section IV-B)
  trains on "the full ISIC 2019 ... eight different diagnostic categories" and SSL-FL's Skin-FL uses the same eight; UNK
  has no training image in ISIC 2019, so a row whose 1 is in UNK is refused. SSL-FL's "Derm" task (melanoma vs benign)
  is :func:`melanoma_vs_benign` applied to these records. A row with no 1 or several 1s is an error naming file, row and
  site.
* ``covidfl`` (COVID-FL) site folder: ``root/<class>/<image>.(png|jpg|jpeg)`` with class folders ``covid``,
  ``pneumonia``, ``normal`` (case-insensitive; ``covid-19``/``covid19`` accepted for covid). Sites may miss
  classes (SSL-FL: BIMCV holds only COVID-19 images). The full data set is SSL-FL's release
  (:mod:`fedssl.data.sslfl_release`), cut into such site folders by ``fedssl sslfl partition``.
* ``derm5`` (FedCLF's five classes: BCC, DF, MEL, NV, SCC; "Federated Self-Supervised Learning for Dermatological
  Disease Diagnosis", sec. V-A) split folder: ``root/<class>/<image>`` with class folders ``BCC``, ``DF``, ``MEL``,
  ``NV``, ``SCC`` (case-insensitive); a device folder holds ``train``, ``val`` and ``test`` such folders, as
  :func:`fedssl.data.fedclf_devices.build_devices` writes them from ISIC 2019, AtlasDerm, Dermnet and DarkDerm.
* ``derm_mel`` (SSL-FL's "Derm": melanoma vs benign, ISIC 2017/2019/2020) site folder: ``root/<class>/<image>``
  with class folders ``benign``, ``melanoma``; the full data set is SSL-FL's release, as for COVID-FL.

Every data problem raises :class:`ImageDataError` naming the site and the path (missing CSV, missing
image, undecodable image, unknown level/class, malformed row).

:class:`ImageDataset` decodes each image once, resizes it (shorter side ``ceil(image_size / 0.875)``,
aspect kept) and keeps the uint8 array in memory (``cache=True``), then applies the SSL-FL augmentation
of ``mode`` with randomness drawn from ``(seed, epoch, index)`` only, so any item is reproducible:

* ``pretrain``: RandomResizedCrop scale 0.2-1 (0.4-1 COVID-FL), ratio 3/4-4/3, colour jitter
  (brightness / contrast / saturation 0.4, random order), horizontal flip p=0.5;
* ``finetune``: random resized crop scale 0.6-1; COVID-FL 0.8-1.2, where a scale above 1 zooms out
  (the crop box is larger than the image, the border is black); rotation +-10 degrees; h-flip p=0.5;
* ``eval``: resize (shorter side ``ceil(S / 0.875)``) + centre crop S;

then ImageNet normalisation. :func:`batches` yields shuffled mini-batches without DataLoader workers.
"""

from __future__ import annotations

import csv
import math
import os
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Iterator, Optional, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from fedssl.data.loading import CachedImageDataset, collate_labelled, load_batches

__all__ = [
    "DATASETS",
    "SSLFL_DATASETS",
    "RETINA_CLASSES",
    "DERM_CLASSES",
    "COVIDFL_CLASSES",
    "DERM_MEL_CLASSES",
    "DERM5_CLASSES",
    "ISIC_COLUMNS",
    "ImageDataError",
    "ImageRecord",
    "class_names",
    "layout_paths",
    "load_image_records",
    "melanoma_vs_benign",
    "train_val_split",
    "select_labelled",
    "class_histogram",
    "ImageDataset",
    "batches",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
]

PathLike = Union[str, "os.PathLike[str]"]

DATASETS: tuple[str, ...] = ("retina", "derm", "covidfl", "derm_mel", "derm5")
#: the data sets of SSL-FL and FedMAE-KS (synthetic writer, partitioner); derm5 has its own
#: (:mod:`fedssl.data.fedclf_devices`, :mod:`fedssl.data.fedclf_synthetic`)
SSLFL_DATASETS: tuple[str, ...] = ("retina", "derm", "covidfl", "derm_mel")
RETINA_CLASSES: list[str] = ["no_dr", "dr"]
#: the ISIC 2019 ground-truth columns, in file order
ISIC_COLUMNS: tuple[str, ...] = ("MEL", "NV", "BCC", "AK", "BKL", "DF", "VASC", "SCC", "UNK")
#: the classes used (UNK has no ISIC 2019 training image)
DERM_CLASSES: list[str] = list(ISIC_COLUMNS[:8])
COVIDFL_CLASSES: list[str] = ["covid", "pneumonia", "normal"]
#: SSL-FL's Derm task: label 1 = melanoma (malignant), 0 = benign
DERM_MEL_CLASSES: list[str] = ["benign", "melanoma"]
#: FedCLF's five classes, the intersection of ISIC 2019, AtlasDerm, Dermnet and DarkDerm (label = index)
DERM5_CLASSES: list[str] = ["BCC", "DF", "MEL", "NV", "SCC"]
#: class-folder names (lower case) -> label, per data set read from ``<class>/<image>`` site folders
_FOLDER_CLASSES = {
    "covidfl": {"covid": 0, "covid-19": 0, "covid19": 0, "covid_19": 0, "pneumonia": 1, "normal": 2},
    "derm_mel": {"benign": 0, "melanoma": 1},
    "derm5": {c.lower(): i for i, c in enumerate(DERM5_CLASSES)},
}
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg")

RETINA_CSV = "trainLabels.csv"
RETINA_DIR = "train"
DERM_CSV = "ISIC_2019_Training_GroundTruth.csv"
DERM_DIR = "ISIC_2019_Training_Input"

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

#: eval resize: shorter side = ceil(image_size / CROP_PCT), then centre crop image_size
CROP_PCT = 0.875
PRETRAIN_SCALE = {"retina": (0.2, 1.0), "derm": (0.2, 1.0), "covidfl": (0.4, 1.0), "derm_mel": (0.2, 1.0),
                  "derm5": (0.2, 1.0)}
FINETUNE_SCALE = {"retina": (0.6, 1.0), "derm": (0.6, 1.0), "covidfl": (0.8, 1.2), "derm_mel": (0.6, 1.0),
                  "derm5": (0.6, 1.0)}
CROP_RATIO = (3.0 / 4.0, 4.0 / 3.0)
COLOR_JITTER = 0.4
FINETUNE_ROTATION_DEG = 10.0
MODES = ("pretrain", "finetune", "eval")
#: decoded images shared by every ImageDataset with cache=True (a site's pre-training and fine-tuning datasets,
#: or datasets rebuilt each round, decode a file once): (path, base size, mtime, file size) -> uint8 array
SHARED_CACHE_BYTES = 1 << 30
_SHARED: "OrderedDict[tuple, np.ndarray]" = OrderedDict()
_SHARED_BYTES = [0]


class ImageDataError(ValueError):
    """A problem with image data on disk; the message names the site, the path and the fix."""


def _err(site: str, path: PathLike, problem: str, fix: str) -> ImageDataError:
    return ImageDataError(f"[site {site or '?'}] {problem}: {os.fspath(path)}. Fix: {fix}")


@dataclass(frozen=True)
class ImageRecord:
    """One labelled image: absolute ``path``, integer ``label`` (index into :func:`class_names`),
    ``source`` = origin site/device if known (COVID-FL: the site folder name), else ""."""

    path: str
    label: int
    source: str = ""


def _check_dataset(dataset: str) -> str:
    if dataset not in DATASETS:
        raise ValueError(f"dataset={dataset!r}: use one of {list(DATASETS)}")
    return dataset


def class_names(dataset: str) -> list[str]:
    """Class names in label order: retina ``["no_dr", "dr"]``; derm the 8 ISIC 2019 diagnostic classes
    ``MEL, NV, BCC, AK, BKL, DF, VASC, SCC``; covidfl ``["covid", "pneumonia", "normal"]``; derm_mel
    ``["benign", "melanoma"]``; derm5 ``["BCC", "DF", "MEL", "NV", "SCC"]``."""
    return list({"retina": RETINA_CLASSES, "derm": DERM_CLASSES, "covidfl": COVIDFL_CLASSES,
                 "derm_mel": DERM_MEL_CLASSES, "derm5": DERM5_CLASSES}[_check_dataset(dataset)])


def layout_paths(dataset: str) -> tuple[Optional[str], Optional[str], str]:
    """``(csv name, image folder, image extension)`` of a dataset's layout; covidfl / derm_mel site folders
    are class folders (no CSV)."""
    return {"retina": (RETINA_CSV, RETINA_DIR, ".jpeg"), "derm": (DERM_CSV, DERM_DIR, ".jpg"),
            "covidfl": (None, None, ".png"), "derm_mel": (None, None, ".jpg"),
            "derm5": (None, None, ".png")}[_check_dataset(dataset)]


def _check_root(root: PathLike, dataset: str, site: str) -> str:
    r = os.path.abspath(os.fspath(root))
    if not os.path.isdir(r):
        tools = ("`fedssl fedclf synth` and device folders with `fedssl fedclf devices`" if dataset == "derm5" else
                 "`fedssl sslfl synth` and site folders with `fedssl sslfl partition`")
        raise _err(site, r, f"{dataset} data folder does not exist or is not a directory",
                   f"point the site's data_root at its data folder (write synthetic data with {tools} if the real "
                   "data is not here)")
    return r


def _read_csv(path: str, dataset: str, site: str) -> tuple[list[str], list[list[str]]]:
    if not os.path.isfile(path):
        raise _err(site, path, f"{dataset} label file is missing",
                   f"the site folder must hold {os.path.basename(path)} next to its image folder "
                   f"(real {dataset} layout)")
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            rows = [r for r in csv.reader(f)]
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise _err(site, path, f"cannot read {dataset} label file ({exc.__class__.__name__}: {exc})",
                   "check the file is a readable UTF-8 CSV") from exc
    rows = [r for r in rows if any(c.strip() for c in r)]
    if not rows:
        raise _err(site, path, "label file is empty", "write the header line and one row per image")
    return [c.strip() for c in rows[0]], rows[1:]


def _image_path(root: str, folder: str, image: str, ext: str, csv_path: str, row: int, site: str) -> str:
    if not image or os.sep in image or "/" in image or image in (".", ".."):
        raise _err(site, csv_path, f"row {row}: bad image name {image!r}", "use the bare image id of the file")
    p = os.path.join(root, folder, image + ext)
    if not os.path.isfile(p):
        raise _err(site, p, f"image listed in {os.path.basename(csv_path)} row {row} is missing",
                   f"put the file in {folder}/ or remove its row")
    return p


def _load_retina(root: str, site: str) -> list[ImageRecord]:
    csv_path = os.path.join(root, RETINA_CSV)
    header, rows = _read_csv(csv_path, "retina", site)
    if [h.lower() for h in header[:2]] != ["image", "level"]:
        raise _err(site, csv_path, f"header {header} is not 'image,level'", "use the Kaggle DR trainLabels.csv header")
    out, seen = [], set()
    for i, r in enumerate(rows, start=2):
        if len(r) < 2:
            raise _err(site, csv_path, f"row {i} has {len(r)} column(s), expected image,level", "fix the row")
        image, level_s = r[0].strip(), r[1].strip()
        try:
            level = int(level_s)
        except ValueError:
            level = -1
        if level not in (0, 1, 2, 3, 4):
            raise _err(site, csv_path, f"row {i} ({image}): unknown DR level {level_s!r}",
                       "levels are integers 0 (no DR) to 4 (proliferative DR)")
        if image in seen:
            raise _err(site, csv_path, f"row {i}: image {image!r} listed twice", "keep one row per image")
        seen.add(image)
        out.append(ImageRecord(_image_path(root, RETINA_DIR, image, ".jpeg", csv_path, i, site), int(level > 0)))
    return out


def _load_derm(root: str, site: str) -> list[ImageRecord]:
    csv_path = os.path.join(root, DERM_CSV)
    header, rows = _read_csv(csv_path, "derm", site)
    if not header or header[0].lower() != "image" or tuple(header[1:]) not in (ISIC_COLUMNS, ISIC_COLUMNS[:8]):
        raise _err(site, csv_path, f"header {header} is not image,{','.join(ISIC_COLUMNS)}",
                   "use the ISIC 2019 ground-truth header (UNK may be absent)")
    ncol = len(header) - 1
    out, seen = [], set()
    for i, r in enumerate(rows, start=2):
        if len(r) != len(header):
            raise _err(site, csv_path, f"row {i} has {len(r)} columns, header has {len(header)}", "fix the row")
        image = r[0].strip()
        try:
            v = [float(x) for x in r[1:]]
        except ValueError:
            raise _err(site, csv_path, f"row {i} ({image}): non-numeric one-hot value in {r[1:]}",
                       "write 0.0 / 1.0 per class column") from None
        ones = [j for j, x in enumerate(v) if x == 1.0]
        if len(ones) != 1 or any(x not in (0.0, 1.0) for x in v):
            raise _err(site, csv_path, f"row {i} ({image}): expected exactly one 1.0 among {list(header[1:])}, "
                       f"got {r[1:]}", "each ISIC 2019 row is one-hot: one diagnosis per image")
        j = ones[0]
        if j >= len(DERM_CLASSES) or j >= ncol:
            raise _err(site, csv_path, f"row {i} ({image}): class {header[1 + j]} is not used",
                       f"the derm tasks use {DERM_CLASSES}; drop UNK rows")
        if image in seen:
            raise _err(site, csv_path, f"row {i}: image {image!r} listed twice", "keep one row per image")
        seen.add(image)
        out.append(ImageRecord(_image_path(root, DERM_DIR, image, ".jpg", csv_path, i, site), j))
    return out


def _load_class_folders(root: str, site: str, dataset: str) -> list[ImageRecord]:
    """Records of a ``<class>/<image>`` site folder (covidfl, derm_mel); ``source`` = the folder's name."""
    source = os.path.basename(root.rstrip(os.sep))
    aliases, classes = _FOLDER_CLASSES[dataset], class_names(dataset)
    out = []
    entries = sorted(os.listdir(root))
    dirs = [e for e in entries if os.path.isdir(os.path.join(root, e)) and not e.startswith(".")]
    if not dirs:
        raise _err(site, root, f"no class folder in the {dataset} site folder",
                   f"the site folder must hold class folders {classes} with the images")
    for d in dirs:
        label = aliases.get(d.lower())
        if label is None:
            raise _err(site, os.path.join(root, d), f"unknown {dataset} class folder {d!r}",
                       f"class folders are {classes}; move the images or remove the folder")
        for f in sorted(os.listdir(os.path.join(root, d))):
            p = os.path.join(root, d, f)
            if f.startswith(".") or not os.path.isfile(p):
                continue
            if os.path.splitext(f)[1].lower() not in IMAGE_EXTENSIONS:
                raise _err(site, p, "file with an unknown image extension in a class folder",
                           f"{dataset} images are {'/'.join(IMAGE_EXTENSIONS)}; remove the file")
            out.append(ImageRecord(p, label, source))
    return out


def load_image_records(root: PathLike, dataset: str, site: str = "?") -> list[ImageRecord]:
    """Records of ONE site folder in the real layout of ``dataset`` (see the module docstring).

    Checks that every listed image exists (decoding happens in :class:`ImageDataset`).

    Raises:
        ImageDataError: missing folder/CSV/image, bad header, unknown level/class, malformed one-hot row,
            duplicate image, or no image at all; the message names the site and the path.
    """
    _check_dataset(dataset)
    r = _check_root(root, dataset, site)
    if dataset in _FOLDER_CLASSES:
        recs = _load_class_folders(r, site, dataset)
    else:
        recs = {"retina": _load_retina, "derm": _load_derm}[dataset](r, site)
    if not recs:
        raise _err(site, r, f"no {dataset} image found", "the site folder needs at least one labelled image")
    return recs


def melanoma_vs_benign(records: Sequence[ImageRecord]) -> list[ImageRecord]:
    """SSL-FL "Derm" task: derm records relabelled 1 = melanoma (MEL), 0 = benign (every other class)."""
    mel = DERM_CLASSES.index("MEL")
    return [replace(r, label=int(r.label == mel)) for r in records]


def _round_half_up(x: float) -> int:
    return int(math.floor(x + 0.5))


def _by_class(records: Sequence[ImageRecord]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(records):
        groups.setdefault(int(r.label), []).append(i)
    return groups


def _ordered(records: Sequence[ImageRecord]) -> list[int]:
    # order by path, so the split does not depend on the order records came in
    return sorted(range(len(records)), key=lambda i: (records[i].path, records[i].label))


def train_val_split(records: Sequence[ImageRecord], val_fraction: float, seed: int) -> tuple[list, list]:
    """Stratified, seeded split: per class ``round(val_fraction * n_c)`` images go to validation, but each
    class present keeps >= 1 training image. Deterministic and independent of the input order.

    Returns:
        ``(train, val)`` lists of records, each in path order.
    """
    if not (isinstance(val_fraction, (int, float)) and 0.0 <= val_fraction < 1.0):
        raise ValueError(f"val_fraction={val_fraction!r}: must be in [0, 1)")
    recs = list(records)
    order = _ordered(recs)
    rng = np.random.default_rng(seed)
    groups = _by_class([recs[i] for i in order])
    val_pos: set[int] = set()
    for label in sorted(groups):
        idx = groups[label]
        n_val = min(len(idx) - 1, _round_half_up(val_fraction * len(idx)))
        if n_val > 0:
            val_pos.update(idx[j] for j in rng.permutation(len(idx))[:n_val])
    train = [recs[order[p]] for p in range(len(order)) if p not in val_pos]
    val = [recs[order[p]] for p in range(len(order)) if p in val_pos]
    return train, val


def select_labelled(records: Sequence[ImageRecord], fraction: float, seed: int) -> list:
    """The labelled subset for fine-tuning (SSL-FL: 10 / 30 / 70 / 100 % "of the labeled samples from each
    class"): per class ``max(1, round(fraction * n_c))`` images, seeded, in path order."""
    if not (isinstance(fraction, (int, float)) and 0.0 < fraction <= 1.0):
        raise ValueError(f"fraction={fraction!r}: must be in (0, 1], e.g. 0.1, 0.3, 0.7, 1.0")
    recs = list(records)
    order = _ordered(recs)
    if fraction >= 1.0:
        return [recs[i] for i in order]
    rng = np.random.default_rng(seed)
    groups = _by_class([recs[i] for i in order])
    keep: set[int] = set()
    for label in sorted(groups):
        idx = groups[label]
        n = min(len(idx), max(1, _round_half_up(fraction * len(idx))))
        keep.update(idx[j] for j in rng.permutation(len(idx))[:n])
    return [recs[order[p]] for p in range(len(order)) if p in keep]


def class_histogram(records: Sequence[ImageRecord], n_classes: int) -> list[int]:
    """Number of records per class label ``0..n_classes-1``."""
    h = [0] * n_classes
    for r in records:
        h[r.label] += 1
    return h


def _decode(path: str, base: int, site: str) -> np.ndarray:
    """Decode one image to RGB uint8 ``[H, W, 3]`` with its shorter side resized to ``base``."""
    from PIL import Image, UnidentifiedImageError

    if not os.path.isfile(path):
        raise _err(site, path, "image file is missing", "restore the file or remove it from the site's label file")
    try:
        with Image.open(path) as im:
            w, h = im.size
            if im.format == "JPEG":  # decode large JPEGs at a reduced scale (still >= base on the short side)
                s = base / min(w, h)
                im.draft("RGB", (max(1, int(w * s)), max(1, int(h * s))))
            im = im.convert("RGB")
            w, h = im.size
            s = base / min(w, h)
            size = (max(base, _round_half_up(w * s)), max(base, _round_half_up(h * s)))
            if size != (w, h):
                im = im.resize(size, Image.BICUBIC, reducing_gap=3.0)
            return np.asarray(im, dtype=np.uint8).copy()
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise _err(site, path, f"cannot decode image ({exc.__class__.__name__}: {exc})",
                   "replace the file with a readable PNG/JPEG or remove it") from exc


class ImageDataset(CachedImageDataset):
    """Augmented, ImageNet-normalised images of one site; item = ``(float [3, S, S], int label)``.

    ``cache=True`` keeps each decoded, resized uint8 image in memory after first use. The augmentation of
    item ``i`` depends only on ``(seed, epoch, i)``: set the epoch with :meth:`set_epoch` (done by
    :func:`batches`). A decode failure raises :class:`ImageDataError` naming the site and the file.
    """

    def __init__(self, records: Sequence[ImageRecord], image_size: int, mode: str, dataset: str, site: str = "?",
                 cache: bool = True, seed: int = 0):
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: use one of {list(MODES)}")
        _check_dataset(dataset)
        if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 4:
            raise ValueError(f"image_size={image_size!r}: must be an integer >= 4 (paper: 224; tiny: 32)")
        self.records = list(records)
        self.image_size = image_size
        self.mode = mode
        self.dataset = dataset
        self.site = site
        self.cache = cache
        self.seed = int(seed)
        self.epoch = 0
        self.base_size = int(math.ceil(image_size / CROP_PCT))
        self._cache: dict[int, np.ndarray] = {}
        self._mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
        self._std = torch.tensor(IMAGENET_STD).view(3, 1, 1)

    @property
    def labels(self) -> list[int]:
        return [r.label for r in self.records]

    def decoded(self, index: int) -> np.ndarray:
        return self.raw(index)

    def raw(self, index: int) -> np.ndarray:
        """The decoded RGB uint8 image (shorter side ``ceil(image_size / 0.875)``), cached if enabled
        (per dataset, and in a process-wide cache of up to ``SHARED_CACHE_BYTES`` shared by all datasets)."""
        img = self._cache.get(index)
        if img is not None:
            return img
        path = self.records[index].path
        if not self.cache:
            return _decode(path, self.base_size, self.site)
        try:
            st = os.stat(path)
            key: Optional[tuple] = (os.path.realpath(path), self.base_size, st.st_mtime_ns, st.st_size)
        except OSError:
            key = None
        img = _SHARED.get(key) if key is not None else None
        if img is None:
            img = _decode(path, self.base_size, self.site)
            if key is not None and img.nbytes <= SHARED_CACHE_BYTES:
                _SHARED[key] = img
                _SHARED_BYTES[0] += img.nbytes
                while _SHARED_BYTES[0] > SHARED_CACHE_BYTES:
                    _SHARED_BYTES[0] -= _SHARED.popitem(last=False)[1].nbytes
        self._cache[index] = img
        return img

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if index < 0:
            index += len(self)
        img = torch.from_numpy(self.raw(index)).permute(2, 0, 1).float().div_(255.0)
        if self.mode == "eval":
            x = self._centre_crop(img)
        else:
            g = np.random.default_rng([self.seed, self.epoch, index])
            x = self._augment(img, g)
        return (x - self._mean) / self._std, int(self.records[index].label)

    def _centre_crop(self, img: torch.Tensor) -> torch.Tensor:
        s = self.image_size
        h, w = img.shape[1:]
        top, left = (h - s) // 2, (w - s) // 2
        return img[:, top : top + s, left : left + s].contiguous()

    def _crop_box(self, h: int, w: int, scale: tuple[float, float], g: np.random.Generator) -> tuple[float, ...]:
        """torchvision RandomResizedCrop box (10 tries, then centre crop); scale > 1 zooms out."""
        area = h * w
        lr = (math.log(CROP_RATIO[0]), math.log(CROP_RATIO[1]))
        for _ in range(10):
            target = area * g.uniform(*scale)
            ratio = math.exp(g.uniform(*lr))
            cw, ch = math.sqrt(target * ratio), math.sqrt(target / ratio)
            if scale[1] <= 1.0 and not (0 < cw <= w and 0 < ch <= h):
                continue
            left = g.uniform(min(0.0, w - cw), max(0.0, w - cw))
            top = g.uniform(min(0.0, h - ch), max(0.0, h - ch))
            return top, left, ch, cw
        side = float(min(h, w))
        return (h - side) / 2, (w - side) / 2, side, side

    def _augment(self, img: torch.Tensor, g: np.random.Generator) -> torch.Tensor:
        h, w = img.shape[1:]
        if self.mode == "pretrain":
            top, left, ch, cw = self._crop_box(h, w, PRETRAIN_SCALE[self.dataset], g)
            angle = 0.0
        else:
            top, left, ch, cw = self._crop_box(h, w, FINETUNE_SCALE[self.dataset], g)
            angle = math.radians(g.uniform(-FINETUNE_ROTATION_DEG, FINETUNE_ROTATION_DEG))
        flip = -1.0 if g.random() < 0.5 else 1.0
        # output normalised coords o -> flip -> rotate -> crop box -> input normalised coords
        c, s = math.cos(angle), math.sin(angle)
        theta = torch.tensor([
            [cw / w * c * flip, -cw / w * s, (2 * left + cw) / w - 1],
            [ch / h * s * flip, ch / h * c, (2 * top + ch) / h - 1],
        ], dtype=torch.float32).unsqueeze(0)
        size = (1, 3, self.image_size, self.image_size)
        grid = F.affine_grid(theta, list(size), align_corners=False)
        x = F.grid_sample(img.unsqueeze(0), grid, mode="bilinear", padding_mode="zeros", align_corners=False)[0]
        if self.mode == "pretrain":
            x = self._colour_jitter(x, g)
        return x.clamp_(0.0, 1.0)

    @staticmethod
    def _colour_jitter(x: torch.Tensor, g: np.random.Generator) -> torch.Tensor:
        j = COLOR_JITTER
        factors = g.uniform(1 - j, 1 + j, size=3)
        for op in g.permutation(3):
            f = float(factors[op])
            if op == 0:  # brightness
                x = x * f
            elif op == 1:  # contrast: blend with the mean grey level
                grey = (0.299 * x[0] + 0.587 * x[1] + 0.114 * x[2]).mean()
                x = (x - grey) * f + grey
            else:  # saturation: blend with the per-pixel grey image
                grey = (0.299 * x[0] + 0.587 * x[1] + 0.114 * x[2]).unsqueeze(0)
                x = (x - grey) * f + grey
            x = x.clamp(0.0, 1.0)
        return x


def batch_bounds(n: int, batch_size: int, drop_last: bool = False, fold_single: bool = False) -> list[tuple[int, int]]:
    """``(start, stop)`` of each mini-batch of ``n`` items.  ``fold_single``: a last batch of one item joins the
    batch before it (BatchNorm cannot train on one item whose features are 1 x 1)."""
    stop = n - n % batch_size if drop_last else n
    bounds = [(start, min(start + batch_size, stop)) for start in range(0, stop, batch_size)]
    if fold_single and len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        bounds[-2:] = [(bounds[-2][0], bounds[-1][1])]
    return bounds


def batches(dataset: Dataset, batch_size: int, seed: int, epoch: int,
            drop_last: bool = False, fold_single: bool = False, *, workers: int = 0,
            pin_memory: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Shuffled mini-batches ``(x [B, ...], y LongTensor [B])`` of ``dataset`` for one epoch. The order depends
    only on ``(seed, epoch)``; datasets with a ``set_epoch`` method get ``epoch`` first, so their augmentation is
    reproducible too.  ``fold_single``: see :func:`batch_bounds`.  ``workers`` / ``pin_memory``:
    :func:`fedssl.data.loading.load_batches` (the same batches from worker processes)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}: must be a positive integer")
    if hasattr(dataset, "set_epoch"):
        dataset.set_epoch(epoch)
    n = len(dataset)
    order = np.random.default_rng([int(seed), int(epoch)]).permutation(n)
    yield from load_batches(dataset, [order[start:stop] for start, stop in batch_bounds(n, batch_size, drop_last,
                                                                                       fold_single)],
                            workers=workers, pin_memory=pin_memory, collate_fn=collate_labelled)
