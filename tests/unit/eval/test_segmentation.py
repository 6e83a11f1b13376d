"""Dice evaluation (fedssl.eval.segmentation)."""

from __future__ import annotations


import numpy as np
import pytest
import torch
from torch import nn

from fedssl.data.volume import Volume
from fedssl.eval.segmentation import ACDC_CLASSES, dice_per_volume, mean_dice

torch.set_num_threads(1)


class EchoModel(nn.Module):
    """Stub segmenter: the input image *is* the predicted label map; returns one-hot logits."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot(x[:, 0].round().long(), 4).permute(0, 3, 1, 2).float() * 10.0


def _vol(pred: np.ndarray, gt: np.ndarray | None, pid: str = "p1", phase: str = "ED") -> Volume:
    return Volume(pid, phase, pred.astype(np.float32), None if gt is None else gt.astype(np.uint8), site="s1")


def test_dice_hand_computed_3d_and_empty_class_convention():
    pred = np.zeros((2, 4, 4))
    gt = np.zeros((2, 4, 4))
    # RV: prediction 4 voxels (2 per slice), ground truth 6 voxels (3 per slice), overlap 3 (2 + 1).
    pred[0, 0, 0:2] = 1
    pred[1, 0, 0:2] = 1
    gt[0, 0, 0:3] = 1
    gt[1, 0, 1:4] = 1
    # MYO: identical 2 voxels on slice 1.
    pred[1, 3, 0:2] = 2
    gt[1, 3, 0:2] = 2
    # LV: absent from both -> Dice 1 by convention.
    rows = dice_per_volume(EchoModel(), [_vol(pred, gt)], batch_size=1)
    assert rows[0]["patient_id"] == "p1" and rows[0]["phase"] == "ED" and rows[0]["site"] == "s1"
    assert rows[0]["RV"] == pytest.approx(2 * 3 / (4 + 6))
    assert rows[0]["MYO"] == pytest.approx(1.0)
    assert rows[0]["LV"] == pytest.approx(1.0)
    assert rows[0]["mean"] == pytest.approx((0.6 + 1.0 + 1.0) / 3)

    # LV predicted (3 voxels) but absent from the ground truth -> 0; MYO missed entirely -> 0.
    pred2 = np.zeros((1, 4, 4))
    gt2 = np.zeros((1, 4, 4))
    pred2[0, 1, 0:3] = 3
    gt2[0, 2, 0:2] = 2
    gt2[0, 3, 0:4] = 1
    pred2[0, 3, 0:2] = 1
    r2 = dice_per_volume(EchoModel(), [_vol(pred2, gt2, "p2", "ES")])[0]
    assert r2["LV"] == 0.0 and r2["MYO"] == 0.0
    assert r2["RV"] == pytest.approx(2 * 2 / (2 + 4))
    assert r2["mean"] == pytest.approx((2 / 3) / 3)

    both = mean_dice(rows + [r2])
    assert both["n_volumes"] == 2
    assert both["RV"] == pytest.approx((0.6 + 2 / 3) / 2)
    assert both["LV"] == pytest.approx(0.5)
    assert both["mean"] == pytest.approx((rows[0]["mean"] + r2["mean"]) / 2)
    assert set(ACDC_CLASSES.values()) == {"RV", "MYO", "LV"}


def test_dice_rejects_unlabelled_volume_and_restores_mode():
    model = EchoModel().train()
    with pytest.raises(ValueError, match="no label"):
        dice_per_volume(model, [_vol(np.zeros((1, 4, 4)), None)])
    dice_per_volume(model, [_vol(np.zeros((1, 4, 4)), np.zeros((1, 4, 4)))])
    assert model.training
    with pytest.raises(ValueError):
        mean_dice([])
