"""Chest X-ray loaders for Surgical aggregation (surgical aggregation (Kulkarni et al., ML4H 2024)): NIH ChestX-ray14,
CheXpert, MIMIC-CXR-JPG.

Real layouts read (the same loaders read the synthetic stand-ins of :mod:`fedssl.data.cxr_synthetic`):

NIH ChestX-ray14 (``root`` = the unpacked dataset folder)::

    Data_Entry_2017_v2020.csv   (or the older Data_Entry_2017.csv)
    images/00000001_000.png ... (or the box.com layout images_001/images/..., images_002/images/...)

  Columns ``Image Index, Finding Labels, Follow-up #, Patient ID, Patient Age, Patient Gender, View Position,
  OriginalImage[Width,Height], OriginalImagePixelSpacing[x,y]``.  The two bracketed headers each span two
  data columns: unquoted, a CSV reader splits them into ``OriginalImage[Width`` / ``Height]``; quoted, they
  are one header field over two data fields; the 2017 file also ends every line with a comma.  The header is
  normalised (``OriginalImage_Width``, ``OriginalImage_Height``, ...) before rows are read, and every row
  must then have exactly the header's width (a trailing empty field allowed).  ``Finding Labels`` joins the
  findings by ``|``; ``No Finding`` means none.

CheXpert (``root`` = the folder holding ``train.csv`` / ``valid.csv``, e.g. ``CheXpert-v1.0-small``)::

    train.csv, valid.csv        Path,Sex,Age,Frontal/Lateral,AP/PA,No Finding,Enlarged Cardiomediastinum,...
    train/patient00001/study1/view1_frontal.jpg

  ``Path`` starts with ``CheXpert-v1.0-small/`` (or ``CheXpert-v1.0/``): that first component is the root
  folder itself (also when the site folder is renamed), so the rest is resolved inside the root; failing
  that, the whole ``Path`` against the root, then against the root's parent.
  Lateral views are discarded.  Labels: ``1`` positive; ``0``, ``-1`` (uncertain, "U-Zeros" as the paper
  and its public code) and blank negative.

MIMIC-CXR-JPG (``root`` = the ``mimic-cxr-jpg/2.0.0`` folder; CSVs plain or ``.csv.gz``)::

    mimic-cxr-2.0.0-chexpert.csv  subject_id,study_id,<label columns>   (1.0 / 0.0 / -1.0 / blank)
    mimic-cxr-2.0.0-split.csv     dicom_id,study_id,subject_id,split    (train / validate / test)
    mimic-cxr-2.0.0-metadata.csv  dicom_id,subject_id,study_id,...,ViewPosition,...
    files/p10/p10000032/s50414267/<dicom_id>.jpg

  Frontal (``ViewPosition`` PA or AP) images only.  The label file may carry more columns than CheXpert's 14
  (the paper uses the CXR-LT expanded labels for all 20 classes, put in place of the CheXpert file by the
  public code); every recognised column is read and :func:`dataset_classes` reports which classes the test
  set annotates.

Class names: CheXpert spellings where NIH has the same finding (``Effusion`` -> ``Pleural Effusion``);
NIH-only findings keep their NIH names with ``Pleural_Thickening`` written ``Pleural Thickening`` (as the
public code and CXR-LT).  NIH 14 + CheXpert 13 classes, 7 shared, 20 in the union (paper 2.2).

Ablation partitioner (paper sec. 2.4.1; public code ``split_for_K_nodes`` and ``configs/exp1``):
:func:`iid_patient_subsets` cuts a data set's patients into ``n_clients`` IID subsets (no patient in two, abnormal
and normal patients dealt out separately so each subset has the same mix; each subset is 1/K of the patients,
so the per-client sample size falls by a factor K as K grows), :func:`shared_class_lists` gives each client its
class list (``n_shared`` classes held by every client, each other class by exactly one, every class at least
once), and :func:`write_nih_partition` writes one NIH-layout site folder per client (its patients, labels of its
own classes only, images linked) plus the held-out NIH test set (all 14 classes) that every model is scored on.
Switches: the number of clients, the number of shared classes, the held-out fraction and the seed.

Every data problem raises :class:`CXRDataError` naming the site, the file (and the CSV row) and the fix.
"""

from __future__ import annotations

import csv
import gzip
import io
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import Dataset

from fedssl.data.loading import CachedImageDataset, load_batches

__all__ = [
    "NIH_RAW_CLASSES",
    "NIH_CLASSES",
    "CHEXPERT_CLASSES",
    "SHARED_CLASSES",
    "ALL_CLASSES",
    "DATASETS",
    "NIH_CSV_NAMES",
    "CXRDataError",
    "CXRRecord",
    "canonical_class",
    "load_nih",
    "load_chexpert",
    "load_mimic_cxr",
    "load_cxr_site",
    "dataset_classes",
    "mimic_annotated_classes",
    "patient_split",
    "iid_patient_subsets",
    "shared_class_lists",
    "write_nih_partition",
    "external_dataset",
    "CXRDataset",
    "batches",
    "n_batches",
]

