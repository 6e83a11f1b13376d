"""MultiLabelExecutor: argument checks, per-site class declaration, losses of the baselines, loading broadcasts."""

import json
import os

import numpy as np
import pytest
import torch

from fedssl.core.multilabel import expand_targets, masked_bce
from fedssl.core.state_dict import match_keys
from fedssl.flare.multilabel_executor import MultiLabelExecutor
from fedssl.jobtools import REPO_ROOT
from fedssl.models.densenet import MultiLabelDenseNet, is_bn_key
from tests.unit.flare.fakes import FakeEngine, context

TINY = dict(growth_rate=8, block_config=[2, 2, 2, 2], num_init_features=16, hidden_features=4)


def executor(method, site_classes, head_classes, backbone="fedavg"):
    ex = MultiLabelExecutor(classes=site_classes, **TINY)
    ex._site_classes, ex._head_classes = list(site_classes), list(head_classes)
    ex._switches = {"method": method, "backbone": backbone}
    return ex


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


def test_vanilla_treats_missing_classes_as_negative():
    # site holds A, C of head [A, B, C]; logits 0 -> BCE log(2) per entry whatever the target
    ex = executor("vanilla", ["A", "C"], ["A", "B", "C"])
    logits = torch.tensor([[5.0, 5.0, -5.0]])
    y = torch.tensor([[1.0, 0.0]])  # A positive, C negative
    loss = ex._loss(logits, y, "site-1")
    # all three columns count; B (non-local) has target 0 and a logit of +5: a large penalty
    sp = torch.nn.functional.softplus
    expected = (sp(torch.tensor(-5.0)) + sp(torch.tensor(5.0)) + sp(torch.tensor(-5.0))) / 3
    assert torch.isclose(loss, expected)


def test_partial_loss_masks_non_local_classes():
    ex = executor("partial_loss", ["A", "C"], ["A", "B", "C"])
    y = torch.tensor([[1.0, 0.0]])
    a = ex._loss(torch.tensor([[5.0, 5.0, -5.0]]), y, "site-1")
    b = ex._loss(torch.tensor([[5.0, -40.0, -5.0]]), y, "site-1")  # the non-local logit does not matter
    assert torch.isclose(a, b)
    sp = torch.nn.functional.softplus
    assert torch.isclose(a, (sp(torch.tensor(-5.0)) * 2) / 2)  # mean over the 2 local entries only
    full, mask = expand_targets(y, ["A", "C"], ["A", "B", "C"], missing="ignore")
    assert full.tolist() == [[1.0, 0.0, 0.0]] and mask.tolist() == [[1.0, 0.0, 1.0]]


def test_surgical_loss_is_plain_bce_on_own_head():
    ex = executor("surgical", ["C", "A"], ["C", "A"])
    logits, y = torch.tensor([[1.0, -2.0]]), torch.tensor([[1.0, 0.0]])
    assert torch.isclose(ex._loss(logits, y, "s"), torch.nn.functional.binary_cross_entropy_with_logits(logits, y))
    with pytest.raises(ValueError, match="drops every entry"):
        masked_bce(logits, y, torch.zeros_like(y))


def test_load_received_keeps_local_tensors_and_rejects_surprises():
    ex = executor("surgical", ["A", "B"], ["A", "B"], backbone="fedbn")
    model = MultiLabelDenseNet(["A", "B"], 8, (2, 2, 2, 2), 16, hidden_features=4, seed=0)
    other = MultiLabelDenseNet(["A", "B"], 8, (2, 2, 2, 2), 16, hidden_features=4, seed=1)
    bn_before = {k: v.clone() for k, v in model.state_dict().items() if is_bn_key(k)}
    sent = {k: v.numpy() for k, v in other.state_dict().items() if not is_bn_key(k)}  # BN held back (FedBN)
    assert ex.load_received(model, sent, "site-1") == len(sent)
    st = model.state_dict()
    assert all(torch.equal(st[k], v) for k, v in bn_before.items())  # own batch-norm kept
    assert torch.equal(st["features.conv0.weight"], other.state_dict()["features.conv0.weight"])
    with pytest.raises(ValueError, match="keys this model lacks"):
        ex.load_received(model, {**sent, "extra.weight": np.zeros(1)}, "site-1")
    with pytest.raises(ValueError, match="lacks 1 tensors"):
        ex.load_received(model, {k: v for k, v in sent.items() if k != "features.conv0.weight"}, "site-1")
    with pytest.raises(ValueError, match="shape"):
        ex.load_received(model, {**sent, "classifier.bias": np.zeros(3, np.float32)}, "site-1")


def test_job_batchnorm_patterns_match_exactly_the_batchnorm_keys():
    from fedssl.flare.backbone_exclusion import BackboneBNExclusion

    with open(os.path.join(REPO_ROOT, "jobs", "surgical_cxr", "app", "config", "config_fed_client.json")) as f:
        client = json.load(f)
    spec = client["task_result_filters"][0]["filters"][0]
    assert spec["path"] == "fedssl.flare.backbone_exclusion.BackboneBNExclusion"
    patterns = BackboneBNExclusion(**spec["args"]).patterns
    keys = list(MultiLabelDenseNet(["A"], 8, (2, 2, 2, 2), 16, hidden_features=4).state_dict())
    assert match_keys(keys, patterns) == [k for k in keys if is_bn_key(k)] != []
