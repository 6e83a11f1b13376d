"""FedCLF's 10 devices (fedssl.data.fedclf_devices) built from the synthetic sources (fedssl.data.fedclf_synthetic):
the class subset, the shards, the 60/20/20 split, the 72 px shorter edge, determinism, and the refusals."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from PIL import Image

from fedssl.data.fedclf_devices import (
    CATEGORY_ALIASES,
    ISIC_FIVE_CLASS_COUNTS,
    PAPER_SOURCE_SIZES,
    build_devices,
    load_device,
    normalise_category,
    read_class_tree,
    split_device,
)
from fedssl.data.fedclf_synthetic import ACQUISITION, source_sizes, write_synthetic_derm_sources
from fedssl.data.images import DERM5_CLASSES, ImageDataError, ImageRecord, load_image_records


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    out = tmp_path_factory.mktemp("raw")
    info = write_synthetic_derm_sources(str(out), n_isic=120, seed=0, image_size=24)
    return str(out), info


def _roots(out):
    return [os.path.join(out, s) for s in ("isic2019", "atlasderm", "dermnet", "darkderm")]


@pytest.fixture(scope="module")
def devices(sources, tmp_path_factory):
    out = tmp_path_factory.mktemp("devices") / "dev"
    return str(out), build_devices(str(out), *_roots(sources[0]), seed=0, short_edge=16)


def test_paper_counts():
    assert sum(ISIC_FIVE_CLASS_COUNTS.values()) == PAPER_SOURCE_SIZES["ISIC 2019"] == 21587  # "about 21k"


def test_ten_devices_isic_shards_and_the_other_sources(sources, devices):
    out, report = devices
    assert list(report["devices"]) == [f"site-{k}" for k in range(1, 11)]
    assert [d["source"] for d in report["devices"].values()] == ["ISIC 2019"] * 7 + ["AtlasDerm", "Dermnet", "DarkDerm"]
    isic = load_image_records(os.path.join(sources[0], "isic2019"), "derm")
    written = sources[1]["isic2019"]["class_counts"]
    others = {c: n for c, n in written.items() if c not in DERM5_CLASSES}
    assert sum(others.values()) == 4  # 3 % of 120, rounded: the other ISIC classes, written to be dropped
    assert sum(d["images"] for d in list(report["devices"].values())[:7]) == 120 == len(isic) - 4
    sizes = [d["images"] for d in list(report["devices"].values())[:7]]
    assert max(sizes) - min(sizes) <= 1  # near-equal random shards
    assert report["skipped"]["ISIC 2019"]["dropped_classes"] == dict(sorted(others.items()))
    assert report["skipped"]["AtlasDerm"]["skipped_categories"] == ["Psoriasis", "Seborrheic Keratosis"]
    assert report["devices"]["site-8"]["images"] == source_sizes(120)["atlasderm"] == 30  # the floor
    # every ISIC image is on exactly one device
    seen = []
    for k in range(1, 8):
        for split in ("train", "val", "test"):
            seen += [os.path.basename(r.path).split("_", 1)[1] for r in load_device(out, f"site-{k}", split)]
    assert len(seen) == len(set(seen)) == 120


def test_split_is_stratified_60_20_20():
    recs = [ImageRecord(f"{c}_{i}.png", c) for c in range(5) for i in range(10 * (c + 1))]
    parts = split_device(recs, seed=3)
    for c in range(5):
        n = 10 * (c + 1)
        val, test = (sum(r.label == c for r in parts[s]) for s in ("val", "test"))
        assert val == test == round(0.2 * n) and sum(r.label == c for r in parts["train"]) == n - 2 * round(0.2 * n)
    small = split_device([ImageRecord(f"{i}", 0) for i in range(3)], seed=0)
    assert [len(small[s]) for s in ("train", "val", "test")] == [1, 1, 1]  # 3 images: one in each split


def test_images_have_the_short_edge_and_keep_the_aspect(devices):
    out, _ = devices
    path = load_device(out, "site-8", "train")[0].path
    w, h = Image.open(path).size
    assert min(w, h) == 16 and abs(w / h - 4 / 3) < 0.1  # written 32 x 24, now 21 x 16


def test_default_short_edge_is_72(sources, tmp_path):
    from fedssl.data.fedclf_devices import resize_short_edge

    path = load_image_records(os.path.join(sources[0], "isic2019"), "derm")[0].path
    assert resize_short_edge(path, 72, "site-1").size == (96, 72)


def test_deterministic_and_seeded(sources, devices, tmp_path):
    again = build_devices(str(tmp_path / "a"), *_roots(sources[0]), seed=0, short_edge=16)
    assert again["devices"] == devices[1]["devices"]
    other = build_devices(str(tmp_path / "b"), *_roots(sources[0]), seed=1, short_edge=16)
    assert other["devices"]["site-1"]["counts"] != devices[1]["devices"]["site-1"]["counts"]


def test_rerun_is_kept_and_other_settings_refused(sources, devices):
    out, report = devices
    assert build_devices(out, *_roots(sources[0]), seed=0, short_edge=16) == report
    with pytest.raises(ValueError, match="other settings"):
        build_devices(out, *_roots(sources[0]), seed=0, short_edge=72)


def test_class_tree_aliases_and_refusals(tmp_path):
    assert CATEGORY_ALIASES[normalise_category("Basal_Cell Carcinoma")] == "BCC"
    assert CATEGORY_ALIASES[normalise_category("melanocytic-nevi")] == "NV"
    (tmp_path / "empty").mkdir()
    with pytest.raises(ImageDataError, match="no category folder"):
        read_class_tree(str(tmp_path / "empty"), "Dermnet")
    (tmp_path / "other" / "Acne").mkdir(parents=True)
    with pytest.raises(ImageDataError, match="none of the five classes"):
        read_class_tree(str(tmp_path / "other"), "Dermnet")
    nested = tmp_path / "tree" / "Melanoma" / "sub"
    nested.mkdir(parents=True)
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(nested / "a.jpg")
    (nested / "notes.txt").write_text("x")
    recs, info = read_class_tree(str(tmp_path / "tree"), "DarkDerm")
    assert [r.label for r in recs] == [DERM5_CLASSES.index("MEL")] and info["non_images"] == 1


def test_corrupt_image_names_file_and_device(sources, tmp_path):
    import shutil

    raw = tmp_path / "raw"
    shutil.copytree(sources[0], raw)
    bad = sorted((raw / "darkderm" / "MEL").iterdir())[0]
    bad.write_bytes(b"not a jpeg")
    with pytest.raises(ImageDataError, match=rf"site-10.*cannot decode.*{bad.name}"):
        build_devices(str(tmp_path / "dev"), *_roots(str(raw)), seed=0, short_edge=16)


def test_devices_json_is_written(devices):
    out, report = devices
    with open(os.path.join(out, "devices.json")) as f:
        assert json.load(f) == report


def _border_luminance(path: str) -> float:
    a = np.asarray(Image.open(path).convert("RGB"), np.float32) / 255.0
    lum = a @ np.array([0.299, 0.587, 0.114], np.float32)
    return float(np.concatenate([lum[2], lum[-3], lum[:, 2], lum[:, -3]]).mean())


def test_sources_differ_in_skin_tone_and_acquisition(sources):
    out, _ = sources
    isic = load_image_records(os.path.join(out, "isic2019"), "derm")
    lum = {s: np.mean([_border_luminance(p) for p in _tree_paths(out, s)])
           for s in ("atlasderm", "dermnet", "darkderm")}
    isic_lum = np.mean([_border_luminance(r.path) for r in isic[:30]])
    assert isic_lum > lum["atlasderm"] > lum["darkderm"] and isic_lum > lum["dermnet"] > lum["darkderm"]
    # the dermoscope ring: black corners in ISIC images only (in those whose ring is small enough to show)
    dark_corner = lambda p: float(np.asarray(Image.open(p).convert("L"), np.float32)[0, 0]) < 0.05 * 255  # noqa: E731
    assert np.mean([dark_corner(r.path) for r in isic[:40]]) > 0.2
    assert not any(dark_corner(p) for s in ("atlasderm", "dermnet", "darkderm") for p in _tree_paths(out, s))
    assert ACQUISITION["darkderm"]["contrast"] < ACQUISITION["atlasderm"]["contrast"]


def _tree_paths(out, source):
    root = os.path.join(out, source)
    return [os.path.join(root, d, f) for d in sorted(os.listdir(root))
            for f in sorted(os.listdir(os.path.join(root, d)))]


def test_difficulty_lowers_the_lesion_contrast(tmp_path):
    from fedssl.data.fedclf_synthetic import render_source_image

    def spread(d):  # std of the image: skin vs lesion contrast (same draw, only the difficulty differs)
        return np.mean([render_source_image("isic2019", "MEL", 0, i, 32, d).std() for i in range(8)])

    assert spread(0.0) > spread(1.0) > spread(3.0)
    with pytest.raises(ValueError, match="difficulty=-1"):
        write_synthetic_derm_sources(str(tmp_path / "x"), n_isic=20, difficulty=-1)
