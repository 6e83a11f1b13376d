"""Tests for the ACDC loader (fedssl.data.acdc) and its synthetic stand-in (fedssl.data.acdc_synthetic)."""

from __future__ import annotations

import os
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch

from fedssl.core.partition import split_patients
from fedssl.data import volume
from fedssl.data.acdc import (
    ACDCDataError,
    PartitionSampleDataset,
    SliceDataset,
    cavity_volumes,
    list_patients,
    load_nifti,
    load_patient,
    load_site,
    preprocess_volume,
    read_info_cfg,
    summarise_cavity_volumes,
)
from fedssl.data.acdc_synthetic import (
    DEFAULT_DIFFICULTY,
    _patient_scan,
    _phantom,
    link_site_folders,
    write_synthetic_acdc,
)
from fedssl.data.volume import Volume

SHAPE = (40, 40)
N_FRAMES = 4


@pytest.fixture(scope="module")
def synth(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[str]]]:
    root = tmp_path_factory.mktemp("acdc_synth")
    sites = write_synthetic_acdc(
        root, n_patients=4, n_sites=2, seed=3, shape=SHAPE, n_frames=N_FRAMES, slices_range=(5, 6)
    )
    return root, sites


def _save_nifti(path: Path, data: np.ndarray, zooms: tuple[float, ...]) -> None:
    affine = np.diag(list(zooms[:3]) + [1.0])
    img = nib.Nifti1Image(data, affine)
    img.header.set_zooms(zooms)
    nib.save(img, str(path))


def _hand_patient(root: Path, pid: str = "patient007", zooms: tuple[float, float, float] = (2.5, 0.625, 8.0)) -> Path:
    """A patient folder with ED=1, ES=2: a 100-valued block on a 0 background, labels = blocks."""
    pdir = root / pid
    pdir.mkdir(parents=True)
    img = np.zeros((20, 80, 3), dtype=np.int16)
    img[5:10, 20:60, :] = 100
    lab = np.zeros((20, 80, 3), dtype=np.uint8)
    lab[5:10, 20:40, :] = 3
    lab[5:10, 40:60, :] = 2
    lab[12:16, 8:16, :] = 1
    for frame in (1, 2):
        _save_nifti(pdir / f"{pid}_frame{frame:02d}.nii.gz", img, zooms)
        _save_nifti(pdir / f"{pid}_frame{frame:02d}_gt.nii.gz", lab, zooms)
    (pdir / "Info.cfg").write_text("ED: 1\nES: 2\nGroup: NOR\nHeight: 170.0\nNbFrame: 2\nWeight: 70.0\n")
    return pdir


# --------------------------------------------------------------------------- synthetic writer


def test_synthetic_layout_and_headers(synth: tuple[Path, dict[str, list[str]]]) -> None:
    root, sites = synth
    assert sites == {"site-1": ["patient001", "patient002"], "site-2": ["patient003", "patient004"]}
    for site, ids in sites.items():
        assert list_patients(root / site, site=site) == ids
        for pid in ids:
            pdir = root / site / pid
            info = read_info_cfg(pdir / "Info.cfg")
            assert info["ED"] == 1 and info["ES"] == N_FRAMES // 3 + 1 and info["NbFrame"] == N_FRAMES
            assert info["Group"] in {"NOR", "MINF", "DCM", "HCM", "RV"}
            assert isinstance(info["Height"], float) and isinstance(info["Weight"], float)
            cine = nib.load(str(pdir / f"{pid}_4d.nii.gz"))
            assert cine.get_data_dtype() == np.int16
            h, w, z, t = cine.shape
            assert (h, w, t) == (*SHAPE, N_FRAMES) and 5 <= z <= 6
            sx, sy, sz = (float(v) for v in cine.header.get_zooms()[:3])
            assert 1.3 <= sx <= 1.7 and sx == pytest.approx(sy) and 5.0 <= sz <= 10.0
            assert np.allclose(np.abs(np.diag(cine.affine)[:3]), (sx, sy, sz), rtol=1e-5)
            for frame in (info["ED"], info["ES"]):
                img = nib.load(str(pdir / f"{pid}_frame{frame:02d}.nii.gz"))
                gt = nib.load(str(pdir / f"{pid}_frame{frame:02d}_gt.nii.gz"))
                assert img.shape == gt.shape == (h, w, z)
                # The frame file is that frame of the cine.
                assert np.array_equal(np.asarray(img.dataobj), np.asarray(cine.dataobj)[..., frame - 1])
                assert set(np.unique(np.asarray(gt.dataobj)).tolist()) <= {0, 1, 2, 3}


