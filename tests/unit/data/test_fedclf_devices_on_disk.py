"""FedCLF's device layer ("Federated Self-Supervised Learning for Dermatological Disease Diagnosis", sec. V-A):
the ``derm5`` class-folder reader (fedssl.data.images) and the 10 devices written by
fedssl.data.fedclf_devices.build_devices from the four raw sources (ISIC 2019's CSV layout and the AtlasDerm /
Dermnet / DarkDerm class trees), checked on disk: ISIC shards, the other sources' devices, the stratified 60/20/20
split, the shorter edge, no image on two devices, determinism, re-runs and the refusals.

Complements tests/unit/data/test_fedclf_devices.py (which checks the report); everything here reads the files."""

from __future__ import annotations

import csv
import hashlib
import os
import re
import shutil
from collections import Counter

import numpy as np
import pytest
import torch
from PIL import Image

from fedssl.data.fedclf_devices import (
    CATEGORY_ALIASES,
    ISIC_FIVE_CLASS_COUNTS,
    PAPER_SOURCE_SIZES,
    SPLITS,
    build_devices,
    load_device,
    normalise_category,
    resize_short_edge,
)
from fedssl.data.fedclf_synthetic import FOLDERS, OTHER_FOLDERS, write_synthetic_derm_sources
from fedssl.data.images import (
    DATASETS,
    DERM5_CLASSES,
    DERM_CSV,
    DERM_DIR,
    FINETUNE_SCALE,
    ISIC_COLUMNS,
    PRETRAIN_SCALE,
    ImageDataError,
    class_names,
    load_image_records,
)
from tests.unit.data.files import tree_digests

torch.set_num_threads(1)  # fedssl.data.images imports torch; one thread on the shared CPU

SOURCES = ("isic2019", "atlasderm", "dermnet", "darkderm")
TREE_SITES = {"site-8": "atlasderm", "site-9": "dermnet", "site-10": "darkderm"}
SITES = [f"site-{k}" for k in range(1, 11)]
EDGE = 16


def _roots(raw) -> list[str]:
    return [os.path.join(str(raw), s) for s in SOURCES]


def _png(path, w: int, h: int, value: int = 128) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.fromarray(np.full((h, w, 3), value, np.uint8)).save(path)


def _stem(path: str) -> str:
    """The source image's stem of a written device file (``<index>_<stem>.png``)."""
    return os.path.splitext(os.path.basename(path))[0].split("_", 1)[1]


def _device_records(out: str, site: str) -> dict[str, list]:
    return {s: load_device(out, site, s) for s in SPLITS}


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    out = tmp_path_factory.mktemp("raw")
    write_synthetic_derm_sources(str(out), n_isic=60, seed=0, image_size=24)
    return out


@pytest.fixture(scope="module")
def built(raw, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("dev") / "devices")
    return out, build_devices(out, *_roots(raw), seed=0, short_edge=EDGE)


def _isic_classes(raw) -> dict[str, str]:
    """ISIC image id -> class name, from the ground-truth CSV."""
    with open(os.path.join(str(raw), "isic2019", DERM_CSV)) as f:
        rows = list(csv.reader(f))[1:]
    return {r[0]: ISIC_COLUMNS[[float(v) for v in r[1:]].index(1.0)] for r in rows}


# ---------------------------------------------------------------------------------------------------- derm5 reader


def test_derm5_is_a_dataset_kind_with_the_five_classes():
    assert "derm5" in DATASETS
    assert class_names("derm5") == DERM5_CLASSES == ["BCC", "DF", "MEL", "NV", "SCC"]
    assert "derm5" in PRETRAIN_SCALE and "derm5" in FINETUNE_SCALE


def test_derm5_reader_labels_by_folder_case_insensitive(tmp_path):
    for folder in ("bcc", "DF", "Mel", "nv", "SCC"):
        _png(tmp_path / folder / f"{folder}_a.png", 10, 8)
    recs = load_image_records(str(tmp_path), "derm5", site="site-3")
    assert sorted((os.path.basename(os.path.dirname(r.path)).upper(), r.label) for r in recs) == \
        [(c, i) for i, c in enumerate(DERM5_CLASSES)]


@pytest.mark.parametrize("folder", ["melanoma", "AK", "Basal Cell Carcinoma"])
def test_derm5_reader_refuses_other_folders(tmp_path, folder):
    _png(tmp_path / "MEL" / "a.png", 8, 8)
    _png(tmp_path / folder / "b.png", 8, 8)
    with pytest.raises(ImageDataError, match=rf"unknown derm5 class folder '{folder}'"):
        load_image_records(str(tmp_path), "derm5", site="site-1")


# ---------------------------------------------------------------------------------------------------- the devices


