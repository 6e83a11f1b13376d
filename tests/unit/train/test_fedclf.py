"""FedCLFLocalTrainer (fedssl.train.fedclf): the LocalTrainer with tiny ResNets on synthetic derm images; its loop
(``train_batches``) on tiny hand-checkable networks and hand-made batches, with hand-computed expectations; its
settings (FedCLFSettings)."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fedssl.core.trainer import LocalTrainer, MixedPrecision, StopRequested
from fedssl.data.image_synthetic import write_synthetic_images
from fedssl.data.images import load_image_records
from fedssl.train.fedclf import FedCLFLocalTrainer, FedCLFSettings, view_batches

torch.set_num_threads(1)

TINY = dict(dataset="derm", image_size=16, width=4, proj_dim=8, batch_size=4, bank_size=16)


def make(records, num_rounds=1, site="device-1", model=None, **kw):
    return FedCLFLocalTrainer(records, FedCLFSettings(**{**TINY, **kw}), num_rounds=num_rounds, site=site, model=model)


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    root = tmp_path_factory.mktemp("derm")
    write_synthetic_images(root, "derm", n_images=18, seed=0, image_size=20)
    return load_image_records(root, "derm", site="device-1")


def test_round_is_one_epoch_of_full_batches_and_reports_the_queue(records):
    t = make(records, 2, "device-1")
    assert isinstance(t, LocalTrainer) and t.steps_per_round == 4  # 18 images // 4, last partial batch dropped
    t.set_remote(np.eye(8, dtype=np.float32)[:6])
    stats = t.train_round(0)
    assert stats.steps == 4 and stats.samples == 18 and len(stats.curve) == 4
    m = stats.metrics
    assert m["remote_features"] == 6 and m["queue_remote_fraction"] == 1.0 and m["queue_size"] == 6
    assert m["bank_filled"] == 16 and m["bank_fill"] == 1.0 and 0 < m["feature_std"] < 1
    assert m["chance_loss"] == pytest.approx(math.log(7))  # issue 44: ln(|Q_CL| + 1), the 6 remote negatives


def test_view_batches_order_from_seed_and_epoch_and_step_cap(records):
    t = make(records, 1, "device-1", max_steps_per_round=2)
    a = [b[0] for b in view_batches(t.dataset, 4, 0, 0, 2)]
    b = [b[0] for b in view_batches(t.dataset, 4, 0, 0, 2)]
    assert len(a) == 2 and all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(next(view_batches(t.dataset, 4, 0, 1))[0], a[0])
    assert t.train_round(0).steps == 2


def test_remote_bank_is_checked_and_stop_is_honoured(records):
    t = make(records, 1, "device-1")
    with pytest.raises(ValueError, match=r"expected \[M, 8\]"):
        t.set_remote(np.zeros((3, 5), np.float32))
    calls = []

    def stop():
        calls.append(1)
        return len(calls) > 1

    with pytest.raises(StopRequested):
        t.train_round(0, stop)


def test_too_few_images_names_the_device(records):
    with pytest.raises(ValueError, match="device-9: 18 training images cannot fill one batch of 32"):
        make(records, 1, "device-9", batch_size=32)


@pytest.mark.parametrize("method", ["simclr", "rotation"])
def test_baselines_exchange_no_bank_and_train(records, method):
    t = make(records, 1, "device-1", method=method, queue="none")
    stats = t.train_round(0)
    assert "queue_size" not in stats.metrics and stats.steps == 4
    assert ("rotation_accuracy" in stats.metrics) == (method == "rotation")
    # issue 44: NT-Xent of 2 x 4 views ln(2B - 1) = ln 7; 4 rotations ln 4
    assert stats.metrics["chance_loss"] == pytest.approx(math.log(7 if method == "simclr" else 4))


def test_sites_draw_differently_and_restart_resumes(records):
    a = make(records, 2, "device-1")
    b = make(records, 2, "device-2")
    assert all(torch.equal(a.global_state()[k], b.global_state()[k]) for k in a.global_state())  # same init
    assert not torch.equal(a.dataset[0][0], b.dataset[0][0])  # per-device augmentation draws
    a.train_round(0)
    c = make(records, 2, "device-1")
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)  # as the executor's checkpoint
    buf.seek(0)
    c.load_state_dict(torch.load(buf, weights_only=True))
    assert a.train_round(1).loss == c.train_round(1).loss


def test_loader_workers_give_the_same_round(records, loader_workers):
    a = make(records, 1, "device-1", max_steps_per_round=2)
    b = make(records, 1, "device-1", max_steps_per_round=2, workers=2)
    sa, sb = a.train_round(0), b.train_round(0)
    assert sa.loss == sb.loss and sa.steps == sb.steps == 2
    assert loader_workers and set(loader_workers) == {2}  # only the workers=2 trainer built DataLoaders
    with pytest.raises(ValueError, match="workers=-1"):
        make(records, 1, "device-1", workers=-1)


# ---------------------------------------------------------------------------------------------- the loop
class TinyNet(nn.Module):
    def __init__(self, out: int = 4):
        super().__init__()
        self.lin = nn.Linear(12, out)

    def forward(self, x):
        return F.normalize(self.lin(x.flatten(1)), dim=1)


class TinyMoCo(nn.Module):
    proj_dim = 4

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.main, self.momentum = TinyNet(), TinyNet()
        self.momentum.load_state_dict(self.main.state_dict())


class TinyRotation(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Linear(12, 4)

    def forward(self, x):
        return self.main(x.flatten(1))


def _batches(n: int, b: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, 3, 2, 2, generator=g), torch.randn(b, 3, 2, 2, generator=g)) for _ in range(n)]


def test_moco_round_fills_the_bank_and_fe_neg_never_uses_a_local_negative(records):
    remote = F.normalize(torch.randn(7, 4, generator=torch.Generator().manual_seed(3)), dim=1)
    t = make(records, 2, "", model=TinyMoCo(), batch_size=3, queue="fe_neg", bank_size=8, seed=0)
    stats = t.train_batches(_batches(2), steps_per_round=2, round_idx=0, remote=remote)
    assert stats["steps"] == 2 and stats["bank_filled"] == 6 and stats["queue_size"] == 7
    assert stats["queue_remote_fraction"] == 1.0
    assert all(any(torch.allclose(row, r) for r in remote) for row in t.queue.features)
    # the local bank holds the momentum features of the batches (what is uploaded), not remote ones
    assert not any(torch.allclose(row, r) for row in t.bank.features[:6] for r in remote)


def test_moco_without_exchange_is_plain_moco_the_queue_is_the_bank(records):
    t = make(records, 1, "", model=TinyMoCo(), batch_size=3, queue="none", bank_size=5, seed=0)
    t.train_batches(_batches(1), steps_per_round=3, round_idx=0)
    stats = t.train_batches(_batches(3, seed=1), steps_per_round=3, round_idx=0)
    assert torch.equal(t.queue.features, t.bank.features) and stats["queue_remote_fraction"] == 0.0


def test_momentum_network_is_an_ema_and_lr_follows_the_cosine(records):
    model = TinyMoCo()
    before = model.momentum.lin.weight.detach().clone()
    t = make(records, 2, "", model=model, batch_size=3, queue="none", bank_size=8, momentum=0.5, lr=0.1, seed=0)
    stats = t.train_batches(_batches(1), steps_per_round=2, round_idx=1)
    # one step: momentum = 0.5 * old + 0.5 * main (after the step)
    assert torch.allclose(model.momentum.lin.weight, 0.5 * before + 0.5 * model.main.lin.weight.detach())
    assert stats["lr_end"] == pytest.approx(0.1 * 0.5 * (1 + math.cos(math.pi * 2 / 4)))


def test_first_round_without_a_remote_bank_draws_from_the_own_initial_bank(records):
    t = make(records, 1, "", model=TinyMoCo(), batch_size=3, queue="fe_neg", bank_size=6, seed=0)
    initial = t.bank.features.clone()  # random unit vectors: nobody's data
    t.train_batches(_batches(1), steps_per_round=1, round_idx=0, remote=None)
    assert all(any(torch.allclose(row, r) for r in initial) for row in t.queue.features)


def test_simclr_and_rotation_methods_train_their_losses(records):
    t = make(records, 100, "", model=nn.ModuleDict({"main": TinyNet()}), batch_size=3, method="simclr", queue="none",
             tau=0.5, seed=0)
    stats = t.train_batches(_batches(2), steps_per_round=2, round_idx=0)
    assert stats["steps"] == 2 and "feature_std" in stats and "queue_size" not in stats
    r = make(records, 100, "", model=TinyRotation(), batch_size=3, method="rotation", queue="none", seed=0)
    stats = r.train_batches(_batches(2), steps_per_round=2, round_idx=0)
    assert 0.0 <= stats["rotation_accuracy"] <= 1.0 and stats["loss"] > 0


def test_state_round_trip_resumes_identically(records):
    a = make(records, 100, "", model=TinyMoCo(), batch_size=3, queue="fe", bank_size=8, seed=0)
    a.train_batches(_batches(1), steps_per_round=1, round_idx=0, remote=torch.eye(4))
    b = make(records, 100, "", model=TinyMoCo(), batch_size=3, queue="fe", bank_size=8, seed=5)
    b.load_state_dict(a.state_dict())
    sa = a.train_batches(_batches(1, seed=2), steps_per_round=1, round_idx=1, remote=torch.eye(4))
    sb = b.train_batches(_batches(1, seed=2), steps_per_round=1, round_idx=1, remote=torch.eye(4))
    assert sa["loss"] == sb["loss"] and torch.equal(a.bank.features, b.bank.features)


def test_settings_refuse_bad_values_naming_them(records):
    with pytest.raises(ValueError, match="FedCLFLocalTrainer: argument queue='fe'.*only method='moco'"):
        make(records, method="simclr", queue="fe")
    with pytest.raises(ValueError, match="queue='both'"):
        make(records, queue="both")
    with pytest.raises(ValueError, match="tau=0"):
        make(records, tau=0)
    with pytest.raises(ValueError, match="num_rounds=0"):
        make(records, 0)


def test_amp_runs_moco_in_bfloat16_and_its_bank_stays_float32(records):
    tr = make(records, 2, "", model=TinyMoCo(), batch_size=3, queue="fe_neg", bank_size=8, seed=0)
    tr.precision = MixedPrecision("cpu", True, force=torch.bfloat16)  # the bfloat16 path on a CPU
    seen = []
    for m in tr.model.main.modules():
        if isinstance(m, nn.Linear):
            m.register_forward_hook(lambda mod, i, o: seen.append(o.dtype))
    out = tr.train_batches(_batches(2), 2, 0)
    assert seen and set(seen) == {torch.bfloat16}
    assert math.isfinite(out["loss"]) and tr.bank.features.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in tr.model.parameters())


def test_moco_step_uses_the_jobs_temperature_and_banks_the_momentum_features(records, monkeypatch):
    """Issue 47: the trainer ignoring the configured temperature, and the local bank storing the main encoder's q
    instead of the momentum features k (eq. 4: Q_l holds keys), passed every test."""
    import fedssl.train.fedclf as fedclf

    seen = []
    real = fedclf.info_nce

    def recording(q, k, negatives, tau):
        seen.append((q.detach().clone(), k.detach().clone(), tau))
        return real(q, k, negatives, tau)

    monkeypatch.setattr(fedclf, "info_nce", recording)
    t = make(records, 2, "", model=TinyMoCo(), batch_size=3, bank_size=8, seed=0, tau=0.37)
    t.train_batches(_batches(1), steps_per_round=1, round_idx=0)
    (q, k, tau), = seen
    assert tau == 0.37
    banked = t.bank.features[:3]
    assert torch.allclose(banked, F.normalize(k, dim=1), atol=1e-6) or torch.allclose(banked, k, atol=1e-6)
    assert not torch.allclose(banked, q, atol=1e-4)