def test_synthetic_anatomy_is_consistent(synth: tuple[Path, dict[str, list[str]]]) -> None:
    root, sites = synth
    ed, es = load_patient(root / "site-1", "patient001", with_labels=True, target_spacing=1.5, image_size=48)
    assert ed.label is not None and es.label is not None
    mid = ed.n_slices // 2
    # Image consistent with labels: blood pools bright, myocardium dark (by a quarter of the normalised range: the
    # LV label holds trabeculae and papillary muscles, and the volume's percentile range includes the RV blood).
    lv, myo, rv = ed.image[ed.label == 3], ed.image[ed.label == 2], ed.image[ed.label == 1]
    assert lv.mean() > myo.mean() + 0.25 and rv.mean() > myo.mean() + 0.25
    # Base -> apex: LV shrinks from the first ventricular slice (slices above the valve plane are atrial,
    # unlabelled), RV gone at the apex slice.
    first = next(z for z in range(ed.n_slices) if (ed.label[z] > 0).any())
    assert (ed.label[first] == 3).sum() > (ed.label[-1] == 3).sum()
    assert (ed.label[first] == 1).sum() > 0 and (ed.label[-1] == 1).sum() == 0
    # ED -> ES: cavities contract.
    assert (es.label[mid] == 3).sum() < (ed.label[mid] == 3).sum()


def test_synthetic_deterministic_and_sites_differ(
    tmp_path: Path, synth: tuple[Path, dict[str, list[str]]]
) -> None:
    root, _ = synth
    again = write_synthetic_acdc(
        tmp_path, n_patients=4, n_sites=2, seed=3, shape=SHAPE, n_frames=N_FRAMES, slices_range=(5, 6),
        per_site_folders=False,
    )
    assert list_patients(tmp_path) == ["patient001", "patient002", "patient003", "patient004"]
    assert again["site-2"] == ["patient003", "patient004"]
    a, _ = load_nifti(root / "site-2" / "patient003" / "patient003_4d.nii.gz")
    b, _ = load_nifti(tmp_path / "patient003" / "patient003_4d.nii.gz")
    assert np.array_equal(a, b)
    # Per-site acquisition: raw intensity statistics differ between sites.
    s1, _ = load_nifti(root / "site-1" / "patient001" / "patient001_4d.nii.gz")
    s2, _ = load_nifti(root / "site-2" / "patient003" / "patient003_4d.nii.gz")
    assert abs(np.percentile(s1, 99) - np.percentile(s2, 99)) > 0.05 * max(np.percentile(s1, 99), np.percentile(s2, 99))


def _raw(root: Path, pid: str, frame: int = 1, gt: bool = False) -> np.ndarray:
    name = f"{pid}_frame{frame:02d}{'_gt' if gt else ''}.nii.gz"
    return np.asarray(nib.load(str(root / pid / name)).dataobj)


def test_difficulty_scales_the_nuisances_and_keeps_the_default(tmp_path: Path) -> None:
    """The difficulty knob moves a simple measurable property: at 0 there is no noise (the air outside the body is
    one exact value), and the blood / myocardium contrast-to-noise ratio falls as the difficulty rises."""
    cnr = []
    for d in (0.0, 1.0, 2.0):
        write_synthetic_acdc(tmp_path / str(d), n_patients=2, n_sites=1, per_site_folders=False, seed=5,
                             shape=(48, 48), n_frames=3, slices_range=(6, 6), difficulty=d)
        img = _raw(tmp_path / str(d), "patient001").astype(np.float64)
        lab = _raw(tmp_path / str(d), "patient001", gt=True)
        if d == 0.0:
            assert len(np.unique(img[:2, :2, :])) == 1  # air corner, no Rician noise
        cnr.append((img[lab == 3].mean() - img[lab == 2].mean()) / img[lab == 2].std())
    assert cnr[0] > cnr[1] > cnr[2]
    # the default is the calibrated setting: omitting the argument equals passing DEFAULT_DIFFICULTY
    write_synthetic_acdc(tmp_path / "default", n_patients=1, n_sites=1, per_site_folders=False, seed=5,
                         shape=(48, 48), n_frames=3, slices_range=(6, 6))
    write_synthetic_acdc(tmp_path / "named", n_patients=1, n_sites=1, per_site_folders=False, seed=5,
                         shape=(48, 48), n_frames=3, slices_range=(6, 6), difficulty=DEFAULT_DIFFICULTY)
    assert np.array_equal(_raw(tmp_path / "default", "patient001"), _raw(tmp_path / "named", "patient001"))


