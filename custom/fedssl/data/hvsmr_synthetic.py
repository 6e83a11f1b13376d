"""Synthetic HVSMR 2016 stand-in written in exactly the challenge's layout (read unchanged by :mod:`fedssl.data.hvsmr`).

:func:`write_synthetic_hvsmr` writes ``training_<variant>_patN.nii.gz`` (int16 image) and
``training_<variant>_patN-label.nii.gz`` (uint8: 0 background, 1 myocardium, 2 blood pool) for N = 0, 1, ...,
either side by side or under the archive's ``Training dataset/`` and ``Ground truth/`` folders.  Each subject is a
3D whole-heart phantom in an axial acquisition (axis 0 right -> left, axis 1 anterior -> posterior, axis 2
inferior -> superior, the slice axis), with the structure HVSMR labels carry (FCL section 5: "blood pool and
ventricular myocardium"):

* left ventricle: a prolate ellipsoid cavity along a tilted long axis (base superior-posterior-right, apex
  inferior-anterior-left) inside a thick myocardial wall, cut open at the base plane;
* right ventricle: a cavity wrapped around the right-anterior side of the LV with a thin wall (myocardium too);
* atria above the base plane and the aorta / pulmonary artery rising to the top of the volume: blood pool, no
  myocardium label (HVSMR labels only the ventricular myocardium);
* around the heart: soft tissue with texture inside the body outline, dark lungs on both sides; SSFP contrast
  (bright blood, dark-grey myocardium), partial-volume blur, a smooth bias field and Rician noise, int16 data.

Per subject (congenital heart disease varies a lot): heart size, orientation, wall thicknesses, RV size, position,
voxel spacing (0.7-1.0 mm by default, stored in the header), intensity gain and noise.  The anatomy is set
relative to the field of view, so a small ``shape`` (tests) still holds a whole heart.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Union

import nibabel as nib
import numpy as np

from fedssl.data.hvsmr import IMAGE_DIR, LABEL_DIR, VARIANTS

__all__ = ["write_synthetic_hvsmr"]

PathLike = Union[str, "os.PathLike[str]"]

# SSFP signal levels (before the subject's gain, bias and noise).
_AIR, _LUNG, _TISSUE, _MYO, _BLOOD = 0.02, 0.08, 0.45, 0.28, 0.92


def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def _rotation(rng: np.random.Generator, max_deg: float) -> np.ndarray:
    """A random rotation of at most ``max_deg`` degrees about a random axis (Rodrigues)."""
    axis = _unit(rng.standard_normal(3))
    angle = np.deg2rad(rng.uniform(-max_deg, max_deg))
    k = np.array([[0, -axis[2], axis[1]], [axis[2], 0, -axis[0]], [-axis[1], axis[0], 0]])
    return np.eye(3) + np.sin(angle) * k + (1 - np.cos(angle)) * (k @ k)


def _ellipsoid(q: np.ndarray, centre: np.ndarray, frame: np.ndarray, radii: np.ndarray) -> np.ndarray:
    """Mask of the points ``q [..., 3]`` inside the ellipsoid with the given centre, axes (rows of ``frame``) and
    radii."""
    local = (q - centre) @ frame.T
    return ((local / radii) ** 2).sum(-1) <= 1.0


def _tube(q: np.ndarray, points: np.ndarray, radius: float) -> np.ndarray:
    """Mask of the points within ``radius`` of the polyline through ``points [P, 3]``."""
    inside = np.zeros(q.shape[:-1], dtype=bool)
    for a, b in zip(points[:-1], points[1:]):
        ab = b - a
        t = np.clip(((q - a) @ ab) / float(ab @ ab), 0.0, 1.0)
        inside |= np.linalg.norm(q - (a + t[..., None] * ab), axis=-1) <= radius
    return inside


def _anatomy(rng: np.random.Generator, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Labels (0/1/2) and noise-free signal of one heart at the points ``q [X, Y, Z, 3]`` (units: half the FOV)."""
    size = 2.0 * rng.uniform(0.85, 1.1)  # the crop holds the heart: it fills most of the field of view
    long_axis = _rotation(rng, 15.0) @ _unit(np.array([0.55, -0.45, -0.70]))  # base -> apex
    side = _unit(np.array([-1.0, -1.0, 0.0]) - (np.array([-1.0, -1.0, 0.0]) @ long_axis) * long_axis)  # RV side
    frame = np.stack([long_axis, side, np.cross(long_axis, side)])
    centre = np.array([0.05, -0.05, -0.1]) + rng.uniform(-0.05, 0.05, 3)
    a_long, a_short = 0.42 * size, 0.21 * size
    wall, rv_wall = 0.075 * size * rng.uniform(0.8, 1.3), 0.03 * size * rng.uniform(0.8, 1.3)
    rv_scale = rng.uniform(0.8, 1.3)
    below_base = (q - centre) @ long_axis >= -0.55 * a_long  # ventricles end at the base plane

    lv_cavity = _ellipsoid(q, centre, frame, np.array([a_long, a_short, a_short])) & below_base
    lv_outer = _ellipsoid(q, centre, frame, np.array([a_long + wall, a_short + wall, a_short + wall])) & below_base
    rv_centre = centre + side * (a_short + wall) * 0.75 + long_axis * 0.05
    rv_radii = np.array([0.85 * a_long, 0.75 * a_short * rv_scale, 1.4 * a_short * rv_scale])
    rv_cavity = _ellipsoid(q, rv_centre, frame, rv_radii) & below_base & ~lv_outer
    rv_outer = _ellipsoid(q, rv_centre, frame, rv_radii + rv_wall) & below_base & ~lv_outer

    base = centre - long_axis * 0.55 * a_long
    up = np.array([0.0, 0.0, 1.0])
    atria = (np.linalg.norm(q - (base + np.array([0.0, 0.12, 0.08]) * size), axis=-1) <= 0.2 * size) | (
        np.linalg.norm(q - (base - side * 0.3 * size + up * 0.05), axis=-1) <= 0.22 * size)
    top = 1.5  # beyond the volume: the vessels leave through its superior face
    aorta = _tube(q, np.stack([base, base + up * 0.35 + side * 0.05, base + up * top]), 0.085 * size)
    rv_base = rv_centre - long_axis * 0.5 * a_long
    pulmonary = _tube(q, np.stack([rv_base, rv_base + up * 0.3 - side * 0.1 + np.array([0, 0.1, 0]),
                                   rv_base + up * top + np.array([0.1, 0.25, 0.0])]), 0.08 * size)
    blood = lv_cavity | rv_cavity | atria | aorta | pulmonary
    myo = (lv_outer | rv_outer) & ~blood

    label = np.where(blood, 2, np.where(myo, 1, 0)).astype(np.uint8)
    body = (q[..., 0] / 1.3) ** 2 + (q[..., 1] / 1.1) ** 2 <= 1.0
    lungs = np.zeros(body.shape, dtype=bool)
    for sx in (-1.0, 1.0):
        lungs |= ((q[..., 0] - sx * 1.0) / 0.3) ** 2 + ((q[..., 1] - 0.1) / 0.6) ** 2 <= 1.0
    texture = 0.06 * np.sin(q @ (rng.standard_normal(3) * 6.0) + rng.uniform(0, 2 * np.pi))
    signal = np.where(body, np.where(lungs, _LUNG, _TISSUE + texture), _AIR)
    signal = np.where(label == 2, _BLOOD, np.where(label == 1, _MYO, signal))
    return label, signal.astype(np.float32)


