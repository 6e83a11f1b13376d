import math

import pytest
import torch

from fedssl.eval.segmentation3d import mean_metrics, volume_metrics

CLASSES = {1: "RV", 2: "MYO"}


def cube(shape, lo, hi, value=1):
    x = torch.zeros(shape, dtype=torch.long)
    x[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]] = value
    return x


def test_perfect_prediction_and_shift_by_hand():
    label = cube((12, 12, 6), (2, 2, 1), (6, 6, 3))  # 4 x 4 x 2 = 32 voxels of class 1
    m = volume_metrics(label.clone(), label, CLASSES, spacing=(1.0, 1.0, 10.0))
    assert m["dice_RV"] == pytest.approx(1.0) and m["hd95_RV"] == pytest.approx(0.0)
    assert m["dice_MYO"] == pytest.approx(1.0) and m["hd95_MYO"] == 0.0  # absent from both
    shifted = cube((12, 12, 6), (4, 2, 1), (8, 6, 3))  # 2 voxels along x: overlap 2 x 4 x 2 = 16
    m = volume_metrics(shifted, label, CLASSES, spacing=(1.5, 1.0, 10.0))
    assert m["dice_RV"] == pytest.approx(2 * 16 / (32 + 32))
    assert m["hd95_RV"] == pytest.approx(2 * 1.5)  # the surfaces are 2 voxels of 1.5 mm apart


def test_a_class_missed_or_invented_has_dice_zero_and_undefined_hd95():
    label = cube((8, 8, 4), (1, 1, 1), (4, 4, 3), value=2)
    m = volume_metrics(torch.zeros_like(label), label, CLASSES, spacing=(1.0, 1.0, 1.0))
    assert m["dice_MYO"] == 0.0 and math.isnan(m["hd95_MYO"])
    rows = [m, volume_metrics(label.clone(), label, CLASSES, spacing=(1.0, 1.0, 1.0))]
    mean = mean_metrics(rows, CLASSES)
    assert mean["dice_MYO"] == pytest.approx(0.5) and mean["hd95_MYO"] == pytest.approx(0.0)  # NaN left out
    assert mean["hd95_undefined"] == 1.0 and mean["dice"] == pytest.approx((1.0 + 0.5) / 2)