def test_patient_scan_conditions_vary_with_difficulty_and_leave_the_anatomy() -> None:
    """Per-patient scan conditions (contrast curve, noise, blood and myocardial signal) are neutral at difficulty 0,
    spread within their documented ranges as the difficulty rises, and change the image, never the labels."""
    assert _patient_scan(0, 1, 0.0) == {"gamma": 1.0, "noise": 1.0, "blood": 1.0, "myo": 0.0}
    scans = [_patient_scan(0, num, 1.5) for num in range(1, 41)]
    gammas = np.array([s["gamma"] for s in scans])
    # at difficulty 1.5 the ranges are 1.5 x 1.25 (the patient spread) = 1.875 x those at 1: gamma exp(+-0.46875)
    assert np.all((gammas >= np.exp(-0.46875)) & (gammas <= np.exp(0.46875))) and gammas.std() > 0.15
    assert gammas.min() < np.exp(-0.375) and gammas.max() > np.exp(0.375)  # wider than the other nuisances' 1.5
    assert all(0.775 <= s["blood"] <= 1.0 and abs(s["myo"]) <= 0.075 for s in scans)
    assert _patient_scan(0, 7, 1.5) == _patient_scan(0, 7, 1.5)  # deterministic per (seed, patient)
    plain = _phantom(np.random.default_rng([9, 1]), (48, 48), 6, 3, "NOR", 1.0)
    darker = _phantom(np.random.default_rng([9, 1]), (48, 48), 6, 3, "NOR", 1.0, {"blood": 0.8, "myo": 0.05})
    assert np.array_equal(plain[1], darker[1]) and plain[2] == darker[2]
    lv = plain[1] == 3
    assert darker[0][lv].mean() < plain[0][lv].mean() - 0.1  # the LV blood is darker in the image


@pytest.mark.parametrize("bad", [-0.1, 3.5, "hard", True, float("nan")])
def test_difficulty_out_of_range_is_refused(tmp_path: Path, bad) -> None:
    with pytest.raises(ValueError, match="difficulty=.*between 0 .clean. and 3"):
        write_synthetic_acdc(tmp_path, n_patients=1, n_sites=1, difficulty=bad)
    assert not list(tmp_path.iterdir())


def test_phantom_label_integrity_over_groups_and_the_stack() -> None:
    """Every labelled slice of every group: the LV cavity is enclosed by myocardium (no LV pixel touches
    background), labels are 0-3; some patients have unlabelled atrial slices at the base whose image still holds
    bright blood; the ES cavity is smaller than the ED one."""
    saw_atrial = False
    for i, group in enumerate(("NOR", "MINF", "DCM", "HCM", "RV") * 2):
        signal, label, es = _phantom(np.random.default_rng([7, i]), (64, 64), 8, 4, group, 1.0)
        assert set(np.unique(label).tolist()) <= {0, 1, 2, 3}
        lv = label == 3
        pad = np.pad(label, ((0, 0), (0, 0), (1, 1), (1, 1)))
        for dy, dx in ((0, 1), (2, 1), (1, 0), (1, 2)):
            neighbour = pad[:, :, dy:dy + 64, dx:dx + 64]
            assert not (lv & (neighbour == 0)).any(), f"{group}: LV touches background"
        assert (label[es] == 3).sum() < (label[0] == 3).sum()
        if not (label[0, 0] > 0).any():  # an atrial slice: unlabelled, yet blood-bright somewhere
            saw_atrial = True
            assert signal[0, 0].max() > 0.7
    assert saw_atrial


def test_load_site_ed_es_and_all_frames(synth: tuple[Path, dict[str, list[str]]]) -> None:
    root, sites = synth
    vols = load_site(root / "site-2", with_labels=True, target_spacing=2.0, image_size=24, site="site-2")
    assert [(v.patient_id, v.phase) for v in vols] == [
        ("patient003", "ED"), ("patient003", "ES"), ("patient004", "ED"), ("patient004", "ES")
    ]
    for v in vols:
        assert v.site == "site-2"
        assert v.image.dtype == np.float32 and v.image.shape[1:] == (24, 24)
        assert 0.0 <= v.image.min() and v.image.max() <= 1.0
        assert v.label is not None and v.label.dtype == np.uint8 and v.label.shape == v.image.shape
        assert set(np.unique(v.label).tolist()) <= {0, 1, 2, 3}
    cine = load_site(root / "site-2", with_labels=False, frames="all", target_spacing=2.0, image_size=24,
                     site="site-2", patients=["patient004"])
    assert [v.phase for v in cine] == [f"frame{t:02d}" for t in range(1, N_FRAMES + 1)]
    assert all(v.label is None and v.site == "site-2" for v in cine)
    # The ED frame of the cine equals the ED volume.
    ed = [v for v in vols if v.patient_id == "patient004" and v.phase == "ED"][0]
    assert np.allclose(cine[0].image, ed.image)
    with pytest.raises(ValueError):
        load_patient(root / "site-2", "patient004", with_labels=True, frames="all")
    with pytest.raises(ValueError):
        load_patient(root / "site-2", "patient004", with_labels=False, frames="es")


def test_unlabelled_load_never_opens_gt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_synthetic_acdc(tmp_path, n_patients=2, n_sites=1, shape=(24, 24), n_frames=3, slices_range=(4, 4))
    opened: list[str] = []
    real_load = nib.load

    def spy(path: str, *args: object, **kwargs: object) -> object:
        opened.append(str(path))
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(volume.nib, "load", spy)
    site_dir = tmp_path / "site-1"
    for gt in site_dir.glob("*/*_gt.nii.gz"):
        gt.unlink()
    vols = load_site(site_dir, with_labels=False, site="site-1", target_spacing=2.0, image_size=16)
    assert len(vols) == 4 and all(v.label is None for v in vols)
    vols = load_site(site_dir, with_labels=False, frames="all", site="site-1", target_spacing=2.0, image_size=16)
    assert len(vols) == 6
    assert opened and not any("_gt" in p for p in opened)
    with pytest.raises(ACDCDataError):
        load_site(site_dir, with_labels=True, site="site-1")


