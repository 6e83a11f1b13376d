"""Tests for the SSL-FL image loaders, splits and dataset (fedssl.data.images) on the synthetic writers' output."""

from __future__ import annotations

import csv
import json
import os
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from fedssl.data.image_sites import write_site_folders
from fedssl.data.image_synthetic import write_synthetic_images
from fedssl.data.images import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    ImageDataError,
    ImageDataset,
    ImageRecord,
    batch_bounds,
    batches,
    class_histogram,
    class_names,
    load_image_records,
    melanoma_vs_benign,
    select_labelled,
    train_val_split,
)

SIZE = 32


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict]]:
    out = {}
    for ds, n in (("retina", 60), ("derm", 48)):
        root = tmp_path_factory.mktemp(ds)
        out[ds] = (root, write_synthetic_images(root, ds, n, seed=1, image_size=SIZE, n_sources=2))
    for ds, n in (("covidfl", 60), ("derm_mel", 24)):  # SSL-FL's release layout -> <class>/ site folders
        root = tmp_path_factory.mktemp(ds)
        info = write_synthetic_images(root / "full", ds, n, seed=1, image_size=SIZE, n_sources=3)
        write_site_folders(root / "full", ds, root / "parts", n_sites=None if ds == "covidfl" else 2, min_per_site=1)
        out[ds] = (root / "parts", info)
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def test_class_names():
    assert class_names("retina") == ["no_dr", "dr"]
    assert class_names("derm") == ["MEL", "NV", "BCC", "AK", "BKL", "DF", "VASC", "SCC"]
    assert class_names("covidfl") == ["covid", "pneumonia", "normal"]
    with pytest.raises(ValueError, match="retina"):
        class_names("cifar")


def test_retina_levels_are_binarised(data):
    root, info = data["retina"]
    recs = load_image_records(root, "retina", site="site-1")
    levels = {r[0]: int(r[1]) for r in list(csv.reader(open(root / "trainLabels.csv")))[1:]}
    assert len(recs) == 60 == len(levels)
    for r in recs:
        assert r.label == int(levels[Path(r.path).stem] > 0)
        assert os.path.isabs(r.path) and r.path.endswith(".jpeg")
    assert sum(r.label == 0 for r in recs) == info["class_counts"]["level_0"]
    assert {r.label for r in recs} == {0, 1}


def test_derm_one_hot_parsing(data):
    root, info = data["derm"]
    recs = load_image_records(root, "derm", site="site-2")
    hist = class_histogram(recs, 8)
    assert hist == [info["class_counts"][c] for c in class_names("derm")]
    assert hist[1] == max(hist)  # NV-dominated, like ISIC 2019
    assert all(r.path.endswith(".jpg") for r in recs)
    binary = melanoma_vs_benign(recs)
    assert [b.label for b in binary] == [int(r.label == 0) for r in recs]


def test_class_folder_sites_covidfl_and_derm_mel(data, tmp_path):
    """COVID-FL and SSL-FL's Derm sites are <class>/<image> folders; the record's label is its folder's class."""
    root, info = data["covidfl"]
    part = json.loads((root / "partition.json").read_text())
    assert part["site_map"]["site-1"] == "bimcv"  # clients in name order: bimcv, gz, rsna-0 .. rsna-4
    total = Counter()
    for site in list(part["sites"]) + ["test"]:
        recs = load_image_records(root / site, "covidfl", site=site)
        assert all(Path(r.path).parent.name == class_names("covidfl")[r.label] for r in recs)
        total.update(class_names("covidfl")[r.label] for r in recs)
    assert dict(total) == {k: v for k, v in info["class_counts"].items() if v}
    assert {r.label for r in load_image_records(root / "site-1", "covidfl")} == {0}  # like BIMCV: COVID-19 only
    mel_root, mel_info = data["derm_mel"]
    recs = [r for s in ("site-1", "site-2", "test") for r in load_image_records(mel_root / s, "derm_mel", site=s)]
    assert class_names("derm_mel") == ["benign", "melanoma"]
    assert Counter(class_names("derm_mel")[r.label] for r in recs) == Counter(mel_info["class_counts"])
    bad = _copy(mel_root / "site-1", tmp_path / "bad")
    (bad / "MEL").mkdir()
    with pytest.raises(ImageDataError, match=r"\[site site-9\] unknown derm_mel class folder 'MEL'"):
        load_image_records(bad, "derm_mel", site="site-9")


def _rewrite_csv(path: Path, edit) -> None:
    rows = list(csv.reader(open(path)))
    edit(rows)
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows)


