"""U-Net initialisation, the fine-tuning loop and its LocalTrainer (fedssl.train.segmentation)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from fedssl.data.volume import Volume
from fedssl.core.trainer import StopRequested
from fedssl.train.segmentation import (
    SegmentationLocalTrainer,
    SegmentationSettings,
    SegmentationTrainer,
    epochs_with_floor,
    init_unet,
    train_segmentation,
)
from fedssl.models.unet import TINY_FEATURES, UNetEncoder, build_unet

torch.set_num_threads(1)


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
        unet, vols, epochs=8, batch_size=4, lr=1e-2, seed=0, progress=lambda e, loss: seen.append((e, loss))
    )
    assert len(losses) == 8 and [e for e, _ in seen] == list(range(1, 9))
    assert np.mean(losses[-2:]) < losses[0]


def test_the_step_floor_adds_whole_epochs_only_where_the_schedule_falls_short():
    assert epochs_with_floor(60, 2, 0) == 60  # no floor: the paper's protocol
    assert epochs_with_floor(60, 2, 240) == 120  # one patient: 2 steps an epoch -> 120 epochs for 240 steps
    assert epochs_with_floor(60, 3, 240) == 80  # 3 x 80 = 240
    assert epochs_with_floor(60, 7, 240) == 60  # 420 steps already: unchanged
    assert epochs_with_floor(60, 5, 301) == 61  # rounds up to a whole epoch (305 steps)
    for bad in (-1, 2.5, True, "240"):
        with pytest.raises(ValueError, match=r"min_steps=.*non-negative integer"):
            epochs_with_floor(60, 2, bad)


def test_train_segmentation_runs_to_the_step_floor():
    vols = [_phantom("p1", "ED", seed=1)]  # 4 slices, batch 2 -> 2 steps an epoch
    unet = init_unet("random", features=TINY_FEATURES, seed=0)
    assert len(train_segmentation(unet, vols, epochs=1, batch_size=2, lr=1e-3, min_steps=7)) == 4  # 8 >= 7 steps
    assert len(train_segmentation(unet, vols, epochs=3, batch_size=2, lr=1e-3, min_steps=4)) == 3  # 6 >= 4 already


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


def test_the_state_of_another_unet_width_is_refused_by_name():
    vols = [_phantom("p1", "ED", seed=3)]
    t1 = SegmentationTrainer(init_unet("random", features=TINY_FEATURES, seed=0), lr=1e-3, batch_size=2, total_steps=4)
    t1.train_epoch(vols)
    wider = [2 * f for f in TINY_FEATURES]  # the same tensors, other shapes
    t2 = SegmentationTrainer(init_unet("random", features=wider, seed=0), lr=1e-3, batch_size=2, total_steps=4)
    with pytest.raises(ValueError, match=r"the saved segmentation state: the optimiser's exp_avg of parameter 0"):
        t2.load_state_dict(copy.deepcopy(t1.state_dict()))


def _local_trainer(seed: int = 0, **kw) -> SegmentationLocalTrainer:
    vols = [_phantom(f"p{i}", ph, z=3, size=32, seed=i) for i in range(2) for ph in ("ED", "ES")]
    unet = init_unet("random", features=TINY_FEATURES, seed=seed)
    args = dict(lr=1e-3, batch_size=2, local_epochs=1, max_steps_per_epoch=0, seed=seed, features=TINY_FEATURES)
    num_rounds, site = kw.pop("num_rounds", 2), kw.pop("site", "")
    args.update(kw)
    return SegmentationLocalTrainer(unet, vols[:3], vols[3:], SegmentationSettings(**args), num_rounds=num_rounds,
                                    site=site)


def test_local_trainer_round_stats_count_slices_and_steps():
    t = _local_trainer(max_steps_per_epoch=2, local_epochs=2)
    stats = t.train_round(0, lambda: False)
    assert stats.samples == 9  # 3 volumes x 3 slices: the FedAvg weight
    assert stats.steps == 4  # 2 epochs x the cap of 2 batches
    assert stats.metrics["lr"] == pytest.approx(t.trainer.current_lr)
    assert len(stats.curve) == 4 and stats.loss == pytest.approx(sum(p["loss"] for p in stats.curve) / 4)
    assert set(t.evaluate("val")) == {"dice", "LV", "MYO", "RV"}


def test_local_trainer_stops_within_one_step():
    t = _local_trainer()
    calls = []

    def stop_after_first() -> bool:
        calls.append(1)
        return len(calls) > 1

    with pytest.raises(StopRequested):
        t.train_round(0, stop_after_first)
    assert t.trainer.step == 1  # one optimiser step ran, the second was refused


def test_local_trainer_restart_continues_identically():
    a, b = _local_trainer(), _local_trainer()
    a.train_round(0, lambda: False)
    b.load_global(a.global_state())
    b.load_state_dict(copy.deepcopy(a.state_dict()))  # as through the checkpoint file (no shared tensors)
    sa, sb = a.train_round(1, lambda: False), b.train_round(1, lambda: False)
    assert sa.loss == sb.loss
    for k, v in a.global_state().items():
        assert torch.equal(v, b.global_state()[k]), k


def test_local_trainer_load_global_names_bad_keys():
    t = _local_trainer()
    state = t.global_state()
    first = next(iter(state))
    with pytest.raises(ValueError, match="lacks 1 keys"):
        t.load_global({k: v for k, v in state.items() if k != first})
    with pytest.raises(ValueError, match="does not have"):
        t.load_global({**state, "extra.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="has shape"):
        t.load_global({**state, first: torch.zeros(1)})
    assert t.load_global({k: v for k, v in state.items() if k != first}, keep_local=[first]) == [first]


def test_amp_runs_the_unet_in_bfloat16_and_keeps_the_loss_float32():
    from fedssl.core.trainer import MixedPrecision
    from tests.unit.core.test_mixed_precision import float32, layer_dtypes

    unet = init_unet("random", features=TINY_FEATURES, seed=0)
    t = SegmentationTrainer(unet, lr=1e-3, batch_size=2, total_steps=2, seed=0, amp=True)
    assert t.precision.dtype is None  # amp on a CPU: float32
    t.precision = MixedPrecision("cpu", True, force=torch.bfloat16)
    seen = layer_dtypes(unet)
    loss = t.train_epoch([_phantom("p1", "ED", seed=3)])
    assert seen and set(seen) == {torch.bfloat16} and np.isfinite(loss) and float32(unet)