# --------------------------------------------------------------------------- preprocessing


def test_odd_spacing_resamples_to_hand_computed_size(tmp_path: Path) -> None:
    _hand_patient(tmp_path)
    data, zooms = load_nifti(tmp_path / "patient007" / "patient007_frame01.nii.gz", site="site-4")
    assert data.dtype == np.float32 and data.shape == (20, 80, 3)
    assert zooms[:3] == pytest.approx((2.5, 0.625, 8.0))
    # 20 px * 2.5 mm = 50 mm -> 40 px at 1.25 mm; 80 px * 0.625 mm = 50 mm -> 40 px; pad 40 -> 48.
    ed, es = load_patient(tmp_path, "patient007", with_labels=True, target_spacing=1.25, image_size=48, site="site-4")
    assert ed.image.shape == (3, 48, 48) and ed.phase == "ED" and es.phase == "ES"
    # Block rows 5:10 -> 10:20, cols 20:60 -> 10:30 in the 40x40 grid; + 4 padding.
    assert np.allclose(ed.image[:, 15:23, 15:33], 1.0)
    assert np.allclose(ed.image[:, :, :4], 0.0) and np.allclose(ed.image[:, :4, :], 0.0)
    assert np.allclose(ed.image[:, 26:, :], 0.0) and np.allclose(ed.image[:, :, 36:], 0.0)
    # Cropping: 40 -> 32 removes 4 pixels on each side.
    img32, _ = preprocess_volume(data, (2.5, 0.625), target_spacing=1.25, image_size=32)
    assert img32.shape == (3, 32, 32)
    assert np.allclose(img32, ed.image[:, 8:40, 8:40])


def test_labels_survive_nearest_resampling(tmp_path: Path) -> None:
    _hand_patient(tmp_path)
    lab, _ = load_nifti(tmp_path / "patient007" / "patient007_frame01_gt.nii.gz")
    img, _ = load_nifti(tmp_path / "patient007" / "patient007_frame01.nii.gz")
    _, out = preprocess_volume(img, (2.5, 0.625), target_spacing=1.25, image_size=40, label_hwz=lab)
    assert out is not None and out.dtype == np.uint8 and out.shape == (3, 40, 40)
    assert set(np.unique(out).tolist()) == {0, 1, 2, 3}
    # x2 along H (nearest-exact: out[i] = in[i // 2]), /2 along W (out[j] = in[2j + 1]).
    expected = np.repeat(lab.astype(np.uint8), 2, axis=0)[:, 1::2, :].transpose(2, 0, 1)
    assert np.array_equal(out, expected)


def test_percentile_clip_and_minmax_hand_made() -> None:
    vol = np.arange(1000, dtype=np.float32).reshape(10, 10, 10)  # (H, W, Z)
    out, lab = preprocess_volume(vol, (1.0, 1.0), target_spacing=1.0, image_size=10)
    assert lab is None and out.dtype == np.float32 and out.shape == (10, 10, 10)
    lo, hi = 9.99, 989.01  # 1st / 99th percentile of 0..999 (linear interpolation)
    expected = np.clip((vol - lo) / (hi - lo), 0.0, 1.0).transpose(2, 0, 1)
    assert np.allclose(out, expected, atol=1e-5)
    assert out.min() == 0.0 and out.max() == 1.0
    # Slice-first: out[z, h, w] == f(vol[h, w, z]).
    assert out[3, 5, 7] == pytest.approx((vol[5, 7, 3] - lo) / (hi - lo), abs=1e-5)
    const, _ = preprocess_volume(np.full((8, 8, 4), 7.0), (1.4, 1.4), target_spacing=1.25, image_size=8)
    assert np.all(const == 0.0) and not np.isnan(const).any()


# --------------------------------------------------------------------------- datasets


def _encoded_volume(z: int = 10, pid: str = "patient001") -> Volume:
    img = np.broadcast_to(np.arange(z, dtype=np.float32)[:, None, None], (z, 6, 6)).copy()
    return Volume(patient_id=pid, phase="ED", image=img, label=np.zeros((z, 6, 6), np.uint8))