#: The 14 NIH findings in the dataset's own spelling and order (Wang et al., 2017).
NIH_RAW_CLASSES: tuple[str, ...] = (
    "Atelectasis", "Cardiomegaly", "Effusion", "Infiltration", "Mass", "Nodule", "Pneumonia", "Pneumothorax",
    "Consolidation", "Edema", "Emphysema", "Fibrosis", "Pleural_Thickening", "Hernia",
)
#: NIH / CXR-LT spellings -> this bundle's class names.
_ALIASES: dict[str, str] = {
    "Effusion": "Pleural Effusion",
    "Pleural_Thickening": "Pleural Thickening",
    "Pleural_Other": "Pleural Other",
}
NIH_CLASSES: tuple[str, ...] = tuple(_ALIASES.get(c, c) for c in NIH_RAW_CLASSES)
#: The 13 CheXpert findings (``No Finding`` excluded), in the CSV's column order.
CHEXPERT_CLASSES: tuple[str, ...] = (
    "Enlarged Cardiomediastinum", "Cardiomegaly", "Lung Opacity", "Lung Lesion", "Edema", "Consolidation",
    "Pneumonia", "Atelectasis", "Pneumothorax", "Pleural Effusion", "Pleural Other", "Fracture", "Support Devices",
)
#: The 7 findings both datasets annotate.
SHARED_CLASSES: tuple[str, ...] = tuple(c for c in NIH_CLASSES if c in CHEXPERT_CLASSES)
#: The 20 classes of the NIH + CheXpert network: NIH order, then the CheXpert-only ones in CheXpert order.
ALL_CLASSES: tuple[str, ...] = NIH_CLASSES + tuple(c for c in CHEXPERT_CLASSES if c not in NIH_CLASSES)
NO_FINDING = "No Finding"
DATASETS: tuple[str, ...] = ("nih", "chexpert", "mimic")
NIH_CSV_NAMES: tuple[str, ...] = ("Data_Entry_2017_v2020.csv", "Data_Entry_2017.csv")
MIMIC_LABELS = "mimic-cxr-2.0.0-chexpert.csv"
MIMIC_SPLIT = "mimic-cxr-2.0.0-split.csv"
MIMIC_METADATA = "mimic-cxr-2.0.0-metadata.csv"
IMAGE_EXTS = (".png", ".jpg", ".jpeg")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class CXRDataError(ValueError):
    """A problem with chest X-ray data on disk; the message names the site, the file (and row) and the fix."""


@dataclass(frozen=True)
class CXRRecord:
    """One frontal image: its path, its patient and its positive findings (class names, sorted)."""

    path: str
    patient: str
    labels: tuple[str, ...]


def _site(site: str) -> str:
    return site if site not in (None, "") else "<unnamed site>"


def _err(site: str, path: object, problem: str, fix: str, row: int | None = None) -> CXRDataError:
    where = f"{os.fspath(path)}" + (f", row {row}" if row is not None else "")
    return CXRDataError(f"[site {_site(site)}] {problem}: {where}. Fix: {fix}")


def canonical_class(name: str) -> str:
    """NIH / CXR-LT spelling -> this bundle's class name (``Effusion`` -> ``Pleural Effusion``)."""
    return _ALIASES.get(name, name)


_KNOWN = set(ALL_CLASSES)


# ----------------------------------------------------------------------------------------------- CSV helpers
def _open_text(path: Path, site: str):
    try:
        if path.suffix == ".gz":
            return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8-sig", newline="")
        return open(path, encoding="utf-8-sig", newline="")
    except OSError as exc:
        raise _err(site, path, f"cannot open CSV ({exc.__class__.__name__}: {exc})",
                   "check the file's permissions") from exc


def _read_rows(path: Path, site: str) -> tuple[list[str], list[tuple[int, list[str]]]]:
    """(header, [(line number, fields)]) of a CSV, blank lines skipped; decode errors -> CXRDataError."""
    try:
        with _open_text(path, site) as f:
            rows = [(i + 1, r) for i, r in enumerate(csv.reader(f)) if any(x.strip() for x in r)]
    except (csv.Error, UnicodeDecodeError, OSError, EOFError) as exc:
        raise _err(site, path, f"unreadable CSV ({exc.__class__.__name__}: {exc})",
                   "re-extract the file from the dataset archive") from exc
    if not rows:
        raise _err(site, path, "CSV is empty", "restore the file from the dataset archive")
    return [h.strip() for h in rows[0][1]], rows[1:]


def _find_csv(root: Path, name: str) -> Path | None:
    for cand in (root / name, root / (name + ".gz")):
        if cand.is_file():
            return cand
    return None


def _require_columns(header: list[str], needed: Sequence[str], path: Path, site: str) -> dict[str, int]:
    pos = {h: i for i, h in enumerate(header)}
    missing = [c for c in needed if c not in pos]
    if missing:
        raise _err(site, path, f"CSV lacks columns {missing} (header {header[:12]})",
                   "use the dataset's original CSV file")
    return pos


def _check_root(root: object, site: str, what: str) -> Path:
    p = Path(os.fspath(root))
    if not p.is_dir():
        raise _err(site, p, f"{what} root folder does not exist", f"point the site's data root at the {what} folder")
    return p


