"""MultiLabelExecutor: argument checks, per-site class declaration, the round protocol around MultiLabelLocalTrainer
(reply meta and headers, validation of the received model, abort, restart), the test task.  The training math
(losses, warm-up, FedBN+, checked loading) is tested in tests/unit/train/test_multilabel.py."""

import json
import os
import re
import shutil

import numpy as np
import pytest
import torch
from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.signal import Signal
from nvflare.app_common.app_constant import AppConstants

from fedssl.core.state_dict import match_keys
from fedssl.flare.constants import BACKBONE_HEADER
from fedssl.flare.multilabel_executor import MultiLabelExecutor
from fedssl.ops.jobs import REPO_ROOT
from fedssl.models.densenet import MultiLabelDenseNet, is_bn_key
from tests.unit.flare.fakes import FakeEngine, context

TINY = dict(growth_rate=8, block_config=[2, 2, 2, 2], num_init_features=16, hidden_features=4)
C_K = ["Atelectasis", "Cardiomegaly", "Pleural Effusion", "Infiltration", "Mass", "Nodule", "Pneumonia",
       "Pneumothorax", "Consolidation", "Edema", "Emphysema", "Fibrosis", "Pleural Thickening", "Hernia"]


@pytest.mark.parametrize("args, match", [
    ({"lr": 0}, "lr=0"), ({"batch_size": 1}, "batch_size"), ({"dataset": "padchest"}, "dataset"),
    ({"classes": ["Edema", "Edema"]}, "twice"), ({"classes": {"site-1": ["A", ""]}}, "site-1"),
    ({"split": [0.5, 0.5, 0.5]}, "split"), ({"block_config": [2, 2]}, "block_config"), ({"rotation": 2}, "rotation"),
    ({"warmup_epochs": -1}, "warmup_epochs"), ({"flip": "no"}, "flip"),
])
def test_argument_errors_name_argument(args, match):
    with pytest.raises(ValueError, match=match):
        MultiLabelExecutor(**args)


def test_classes_per_site_from_argument_mapping_or_site_config(tmp_path):
    ex = MultiLabelExecutor(classes={"site-1": ["Edema", "Mass"], "site-2": ["Fracture"]})
    assert ex.site_classes(context(site="site-2", engine=FakeEngine(tmp_path))) == ["Fracture"]
    with pytest.raises(ValueError, match="no entry for site-3"):
        ex.site_classes(context(site="site-3", engine=FakeEngine(tmp_path)))
    with open(tmp_path / "fedssl_site.json", "w") as f:
        json.dump({"classes": ["Hernia", "Edema"]}, f)
    assert MultiLabelExecutor().site_classes(context(site="site-7", engine=FakeEngine(tmp_path))) == ["Hernia", "Edema"]
    with open(tmp_path / "fedssl_site.json", "w") as f:
        json.dump({"classes": ["Hernia", "Hernia"]}, f)
    with pytest.raises(ValueError, match=r"site-7.*twice.*fedssl_site.json"):
        MultiLabelExecutor().site_classes(context(site="site-7", engine=FakeEngine(tmp_path)))
    os.remove(tmp_path / "fedssl_site.json")
    with pytest.raises(ValueError, match="site-7: no classes configured"):
        MultiLabelExecutor().site_classes(context(site="site-7", engine=FakeEngine(tmp_path)))


def test_job_batchnorm_patterns_match_exactly_the_batchnorm_keys():
    from fedssl.flare.backbone_exclusion import BackboneBNExclusion

    with open(os.path.join(REPO_ROOT, "jobs", "surgical_cxr", "app", "config", "config_fed_client.json")) as f:
        client = json.load(f)
    spec = client["task_result_filters"][0]["filters"][0]
    assert spec["path"] == "fedssl.flare.backbone_exclusion.BackboneBNExclusion"
    patterns = BackboneBNExclusion(**spec["args"]).patterns
    keys = list(MultiLabelDenseNet(["A"], 8, (2, 2, 2, 2), 16, hidden_features=4).state_dict())
    assert match_keys(keys, patterns) == [k for k in keys if is_bn_key(k)] != []