def test_paper_sizes_and_isic_five_class_counts():
    assert PAPER_SOURCE_SIZES == {"ISIC 2019": 21587, "AtlasDerm": 618, "Dermnet": 276, "DarkDerm": 216}
    assert ISIC_FIVE_CLASS_COUNTS == {"MEL": 4522, "NV": 12875, "BCC": 3323, "DF": 239, "SCC": 628}
    assert sum(ISIC_FIVE_CLASS_COUNTS.values()) == 21587  # the paper's "a subset with about 21k images"


def test_ten_device_folders_each_read_as_derm5(built):
    out, report = built
    assert sorted(d for d in os.listdir(out) if d != "devices.json") == sorted(SITES)
    for site in SITES:
        assert sorted(os.listdir(os.path.join(out, site))) == sorted(SPLITS)
        assert sum(len(v) for v in _device_records(out, site).values()) == report["devices"][site]["images"]


def test_isic_devices_are_disjoint_shards_of_all_five_class_images(raw, built):
    out, report = built
    truth = _isic_classes(raw)
    five = {i for i, c in truth.items() if c in DERM5_CLASSES}
    shards = []
    for site in SITES[:7]:
        recs = [r for rs in _device_records(out, site).values() for r in rs]
        shards.append({_stem(r.path) for r in recs})
        assert len(shards[-1]) == len(recs)
        assert all(DERM5_CLASSES[r.label] == truth[_stem(r.path)] for r in recs)  # labels kept through the shard
    assert sum(len(s) for s in shards) == len(set().union(*shards))  # disjoint
    assert set().union(*shards) == five  # all five-class ISIC images, nothing else
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    dropped = Counter(c for c in truth.values() if c not in DERM5_CLASSES)
    assert dropped and report["skipped"]["ISIC 2019"]["dropped_classes"] == dict(dropped)


def test_tree_devices_hold_exactly_their_sources_five_class_images(raw, built):
    out, report = built
    for site, source in TREE_SITES.items():
        expected = Counter()
        for cls, folder in FOLDERS[source].items():
            expected.update((cls, os.path.splitext(f)[0]) for f in os.listdir(os.path.join(str(raw), source, folder)))
        got = Counter((DERM5_CLASSES[r.label], _stem(r.path))
                      for rs in _device_records(out, site).values() for r in rs)
        assert got == expected
    skipped = {s: report["skipped"][s]["skipped_categories"] for s in ("AtlasDerm", "Dermnet", "DarkDerm")}
    assert skipped == {"AtlasDerm": sorted(OTHER_FOLDERS["atlasderm"]), "Dermnet": sorted(OTHER_FOLDERS["dermnet"]),
                       "DarkDerm": []}


def _expected_split(n: int) -> tuple[int, int, int]:
    """(train, val, test) of a class of ``n`` images: round-half-up 20 % each to val and test, >= 1 when n >= 3."""
    v = int(np.floor(0.2 * n + 0.5))
    if n >= 3:
        v = max(v, 1)
    v = min(v, n)
    t = min(v, n - v)
    return n - v - t, v, t


def test_every_device_is_split_60_20_20_per_class(built):
    out, report = built
    for site in SITES:
        recs = _device_records(out, site)
        n_total = sum(len(v) for v in recs.values())
        for c, name in enumerate(DERM5_CLASSES):
            per_split = tuple(sum(r.label == c for r in recs[s]) for s in SPLITS)
            assert per_split == _expected_split(sum(per_split)), (site, name, per_split)
            assert per_split == tuple(report["devices"][site]["counts"][s][name] for s in SPLITS)
        if n_total >= 30:  # rounding per class moves at most one image per class
            assert abs(len(recs["train"]) - 0.6 * n_total) <= len(DERM5_CLASSES)
            assert abs(len(recs["val"]) - 0.2 * n_total) <= len(DERM5_CLASSES) / 2 + 0.5


def test_no_image_is_on_two_devices(built):
    out, _ = built
    owner: dict[str, str] = {}
    for site in SITES:
        for split in SPLITS:
            for r in load_device(out, site, split):
                with open(r.path, "rb") as f:
                    digest = hashlib.md5(f.read()).hexdigest()
                assert owner.setdefault(digest, site) == site, f"{r.path} also on {owner[digest]}"
                assert owner.setdefault("name:" + _stem(r.path), site) == site


def test_written_images_have_the_short_edge_and_keep_the_aspect(raw, built):
    out, _ = built
    src_w, src_h = Image.open(load_image_records(os.path.join(str(raw), "isic2019"), "derm")[0].path).size
    for site in SITES:
        for r in load_device(out, site, "train"):
            with Image.open(r.path) as im:
                assert im.format == "PNG" and im.mode == "RGB"
                w, h = im.size
            assert h == EDGE and abs(w - src_w * EDGE / src_h) <= 1


