"""Synthetic ACDC stand-in written in exactly the real ACDC layout, and site folders for real ACDC.

:func:`write_synthetic_acdc` writes cardiac cine phantoms as ``patientNNN/`` folders that
:mod:`fedssl.data.acdc` reads unchanged (``Info.cfg``, ``patientNNN_4d.nii.gz``,
``patientNNN_frameXX.nii.gz`` and ``patientNNN_frameXX_gt.nii.gz`` for the ED and ES frames).
The phantom carries the structure FCL exploits and the difficulty of the real task (calibrated on random init,
README "Calibrated synthetic data and the papers' tables"):

* anatomy: LV blood pool, myocardium ring around it, RV blood pool (a crescent wrapped around the septum, with a
  thin unlabelled free wall), inside a thorax of similar intensities (chest wall fat and muscle, lungs, spine,
  descending aorta, the liver rising into the apical slices, great vessels at the base), epicardial fat patches,
  trabeculae and papillary muscles inside the cavity (counted as cavity, as ACDC's contours do), non-circular
  cavities; labels 0 bg / 1 RV / 2 MYO / 3 LV are drawn with the geometry of the image;
* along the slice axis (base at slice 0) the LV and RV shrink to an apical cap; per patient the stack may start
  above the valve plane (atrial slices, bright blood, unlabelled) and end past the apex; partial volume across
  each thick slice (three positions averaged); breath-hold misalignment between slices;
* along the cine axis the cavities contract from ED (frame 1) to ES (frame ``max(1, T//3) + 1``) and relax back,
  with the myocardium thickening (area conserved);
* per patient: heart size, position, orientation and the view's in-plane rotation, pathology group
  (NOR/MINF/DCM/HCM/RV, cycled: MINF a thinned akinetic sector, HCM septal hypertrophy, DCM / RV dilated),
  anisotropic spacing (in-plane 1.3-1.7 mm, slices 5-10 mm) in the NIfTI affine and zooms, int16 data;
* per site: intensity scale/offset, contrast gamma, coil bias field and Rician noise level differ (non-IID);
* per patient within a site, the scan conditions (ACDC mixes 1.5 T and 3 T scanners and patients who hold their
  breath well or badly): contrast gamma, noise level, blood brightness and myocardial signal;
* ``difficulty`` scales the nuisances (noise, bias field, misalignment, trabeculae, slow-flow darkening, view
  rotation, texture, the spread of the per-patient scan conditions); 0 is the clean anatomy.

:func:`link_site_folders` builds the federated ``site-k/patientNNN`` view of a real ACDC
``training/`` folder with symlinks, using :func:`fedssl.core.partition.split_patients`.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence, Union

import nibabel as nib
import numpy as np

from fedssl.core.partition import split_patients
from fedssl.data.acdc import ACDC_GROUPS, ACDCDataError, list_patients

__all__ = ["write_synthetic_acdc", "link_site_folders", "GROUPS", "DEFAULT_DIFFICULTY"]

PathLike = Union[str, "os.PathLike[str]"]

GROUPS: tuple[str, ...] = ACDC_GROUPS

#: the calibrated difficulty (README, "Calibrated synthetic data"), chosen on random init only: random-init local
#: fine-tuning (quick / bench fine-tuning, 3 sites x 10 patients, folds 0-2) against FCL Table 1's random-init row
#: (0.280 / 0.414 / 0.618 / 0.766).  Without per-patient scan conditions 1.0 gave 0.265 / 0.564 / 0.639 / 0.771 and
#: 1.5 gave 0.239 / 0.532 / 0.592 / 0.738 (N=2 0.118 too easy); with them 1.5 gives 0.223 / 0.486 / 0.565 / 0.719
#: (worst: N=2, +0.072).  After the HCM fix, with the patient spread below and the fine-tuning step floor (quick
#: profile, finetune.min_steps 240), 1.5 gives 0.322 / 0.464 / 0.558 / 0.733 over folds 0-4 (worst: N=4, -0.060)
DEFAULT_DIFFICULTY = 1.5

# Relative signal levels (cine SSFP, before the site's acquisition model) of the tissues.  Blood and fat are
# bright, myocardium, skeletal muscle and liver are close to each other (the myocardium's contrast to its
# surroundings is low), lungs and air are dark.
_AIR = 0.03
_LUNG = 0.07
_MYO = 0.24
_MUSCLE = 0.27
_LIVER = 0.31
_TISSUE = 0.36
_SPINE = 0.40
_FAT = 0.80
_LV_BLOOD = 0.86
_RV_BLOOD = 0.82

# Group -> (LV radius factor, wall thickness factor, LV contraction amplitude, RV size factor, RV contraction
# amplitude).  The RV columns give end-diastolic RV / LV cavity volume ratios of about 1.0 (NOR, HCM), 0.70 (MINF),
# 0.60 (DCM) and 1.8 (abnormal RV) and RV ejection fractions of 0.53 / 0.42 / 0.34 / 0.58 / 0.34 (NOR / MINF /
# DCM / HCM / RV; measured on the generated labels, tests/unit/data/test_acdc.py).  In healthy adults
# the RV end-diastolic volume is about that of the LV (Kawel-Boehm et al., "Normal values for cardiovascular
# magnetic resonance in adults and children", J. Cardiovasc. Magn. Reson. 2015); the ACDC groups are defined by LV
# dilation (DCM: LV EDV > 100 ml/m2), an RV EF above 40 % outside the abnormal-RV group, and an RV volume above
# 100-110 ml/m2 or an RV EF below 40 % in it (Bernard et al., "Deep Learning Techniques for Automatic MRI Cardiac
# Multi-structures Segmentation and Diagnosis: Is the Problem Solved?", IEEE TMI 2018).  Before this table the RV
# was 0.28-0.41 of the LV outside the abnormal-RV group (HCM's the smallest of all, 6 ml at ES).
_GROUP_PARAMS: dict[str, tuple[float, float, float, float, float]] = {
    "NOR": (1.00, 1.00, 0.30, 1.00, 0.30),
    "MINF": (1.15, 0.90, 0.14, 0.88, 0.23),  # plus a thinned, akinetic infarct sector
    "DCM": (1.35, 0.70, 0.09, 0.86, 0.18),
    "HCM": (0.80, 1.60, 0.38, 0.91, 0.34),  # plus asymmetric septal thickening
    "RV": (0.95, 1.00, 0.28, 1.37, 0.18),
}
#: RV disc radius at the base, relative to the LV epicardial radius (times the group's RV size factor); the disc is
#: centred on the epicardium on the LV -> RV axis, so the crescent wraps 60-70 degrees either side of that axis
_RV_RADIUS = (0.90, 1.10)
#: where the RV ends, relative to the apex (it tapers like the LV: radius ~ sqrt(1 - (u / end) ** 2.5))
_RV_END = (0.80, 0.92)


#: how much wider the per-patient scan conditions range than the other nuisances at the same ``difficulty`` (README,
#: "Calibrated synthetic data").  It is the one nuisance that lowers N=2 more than N=1 (two patients do not cover
#: the scan conditions of the validation patients), so it sets the curve's shape where ``difficulty`` moves every N
#: alike.  Chosen on random init only (folds 0-4, with the fine-tuning step floor): 1.25; 1.5 left N=4 at -0.072
#: on folds 0-2 and N=8 lower still
_PATIENT_SPREAD = 1.25

#: HCM's extra septal wall thickness, as a fraction of the wall, on the LV -> RV axis
_HCM_SEPTAL = 0.7


def _site_acquisition(seed: int, site_index: int) -> dict[str, float]:
    """Per-site acquisition parameters (the non-IID shift between sites)."""
    rng = np.random.default_rng([seed, 1, site_index])
    return {
        "scale": float(rng.uniform(350.0, 1600.0)),
        "offset": float(rng.uniform(0.0, 150.0)),
        "gamma": float(rng.uniform(0.7, 1.4)),
        "noise": float(rng.uniform(0.02, 0.06)),
        "bias": float(rng.uniform(0.15, 0.40)),
        "bias_angle": float(rng.uniform(0.0, 2.0 * np.pi)),
        "coil": float(rng.uniform(0.2, 0.6)),
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


def _ellipse(yy, xx, cy, cx, ry, rx, width: float = 1.5) -> np.ndarray:
    """Soft membership of an axis-aligned ellipse (centre, semi-axes in pixels)."""
    r = np.sqrt(((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2)
    return _soft(r * np.float32(min(ry, rx)), np.float32(min(ry, rx)), width=width)


def _wobble(rng: np.random.Generator, orders: Sequence[int], amp: float) -> list[tuple[int, float, float]]:
    """Random Fourier terms (order, amplitude, phase) of a boundary ``r(theta) = r (1 + sum a cos(j theta + p))``."""
    return [(int(j), float(rng.uniform(0.0, amp)), float(rng.uniform(0.0, 2.0 * np.pi))) for j in orders]


def _radial(theta: np.ndarray, terms: Sequence[tuple[int, float, float]]) -> np.ndarray:
    out = np.zeros_like(theta)
    for j, a, p in terms:
        out += np.float32(a) * np.cos(np.float32(j) * theta + np.float32(p))
    return out


def _smooth_field(rng: np.random.Generator, shape: tuple[int, ...], n_waves: int,
                  freq: tuple[float, float]) -> np.ndarray:
    """Zero-mean smooth random field ``[Z, H, W]`` (unit-ish amplitude): a sum of random plane waves, slowly
    varying along the slice axis."""
    z, h, w = shape
    m = float(min(h, w))
    yy = np.arange(h, dtype=np.float32)[None, :, None]
    xx = np.arange(w, dtype=np.float32)[None, None, :]
    zs = np.arange(z, dtype=np.float32)[:, None, None]
    out = np.zeros(shape, dtype=np.float32)
    for _ in range(n_waves):
        theta = rng.uniform(0.0, 2.0 * np.pi)
        f = rng.uniform(*freq) * 2.0 * np.pi / m
        out += np.float32(rng.uniform(0.5, 1.0)) * np.sin(
            np.float32(f) * (np.float32(np.cos(theta)) * xx + np.float32(np.sin(theta)) * yy)
            + np.float32(rng.uniform(0.05, 0.4)) * zs + np.float32(rng.uniform(0, 2 * np.pi)))
    return out / np.float32(np.sqrt(n_waves))


def _grid(h: int, w: int, angle: float) -> tuple[np.ndarray, np.ndarray]:
    """Pixel coordinates ``(y, x)`` ``[H, W]`` of a view rotated by ``angle`` (radians) about the image centre: the
    short-axis plane's in-plane orientation differs between patients."""
    yy = np.arange(h, dtype=np.float32)[:, None] - np.float32((h - 1) / 2.0)
    xx = np.arange(w, dtype=np.float32)[None, :] - np.float32((w - 1) / 2.0)
    c, s = np.float32(np.cos(angle)), np.float32(np.sin(angle))
    return ((c * yy - s * xx + np.float32((h - 1) / 2.0)).astype(np.float32),
            (s * yy + c * xx + np.float32((w - 1) / 2.0)).astype(np.float32))