# ---------------------------------------------------------------------------------------------- the round protocol
@pytest.fixture(scope="module")
def site_root(tmp_path_factory):
    from fedssl.data.cxr_synthetic import write_synthetic_nih

    root = tmp_path_factory.mktemp("cxr") / "site-1"
    write_synthetic_nih(root, 12, seed=0, image_size=32)
    return root


def make_executor(root, **kw):
    args = dict(data_root=str(root), dataset="nih", classes=C_K, image_size=32, batch_size=4, warmup_epochs=1,
                local_epochs=1, max_steps_per_epoch=1, n_bootstrap=0, device="cpu", **TINY)
    return MultiLabelExecutor(**{**args, **kw})


def initial_state(classes=C_K):
    return {k: v.numpy() for k, v in MultiLabelDenseNet(classes, 8, (2, 2, 2, 2), 16,
                                                        hidden_features=4).state_dict().items()}


def run_task(ex, run_dir, name, data, meta, round_idx=0, aborted=False):
    task = DXO(DataKind.WEIGHTS, data=data, meta=meta).to_shareable()
    task.set_header(AppConstants.CURRENT_ROUND, round_idx)
    task.set_header(AppConstants.NUM_ROUNDS, 3)
    signal = Signal()
    if aborted:
        signal.trigger("abort")
    return ex.execute(name, task, context(site="site-1", engine=FakeEngine(run_dir)), signal)