# ------------------------------------------------------------------------------------------------------- NIH
_BRACKET_OPEN = re.compile(r"^(?P<name>[^\[\]]+)\[(?P<a>[^\[\],]+)$")          # 'OriginalImage[Width'
_BRACKET_CLOSE = re.compile(r"^(?P<b>[^\[\],]+)\]$")                          # 'Height]'
_BRACKET_WHOLE = re.compile(r"^(?P<name>[^\[\]]+)\[(?P<a>[^\[\],]+),(?P<b>[^\[\],]+)\]$")  # quoted 'X[a,b]'


def _normalise_nih_header(header: list[str]) -> list[str]:
    """Expand the two-column bracketed headers into two names each and drop trailing empty names."""
    out: list[str] = []
    i = 0
    while i < len(header):
        h = header[i]
        m_whole = _BRACKET_WHOLE.match(h)
        m_open = _BRACKET_OPEN.match(h)
        if m_whole:
            out += [f"{m_whole['name']}_{m_whole['a']}", f"{m_whole['name']}_{m_whole['b']}"]
        elif m_open and i + 1 < len(header) and _BRACKET_CLOSE.match(header[i + 1]):
            out += [f"{m_open['name']}_{m_open['a']}", f"{m_open['name']}_{_BRACKET_CLOSE.match(header[i + 1])['b']}"]
            i += 1
        else:
            out.append(h)
        i += 1
    while out and out[-1] == "":
        out.pop()
    return out


def _index_images(root: Path, site: str) -> dict[str, Path]:
    """Image file name -> path over ``images/`` and ``images_NNN/images/`` (and ``images_NNN/``)."""
    dirs = [root / "images"]
    try:
        subs = sorted(d for d in os.listdir(root) if re.fullmatch(r"images_\d+", d))
    except OSError as exc:
        raise _err(site, root, f"cannot list NIH root ({exc})", "check the folder's permissions") from exc
    for d in subs:
        dirs += [root / d / "images", root / d]
    index: dict[str, Path] = {}
    for d in dirs:
        if not d.is_dir():
            continue
        with os.scandir(d) as it:
            for e in it:
                if e.name.lower().endswith(IMAGE_EXTS) and e.name not in index:
                    index[e.name] = Path(e.path)
    return index


def _nih_labels(value: str, path: Path, row: int, site: str) -> tuple[str, ...]:
    parts = [p.strip() for p in value.split("|")]
    if not value.strip() or any(not p for p in parts):
        raise _err(site, path, f"empty finding in 'Finding Labels' {value!r}",
                   "findings are joined by '|' (e.g. 'Cardiomegaly|Effusion'); write 'No Finding' for none", row)
    if NO_FINDING in parts:
        if len(parts) > 1:
            raise _err(site, path, f"'No Finding' together with findings in {value!r}",
                       "a row is either 'No Finding' or a '|'-joined list of findings", row)
        return ()
    unknown = [p for p in parts if p not in NIH_RAW_CLASSES and p not in NIH_CLASSES]
    if unknown:
        raise _err(site, path, f"unknown NIH findings {unknown}",
                   f"use the NIH spellings {list(NIH_RAW_CLASSES)} (or 'No Finding')", row)
    return tuple(sorted({canonical_class(p) for p in parts}))


def load_nih(root: object, site: str = "?", check_images: bool = True) -> list[CXRRecord]:
    """Records of the NIH ChestX-ray14 layout under ``root`` (CSV order; all NIH images are frontal)."""
    rp = _check_root(root, site, "NIH ChestX-ray14")
    csv_path = next((rp / n for n in NIH_CSV_NAMES if (rp / n).is_file()), None)
    if csv_path is None:
        raise _err(site, rp, f"no NIH label file ({' or '.join(NIH_CSV_NAMES)})",
                   "copy Data_Entry_2017_v2020.csv next to images/ (or write synthetic data with "
                   "fedssl.data.cxr_synthetic.write_synthetic_nih)")
    raw_header, rows = _read_rows(csv_path, site)
    header = _normalise_nih_header(raw_header)
    pos = _require_columns(header, ("Image Index", "Finding Labels", "Patient ID"), csv_path, site)
    images = _index_images(rp, site) if check_images else {}
    if check_images and not images:
        raise _err(site, rp, "no image found in images/ or images_NNN/images/", "unpack the NIH image archives")
    out = []
    for line, r in rows:
        if len(r) == len(header) + 1 and r[-1].strip() == "":
            r = r[:-1]
        if len(r) != len(header):
            raise _err(site, csv_path, f"row has {len(r)} fields, the header {len(header)} ({header})",
                       "the CSV is truncated or edited; restore it from the dataset archive", line)
        name = r[pos["Image Index"]].strip()
        patient = r[pos["Patient ID"]].strip()
        if not name or not patient:
            raise _err(site, csv_path, "empty 'Image Index' or 'Patient ID'", "every row needs both", line)
        labels = _nih_labels(r[pos["Finding Labels"]], csv_path, line, site)
        if check_images:
            if name not in images:
                raise _err(site, csv_path, f"image {name!r} listed but not found under images/",
                           "unpack every images_NNN archive, or drop the row from the CSV of this site", line)
            path = str(images[name])
        else:
            path = str(rp / "images" / name)
        out.append(CXRRecord(path=path, patient=patient, labels=labels))
    if not out:
        raise _err(site, csv_path, "CSV holds no image row", "restore the label file")
    return out


