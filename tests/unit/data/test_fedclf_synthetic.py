"""The synthetic stand-ins for FedCLF's four dermatology sources (fedssl.data.fedclf_synthetic; "Federated
Self-Supervised Learning for Dermatological Disease Diagnosis", sec. V-A), measured on the written files: the ISIC
2019 class mix, the sources' sizes and floor, the category folders, skin tone and acquisition per source, the
difficulty knob, determinism and the argument checks."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
import torch
from PIL import Image

from fedssl.data.fedclf_devices import CATEGORY_ALIASES, PAPER_SOURCE_SIZES, normalise_category
from fedssl.data.fedclf_synthetic import (
    DERM5_DIFFICULTY,
    FOLDERS,
    MIN_SOURCE_IMAGES,
    OTHER_FOLDERS,
    SOURCES,
    render_source_image,
    source_sizes,
    write_synthetic_derm_sources,
)
from fedssl.data.images import DERM5_CLASSES, DERM_CLASSES, load_image_records
from tests.unit.data.files import tree_digests

torch.set_num_threads(1)  # fedssl.data.images imports torch; one thread on the shared CPU

LUMA = np.array([0.299, 0.587, 0.114], np.float32)
TREES = ("atlasderm", "dermnet", "darkderm")
#: the five classes' counts in the ISIC 2019 training ground truth (the paper's ~21k five-class subset)
ISIC_2019 = {"MEL": 4522, "NV": 12875, "BCC": 3323, "DF": 239, "SCC": 628}
N_ISIC = 200


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    out = tmp_path_factory.mktemp("raw")
    return str(out), write_synthetic_derm_sources(str(out), n_isic=N_ISIC, seed=0, image_size=24)


def _tree_images(out: str, source: str, only_five: bool = True) -> list[str]:
    root = os.path.join(out, source)
    folders = FOLDERS[source].values() if only_five else os.listdir(root)
    return sorted(os.path.join(root, d, f) for d in folders for f in os.listdir(os.path.join(root, d)))


def _isic_images(out: str) -> list[str]:
    return [r.path for r in load_image_records(os.path.join(out, "isic2019"), "derm")
            if DERM_CLASSES[r.label] in DERM5_CLASSES]


def _luma(path: str) -> np.ndarray:
    with Image.open(path) as im:
        return (np.asarray(im.convert("RGB"), np.float32) / 255.0) @ LUMA


def _box(a: np.ndarray, k: int) -> np.ndarray:
    """Mean over a k x k window (reflected edges)."""
    p = np.pad(a, k // 2, mode="reflect")
    c = np.cumsum(np.cumsum(np.pad(p, ((1, 0), (1, 0))), 0), 1)
    return (c[k:, k:] - c[:-k, k:] - c[k:, :-k] + c[:-k, :-k]) / (k * k)


# ---------------------------------------------------------------------------------------------------- counts


def test_isic_class_counts_follow_the_isic_2019_mix(raw):
    out, info = raw
    counts = info["isic2019"]["class_counts"]
    total = sum(ISIC_2019.values())
    floored = sum(3 - int(N_ISIC * n / total) for n in ISIC_2019.values() if N_ISIC * n / total < 3)
    for cls, n_paper in ISIC_2019.items():
        target = N_ISIC * n_paper / total
        if target < 3:  # a floor of 3 images per class (one in each split), taken from the largest class
            assert counts[cls] == 3, (cls, counts[cls])
        else:
            assert abs(counts[cls] - target) <= 1 + (floored if cls == "NV" else 0), (cls, counts[cls], target)
    assert sum(counts[c] for c in DERM5_CLASSES) == N_ISIC
    others = {c: n for c, n in counts.items() if c not in DERM5_CLASSES}
    assert set(others) == {"AK", "BKL", "VASC"} and 3 <= sum(others.values()) <= 0.1 * N_ISIC
    on_disk = load_image_records(os.path.join(out, "isic2019"), "derm")  # the CSV agrees with the report
    assert {DERM_CLASSES[c]: n for c, n in zip(*np.unique([r.label for r in on_disk], return_counts=True))} == counts


def test_source_sizes_follow_the_paper_with_a_floor():
    assert source_sizes(PAPER_SOURCE_SIZES["ISIC 2019"]) == {
        "isic2019": 21587, "atlasderm": 618, "dermnet": 276, "darkderm": 216}
    assert source_sizes(5000) == {"isic2019": 5000, "atlasderm": 143, "dermnet": 64, "darkderm": 50}
    assert source_sizes(200) == {"isic2019": 200, **dict.fromkeys(TREES, MIN_SOURCE_IMAGES)}
    sizes = source_sizes(20000)
    assert sizes["atlasderm"] > sizes["dermnet"] > sizes["darkderm"] > MIN_SOURCE_IMAGES


def test_trees_have_their_sizes_every_class_and_skippable_folders(raw):
    out, info = raw
    for source in TREES:
        folders = set(os.listdir(os.path.join(out, source)))
        assert folders == set(FOLDERS[source].values()) | set(OTHER_FOLDERS[source])
        five, others = {}, 0
        for f in folders:
            cls, n = CATEGORY_ALIASES.get(normalise_category(f)), len(os.listdir(os.path.join(out, source, f)))
            if cls is None:
                others += n
            else:
                five[cls] = five.get(cls, 0) + n
        assert sorted(five) == DERM5_CLASSES and min(five.values()) >= 3  # every class in every split
        assert sum(five.values()) == source_sizes(N_ISIC)[source]
        assert others == 3 * len(OTHER_FOLDERS[source])
        assert info[source]["class_counts"] == {f: len(os.listdir(os.path.join(out, source, f))) for f in folders}
    assert any(" " in f for f in FOLDERS["atlasderm"].values())  # human-readable category names


# ---------------------------------------------------------------------------------------------------- appearance


def _skin(path: str) -> float:
    """Mean luminance of the middle half of the four image edges (skin; away from the dermoscope's corners)."""
    a = _luma(path)
    h, w = a.shape
    return float(np.concatenate([a[1, w // 4:-w // 4], a[-2, w // 4:-w // 4],
                                 a[h // 4:-h // 4, 1], a[h // 4:-h // 4, -2]]).mean())


def test_skin_tone_is_darker_outside_isic_and_darkest_in_darkderm(raw):
    out, _ = raw
    skin = {"isic2019": np.mean([_skin(p) for p in _isic_images(out)[:60]]),
            **{s: np.mean([_skin(p) for p in _tree_images(out, s)]) for s in TREES}}
    assert skin["isic2019"] > max(skin["atlasderm"], skin["dermnet"]) + 0.05
    assert min(skin["atlasderm"], skin["dermnet"]) > skin["darkderm"] + 0.05


def test_dermoscope_ring_only_in_isic(raw):
    out, _ = raw

    def corner(path):  # the darkest corner over the skin around it (1: no ring)
        a = _luma(path)
        return min(a[0, 0], a[0, -1], a[-1, 0], a[-1, -1]) / max(_skin(path), 1e-3)

    isic = [corner(p) for p in _isic_images(out)[:60]]
    assert np.mean(np.array(isic) < 0.1) > 0.15  # the ring's radius varies: it blacks the corners of some views
    assert min(corner(p) for s in TREES for p in _tree_images(out, s, only_five=False)) > 0.3


def _lesion(source: str, cls: str, index: int, size: int = 40, difficulty: float = 0.0):
    """(lesion mask, image luminance): the mask is where the image at difficulty 0 is 20 % darker than its local
    background (31 px window), so it is the lesion whatever the lighting ramp; the same draw at any difficulty."""
    ref = render_source_image(source, cls, 0, index, size, 0.0) @ LUMA
    mask = _box(ref, 3) < 0.8 * _box(ref, 31)
    return mask, render_source_image(source, cls, 0, index, size, difficulty) @ LUMA


def _lesion_stats(source: str, difficulty: float, n: int = 6) -> tuple[float, float, float]:
    """Mean lesion area fraction, absolute and relative lesion-to-skin luminance contrast over n images per class."""
    area, absolute, relative = [], [], []
    for i in range(n):
        for cls in DERM5_CLASSES:
            mask, a = _lesion(source, cls, i, difficulty=difficulty)
            if mask.sum() < 4:
                continue
            bg = _box(a, 31)
            area.append(mask.mean())
            absolute.append((bg - a)[mask].mean())
            relative.append(1.0 - (a / bg)[mask].mean())
    return float(np.mean(area)), float(np.mean(absolute)), float(np.mean(relative))


def test_clinical_sources_show_smaller_lesions_with_lower_contrast_on_dark_skin():
    stats = {s: _lesion_stats(s, DERM5_DIFFICULTY) for s in SOURCES}
    area, contrast = ({s: v[k] for s, v in stats.items()} for k in (0, 1))
    assert area["isic2019"] > 1.3 * max(area[s] for s in TREES)  # close-up vs a wider field of view
    assert contrast["isic2019"] > max(contrast["atlasderm"], contrast["dermnet"]) > contrast["darkderm"]
    assert min(contrast["atlasderm"], contrast["dermnet"]) > 1.3 * contrast["darkderm"]


def _ramp(path_or_img) -> float:
    """Lighting gradient: the largest difference of mean luminance between opposite image halves."""
    a = _luma(path_or_img) if isinstance(path_or_img, str) else path_or_img
    h, w = a.shape
    return max(abs(a[:h // 2].mean() - a[h // 2:].mean()), abs(a[:, :w // 2].mean() - a[:, w // 2:].mean()))


def test_clinical_sources_have_oblique_lighting_and_a_colour_cast(raw):
    out, _ = raw
    isic = [p for p in _isic_images(out)[:60] if _luma(p)[0, 0] > 0.05]  # ring-free views only
    ramp = {"isic2019": np.mean([_ramp(p) for p in isic]),
            **{s: np.mean([_ramp(p) for p in _tree_images(out, s)]) for s in ("atlasderm", "dermnet")}}
    assert min(ramp["atlasderm"], ramp["dermnet"]) > 1.5 * ramp["isic2019"]

    def cast(paths):  # mean red/blue ratio of the skin border
        rgb = [np.asarray(Image.open(p).convert("RGB"), np.float32)[1:-1:4, 1].mean(0) for p in paths]
        return float(np.mean([c[0] / max(c[2], 1.0) for c in rgb]))

    assert abs(cast(_tree_images(out, "atlasderm")) - cast(_tree_images(out, "dermnet"))) > 0.05


# ---------------------------------------------------------------------------------------------------- difficulty


def test_difficulty_lowers_the_lesion_contrast_in_every_source():
    for source in SOURCES:
        relative = [_lesion_stats(source, d)[2] for d in (0.0, 1.0, 3.0)]
        assert relative[0] > relative[1] > relative[2], (source, relative)
        assert relative[2] < 0.8 * relative[0], (source, relative)


def test_default_difficulty_is_the_documented_constant(tmp_path):
    a = write_synthetic_derm_sources(str(tmp_path / "a"), n_isic=15, image_size=16)
    write_synthetic_derm_sources(str(tmp_path / "b"), n_isic=15, image_size=16, difficulty=DERM5_DIFFICULTY)
    assert a["settings"]["difficulty"] == DERM5_DIFFICULTY
    assert tree_digests(str(tmp_path / "a")) == tree_digests(str(tmp_path / "b"))


# ---------------------------------------------------------------------------------------------------- determinism


def test_same_seed_same_bytes_other_seed_other_images(raw, tmp_path):
    out, info = raw
    again = write_synthetic_derm_sources(str(tmp_path / "a"), n_isic=N_ISIC, seed=0, image_size=24)
    assert tree_digests(str(tmp_path / "a")) == tree_digests(out)
    assert {s: again[s]["class_counts"] for s in SOURCES} == {s: info[s]["class_counts"] for s in SOURCES}
    write_synthetic_derm_sources(str(tmp_path / "b"), n_isic=N_ISIC, seed=1, image_size=24)
    first, other = tree_digests(out), tree_digests(str(tmp_path / "b"))
    assert not any(first[k] == other.get(k) for k in first)  # no file is the same under another seed


def test_an_image_is_a_function_of_seed_source_and_index():
    a = render_source_image("dermnet", "MEL", 3, 17, 24, 1.0)
    assert np.array_equal(a, render_source_image("dermnet", "MEL", 3, 17, 24, 1.0))
    for other in (("darkderm", "MEL", 3, 17), ("dermnet", "MEL", 4, 17), ("dermnet", "MEL", 3, 18)):
        assert not np.array_equal(a, render_source_image(*other, 24, 1.0))


# ---------------------------------------------------------------------------------------------------- arguments


@pytest.mark.parametrize("kwargs,message", [
    ({"n_isic": 14}, "n_isic=14"), ({"n_isic": 20.0}, "n_isic=20.0"), ({"image_size": 8}, "image_size=8"),
    ({"difficulty": -1}, "difficulty=-1"), ({"difficulty": True}, "difficulty=True"),
    ({"difficulty": "hard"}, "difficulty='hard'")])
def test_arguments_are_checked(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        write_synthetic_derm_sources(str(tmp_path / "x"), **{"n_isic": 15, "image_size": 16, **kwargs})


def test_an_existing_source_folder_is_refused(tmp_path):
    (tmp_path / "dermnet").mkdir()
    with pytest.raises(ValueError, match="already holds"):
        write_synthetic_derm_sources(str(tmp_path), n_isic=15, image_size=16)
