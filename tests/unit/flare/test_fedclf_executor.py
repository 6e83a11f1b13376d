"""FedCLFExecutor on a tiny device folder: one real train task per switch (what leaves the device), the remote bank
reaching the queue, Local CL's empty upload, and the refusals of a bad configuration."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.signal import Signal
from PIL import Image

from fedssl.flare.constants import BANK_FEATURES, BANK_PARTITIONS, REMOTE_FEATURES, SITE_RECORD_META
from fedssl.flare.fedclf_executor import FedCLFExecutor
from fedssl.models.resnet import PretrainingResNet
from tests.unit.flare.fakes import FakeEngine, context

torch.set_num_threads(1)
ARGS = dict(dataset="derm_mel", image_size=16, width=4, proj_dim=8, batch_size=4, bank_size=16, device="cpu")


@pytest.fixture(scope="module")
def device(tmp_path_factory):
    """A device folder with a class-folder train split (12 images)."""
    root = tmp_path_factory.mktemp("device-1")
    rng = np.random.default_rng(0)
    for cls in ("benign", "melanoma"):
        (root / "train" / cls).mkdir(parents=True)
        for i in range(6):
            Image.fromarray(rng.integers(0, 255, (20, 24, 3), dtype=np.uint8)).save(root / "train" / cls / f"{i}.png")
    return str(root)


def task(method="moco", round_idx=0, remote=None, depth=18):
    weights = {k: v.numpy() for k, v in PretrainingResNet(method, 4, 8, depth=depth).state_dict().items()}
    meta = {} if remote is None else {REMOTE_FEATURES: remote}
    s = DXO(DataKind.WEIGHTS, data=weights, meta=meta).to_shareable()
    s.set_header("current_round", round_idx)
    s.set_header("num_rounds", 2)
    return s


def run(executor, tmp_path, shareable):
    return from_shareable(executor.execute("train", shareable, context(site="device-1", engine=FakeEngine(tmp_path)),
                                           Signal()))


def test_fedclf_uploads_its_bank_and_trains_on_remote_negatives_only(device, tmp_path):
    ex = FedCLFExecutor(data_root=device, **ARGS)
    remote = np.eye(8, dtype=np.float32)[np.arange(10) % 8]
    out = run(ex, tmp_path, task(remote=remote))
    assert out.data_kind == DataKind.WEIGHTS and out.get_meta_prop("num_samples") == 12
    feats, parts = out.get_meta_prop(BANK_FEATURES), out.get_meta_prop(BANK_PARTITIONS)
    assert feats.shape == (12, 8) and (parts == 0).all()  # 3 steps x 4 momentum features, each shared once
    record = out.get_meta_prop(SITE_RECORD_META)
    assert record["queue_remote_fraction"] == 1.0 and record["bank_filled"] == 12 and record["images"] == 12
    metrics = [json.loads(line) for line in open(tmp_path / "fedclf_metrics.jsonl")]
    assert metrics[0]["remote_features"] == 10 and metrics[0]["queue_size"] == 10
    # issue 44: the loss's chance level, ln(|Q_CL| + 1) of the 10 remote negatives (not the bank's K = 16)
    assert record["chance_loss"] == metrics[0]["chance_loss"] == pytest.approx(math.log(11))


@pytest.mark.parametrize("switch, chance", [({"queue": "none"}, math.log(17)),  # MoCo: ln(K + 1), K = 16
                                            ({"method": "simclr", "queue": "none"}, math.log(7)),  # ln(2B - 1), B = 4
                                            ({"method": "rotation", "queue": "none"}, math.log(4))])
def test_without_feature_exchange_no_feature_leaves_the_device(device, tmp_path, switch, chance):
    ex = FedCLFExecutor(data_root=device, **{**ARGS, **switch})
    out = run(ex, tmp_path, task(switch.get("method", "moco"), remote=np.eye(8, dtype=np.float32)))
    assert out.get_meta_prop(BANK_FEATURES) is None and out.data  # weights, no bank
    metrics = [json.loads(line) for line in open(tmp_path / "fedclf_metrics.jsonl")]
    assert metrics[0]["remote_features"] == 0  # a remote bank that arrives anyway is not used
    assert out.get_meta_prop(SITE_RECORD_META)["chance_loss"] == pytest.approx(chance)  # issue 44


def test_local_cl_uploads_nothing(device, tmp_path):
    ex = FedCLFExecutor(data_root=device, federated=False, queue="none", **ARGS)
    out = run(ex, tmp_path, task())
    assert not out.data and out.get_meta_prop(BANK_FEATURES) is None


def test_a_partition_site_is_read_from_its_own_folder_and_resnet50_trains(device, tmp_path):
    """split="" reads data_root itself (a ``fedssl sslfl partition`` site: FedMAE-KS's Table III data); depth 50 is
    the CNN baselines' ResNet-50 there."""
    ex = FedCLFExecutor(data_root=f"{device}/train", split="", depth=50, **{**ARGS, "queue": "none"})
    out = run(ex, tmp_path, task(depth=50))
    assert out.get_meta_prop("num_samples") == 12
    assert out.data["main.encoder.net.layer3.5.conv3.weight"].shape == (64, 16, 1, 1)  # Bottleneck: 4 x (4 x width)
    with pytest.raises(ValueError, match="depth=34"):
        FedCLFExecutor(depth=34)


def test_bad_configuration_is_refused_naming_the_argument():
    with pytest.raises(ValueError, match="queue='fe_neg'.*Local CL"):
        FedCLFExecutor(federated=False)
    with pytest.raises(ValueError, match="queue='fe'.*only method='moco'"):
        FedCLFExecutor(method="rotation", queue="fe")
    with pytest.raises(ValueError, match="split='all'"):
        FedCLFExecutor(split="all")
    with pytest.raises(ValueError, match="width=3"):
        FedCLFExecutor(width=3)


def test_loader_workers_reach_the_trainer(device, tmp_path, loader_workers):
    out = run(FedCLFExecutor(data_root=device, workers=1, **ARGS), tmp_path, task())
    assert np.isfinite(out.get_meta_prop("loss")) and loader_workers == [1]