def test_partition_sample_dataset_order_and_reproducibility() -> None:
    vols = [_encoded_volume(10), _encoded_volume(7, "patient002")]
    ds = PartitionSampleDataset(vols, n_partitions=4, seed=1)
    assert len(ds) == 2
    parts = {i: np.array_split(np.arange(v.n_slices), 4) for i, v in enumerate(vols)}
    seen: dict[tuple[int, int], set[int]] = {}
    first = [ds[i] for i in range(2)]
    for epoch in range(30):
        ds.set_epoch(epoch)
        for i in range(2):
            x, part = ds[i]
            assert x.shape == (4, 1, 6, 6) and x.dtype == torch.float32
            assert torch.equal(part, torch.arange(4)) and part.dtype == torch.long
            for s in range(4):
                z = int(x[s, 0, 0, 0])
                assert z in parts[i][s].tolist()
                assert torch.all(x[s] == z)
                seen.setdefault((i, s), set()).add(z)
    # Every slice of every partition gets drawn eventually.
    for (i, s), zs in seen.items():
        assert zs == set(parts[i][s].tolist())
    # Reproducible: same seed and epoch -> same sample; a fresh dataset agrees.
    ds.set_epoch(0)
    again = PartitionSampleDataset(vols, n_partitions=4, seed=1)
    for i in range(2):
        assert torch.equal(ds[i][0], first[i][0]) and torch.equal(again[i][0], first[i][0])
    # set_epoch reseeds; another seed gives another sequence of draws.
    other = PartitionSampleDataset(vols, n_partitions=4, seed=2)
    draws, other_draws = [], []
    for e in range(10):
        ds.set_epoch(e)
        other.set_epoch(e)
        draws.append(tuple(ds.slice_indices(0)))
        other_draws.append(tuple(other.slice_indices(0)))
    assert len(set(draws)) > 1 and draws != other_draws


def test_partition_sample_dataset_rejects_short_volume() -> None:
    with pytest.raises(ValueError, match="fewer than n_partitions"):
        PartitionSampleDataset([_encoded_volume(10), _encoded_volume(3, "patient009")], n_partitions=4)


def test_slice_dataset() -> None:
    vols = [_encoded_volume(5), _encoded_volume(3, "patient002")]
    vols[1].label[1, 2, 3] = 3
    ds = SliceDataset(vols)
    assert len(ds) == 8
    img, lab = ds[6]
    assert img.shape == (1, 6, 6) and img.dtype == torch.float32 and float(img[0, 0, 0]) == 1.0
    assert lab.shape == (6, 6) and lab.dtype == torch.long and int(lab[2, 3]) == 3
    unl = Volume(patient_id="patient003", phase="frame01", image=np.zeros((4, 6, 6), np.float32))
    with pytest.raises(ValueError, match="no label"):
        SliceDataset([unl])


# --------------------------------------------------------------------------- errors


def _assert_names(exc: pytest.ExceptionInfo[ACDCDataError], path: Path, site: str) -> None:
    msg = str(exc.value)
    assert str(path) in msg, msg
    assert site in msg, msg
    assert "Fix:" in msg, msg


def test_missing_root_and_empty_root(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ACDCDataError) as exc:
        list_patients(missing, site="site-3")
    _assert_names(exc, missing, "site-3")
    with pytest.raises(ACDCDataError) as exc:
        load_site(missing, with_labels=False, site="site-3")
    _assert_names(exc, missing, "site-3")
    (tmp_path / "patient01").mkdir()  # 2 digits: not a patient folder
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ACDCDataError) as exc:
        list_patients(tmp_path, site="site-5")
    _assert_names(exc, tmp_path, "site-5")


def test_patient_without_info_cfg(tmp_path: Path) -> None:
    pdir = _hand_patient(tmp_path)
    (pdir / "Info.cfg").unlink()
    with pytest.raises(ACDCDataError) as exc:
        load_patient(tmp_path, "patient007", with_labels=False, site="site-3")
    _assert_names(exc, pdir / "Info.cfg", "site-3")


def test_info_cfg_parsing_and_missing_es(tmp_path: Path) -> None:
    cfg = tmp_path / "Info.cfg"
    cfg.write_text("ED: 1\nES: 12\nGroup: NOR\nHeight: 184.0\nNbFrame: 30\nWeight: 95.0\n")
    assert read_info_cfg(cfg) == {"ED": 1, "ES": 12, "Group": "NOR", "Height": 184.0, "NbFrame": 30, "Weight": 95.0}
    cfg.write_text("ED: 1\nGroup: NOR\n")
    with pytest.raises(ACDCDataError) as exc:
        read_info_cfg(cfg, site="site-8")
    _assert_names(exc, cfg, "site-8")
    assert "ES" in str(exc.value)


def test_corrupt_and_missing_nifti(tmp_path: Path) -> None:
    pdir = _hand_patient(tmp_path)
    bad = pdir / "patient007_frame02.nii.gz"
    bad.write_bytes(os.urandom(64) + b"not a nifti")
    with pytest.raises(ACDCDataError) as exc:
        load_nifti(bad, site="site-3")
    _assert_names(exc, bad, "site-3")
    with pytest.raises(ACDCDataError) as exc:
        load_patient(tmp_path, "patient007", with_labels=False, site="site-3")
    _assert_names(exc, bad, "site-3")
    missing = pdir / "patient007_frame01_gt.nii.gz"
    missing.unlink()
    with pytest.raises(ACDCDataError) as exc:
        load_nifti(missing, site="site-6")
    _assert_names(exc, missing, "site-6")


# --------------------------------------------------------------------------- real-format edge cases