# -------------------------------------------------------------------------------------------------- CheXpert
def chexpert_value(value: str, path: Path, row: int, column: str, site: str, blanks: Sequence[str] = ("",),
                   fix: str = "use the dataset's original label file", error=None) -> float | None:
    """A CheXpert-style label cell: 1.0, 0.0 or -1.0, None when it is one of ``blanks``; anything else is a
    CXRDataError naming the file, row, column and site."""
    v = value.strip()
    if v in blanks:
        return None
    try:
        f = float(v)
    except ValueError:
        f = float("nan")
    if f not in (1.0, 0.0, -1.0):
        raise (error or _err)(site, path, f"label {column}={value!r} is not 1, 0, -1 or blank", fix, row)
    return f


def checked_rows(header: Sequence[str], rows, path: Path, site: str, fix: str = "restore the CSV", error=None):
    """Yield ``(line, fields)`` of ``rows``; a row with another number of fields than ``header`` is an error naming
    the file, the line and the site (``error(site, path, problem, fix, line)``, default a CXRDataError)."""
    for line, r in rows:
        if len(r) != len(header):
            raise (error or _err)(site, path, f"row has {len(r)} fields, the header {len(header)}", fix, line)
        yield line, r


def _binary(value: str, path: Path, row: int, column: str, site: str) -> int:
    # uncertain (-1) and blank -> negative (U-Zeros, as the paper)
    return 1 if chexpert_value(value, path, row, column, site) == 1.0 else 0


def _resolve_chexpert_path(rp: Path, rel: str) -> list[Path]:
    parts = Path(rel).parts
    cands = [rp.joinpath(*parts[1:])] if len(parts) > 1 else []
    return cands + [rp / rel, rp.parent / rel]


def load_chexpert(root: object, split: str = "train", site: str = "?", check_images: bool = True) -> list[CXRRecord]:
    """Frontal records of CheXpert ``train.csv`` or ``valid.csv`` under ``root``."""
    if split not in ("train", "valid"):
        raise ValueError(f"split={split!r}: CheXpert has 'train' and 'valid'")
    rp = _check_root(root, site, "CheXpert")
    csv_path = rp / f"{split}.csv"
    if not csv_path.is_file():
        raise _err(site, csv_path, f"CheXpert {split}.csv not found",
                   "point the data root at the folder holding train.csv/valid.csv (e.g. CheXpert-v1.0-small)")
    header, rows = _read_rows(csv_path, site)
    pos = _require_columns(header, ("Path", "Frontal/Lateral") + CHEXPERT_CLASSES, csv_path, site)
    mode: int | None = None  # which candidate resolved the first image; used first for the rest
    out = []
    for line, r in rows:
        if len(r) != len(header):
            raise _err(site, csv_path, f"row has {len(r)} fields, the header {len(header)}",
                       "restore the label file from the dataset archive", line)
        view = r[pos["Frontal/Lateral"]].strip()
        if view not in ("Frontal", "Lateral"):
            raise _err(site, csv_path, f"Frontal/Lateral={view!r}", "use 'Frontal' or 'Lateral'", line)
        if view != "Frontal":
            continue
        rel = r[pos["Path"]].strip()
        m = re.search(r"(patient\d+)", rel)
        if not rel or m is None:
            raise _err(site, csv_path, f"Path {rel!r} has no patientNNNNN component",
                       "paths look like CheXpert-v1.0-small/train/patient00001/study1/view1_frontal.jpg", line)
        labels = tuple(sorted(c for c in CHEXPERT_CLASSES if _binary(r[pos[c]], csv_path, line, c, site)))
        cands = _resolve_chexpert_path(rp, rel)
        path = cands[mode if mode is not None else 0]
        if check_images:
            order = ([mode] if mode is not None else []) + [i for i in range(len(cands)) if i != mode]
            hit = next((i for i in order if cands[i].is_file()), None)
            if hit is None:
                raise _err(site, csv_path, f"image {rel!r} not found (looked in {[str(c) for c in cands]})",
                           "keep the CSV next to the train/ and valid/ folders of the same download", line)
            mode, path = hit, cands[hit]
        out.append(CXRRecord(path=str(path), patient=m.group(1), labels=labels))
    if not out:
        raise _err(site, csv_path, "no frontal image in the CSV", "use the dataset's original label file")
    return out


# ----------------------------------------------------------------------------------------------------- MIMIC
def _mimic_csv(rp: Path, name: str, site: str) -> Path:
    p = _find_csv(rp, name)
    if p is None:
        raise _err(site, rp / name, "MIMIC-CXR-JPG file not found (also looked for .gz)",
                   "point the data root at mimic-cxr-jpg/2.0.0 (or write synthetic data with "
                   "fedssl.data.cxr_synthetic.write_synthetic_mimic_cxr)")
    return p