def test_error_missing_csv_and_image(data, tmp_path):
    root = _copy(data["retina"][0], tmp_path / "r")
    os.remove(sorted(root.glob("train/*.jpeg"))[0])
    with pytest.raises(ImageDataError) as e:
        load_image_records(root, "retina", site="site-7")
    assert "[site site-7]" in str(e.value) and ".jpeg" in str(e.value) and "missing" in str(e.value)
    os.remove(root / "trainLabels.csv")
    with pytest.raises(ImageDataError, match=r"\[site site-7\].*trainLabels\.csv"):
        load_image_records(root, "retina", site="site-7")
    with pytest.raises(ImageDataError, match=r"\[site s\].*does not exist"):
        load_image_records(tmp_path / "nowhere", "derm", site="s")
    d = _copy(data["derm"][0], tmp_path / "d")
    os.remove(d / "ISIC_2019_Training_GroundTruth.csv")
    with pytest.raises(ImageDataError, match="ISIC_2019_Training_GroundTruth.csv"):
        load_image_records(d, "derm", site="s")


def test_error_unknown_level(data, tmp_path):
    root = _copy(data["retina"][0], tmp_path / "r")

    def bad(rows):
        rows[3][1] = "7"
    _rewrite_csv(root / "trainLabels.csv", bad)
    with pytest.raises(ImageDataError) as e:
        load_image_records(root, "retina", site="site-3")
    msg = str(e.value)
    assert "[site site-3]" in msg and "row 4" in msg and "'7'" in msg and "trainLabels.csv" in msg


@pytest.mark.parametrize("values, match", [
    (["0.0"] * 9, "exactly one 1.0"),
    (["1.0", "1.0"] + ["0.0"] * 7, "exactly one 1.0"),
    (["0.0"] * 8 + ["1.0"], "UNK is not used"),
    (["0.5", "0.5"] + ["0.0"] * 7, "exactly one 1.0"),
    (["x"] + ["0.0"] * 8, "non-numeric"),
])
def test_error_bad_one_hot_row(data, tmp_path, values, match):
    root = _copy(data["derm"][0], tmp_path / "d")
    image = []

    def bad(rows):
        image.append(rows[5][0])
        rows[5][1:] = values
    _rewrite_csv(root / "ISIC_2019_Training_GroundTruth.csv", bad)
    with pytest.raises(ImageDataError) as e:
        load_image_records(root, "derm", site="site-9")
    msg = str(e.value)
    assert "[site site-9]" in msg and "row 6" in msg and image[0] in msg
    assert "ISIC_2019_Training_GroundTruth.csv" in msg
    assert match.split(" is ")[0] in msg


def test_error_unknown_covidfl_class(data, tmp_path):
    root = _copy(data["covidfl"][0] / "site-3", tmp_path / "rsna")
    (root / "tuberculosis").mkdir()
    with pytest.raises(ImageDataError, match=r"\[site site-2\] unknown covidfl class folder 'tuberculosis'"):
        load_image_records(root, "covidfl", site="site-2")


def test_error_undecodable_image(data, tmp_path):
    root = _copy(data["retina"][0], tmp_path / "r")
    recs = load_image_records(root, "retina", site="site-4")
    Path(recs[2].path).write_bytes(b"not a jpeg")
    ds = ImageDataset(recs, SIZE, "eval", "retina", site="site-4")
    ds[0]
    with pytest.raises(ImageDataError) as e:
        ds[2]
    assert "[site site-4]" in str(e.value) and recs[2].path in str(e.value) and "decode" in str(e.value)


def _recs(counts: dict[int, int]) -> list[ImageRecord]:
    return [ImageRecord(f"/x/{c}_{i:04d}.png", c) for c, n in counts.items() for i in range(n)]


def test_train_val_split_stratified_deterministic():
    recs = _recs({0: 73, 1: 27, 2: 1})
    tr, va = train_val_split(recs, 0.2, seed=5)
    assert sorted(tr + va, key=lambda r: r.path) == sorted(recs, key=lambda r: r.path)
    assert not set(tr) & set(va)
    assert class_histogram(va, 3) == [15, 5, 0]  # round(0.2 * n_c); the singleton class stays in train
    assert class_histogram(tr, 3) == [58, 22, 1]
    assert train_val_split(list(reversed(recs)), 0.2, seed=5) == (tr, va)  # order-free
    assert train_val_split(recs, 0.2, seed=6)[1] != va
    assert train_val_split(recs, 0.0, seed=0)[1] == []
    with pytest.raises(ValueError, match="val_fraction"):
        train_val_split(recs, 1.0, seed=0)


