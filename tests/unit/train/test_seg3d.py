import math

import pytest
import torch

from fedssl.models.dynunet3d import build_dynunet
from fedssl.core.trainer import amp_dtype
from fedssl.eval.segmentation3d import predict_volume3d
from fedssl.train.seg3d import Seg3DLocalTrainer, Seg3DSettings

ROI, PIX = (16, 16, 8), (2.0, 2.0, 10.0)
CLASSES = {1: "RV", 2: "MYO", 3: "LV"}


def volume(seed: int, vid: str) -> dict:
    g = torch.Generator().manual_seed(seed)
    label = torch.zeros(1, 24, 24, 8, dtype=torch.uint8)
    label[0, 6:14, 6:14, 2:6] = 3
    label[0, 4:6, 6:14, 2:6] = 2
    label[0, 14:18, 8:12, 2:6] = 1
    image = (label.float() / 3 + 0.05 * torch.randn(label.shape, generator=g)).clamp(0, 1)
    return {"image": image, "label": label, "id": vid}


def trainer(**kw) -> Seg3DLocalTrainer:
    net = build_dynunet([4, 8, 16], PIX, ROI, 3, seed=0)
    args = dict(filters=[4, 8, 16], pixdim=PIX, roi_size=ROI, lr=3e-3, batch_size=4, num_samples=2, local_epochs=1,
                seed=0)
    num_rounds, site, device = kw.pop("num_rounds", 2), kw.pop("site", ""), kw.pop("device", "cpu")
    args.update(kw)
    return Seg3DLocalTrainer(net, [volume(0, "a"), volume(1, "b"), volume(2, "c")], [volume(3, "v")],
                             Seg3DSettings(**args), num_rounds=num_rounds, site=site, device=device)


def test_a_round_takes_the_planned_steps_and_evaluates_every_class():
    t = trainer()
    # 3 volumes x 2 patches / batch 4 -> 2 steps per epoch
    stats = t.train_round(0, lambda: False)
    assert stats.steps == 2 == t.steps_per_epoch and stats.samples == 3 and math.isfinite(stats.loss)
    assert t.total_steps == 2 * 1 * 2
    m = t.evaluate("val")
    # by hand: 2 |P & L| / (|P| + |L|) per class of the sliding-window prediction, then their mean
    v = t.val_volumes[0]
    pred = predict_volume3d(t.model, v["image"], ROI, device=t.device)
    label = v["label"][0].long()
    by_hand = {}
    for c, name in CLASSES.items():
        p, y = pred == c, label == c
        by_hand[name] = 2 * float((p & y).sum()) / float(p.sum() + y.sum())
        assert m[f"dice_{name}"] == pytest.approx(by_hand[name], abs=1e-6)
    assert m["volumes"] == 1 and m["dice"] == pytest.approx(sum(by_hand.values()) / 3, abs=1e-6)
    capped = trainer(max_steps_per_epoch=1)
    assert capped.train_round(0, lambda: False).steps == 1


def test_state_round_trips_and_a_foreign_state_is_refused():
    t = trainer()
    t.train_round(0, lambda: False)
    other = trainer()
    other.load_state_dict(t.state_dict())
    assert other.step == t.step and other.scheduler.get_last_lr() == t.scheduler.get_last_lr()
    with pytest.raises(ValueError, match="total_steps=4; this trainer has 8"):
        trainer(num_rounds=4).load_state_dict(t.state_dict())


def test_same_seed_same_round():
    a, b = trainer(), trainer()
    assert a.train_round(0, lambda: False).loss == b.train_round(0, lambda: False).loss


def test_amp_is_bfloat16_on_gpus_that_have_it_float16_before_and_off_on_a_cpu(monkeypatch):
    assert amp_dtype(torch.device("cpu"), True) is None and amp_dtype(torch.device("cpu"), False) is None
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert amp_dtype(torch.device("cuda"), True) is torch.bfloat16 and amp_dtype(torch.device("cuda"), False) is None
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)  # e.g. V100, T4
    assert amp_dtype(torch.device("cuda:0"), True) is torch.float16