def _label_columns(header: list[str]) -> dict[str, int]:
    """Recognised label columns (canonical class name -> column index)."""
    return {canonical_class(h): i for i, h in enumerate(header) if canonical_class(h) in _KNOWN}


def mimic_annotated_classes(root: object, site: str = "?") -> list[str]:
    """The classes the MIMIC label file annotates, in ``ALL_CLASSES`` order."""
    rp = _check_root(root, site, "MIMIC-CXR-JPG")
    header, _ = _read_rows(_mimic_csv(rp, MIMIC_LABELS, site), site)
    cols = _label_columns(header)
    return [c for c in ALL_CLASSES if c in cols]


def load_mimic_cxr(root: object, split: str = "test", site: str = "?", check_images: bool = True) -> list[CXRRecord]:
    """Frontal (PA/AP) records of MIMIC-CXR-JPG, official ``split`` ("train", "validate", "test" or "all")."""
    if split not in ("train", "validate", "test", "all"):
        raise ValueError(f"split={split!r}: MIMIC-CXR-JPG splits are 'train', 'validate', 'test' (or 'all')")
    rp = _check_root(root, site, "MIMIC-CXR-JPG")
    lab_path = _mimic_csv(rp, MIMIC_LABELS, site)
    header, rows = _read_rows(lab_path, site)
    by_dicom = "dicom_id" in header
    pos = _require_columns(header, ("dicom_id",) if by_dicom else ("subject_id", "study_id"), lab_path, site)
    cols = _label_columns(header)
    if not cols:
        raise _err(site, lab_path, f"no label column recognised in {header}",
                   f"label columns are named like {list(CHEXPERT_CLASSES)}")
    labels: dict[tuple[str, ...], tuple[str, ...]] = {}
    for line, r in rows:
        if len(r) != len(header):
            raise _err(site, lab_path, f"row has {len(r)} fields, the header {len(header)}", "restore the label file",
                       line)
        key = (r[pos["dicom_id"]].strip(),) if by_dicom else (r[pos["subject_id"]].strip(), r[pos["study_id"]].strip())
        labels[key] = tuple(sorted(c for c, i in cols.items() if _binary(r[i], lab_path, line, header[i], site)))
    sp_path = _mimic_csv(rp, MIMIC_SPLIT, site)
    sh, srows = _read_rows(sp_path, site)
    spos = _require_columns(sh, ("dicom_id", "split"), sp_path, site)
    split_of: dict[str, str] = {}
    for line, r in srows:
        if len(r) != len(sh):
            raise _err(site, sp_path, f"row has {len(r)} fields, the header {len(sh)}", "restore the split file", line)
        split_of[r[spos["dicom_id"]].strip()] = r[spos["split"]].strip()
    md_path = _mimic_csv(rp, MIMIC_METADATA, site)
    mh, mrows = _read_rows(md_path, site)
    mpos = _require_columns(mh, ("dicom_id", "subject_id", "study_id", "ViewPosition"), md_path, site)
    out = []
    for line, r in mrows:
        if len(r) != len(mh):
            raise _err(site, md_path, f"row has {len(r)} fields, the header {len(mh)}", "restore the metadata file",
                       line)
        dicom, subject, study = (r[mpos[c]].strip() for c in ("dicom_id", "subject_id", "study_id"))
        if r[mpos["ViewPosition"]].strip() not in ("PA", "AP"):
            continue
        if dicom not in split_of:
            raise _err(site, md_path, f"dicom_id {dicom!r} is missing from {sp_path.name}",
                       "use the split and metadata files of the same release", line)
        if split != "all" and split_of[dicom] != split:
            continue
        key = (dicom,) if by_dicom else (subject, study)
        if key not in labels:
            continue  # the label file covers labelled studies only (as the release)
        if not subject.isdigit() or not study.isdigit():
            raise _err(site, md_path, f"subject_id {subject!r} / study_id {study!r} are not numbers",
                       "use the dataset's original metadata file", line)
        path = rp / "files" / f"p{subject[:2]}" / f"p{subject}" / f"s{study}" / f"{dicom}.jpg"
        if check_images and not path.is_file():
            raise _err(site, md_path, f"image {path.relative_to(rp)} not found",
                       "download the files/ tree of the same release", line)
        out.append(CXRRecord(path=str(path), patient=subject, labels=labels[key]))
    if not out:
        raise _err(site, md_path, f"no labelled frontal image in split {split!r}", "check the split name and files")
    return out


# ---------------------------------------------------------------------------------------------------- common
def load_cxr_site(root: object, dataset: str, site: str = "?", split: str | None = None,
                  check_images: bool = True) -> list[CXRRecord]:
    """Records of one site folder: ``dataset`` "nih" | "chexpert" (split "train"/"valid") | "mimic"
    (split "train"/"validate"/"test"/"all", default "test")."""
    if dataset == "nih":
        if split not in (None, "all"):
            raise ValueError(f"split={split!r}: NIH has one label file; split by patient with patient_split")
        return load_nih(root, site, check_images)
    if dataset == "chexpert":
        return load_chexpert(root, split or "train", site, check_images)
    if dataset == "mimic":
        return load_mimic_cxr(root, split or "test", site, check_images)
    raise ValueError(f"dataset={dataset!r}: use one of {list(DATASETS)}")