@pytest.mark.parametrize("encoding,newline", [("utf-8-sig", "\n"), ("utf-8-sig", "\r\n"), ("utf-16", "\r\n")])
def test_info_cfg_with_byte_order_mark(tmp_path: Path, encoding: str, newline: str) -> None:
    cfg = tmp_path / "Info.cfg"
    cfg.write_bytes(newline.join(["ED: 1", "ES: 12", "Group: NOR", "NbFrame: 30", ""]).encode(encoding))
    assert cfg.read_bytes()[:2] in (b"\xef\xbb", b"\xff\xfe", b"\xfe\xff")  # the BOM really is there
    assert read_info_cfg(cfg, site="site-2") == {"ED": 1, "ES": 12, "Group": "NOR", "NbFrame": 30}


def _cine_only_patient(root: Path, pid: str = "patient009", ed: int = 2, es: int = 4) -> Path:
    """Only Info.cfg + a (8, 8, 2, 4) cine whose frame t (1-based) is bright on rows 2(t-1):2t only."""
    pdir = root / pid
    pdir.mkdir(parents=True)
    cine = np.zeros((8, 8, 2, 4), dtype=np.int16)
    for t in range(4):
        cine[2 * t : 2 * t + 2, :, :, t] = 100
    _save_nifti(pdir / f"{pid}_4d.nii.gz", cine, (1.25, 1.25, 8.0, 1.0))
    (pdir / "Info.cfg").write_text(f"ED: {ed}\nES: {es}\nNbFrame: 4\n")
    return pdir


def test_cine_only_folder_gives_ed_es_for_pretraining(tmp_path: Path) -> None:
    pdir = _cine_only_patient(tmp_path)
    ed, es = load_patient(tmp_path, "patient009", with_labels=False, target_spacing=1.25, image_size=8, site="site-3")
    assert (ed.phase, es.phase) == ("ED", "ES") and ed.label is None and es.label is None
    # ED: 2 -> cine[..., 1] (rows 2:4 bright); ES: 4 -> cine[..., 3] (rows 6:8); 1-based as in ACDC.
    for vol, rows in ((ed, slice(2, 4)), (es, slice(6, 8))):
        expected = np.zeros((2, 8, 8), np.float32)
        expected[:, rows, :] = 1.0
        assert np.array_equal(vol.image, expected)
    # Labelled loading still needs the frame + _gt files: one clear error naming the missing frame file.
    with pytest.raises(ACDCDataError, match="pre-training only") as exc:
        load_patient(tmp_path, "patient009", with_labels=True, site="site-3")
    _assert_names(exc, pdir / "patient009_frame02.nii.gz", "site-3")
    # A frame number beyond the cine is refused, naming the cine.
    _cine_only_patient(tmp_path, "patient010", ed=1, es=5)
    with pytest.raises(ACDCDataError, match="ES: 5 but the cine has 4 frames") as exc:
        load_patient(tmp_path, "patient010", with_labels=False, site="site-3")
    _assert_names(exc, tmp_path / "patient010" / "patient010_4d.nii.gz", "site-3")
    # Neither the frame file nor the cine: the error says both are missing.
    (pdir / "patient009_4d.nii.gz").unlink()
    with pytest.raises(ACDCDataError, match="no 4D cine") as exc:
        load_patient(tmp_path, "patient009", with_labels=False, site="site-3")
    _assert_names(exc, pdir / "patient009_frame02.nii.gz", "site-3")


def test_cine_only_site_matches_frame_files(tmp_path: Path) -> None:
    write_synthetic_acdc(tmp_path, n_patients=2, n_sites=1, seed=1, shape=(24, 24), n_frames=4, slices_range=(4, 4))
    site_dir = tmp_path / "site-1"
    kwargs = dict(with_labels=False, target_spacing=2.0, image_size=16, site="site-1")
    from_frames = load_site(site_dir, **kwargs)
    for f in site_dir.glob("*/*_frame*.nii.gz"):
        f.unlink()
    from_cine = load_site(site_dir, **kwargs)
    assert [(v.patient_id, v.phase) for v in from_cine] == [(v.patient_id, v.phase) for v in from_frames]
    assert all(np.array_equal(a.image, b.image) for a, b in zip(from_cine, from_frames))


