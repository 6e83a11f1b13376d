"""RSNA Pneumonia as a segmentation set: FedDRA's segmentation downstream task (appendix A.1.2: "Following Wang et
al. (2022) [MGCA], we convert RSNA object detection ground truths into segmentation masks").

Layout: the Kaggle RSNA Pneumonia Detection release (see :func:`fedssl.data.vlp.load_rsna_pneumonia`):
``stage_2_train_labels.csv`` with one row per box, ``patientId,x,y,width,height,Target``, the boxes in the pixel
frame of the 1024 x 1024 DICOM, and the images converted to PNG / JPG.  A patient's mask is the union of its boxes
(1 inside any box, 0 elsewhere; an empty mask for Target 0), as MGCA's ``RSNASegmentDataset`` builds it.  The PNG may
have been resized from the DICOM: the boxes are scaled by the image's size over :data:`RSNA_FRAME`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from fedssl.core.checks import require
from fedssl.data.cxr import _read_rows, _require_columns, checked_rows
from fedssl.data.vlp import RSNA_CSVS, VLPDataset, VLPRecord, _err, load_rsna_pneumonia

#: the pixel frame of RSNA's boxes (the DICOMs are 1024 x 1024)
RSNA_FRAME = 1024

Box = tuple[float, float, float, float]


def _box_value(value: str, path: Path, row: int, column: str, site: str) -> float:
    try:
        v = float(value)
    except ValueError:
        raise _err(site, path, f"{column}={value!r} is not a number", "restore the CSV (boxes in pixels)",
                   row) from None
    if not np.isfinite(v) or v < 0 or v > 4 * RSNA_FRAME:
        raise _err(site, path, f"{column}={value!r} is outside the 1024 px frame", "restore the CSV", row)
    return v


def load_rsna_segmentation(root: object, site: str = "?",
                           check_images: bool = True) -> list[tuple[str, tuple[Box, ...]]]:
    """``[(image path, boxes)]`` per patient in CSV order (the order of :func:`load_rsna_pneumonia`); ``boxes`` are
    ``(x, y, width, height)`` in the 1024 px frame, empty for Target 0.  A Target-1 row without a box, or a box on
    a Target-0 row, is an error naming the file and the row."""
    items = load_rsna_pneumonia(root, site=site, check_images=check_images)  # layout and image checks
    rp = Path(str(root))
    csv_path = next(rp / n for n in RSNA_CSVS if (rp / n).is_file())
    header, rows = _read_rows(csv_path, site)
    pos = _require_columns(header, ("patientId", "x", "y", "width", "height", "Target"), csv_path, site)
    boxes: dict[str, list[Box]] = {}
    for line, r in checked_rows(header, rows, csv_path, site, "restore the CSV", error=_err):
        pid, target = r[pos["patientId"]].strip(), r[pos["Target"]].strip()
        fields = [r[pos[c]].strip() for c in ("x", "y", "width", "height")]
        boxes.setdefault(pid, [])
        if target == "1":
            if not all(fields):
                raise _err(site, csv_path, "a Target 1 row without a box", "give x, y, width, height", line)
            x, y, w, h = (_box_value(v, csv_path, line, c, site) for v, c in zip(fields, ("x", "y", "width", "height")))
            boxes[pid].append((x, y, w, h))
        elif any(fields):
            raise _err(site, csv_path, "a Target 0 row with a box", "leave x, y, width, height empty", line)
    return [(path, tuple(boxes.get(Path(path).stem, ()))) for path, _ in items]


def box_mask(boxes: Sequence[Box], height: int, width: int, frame: int = RSNA_FRAME) -> np.ndarray:
    """``[height, width]`` uint8 mask of an image of that size covering the ``frame`` x ``frame`` original: a pixel
    is 1 when its centre lies in a box (scaled by size / frame)."""
    ys = (np.arange(height, dtype=np.float64) + 0.5) * frame / height
    xs = (np.arange(width, dtype=np.float64) + 0.5) * frame / width
    mask = np.zeros((height, width), np.uint8)
    for x, y, w, h in boxes:
        rows = (ys >= y) & (ys < y + h)
        cols = (xs >= x) & (xs < x + w)
        mask[np.ix_(rows, cols)] = 1
    return mask


class RSNASegmentationDataset(torch.utils.data.Dataset):
    """``(image [C, S, S], mask [1, S, S] float)`` items: the image through :class:`fedssl.data.vlp.VLPDataset`'s
    pipeline (grey, shorter edge ``S``, centre crop, ImageNet-style normalisation), the mask of its boxes at the
    resized size, cropped the same way.  ``has_box`` (0/1 per item) stratifies few-shot subsets."""

    def __init__(self, items: Sequence[tuple[str, Sequence[Box]]], image_size: int, channels: int = 3):
        require(len(items) > 0, "RSNASegmentationDataset", "items", len(items), "pass at least one (path, boxes) item")
        recs = [VLPRecord(image=p, text="", labels=(int(bool(b)),), patient=str(i), study=str(i), split="train")
                for i, (p, b) in enumerate(items)]
        self.images = VLPDataset(recs, image_size, channels=channels, cache=False)
        self.boxes = [tuple(b) for _, b in items]
        self.has_box = [int(bool(b)) for b in self.boxes]
        self.image_size = image_size

    def __len__(self) -> int:
        return len(self.boxes)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, _ = self.images[i]
        h, w = self.images.raw(i).shape[:2]
        s = self.image_size
        top, left = (h - s) // 2, (w - s) // 2
        m = box_mask(self.boxes[i], h, w)[top:top + s, left:left + s]
        return x, torch.from_numpy(m.astype(np.float32)).unsqueeze(0)


__all__ = ["RSNA_FRAME", "RSNASegmentationDataset", "box_mask", "load_rsna_segmentation"]
