"""Tests for the synthetic retina / derm / covidfl writers (fedssl.data.image_synthetic)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from fedssl.data.image_synthetic import (
    RETINA_DIFFICULTY,
    _source_params,
    render,
    retina_lesion_opacity,
    write_synthetic_images,
)
from fedssl.data.images import class_names, load_image_records
from fedssl.data.sslfl_release import read_release


def _mean(dataset, cls, source, n=12, size=32, **kw):
    return np.stack([render(dataset, cls, source, np.random.default_rng(i), size, **kw) for i in range(n)])


def test_class_is_visible_in_the_pixels():
    src = _source_params("retina", 0, 1)[0]
    # the same random stream draws the same fundus, so the difference between levels is the lesions only;
    # at difficulty 0 (opaque lesions, ideal camera) every DR level shows
    healthy = _mean("retina", 0, src, n=1, size=64, difficulty=0.0)[0]
    assert np.array_equal(healthy, _mean("retina", 0, src, n=1, size=64, difficulty=0.0)[0])
    lesion_px = [int((np.abs(_mean("retina", level, src, n=1, size=64, difficulty=0.0)[0] - healthy).max(axis=2)
                      > 0.1).sum()) for level in (1, 2, 3)]
    assert 1 <= lesion_px[0] < 10 < lesion_px[1] < lesion_px[2]  # grade 1: a microaneurysm or two; more with the level
    d = _source_params("derm", 0, 1)[0]
    centre = lambda a: a[:, 12:20, 15:27].mean(axis=(0, 1, 2))  # noqa: E731 - lesion region
    mel, nv, vasc = (centre(_mean("derm", c, d)) for c in ("MEL", "NV", "VASC"))
    assert mel.mean() < nv.mean()  # melanoma darker than naevus
    assert vasc[0] - vasc[1] > nv[0] - nv[1]  # vascular lesions redder
    c = _source_params("covidfl", 0, 1)[0]
    lungs = lambda a: a[:, 8:26, 4:28].mean()  # noqa: E731 - lung fields
    normal, pneu, covid = (lungs(_mean("covidfl", k, c, n=16)) for k in ("normal", "pneumonia", "covid"))
    assert pneu > normal + 0.01 and covid > normal + 0.01


def test_sources_shift_appearance():
    a, b = _source_params("derm", 0, 2)
    ma, mb = _mean("derm", "NV", a).mean(axis=(0, 1, 2)), _mean("derm", "NV", b).mean(axis=(0, 1, 2))
    assert np.abs(ma - mb).max() > 0.03


def test_writer_is_deterministic_and_class_mix_is_realistic(tmp_path):
    infos = [write_synthetic_images(tmp_path / f"r{k}", "retina", 200, seed=4, image_size=16) for k in (0, 1)]
    assert infos[0]["class_counts"] == infos[1]["class_counts"]
    assert infos[0]["class_counts"]["level_0"] == 147  # 73.5 % level 0, as Kaggle DR
    h = [hashlib.sha256((tmp_path / f"r{k}" / "train" / "10_left.jpeg").read_bytes()).hexdigest() for k in (0, 1)]
    assert h[0] == h[1]
    recs = load_image_records(tmp_path / "r0", "retina")
    assert len(recs) == 200 and sum(r.label for r in recs) == 53
    other = write_synthetic_images(tmp_path / "r2", "retina", 200, seed=5, image_size=16)
    assert other["class_counts"] == infos[0]["class_counts"]  # the mix depends on n_images, not the seed
    assert hashlib.sha256((tmp_path / "r2" / "train" / "10_left.jpeg").read_bytes()).hexdigest() != h[0]
    with pytest.raises(ValueError, match="already exists"):
        write_synthetic_images(tmp_path / "r0", "retina", 200, seed=4, image_size=16)


def test_derm_and_covidfl_layouts(tmp_path):
    info = write_synthetic_images(tmp_path / "d", "derm", 100, seed=0, image_size=16)
    assert min(info["class_counts"].values()) >= 2 and max(info["class_counts"], key=info["class_counts"].get) == "NV"
    assert len(load_image_records(tmp_path / "d", "derm")) == 100
    info = write_synthetic_images(tmp_path / "c", "covidfl", 200, seed=0, image_size=16)
    assert sorted(info["sources"]) == ["bimcv", "cohen", "eurorad", "gz", "ml-workgroup", "ricord_c", "rsna", "sirm"]
    # SSL-FL's 12_clients/split_real: RSNA cut into 5, the other 7 real sites whole (section IV-B1: 12 clients)
    assert sorted(info["clients"]) == ["bimcv", "cohen", "eurorad", "gz", "ml-workgroup", "ricord_c",
                                       "rsna-0", "rsna-1", "rsna-2", "rsna-3", "rsna-4", "sirm"]
    release = read_release(tmp_path / "c", "covidfl")
    mixes: dict = {}
    for r in release.train + release.test:
        mixes.setdefault(Path(r.path).name.split("_")[0], set()).add(class_names("covidfl")[r.label])
    assert mixes["bimcv"] == {"covid"} and mixes["rsna"] == {"pneumonia", "normal"}
    assert mixes["cohen"] == {"covid", "pneumonia", "normal"}
    # every real site holds out 20 % of each of its classes (section IV-A: 80/20 within each site)
    for site in info["sources"]:
        for c in range(3):
            n_tr = sum(Path(r.path).name.startswith(site + "_") and r.label == c for r in release.train)
            n_te = sum(Path(r.path).name.startswith(site + "_") and r.label == c for r in release.test)
            assert n_te == (0 if n_tr + n_te < 2 else min(n_tr + n_te - 1, int((n_tr + n_te) * 0.2 + 0.5)))
    mel = write_synthetic_images(tmp_path / "m", "derm_mel", 40, seed=0, image_size=16)
    assert mel["class_counts"] == {"benign": 20, "melanoma": 20}
    derm = read_release(tmp_path / "m", "derm_mel")
    assert (len(derm.train), len(derm.test)) == (30, 10)  # ~7,500 / ~2,500 in the paper
    with pytest.raises(ValueError, match="n_sources"):
        write_synthetic_images(tmp_path / "x", "covidfl", 60, n_sources=9)
    with pytest.raises(ValueError, match="n_images"):
        write_synthetic_images(tmp_path / "y", "derm", 10)


def _lesion_contrast(level: int, difficulty: float, n: int = 6, size: int = 40) -> float:
    """Mean |image of ``level`` - image of level 0| over a fixed set of eyes: the lesions' contrast (anatomy and
    camera come from their own streams, so only the lesions differ)."""
    src = _source_params("retina", 0, 4)
    return float(np.mean([np.abs(render("retina", level, src[i % 4], np.random.default_rng(i), size,
                                        difficulty=difficulty)
                                 - render("retina", 0, src[i % 4], np.random.default_rng(i), size,
                                          difficulty=difficulty)).mean()
                          for i in range(n)]))


def test_difficulty_lowers_lesion_contrast_monotonically():
    assert (retina_lesion_opacity(0.0) == 1.0 and retina_lesion_opacity(1.0) == 0.5
            and retina_lesion_opacity(3.0) == 0.25)
    contrast = [_lesion_contrast(2, d) for d in (0.0, 0.5, 1.0, 2.0, 3.0)]
    assert all(a > b for a, b in zip(contrast, contrast[1:])), contrast
    assert contrast[-1] < 0.25 * contrast[0]  # opacity / 4 at d = 3, plus camera blur


def test_lesions_grow_with_the_dr_level_and_grade_1_is_faint():
    c = {level: _lesion_contrast(level, 0.0) for level in range(5)}
    assert c[0] == 0.0
    assert c[1] < 0.1 * c[2] < 0.1 * c[3]  # grade 1: a few sub-pixel microaneurysms only (Kaggle DR grade 1)
    assert c[4] > c[1]


def test_difficulty_scales_the_camera_nuisance():
    src = _source_params("retina", 0, 4)[1]
    ideal = [render("retina", 0, src, np.random.default_rng(i), 40, difficulty=0.0) for i in range(4)]
    # difficulty 0: an ideal camera, so two cameras give the same picture of the same eye
    other = [render("retina", 0, _source_params("retina", 0, 4)[2], np.random.default_rng(i), 40, difficulty=0.0)
             for i in range(4)]
    assert all(np.array_equal(a, b) for a, b in zip(ideal, other))
    # the cameras' colour cast / exposure / gamma: the spread of the same eye's mean colour over the 4 cameras grows
    spread = []
    for d in (0.0, 0.5, 1.0, 2.0):
        means = [[render("retina", 0, cam, np.random.default_rng(i), 40, difficulty=d).mean(axis=(0, 1))
                  for cam in _source_params("retina", 0, 4)] for i in range(2)]
        spread.append(float(np.std(np.asarray(means), axis=1).mean()))
    assert spread[0] < 1e-6 < spread[1] < spread[2] < spread[3], spread


def test_writer_records_the_difficulty_and_keeps_the_labels(tmp_path):
    a = write_synthetic_images(tmp_path / "a", "retina", 40, seed=2, image_size=16, difficulty=1.5)
    write_synthetic_images(tmp_path / "b", "retina", 40, seed=2, image_size=16, difficulty=1.5)
    c = write_synthetic_images(tmp_path / "c", "retina", 40, seed=2, image_size=16)
    assert a["difficulty"] == 1.5 and c["difficulty"] == RETINA_DIFFICULTY
    labels = [(tmp_path / k / "trainLabels.csv").read_text() for k in "abc"]
    assert labels[0] == labels[1] == labels[2]  # the difficulty changes pixels, never labels or the layout
    files = sorted(p.name for p in (tmp_path / "a" / "train").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "c" / "train").iterdir()) and len(files) == 40
    digest = {k: hashlib.sha256((tmp_path / k / "train" / "10_left.jpeg").read_bytes()).hexdigest() for k in "abc"}
    assert digest["a"] == digest["b"] != digest["c"]  # same seed and difficulty: same bytes


def test_difficulty_is_checked_and_only_for_retina(tmp_path):
    for bad in (-0.1, float("nan"), float("inf"), True, "1"):
        with pytest.raises(ValueError, match="difficulty="):
            write_synthetic_images(tmp_path / "r", "retina", 40, difficulty=bad)
    with pytest.raises(ValueError, match="only the retina generator"):
        write_synthetic_images(tmp_path / "d", "derm", 40, difficulty=1.0)
    assert not (tmp_path / "d").exists()


def test_other_data_sets_render_as_before_the_retina_change():
    """derm / covidfl / derm_mel pixels are unchanged by the retina work (values recorded from the code before it)."""
    expected = {("derm", "MEL"): (1099.8125, 0.481223), ("covidfl", "covid"): (532.7788, 0.3319),
                ("derm_mel", "NV"): (1225.1409, 0.556616)}
    for (ds, cls), (total, pixel) in expected.items():
        img = render(ds, cls, _source_params(ds, 3, 2)[1], np.random.default_rng(5), 24)
        assert float(img.astype(np.float64).sum()) == pytest.approx(total, abs=1e-3)
        assert float(img[7, 9, 1]) == pytest.approx(pixel, abs=1e-6)
