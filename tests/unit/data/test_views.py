"""MoCo v2 view pairs (fedssl.data.views): shapes, normalisation, determinism per (seed, epoch, index), the crop box
and each augmentation's probability."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedssl.data.image_synthetic import write_synthetic_images
from fedssl.data.images import IMAGENET_MEAN, IMAGENET_STD, load_image_records
from fedssl.data.views import TwoViewDataset, crop_box, mocov2_view

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    root = tmp_path_factory.mktemp("derm")
    write_synthetic_images(root, "derm", n_images=16, seed=0, image_size=24)
    return load_image_records(root, "derm", site="site-1")


def test_two_views_are_normalised_crops_and_reproducible(records):
    ds = TwoViewDataset(records, 16, "derm", site="site-1", seed=3)
    v1, v2 = ds[0]
    assert v1.shape == v2.shape == (3, 16, 16) and not torch.equal(v1, v2)
    again = TwoViewDataset(records, 16, "derm", site="site-1", seed=3)[0]
    assert torch.equal(again[0], v1) and torch.equal(again[1], v2)  # (seed, epoch, index) only
    ds.set_epoch(1)
    assert not torch.equal(ds[0][0], v1)
    lo = (0 - np.array(IMAGENET_MEAN)) / np.array(IMAGENET_STD)
    hi = (1 - np.array(IMAGENET_MEAN)) / np.array(IMAGENET_STD)
    for c in range(3):  # pixels stayed in [0, 1] before normalisation
        assert lo[c] - 1e-5 <= float(v1[c].min()) and float(v1[c].max()) <= hi[c] + 1e-5


def test_crop_box_area_and_ratio_within_mocov2_ranges():
    g = np.random.default_rng(0)
    for _ in range(200):
        top, left, h, w = crop_box(40, 60, g)
        assert 0 <= top and top + h <= 40 and 0 <= left and left + w <= 60
        assert 0.2 * 2400 * 0.8 <= h * w <= 2400  # scale 0.2-1 (rounding to whole pixels)
        assert 3 / 4 - 0.1 <= w / h <= 4 / 3 + 0.1


def test_augmentation_probabilities():
    img = torch.rand(3, 20, 20)
    grey = 0
    n = 400
    for i in range(n):
        x = mocov2_view(img, 16, np.random.default_rng([7, i]))
        grey += bool(torch.allclose(x[0], x[1]) and torch.allclose(x[1], x[2]))
    # grayscale p = 0.2 (a jittered colour image is never grey by chance)
    assert abs(grey / n - 0.2) < 0.06
