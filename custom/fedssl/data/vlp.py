"""Image-text data for FedDRA: federated vision-language pre-training on chest X-rays and fundus photographs.

FedDRA is "Distributionally Robust Alignment for Medical Federated Vision-Language Pre-training Under Data
Heterogeneity" (TMLR).  Its data (section 5.1 and appendix A):

* MIMIC-CXR image-report pairs cut into 5 clients by LDA (Dirichlet) over a disease code.  Following Bannur et
  al. ("Learning to exploit temporal structure for biomedical vision-language processing", CVPR 2023) the 5
  findings :data:`FEDDRA_FINDINGS` are used: "We set the non-NaN value to 1 and then set NaN value to 0 to
  construct a 5-way binary multi-label. Then we get 2^5-category multi-class label and run LDA on them"
  (heterogeneity alpha = 1; 5 in the analysis).  Each client keeps the official train / test split.
* Ophthalmology: MESSIDOR-2 (France) and BRSET (Brazil), one client each, with the tabular DR grade and edema
  risk turned into captions "retinal image with {DR status} and {edema risk}".
* Out-of-distribution few-shot linear-probe sets: RSNA Pneumonia Detection and COVIDx CXR.

Real layouts read (the synthetic stand-ins of :mod:`fedssl.data.vlp_synthetic` are written in the same ones):

MIMIC-CXR + MIMIC-CXR-JPG (:func:`load_mimic_vlp`; ``root`` = ``mimic-cxr-jpg/2.0.0``, reports from MIMIC-CXR's
``mimic-cxr-reports`` folder, by default the same root; the CSVs plain or ``.csv.gz``)::

    files/p10/p10000032/s50414267.txt                 free-text report of study 50414267 (reports_root)
    files/p10/p10000032/s50414267/<dicom_id>.jpg      its images
    mimic-cxr-2.0.0-chexpert.csv   subject_id,study_id,<14 CheXpert label columns>  (1.0 / 0.0 / -1.0 / blank)
    mimic-cxr-2.0.0-split.csv      dicom_id,study_id,subject_id,split               (train / validate / test)
    mimic-cxr-2.0.0-metadata.csv   dicom_id,subject_id,study_id,...,ViewPosition,...

  Frontal images (``ViewPosition`` PA or AP) only.  The text is the report's FINDINGS and IMPRESSION sections
  (:func:`parse_report`, :func:`report_text`); a report with neither, or a missing report file, is skipped and
  counted.  ``validate`` counts as ``train`` (the paper uses the official train and test splits).

MESSIDOR-2 (:func:`load_messidor2`), as distributed on Kaggle with the adjudicated grades of Krause et al.
("Grader variability and the importance of reference standards for evaluating machine learning models for
diabetic retinopathy", Ophthalmology 2018)::

    messidor_data.csv       image_id,adjudicated_dr_grade,adjudicated_dme,adjudicated_gradable
    IMAGES/<image>          (or messidor-2/preprocess/<image>; .png / .jpg / .jpeg / .tif, matched by file stem)

BRSET (:func:`load_brset`; Nakayama et al., "A Brazilian multilabel ophthalmological dataset (BRSET)", PhysioNet
2023)::

    labels_brset.csv (or labels.csv)   image_id,patient_id,...,DR_ICDR,...,macular_edema,...
    fundus_photos/<image_id>.jpg

RSNA Pneumonia Detection (:func:`load_rsna_pneumonia`; Shih et al., Radiology: AI 2019; Kaggle layout with the
DICOMs converted to PNG/JPEG)::

    stage_2_train_labels.csv    patientId,x,y,width,height,Target   (one row per box; Target 0 rows without box)
    stage_2_train_images/<patientId>.png

COVIDx CXR (:func:`load_covidx`; Wang et al., "COVID-Net", Scientific Reports 2020)::

    train.txt, test.txt (val.txt)   "patient_id filename label source" per line
    train/<filename>, test/<filename>

Client manifests (:func:`write_client_manifests`, :func:`write_source_manifests`, :func:`load_manifest`)::

    <out>/site-<i>/manifest.csv    image,text_source,split,patient,study,labels
    <out>/split_summary.json

Every problem with files on disk raises :class:`VLPDataError` (a :class:`fedssl.data.cxr.CXRDataError`) naming
the site, the file (and the row) and the fix; bad arguments raise ``ValueError`` naming the argument.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from fedssl.core.checks import require, require_choice, require_int
from fedssl.core.dirichlet import class_counts, dirichlet_split
from fedssl.data.cxr import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    MIMIC_LABELS,
    MIMIC_METADATA,
    MIMIC_SPLIT,
    CXRDataError,
    checked_rows,
    chexpert_value,
    _check_root,
    _err as _cxr_err,
    _mimic_csv,
    _read_rows,
    _require_columns,
)
from fedssl.data.images import _decode
from fedssl.data.loading import CachedImageDataset
from fedssl.data.views import crop_box

__all__ = [
    "FEDDRA_FINDINGS",
    "N_CODES",
    "DR_STATUS",
    "EDEMA_RISK",
    "CAPTION_SCHEMES",
    "CAPTION_PREFIX",
    "COVIDX_CLASSES_V3",
    "COVIDX_CLASSES_OLD",
    "RSNA_CLASSES",
    "COLOURS",
    "VLPDataError",
    "VLPRecord",
    "finding_code",
    "parse_report",
    "report_text",
    "load_mimic_vlp",
    "lda_client_split",
    "code_histograms",
    "mean_tv_distance",
    "write_client_manifests",
    "write_source_manifests",
    "load_manifest",
    "retina_caption",
    "patient_test_split",
    "load_messidor2",
    "load_brset",
    "load_rsna_pneumonia",
    "covidx_classes",
    "load_covidx",
    "VLPDataset",
    "collate_vlp",
]

#: FedDRA's 5 findings (appendix A.1, after Bannur et al. 2023), in code-bit order (bit i = finding i)
FEDDRA_FINDINGS: tuple[str, ...] = ("Edema", "Pleural Effusion", "Consolidation", "Pneumothorax", "Pneumonia")
#: number of LDA classes: 2^5 finding combinations
N_CODES = 2 ** len(FEDDRA_FINDINGS)
MANIFEST_COLUMNS = ("image", "text_source", "split", "patient", "study", "labels")
SPLITS = ("train", "test")
_FRONTAL = ("PA", "AP")
_LATERAL = ("LATERAL", "LL", "RL")
RETINA_EXTS = (".png", ".jpg", ".jpeg", ".tif", ".tiff")

# ------------------------------------------------------------------------------------------------- records


class VLPDataError(CXRDataError):
    """A problem with image-text data on disk; the message names the site, the file (and row) and the fix."""


def _err(site: str, path: object, problem: str, fix: str, row: int | None = None) -> VLPDataError:
    return VLPDataError(str(_cxr_err(site, path, problem, fix, row)))


@dataclass(frozen=True)
class VLPRecord:
    """One image-text pair.

    ``image``: absolute image path; ``text``: the report text (FINDINGS + IMPRESSION) or the caption used for
    pre-training; ``labels``: MIMIC the 5 :data:`FEDDRA_FINDINGS` as 0/1 (FedDRA's non-NaN rule), retina
    ``(dr_grade, edema_risk)``; ``patient`` / ``study``: ids (retina: study = the image's file stem);
    ``split``: "train" or "test"; ``text_source``: where ``text`` came from (the report file; "" for captions
    made from tabular labels).
    """

    image: str
    text: str
    labels: tuple[int, ...]
    patient: str
    study: str
    split: str
    text_source: str = field(default="")


def finding_code(labels: Sequence[int]) -> int:
    """The 2^5 LDA class of a 5-finding label vector: ``sum(labels[i] << i)`` (bit i = ``FEDDRA_FINDINGS[i]``).

    ``(1, 0, 1, 0, 0)`` (Edema, Consolidation) -> 5; ``(0, 0, 0, 0, 1)`` (Pneumonia) -> 16.
    """
    v = tuple(labels)
    require(len(v) == len(FEDDRA_FINDINGS) and all(x in (0, 1) for x in v), "finding_code", "labels", labels,
            f"give {len(FEDDRA_FINDINGS)} values 0/1 in the order {FEDDRA_FINDINGS}")
    return int(sum(int(x) << i for i, x in enumerate(v)))


# ------------------------------------------------------------------------------------------- report parsing
#: a section header: at the start of a line, upper-case words (spaces, ( ) / , & - allowed), then a colon
_HEADER = re.compile(r"^[ \t]*([A-Z][A-Z ()/,&-]*[A-Z)])[ \t]*:", re.MULTILINE)
#: header name -> the section it opens (others: any other section, which ends FINDINGS / IMPRESSION)
_SECTION_OF = {
    "FINDINGS": "findings", "FINDING": "findings",
    "IMPRESSION": "impression", "IMPRESSIONS": "impression", "CONCLUSION": "impression", "CONCLUSIONS": "impression",
    "FINDINGS AND IMPRESSION": "impression", "FINDINGS/IMPRESSION": "impression",
    "IMPRESSION AND FINDINGS": "impression",
}


def _collapse(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def parse_report(text: str) -> dict:
    """The FINDINGS and IMPRESSION sections of a MIMIC-CXR free-text report, whitespace collapsed.

    A section starts at an upper-case header at the start of a line ("FINDINGS:", "IMPRESSION:", "INDICATION:",
    "WET READ:" ...; the text may follow on the same line) and ends at the next such header.  As the section
    parser released with MIMIC-CXR (Johnson et al.), "CONCLUSION" and headers naming both ("FINDINGS AND
    IMPRESSION") count as the impression; a section present several times is joined; an empty section is absent.
    The preamble ("FINAL REPORT", "WET READ" ...) and every other section are dropped.  Negations stay in the
    text ("No pleural effusion.").

    Returns:
        ``{"findings": str | None, "impression": str | None}``.
    """
    if not isinstance(text, str):
        raise ValueError(f"parse_report: argument text={type(text).__name__} is invalid; pass the report as a str")
    heads = list(_HEADER.finditer(text))
    parts: dict[str, list[str]] = {"findings": [], "impression": []}
    for k, m in enumerate(heads):
        name = _SECTION_OF.get(_collapse(m.group(1)))
        if name is None:
            continue
        end = heads[k + 1].start() if k + 1 < len(heads) else len(text)
        body = _collapse(text[m.end():end])
        if body:
            parts[name].append(body)
    return {k: (" ".join(v) if v else None) for k, v in parts.items()}


def report_text(text: str) -> str | None:
    """FINDINGS + " " + IMPRESSION of a report (whichever exist); None when it has neither."""
    sec = parse_report(text)
    got = [s for s in (sec["findings"], sec["impression"]) if s]
    return " ".join(got) if got else None


# ---------------------------------------------------------------------------------------------------- MIMIC
_NAN = ("", "nan", "NaN", "NAN")


def _feddra_value(value: str, path: Path, row: int, column: str, site: str) -> int:
    """FedDRA's rule: any non-NaN value (1, 0 or -1) -> 1, NaN / blank -> 0."""
    v = chexpert_value(value, path, row, column, site, blanks=_NAN,
                       fix="use the dataset's original mimic-cxr-2.0.0-chexpert.csv", error=_err)
    return 0 if v is None else 1


def _report_path(reports_root: Path, subject: str, study: str) -> Path:
    return reports_root / "files" / f"p{subject[:2]}" / f"p{subject}" / f"s{study}.txt"


def _read_text(path: Path, site: str) -> str | None:
    """The file's text, or None when it does not exist; unreadable -> VLPDataError."""
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise _err(site, path, f"cannot read report ({exc.__class__.__name__}: {exc})",
                   "check the file's permissions or re-extract mimic-cxr-reports") from exc


def load_mimic_vlp(root: object, site: str = "?", check_images: bool = True,
                   reports_root: object | None = None) -> tuple[list[VLPRecord], dict]:
    """Frontal image-report pairs of MIMIC-CXR(-JPG) under ``root`` (metadata-file order), FedDRA labels.

    Args:
        root: the ``mimic-cxr-jpg/2.0.0`` folder (``files/`` images and the three CSVs, plain or ``.gz``).
        site: named in error messages.
        check_images: a listed frontal image missing on disk is an error (else paths are not checked).
        reports_root: the folder whose ``files/pNN/pNNNNNNNN/sNNNNNNNN.txt`` are the reports (MIMIC-CXR's
            ``mimic-cxr-reports``); default ``root``.

    Labels: for each of :data:`FEDDRA_FINDINGS`, 1 when the CheXpert value is not NaN (1.0, 0.0 or -1.0) and 0
    when blank, as FedDRA's client split (appendix A.1).  ``validate`` images get split "train".

    Returns:
        ``(records, counts)``; counts are of metadata rows (images): ``images`` (kept), ``studies``,
        ``patients``, ``train``, ``test`` (kept images per split), ``skipped_lateral`` (ViewPosition LATERAL / LL
        / RL), ``skipped_other_view`` (any other non-PA/AP view, e.g. blank), ``skipped_no_labels`` (frontal,
        study absent from the label file), ``skipped_no_report`` (report file missing), ``skipped_no_sections``
        (report with neither FINDINGS nor IMPRESSION).
    """
    rp = _check_root(root, site, "MIMIC-CXR-JPG")
    rr = rp if reports_root is None else Path(os.fspath(reports_root))
    if not rr.is_dir():
        raise _err(site, rr, "reports_root folder does not exist",
                   "point reports_root at mimic-cxr-reports (the folder holding files/pNN/pNNNNNNNN/sNNNNNNNN.txt)")
    lab_path = _mimic_csv(rp, MIMIC_LABELS, site)
    header, rows = _read_rows(lab_path, site)
    pos = _require_columns(header, ("subject_id", "study_id") + FEDDRA_FINDINGS, lab_path, site)
    labels: dict[tuple[str, str], tuple[int, ...]] = {}
    for line, r in checked_rows(header, rows, lab_path, site, "restore the label file", error=_err):
        key = (r[pos["subject_id"]].strip(), r[pos["study_id"]].strip())
        labels[key] = tuple(_feddra_value(r[pos[c]], lab_path, line, c, site) for c in FEDDRA_FINDINGS)
    sp_path = _mimic_csv(rp, MIMIC_SPLIT, site)
    sh, srows = _read_rows(sp_path, site)
    spos = _require_columns(sh, ("dicom_id", "split"), sp_path, site)
    split_of: dict[str, str] = {}
    for line, r in checked_rows(sh, srows, sp_path, site, "restore the split file", error=_err):
        s = r[spos["split"]].strip()
        if s not in ("train", "validate", "test"):
            raise _err(site, sp_path, f"split {s!r} is not train, validate or test", "restore the split file", line)
        split_of[r[spos["dicom_id"]].strip()] = "test" if s == "test" else "train"
    md_path = _mimic_csv(rp, MIMIC_METADATA, site)
    mh, mrows = _read_rows(md_path, site)
    mpos = _require_columns(mh, ("dicom_id", "subject_id", "study_id", "ViewPosition"), md_path, site)
    counts = {k: 0 for k in ("images", "studies", "patients", "train", "test", "skipped_lateral", "skipped_other_view",
                             "skipped_no_labels", "skipped_no_report", "skipped_no_sections")}
    texts: dict[tuple[str, str], str | None | bool] = {}  # study -> text, None (no sections), False (no report)
    out: list[VLPRecord] = []
    for line, r in checked_rows(mh, mrows, md_path, site, "restore the metadata file", error=_err):
        dicom, subject, study = (r[mpos[c]].strip() for c in ("dicom_id", "subject_id", "study_id"))
        view = r[mpos["ViewPosition"]].strip().upper()
        if view not in _FRONTAL:
            counts["skipped_lateral" if view in _LATERAL else "skipped_other_view"] += 1
            continue
        if not subject.isdigit() or not study.isdigit() or not dicom:
            raise _err(site, md_path, f"dicom_id {dicom!r} / subject_id {subject!r} / study_id {study!r} malformed",
                       "use the dataset's original metadata file", line)
        if dicom not in split_of:
            raise _err(site, md_path, f"dicom_id {dicom!r} is missing from {sp_path.name}",
                       "use the split and metadata files of the same release", line)
        key = (subject, study)
        if key not in labels:
            counts["skipped_no_labels"] += 1
            continue
        rep = _report_path(rr, subject, study)
        if key not in texts:
            raw = _read_text(rep, site)
            texts[key] = False if raw is None else report_text(raw)
        text = texts[key]
        if text is False:
            counts["skipped_no_report"] += 1
            continue
        if text is None:
            counts["skipped_no_sections"] += 1
            continue
        img = rp / "files" / f"p{subject[:2]}" / f"p{subject}" / f"s{study}" / f"{dicom}.jpg"
        if check_images and not img.is_file():
            raise _err(site, md_path, f"image {img.relative_to(rp)} not found",
                       "download the files/ tree of the same MIMIC-CXR-JPG release", line)
        split = split_of[dicom]
        out.append(VLPRecord(image=str(img.absolute()), text=str(text), labels=labels[key], patient=subject,
                             study=study, split=split, text_source=str(rep.absolute())))
        counts[split] += 1
    if not out:
        if counts["skipped_no_report"]:
            raise _err(site, rr / "files", f"no report found for any of the {counts['skipped_no_report']} frontal "
                       "images", "pass reports_root= the mimic-cxr-reports folder holding files/pNN/pNNNNNNNN/"
                       "sNNNNNNNN.txt")
        raise _err(site, md_path, f"no frontal image with a labelled study and a report ({counts})",
                   "check that the CSVs, files/ and the reports come from the same release")
    counts["images"] = len(out)
    counts["studies"] = len({(r.patient, r.study) for r in out})
    counts["patients"] = len({r.patient for r in out})
    return out, counts


# ---------------------------------------------------------------------------------------------------- split
def _study_groups(records: Sequence[VLPRecord]) -> tuple[list[tuple[str, str]], dict[tuple[str, str], list[int]]]:
    order: list[tuple[str, str]] = []
    groups: dict[tuple[str, str], list[int]] = {}
    for i, r in enumerate(records):
        key = (r.patient, r.study)
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(i)
    return order, groups


def lda_client_split(records: Sequence[VLPRecord], n_clients: int = 5, alpha: float = 1.0, seed: int = 0,
                     min_per_client: int = 10) -> list[list[VLPRecord]]:
    """FedDRA's heterogeneous clients: Dirichlet (LDA) label skew over the 2^5 finding code, at the study level.

    Each study (``(patient, study)``; its code = :func:`finding_code` of its first record's labels - MIMIC labels
    are per study) is one item of :func:`fedssl.core.dirichlet.dirichlet_split` (SSL-FL's splitter, Yan et al.,
    "Label-efficient self-supervised federated learning for tackling data heterogeneity in medical imaging",
    IEEE TMI 2023) with the codes as classes; all images of a study go to the same client.  Train and test
    records are split together, so every client keeps the official train / test split (paper 5.1).

    Args:
        records: MIMIC records (5-finding labels).
        n_clients: number of clients (paper: 5).
        alpha: Dirichlet concentration (paper: 1; 5 in the analysis); smaller = more heterogeneous.
        seed: the same (records order, n_clients, alpha, seed) always gives the same split.
        min_per_client: redraw until every client holds at least this many studies (SSL-FL: 10).

    Returns:
        ``n_clients`` lists of records, each in input order; every record is in exactly one.
    """
    recs = list(records)
    require_int("lda_client_split", "n_clients", n_clients, 1, "use a positive number of clients (paper: 5)")
    require(isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and math.isfinite(alpha) and alpha > 0,
            "lda_client_split", "alpha", alpha, "use a finite Dirichlet concentration > 0 (paper: 1.0, or 5.0)")
    require_int("lda_client_split", "min_per_client", min_per_client, 0, "use an integer >= 0 (SSL-FL: 10)")
    order, groups = _study_groups(recs)
    require(len(order) >= n_clients * min_per_client and len(order) > 0, "lda_client_split", "min_per_client",
            min_per_client, f"{len(order)} studies cannot give each of {n_clients} clients {min_per_client}; "
            "lower min_per_client or n_clients")
    codes = [finding_code(recs[groups[k][0]].labels) for k in order]
    parts = dirichlet_split(codes, n_clients, float(alpha), seed, min_per_site=min_per_client)
    owner = {order[j]: c for c, part in enumerate(parts) for j in part}
    out: list[list[VLPRecord]] = [[] for _ in range(n_clients)]
    for r in recs:
        out[owner[(r.patient, r.study)]].append(r)
    return out


def code_histograms(parts: Sequence[Sequence[VLPRecord]]) -> np.ndarray:
    """``[len(parts), 32]`` int matrix: records (images) of each finding code per client."""
    codes = [finding_code(r.labels) for p in parts for r in p]
    bounds = np.cumsum([0] + [len(p) for p in parts])
    return class_counts(codes, [list(range(bounds[i], bounds[i + 1])) for i in range(len(parts))], N_CODES)


def mean_tv_distance(hist: np.ndarray) -> float:
    """Mean over clients of the total-variation distance between a client's code distribution and the global one
    (0 = IID; 1 = disjoint); ``hist`` = :func:`code_histograms` (or any clients x classes count matrix)."""
    h = np.asarray(hist, dtype=float)
    glob = h.sum(axis=0) / max(h.sum(), 1.0)
    rows = [0.5 * np.abs(r / r.sum() - glob).sum() for r in h if r.sum() > 0]
    return float(np.mean(rows)) if rows else 0.0


# ------------------------------------------------------------------------------------------------ manifests
#: ``text_source`` prefix of a manifest row whose text is a caption made from tabular labels (retina), not a file
CAPTION_PREFIX = "caption:"


def _rel(path: str, root: Path | None) -> str:
    return os.path.relpath(path, root) if root is not None else os.path.abspath(path)


def _source_field(r: VLPRecord, root: Path | None) -> str:
    return _rel(r.text_source, root) if r.text_source else CAPTION_PREFIX + r.text


def _write_manifest(path: Path, records: Sequence[VLPRecord], root: Path | None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(MANIFEST_COLUMNS)
        for r in records:
            w.writerow([_rel(r.image, root), _source_field(r, root), r.split, r.patient, r.study,
                        ";".join(str(int(x)) for x in r.labels)])


def write_client_manifests(records: Sequence[VLPRecord], out: object, n_clients: int = 5, alpha: float = 1.0,
                           seed: int = 0, root: object | None = None, min_per_client: int = 10) -> list[str]:
    """Cut ``records`` with :func:`lda_client_split` and write one manifest per client.

    Writes ``<out>/site-<i>/manifest.csv`` (i = 1 ..) with columns ``image,text_source,split,patient,study,labels``
    (``image`` and ``text_source`` - the report file, not its text - relative to ``root`` when given, else
    absolute; a record without a report file gets ``caption:<its text>``; ``labels`` joined by ";", e.g.
    ``1;0;0;1;0``) and ``<out>/split_summary.json`` (n_clients, alpha, seed, per-client image / study / train /
    test counts and code histograms, the global histogram and the mean total-variation distance of the clients'
    code distributions to it).

    Returns:
        the manifest paths, site-1 first.
    """
    recs = list(records)
    parts = lda_client_split(recs, n_clients, alpha, seed, min_per_client)
    op = Path(os.fspath(out))
    rt = Path(os.fspath(root)).absolute() if root is not None else None
    paths = []
    for i, part in enumerate(parts, start=1):
        p = op / f"site-{i}" / "manifest.csv"
        _write_manifest(p, part, rt)
        paths.append(str(p))
    hist = code_histograms(parts)
    summary = {
        "n_clients": n_clients, "alpha": alpha, "seed": seed, "min_per_client": min_per_client,
        "findings": list(FEDDRA_FINDINGS),
        "clients": [{"site": f"site-{i}", "images": len(part), "studies": len({(r.patient, r.study) for r in part}),
                     "train": sum(r.split == "train" for r in part), "test": sum(r.split == "test" for r in part),
                     "code_histogram": hist[i - 1].tolist()} for i, part in enumerate(parts, start=1)],
        "total_code_histogram": hist.sum(axis=0).tolist(),
        "mean_tv_distance": mean_tv_distance(hist),
    }
    (op / "split_summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    return paths


def write_source_manifests(sources: dict[str, Sequence[VLPRecord]], out: object,
                           root: object | dict[str, object] | None = None) -> list[str]:
    """One client per source (FedDRA's ophthalmology setting: MESSIDOR-2 -> one client, BRSET -> the other).

    Writes ``<out>/<site>/manifest.csv`` for every ``site`` of ``sources`` (in its order), in the layout of
    :func:`write_client_manifests`; a record without a report file (a caption made from tabular labels) gets
    ``text_source`` ``caption:<the caption>``.  ``root``: one folder, or a folder per site, that paths are written
    relative to (default absolute).  Also writes ``<out>/split_summary.json`` (per-site image / train / test counts).

    Returns:
        the manifest paths, in ``sources`` order.
    """
    require(isinstance(sources, dict) and len(sources) > 0 and all(isinstance(k, str) and k for k in sources),
            "write_source_manifests", "sources", type(sources).__name__,
            "pass a dict {site name: records}, e.g. {'site-1': messidor_records, 'site-2': brset_records}")
    op = Path(os.fspath(out))
    paths, clients = [], []
    for name, recs in sources.items():
        recs = list(recs)
        require(len(recs) > 0, "write_source_manifests", f"sources[{name!r}]", "[]", "give every site its records")
        r0 = root.get(name) if isinstance(root, dict) else root
        p = op / name / "manifest.csv"
        _write_manifest(p, recs, Path(os.fspath(r0)).absolute() if r0 is not None else None)
        paths.append(str(p))
        clients.append({"site": name, "images": len(recs), "patients": len({r.patient for r in recs}),
                        "train": sum(r.split == "train" for r in recs), "test": sum(r.split == "test" for r in recs)})
    (op / "split_summary.json").write_text(json.dumps({"split": "by_source", "clients": clients}, indent=1) + "\n",
                                           encoding="utf-8")
    return paths


def load_manifest(path: object, root: object | None, site: str = "?", check_images: bool = True) -> list[VLPRecord]:
    """Records of a manifest written by :func:`write_client_manifests` or :func:`write_source_manifests`; relative
    paths are resolved against ``root``; each report is read again through :func:`parse_report` /
    :func:`report_text` (a ``caption:...`` text_source is the text itself).  A malformed row, a missing image or
    report, or a report without FINDINGS / IMPRESSION is an error naming file, row and site."""
    mp = Path(os.fspath(path))
    if not mp.is_file():
        raise _err(site, mp, "manifest not found", "write it with fedssl.data.vlp.write_client_manifests")
    rt = Path(os.fspath(root)) if root is not None else None
    header, rows = _read_rows(mp, site)
    if tuple(header) != MANIFEST_COLUMNS:
        raise _err(site, mp, f"manifest header {header} is not {list(MANIFEST_COLUMNS)}",
                   "write the manifest with fedssl.data.vlp.write_client_manifests")

    def resolve(p: str, line: int, what: str) -> Path:
        q = Path(p)
        if not p:
            raise _err(site, mp, f"empty {what} path", "every row needs an image and a text_source", line)
        if not q.is_absolute():
            if rt is None:
                raise _err(site, mp, f"relative {what} path {p!r} but no root", "pass the root the manifest was "
                           "written against", line)
            q = rt / q
        return q

    cache: dict[Path, str | None] = {}
    out = []
    for line, r in checked_rows(MANIFEST_COLUMNS, rows, mp, site, "rewrite the manifest", error=_err):
        image, source, split, patient, study, lab = (x.strip() for x in r)
        if split not in SPLITS:
            raise _err(site, mp, f"split {split!r} is not train or test", "rewrite the manifest", line)
        try:
            labels = tuple(int(x) for x in lab.split(";"))
        except ValueError:
            labels = ()
        if not labels or any(x < 0 for x in labels):
            raise _err(site, mp, f"labels {lab!r} are not ';'-joined non-negative integers (e.g. 1;0;0;1;0)",
                       "rewrite the manifest", line)
        img = resolve(image, line, "image")
        if check_images and not img.is_file():
            raise _err(site, mp, f"image {img} not found", "pass the root the manifest was written against", line)
        if source.startswith(CAPTION_PREFIX):
            caption = source[len(CAPTION_PREFIX):].strip()
            if not caption:
                raise _err(site, mp, "empty caption", "rewrite the manifest", line)
            out.append(VLPRecord(image=str(img.absolute()), text=caption, labels=labels, patient=patient,
                                 study=study, split=split))
            continue
        rep = resolve(source, line, "text_source")
        if rep not in cache:
            raw = _read_text(rep, site)
            if raw is None:
                raise _err(site, mp, f"report {rep} not found", "pass the root the manifest was written against", line)
            cache[rep] = report_text(raw)
        text = cache[rep]
        if text is None:
            raise _err(site, mp, f"report {rep} has neither FINDINGS nor IMPRESSION",
                       "restore the report (or drop the row)", line)
        out.append(VLPRecord(image=str(img.absolute()), text=text, labels=labels, patient=patient, study=study,
                             split=split, text_source=str(rep.absolute())))
    if not out:
        raise _err(site, mp, "manifest holds no row", "rewrite the manifest")
    return out


# ------------------------------------------------------------------------------------------------ retina
#: ICDR grade 0-4 -> DR status (International Clinical Diabetic Retinopathy scale)
DR_STATUS: tuple[str, ...] = (
    "no diabetic retinopathy",
    "mild non-proliferative diabetic retinopathy",
    "moderate non-proliferative diabetic retinopathy",
    "severe non-proliferative diabetic retinopathy",
    "proliferative diabetic retinopathy",
)
#: edema flag 0/1 -> edema risk
EDEMA_RISK: tuple[str, ...] = ("no risk of macular edema", "risk of macular edema")
#: grade schemes: "icdr" 0-4 (MESSIDOR-2 adjudicated grade, BRSET DR_ICDR); "binary" 0/1 (no DR / DR)
CAPTION_SCHEMES = ("icdr", "binary")
_BINARY_STATUS = ("no diabetic retinopathy", "diabetic retinopathy")


def retina_caption(dr_grade: int, edema: int, scheme: str = "icdr") -> str:
    """FedDRA's caption "retinal image with {DR status} and {edema risk}" (appendix A.2).

    ``scheme="icdr"``: ``dr_grade`` 0-4 on the ICDR scale (:data:`DR_STATUS`); ``"binary"``: 0/1 (no DR / DR).
    ``edema`` 0/1 (:data:`EDEMA_RISK`).  E.g. ``(2, 1)`` -> "retinal image with moderate non-proliferative
    diabetic retinopathy and risk of macular edema".
    """
    require_choice("retina_caption", "scheme", scheme, CAPTION_SCHEMES)
    names = DR_STATUS if scheme == "icdr" else _BINARY_STATUS
    require(isinstance(dr_grade, (int, np.integer)) and not isinstance(dr_grade, bool) and 0 <= dr_grade < len(names),
            "retina_caption", "dr_grade", dr_grade, f"use an integer 0-{len(names) - 1} (scheme {scheme!r})")
    require(edema in (0, 1) and not isinstance(edema, bool), "retina_caption", "edema", edema, "use 0 or 1")
    return f"retinal image with {names[int(dr_grade)]} and {EDEMA_RISK[int(edema)]}"


def patient_test_split(patients: Sequence[str], seed: int = 0, test_fraction: float = 0.2) -> set[str]:
    """The test patients of a deterministic patient-level split: the sorted distinct ids, permuted by
    ``np.random.default_rng(seed)``, the first ``round(test_fraction * n)`` are test."""
    require(isinstance(test_fraction, (int, float)) and 0.0 <= float(test_fraction) < 1.0, "patient_test_split",
            "test_fraction", test_fraction, "use a fraction in [0, 1), e.g. 0.2")
    ids = sorted(set(patients))
    order = np.random.default_rng(seed).permutation(len(ids))
    n_test = int(round(float(test_fraction) * len(ids)))
    return {ids[i] for i in order[:n_test]}


def _int_value(value: str, path: Path, row: int, column: str, allowed: Sequence[int], site: str) -> int:
    try:
        f = float(value.strip())
    except ValueError:
        f = float("nan")
    if not math.isfinite(f) or f != int(f) or int(f) not in allowed:
        raise _err(site, path, f"{column}={value!r} is not one of {list(allowed)}",
                   "use the dataset's original label file", row)
    return int(f)


def _index_folder(folders: Sequence[Path]) -> dict[str, Path]:
    """lower-case file stem -> path over image files (RETINA_EXTS) of the first existing folders."""
    index: dict[str, Path] = {}
    for d in folders:
        if not d.is_dir():
            continue
        for e in sorted(os.scandir(d), key=lambda e: e.name):
            if e.is_file() and e.name.lower().endswith(RETINA_EXTS):
                index.setdefault(Path(e.name).stem.lower(), Path(e.path))
    return index


def _refuse_layout(rp: Path, site: str, expected: str, fix: str) -> VLPDataError:
    found = sorted(os.listdir(rp))[:8]
    xls = [f for f in found if f.lower().endswith((".xls", ".xlsx"))]
    what = (f"only a spreadsheet annotation ({', '.join(xls)}) found, which this loader does not read; expected "
            f"{expected}" if xls else f"expected {expected} (found {found})")
    return _err(site, rp, what, fix)


def _with_split(recs: list[dict], seed: int, test_fraction: float, scheme: str = "icdr") -> list[VLPRecord]:
    test = patient_test_split([r["patient"] for r in recs], seed, test_fraction)
    return [VLPRecord(image=r["image"], text=retina_caption(r["grade"], r["edema"], scheme),
                      labels=(r["grade"], r["edema"]), patient=r["patient"], study=r["study"],
                      split="test" if r["patient"] in test else "train") for r in recs]


MESSIDOR2_CSV = "messidor_data.csv"
MESSIDOR2_DIRS = ("IMAGES", "messidor-2/preprocess", "preprocess")


def load_messidor2(root: object, site: str = "?", seed: int = 0, test_fraction: float = 0.2,
                   check_images: bool = True) -> tuple[list[VLPRecord], dict]:
    """MESSIDOR-2 (Decencière et al., "Feedback on a publicly distributed image database: the Messidor database",
    Image Analysis & Stereology 2014) with the adjudicated grades, in the Kaggle layout (module docstring).

    Ungradable rows (``adjudicated_gradable`` 0) are skipped and counted; ``adjudicated_dr_grade`` is ICDR 0-4,
    ``adjudicated_dme`` 0/1.  An ``image_id`` is matched by file stem (the Kaggle copies are re-encoded, e.g.
    ``.tif`` listed, ``.png`` stored).  MESSIDOR-2 has no official split: records get "train" / "test" by a
    deterministic patient-level split (:func:`patient_test_split`, ``seed``, ``test_fraction`` = 0.2).  The CSV
    carries no patient id (the two-eye exam pairing is only in the release's .xls), so each image counts as its
    own patient: the two eyes of one exam may fall in different splits.

    Returns:
        ``(records, counts)`` with counts ``images``, ``patients``, ``train``, ``test``, ``skipped_ungradable``.
    """
    rp = _check_root(root, site, "MESSIDOR-2")
    csv_path = rp / MESSIDOR2_CSV
    if not csv_path.is_file():
        raise _refuse_layout(rp, site, f"{MESSIDOR2_CSV} (columns image_id, adjudicated_dr_grade, adjudicated_dme, "
                             "adjudicated_gradable) with images under IMAGES/ or messidor-2/preprocess/",
                             f"use the Kaggle MESSIDOR-2 release: {MESSIDOR2_CSV} next to IMAGES/ (or "
                             "messidor-2/preprocess/); the original .xls annotation is not read")
    header, rows = _read_rows(csv_path, site)
    pos = _require_columns(header, ("image_id", "adjudicated_dr_grade", "adjudicated_dme", "adjudicated_gradable"),
                           csv_path, site)
    index = _index_folder([rp / d for d in MESSIDOR2_DIRS])
    if check_images and not index:
        raise _err(site, rp, "no image (.png/.jpg/.jpeg/.tif) under IMAGES/ or messidor-2/preprocess/",
                   "unpack the MESSIDOR-2 images next to messidor_data.csv")
    skipped, recs = 0, []
    for line, r in checked_rows(header, rows, csv_path, site, "restore the CSV", error=_err):
        image_id = r[pos["image_id"]].strip()
        if not image_id:
            raise _err(site, csv_path, "empty image_id", "every row needs an image_id", line)
        if _int_value(r[pos["adjudicated_gradable"]], csv_path, line, "adjudicated_gradable", (0, 1), site) == 0:
            skipped += 1
            continue
        grade = _int_value(r[pos["adjudicated_dr_grade"]], csv_path, line, "adjudicated_dr_grade", range(5), site)
        dme = _int_value(r[pos["adjudicated_dme"]], csv_path, line, "adjudicated_dme", (0, 1), site)
        stem = Path(image_id).stem
        path = index.get(stem.lower())
        if path is None:
            if check_images:
                raise _err(site, csv_path, f"image {image_id!r} not found under IMAGES/ or messidor-2/preprocess/",
                           "unpack every MESSIDOR-2 image (any of .png/.jpg/.jpeg/.tif)", line)
            path = rp / MESSIDOR2_DIRS[0] / image_id
        recs.append({"image": str(path.absolute()), "grade": grade, "edema": dme, "patient": stem, "study": stem})
    if not recs:
        raise _err(site, csv_path, "no gradable image", "use the adjudicated messidor_data.csv")
    out = _with_split(recs, seed, test_fraction)
    counts = {"images": len(out), "patients": len({r.patient for r in out}),
              "train": sum(r.split == "train" for r in out), "test": sum(r.split == "test" for r in out),
              "skipped_ungradable": skipped}
    return out, counts


BRSET_CSVS = ("labels_brset.csv", "labels.csv")


def load_brset(root: object, site: str = "?", seed: int = 0, test_fraction: float = 0.2,
               check_images: bool = True) -> tuple[list[VLPRecord], dict]:
    """BRSET (Nakayama et al., PhysioNet 2023) in its PhysioNet layout (module docstring).

    Reads ``image_id``, ``patient_id``, ``DR_ICDR`` (0-4) and ``macular_edema`` (0/1); other columns are
    ignored.  BRSET has no official split: records get "train" / "test" by a deterministic patient-level split
    (:func:`patient_test_split`, ``seed``, ``test_fraction`` = 0.2), so both eyes of a patient stay together.

    Returns:
        ``(records, counts)`` with counts ``images``, ``patients``, ``train``, ``test``.
    """
    rp = _check_root(root, site, "BRSET")
    csv_path = next((rp / n for n in BRSET_CSVS if (rp / n).is_file()), None)
    if csv_path is None:
        raise _refuse_layout(rp, site, f"{' or '.join(BRSET_CSVS)} (columns image_id, patient_id, DR_ICDR, "
                             "macular_edema) with images under fundus_photos/",
                             "use the PhysioNet BRSET release: labels_brset.csv next to fundus_photos/")
    header, rows = _read_rows(csv_path, site)
    pos = _require_columns(header, ("image_id", "patient_id", "DR_ICDR", "macular_edema"), csv_path, site)
    img_dir = rp / "fundus_photos"
    if check_images and not img_dir.is_dir():
        raise _err(site, img_dir, "BRSET image folder not found", "unpack fundus_photos/ next to the label file")
    recs = []
    for line, r in checked_rows(header, rows, csv_path, site, "restore the CSV", error=_err):
        image_id, patient = r[pos["image_id"]].strip(), r[pos["patient_id"]].strip()
        if not image_id or not patient:
            raise _err(site, csv_path, "empty image_id or patient_id", "every row needs both", line)
        grade = _int_value(r[pos["DR_ICDR"]], csv_path, line, "DR_ICDR", range(5), site)
        edema = _int_value(r[pos["macular_edema"]], csv_path, line, "macular_edema", (0, 1), site)
        name = image_id if Path(image_id).suffix.lower() in RETINA_EXTS else image_id + ".jpg"
        path = img_dir / name
        if check_images and not path.is_file():
            raise _err(site, csv_path, f"image fundus_photos/{name} not found", "unpack every BRSET image", line)
        recs.append({"image": str(path.absolute()), "grade": grade, "edema": edema, "patient": patient,
                     "study": Path(name).stem})
    if not recs:
        raise _err(site, csv_path, "label file holds no row", "restore the label file")
    out = _with_split(recs, seed, test_fraction)
    counts = {"images": len(out), "patients": len({r.patient for r in out}),
              "train": sum(r.split == "train" for r in out), "test": sum(r.split == "test" for r in out)}
    return out, counts


# ------------------------------------------------------------------------------------ out-of-distribution sets
#: RSNA classes: Target 0 (no lung opacity, including "not normal" images) / Target 1 (lung opacity: pneumonia)
RSNA_CLASSES = ("no_pneumonia", "pneumonia")
RSNA_CSVS = ("stage_2_train_labels.csv", "stage_1_train_labels.csv")
RSNA_DIRS = ("stage_2_train_images", "stage_1_train_images")


def load_rsna_pneumonia(root: object, site: str = "?", check_images: bool = True) -> list[tuple[str, int]]:
    """``[(image path, target)]`` of the RSNA Pneumonia Detection training set, one per patient (CSV order).

    The CSV has one row per box (several per pneumonia patient, one box-less row for Target 0); the patient's
    target is the maximum of its rows' ``Target`` (class names :data:`RSNA_CLASSES`).  Images are
    ``stage_2_train_images/<patientId>.png`` (or .jpg / .jpeg): DICOM reading is not a dependency, so a folder of
    ``.dcm`` files is refused with the advice to convert them to PNG.
    """
    rp = _check_root(root, site, "RSNA Pneumonia")
    csv_path = next((rp / n for n in RSNA_CSVS if (rp / n).is_file()), None)
    if csv_path is None:
        raise _refuse_layout(rp, site, "stage_2_train_labels.csv (patientId,x,y,width,height,Target) with images "
                             "under stage_2_train_images/", "use the Kaggle RSNA Pneumonia Detection layout")
    img_dir = next((rp / d for d in RSNA_DIRS if (rp / d).is_dir()), rp / RSNA_DIRS[0])
    header, rows = _read_rows(csv_path, site)
    pos = _require_columns(header, ("patientId", "Target"), csv_path, site)
    target: dict[str, int] = {}
    for line, r in checked_rows(header, rows, csv_path, site, "restore the CSV", error=_err):
        pid = r[pos["patientId"]].strip()
        if not pid:
            raise _err(site, csv_path, "empty patientId", "restore the CSV", line)
        t = _int_value(r[pos["Target"]], csv_path, line, "Target", (0, 1), site)
        target[pid] = max(target.get(pid, 0), t)
    if not target:
        raise _err(site, csv_path, "label file holds no row", "restore the label file")
    names: dict[str, Path] = {}
    dicoms: set[str] = set()
    if img_dir.is_dir():
        for e in os.scandir(img_dir):
            stem, ext = os.path.splitext(e.name)
            if ext.lower() in (".png", ".jpg", ".jpeg"):
                names.setdefault(stem, Path(e.path))
            elif ext.lower() == ".dcm":
                dicoms.add(stem)
    out = []
    for pid, t in target.items():
        path = names.get(pid)
        if path is None:
            if check_images:
                if pid in dicoms:
                    raise _err(site, img_dir / f"{pid}.dcm", "RSNA images are DICOM; DICOM reading is not a "
                               "dependency of this bundle", "convert the images to PNG first (e.g. with pydicom: "
                               "stage_2_train_images/<patientId>.png, 8-bit grey)")
                raise _err(site, img_dir, f"image of patientId {pid!r} (.png/.jpg) not found",
                           "convert every stage_2_train_images/*.dcm to <patientId>.png")
            path = img_dir / f"{pid}.png"
        out.append((str(path.absolute()), t))
    return out


#: COVIDx CXR-3 / CXR-4 labels (binary COVID-19 detection): negative -> 0, positive -> 1
COVIDX_CLASSES_V3 = ("negative", "positive")
#: older COVIDx releases (and FedDRA's 3-way task): normal -> 0, pneumonia -> 1, COVID-19 -> 2
COVIDX_CLASSES_OLD = ("normal", "pneumonia", "COVID-19")
COVIDX_SPLITS = ("train", "val", "test")


def _covidx_file(rp: Path, split: str) -> Path | None:
    p = rp / f"{split}.txt"
    if p.is_file():
        return p
    alts = sorted(rp.glob(f"{split}_COVIDx*.txt"))
    return alts[-1] if alts else None


def _covidx_lines(path: Path, site: str) -> list[tuple[int, str, str]]:
    """``[(line number, filename, label)]``: ``patient_id filename label [source]`` (a filename may hold spaces)."""
    known = {c.lower() for c in COVIDX_CLASSES_V3 + COVIDX_CLASSES_OLD}
    out = []
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise _err(site, path, f"unreadable ({exc.__class__.__name__}: {exc})", "restore the file") from exc
    for i, raw in enumerate(text.splitlines(), start=1):
        tok = raw.split()
        if not tok:
            continue
        if len(tok) >= 4 and tok[-2].lower() in known:
            name, label = " ".join(tok[1:-2]), tok[-2]
        elif len(tok) >= 3 and tok[-1].lower() in known:
            name, label = " ".join(tok[1:-1]), tok[-1]
        else:
            raise _err(site, path, f"line {raw.strip()!r} is not 'patient_id filename label source' with a label in "
                       f"{list(COVIDX_CLASSES_V3 + COVIDX_CLASSES_OLD)}", "use the COVIDx release's split file", i)
        out.append((i, name, label))
    return out


def covidx_classes(root: object, site: str = "?") -> tuple[str, ...]:
    """The class names of a COVIDx folder, index = class id: :data:`COVIDX_CLASSES_V3` (negative, positive) when
    every split file uses positive / negative (COVIDx CXR-2/3/4), :data:`COVIDX_CLASSES_OLD` (normal, pneumonia,
    COVID-19) when they use the older three labels; a mix is an error."""
    rp = _check_root(root, site, "COVIDx")
    files = [p for p in (_covidx_file(rp, s) for s in COVIDX_SPLITS) if p is not None]
    if not files:
        raise _refuse_layout(rp, site, "train.txt / test.txt ('patient_id filename label source' lines) with images "
                             "in train/ and test/", "use the COVIDx CXR release layout")
    labels = {lab.lower() for p in files for _, _, lab in _covidx_lines(p, site)}
    if labels <= {c.lower() for c in COVIDX_CLASSES_V3}:
        return COVIDX_CLASSES_V3
    if labels <= {c.lower() for c in COVIDX_CLASSES_OLD}:
        return COVIDX_CLASSES_OLD
    raise _err(site, rp, f"split files mix label sets {sorted(labels)}",
               "use the train/test files of one COVIDx release")


def load_covidx(root: object, split: str = "train", site: str = "?",
                check_images: bool = True) -> list[tuple[str, int]]:
    """``[(image path, class id)]`` of COVIDx split ``split`` ("train", "val" - CXR-4 only - or "test"), file order.

    Class ids follow :func:`covidx_classes`: CXR-3 style negative -> 0, positive -> 1; older releases normal -> 0,
    pneumonia -> 1, COVID-19 -> 2.  Images are ``<split>/<filename>``.
    """
    require_choice("load_covidx", "split", split, COVIDX_SPLITS)
    classes = covidx_classes(root, site)
    rp = Path(os.fspath(root))
    path = _covidx_file(rp, split)
    if path is None:
        raise _err(site, rp / f"{split}.txt", "COVIDx split file not found", f"use one of the splits present ("
                   f"{[s for s in COVIDX_SPLITS if _covidx_file(rp, s)]})")
    idx = {c.lower(): i for i, c in enumerate(classes)}
    out = []
    for line, name, label in _covidx_lines(path, site):
        img = rp / split / name
        if check_images and not img.is_file():
            raise _err(site, path, f"image {split}/{name} not found", f"unpack the COVIDx {split}/ folder", line)
        out.append((str(img.absolute()), idx[label.lower()]))
    if not out:
        raise _err(site, path, "split file holds no line", "restore the file")
    return out


# ---------------------------------------------------------------------------------------------------- dataset
#: augmentation: random resized crop scale and ratio, rotation range (degrees)
AUG_SCALE = (0.8, 1.0)
AUG_RATIO = (3.0 / 4.0, 4.0 / 3.0)
AUG_ROTATION_DEG = 10.0
COLOURS = ("grey", "rgb")
_GREY_MEAN, _GREY_STD = float(np.mean(IMAGENET_MEAN)), float(np.mean(IMAGENET_STD))


class VLPDataset(CachedImageDataset):
    """Image-text pairs: item ``i`` -> ``(float tensor [channels, S, S], text str)``.

    Images are decoded with PIL, resized so the shorter edge is ``image_size`` (aspect kept) and centre-cropped
    to ``image_size`` x ``image_size``.  ``colour="grey"`` (chest X-rays): converted to grey (ITU-R 601 luma)
    and repeated to ``channels``; ``colour="rgb"`` (fundus photographs): RGB, ``channels`` must be 3.
    Normalisation is ImageNet-style: ``(x - mean) / std`` per channel with the ImageNet statistics
    (``channels`` != 3: their averages, 0.449 / 0.226), as the bundle's other image datasets.

    ``augment=True``: a random resized crop of the resized image (area 0.8-1, ratio 3/4-4/3) and a rotation of
    up to +-10 degrees (zero fill), drawn from ``np.random.default_rng([seed, epoch, index])`` only (set the epoch
    with :meth:`set_epoch`), so every item is reproducible.  ``cache=True`` keeps each decoded resized image
    (uint8, about ``S * S * 1.2`` bytes grey, 3x that RGB) in memory.
    """

    def __init__(self, records: Sequence[VLPRecord], image_size: int, channels: int = 3, augment: bool = False,
                 seed: int = 0, colour: str = "grey", site: str = "?", cache: bool = True):
        require_int("VLPDataset", "image_size", image_size, 8, "use an integer >= 8 (e.g. 224; tiny runs 32)")
        require_int("VLPDataset", "channels", channels, 1, "use 1 or 3 (3 for ImageNet-style encoders)")
        require_choice("VLPDataset", "colour", colour, COLOURS)
        require(colour == "grey" or channels == 3, "VLPDataset", "channels", channels,
                "colour='rgb' (fundus photographs) needs channels=3")
        require(isinstance(augment, bool), "VLPDataset", "augment", augment, "use True or False")
        self.records = list(records)
        self.image_size, self.channels, self.augment, self.colour = image_size, channels, augment, colour
        self.seed, self.epoch, self.site, self.cache = int(seed), 0, site, bool(cache)
        self._cache: dict[int, np.ndarray] = {}
        if channels == 3:
            mean, std = IMAGENET_MEAN, IMAGENET_STD
        else:
            mean, std = (_GREY_MEAN,) * channels, (_GREY_STD,) * channels
        self._mean = torch.tensor(mean, dtype=torch.float32).view(channels, 1, 1)
        self._std = torch.tensor(std, dtype=torch.float32).view(channels, 1, 1)

    @property
    def texts(self) -> list[str]:
        return [r.text for r in self.records]

    def decoded(self, index: int) -> np.ndarray:
        return self.raw(index)

    def raw(self, index: int) -> np.ndarray:
        """The decoded uint8 image, shorter edge ``image_size``: ``[H, W]`` grey or ``[H, W, 3]`` RGB."""
        img = self._cache.get(index)
        if img is not None:
            return img
        rgb = _decode(self.records[index].image, self.image_size, self.site)
        if self.colour == "grey":
            img = np.clip(rgb.astype(np.float32) @ np.array([0.299, 0.587, 0.114], np.float32) + 0.5, 0, 255)
            img = img.astype(np.uint8)
        else:
            img = rgb
        if self.cache:
            self._cache[index] = img
        return img

    def __getitem__(self, index: int) -> tuple[torch.Tensor, str]:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} records")
        a = self.raw(index)
        x = torch.from_numpy(a).float().div_(255.0)
        x = x.unsqueeze(0) if x.ndim == 2 else x.permute(2, 0, 1)
        s = self.image_size
        if self.augment:
            g = np.random.default_rng([self.seed, self.epoch, index])
            h, w = x.shape[1:]
            top, left, ch, cw = crop_box(h, w, g, scale=AUG_SCALE, ratio=AUG_RATIO)
            angle = math.radians(g.uniform(-AUG_ROTATION_DEG, AUG_ROTATION_DEG))
            c, sn = math.cos(angle), math.sin(angle)
            theta = torch.tensor([[cw / w * c, -cw / w * sn, (2 * left + cw) / w - 1],
                                  [ch / h * sn, ch / h * c, (2 * top + ch) / h - 1]], dtype=torch.float32)
            grid = F.affine_grid(theta.unsqueeze(0), [1, x.shape[0], s, s], align_corners=False)
            x = F.grid_sample(x.unsqueeze(0), grid, mode="bilinear", padding_mode="zeros", align_corners=False)[0]
        else:
            h, w = x.shape[1:]
            top, left = (h - s) // 2, (w - s) // 2
            x = x[:, top:top + s, left:left + s]
        if x.shape[0] != self.channels:
            x = x.expand(self.channels, -1, -1)
        return ((x - self._mean) / self._std).contiguous(), self.records[index].text


def collate_vlp(batch: Sequence[tuple[torch.Tensor, str]]) -> tuple[torch.Tensor, list[str]]:
    """``[(image, text), ...]`` -> ``(images [B, C, S, S], [text, ...])`` (a DataLoader ``collate_fn``)."""
    require(len(batch) > 0, "collate_vlp", "batch", batch, "pass at least one (image, text) item")
    return torch.stack([x for x, _ in batch]), [str(t) for _, t in batch]