def test_resize_short_edge_portrait_and_landscape(tmp_path):
    for (w, h), expected in {(30, 50): (72, 120), (61, 37): (119, 72), (72, 72): (72, 72)}.items():
        _png(tmp_path / f"{w}x{h}.png", w, h)
        assert resize_short_edge(str(tmp_path / f"{w}x{h}.png"), 72, "site-1").size == expected


def _tiny_sources(root, sizes, n_isic: int = 21) -> list[str]:
    """Hand-made raw sources: ``n_isic`` NV images (21: three per shard, one per split) plus one image per tree,
    of the given sizes."""
    isic = os.path.join(str(root), "isic")
    rows = []
    for i in range(n_isic):
        _png(os.path.join(isic, DERM_DIR, f"ISIC_{i}.jpg"), *sizes[i % len(sizes)])
        rows.append([f"ISIC_{i}"] + ["1.0" if c == "NV" else "0.0" for c in ISIC_COLUMNS])
    with open(os.path.join(isic, DERM_CSV), "w", newline="") as f:
        csv.writer(f).writerows([["image", *ISIC_COLUMNS], *rows])
    roots = [isic]
    for k, name in enumerate(("atlas", "dermnet", "dark")):
        _png(os.path.join(str(root), name, "Melanoma", f"{name}.png"), *sizes[k % len(sizes)])
        roots.append(os.path.join(str(root), name))
    return roots


def test_default_short_edge_is_72_on_a_tiny_build(tmp_path):
    sizes = [(40, 30), (25, 60), (61, 37)]
    roots = _tiny_sources(tmp_path / "raw", sizes)
    source_size = {f"ISIC_{i}": sizes[i % 3] for i in range(21)}
    source_size.update({name: sizes[k] for k, name in enumerate(("atlas", "dermnet", "dark"))})
    report = build_devices(str(tmp_path / "dev"), *roots)
    assert report["settings"]["short_edge"] == 72
    written = [r.path for site in SITES for r in load_device(str(tmp_path / "dev"), site, "train")]
    assert len(written) == 10
    for path in written:
        (w, h), (sw, sh) = Image.open(path).size, source_size[_stem(path)]
        assert min(w, h) == 72 and abs(max(w, h) - max(sw, sh) * 72 / min(sw, sh)) <= 1, (path, w, h)


def test_same_seed_same_files_and_bytes_other_seed_other_shards(raw, built, tmp_path):
    out, _ = built
    again = str(tmp_path / "again")
    build_devices(again, *_roots(raw), seed=0, short_edge=EDGE)
    assert tree_digests(again) == tree_digests(out)  # same file lists, same bytes (devices.json included)
    other = str(tmp_path / "other")
    build_devices(other, *_roots(raw), seed=1, short_edge=EDGE)
    shard = lambda root: {_stem(r.path) for s in SPLITS for r in load_device(root, "site-1", s)}  # noqa: E731
    assert shard(other) != shard(out)


def test_rerun_is_a_noop_and_other_settings_are_refused(raw, built):
    out, report = built
    before = {p: os.stat(os.path.join(out, p)).st_mtime_ns for p in tree_digests(out)}
    assert build_devices(out, *_roots(raw), seed=0, short_edge=EDGE) == report
    assert {p: os.stat(os.path.join(out, p)).st_mtime_ns for p in tree_digests(out)} == before
    for change in ({"seed": 1}, {"short_edge": 72}, {"fractions": (0.8, 0.1, 0.1)}):
        kwargs = {"seed": 0, "short_edge": EDGE, **change}
        with pytest.raises(ValueError, match="other settings"):
            build_devices(out, *_roots(raw), **kwargs)


def test_too_few_isic_images_for_seven_devices_are_refused(tmp_path):
    roots = _tiny_sources(tmp_path / "raw", [(40, 30)], n_isic=20)
    with pytest.raises(ImageDataError, match="20 images of the five classes.*at least 21"):
        build_devices(str(tmp_path / "dev"), *roots)
    assert not os.path.exists(tmp_path / "dev")


def test_a_build_that_stopped_leaves_nothing_and_the_next_one_completes(tmp_path):
    roots = _tiny_sources(tmp_path / "raw", [(40, 30)])
    bad = os.path.join(roots[3], "Melanoma", "dark.png")
    good = open(bad, "rb").read()
    with open(bad, "wb") as f:
        f.write(b"not an image")
    with pytest.raises(ImageDataError, match="site-10.*cannot decode"):
        build_devices(str(tmp_path / "dev"), *roots)
    assert not os.path.exists(tmp_path / "dev")  # the partial build never became the device folder
    with open(bad, "wb") as f:
        f.write(good)
    report = build_devices(str(tmp_path / "dev"), *roots)
    assert len(report["devices"]) == 10 and not os.path.exists(str(tmp_path / "dev") + ".partial")


