"""Loader for the real ACDC (MICCAI 2017) on-disk layout, plus the FCL datasets built on it.

Layout read (one folder per patient, as in the public ``training/`` folder)::

    root/
      patient001/
        Info.cfg                      # "ED: 1", "ES: 12", "Group: DCM", "Height: 184.0", "NbFrame: 30", "Weight: 95.0"
        patient001_4d.nii.gz          # cine, (H, W, Z, T)
        patient001_frame01.nii.gz     # ED volume, (H, W, Z)
        patient001_frame01_gt.nii.gz  # ED labels: 0 bg, 1 RV, 2 MYO, 3 LV
        patient001_frame12.nii.gz     # ES volume
        patient001_frame12_gt.nii.gz  # ES labels
      patient002/ ...

A folder holding only ``patientNNN_4d.nii.gz`` (+ ``Info.cfg``) serves unlabelled loading: the ED and
ES volumes are then taken out of the cine (Info.cfg frame numbers are 1-based, as in ACDC). Labelled
loading always needs the ``_frameMM`` and ``_frameMM_gt`` files.

Preprocessing (FCL (Wu et al., MedIA 2022), FCL): slice-first ``[Z, H, W]``, intensities clipped to the volume's
1st-99th percentile and min-max scaled to [0, 1], in-plane resampling to ``target_spacing`` mm
(1.25 mm by default), centre crop / zero pad to ``image_size x image_size``.

Every data problem raises :class:`ACDCDataError`, whose message names the offending path, the
site that hit it and what to do about it, so a failure on one FLARE client is diagnosable from
the server log.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from fedssl.data.loading import load_batches
from fedssl.data.volume import Volume, read_nifti

__all__ = [
    "ACDCDataError",
    "list_patients",
    "read_info_cfg",
    "load_nifti",
    "preprocess_volume",
    "load_patient",
    "load_site",
    "cavity_volumes",
    "summarise_cavity_volumes",
    "PartitionSampleDataset",
    "SliceDataset",
]

PathLike = Union[str, "os.PathLike[str]"]

PATIENT_RE = re.compile(r"^patient\d{3}$")
_INT_KEYS = ("ED", "ES", "NbFrame")
_FLOAT_KEYS = ("Height", "Weight")
ACDC_LABELS = (0, 1, 2, 3)  # bg, RV, MYO, LV
#: the five ACDC pathology groups (``Group`` in Info.cfg), in the challenge's order
ACDC_GROUPS: tuple[str, ...] = ("NOR", "MINF", "DCM", "HCM", "RV")
#: ACDC foreground classes by label value
ACDC_CLASSES: dict[int, str] = {1: "RV", 2: "MYO", 3: "LV"}
_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")


class ACDCDataError(ValueError):
    """A problem with ACDC data on disk (missing/corrupt file, bad Info.cfg, empty folder).

    The message always names the offending path, the site and the fix.
    """


def _site_name(site: str) -> str:
    return site if site else "<unnamed site>"


def _err(site: str, path: PathLike, problem: str, fix: str) -> ACDCDataError:
    return ACDCDataError(f"[site {_site_name(site)}] {problem}: {os.fspath(path)}. Fix: {fix}")


def list_patients(root: PathLike, site: str = "") -> list[str]:
    """Sorted names of the patient folders (``patientNNN``, three digits) directly under ``root``.

    Symlinked patient folders (as made by ``link_site_folders``) count.

    Raises:
        ACDCDataError: ``root`` is missing, not a directory, unreadable, or holds no patient folder.
    """
    root_p = Path(root)
    if not root_p.exists():
        raise _err(site, root_p, "ACDC root folder does not exist",
                   "point the site's data root at the ACDC training folder (or its site-k subfolder)")
    if not root_p.is_dir():
        raise _err(site, root_p, "ACDC root is not a directory",
                   "point the site's data root at a folder holding patientNNN/ subfolders")
    try:
        names = os.listdir(root_p)
    except OSError as exc:
        raise _err(site, root_p, f"cannot read ACDC root folder ({exc.__class__.__name__}: {exc})",
                   "check the folder's permissions for the user running the FLARE client") from exc
    patients = sorted(n for n in names if PATIENT_RE.match(n) and (root_p / n).is_dir())
    if not patients:
        raise _err(site, root_p, "no patientNNN folder found in ACDC root",
                   "the root must directly contain patient001/, patient002/, ... folders "
                   "(write synthetic data with fedssl.data.acdc_synthetic.write_synthetic_acdc if "
                   "the real data set is not available)")
    return patients


def _parse_number(key: str, value: str, path: Path, site: str) -> Any:
    if key in _INT_KEYS:
        try:
            f = float(value)
        except ValueError:
            f = float("nan")
        if not np.isfinite(f) or f != int(f):
            raise _err(site, path, f"Info.cfg entry {key}={value!r} is not an integer",
                       f"write an integer frame number/count, e.g. '{key}: 1'")
        return int(f)
    if key in _FLOAT_KEYS:
        try:
            return float(value)
        except ValueError as exc:
            raise _err(site, path, f"Info.cfg entry {key}={value!r} is not a number",
                       f"write a number, e.g. '{key}: 170.0'") from exc
    try:
        return float(value)
    except ValueError:
        return value


def _decode_cfg(raw: bytes) -> str:
    """Text of an Info.cfg saved by any common editor: UTF-8 with or without a BOM, or UTF-16 with a BOM.

    A BOM left in the text would glue itself to the first key (``"\\ufeffED"``) and hide ``ED``.
    """
    if raw.startswith(_UTF16_BOMS):
        return raw.decode("utf-16", errors="replace")
    return raw.decode("utf-8-sig", errors="replace")


def read_info_cfg(path: PathLike, site: str = "") -> dict[str, Any]:
    """Parse an ACDC ``Info.cfg`` (``key: value`` lines).

    ``ED``, ``ES`` and ``NbFrame`` become ints, ``Height`` and ``Weight`` floats, other numeric
    values floats and everything else (e.g. ``Group``) stays a string. A leading byte-order mark
    (UTF-8 or UTF-16, as Windows editors write) is ignored.

    Raises:
        ACDCDataError: the file is missing/unreadable, ED or ES is missing, or a number is malformed.
    """
    p = Path(path)
    if not p.is_file():
        raise _err(site, p, "Info.cfg not found",
                   "every patient folder needs an Info.cfg with at least 'ED: <frame>' and 'ES: <frame>' lines")
    try:
        text = _decode_cfg(p.read_bytes())
    except OSError as exc:
        raise _err(site, p, f"cannot read Info.cfg ({exc.__class__.__name__}: {exc})",
                   "check the file's permissions") from exc
    info: dict[str, Any] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or ":" not in line:
            continue
        key, value = (s.strip() for s in line.split(":", 1))
        if key:
            info[key] = _parse_number(key, value, p, site)
    missing = [k for k in ("ED", "ES") if k not in info]
    if missing:
        raise _err(site, p, f"Info.cfg lacks {' and '.join(missing)}",
                   "add the end-diastolic/end-systolic frame numbers, e.g. 'ED: 1' and 'ES: 12'")
    return info


def load_nifti(path: PathLike, site: str = "") -> tuple[np.ndarray, tuple[float, ...]]:
    """Load a NIfTI file: ``(data as float32, voxel spacing from the header zooms)``.

    Raises:
        ACDCDataError: the file is missing or cannot be decoded (truncated, not NIfTI, bad gzip).
    """
    p = Path(path)
    if not p.is_file():
        raise _err(site, p, "NIfTI file not found",
                   "restore the file from the ACDC archive (or regenerate the synthetic data)")
    try:
        data, zooms = read_nifti(p)
    except Exception as exc:  # nibabel raises many types (ImageFileError, OSError, EOFError, zlib.error ...)
        raise _err(site, p, f"corrupt or unreadable NIfTI file ({exc.__class__.__name__}: {exc})",
                   "re-extract/re-download this file; it is not a valid (gzipped) NIfTI-1 image") from exc
    return data, zooms


def _normalise_intensity(vol: np.ndarray) -> np.ndarray:
    """Clip to the volume's 1st-99th percentile and min-max scale to [0, 1] (constant -> zeros)."""
    vol = np.nan_to_num(vol.astype(np.float32, copy=False), nan=0.0, posinf=0.0, neginf=0.0)
    lo, hi = np.percentile(vol, [1.0, 99.0])
    if not hi > lo:
        return np.zeros_like(vol, dtype=np.float32)
    out = (np.clip(vol, lo, hi) - lo) / (hi - lo)
    return out.astype(np.float32)