@pytest.mark.parametrize("fraction, expected", [(0.1, [73, 27, 1]), (0.3, [219, 81, 3]), (0.7, [511, 189, 7]),
                                                (1.0, [730, 270, 10])])
def test_select_labelled_fractions(fraction, expected):
    recs = _recs({0: 730, 1: 270, 2: 10})
    sel = select_labelled(recs, fraction, seed=0)
    assert class_histogram(sel, 3) == expected
    assert select_labelled(recs, fraction, seed=0) == sel
    assert set(sel) <= set(recs)


def test_select_labelled_keeps_every_class_and_nests_nothing_wrong():
    recs = _recs({0: 30, 1: 3, 2: 1})
    assert class_histogram(select_labelled(recs, 0.1, seed=1), 3) == [3, 1, 1]
    assert select_labelled(recs, 0.1, seed=1) != select_labelled(recs, 0.1, seed=2)
    with pytest.raises(ValueError, match="fraction"):
        select_labelled(recs, 0.0, seed=0)


@pytest.mark.parametrize("ds", ["retina", "derm", "covidfl"])
@pytest.mark.parametrize("mode", ["pretrain", "finetune", "eval"])
def test_dataset_shapes_and_normalisation(data, ds, mode):
    root, _ = data[ds]
    recs = load_image_records(root / "site-3" if ds == "covidfl" else root, ds, site="s")[:6]
    d = ImageDataset(recs, 16, mode, ds, site="s", seed=3)
    x, y = d[1]
    assert x.shape == (3, 16, 16) and x.dtype == torch.float32
    assert y == recs[1].label
    mean, std = torch.tensor(IMAGENET_MEAN).view(3, 1, 1), torch.tensor(IMAGENET_STD).view(3, 1, 1)
    pix = x * std + mean  # undo ImageNet normalisation -> [0, 1]
    assert pix.min() >= -1e-5 and pix.max() <= 1 + 1e-5
    assert pix.std() > 0.02  # an image, not a constant
    again, _ = d[1]
    assert torch.equal(x, again)  # same (seed, epoch, index) -> same item
    if mode != "eval":
        d.set_epoch(1)
        assert not torch.equal(d[1][0], x)
        other = ImageDataset(recs, 16, mode, ds, site="s", seed=4)
        assert not torch.equal(other[1][0], x)
    else:
        d.set_epoch(5)
        assert torch.equal(d[1][0], x)