def dataset_classes(dataset: str, root: object | None = None, site: str = "?") -> list[str]:
    """The classes a dataset annotates: NIH 14, CheXpert 13, MIMIC the recognised label columns (needs root)."""
    if dataset == "nih":
        return list(NIH_CLASSES)
    if dataset == "chexpert":
        return list(CHEXPERT_CLASSES)
    if dataset == "mimic":
        return mimic_annotated_classes(root, site) if root is not None else list(CHEXPERT_CLASSES)
    raise ValueError(f"dataset={dataset!r}: use one of {list(DATASETS)}")


def patient_split(records: Sequence[CXRRecord], fractions: Sequence[float] = (0.7, 0.1, 0.2),
                  seed: int = 0) -> tuple[list[CXRRecord], list[CXRRecord], list[CXRRecord]]:
    """Train / val / test by patient (no patient in two splits), seeded.

    As the public code, patients with any finding and patients without are shuffled and cut separately, so
    both kinds land in every split in the given proportions.  Records keep their input order in each split.
    """
    fr = [float(f) for f in fractions]
    if len(fr) != 3 or any(f < 0 for f in fr) or abs(sum(fr) - 1.0) > 1e-6:
        raise ValueError(f"fractions={list(fractions)!r}: three non-negative numbers summing to 1, e.g. [0.7, 0.1, "
                         "0.2]")
    abnormal: dict[str, bool] = {}
    for r in records:
        abnormal[r.patient] = abnormal.get(r.patient, False) or bool(r.labels)
    rng = np.random.default_rng(seed)
    assign: dict[str, int] = {}
    bounds = np.cumsum(fr)
    for group in (True, False):
        pats = sorted(p for p, a in abnormal.items() if a == group)
        pats = [pats[i] for i in rng.permutation(len(pats))]
        cuts = [int(round(b * len(pats))) for b in bounds]
        for i, p in enumerate(pats):
            assign[p] = next(k for k, c in enumerate(cuts) if i < c) if i < cuts[-1] else 2
    out: tuple[list, list, list] = ([], [], [])
    for r in records:
        out[assign[r.patient]].append(r)
    return out


# ------------------------------------------------------------------------------------------------- ablation partitioner
def _abnormal_groups(records: Sequence[CXRRecord]) -> tuple[list[str], list[str]]:
    """(patients with any finding, patients without), each sorted."""
    abnormal: dict[str, bool] = {}
    for r in records:
        abnormal[r.patient] = abnormal.get(r.patient, False) or bool(r.labels)
    return sorted(p for p, a in abnormal.items() if a), sorted(p for p, a in abnormal.items() if not a)


def iid_patient_subsets(records: Sequence[CXRRecord], n_clients: int, seed: int = 0) -> list[list[CXRRecord]]:
    """``n_clients`` IID subsets of ``records`` by patient (public code ``split_for_K_nodes``): abnormal and normal
    patients are each shuffled (seeded) and cut into ``n_clients`` chunks of ``floor(n / n_clients)`` patients, the
    ``< n_clients`` left over in each group unused, so every client holds 1/K of each group.  Records keep their
    input order within a subset."""
    if not isinstance(n_clients, int) or isinstance(n_clients, bool) or n_clients < 1:
        raise ValueError(f"n_clients={n_clients!r}: use a positive number of clients (paper sec. 2.4.1: 2 to 10)")
    rng = np.random.default_rng(seed)
    owner: dict[str, int] = {}
    for group in _abnormal_groups(records):
        shuffled = [group[i] for i in rng.permutation(len(group))]
        size = len(group) // n_clients
        for k in range(n_clients):
            owner.update({p: k for p in shuffled[k * size:(k + 1) * size]})
    subsets: list[list[CXRRecord]] = [[] for _ in range(n_clients)]
    for r in records:
        if r.patient in owner:
            subsets[owner[r.patient]].append(r)
    if any(not s for s in subsets):
        raise ValueError(f"{len({r.patient for r in records})} patients cannot fill {n_clients} IID subsets; "
                         "use fewer clients or more patients")
    return subsets