def test_float_gt_with_non_integer_labels_is_refused(tmp_path: Path) -> None:
    pdir = _hand_patient(tmp_path)
    gt = pdir / "patient007_frame02_gt.nii.gz"
    lab, zooms = load_nifti(gt)
    kwargs = dict(with_labels=True, target_spacing=1.25, image_size=48, site="site-4")
    reference = load_patient(tmp_path, "patient007", **kwargs)
    # Float file with exactly integral values 0/1/2/3: accepted, same labels as the uint8 file.
    _save_nifti(gt, lab.astype(np.float32), zooms)
    as_float = load_patient(tmp_path, "patient007", **kwargs)
    assert all(np.array_equal(a.label, b.label) for a, b in zip(as_float, reference))
    for bad_value, shown in ((1.5, "1.5"), (0.3, "0.3"), (np.nan, "nan")):
        bad = lab.astype(np.float32)
        bad[0, 0, 0] = bad_value
        _save_nifti(gt, bad, zooms)
        with pytest.raises(ACDCDataError, match=f"1 non-integer value.*{shown}") as exc:
            load_patient(tmp_path, "patient007", **kwargs)
        _assert_names(exc, gt, "site-4")
    # Integral but not an ACDC class.
    bad = lab.astype(np.float32)
    bad[0, 0, 0] = 4.0
    _save_nifti(gt, bad, zooms)
    with pytest.raises(ACDCDataError, match="label values 4 are not ACDC classes") as exc:
        load_patient(tmp_path, "patient007", **kwargs)
    _assert_names(exc, gt, "site-4")
    # Integer files: values that a uint8 cast would wrap onto a class (256 -> background, 257 and -255 -> RV) are
    # checked before any cast (issue 45).
    for bad_value in (256, 257, -255):
        bad = lab.astype(np.int16)
        bad[0, 0, 0] = bad_value
        _save_nifti(gt, bad, zooms)
        with pytest.raises(ACDCDataError, match=f"label values {bad_value} are not ACDC classes") as exc:
            load_patient(tmp_path, "patient007", **kwargs)
        _assert_names(exc, gt, "site-4")
    # preprocess_volume itself refuses rather than rounds.
    with pytest.raises(ValueError, match="non-integer"):
        preprocess_volume(np.zeros((4, 4, 1)), (1.0, 1.0), target_spacing=1.0, image_size=4,
                          label_hwz=np.full((4, 4, 1), 1.5))


# --------------------------------------------------------------------------- site folders for real ACDC


def test_link_site_folders(tmp_path: Path) -> None:
    src = tmp_path / "training"
    ids = [f"patient{i:03d}" for i in range(1, 7)]
    for pid in ids:
        (src / pid).mkdir(parents=True)
    (src / "MANDATORY_CITATION.md").write_text("cite")
    out = tmp_path / "fed"
    plan = link_site_folders(src, out, n_sites=3, per_site=2, seed=5)
    expected = split_patients(ids, 3, 2, seed=5)
    assert plan == {f"site-{k}": g for k, g in enumerate(expected, start=1)}
    for site, g in plan.items():
        assert list_patients(out / site, site=site) == g
        for pid in g:
            assert (out / site / pid).is_symlink()
            assert (out / site / pid).resolve() == (src / pid).resolve()
    # Idempotent with the same arguments; a different split conflicts.
    assert link_site_folders(src, out, n_sites=3, per_site=2, seed=5) == plan
    with pytest.raises(ACDCDataError) as exc:
        link_site_folders(src, out, n_sites=3, per_site=2, seed=6)
    assert "site-" in str(exc.value) and str(out) in str(exc.value)


def test_every_group_has_a_right_ventricle_beside_the_septum() -> None:
    """HCM thickens the septum; the RV must stay outside it (it did not: the thick septum covered the RV crescent,
    leaving 0-80 RV pixels per volume). At ED, on the same draws, each group's RV is at least a third of NOR's,
    and the RV touches the myocardium (no gap of background between them)."""
    def rv_at_ed(group: str, i: int) -> tuple[int, bool]:
        _, label, _ = _phantom(np.random.default_rng([11, i]), (64, 64), 8, 4, group, 1.0)
        ed = label[0]
        rv = ed == 1
        pad = np.pad(ed, ((0, 0), (1, 1), (1, 1)))
        touches = any((rv & (pad[:, dy:dy + 64, dx:dx + 64] == 2)).any() for dy, dx in ((0, 1), (2, 1), (1, 0), (1, 2)))
        return int(rv.sum()), touches

    for i in range(4):
        nor, _ = rv_at_ed("NOR", i)
        for group in ("MINF", "DCM", "HCM", "RV"):
            n, touches = rv_at_ed(group, i)
            assert n > nor / 3 and touches, f"{group} (draw {i}): {n} RV pixels at ED against NOR's {nor}"


def test_right_ventricle_size_and_function_per_group() -> None:
    """The RV / LV end-diastolic cavity ratio and the RV ejection fraction follow the ACDC groups (mean over six
    draws): about equal volumes in NOR and HCM (healthy adults have RV EDV ~ LV EDV), a dilated LV in MINF and DCM,
    a dilated RV with an RV EF below 40 % in the abnormal-RV group, and an RV EF above 40 % in NOR and HCM. Before
    this the generator's RV was 0.28-0.41 of the LV outside the abnormal-RV group."""
    bands = {"NOR": (0.8, 1.2), "HCM": (0.85, 1.3), "MINF": (0.55, 0.85), "DCM": (0.45, 0.72), "RV": (1.5, 2.4)}
    for group, (lo, hi) in bands.items():
        ratio, ef = [], []
        for i in range(6):
            _, label, es = _phantom(np.random.default_rng([12, i]), (64, 64), 8, 4, group, 1.0)
            rv_ed, rv_es, lv_ed = (label[0] == 1).sum(), (label[es] == 1).sum(), (label[0] == 3).sum()
            ratio.append(rv_ed / lv_ed)
            ef.append(1.0 - rv_es / rv_ed)
        assert lo < np.mean(ratio) < hi, f"{group}: RV / LV at ED {np.mean(ratio):.2f}, expected in ({lo}, {hi})"
        if group == "RV":
            assert np.mean(ef) < 0.40, f"abnormal RV: RV EF {np.mean(ef):.2f}, expected below 0.40"
        elif group in ("NOR", "HCM"):
            assert np.mean(ef) > 0.45, f"{group}: RV EF {np.mean(ef):.2f}, expected above 0.45"