def test_eval_is_resize_and_centre_crop(data):
    from PIL import Image

    recs = load_image_records(data["retina"][0], "retina")[:1]
    d = ImageDataset(recs, 28, "eval", "retina")
    raw = d.raw(0)
    assert min(raw.shape[:2]) == 32  # ceil(28 / 0.875)
    x, _ = d[0]
    pix = x * torch.tensor(IMAGENET_STD).view(3, 1, 1) + torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
    h, w = raw.shape[:2]
    crop = torch.from_numpy(raw[(h - 28) // 2:(h - 28) // 2 + 28, (w - 28) // 2:(w - 28) // 2 + 28]).permute(2, 0, 1)
    assert torch.allclose(pix, crop.float() / 255, atol=1e-5)
    with Image.open(recs[0].path) as im:
        assert im.size[0] > im.size[1]  # 5:4 fundus frame: aspect kept by the resize


def test_finetune_crop_scales_covidfl_zooms_out(data):
    recs = load_image_records(data["covidfl"][0] / "site-3", "covidfl")[:1]
    g = np.random.default_rng(0)
    cov = ImageDataset(recs, 16, "finetune", "covidfl")
    areas = [cov._crop_box(40, 40, (0.8, 1.2), g) for _ in range(400)]
    frac = np.array([ch * cw / 1600 for _, _, ch, cw in areas])
    assert frac.min() >= 0.8 - 1e-9 and frac.max() <= 1.2 + 1e-9
    assert (frac > 1.0).mean() > 0.3  # zoom-out boxes, larger than the image
    big = [(t, left) for (t, left, ch, cw), f in zip(areas, frac) if f > 1.0 and cw > 40]
    assert big and all(left <= 0 for _, left in big)  # the image lies inside a zoomed-out box
    ret = ImageDataset(recs, 16, "finetune", "retina")
    boxes = [ret._crop_box(40, 50, (0.6, 1.0), g) for _ in range(400)]
    assert all(0 <= t and 0 <= left and t + ch <= 40 + 1e-6 and left + cw <= 50 + 1e-6 for t, left, ch, cw in boxes)
    assert min(ch * cw for _, _, ch, cw in boxes) >= 0.6 * 2000 - 1e-6


def test_cache_decodes_once(data, monkeypatch):
    from fedssl.data import images

    recs = load_image_records(data["derm"][0], "derm")[:5]
    calls = []
    real = images._decode
    monkeypatch.setattr(images, "_decode", lambda *a: calls.append(a[0]) or real(*a))
    monkeypatch.setattr(images, "_SHARED", images.OrderedDict())
    monkeypatch.setattr(images, "_SHARED_BYTES", [0])
    d = ImageDataset(recs, 16, "pretrain", "derm", cache=True)
    for e in range(3):
        d.set_epoch(e)
        [d[i] for i in range(5)]
    assert len(calls) == 5 and d.cached() == 5
    # a second dataset over the same files (e.g. fine-tuning after pre-training) reuses the decoded images
    ft = ImageDataset(recs, 16, "finetune", "derm", cache=True)
    [ft[i] for i in range(5)]
    assert len(calls) == 5
    ImageDataset(recs, 24, "eval", "derm")[0]  # another size: decoded again
    assert len(calls) == 6
    nc = ImageDataset(recs, 16, "pretrain", "derm", cache=False)
    [nc[i] for i in range(5)]
    [nc[i] for i in range(5)]
    assert len(calls) == 16 and nc.cached() == 0
    nc.set_epoch(2), d.set_epoch(2)
    assert torch.equal(nc[3][0], d[3][0])
    # the shared cache is bounded
    monkeypatch.setattr(images, "SHARED_CACHE_BYTES", 2 * d.raw(0).nbytes + 10)
    monkeypatch.setattr(images, "_SHARED", images.OrderedDict())
    monkeypatch.setattr(images, "_SHARED_BYTES", [0])
    small = ImageDataset(recs, 16, "eval", "derm")
    [small[i] for i in range(5)]
    assert len(images._SHARED) <= 2 and images._SHARED_BYTES[0] <= images.SHARED_CACHE_BYTES


def test_batches_shuffle_per_epoch_and_cover_everything(data):
    recs = load_image_records(data["retina"][0], "retina")[:10]
    d = ImageDataset(recs, 16, "finetune", "retina")
    b0 = list(batches(d, 4, seed=0, epoch=0))
    assert [len(y) for _, y in b0] == [4, 4, 2] and b0[0][0].shape == (4, 3, 16, 16)
    assert sorted(torch.cat([y for _, y in b0]).tolist()) == sorted(r.label for r in recs)
    again = list(batches(d, 4, seed=0, epoch=0))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(b0, again))
    assert [len(y) for _, y in batches(d, 4, seed=0, epoch=1, drop_last=True)] == [4, 4]
    x0 = torch.cat([x for x, _ in b0])
    x1 = torch.cat([x for x, _ in batches(d, 4, seed=0, epoch=1)])
    assert not torch.equal(x0, x1)
    with pytest.raises(ValueError, match="batch_size"):
        next(batches(d, 0, seed=0, epoch=0))
    # a last batch of one image joins the one before it (BatchNorm cannot train on one 1 x 1 feature map)
    folded = list(batches(d, 3, seed=0, epoch=0, fold_single=True))
    assert [len(y) for _, y in folded] == [3, 3, 4]
    assert sorted(torch.cat([y for _, y in folded]).tolist()) == sorted(r.label for r in recs)
    assert [len(y) for _, y in batches(d, 4, seed=0, epoch=0, fold_single=True)] == [4, 4, 2]


def test_batch_bounds_by_hand():
    assert batch_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert batch_bounds(9, 4, fold_single=True) == [(0, 4), (4, 9)]
    assert batch_bounds(9, 4) == [(0, 4), (4, 8), (8, 9)]
    assert batch_bounds(1, 4, fold_single=True) == [(0, 1)]  # nothing to join: one batch of one
    assert batch_bounds(9, 4, drop_last=True, fold_single=True) == [(0, 4), (4, 8)]


def test_a_decompression_bomb_names_the_file_and_the_site(tmp_path, monkeypatch):
    """Issue 45: PIL's DecompressionBombError is not an OSError and escaped the loaders unnamed."""
    from PIL import Image

    from fedssl.data import images as images_module
    from fedssl.data.fedclf_devices import resize_short_edge

    path = str(tmp_path / "bomb.png")
    Image.new("RGB", (40, 40)).save(path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # 1,600 pixels > 2 x 100: PIL raises, as for a real bomb
    with pytest.raises(ImageDataError, match=r"\[site site-2\].*DecompressionBombError.*bomb\.png"):
        images_module._decode(path, 32, "site-2")
    with pytest.raises(ImageDataError, match=r"\[site site-2\].*DecompressionBombError.*bomb\.png"):
        resize_short_edge(path, 32, "site-2")