def _blur(x: np.ndarray) -> np.ndarray:
    """Partial-volume blur: the separable [1, 2, 1] / 4 kernel along each axis (edges replicated)."""
    for axis in range(3):
        pad = np.pad(x, [(1, 1) if a == axis else (0, 0) for a in range(3)], mode="edge")
        lo = np.take(pad, range(0, x.shape[axis]), axis=axis)
        mid = np.take(pad, range(1, x.shape[axis] + 1), axis=axis)
        hi = np.take(pad, range(2, x.shape[axis] + 2), axis=axis)
        x = 0.25 * lo + 0.5 * mid + 0.25 * hi
    return x


def _acquire(signal: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Bias field, Rician noise and gain -> int16 (the subject's scanner session)."""
    grid = np.stack(np.meshgrid(*[np.linspace(-0.5, 0.5, n) for n in signal.shape], indexing="ij"), -1)
    bias = 1.0 + rng.uniform(0.0, 0.3) * (grid @ _unit(rng.standard_normal(3)))
    s = _blur(signal) * bias
    sigma = rng.uniform(0.02, 0.06)
    s = np.sqrt((s + sigma * rng.standard_normal(s.shape)) ** 2 + (sigma * rng.standard_normal(s.shape)) ** 2)
    return np.clip(np.rint(s * rng.uniform(400.0, 1500.0)), 0, 32767).astype(np.int16)


def _save(arr: np.ndarray, spacing: tuple[float, float, float], path: Path) -> None:
    affine = np.diag([*spacing, 1.0])
    affine[:3, 3] = [-s * n / 2.0 for s, n in zip(spacing, arr.shape)]
    img = nib.Nifti1Image(arr, affine)
    img.header.set_data_dtype(arr.dtype)
    img.header.set_zooms(spacing)
    img.header.set_xyzt_units("mm")
    nib.save(img, str(path))


def _subject(rng: np.random.Generator, shape: tuple[int, int, int],
             spacing: tuple[float, float, float]) -> tuple[np.ndarray, np.ndarray]:
    """(int16 image, uint8 label) of one subject, both ``shape``."""
    extent = np.array(shape) * np.array(spacing)
    half = extent.min() / 2.0
    axes = [(np.arange(n) + 0.5) * s - e / 2.0 for n, s, e in zip(shape, spacing, extent)]
    q = np.stack(np.meshgrid(*axes, indexing="ij"), -1) / half
    label, signal = _anatomy(rng, q)
    return _acquire(signal, rng), label


def write_synthetic_hvsmr(
    out_dir: PathLike,
    *,
    n_subjects: int = 10,
    seed: int = 0,
    shape: tuple[int, int, int] = (128, 128, 96),
    spacing_range: tuple[float, float] = (0.7, 1.0),
    variant: str = "axial_crop",
    archive_folders: bool = False,
) -> list[str]:
    """Write ``n_subjects`` synthetic HVSMR subjects ``pat0`` ... in the challenge's layout; returns their ids.

    Args:
        out_dir: output folder (created if needed; existing subject files are overwritten).
        n_subjects: subjects (the challenge has 10 labelled ones).
        seed: drives everything; the same arguments give the same files (subject N uses ``[seed, N]``).
        shape: ``(X, Y, Z)`` voxels of every volume (Z = axial slices).
        spacing_range: in-plane and slice spacing in mm, drawn uniformly per subject (HVSMR: about 0.7-1.15).
        variant: which of the archive's versions the file names carry.
        archive_folders: images under ``Training dataset/`` and labels under ``Ground truth/`` (as the archive
            unpacks) instead of side by side.
    """
    if not isinstance(n_subjects, int) or n_subjects < 1:
        raise ValueError(f"n_subjects={n_subjects!r}: must be a positive integer (the challenge has 10)")
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r}: use one of {list(VARIANTS)}")
    if len(shape) != 3 or min(shape) < 8:
        raise ValueError(f"shape={shape!r}: must be (X, Y, Z) with every size >= 8")
    lo, hi = float(spacing_range[0]), float(spacing_range[1])
    if not 0 < lo <= hi:
        raise ValueError(f"spacing_range={spacing_range!r}: need 0 < low <= high (mm)")
    out = Path(out_dir)
    image_dir, label_dir = (out / IMAGE_DIR, out / LABEL_DIR) if archive_folders else (out, out)
    image_dir.mkdir(parents=True, exist_ok=True)
    label_dir.mkdir(parents=True, exist_ok=True)
    ids = []
    for n in range(n_subjects):
        rng = np.random.default_rng([seed, n])
        sp_xy, sp_z = rng.uniform(lo, hi), rng.uniform(lo, hi)
        spacing = (float(sp_xy), float(sp_xy), float(sp_z))
        image, label = _subject(rng, tuple(int(s) for s in shape), spacing)
        _save(image, spacing, image_dir / f"training_{variant}_pat{n}.nii.gz")
        _save(label, spacing, label_dir / f"training_{variant}_pat{n}-label.nii.gz")
        ids.append(f"pat{n}")
    return ids