def shared_class_lists(classes: Sequence[str], n_clients: int, n_shared: int, seed: int = 0) -> list[list[str]]:
    """Each client's classes for the shared-classes ablation (paper sec. 2.4.1; public ``configs/exp1/exp1.2``):
    ``n_shared`` classes drawn (seeded) are held by every client; the others, shuffled, are dealt round-robin so
    each is held by exactly one client.  Every class is held at least once; each list is in ``classes``' order."""
    classes = list(classes)
    if not isinstance(n_shared, int) or isinstance(n_shared, bool) or not 0 <= n_shared <= len(classes):
        raise ValueError(f"n_shared={n_shared!r}: use 0 to {len(classes)} classes held by every client")
    if not isinstance(n_clients, int) or isinstance(n_clients, bool) or n_clients < 1:
        raise ValueError(f"n_clients={n_clients!r}: use a positive number of clients")
    if n_shared == 0 and len(classes) < n_clients:
        raise ValueError(f"{len(classes)} classes and none shared leave a client of {n_clients} without classes; "
                         "share at least one class or use fewer clients")
    order = [classes[i] for i in np.random.default_rng(seed).permutation(len(classes))]
    shared, rest = set(order[:n_shared]), order[n_shared:]
    held = [set(shared) for _ in range(n_clients)]
    for i, c in enumerate(rest):
        held[i % n_clients].add(c)
    return [[c for c in classes if c in h] for h in held]


