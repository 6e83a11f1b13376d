"""Loader for the HVSMR 2016 challenge (Pace et al., MICCAI 2015) on-disk layout, the target of FCL's transfer study.

FCL (Wu et al., MedIA 2022) section 5, "Dataset and preprocessing": HVSMR "contains 10 3D cardiac MRI images captured in
an axial view using a 1.5T scanner with expert annotations of the blood pool and ventricular myocardium"; each 3D
volume is min-max normalised to its [x_1, x_99] percentiles, then the 2D images and annotations are resampled to
0.7 x 0.7 mm^2.  Section 5.4 / Table 5 fine-tunes the U-Net on these 2D slices (:mod:`fedssl.train.transfer`).

Layout read (the challenge's training archive: one image and one label NIfTI per subject, ``N`` = 0 ... 9)::

    root/training_axial_crop_patN.nii.gz          # image, (X, Y, Z) with Z the axial slice axis
    root/training_axial_crop_patN-label.nii.gz    # labels: 0 background, 1 myocardium, 2 blood pool

or, as the archive unpacks, the images under ``root/Training dataset/`` and the labels under ``root/Ground truth/``.
``.nii`` instead of ``.nii.gz`` is accepted.  The archive ships three versions of every subject: ``axial_crop``
(cropped around the heart; the default), ``axial_full`` and ``sa_crop`` (short-axis reformat); ``variant`` picks one.
The unlabelled ``testing_*_patN`` files (N = 10 ... 19) belong to the layout and are not loaded.  Anything else that
looks like an image (another name, e.g. a ``_label_A`` repackaging, or another format such as ``.mha``) is refused
with :class:`HVSMRDataError` naming the file, as is an image without its label (and the reverse), a corrupt file, a
label that is not an integer map of {0, 1, 2} of the image's shape.

Every message names the offending path, the site that hit it and the fix.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional, Union

import numpy as np

from fedssl.data.acdc import preprocess_volume
from fedssl.data.volume import Volume, read_nifti

__all__ = [
    "HVSMRDataError",
    "HVSMR_CLASSES",
    "VARIANTS",
    "PAPER_SPACING",
    "list_subjects",
    "subject_files",
    "load_subject",
    "load_hvsmr",
]

PathLike = Union[str, "os.PathLike[str]"]

#: HVSMR 2016 foreground labels (0 is background), as the challenge's ground truth encodes them
HVSMR_CLASSES: dict[int, str] = {1: "myocardium", 2: "blood_pool"}
#: the three versions of every subject in the challenge archive
VARIANTS: tuple[str, ...] = ("axial_crop", "axial_full", "sa_crop")
#: FCL section 5: "resample the 2D images and corresponding annotations to a fixed pixel size 0.7 x 0.7 mm^2"
PAPER_SPACING = 0.7
#: the archive's two sub-folders (images, labels); without them both lie directly in the root
IMAGE_DIR, LABEL_DIR = "Training dataset", "Ground truth"

_NAME_RE = re.compile(r"^(training|testing)_(axial_crop|axial_full|sa_crop)_pat(\d+)(-label)?\.nii(\.gz)?$")
_IMAGE_SUFFIXES = (".nii", ".nii.gz", ".mha", ".mhd", ".nrrd", ".img", ".hdr", ".dcm")
_LAYOUT = ("training_<variant>_patN.nii.gz + training_<variant>_patN-label.nii.gz side by side, or under "
           f"'{IMAGE_DIR}/' and '{LABEL_DIR}/' (variant: {', '.join(VARIANTS)})")


class HVSMRDataError(ValueError):
    """A problem with HVSMR data on disk; the message names the path, the site and the fix."""


def _err(site: str, path: PathLike, problem: str, fix: str) -> HVSMRDataError:
    return HVSMRDataError(f"[site {site or '<unnamed site>'}] {problem}: {os.fspath(path)}. Fix: {fix}")


def _folders(root: Path, site: str) -> tuple[Path, Path]:
    """(image folder, label folder) of ``root``: the archive's two sub-folders when present, else ``root`` itself."""
    if not root.is_dir():
        raise _err(site, root, "HVSMR root folder does not exist or is not a directory",
                   f"point the data root at the HVSMR 2016 training data ({_LAYOUT})")
    images, labels = root / IMAGE_DIR, root / LABEL_DIR
    if images.is_dir() != labels.is_dir():
        missing = labels if images.is_dir() else images
        raise _err(site, missing, "HVSMR archive layout is incomplete (one of its two folders is missing)",
                   f"restore both '{IMAGE_DIR}/' and '{LABEL_DIR}/', or put every file directly in the root")
    return (images, labels) if images.is_dir() else (root, root)


