"""Dice evaluation, U-Net initialisation and fine-tuning loop (fedssl.eval.segmentation)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from fedssl.data.volume import Volume
from fedssl.eval.segmentation import (
    ACDC_CLASSES,
    SegmentationTrainer,
    dice_per_volume,
    init_unet,
    mean_dice,
    train_segmentation,
)
from fedssl.models.unet import TINY_FEATURES, UNetEncoder, build_unet

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


def test_init_unet_random_seeded_and_encoder_loaded_exactly():
    a, b, c = (init_unet("random", features=TINY_FEATURES, seed=s) for s in (1, 1, 2))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)

    torch.manual_seed(123)
    enc = UNetEncoder(TINY_FEATURES).state_dict()
    unet = init_unet(enc, features=TINY_FEATURES, seed=1)
    own = unet.state_dict()
    for k, v in enc.items():
        assert torch.equal(own[k], v), k
    decoder_keys = [k for k in own if k.startswith(("upcat_", "final_conv."))]
    assert decoder_keys and all(torch.equal(own[k], sa[k]) for k in decoder_keys)

    full = build_unet(TINY_FEATURES).state_dict()
    loaded = init_unet(full, features=TINY_FEATURES, seed=5).state_dict()
    assert all(torch.equal(loaded[k], full[k]) for k in full)


def test_init_unet_rejects_mismatch():
    other = UNetEncoder((8, 8, 16, 16, 32, 8)).state_dict()
    with pytest.raises(ValueError):
        init_unet(other, features=TINY_FEATURES)
    with pytest.raises(ValueError):
        init_unet(build_unet((8, 8, 16, 16, 32, 8)).state_dict(), features=TINY_FEATURES)
    with pytest.raises(ValueError):
        init_unet("imagenet", features=TINY_FEATURES)


def _phantom(pid: str, phase: str, z: int = 4, size: int = 32, seed: int = 0) -> Volume:
    """Trivially learnable: intensity encodes the class (RV blob, LV disc, MYO ring)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[:size, :size]
    label = np.zeros((z, size, size), np.uint8)
    for k in range(z):
        cy, cx = size // 2 + rng.integers(-2, 3), size // 2 + rng.integers(-2, 3)
        r = np.hypot(yy - cy, xx - cx)
        label[k][r < 9] = 2
        label[k][r < 6] = 3
        label[k][(np.hypot(yy - cy, xx - (cx - 11)) < 4)] = 1
    image = (label / 3.0 + rng.normal(0, 0.02, label.shape)).clip(0, 1).astype(np.float32)
    return Volume(pid, phase, image, label, site="s1")


def test_training_reduces_loss():
    vols = [_phantom("p1", "ED", seed=1), _phantom("p1", "ES", seed=2)]
    unet = init_unet("random", features=TINY_FEATURES, seed=0)
    seen = []
    losses = train_segmentation(
        unet, vols, epochs=8, batch_size=4, lr=1e-2, seed=0, progress=lambda e, l: seen.append((e, l))
    )
    assert len(losses) == 8 and [e for e, _ in seen] == list(range(1, 9))
    assert np.mean(losses[-2:]) < losses[0]


def test_trainer_schedule_and_state_round_trip():
    vols = [_phantom("p1", "ED", seed=3)]  # 4 slices, batch 2 -> 2 steps / epoch
    unet = init_unet("random", features=TINY_FEATURES, seed=0)
    t1 = SegmentationTrainer(unet, lr=1e-3, batch_size=2, total_steps=4, seed=7)
    t1.train_epoch(vols)
    assert t1.step == 2 and t1.current_lr == pytest.approx(1e-3 * 0.5)  # cos(pi/2) midpoint

    unet2 = copy.deepcopy(unet)
    t2 = SegmentationTrainer(unet2, lr=1e-3, batch_size=2, total_steps=4, seed=999)
    t2.load_state_dict(copy.deepcopy(t1.state_dict()))
    assert t2.step == 2 and t2.epoch == 1 and t2.current_lr == pytest.approx(t1.current_lr)

    l1, l2 = t1.train_epoch(vols), t2.train_epoch(vols)
    assert l1 == pytest.approx(l2, rel=1e-5)
    s1, s2 = unet.state_dict(), unet2.state_dict()
    assert all(torch.allclose(s1[k], s2[k], atol=1e-6) for k in s1)
    assert t1.current_lr == pytest.approx(0.0, abs=1e-12)
    t1.train_epoch(vols, max_steps=1)  # past total_steps the lr stays at 0
    assert t1.step == 5 and t1.current_lr == pytest.approx(0.0, abs=1e-12)

    with pytest.raises(ValueError):
        SegmentationTrainer(unet, lr=1e-3, batch_size=2, total_steps=8, seed=0).load_state_dict(t1.state_dict())