def _write_nih_subset(out: Path, records: Sequence[CXRRecord], classes: Sequence[str]) -> dict:
    """An NIH-layout folder: the label file (positives among ``classes`` only) and ``images/`` linking each image."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "images").mkdir(exist_ok=True)
    raw = {canonical_class(c): c for c in NIH_RAW_CLASSES}
    lines = ["Image Index,Finding Labels,Patient ID"]
    for r in records:
        name = os.path.basename(r.path)
        link = out / "images" / name
        if not link.exists():
            os.symlink(os.path.abspath(r.path), link)
        found = "|".join(raw[c] for c in classes if c in r.labels) or NO_FINDING
        lines.append(f"{name},{found},{r.patient}")
    (out / NIH_CSV_NAMES[0]).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return {"classes": list(classes), "n_images": len(records), "n_patients": len({r.patient for r in records})}


def write_nih_partition(root: object, out: object, n_clients: int, n_shared: int, seed: int = 0,
                        holdout: float = 0.2) -> dict:
    """The ablation data of paper sec. 2.4.1 from the NIH folder ``root``: ``holdout`` of the patients (by patient,
    seeded) -> ``out/nih_test`` (every class: the held-out NIH test set, given to the sites as
    ``external_test_root``); the rest -> ``n_clients`` IID subsets ``out/site-1`` ... with the class lists of
    :func:`shared_class_lists`.  Returns ``{"sites": {site: {"classes", "n_images", "n_patients"}},
    "held_out": {...}, "classes": {site: [...]}}`` (``classes`` is the executor's per-site ``classes`` value)."""
    if not 0.0 < float(holdout) < 1.0:
        raise ValueError(f"holdout={holdout!r}: use the fraction of patients held out for testing, e.g. 0.2")
    records = load_nih(root, site="<partition>")
    rest, _, held = patient_split(records, fractions=(1.0 - float(holdout), 0.0, float(holdout)), seed=seed)
    subsets = iid_patient_subsets(rest, n_clients, seed=seed)
    lists = shared_class_lists(NIH_CLASSES, n_clients, n_shared, seed=seed)
    op = Path(os.fspath(out))
    sites = {f"site-{k + 1}": _write_nih_subset(op / f"site-{k + 1}", sub, cl)
             for k, (sub, cl) in enumerate(zip(subsets, lists))}
    return {"sites": sites, "held_out": _write_nih_subset(op / "nih_test", held, NIH_CLASSES),
            "classes": {s: v["classes"] for s, v in sites.items()}}


def external_dataset(root: object) -> str:
    """The layout of an external test folder: "nih" when it holds an NIH label file (the ablation's held-out NIH
    test set), else "mimic" (MIMIC-CXR-JPG)."""
    rp = Path(os.fspath(root))
    return "nih" if any((rp / n).is_file() for n in NIH_CSV_NAMES) else "mimic"


# ---------------------------------------------------------------------------------------------------- images
def _load_resized(path: str, size: int, site: str) -> np.ndarray:
    """Grayscale uint8 [size, size]: aspect kept, longer side = size, zero padded (resize_with_pad)."""
    try:
        with Image.open(path) as im:
            im.load()
            g = im.convert("L") if im.mode != "I;16" else Image.fromarray((np.asarray(im) >> 8).astype(np.uint8))
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise _err(site, path, f"unreadable image ({exc.__class__.__name__}: {exc})",
                   "re-extract the image (or drop its row from the site's CSV)") from exc
    w, h = g.size
    s = size / max(w, h)
    nw, nh = max(1, round(w * s)), max(1, round(h * s))
    g = g.resize((nw, nh), Image.BILINEAR)
    out = np.zeros((size, size), dtype=np.uint8)
    top, left = (size - nh) // 2, (size - nw) // 2
    out[top:top + nh, left:left + nw] = np.asarray(g)
    return out


class CXRDataset(CachedImageDataset):
    """Images + multi-hot targets over ``classes``: item -> ``(FloatTensor [3, S, S], FloatTensor [len(classes)])``.

    ``target[j] = 1`` iff ``classes[j]`` is among the record's positive findings (a class the record's
    dataset does not annotate reads 0: vanilla FL's "missing as negative"; partial loss masks it out).
    Images are read once, resized with padding to ``image_size`` and cached in memory as uint8.
    Training augmentation (public code, Keras layers): random rotation by up to ``rotation`` x 360 degrees
    (0.2 -> +-72), horizontal flip, zoom by up to ``zoom`` (independently in height and width, 0.5 -> 50 %),
    contrast factor in ``[1 - contrast, 1 + contrast]`` around the image mean; reflection fill.  Then
    gray -> 3 channels and ImageNet normalisation.  Augmentation is reproducible from (seed, epoch, index).
    """

    def __init__(self, records: Sequence[CXRRecord], classes: Sequence[str], image_size: int = 224,
                 train: bool = False, site: str = "?", cache: bool = True, seed: int = 0,
                 rotation: float = 0.2, zoom: float = 0.5, contrast: float = 0.75, flip: bool = True):
        from fedssl.core.surgical import check_class_list

        self.classes = check_class_list(list(classes), site)
        if not isinstance(image_size, int) or image_size < 8:
            raise ValueError(f"image_size={image_size!r}: use an int >= 8 (paper 224)")
        for name, v, hi in (("rotation", rotation, 0.5), ("zoom", zoom, 0.9), ("contrast", contrast, 1.0)):
            if not 0.0 <= float(v) <= hi:
                raise ValueError(f"{name}={v!r}: use a value in [0, {hi}]")
        self.records = list(records)
        self.image_size, self.train, self.site = image_size, bool(train), site
        self.cache, self.seed, self.epoch = cache, int(seed), 0
        self.rotation, self.zoom, self.contrast, self.flip = float(rotation), float(zoom), float(contrast), bool(flip)
        self._cache: dict[int, np.ndarray] = {}
        col = {c: j for j, c in enumerate(self.classes)}
        self.targets = torch.zeros(len(self.records), len(self.classes))
        for i, r in enumerate(self.records):
            for c in r.labels:
                if c in col:
                    self.targets[i, col[c]] = 1.0
        self._mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
        self._std = torch.tensor(IMAGENET_STD).view(3, 1, 1)

    def decoded(self, index: int) -> np.ndarray:
        return self.gray(index)

    def gray(self, index: int) -> np.ndarray:
        """The cached uint8 [S, S] image of item ``index`` (no augmentation)."""
        if index in self._cache:
            return self._cache[index]
        img = _load_resized(self.records[index].path, self.image_size, self.site)
        if self.cache:
            self._cache[index] = img
        return img

    def _augment(self, x: torch.Tensor, index: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(int(np.random.default_rng([self.seed, self.epoch, index]).integers(2**62)))
        u = torch.rand(5, generator=g)
        theta = (2 * u[0] - 1) * self.rotation * 2 * np.pi
        zh, zw = 1 + (2 * u[1] - 1) * self.zoom, 1 + (2 * u[2] - 1) * self.zoom
        fl = -1.0 if (self.flip and u[3] < 0.5) else 1.0
        c, s = torch.cos(theta), torch.sin(theta)
        # output -> input sampling grid: flip, rotate, then scale (zoom > 1 samples a larger area: zoom out)
        a = torch.stack([torch.stack([c * zw * fl, -s * zw, torch.tensor(0.0)]),
                         torch.stack([s * zh * fl, c * zh, torch.tensor(0.0)])]).unsqueeze(0)
        grid = F.affine_grid(a, [1, 1, *x.shape[-2:]], align_corners=False)
        x = F.grid_sample(x.unsqueeze(0), grid, mode="bilinear", padding_mode="reflection", align_corners=False)[0]
        factor = 1 + (2 * u[4] - 1) * self.contrast
        m = x.mean()
        return ((x - m) * factor + m).clamp(0.0, 1.0)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} images")
        x = torch.from_numpy(self.gray(index).astype(np.float32) / 255.0).unsqueeze(0)
        if self.train:
            x = self._augment(x, index)
        x = (x.expand(3, -1, -1) - self._mean) / self._std
        return x.contiguous(), self.targets[index].clone()


def n_batches(dataset: Dataset, batch_size: int, drop_last: bool = False, max_batches: int = 0) -> int:
    n = len(dataset) // batch_size if drop_last else -(-len(dataset) // batch_size)
    return min(n, max_batches) if max_batches else n


def batches(dataset: Dataset, batch_size: int, seed: int = 0, epoch: int = 0, shuffle: bool = True,
            drop_last: bool = False, max_batches: int = 0, *, workers: int = 0,
            pin_memory: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """One epoch of ``(x [B, 3, S, S], y [B, C])``; the order (when ``shuffle``) and the augmentation are
    reproducible from (seed, epoch). ``workers`` / ``pin_memory``: :func:`fedssl.data.loading.load_batches`
    (the same batches from worker processes)."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}: use a positive int (paper 64)")
    if hasattr(dataset, "set_epoch"):
        dataset.set_epoch(epoch)
    order = np.random.default_rng([seed, epoch]).permutation(len(dataset)) if shuffle else np.arange(len(dataset))
    yield from load_batches(dataset, [order[b * batch_size:(b + 1) * batch_size]
                                      for b in range(n_batches(dataset, batch_size, drop_last, max_batches))],
                            workers=workers, pin_memory=pin_memory)