def _scan(folder: Path, site: str) -> dict[tuple[str, str, int, bool], Path]:
    """Every HVSMR file of ``folder`` keyed by (split, variant, subject number, is label); unknown image files
    refused."""
    try:
        names = sorted(os.listdir(folder))
    except OSError as exc:
        raise _err(site, folder, f"cannot read folder ({exc.__class__.__name__}: {exc})",
                   "check the folder's permissions for the user running the FLARE client") from exc
    found: dict[tuple[str, str, int, bool], Path] = {}
    for name in names:
        m = _NAME_RE.match(name)
        if m is None:
            if name.lower().endswith(_IMAGE_SUFFIXES):
                raise _err(site, folder / name, "file is not part of the HVSMR 2016 layout",
                           f"expected {_LAYOUT} (NIfTI only; convert or move other files away)")
            continue
        key = (m.group(1), m.group(2), int(m.group(3)), m.group(4) is not None)
        if key in found:
            raise _err(site, folder / name, f"subject pat{key[2]} has two copies ({found[key].name} and {name})",
                       "keep either the .nii or the .nii.gz file")
        found[key] = folder / name
    return found


def subject_files(root: PathLike, variant: str = "axial_crop", site: str = "") -> dict[str, tuple[Path, Path]]:
    """``{"pat0": (image path, label path), ...}`` of the labelled (training) subjects of ``variant``, in subject order.

    Raises:
        HVSMRDataError: root missing, a file outside the layout, an image without its label or a label without
            its image, or no subject of ``variant``.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r}: use one of {list(VARIANTS)}")
    image_dir, label_dir = _folders(Path(root), site)
    files = _scan(image_dir, site)
    if label_dir != image_dir:
        files.update({k: v for k, v in _scan(label_dir, site).items() if k[3]})
    images = {n: p for (split, var, n, lab), p in files.items() if split == "training" and var == variant and not lab}
    labels = {n: p for (split, var, n, lab), p in files.items() if split == "training" and var == variant and lab}
    for n in sorted(set(labels) - set(images)):
        raise _err(site, labels[n], f"label of subject pat{n} has no image",
                   f"restore {image_dir / f'training_{variant}_pat{n}.nii.gz'}")
    for n in sorted(set(images) - set(labels)):
        raise _err(site, images[n], f"image of subject pat{n} has no label",
                   f"restore {label_dir / f'training_{variant}_pat{n}-label.nii.gz'} (fine-tuning needs every label)")
    if not images:
        raise _err(site, image_dir, f"no HVSMR training subject of variant {variant!r} found",
                   f"expected {_LAYOUT}; write synthetic data with `fedssl fcl hvsmr-synth` if the real set is absent")
    return {f"pat{n}": (images[n], labels[n]) for n in sorted(images)}


def list_subjects(root: PathLike, variant: str = "axial_crop", site: str = "") -> list[str]:
    """The labelled subject ids (``"pat0"``, ``"pat1"``, ...) of ``variant`` under ``root``, in number order."""
    return list(subject_files(root, variant, site))


def _load_nifti(path: Path, site: str) -> tuple[np.ndarray, tuple[float, ...]]:
    """A 3D NIfTI's data (float32) and voxel spacing; a trailing singleton axis is dropped."""
    try:
        data, zooms = read_nifti(path)
    except Exception as exc:  # nibabel raises many types (ImageFileError, OSError, EOFError, zlib.error ...)
        raise _err(site, path, f"corrupt or unreadable NIfTI file ({exc.__class__.__name__}: {exc})",
                   "re-extract this file from the HVSMR 2016 archive; it is not a valid NIfTI-1 image") from exc
    if data.ndim == 4 and data.shape[3] == 1:
        data = data[..., 0]
    if data.ndim != 3:
        raise _err(site, path, f"expected a 3D (X, Y, Z) volume, got shape {data.shape}",
                   "HVSMR images and labels are single 3D volumes")
    if not all(np.isfinite(z) and z > 0 for z in zooms[:3]):
        raise _err(site, path, f"voxel spacing {zooms[:3]} is not positive",
                   "the header's pixdim must hold the spacing in mm (the in-plane resampling needs it)")
    return data, zooms