def _thorax(rng: np.random.Generator, shape: tuple[int, int], u: np.ndarray, difficulty: float,
            grid: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """The heart's surroundings ``[Zs, H, W]`` at slice positions ``u`` (0 base .. 1 apex): body with a chest wall
    (subcutaneous fat, muscle), mediastinal tissue with texture, lungs, spine, descending aorta, and the liver
    rising into the apical slices.  Everything here is labelled background."""
    h, w = shape
    m = float(min(h, w))
    zs = u.size
    yy, xx = grid
    uu = u.astype(np.float32)[:, None, None]
    by, bx = (h - 1) / 2.0 + rng.uniform(0.14, 0.22) * h, (w - 1) / 2.0 + rng.uniform(-0.05, 0.05) * w
    ay, ax = rng.uniform(0.44, 0.50) * h, rng.uniform(0.58, 0.68) * w
    fat_t, muscle_t = rng.uniform(0.02, 0.045) * m, rng.uniform(0.025, 0.05) * m
    body = _ellipse(yy, xx, by, bx, ay, ax)
    inner_fat = _ellipse(yy, xx, by, bx, ay - fat_t, ax - fat_t)
    inner_muscle = _ellipse(yy, xx, by, bx, ay - fat_t - muscle_t, ax - fat_t - muscle_t)
    tex = _smooth_field(rng, (zs, h, w), 8, (2.0, 12.0))
    tissue = (_TISSUE + rng.uniform(-0.04, 0.04)) + (0.06 + 0.03 * difficulty) * tex
    img = _AIR + (_FAT - _AIR) * body[None]  # [Zs, H, W]
    img = img * (1 - inner_fat) + (_MUSCLE + 0.03 * tex) * inner_fat
    img = img * (1 - inner_muscle) + tissue * inner_muscle
    # lungs left and right of the mediastinum, a little smaller towards the apex
    for side in (-1.0, 1.0):
        ly, lx = (h - 1) / 2.0 - rng.uniform(-0.02, 0.08) * h, bx + side * rng.uniform(0.27, 0.33) * w
        sy, sx = rng.uniform(0.20, 0.27) * h, rng.uniform(0.10, 0.14) * w
        lung = _ellipse(yy, xx, ly, lx, sy, sx, width=3.0)[None] * (1.0 - 0.25 * uu)
        img = img * (1 - lung) + (_LUNG + 0.02 * tex) * lung
    # spine (posterior midline) and the descending aorta beside it (bright blood, unlabelled)
    sp_y, sp_x = by + ay - fat_t - muscle_t - rng.uniform(0.08, 0.11) * h, bx + rng.uniform(-0.02, 0.02) * w
    spine = _ellipse(yy, xx, sp_y, sp_x, 0.05 * m, 0.055 * m)[None]
    img = img * (1 - spine) + _SPINE * spine
    ao = _ellipse(yy, xx, sp_y - 0.075 * m, sp_x + rng.uniform(0.05, 0.09) * w, 0.035 * m, 0.035 * m)[None]
    img = img * (1 - ao) + (_LV_BLOOD - 0.05) * ao
    # liver: patient's right-inferior (image lower left), rising into the slices towards the apex
    grow = np.clip((uu - 0.35) / 0.5, 0.0, 1.0)
    liver = _ellipse(yy, xx, (h - 1) / 2.0 + 0.28 * h, bx - 0.22 * w, 0.28 * m, 0.34 * m, width=2.0)[None]
    liver = liver * _soft(np.float32(1.0) - grow, np.float32(0.5), width=0.3)  # in from u ~ 0.5, fully by u ~ 0.85
    img = img * (1 - liver) + (_LIVER + 0.02 * tex) * liver
    return img.astype(np.float32)


def _phantom(
    rng: np.random.Generator, shape: tuple[int, int], n_slices: int, n_frames: int, group: str,
    difficulty: float = DEFAULT_DIFFICULTY,
    scan: dict[str, float] | None = None,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Noise-free cine signal ``[T, Z, H, W]`` in [0, 1], labels ``[T, Z, H, W]`` and the ES index.

    The signal of a slice is the mean of the anatomy at three positions across its thickness (partial volume
    between thick slices); the labels are drawn at the slice centre, with the geometry of the image."""
    h, w = shape
    m = float(min(h, w))
    d = float(difficulty)
    f_lv, f_wall, amp, f_rv, rv_amp = _GROUP_PARAMS[group]
    f32 = np.float32
    # the whole view rotated per patient (oblique short-axis planes); ``difficulty`` widens the range
    yy, xx = _grid(h, w, rng.uniform(-1.0, 1.0) * np.radians(20.0) * d)

    # Per-patient anatomy (pixel units, relative to the field of view).
    cy0 = (h - 1) / 2.0 + rng.uniform(-0.10, 0.10) * h
    cx0 = (w - 1) / 2.0 + rng.uniform(-0.10, 0.10) * w
    drift = rng.uniform(-0.04, 0.04, size=2) * m  # centre drift base -> apex
    r_lv0 = rng.uniform(0.075, 0.115) * m * f_lv
    wall0 = r_lv0 * rng.uniform(0.30, 0.45) * f_wall
    r_rv0 = (r_lv0 + wall0) * rng.uniform(*_RV_RADIUS) * f_rv  # RV radius at the base
    rv_wall = max(1.0, 0.012 * m)
    phi = np.pi + rng.uniform(-np.pi / 3.0, np.pi / 3.0)  # direction LV -> RV (heart orientation)
    endo_terms = _wobble(rng, (2, 3), 0.08)  # non-circular cavity
    trab_terms = _wobble(rng, (7, 9, 11, 13), 1.0)  # trabeculae: dark intrusions labelled as cavity
    scan = scan or {}
    blood_lv = (_LV_BLOOD + rng.uniform(-0.06, 0.06)) * scan.get("blood", 1.0)
    blood_rv = (_RV_BLOOD + rng.uniform(-0.06, 0.06)) * scan.get("blood", 1.0)
    myo_val = _MYO + rng.uniform(-0.04, 0.04) + scan.get("myo", 0.0)
    fat_val = _FAT + rng.uniform(-0.08, 0.05)
    fat_amount = rng.uniform(0.0, 1.0)
    fat_angles = phi + np.pi + rng.uniform(-2.0, 2.0, size=2)  # patches on the free (lateral) wall side
    inf_angle = phi + rng.uniform(0.5, 2.5) * rng.choice([-1.0, 1.0])  # infarct sector (MINF)
    # the stack's coverage differs per patient: the apex may lie before the last slice (then only the apical
    # myocardial cap, then no heart), and the first slices may lie above the valve plane (atria: bright blood
    # pools with thin walls, labelled background, as in ACDC's basal slices)
    apex_u = rng.uniform(0.85, 1.1)
    valve_u = rng.uniform(-0.12, 0.22)
    rv_end = rng.uniform(*_RV_END) * apex_u

    k, es = _contraction(n_frames)
    kk = k[:, None, None, None]  # [T, 1, 1, 1]
    # slice centres u_z and three positions across each slice's thickness: [Z * 3] (z-major)
    step = 1.0 / max(n_slices - 1, 1)
    u_c = np.arange(n_slices, dtype=np.float32) * f32(step)
    u_all = (u_c[:, None] + f32(step) * np.array([-0.35, 0.0, 0.35], dtype=np.float32)[None, :]).reshape(-1)
    u = np.clip(u_all, 0.0, 1.0)[None, :, None, None]  # [1, Zs, 1, 1]
    v = np.clip(u_all / f32(apex_u), 0.0, None)[None, :, None, None]  # 1 at the apex
    atrial = (u_all < valve_u)[None, :, None, None]
    # breath-hold misalignment: every slice's heart shifted by its own in-plane offset
    shift = np.repeat(rng.normal(0.0, 0.012 * m * d, size=(n_slices, 2)), 3, axis=0).astype(np.float32)
    cy = (cy0 + drift[0] * u[..., 0, 0] + shift[None, :, 0])[..., None, None].astype(f32)
    cx = (cx0 + drift[1] * u[..., 0, 0] + shift[None, :, 1])[..., None, None].astype(f32)

    dy, dx = yy - cy, xx - cx  # [1, Zs, H, W]
    dist_lv = np.sqrt(dy * dy + dx * dx)
    theta = np.arctan2(dy, dx)
    shape_f = f32(1.0) + _radial(theta, endo_terms)

    r_lv_ed = r_lv0 * np.sqrt(np.clip(1.0 - v**2.5, 0.0, None))
    wall_ang = np.ones_like(theta)
    sector = np.cos(theta - f32(inf_angle))
    if group == "HCM":  # asymmetric septal hypertrophy: the wall facing the RV is thicker
        wall_ang = wall_ang + f32(_HCM_SEPTAL) * np.clip(np.cos(theta - f32(phi)), 0.0, None) ** 2
    if group == "MINF":  # thinned infarct sector
        wall_ang = wall_ang - f32(0.45) * np.clip((sector - 0.5) / 0.5, 0.0, 1.0)
    wall = (wall0 * (1.0 + 0.2 * u) * np.clip((1.2 - v) / 0.2, 0.0, 1.0)) * wall_ang  # the cap ends by v = 1.2
    myo_area = (r_lv_ed + wall) ** 2 - r_lv_ed**2
    amp_ang = f32(amp) * (f32(1.0) - (f32(0.85) * np.clip((sector - 0.5) / 0.5, 0.0, 1.0) if group == "MINF" else 0.0))
    r_lv = ((r_lv_ed * (1.0 - amp_ang * kk)) * shape_f).astype(f32)  # [T, Zs, H, W]
    r_epi = np.sqrt(r_lv.astype(np.float32) ** 2 + myo_area).astype(f32)  # wall thickens in systole
    # above the valve plane: the atria, round blood pools with a thin wall
    r_lv = np.where(atrial, (f32(0.9 * r_lv0) * shape_f).astype(f32), r_lv)
    r_epi = np.where(atrial, r_lv + f32(1.2), r_epi)
    r_rv = (r_rv0 * np.sqrt(np.clip(1.0 - (u / f32(rv_end)) ** 2.5, 0.0, None)) * (1.0 - rv_amp * kk)).astype(f32)
    # RV disc centred on the epicardium on the LV->RV axis: minus the epicardial disc it leaves a crescent about
    # r_rv thick wrapped around the septum; it shrinks to a small blob towards the apex.  The epicardial radius on
    # that axis uses the septum's own thickness (HCM's is thicker: the RV sits outside it, as in real HCM, instead
    # of being covered by the myocardium)
    wall_axis = wall0 * (1.0 + 0.2 * u) * (1.0 + (_HCM_SEPTAL if group == "HCM" else 0.0))
    r_epi_axis = np.sqrt((r_lv_ed * (1.0 - amp * kk)) ** 2 + (r_lv_ed + wall_axis) ** 2 - r_lv_ed**2)
    d_rv = r_epi_axis.astype(f32)
    dist_rv = np.sqrt((yy - (cy + d_rv * f32(np.sin(phi)))) ** 2 + (xx - (cx + d_rv * f32(np.cos(phi)))) ** 2)
    has_rv = r_rv > 0.5

    # surroundings (static over the cycle), then the heart painted over them
    img = np.broadcast_to(_thorax(rng, (h, w), u_all.clip(0.0, 1.0), d, (yy, xx))[None],
                          dist_rv.shape).astype(np.float32)
    # great vessels at the base (aortic root and pulmonary trunk, bright, unlabelled), anterior to the LV
    base = _soft(u, f32(0.12), width=0.12)
    for ang, rad in ((phi + 0.9, 0.055), (phi + 0.2, 0.05)):
        vy, vx = cy + f32((r_lv0 + wall0) * 1.3 * np.sin(ang)), cx + f32((r_lv0 + wall0) * 1.3 * np.cos(ang))
        vessel = _soft(np.sqrt((yy - vy) ** 2 + (xx - vx) ** 2), f32(rad * m)) * base
        img = img * (1 - vessel) + f32(_LV_BLOOD - 0.04) * vessel
    # epicardial fat: bright patches on the epicardium (two sectors of ~50 degrees; their amount varies per patient)
    groove = np.zeros_like(theta)
    for ang in fat_angles:
        groove = np.maximum(groove, np.clip((np.cos(theta - f32(ang)) - 0.9) / 0.1, 0.0, 1.0))
    fat_r = r_epi - f32(1.5) + f32(fat_amount * 0.04 * m + 1.5) * groove  # none (hidden by the wall) off the grooves
    a_fat = _soft(dist_lv, fat_r) * (f32(1.0) - _soft(dist_rv, r_rv + rv_wall + 1.0) * has_rv)
    img = img * (1 - a_fat) + fat_val * a_fat
    a_rv_outer = _soft(dist_rv, r_rv + rv_wall) * has_rv
    a_rv = _soft(dist_rv, r_rv) * has_rv
    a_epi = _soft(dist_lv, r_epi)
    # the image's cavity boundary has trabeculae (dark fingers) and two papillary muscles inside it;
    # the labels (like ACDC's) draw the smooth endocardial contour and count both as cavity
    trab = f32(0.10 * min(d, 2.0)) * np.clip(_radial(theta, trab_terms) / 1.5, 0.0, None)
    a_lv = _soft(dist_lv, r_lv * (f32(1.0) - trab))
    mid = _soft(np.abs(u - f32(0.45)), f32(0.25), width=0.1) * ~atrial  # mid-ventricular slices only
    for ang in (phi + np.pi - 0.7, phi + np.pi + 0.7):
        pr = r_lv_ed * (1.0 - amp * kk) * 0.55
        py, px = cy - pr * f32(np.sin(-ang)), cx + pr * f32(np.cos(ang))
        pap = _soft(np.sqrt((yy - py) ** 2 + (xx - px) ** 2), r_lv_ed * f32(0.16) * (1.0 + 0.5 * kk)) * mid
        a_lv = a_lv * (f32(1.0) - pap)
    # blood: slow flow darkens the apex; smooth inflow/outflow heterogeneity
    flow = f32(1.0) - f32(0.25 * min(d, 2.0)) * np.clip((u - 0.75) / 0.25, 0.0, 1.0)
    img = img * (1 - a_rv_outer) + myo_val * a_rv_outer
    img = img * (1 - a_rv) + (blood_rv * flow) * a_rv
    img = img * (1 - a_epi) + myo_val * a_epi
    img = img * (1 - a_lv) + (blood_lv * flow) * a_lv

    # partial volume: average the three positions across each slice
    t = img.shape[0]
    signal = img.reshape(t, n_slices, 3, h, w).mean(axis=2)
    centre = slice(1, None, 3)
    label = np.zeros((t, n_slices, h, w), dtype=np.uint8)
    rv_c, lv_c = dist_rv[:, centre], np.broadcast_to(dist_lv, dist_rv.shape)[:, centre]
    label[(rv_c < r_rv[:, centre]) & has_rv[:, centre]] = 1
    label[lv_c < r_epi[:, centre]] = 2
    label[lv_c < r_lv[:, centre]] = 3
    label[:, atrial[0, centre, 0, 0]] = 0  # atrial slices: no ventricle
    return np.clip(signal, 0.0, 1.0).astype(np.float32), label, es


def _acquire(signal: np.ndarray, acq: dict[str, float], rng: np.random.Generator,
             difficulty: float = DEFAULT_DIFFICULTY) -> np.ndarray:
    """Site acquisition model: gamma contrast, coil bias field (a smooth random gain plus the fall-off away from
    the anterior surface coil), Rician noise, scale/offset -> int16.  ``difficulty`` scales the bias field and the
    noise."""
    t, z, h, w = signal.shape
    d = float(difficulty)
    s = np.power(signal, acq["gamma"], dtype=np.float32)
    yy = (np.arange(h, dtype=np.float32)[:, None] / max(h - 1, 1)) - 0.5
    xx = (np.arange(w, dtype=np.float32)[None, :] / max(w - 1, 1)) - 0.5
    gain = acq["bias"] * d * (np.cos(acq["bias_angle"]) * xx + np.sin(acq["bias_angle"]) * yy) * 2.0
    gain = gain + 0.5 * acq["bias"] * d * _smooth_field(rng, (z, h, w), 3, (0.5, 1.5))
    coil = 1.0 + acq["coil"] * d * np.exp(-(yy + 0.5) / 0.35)  # anterior coil: brighter near the chest wall
    s = s * (np.exp(gain) * coil / (1.0 + acq["coil"] * d * 0.5)).astype(np.float32)
    sigma = np.float32(acq["noise"] * d)
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
    difficulty: float = DEFAULT_DIFFICULTY,
    only_sites: Sequence[str] | None = None,
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
        difficulty: strength of the nuisances (0 = clean anatomy, no noise / bias field / misalignment / trabeculae;
            :data:`DEFAULT_DIFFICULTY` = calibrated to FCL Table 1's random-init row, README "Calibrated synthetic
            data"); it scales the Rician noise, the coil bias field, the breath-hold misalignment, the
            trabeculae, the slow-flow darkening and the texture of the surrounding tissue.
        only_sites: write only these sites' patients (None = all); the files are the same as in a full write, so
            processes can write the sites of one data set in parallel.

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
    if isinstance(difficulty, bool) or not isinstance(difficulty, (int, float)) or not 0.0 <= float(difficulty) <= 3.0:
        raise ValueError(f"difficulty={difficulty!r}: must be a number between 0 (clean) and 3 "
                         f"(default {DEFAULT_DIFFICULTY}, the calibrated setting)")
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
        if only_sites is not None and site not in only_sites:
            continue
        jobs.extend((i, first_id + i, acq, site_dir) for i in block.tolist())

    def write_one(job: tuple[int, int, dict[str, float], Path]) -> None:
        i, num, acq, site_dir = job
        _write_patient(site_dir, num, GROUPS[i % len(GROUPS)], acq, seed=seed, shape=(h, w),
                       n_frames=n_frames, slices_range=(lo, hi), difficulty=float(difficulty))

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


def _patient_scan(seed: int, num: int, difficulty: float) -> dict[str, float]:
    """Per-patient scan conditions within a site (ACDC mixes 1.5 T and 3 T scanners and patients who hold their
    breath well or badly): contrast curve, noise level, blood brightness and myocardial signal.  Drawn from their
    own stream, so the anatomy of a patient does not depend on them; ``difficulty`` widens every range (at 0 all
    are neutral)."""
    d = float(difficulty) * _PATIENT_SPREAD
    rng = np.random.default_rng([seed, 3, num])
    return {
        "gamma": float(np.exp(rng.uniform(-0.25, 0.25) * d)),
        "noise": float(np.exp(rng.uniform(-0.4, 0.4) * d)),
        "blood": float(1.0 - rng.uniform(0.0, 0.12) * d),
        "myo": float(rng.uniform(-0.04, 0.04) * d),
    }


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
    difficulty: float,
) -> None:
    """Write one synthetic patient folder ``site_dir/patient{num:03d}`` (see write_synthetic_acdc)."""
    h, w = shape
    pid = f"patient{num:03d}"
    rng = np.random.default_rng([seed, 2, num])
    n_slices = int(rng.integers(slices_range[0], slices_range[1] + 1))
    sp_xy = float(rng.uniform(1.3, 1.7))
    sp_z = float(rng.uniform(5.0, 10.0))
    scan = _patient_scan(seed, num, difficulty)
    signal, labels, es = _phantom(rng, (h, w), n_slices, n_frames, group, difficulty, scan)
    acq = dict(acq, gamma=acq["gamma"] * scan["gamma"], noise=acq["noise"] * scan["noise"])
    data = _acquire(signal, acq, rng, difficulty)  # [T, Z, H, W] int16

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