def test_moved_sources_do_not_invalidate_a_finished_build(raw, built, tmp_path):
    import shutil

    out, report = built
    moved = tmp_path / "moved"
    shutil.copytree(raw, moved)
    assert build_devices(out, *_roots(str(moved)), seed=0, short_edge=EDGE)["devices"] == report["devices"]
    with pytest.raises(ValueError, match="seed=-1"):
        build_devices(str(tmp_path / "x"), *_roots(raw), seed=-1)


def test_a_non_empty_folder_without_report_is_refused(raw, tmp_path):
    (tmp_path / "dev" / "site-1").mkdir(parents=True)
    with pytest.raises(ValueError, match="not empty"):
        build_devices(str(tmp_path / "dev"), *_roots(raw), short_edge=EDGE)


def test_corrupt_isic_image_names_the_file_and_its_device(raw, built, tmp_path):
    out, _ = built
    copy = tmp_path / "raw"
    shutil.copytree(str(raw), copy)
    victim = load_device(out, "site-4", "train")[0]
    bad = copy / "isic2019" / DERM_DIR / f"{_stem(victim.path)}.jpg"
    bad.write_bytes(b"\xff\xd8 truncated")
    with pytest.raises(ImageDataError, match=rf"site-4\b.*{re.escape(bad.name)}"):
        build_devices(str(tmp_path / "dev"), *_roots(copy), short_edge=EDGE)


def test_source_roots_in_other_layouts_are_refused(raw, tmp_path):
    roots = _roots(raw)
    (tmp_path / "flat").mkdir()
    _png(tmp_path / "flat" / "a.jpg", 8, 8)  # images but no category folder
    for k, bad, message in [(3, tmp_path / "missing", "does not exist"), (1, tmp_path / "flat", "no category folder"),
                            (2, roots[0], "none of the five classes"), (0, roots[1], re.escape(DERM_CSV))]:
        args = list(roots)
        args[k] = str(bad)
        with pytest.raises(ImageDataError, match=message) as err:
            build_devices(str(tmp_path / f"dev{k}"), *args, short_edge=EDGE)
        assert str(bad) in str(err.value)


@pytest.mark.parametrize("name,cls", [
    ("basal cell carcinoma", "BCC"), ("BCC", "BCC"), ("basal_cell_carcinoma", "BCC"), ("Basal-Cell Carcinoma", "BCC"),
    ("dermatofibroma", "DF"), ("df", "DF"), ("melanoma", "MEL"), ("Malignant Melanoma", "MEL"), ("mel", "MEL"),
    ("melanocytic nevus", "NV"), ("Melanocytic Nevi", "NV"), ("nevus", "NV"), ("nevi", "NV"), ("NV", "NV"),
    ("squamous cell carcinoma", "SCC"), ("SCC", "SCC"), ("Psoriasis", None), ("Seborrheic Keratosis", None),
    ("actinic keratosis", None)])
def test_category_alias_table(name, cls):
    assert CATEGORY_ALIASES.get(normalise_category(name)) == cls


def test_nested_folders_read_and_non_images_counted(raw, tmp_path):
    copy = tmp_path / "raw"
    shutil.copytree(str(raw), copy)
    mel = copy / "dermnet" / FOLDERS["dermnet"]["MEL"]
    first = sorted(mel.iterdir())[0]
    for sub in ("a", "b/c"):  # same file name in two subfolders: both are images of the device
        (mel / sub).mkdir(parents=True)
        shutil.copy(first, mel / sub / "same.jpg")
    (mel / "notes.txt").write_text("not an image")
    (mel / "b" / "index.html").write_text("<html/>")
    out = str(tmp_path / "dev")
    report = build_devices(out, *_roots(copy), short_edge=EDGE)
    assert report["skipped"]["Dermnet"]["non_images"] == 2
    stems = [_stem(r.path) for s in SPLITS for r in load_device(out, "site-9", s)]
    assert stems.count("same") == 2 and report["devices"]["site-9"]["images"] == len(stems)


def test_argument_checks_name_the_argument(raw, built, tmp_path):
    for kwargs, name in [({"short_edge": 0}, "short_edge=0"), ({"short_edge": 7.5}, "short_edge=7.5"),
                         ({"fractions": (0.6, 0.3, 0.2)}, "fractions="), ({"fractions": (0.5, 0.5)}, "fractions=")]:
        with pytest.raises(ValueError, match=re.escape(name)):
            build_devices(str(tmp_path / "x"), *_roots(raw), **kwargs)
    with pytest.raises(ValueError, match="split='training'"):
        load_device(built[0], "site-1", "training")