def _crop_or_pad(arr: np.ndarray, size: int) -> np.ndarray:
    """Centre crop / zero pad the last two axes of ``arr`` to ``size x size``."""
    z, h, w = arr.shape
    out = np.zeros((z, size, size), dtype=arr.dtype)
    # source window (crop) and destination window (pad) per axis
    def window(n: int) -> tuple[slice, slice]:
        if n >= size:
            start = (n - size) // 2
            return slice(start, start + size), slice(0, size)
        start = (size - n) // 2
        return slice(0, n), slice(start, start + n)

    sh, dh = window(h)
    sw, dw = window(w)
    out[:, dh, dw] = arr[:, sh, sw]
    return out


def _non_integral(arr: np.ndarray) -> np.ndarray:
    """Mask of entries that are not finite integers (NaN, inf, 1.5, 0.3 ...)."""
    arr = np.asarray(arr, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        return ~np.isfinite(arr) | (arr != np.rint(arr))


def _examples(values: np.ndarray) -> str:
    """Up to five distinct values, compactly printed for an error message."""
    return ", ".join(f"{v:g}" for v in np.unique(values)[:5])


def preprocess_volume(
    image_hwz: np.ndarray,
    spacing_xy: tuple[float, float],
    *,
    target_spacing: float,
    image_size: int,
    label_hwz: Optional[np.ndarray] = None,
) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """FCL preprocessing of one 3D volume (and optionally its label map).

    Steps: transpose ``(H, W, Z) -> (Z, H, W)``; clip intensities to the volume's 1st-99th
    percentile and min-max scale to [0, 1] (a constant volume gives zeros, never NaN); resample
    in-plane so the pixel spacing becomes ``target_spacing`` mm (new size
    ``round(H * spacing_xy[0] / target_spacing) x round(W * spacing_xy[1] / target_spacing)``;
    bilinear for the image, nearest for the label); centre crop / zero pad to
    ``image_size x image_size``.

    Args:
        image_hwz: ``(H, W, Z)`` array (NIfTI axis order).
        spacing_xy: voxel spacing in mm along H and W (the first two header zooms).
        target_spacing: in-plane spacing after resampling, in mm.
        image_size: output height and width.
        label_hwz: optional ``(H, W, Z)`` label map of the same shape; its values must be integral
            (a float array holding 0.0/1.0/... is fine, 1.5 is refused rather than rounded).

    Returns:
        ``(image float32 [Z, image_size, image_size] in [0, 1], label uint8 [Z, image_size, image_size] or None)``.
    """
    image_hwz = np.asarray(image_hwz)
    if image_hwz.ndim != 3:
        raise ValueError(f"image_hwz must be 3D (H, W, Z), got shape {image_hwz.shape}")
    if label_hwz is not None and np.asarray(label_hwz).shape != image_hwz.shape:
        raise ValueError(f"label shape {np.asarray(label_hwz).shape} != image shape {image_hwz.shape}")
    if label_hwz is not None and _non_integral(np.asarray(label_hwz)).any():
        raise ValueError("label_hwz holds non-integer values; labels must be class indices, not interpolated values")
    if target_spacing <= 0 or image_size <= 0:
        raise ValueError(f"target_spacing={target_spacing} and image_size={image_size} must be positive")
    sx, sy = float(spacing_xy[0]), float(spacing_xy[1])
    if not (sx > 0 and sy > 0):
        raise ValueError(f"spacing_xy={spacing_xy} must be positive")

    img = _normalise_intensity(np.transpose(image_hwz, (2, 0, 1)))
    _, h, w = img.shape
    new_h = max(1, int(round(h * sx / target_spacing)))
    new_w = max(1, int(round(w * sy / target_spacing)))

    with torch.no_grad():
        t = torch.from_numpy(np.ascontiguousarray(img)).unsqueeze(1)  # [Z, 1, H, W]
        if (new_h, new_w) != (h, w):
            t = F.interpolate(t, size=(new_h, new_w), mode="bilinear", align_corners=False)
        img_r = t.squeeze(1).clamp_(0.0, 1.0).numpy().astype(np.float32)

        lab_r: Optional[np.ndarray] = None
        if label_hwz is not None:
            lab = np.transpose(np.asarray(label_hwz), (2, 0, 1)).astype(np.float32)
            lt = torch.from_numpy(np.ascontiguousarray(lab)).unsqueeze(1)
            if (new_h, new_w) != (h, w):
                lt = F.interpolate(lt, size=(new_h, new_w), mode="nearest-exact")
            lab_r = lt.squeeze(1).numpy()
            if lab_r.size and (lab_r.min() < 0 or lab_r.max() > 255):
                raise ValueError(f"label values must lie in [0, 255], got [{lab_r.min()}, {lab_r.max()}]")
            lab_r = lab_r.astype(np.uint8)

    image_out = _crop_or_pad(img_r, image_size)
    label_out = _crop_or_pad(lab_r, image_size) if lab_r is not None else None
    return image_out, label_out


def _frame_path(pdir: Path, patient_id: str, frame: int, gt: bool = False) -> Path:
    return pdir / f"{patient_id}_frame{frame:02d}{'_gt' if gt else ''}.nii.gz"


def _finite_image(data: np.ndarray, path: Path, site: str) -> np.ndarray:
    """``data`` unchanged, or ACDCDataError naming the file and the site when a voxel is NaN or infinite (a
    corrupt export; before, such voxels were silently set to 0)."""
    bad = int(np.size(data) - np.count_nonzero(np.isfinite(data)))
    if bad:
        raise _err(site, path, f"{bad} voxel(s) are NaN or infinite",
                   "re-export the image from the scanner archive; a valid MRI holds finite intensities only")
    return data


def _load_cine(cine_path: Path, site: str) -> tuple[np.ndarray, tuple[float, ...]]:
    """The patient's ``_4d.nii.gz`` as ``(H, W, Z, T)`` (a 3D file counts as one frame)."""
    data, zooms = load_nifti(cine_path, site=site)
    _finite_image(data, cine_path, site)
    if data.ndim == 3:
        data = data[..., None]
    if data.ndim != 4:
        raise _err(site, cine_path, f"expected a 4D (H, W, Z, T) cine, got shape {data.shape}",
                   "restore the patient's _4d.nii.gz from the ACDC archive")
    return data, zooms


def _frame_volume(data: np.ndarray, img_path: Path, site: str) -> np.ndarray:
    """A per-frame file's data as ``(H, W, Z)`` (a trailing singleton time axis is dropped)."""
    if data.ndim == 4 and data.shape[3] == 1:
        data = data[..., 0]
    if data.ndim != 3:
        raise _err(site, img_path, f"expected a 3D (H, W, Z) volume, got shape {data.shape}",
                   "use the per-frame patientNNN_frameXX.nii.gz files, not the 4D cine")
    return _finite_image(data, img_path, site)


def _phase_image(
    pdir: Path, patient_id: str, phase: str, frame: int, *, with_labels: bool,
    cine: dict[str, tuple[np.ndarray, tuple[float, ...]]], site: str,
) -> tuple[np.ndarray, tuple[float, ...]]:
    """The ``(H, W, Z)`` image and zooms of the ED or ES frame.

    The ``_frameMM`` file is used when present. Without it, unlabelled loading takes frame
    ``frame`` (1-based) out of the ``_4d`` cine, loaded once per patient into ``cine``;
    labelled loading needs the frame file, since its ``_gt`` labels belong to it.
    """
    img_path = _frame_path(pdir, patient_id, frame)
    if img_path.is_file():
        data, zooms = load_nifti(img_path, site=site)
        return _frame_volume(data, img_path, site), zooms
    cine_path = pdir / f"{patient_id}_4d.nii.gz"
    if with_labels:
        raise _err(site, img_path, f"{phase} frame image not found (labelled loading needs it and its _gt file)",
                   "restore patientNNN_frameMM.nii.gz and _frameMM_gt.nii.gz, or leave this patient out of the "
                   "labelled (fine-tuning) data: a folder with only the _4d cine serves pre-training only")
    if not cine_path.is_file():
        raise _err(site, img_path, f"{phase} frame image not found, and no 4D cine {cine_path.name} to take it from",
                   "restore patientNNN_frameMM.nii.gz or patientNNN_4d.nii.gz from the ACDC archive")
    if "data" not in cine:
        cine["data"] = _load_cine(cine_path, site)
    data, zooms = cine["data"]
    n_frames = data.shape[3]
    if not 1 <= frame <= n_frames:
        raise _err(site, cine_path, f"Info.cfg gives {phase}: {frame} but the cine has {n_frames} frames "
                   "(frame numbers are 1-based)", f"correct {phase} in {pdir / 'Info.cfg'} or restore the full cine")
    return data[..., frame - 1], zooms


def _load_label(gt_path: Path, shape: tuple[int, ...], site: str) -> np.ndarray:
    """A ``_gt`` file as ``(H, W, Z)``: same shape as its image, values in :data:`ACDC_LABELS`.

    Float files are accepted when every value is one of the integers 0-3; a non-integer value
    (e.g. from linear-interpolation resampling) is refused, never rounded into some class.
    """
    label, _ = load_nifti(gt_path, site=site)
    if label.ndim == 4 and label.shape[3] == 1:
        label = label[..., 0]
    if label.shape != shape:
        raise _err(site, gt_path, f"label shape {label.shape} does not match image shape {shape}",
                   "the _gt file must come from the same frame as the image")
    return _checked_label(label, gt_path, site)


def _checked_label(label: np.ndarray, gt_path: Path, site: str) -> np.ndarray:
    bad = _non_integral(label)
    if bad.any():
        raise _err(site, gt_path, f"label file holds {int(bad.sum())} non-integer value(s), "
                   f"e.g. {_examples(label[bad])}",
                   "labels must be the integers 0 (bg), 1 (RV), 2 (MYO), 3 (LV); resample label maps "
                   "with nearest-neighbour, not linear interpolation")
    outside = ~np.isin(label, ACDC_LABELS)
    if outside.any():
        raise _err(site, gt_path, f"label values {_examples(label[outside])} are not ACDC classes",
                   "labels must be 0 (bg), 1 (RV), 2 (MYO) or 3 (LV)")
    return label


def load_patient(
    root: PathLike,
    patient_id: str,
    *,
    with_labels: bool,
    target_spacing: float = 1.25,
    image_size: int = 192,
    frames: str = "ed_es",
    site: str = "",
) -> list[Volume]:
    """Load and preprocess one patient.

    Args:
        root: folder holding the ``patientNNN`` folders.
        patient_id: e.g. ``"patient001"``.
        with_labels: load the ``_gt`` label maps. When False no ``_gt`` file is opened (the
            pre-training phase must not touch labels).
        target_spacing / image_size: see :func:`preprocess_volume`.
        frames: ``"ed_es"`` -> the ED and ES volumes (phases ``"ED"``, ``"ES"``; unlabelled, they
            come from the cine when the ``_frameMM`` files are absent); ``"all"`` ->
            every frame of ``patientNNN_4d.nii.gz`` (phases ``"frame01"``, ``"frame02"`` ...,
            unlabelled).
        site: site name used in error messages and stored in ``Volume.site``.

    Raises:
        ValueError: bad ``frames`` value, or ``frames="all"`` with ``with_labels=True``.
        ACDCDataError: missing folder / Info.cfg / NIfTI, corrupt file, inconsistent shapes,
            non-integer or non-ACDC label values, ED/ES outside the cine.
    """
    if frames not in ("ed_es", "all"):
        raise ValueError(f"frames={frames!r}: must be 'ed_es' or 'all'")
    if frames == "all" and with_labels:
        raise ValueError("frames='all' loads unlabelled cine frames; use with_labels=False "
                         "(labels exist only for the ED and ES frames: frames='ed_es')")
    pdir = Path(root) / patient_id
    if not pdir.is_dir():
        raise _err(site, pdir, f"patient folder {patient_id} not found",
                   "check the patient list for this site (list_patients(root)) and the data root")
    info = read_info_cfg(pdir / "Info.cfg", site=site)

    volumes: list[Volume] = []
    if frames == "ed_es":
        cine: dict[str, tuple[np.ndarray, tuple[float, ...]]] = {}
        for phase in ("ED", "ES"):
            frame = int(info[phase])
            data, zooms = _phase_image(pdir, patient_id, phase, frame, with_labels=with_labels, cine=cine, site=site)
            label = None
            if with_labels:
                label = _load_label(_frame_path(pdir, patient_id, frame, gt=True), data.shape, site)
            img_p, lab_p = preprocess_volume(
                data, (zooms[0], zooms[1]), target_spacing=target_spacing,
                image_size=image_size, label_hwz=label,
            )
            volumes.append(Volume(patient_id=patient_id, phase=phase, image=img_p, label=lab_p, site=site))
    else:
        data, zooms = _load_cine(pdir / f"{patient_id}_4d.nii.gz", site)
        for t in range(data.shape[3]):
            img_p, _ = preprocess_volume(
                data[..., t], (zooms[0], zooms[1]), target_spacing=target_spacing, image_size=image_size
            )
            volumes.append(Volume(patient_id=patient_id, phase=f"frame{t + 1:02d}", image=img_p, site=site))
    return volumes


def load_site(
    root: PathLike,
    *,
    with_labels: bool,
    target_spacing: float = 1.25,
    image_size: int = 192,
    frames: str = "ed_es",
    site: str = "",
    patients: Optional[list[str]] = None,
) -> list[Volume]:
    """Load every patient of one site (or only ``patients``), in patient order.

    Each returned :class:`Volume` has ``site`` set. ``patients=None`` means every ``patientNNN``
    folder under ``root`` (see :func:`list_patients`).
    """
    ids = list_patients(root, site=site) if patients is None else list(patients)
    volumes: list[Volume] = []
    for pid in ids:
        for vol in load_patient(root, pid, with_labels=with_labels, target_spacing=target_spacing,
                                image_size=image_size, frames=frames, site=site):
            vol.site = site
            volumes.append(vol)
    return volumes


_VOLUME_CLASSES = (("RV", 1), ("MYO", 2), ("LV", 3))


def cavity_volumes(root: PathLike, site: str = "") -> list[dict[str, Any]]:
    """Per patient under ``root`` (a folder of ``patientNNN/``): its group, the RV / MYO / LV volumes in ml at ED
    and ES (voxel counts of the ``_gt`` files times the voxel volume of their header), RV / LV at ED and both
    ejection fractions (``nan`` where the ED cavity is empty).  Reads only labels and ``Info.cfg``: a check of a
    data set's anatomy (e.g. the synthetic generator's against the ACDC groups), not of its images.

    Raises:
        ACDCDataError: a missing or corrupt ``Info.cfg`` or ``_gt`` file (naming the file and the site), or
            labels outside 0-3.
    """
    rows = []
    for pid in list_patients(root, site):
        pdir = Path(root) / pid
        info = read_info_cfg(pdir / "Info.cfg", site)
        row: dict[str, Any] = {"patient": pid, "group": str(info.get("Group", "unknown"))}
        for phase in ("ED", "ES"):
            gt = _frame_path(pdir, pid, int(info[phase]), gt=True)
            label, zooms = load_nifti(gt, site=site)
            label = _checked_label(label, gt, site)
            ml = float(np.prod(zooms[:3])) / 1000.0
            for name, value in _VOLUME_CLASSES:
                row[f"{name}_{phase}_ml"] = float(np.count_nonzero(label == value)) * ml
        row["RV_LV_ED"] = row["RV_ED_ml"] / row["LV_ED_ml"] if row["LV_ED_ml"] > 0 else float("nan")
        for name in ("RV", "LV"):
            ed = row[f"{name}_ED_ml"]
            row[f"{name}_EF"] = 1.0 - row[f"{name}_ES_ml"] / ed if ed > 0 else float("nan")
        rows.append(row)
    return rows


def summarise_cavity_volumes(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Group means of :func:`cavity_volumes` rows, in ACDC's group order (other groups after, sorted): ``n``, the
    mean of every volume, of RV / LV at ED and of both ejection fractions (each the mean of the patients' own
    ratios, ignoring ``nan``)."""
    keys = [f"{c}_{p}_ml" for p in ("ED", "ES") for c, _ in _VOLUME_CLASSES] + ["RV_LV_ED", "RV_EF", "LV_EF"]
    rank = {g: i for i, g in enumerate(ACDC_GROUPS)}
    groups = sorted({r["group"] for r in rows}, key=lambda g: (rank.get(g, len(rank)), g))
    out = []
    for g in groups:
        members = [r for r in rows if r["group"] == g]
        summary: dict[str, Any] = {"group": g, "n": len(members)}
        for k in keys:
            vals = np.array([r[k] for r in members], dtype=np.float64)
            vals = vals[~np.isnan(vals)]
            summary[k] = float(vals.mean()) if vals.size else float("nan")
        out.append(summary)
    return out


class PartitionSampleDataset(Dataset):
    """FCL pre-training samples: one random slice from each of the S partitions of a volume.

    Partition ``s`` of a volume with ``Z`` slices is ``np.array_split(np.arange(Z), S)[s]``.
    Item ``i`` is ``(x, part)`` with ``x`` a float tensor ``[S, 1, H, W]`` whose row ``s`` is a slice
    drawn uniformly from partition ``s`` of volume ``i`` (order kept), and ``part = arange(S)``.

    Randomness: item ``i`` in epoch ``e`` uses ``np.random.default_rng([seed, e, i])``, so the
    draw depends only on (seed, epoch, index) - not on access order or DataLoader workers - and
    runs are reproducible. Call :meth:`set_epoch` each epoch to draw new slices.
    """

    def __init__(self, volumes: list[Volume], n_partitions: int = 4, seed: int = 0) -> None:
        if n_partitions <= 0:
            raise ValueError(f"n_partitions={n_partitions}: must be a positive integer")
        if not volumes:
            raise ValueError("PartitionSampleDataset needs at least one volume")
        for v in volumes:
            if v.n_slices < n_partitions:
                raise ValueError(
                    f"volume {v.patient_id}/{v.phase} (site {_site_name(v.site)}) has {v.n_slices} slices, "
                    f"fewer than n_partitions={n_partitions}; lower n_partitions or drop this volume"
                )
        self.volumes = list(volumes)
        self.n_partitions = int(n_partitions)
        self.seed = int(seed)
        self.epoch = 0
        self._partitions = [np.array_split(np.arange(v.n_slices), self.n_partitions) for v in self.volumes]

    def set_epoch(self, epoch: int) -> None:
        """Reseed: items drawn after this call use epoch ``epoch``."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.volumes)

    def n_batches(self, volumes_per_batch: int, max_batches: int = 0) -> int:
        """Full batches of ``volumes_per_batch`` volumes in one epoch (capped by ``max_batches`` if > 0)."""
        n = len(self) // max(1, volumes_per_batch)
        return min(n, max_batches) if max_batches else n

    def batches(self, volumes_per_batch: int, epoch: int, max_batches: int = 0, *, workers: int = 0,
                pin_memory: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One epoch of shuffled batches ``(x [V, S, 1, H, W], part [V, S])``, reproducible from (seed, epoch);
        ``workers`` / ``pin_memory``: :func:`fedssl.data.loading.load_batches` (the same batches)."""
        self.set_epoch(epoch)
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self))
        v = max(1, volumes_per_batch)
        yield from load_batches(self, [order[b * v : (b + 1) * v] for b in range(self.n_batches(v, max_batches))],
                                workers=workers, pin_memory=pin_memory)

    def slice_indices(self, index: int) -> np.ndarray:
        """The slice index drawn from each partition for item ``index`` in the current epoch."""
        rng = np.random.default_rng([self.seed, self.epoch, index])
        return np.array([int(rng.choice(p)) for p in self._partitions[index]], dtype=np.int64)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} volumes")
        idx = self.slice_indices(index)
        x = torch.from_numpy(np.ascontiguousarray(self.volumes[index].image[idx], dtype=np.float32))
        return x.unsqueeze(1), torch.arange(self.n_partitions, dtype=torch.long)


class SliceDataset(Dataset):
    """Every 2D slice of a list of labelled volumes, for segmentation fine-tuning.

    Item -> ``(image FloatTensor [1, H, W], label LongTensor [H, W])``; slices are ordered by
    volume then slice index.
    """

    def __init__(self, volumes: list[Volume]) -> None:
        for v in volumes:
            if v.label is None:
                raise ValueError(
                    f"volume {v.patient_id}/{v.phase} (site {_site_name(v.site)}) has no label; "
                    "load fine-tuning data with with_labels=True"
                )
            if v.label.shape != v.image.shape:
                raise ValueError(f"volume {v.patient_id}/{v.phase}: label shape {v.label.shape} "
                                 f"!= image shape {v.image.shape}")
        self.volumes = list(volumes)
        self.index = [(vi, z) for vi, v in enumerate(self.volumes) for z in range(v.n_slices)]

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        vi, z = self.index[index]
        v = self.volumes[vi]
        img = torch.from_numpy(np.ascontiguousarray(v.image[z], dtype=np.float32)).unsqueeze(0)
        assert v.label is not None
        lab = torch.from_numpy(np.ascontiguousarray(v.label[z]).astype(np.int64))
        return img, lab
