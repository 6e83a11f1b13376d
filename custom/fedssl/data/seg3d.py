"""3D segmentation data: labelled volumes of ACDC and HVSMR as MONAI dictionaries, and their MONAI 3D transforms.

Items are ``{"image": path, "label": path, "id": "patient001_ED"}`` read from each data set's real layout
(:mod:`fedssl.data.acdc`: ``patientNNN/patientNNN_frameNN.nii.gz`` + ``_gt``, the ED and ES frames of
``Info.cfg``; :mod:`fedssl.data.hvsmr`: ``training_<variant>_patN.nii.gz`` + ``-label``).  The deterministic part
of the pipeline (load, channel first, orientation, spacing, intensity, padding to the patch) runs once per
volume in :func:`load_volumes`, which names the file and the site when a volume cannot be read or its label is
not a map of the data set's classes; the random part (patches around foreground and background, flips,
intensity jitter) runs every time a patch is drawn.

Orientation: ACDC's short-axis stacks keep their voxel order (``axcodes=None``): the slice axis stays last,
where the anisotropic kernels of :func:`fedssl.models.dynunet3d.plan_dynunet` expect the 10 mm spacing;
re-orienting an oblique short-axis stack to RAS would move it.  HVSMR's axial volumes go to RAS.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from fedssl.data import acdc, hvsmr

#: foreground classes by data set (0 is background)
CLASSES: dict[str, dict[int, str]] = {"acdc": dict(acdc.ACDC_CLASSES), "hvsmr": dict(hvsmr.HVSMR_CLASSES)}
#: default orientation per data set (None: keep the acquisition's voxel order)
AXCODES: dict[str, str | None] = {"acdc": None, "hvsmr": "RAS"}


class Seg3DDataError(ValueError):
    """A 3D volume that cannot be used, naming the file, the site and the fix."""


def acdc_items(root: str, site: str = "") -> list[dict]:
    """The ED and ES volumes of every patient under ``root`` with their label files."""
    items = []
    for pid in acdc.list_patients(root, site=site):
        pdir = Path(root) / pid
        info = acdc.read_info_cfg(pdir / "Info.cfg", site=site)
        for phase in ("ED", "ES"):
            frame = int(info[phase])
            image, label = (pdir / f"{pid}_frame{frame:02d}{suffix}.nii.gz" for suffix in ("", "_gt"))
            for path in (image, label):
                if not path.is_file():
                    raise Seg3DDataError(f"site {site or '?'}: {path}: {phase} frame file not found; 3D segmentation "
                                         "reads the labelled ED/ES frames (patientNNN_frameNN.nii.gz and its _gt)")
            items.append({"image": str(image), "label": str(label), "id": f"{pid}_{phase}"})
    return items


def hvsmr_items(root: str, site: str = "", variant: str = "axial_crop") -> list[dict]:
    return [{"image": str(img), "label": str(lab), "id": subject}
            for subject, (img, lab) in hvsmr.subject_files(root, variant=variant, site=site).items()]


def patient_of(item_id: str, dataset: str) -> str:
    """The patient of an item id: ACDC "patient001_ED" -> "patient001"; an HVSMR subject is its own patient."""
    return item_id.rsplit("_", 1)[0] if dataset == "acdc" else item_id


def list_items(dataset: str, root: str, site: str = "") -> list[dict]:
    if dataset == "acdc":
        return acdc_items(root, site)
    if dataset == "hvsmr":
        return hvsmr_items(root, site)
    raise ValueError(f"dataset={dataset!r}: use 'acdc' or 'hvsmr'")


def base_transform(pixdim: Sequence[float], roi_size: Sequence[int], axcodes: str | None):
    """Deterministic: load, channel first, orientation (unless None), resample to ``pixdim`` (bilinear image,
    nearest label), intensity to [0, 1] between the 1st and 99th percentiles, pad to at least ``roi_size``."""
    from monai import transforms as mt

    steps = [mt.LoadImaged(keys=["image", "label"], image_only=True), mt.EnsureChannelFirstd(keys=["image", "label"]),
             mt.Lambdad(keys="image", func=_finite)]
    if axcodes:
        steps.append(mt.Orientationd(keys=["image", "label"], axcodes=axcodes,
                                     labels=(("L", "R"), ("P", "A"), ("I", "S"))))
    steps += [
        mt.Spacingd(keys=["image", "label"], pixdim=tuple(float(p) for p in pixdim), mode=("bilinear", "nearest")),
        mt.ScaleIntensityRangePercentilesd(keys="image", lower=1, upper=99, b_min=0.0, b_max=1.0, clip=True),
        mt.SpatialPadd(keys=["image", "label"], spatial_size=tuple(int(r) for r in roi_size)),
        # labels stay float32 here: load_volumes checks the values before the uint8 cast (256 must not wrap to 0)
        mt.EnsureTyped(keys=["image", "label"], dtype=(torch.float32, torch.float32), track_meta=False),
    ]
    return mt.Compose(steps)


def _finite(image):
    """The image unchanged, or ValueError when a voxel is NaN or infinite (before resampling spreads or the
    intensity clip hides it)."""
    bad = int(image.numel() - torch.isfinite(torch.as_tensor(image)).sum())
    if bad:
        raise ValueError(f"{bad} voxel(s) are NaN or infinite")
    return image


def train_transform(roi_size: Sequence[int], num_samples: int = 2):
    """Random: ``num_samples`` patches of ``roi_size`` per volume, half centred on foreground; in-plane flips;
    intensity scale and shift."""
    from monai import transforms as mt

    return mt.Compose([
        mt.RandCropByPosNegLabeld(keys=["image", "label"], label_key="label",
                                  spatial_size=tuple(int(r) for r in roi_size),
                                  pos=1, neg=1, num_samples=int(num_samples)),
        mt.RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=0),
        mt.RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=1),
        mt.RandScaleIntensityd(keys="image", factors=0.1, prob=0.5),
        mt.RandShiftIntensityd(keys="image", offsets=0.1, prob=0.5),
    ])


def load_volumes(items: Sequence[dict], dataset: str, pixdim: Sequence[float], roi_size: Sequence[int],
                 site: str = "", axcodes: str | None = "default") -> list[dict]:
    """Each item through :func:`base_transform`: ``{"image": float32 [1, X, Y, Z], "label": uint8 [1, X, Y, Z],
    "id"}``.  A file that cannot be read or resampled, or a label outside the data set's classes, raises
    :class:`Seg3DDataError` naming it and the site."""
    codes = AXCODES[dataset] if axcodes == "default" else axcodes
    transform = base_transform(pixdim, roi_size, codes)
    allowed = {0, *CLASSES[dataset]}
    out = []
    for item in items:
        try:
            d = transform({"image": item["image"], "label": item["label"]})
        except Exception as e:  # noqa: BLE001 -- nibabel / MONAI raise many types; the message names the file
            cause = e.__cause__ or e
            raise Seg3DDataError(f"site {site or '?'}: {item['image']} (label {item['label']}): cannot be loaded as a "
                                 f"3D volume ({type(cause).__name__}: {str(cause)[:200]}); restore the file "
                                 "pair") from None
        if tuple(d["image"].shape) != tuple(d["label"].shape):
            raise Seg3DDataError(f"site {site or '?'}: {item['label']}: label shape {tuple(d['label'].shape)} differs "
                                 f"from the image's {tuple(d['image'].shape)}; the pair must share one grid")
        values = set(np.unique(d["label"].numpy()).tolist())  # float32: checked before any cast
        if not values <= allowed:
            shown = sorted(v if not float(v).is_integer() else int(v) for v in values - allowed)[:5]
            raise Seg3DDataError(f"site {site or '?'}: {item['label']}: label values {shown} are "
                                 f"not {dataset} classes {sorted(allowed)}")
        out.append({"image": d["image"], "label": d["label"].to(torch.uint8), "id": item["id"]})
    return out