def records(run_dir):
    with open(os.path.join(run_dir, "multilabel_metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


SURGICAL = {"method": "surgical", "backbone": "fedbn"}


def test_declare_then_train_rounds_reply_with_classes_validation_and_backbone_header(site_root, tmp_path):
    ex = make_executor(site_root)
    declared = from_shareable(run_task(ex, tmp_path, "declare_classes", {}, SURGICAL))
    assert (declared.get_meta_prop("classes").tolist() == C_K
            and declared.get_meta_prop("num_samples") == ex.splits["n_train"])
    sent = initial_state()
    r0 = run_task(ex, tmp_path, "train", sent, SURGICAL, 0)
    assert r0.get_header(BACKBONE_HEADER) == "fedbn"  # read by the BackboneBNExclusion upload filter
    d0 = from_shareable(r0)
    assert d0.data_kind == DataKind.WEIGHTS and set(d0.data) == set(sent)  # BN goes to the upload filter
    meta = d0.get_meta_props()
    assert meta["classes"].tolist() == C_K and meta["num_samples"] == ex.splits["n_train"]
    assert meta[MetaKey.NUM_STEPS_CURRENT_ROUND] == 1 and MetaKey.INITIAL_METRICS not in meta
    back = {k: v for k, v in d0.data.items() if not is_bn_key(k)}  # as the server sends it under FedBN
    d1 = from_shareable(run_task(ex, tmp_path, "train", back, SURGICAL, 1))
    assert set(d1.get_meta_prop(MetaKey.INITIAL_METRICS)) == {"val_loss", "val_auroc"}
    rec = records(tmp_path)
    assert [r["round"] for r in rec] == [0, 1] and "warmup_loss" in rec[0] and "warmup_loss" not in rec[1]
    assert [r["received_head_shape"] for r in rec] == [[14, 4], [14, 4]]
    assert rec[1]["val_loss"] == d1.get_meta_prop(MetaKey.INITIAL_METRICS)["val_loss"]
    assert rec[1]["received_tensors"] == len(back) and rec[1]["steps"] == 1


def test_personalised_keeps_its_head_and_individual_uploads_nothing(site_root, tmp_path):
    os.makedirs(tmp_path / "p")
    os.makedirs(tmp_path / "i")
    sent = {k: v for k, v in initial_state().items() if not k.startswith("classifier.")}
    d = from_shareable(run_task(make_executor(site_root), tmp_path / "p", "train", sent,
                                {"method": "personalised", "backbone": "fedavg"}))
    assert set(d.data) == set(sent)
    d = from_shareable(run_task(make_executor(site_root), tmp_path / "i", "train", sent,
                                {"method": "individual", "backbone": "fedavg"}))
    assert d.data == {} and d.get_meta_prop("loss") > 0


def test_abort_returns_task_aborted_and_writes_no_checkpoint(site_root, tmp_path):
    reply = run_task(make_executor(site_root), tmp_path, "train", initial_state(), SURGICAL, aborted=True)
    assert reply.get_return_code() == ReturnCode.TASK_ABORTED
    assert not os.path.exists(tmp_path / "multilabel_client_state.pt")


def test_a_restarted_client_resumes_where_it_stopped(site_root, tmp_path):
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    os.makedirs(a_dir)
    a = make_executor(site_root, dropout=0.3)
    d0 = from_shareable(run_task(a, a_dir, "train", initial_state(), SURGICAL, 0))
    shutil.copytree(a_dir, b_dir)
    torch.manual_seed(1)
    da = from_shareable(run_task(a, a_dir, "train", d0.data, SURGICAL, 1))
    b = make_executor(site_root, dropout=0.3)  # a new process: data, trainer and state from the checkpoint
    torch.manual_seed(1)
    db = from_shareable(run_task(b, b_dir, "train", d0.data, SURGICAL, 1))
    assert da.get_meta_prop("loss") == db.get_meta_prop("loss")
    assert all(np.array_equal(da.data[k], db.data[k]) for k in da.data)
    assert "warmup_loss" not in records(b_dir)[-1]  # warmed up before the restart


def test_run_switches_and_registered_classes_are_fixed(site_root, tmp_path, caplog):
    ex = make_executor(site_root)
    run_task(ex, tmp_path, "train", initial_state(), SURGICAL, 0)
    cases = [({}, {"method": "vanilla", "backbone": "fedbn"}, "switched from"),
             ({}, {**SURGICAL, "classes": np.asarray(["Edema"])}, r"registered this site's classes as \['Edema'\]"),
             ({"classifier.bias": np.zeros(3, np.float32)}, SURGICAL, r"classifier.bias has shape \(3,\)"),
             ({}, {"method": "fedprox", "backbone": "fedbn"}, "method='fedprox'")]
    for change, meta, message in cases:
        caplog.clear()
        reply = run_task(ex, tmp_path, "train", {**initial_state(), **change}, meta, 1)
        assert reply.get_return_code() == ReturnCode.EXECUTION_EXCEPTION
        assert re.search(f"site-1: task train failed: site-1: .*{message}", caplog.text), caplog.text


def test_test_task_scores_the_global_model_on_the_sites_classes(site_root, tmp_path, caplog):
    network = C_K + ["Fracture"]
    ex = make_executor(site_root)
    run_task(ex, tmp_path, "train", initial_state(), SURGICAL, 0)
    full = {k: v for k, v in initial_state(network).items() if not is_bn_key(k)}  # BN stays on the site (FedBN)
    # without the network's classes (HeadSlicer(full_head=true) missing on the server) the site cannot score it
    assert run_task(ex, tmp_path, "test", full, SURGICAL, 1).get_return_code() == ReturnCode.EXECUTION_EXCEPTION
    assert "the test task needs the network's classes (meta 'global_classes'); put HeadSlicer" in caplog.text
    res = from_shareable(run_task(ex, tmp_path, "test", full, {**SURGICAL, "global_classes": np.asarray(network)}, 1))
    assert res.data_kind == DataKind.METRICS and res.data["model"] == "global model"
    assert list(res.data["test"]["per_class"]) == C_K and res.data["n_test"] == ex.splits["n_test"]
    assert records(tmp_path)[-1]["task"] == "test" and "test_mean_auroc" in records(tmp_path)[-1]
    personal = {"method": "personalised", "backbone": "fedavg"}
    os.makedirs(tmp_path / "p")
    ex = make_executor(site_root)
    sent = {k: v for k, v in initial_state().items() if not k.startswith("classifier.")}
    run_task(ex, tmp_path / "p", "train", sent, personal, 0)
    res = from_shareable(run_task(ex, tmp_path / "p", "test", sent, personal, 1))
    assert res.data["model"] == "personalised model" and list(res.data["test"]["per_class"]) == C_K
