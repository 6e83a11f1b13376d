"""The in-memory unit every 3D loader yields: one preprocessed volume of one patient."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import nibabel as nib
import numpy as np


@dataclass
class Volume:
    """A preprocessed 3D volume (slice axis first).

    image: float32 ``[Z, H, W]`` in [0, 1] (percentile-clipped, min-max scaled, resampled in-plane).
    label: uint8 ``[Z, H, W]`` (ACDC: 0 bg, 1 RV, 2 MYO, 3 LV) or None when loaded unlabelled.
    phase: "ED", "ES" or "frameNN" for unlabelled cine frames.
    """

    patient_id: str
    phase: str
    image: np.ndarray
    label: Optional[np.ndarray] = None
    site: str = ""

    @property
    def n_slices(self) -> int:
        return int(self.image.shape[0])


def read_nifti(path: str) -> tuple[np.ndarray, tuple[float, ...]]:
    """A NIfTI file's data (float32) and voxel spacing.  nibabel raises many exception types for a bad file
    (ImageFileError, OSError, EOFError, zlib.error ...): the data set's loader catches them and names the file,
    the site and its own fix."""
    img = nib.load(str(path))
    data = np.asarray(img.get_fdata(dtype=np.float32), dtype=np.float32)
    return data, tuple(float(z) for z in img.header.get_zooms())
