"""FedCLFLocalTrainer (fedssl.train.fedclf): the LocalTrainer seam over the core trainer, with tiny ResNets on
synthetic derm images."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from fedssl.core.trainer import LocalTrainer, StopRequested
from fedssl.data.image_synthetic import write_synthetic_images
from fedssl.data.images import load_image_records
from fedssl.train.fedclf import FedCLFLocalTrainer, view_batches

torch.set_num_threads(1)

TINY = dict(dataset="derm", image_size=16, width=4, proj_dim=8, batch_size=4, bank_size=16)


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    root = tmp_path_factory.mktemp("derm")
    write_synthetic_images(root, "derm", n_images=18, seed=0, image_size=20)
    return load_image_records(root, "derm", site="device-1")


def test_round_is_one_epoch_of_full_batches_and_reports_the_queue(records):
    t = FedCLFLocalTrainer(records, num_rounds=2, site="device-1", **TINY)
    assert isinstance(t, LocalTrainer) and t.steps_per_round == 4  # 18 images // 4, last partial batch dropped
    t.set_remote(np.eye(8, dtype=np.float32)[:6])
    stats = t.train_round(0)
    assert stats.steps == 4 and stats.samples == 18 and len(stats.curve) == 4
    m = stats.metrics
    assert m["remote_features"] == 6 and m["queue_remote_fraction"] == 1.0 and m["queue_size"] == 6
    assert m["bank_filled"] == 16 and m["bank_fill"] == 1.0 and 0 < m["feature_std"] < 1


def test_view_batches_order_from_seed_and_epoch_and_step_cap(records):
    t = FedCLFLocalTrainer(records, num_rounds=1, site="device-1", max_steps_per_round=2, **TINY)
    a = [b[0] for b in view_batches(t.dataset, 4, 0, 0, 2)]
    b = [b[0] for b in view_batches(t.dataset, 4, 0, 0, 2)]
    assert len(a) == 2 and all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(next(view_batches(t.dataset, 4, 0, 1))[0], a[0])
    assert t.train_round(0).steps == 2


def test_remote_bank_is_checked_and_stop_is_honoured(records):
    t = FedCLFLocalTrainer(records, num_rounds=1, site="device-1", **TINY)
    with pytest.raises(ValueError, match=r"expected \[R, 8\]"):
        t.set_remote(np.zeros((3, 5), np.float32))
    calls = []

    def stop():
        calls.append(1)
        return len(calls) > 1

    with pytest.raises(StopRequested):
        t.train_round(0, stop)


def test_too_few_images_names_the_device(records):
    with pytest.raises(ValueError, match="device-9: 18 training images cannot fill one batch of 32"):
        FedCLFLocalTrainer(records, num_rounds=1, site="device-9", **{**TINY, "batch_size": 32})


@pytest.mark.parametrize("method", ["simclr", "rotation"])
def test_baselines_exchange_no_bank_and_train(records, method):
    t = FedCLFLocalTrainer(records, num_rounds=1, site="device-1", method=method, queue="none", **TINY)
    stats = t.train_round(0)
    assert "queue_size" not in stats.metrics and stats.steps == 4
    assert ("rotation_accuracy" in stats.metrics) == (method == "rotation")


def test_sites_draw_differently_and_restart_resumes(records):
    a = FedCLFLocalTrainer(records, num_rounds=2, site="device-1", **TINY)
    b = FedCLFLocalTrainer(records, num_rounds=2, site="device-2", **TINY)
    assert all(torch.equal(a.global_state()[k], b.global_state()[k]) for k in a.global_state())  # same init
    assert not torch.equal(a.dataset[0][0], b.dataset[0][0])  # per-device augmentation draws
    a.train_round(0)
    c = FedCLFLocalTrainer(records, num_rounds=2, site="device-1", **TINY)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)  # as the executor's checkpoint
    buf.seek(0)
    c.load_state_dict(torch.load(buf, weights_only=True))
    assert a.train_round(1).loss == c.train_round(1).loss


def test_loader_workers_give_the_same_round(records, loader_workers):
    a = FedCLFLocalTrainer(records, num_rounds=1, site="device-1", max_steps_per_round=2, **TINY)
    b = FedCLFLocalTrainer(records, num_rounds=1, site="device-1", max_steps_per_round=2, workers=2, **TINY)
    sa, sb = a.train_round(0), b.train_round(0)
    assert sa.loss == sb.loss and sa.steps == sb.steps == 2
    assert loader_workers and set(loader_workers) == {2}  # only the workers=2 trainer built DataLoaders
    with pytest.raises(ValueError, match="workers=-1"):
        FedCLFLocalTrainer(records, num_rounds=1, site="device-1", workers=-1, **TINY)