def _check_label(label: np.ndarray, shape: tuple[int, ...], path: Path, site: str) -> None:
    """Same shape as the image, integer values in {0, 1, 2} (never rounded into a class)."""
    if label.shape != shape:
        raise _err(site, path, f"label shape {label.shape} does not match image shape {shape}",
                   "the -label file must belong to the image of the same subject and variant")
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(label) | (label != np.rint(label))
    if bad.any():
        raise _err(site, path, f"label file holds {int(bad.sum())} non-integer value(s), e.g. "
                   f"{', '.join(f'{v:g}' for v in np.unique(label[bad])[:5])}",
                   "labels must be the integers 0 (background), 1 (myocardium), 2 (blood pool); resample label maps "
                   "with nearest-neighbour")
    outside = ~np.isin(label, (0, *HVSMR_CLASSES))
    if outside.any():
        raise _err(site, path, f"label values {', '.join(f'{v:g}' for v in np.unique(label[outside])[:5])} are not "
                   "HVSMR 2016 classes", "labels must be 0 (background), 1 (myocardium) or 2 (blood pool); a "
                   "relabelled copy (e.g. HVSMR 2.0's aorta / pulmonary artery classes) must be mapped back first")


def load_subject(
    root: PathLike,
    subject: str,
    *,
    variant: str = "axial_crop",
    target_spacing: float = PAPER_SPACING,
    image_size: int = 192,
    site: str = "",
) -> Volume:
    """One preprocessed labelled subject: a :class:`Volume` of axial slices ``[Z, image_size, image_size]``.

    Preprocessing is :func:`fedssl.data.acdc.preprocess_volume` (FCL section 5): percentile min-max of the 3D
    volume, in-plane resampling of every slice to ``target_spacing`` mm (bilinear / nearest for the labels), centre
    crop or zero pad.  ``Volume.phase`` holds the variant.
    """
    files = subject_files(root, variant, site)
    if subject not in files:
        raise _err(site, root, f"subject {subject!r} not found (have {', '.join(files)})",
                   "pass one of the listed subject ids")
    image_path, label_path = files[subject]
    return _load_pair(subject, image_path, label_path, variant, target_spacing, image_size, site)


def _load_pair(subject: str, image_path: Path, label_path: Path, variant: str, target_spacing: float,
               image_size: int, site: str) -> Volume:
    image, zooms = _load_nifti(image_path, site)
    label, _ = _load_nifti(label_path, site)
    _check_label(label, image.shape, label_path, site)
    try:
        img, lab = preprocess_volume(image, (zooms[0], zooms[1]), target_spacing=target_spacing,
                                     image_size=image_size, label_hwz=label)
    except ValueError as exc:
        raise _err(site, image_path, f"cannot preprocess ({exc})",
                   "check target_spacing / image_size (positive) and the file's header") from exc
    return Volume(patient_id=subject, phase=variant, image=img, label=lab, site=site)


def load_hvsmr(
    root: PathLike,
    *,
    variant: str = "axial_crop",
    target_spacing: float = PAPER_SPACING,
    image_size: int = 192,
    subjects: Optional[list[str]] = None,
    site: str = "",
) -> list[Volume]:
    """Every labelled subject of ``variant`` under ``root`` (or only ``subjects``), preprocessed as in
    :func:`load_subject`, in subject order.  The layout is checked as a whole before any volume is read."""
    files = subject_files(root, variant, site)
    ids = list(files) if subjects is None else list(subjects)
    unknown = [s for s in ids if s not in files]
    if unknown:
        raise _err(site, root, f"subjects {unknown} not found (have {', '.join(files)})",
                   "pass subject ids from list_subjects(root)")
    return [_load_pair(s, *files[s], variant, target_spacing, image_size, site) for s in ids]