def test_cavity_volumes_hand_computed(tmp_path: Path) -> None:
    """Voxels of 2.5 x 0.625 x 8 mm = 12.5 mm3. ED: LV 5 x 20 x 3 = 300 voxels (3.75 ml), MYO 300 (3.75 ml), RV
    4 x 8 x 3 = 96 (1.2 ml). ES: the LV block halved (150 voxels, 1.875 ml), the rest unchanged."""
    pdir = _hand_patient(tmp_path)
    es = np.zeros((20, 80, 3), dtype=np.uint8)
    es[5:10, 20:30, :] = 3
    es[5:10, 40:60, :] = 2
    es[12:16, 8:16, :] = 1
    _save_nifti(pdir / "patient007_frame02_gt.nii.gz", es, (2.5, 0.625, 8.0))
    second = _hand_patient(tmp_path, "patient008", zooms=(1.0, 1.0, 10.0))  # 10 mm3 voxels, ED == ES files
    (second / "Info.cfg").write_text("ED: 1\nES: 2\nGroup: HCM\nHeight: 170.0\nNbFrame: 2\nWeight: 70.0\n")
    rows = cavity_volumes(tmp_path, site="site-x")
    assert [r["patient"] for r in rows] == ["patient007", "patient008"]
    a, b = rows
    assert a["group"] == "NOR" and b["group"] == "HCM"
    assert a["LV_ED_ml"] == pytest.approx(3.75) and a["MYO_ED_ml"] == pytest.approx(3.75)
    assert a["RV_ED_ml"] == pytest.approx(1.2) and a["RV_ES_ml"] == pytest.approx(1.2)
    assert a["LV_ES_ml"] == pytest.approx(1.875)
    assert (a["RV_LV_ED"] == pytest.approx(0.32) and a["LV_EF"] == pytest.approx(0.5)
            and a["RV_EF"] == pytest.approx(0.0))
    assert b["LV_ED_ml"] == pytest.approx(3.0) and b["RV_ED_ml"] == pytest.approx(0.96)
    groups = summarise_cavity_volumes(rows + [dict(a, patient="patient009", LV_EF=float("nan"), RV_LV_ED=0.5)])
    assert [(g["group"], g["n"]) for g in groups] == [("NOR", 2), ("HCM", 1)]  # ACDC's group order
    assert groups[0]["RV_LV_ED"] == pytest.approx(0.41) and groups[0]["LV_EF"] == pytest.approx(0.5)  # nan ignored


def test_cavity_volumes_name_the_broken_file_and_site(tmp_path: Path) -> None:
    pdir = _hand_patient(tmp_path)
    (pdir / "patient007_frame02_gt.nii.gz").write_bytes(b"not a nifti")
    with pytest.raises(ACDCDataError, match="site-x.*patient007_frame02_gt"):
        cavity_volumes(tmp_path, site="site-x")
    bad = np.full((20, 80, 3), 7, dtype=np.uint8)
    _save_nifti(pdir / "patient007_frame02_gt.nii.gz", bad, (2.5, 0.625, 8.0))
    with pytest.raises(ACDCDataError, match="not ACDC classes"):
        cavity_volumes(tmp_path, site="site-x")


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("cine_only", [False, True])
def test_non_finite_image_is_refused_naming_file_and_site(tmp_path: Path, value: float, cine_only: bool) -> None:
    """Issue 45: a NaN or infinite voxel was silently set to 0; now the load stops naming the file and the site."""
    if cine_only:
        pdir = _cine_only_patient(tmp_path)
        bad = pdir / "patient009_4d.nii.gz"
        data = np.zeros((8, 8, 2, 4), dtype=np.float32)
        zooms: tuple[float, ...] = (1.25, 1.25, 8.0, 1.0)
    else:
        pdir = _hand_patient(tmp_path)
        bad = pdir / "patient007_frame02.nii.gz"
        data, zooms = np.zeros((20, 80, 3), dtype=np.float32), (2.5, 0.625, 8.0)
    data[(1, 2, 1, 0)[: data.ndim]] = value
    _save_nifti(bad, data, zooms)
    with pytest.raises(ACDCDataError, match="1 voxel\\(s\\) are NaN or infinite") as exc:
        load_site(tmp_path, with_labels=False, site="site-3")
    _assert_names(exc, bad, "site-3")
