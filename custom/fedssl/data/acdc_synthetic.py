"""Synthetic ACDC stand-in written in exactly the real ACDC layout, and site folders for real ACDC.

:func:`write_synthetic_acdc` writes cardiac cine phantoms as ``patientNNN/`` folders that
:mod:`fedssl.data.acdc` reads unchanged (``Info.cfg``, ``patientNNN_4d.nii.gz``,
``patientNNN_frameXX.nii.gz`` and ``patientNNN_frameXX_gt.nii.gz`` for the ED and ES frames).
The phantom carries the structure FCL exploits:

* anatomy: LV blood pool (bright disc), myocardium ring (dark grey) around it, RV blood pool
  (bright crescent wrapped around the septum, with a thin unlabelled free wall), inside a
  textured body ellipse; labels 0 bg / 1 RV / 2 MYO / 3 LV are painted with the same geometry
  as the image, so they are consistent with it;
* along the slice axis (base at slice 0, apex at the last slice) the LV and RV shrink smoothly,
  the RV vanishes near the apex, the heart drifts slightly: slice partitions mean something;
* along the cine axis the cavities contract from ED (frame 1) to ES (frame ``max(1, T//3) + 1``)
  and relax back, with the myocardium thickening (area conserved);
* per patient: random heart size, position, orientation, pathology group (NOR/MINF/DCM/HCM/RV,
  cycled, changing cavity size / wall thickness / contraction), anisotropic spacing (in-plane
  uniform 1.3-1.7 mm, slices 5-10 mm) stored in the NIfTI affine and zooms, int16 data;
* per site: intensity scale/offset, contrast gamma, smooth bias field and Rician noise level
  differ, so the sites are non-IID.

:func:`link_site_folders` builds the federated ``site-k/patientNNN`` view of a real ACDC
``training/`` folder with symlinks, using :func:`fedssl.core.partition.split_patients`.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Union

import nibabel as nib
import numpy as np

from fedssl.core.partition import split_patients
from fedssl.data.acdc import ACDCDataError, list_patients

__all__ = ["write_synthetic_acdc", "link_site_folders", "GROUPS"]

PathLike = Union[str, "os.PathLike[str]"]

GROUPS: tuple[str, ...] = ("NOR", "MINF", "DCM", "HCM", "RV")

# Relative signal levels (before the site's acquisition model) of the tissue classes.
_AIR = 0.03
_MYO = 0.17
_LV_BLOOD = 0.88
_RV_BLOOD = 0.82

# Group -> (LV radius factor, wall thickness factor, contraction amplitude, RV size factor)
_GROUP_PARAMS: dict[str, tuple[float, float, float, float]] = {
    "NOR": (1.00, 1.00, 0.30, 1.00),
    "MINF": (1.10, 0.85, 0.16, 1.00),
    "DCM": (1.25, 0.75, 0.12, 1.05),
    "HCM": (0.85, 1.55, 0.36, 0.95),
    "RV": (0.95, 1.00, 0.28, 1.40),
}


def _site_acquisition(seed: int, site_index: int) -> dict[str, float]:
    """Per-site acquisition parameters (the non-IID shift between sites)."""
    rng = np.random.default_rng([seed, 1, site_index])
    return {
        "scale": float(rng.uniform(350.0, 1600.0)),
        "offset": float(rng.uniform(0.0, 150.0)),
        "gamma": float(rng.uniform(0.65, 1.5)),
        "noise": float(rng.uniform(0.015, 0.08)),
        "bias": float(rng.uniform(0.0, 0.35)),
        "bias_angle": float(rng.uniform(0.0, 2.0 * np.pi)),
    }


def _contraction(n_frames: int) -> tuple[np.ndarray, int]:
    """Contraction curve k(t) in [0, 1] (0 at ED = frame 1, 1 at ES) and the 0-based ES index."""
    if n_frames < 2:
        return np.zeros(max(n_frames, 1), dtype=np.float32), 0
    es = max(1, n_frames // 3)
    t = np.arange(n_frames, dtype=np.float64)
    k = np.where(
        t <= es,
        0.5 - 0.5 * np.cos(np.pi * t / es),
        0.5 + 0.5 * np.cos(np.pi * (t - es) / (n_frames - es)),
    )
    return k.astype(np.float32), es


def _soft(dist: np.ndarray, radius: np.ndarray, width: float = 1.0) -> np.ndarray:
    """Partial-volume disc membership (float32): 1 inside ``radius``, 0 outside, a linear ramp
    ``width`` pixels wide centred on the boundary (0.5 exactly on it)."""
    r = np.asarray(radius, dtype=np.float32)
    out = (r - dist) * np.float32(1.0 / width)
    out += np.float32(0.5)
    return np.clip(out, 0.0, 1.0, out=out)


def _phantom(
    rng: np.random.Generator, shape: tuple[int, int], n_slices: int, n_frames: int, group: str
) -> tuple[np.ndarray, np.ndarray, int]:
    """Noise-free cine signal ``[T, Z, H, W]`` in [0, 1], labels ``[T, Z, H, W]`` and the ES index."""
    h, w = shape
    m = float(min(h, w))
    f_lv, f_wall, amp, f_rv = _GROUP_PARAMS[group]
    yy = np.arange(h, dtype=np.float32)[:, None]
    xx = np.arange(w, dtype=np.float32)[None, :]

    # Per-patient anatomy (pixel units, relative to the field of view).
    cy0 = (h - 1) / 2.0 + rng.uniform(-0.08, 0.08) * h
    cx0 = (w - 1) / 2.0 + rng.uniform(-0.08, 0.08) * w
    drift = rng.uniform(-0.03, 0.03, size=2) * m  # centre drift base -> apex
    r_lv0 = rng.uniform(0.085, 0.115) * m * f_lv
    wall0 = r_lv0 * rng.uniform(0.32, 0.45) * f_wall
    r_rv0 = (r_lv0 + wall0) * rng.uniform(0.85, 1.05) * f_rv  # RV radius ~ epicardial radius
    rv_wall = max(1.0, 0.012 * m)
    phi = np.pi + rng.uniform(-np.pi / 3.0, np.pi / 3.0)  # direction LV -> RV

    k, es = _contraction(n_frames)
    k = k[:, None, None, None]  # [T, 1, 1, 1]
    u = (np.arange(n_slices, dtype=np.float32) / max(n_slices - 1, 1))[None, :, None, None]  # [1, Z, 1, 1]

    f32 = np.float32
    cy = (cy0 + drift[0] * u).astype(f32)
    cx = (cx0 + drift[1] * u).astype(f32)
    r_lv_ed = r_lv0 * (1.0 - 0.72 * u**1.5)
    wall = wall0 * (1.0 + 0.2 * u)
    myo_area = (r_lv_ed + wall) ** 2 - r_lv_ed**2
    r_lv = (r_lv_ed * (1.0 - amp * k)).astype(f32)
    r_epi = np.sqrt(r_lv.astype(np.float64) ** 2 + myo_area).astype(f32)  # wall thickens in systole
    r_rv = (r_rv0 * np.clip(1.0 - (u / 0.8) ** 2, 0.0, None) * (1.0 - 0.6 * amp * k)).astype(f32)
    # RV disc centre at r_epi - 0.4 r_rv from the LV centre: minus the epicardial disc it leaves a
    # crescent ~0.6 r_rv thick wrapped around the septum; it shrinks to a small blob at the apex.
    d_rv = r_epi - f32(0.4) * r_rv
    cy_rv = (cy + d_rv * np.sin(phi)).astype(f32)
    cx_rv = (cx + d_rv * np.cos(phi)).astype(f32)

    dist_lv = np.sqrt((yy - cy) ** 2 + (xx - cx) ** 2)  # [1, Z, H, W]
    dist_rv = np.sqrt((yy - cy_rv) ** 2 + (xx - cx_rv) ** 2)  # [T, Z, H, W]
    has_rv = r_rv > 0.5

    # Body with smooth tissue texture (fixed over time, smooth along the slice axis).
    by, bx = (h - 1) / 2.0, (w - 1) / 2.0
    ay, ax = rng.uniform(0.40, 0.48) * h, rng.uniform(0.42, 0.49) * w
    body = _soft(np.sqrt(((yy - by) / ay) ** 2 + ((xx - bx) / ax) ** 2) * m, np.float32(m), width=1.0)
    tex = np.zeros((n_slices, h, w), dtype=np.float32)
    zs = np.arange(n_slices, dtype=np.float32)[:, None, None]
    n_waves = 8
    for _ in range(n_waves):
        theta = rng.uniform(0.0, 2.0 * np.pi)
        freq = rng.uniform(2.0, 12.0) * 2.0 * np.pi / m
        fz = rng.uniform(0.05, 0.4)
        tex += rng.uniform(0.5, 1.0) * np.sin(
            freq * (np.cos(theta) * xx + np.sin(theta) * yy) + fz * zs + rng.uniform(0, 2 * np.pi)
        ).astype(np.float32)
    tex = tex / np.sqrt(n_waves) + 0.3 * rng.standard_normal((n_slices, h, w), dtype=np.float32)
    bg_level = rng.uniform(0.40, 0.50)
    background = _AIR + (bg_level + 0.07 * tex - _AIR) * body  # [Z, H, W]
    # Dark lungs left and right of the mediastinum.
    for side in (-1.0, 1.0):
        ly, lx = by - rng.uniform(0.0, 0.08) * h, bx + side * rng.uniform(0.27, 0.32) * w
        sy, sx = rng.uniform(0.18, 0.24) * h, rng.uniform(0.09, 0.12) * w
        lung = _soft(np.sqrt(((yy - ly) / sy) ** 2 + ((xx - lx) / sx) ** 2) * m, np.float32(m), width=3.0)
        background = background * (1 - lung) + (0.08 + 0.02 * tex) * lung

    # Painter's algorithm (soft for the image, hard with the same geometry for the labels).
    a_rv_outer = _soft(dist_rv, r_rv + rv_wall) * has_rv
    a_rv = _soft(dist_rv, r_rv) * has_rv
    a_epi = _soft(dist_lv, r_epi)
    a_lv = _soft(dist_lv, r_lv)
    lv_val = _LV_BLOOD + rng.uniform(-0.05, 0.05)
    rv_val = _RV_BLOOD + rng.uniform(-0.05, 0.05)
    myo_val = _MYO + rng.uniform(-0.04, 0.04)
    img = np.broadcast_to(background[None], dist_rv.shape).astype(np.float32)
    img = img * (1 - a_rv_outer) + myo_val * a_rv_outer
    img = img * (1 - a_rv) + rv_val * a_rv
    img = img * (1 - a_epi) + myo_val * a_epi
    img = img * (1 - a_lv) + lv_val * a_lv

    label = np.zeros(dist_rv.shape, dtype=np.uint8)
    label[(dist_rv < r_rv) & has_rv] = 1
    label[np.broadcast_to(dist_lv, dist_rv.shape) < r_epi] = 2
    label[np.broadcast_to(dist_lv, dist_rv.shape) < r_lv] = 3
    return np.clip(img, 0.0, 1.0).astype(np.float32), label, es


def _acquire(signal: np.ndarray, acq: dict[str, float], rng: np.random.Generator) -> np.ndarray:
    """Site acquisition model: gamma contrast, bias field, Rician noise, scale/offset -> int16."""
    t, z, h, w = signal.shape
    s = np.power(signal, acq["gamma"], dtype=np.float32)
    yy = (np.arange(h, dtype=np.float32)[:, None] / max(h - 1, 1)) - 0.5
    xx = (np.arange(w, dtype=np.float32)[None, :] / max(w - 1, 1)) - 0.5
    bias = 1.0 + acq["bias"] * (np.cos(acq["bias_angle"]) * xx + np.sin(acq["bias_angle"]) * yy) * 2.0
    s = s * bias.astype(np.float32)
    sigma = np.float32(acq["noise"])
    n1 = rng.standard_normal(signal.shape, dtype=np.float32)
    n2 = rng.standard_normal(signal.shape, dtype=np.float32)
    s = np.sqrt((s + sigma * n1) ** 2 + (sigma * n2) ** 2)  # Rician magnitude noise
    scale = acq["scale"] * rng.uniform(0.9, 1.1)
    out = np.clip(np.rint(s * scale + acq["offset"]), 0, 32767)
    return out.astype(np.int16)


def _save(arr: np.ndarray, zooms: tuple[float, ...], origin: np.ndarray, path: Path) -> None:
    affine = np.diag([zooms[0], zooms[1], zooms[2], 1.0])
    affine[:3, 3] = origin
    img = nib.Nifti1Image(arr, affine)
    img.header.set_data_dtype(arr.dtype)
    img.header.set_zooms(zooms)
    img.header.set_xyzt_units("mm", "msec")
    nib.save(img, str(path))


def write_synthetic_acdc(
    out_dir: PathLike,
    *,
    n_patients: int = 100,
    n_sites: int = 10,
    per_site_folders: bool = True,
    first_id: int = 1,
    seed: int = 0,
    shape: tuple[int, int] = (128, 128),
    n_frames: int = 10,
    slices_range: tuple[int, int] = (8, 10),
) -> dict[str, list[str]]:
    """Write synthetic cardiac cine phantoms in the real ACDC layout.

    Patients ``patient{first_id:03d}`` ... are split in contiguous blocks over ``site-1`` ...
    ``site-{n_sites}`` (``np.array_split`` sizes). With ``per_site_folders`` they are written to
    ``out_dir/site-k/patientNNN``, otherwise directly to ``out_dir/patientNNN`` (the site
    assignment still sets the acquisition model and is still returned).

    Each patient folder holds ``Info.cfg`` (ED, ES, Group, Height, NbFrame, Weight),
    ``patientNNN_4d.nii.gz`` (int16, ``(H, W, Z, T)``), and for the ED and ES frames
    ``patientNNN_frameXX.nii.gz`` (int16, ``(H, W, Z)``, identical to that cine frame) and
    ``patientNNN_frameXX_gt.nii.gz`` (uint8 labels 0 bg, 1 RV, 2 MYO, 3 LV).

    Args:
        out_dir: output folder (created if needed; existing patient files are overwritten).
        n_patients: number of patients; ids must stay within 3 digits.
        n_sites: number of sites (1 <= n_sites <= n_patients).
        per_site_folders: write ``site-k/`` subfolders.
        first_id: number of the first patient.
        seed: drives everything; the same arguments give the same files.
        shape: in-plane ``(H, W)`` in voxels.
        n_frames: cine frames T (``NbFrame``).
        slices_range: inclusive range of the number of slices Z per patient.

    Returns:
        ``{"site-1": [patient ids], ...}``.
    """
    if n_patients <= 0:
        raise ValueError(f"n_patients={n_patients}: must be positive")
    if not 1 <= n_sites <= n_patients:
        raise ValueError(f"n_sites={n_sites}: must be between 1 and n_patients={n_patients}")
    if first_id < 0 or first_id + n_patients - 1 > 999:
        raise ValueError(f"patient ids {first_id}..{first_id + n_patients - 1} do not fit 3 digits (000-999)")
    if len(shape) != 2 or min(shape) < 8:
        raise ValueError(f"shape={shape}: must be (H, W) with H, W >= 8")
    if n_frames < 1:
        raise ValueError(f"n_frames={n_frames}: must be >= 1")
    lo, hi = int(slices_range[0]), int(slices_range[1])
    if lo < 1 or hi < lo:
        raise ValueError(f"slices_range={slices_range}: need 1 <= low <= high")
    h, w = int(shape[0]), int(shape[1])

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    blocks = np.array_split(np.arange(n_patients), n_sites)
    jobs: list[tuple[int, int, dict[str, float], Path]] = []
    result: dict[str, list[str]] = {}
    for k, block in enumerate(blocks, start=1):
        site = f"site-{k}"
        acq = _site_acquisition(seed, k)
        site_dir = out / site if per_site_folders else out
        result[site] = [f"patient{first_id + i:03d}" for i in block.tolist()]
        jobs.extend((i, first_id + i, acq, site_dir) for i in block.tolist())

    def write_one(job: tuple[int, int, dict[str, float], Path]) -> None:
        i, num, acq, site_dir = job
        _write_patient(site_dir, num, GROUPS[i % len(GROUPS)], acq, seed=seed, shape=(h, w),
                       n_frames=n_frames, slices_range=(lo, hi))

    # gzip and most numpy work release the GIL: a few threads roughly divide the wall time.
    # Each patient has its own generator, so the output does not depend on the thread schedule.
    n_workers = max(1, min(4, os.cpu_count() or 1, len(jobs)))
    if n_workers == 1:
        for job in jobs:
            write_one(job)
    else:
        with ThreadPoolExecutor(max_workers=n_workers) as pool:
            list(pool.map(write_one, jobs))
    return result


def _write_patient(
    site_dir: Path,
    num: int,
    group: str,
    acq: dict[str, float],
    *,
    seed: int,
    shape: tuple[int, int],
    n_frames: int,
    slices_range: tuple[int, int],
) -> None:
    """Write one synthetic patient folder ``site_dir/patient{num:03d}`` (see write_synthetic_acdc)."""
    h, w = shape
    pid = f"patient{num:03d}"
    rng = np.random.default_rng([seed, 2, num])
    n_slices = int(rng.integers(slices_range[0], slices_range[1] + 1))
    sp_xy = float(rng.uniform(1.3, 1.7))
    sp_z = float(rng.uniform(5.0, 10.0))
    signal, labels, es = _phantom(rng, (h, w), n_slices, n_frames, group)
    data = _acquire(signal, acq, rng)  # [T, Z, H, W] int16

    pdir = site_dir / pid
    pdir.mkdir(parents=True, exist_ok=True)
    origin = np.array([-sp_xy * h / 2.0, -sp_xy * w / 2.0, -sp_z * n_slices / 2.0])
    zooms3 = (sp_xy, sp_xy, sp_z)
    cine = np.ascontiguousarray(data.transpose(2, 3, 1, 0))  # (H, W, Z, T)
    _save(cine, zooms3 + (float(rng.uniform(25.0, 45.0)),), origin, pdir / f"{pid}_4d.nii.gz")
    for t in sorted({0, es}):
        frame = t + 1
        _save(np.ascontiguousarray(cine[..., t]), zooms3, origin, pdir / f"{pid}_frame{frame:02d}.nii.gz")
        lab = np.ascontiguousarray(labels[t].transpose(1, 2, 0))  # (H, W, Z)
        _save(lab, zooms3, origin, pdir / f"{pid}_frame{frame:02d}_gt.nii.gz")
    height = round(float(rng.uniform(150.0, 195.0)), 1)
    weight = round(float(rng.uniform(50.0, 110.0)), 1)
    (pdir / "Info.cfg").write_text(
        f"ED: 1\nES: {es + 1}\nGroup: {group}\nHeight: {height}\nNbFrame: {n_frames}\nWeight: {weight}\n",
        encoding="utf-8",
    )


def link_site_folders(
    src_root: PathLike, out_root: PathLike, *, n_sites: int, per_site: int, seed: int = 0
) -> dict[str, list[str]]:
    """Federated view of a real ACDC ``training/`` folder: ``out_root/site-k/patientNNN`` symlinks.

    Patients are split with :func:`fedssl.core.partition.split_patients` (seeded, order-free).
    Re-running with the same arguments is a no-op; a ``site-k`` folder that already exists with
    any other content raises :class:`ACDCDataError`.

    Returns:
        ``{"site-1": [patient ids], ...}``.
    """
    src = Path(src_root).resolve()
    ids = list_patients(src)
    groups = split_patients(ids, n_sites, per_site, seed=seed)
    out = Path(out_root)
    plan = {f"site-{k}": g for k, g in enumerate(groups, start=1)}

    # Validate everything first, so a conflict leaves nothing half-written.
    for site, g in plan.items():
        sdir = out / site
        if not (sdir.exists() or sdir.is_symlink()):
            continue
        if not sdir.is_dir() or sdir.is_symlink():
            raise ACDCDataError(f"[site {site}] exists and is not a plain folder: {sdir}. "
                                "Fix: remove it or choose another out_root")
        entries = set(os.listdir(sdir))
        ok = entries == set(g) and all(
            (sdir / p).is_symlink() and Path(os.readlink(sdir / p)) == src / p for p in g
        )
        if not ok:
            raise ACDCDataError(
                f"[site {site}] folder already exists with other content: {sdir}. "
                "Fix: remove it, or re-run with the seed/n_sites/per_site that created it, or use another out_root"
            )
    for site, g in plan.items():
        sdir = out / site
        sdir.mkdir(parents=True, exist_ok=True)
        for p in g:
            link = sdir / p
            if not link.is_symlink():
                os.symlink(src / p, link, target_is_directory=True)
    return plan
