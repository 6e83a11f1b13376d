"""Federated ViT fine-tuning in the FLARE simulator (quick profile, 3 sites, 2 rounds): from a tiny pre-trained MAE
encoder and from scratch (with FedProx) on retina, and FedMAE-KS's fine-tuning job on derm; the validation-selected
model is tested at every site.

Marked slow; CI runs it (the README's test command runs everything).
"""

import json
import os
import re

import pytest
import torch

from fedssl.data.image_sites import write_site_folders
from fedssl.data.image_synthetic import write_synthetic_images
from fedssl.data.images import class_names, load_image_records, select_labelled, train_val_split
from fedssl.ops.jobs import REPO_ROOT
from fedssl.models.vit import TINY_DECODER, TINY_VIT, MAEViT
from fedssl.ops.simulate import run_simulation

pytestmark = pytest.mark.slow
JOB = os.path.join(REPO_ROOT, "jobs", "sslfl_retina_finetune")
SITES = 3
VAL_FRACTION = 0.1  # the job's value (quick profile keeps it)


def write_parts(root, dataset: str, n_images: int) -> str:
    write_synthetic_images(root / "full", dataset, n_images=n_images, seed=0, image_size=40)
    write_site_folders(root / "full", dataset, root / "parts", n_sites=SITES, alpha=0.5, seed=0)
    return str(root / "parts")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_parts(tmp_path_factory.mktemp("retina"), "retina", 240)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    path = tmp_path_factory.mktemp("pre") / "FL_global_model.pt"
    torch.manual_seed(1)
    torch.save({"model": MAEViT(**TINY_VIT, **TINY_DECODER, seed=1).state_dict()}, path)  # persistor format
    return str(path)


def labelled_counts(data, dataset="retina", val_fraction=VAL_FRACTION, label_fraction=1.0):
    counts = []
    for i in range(1, SITES + 1):
        train, _ = train_val_split(load_image_records(os.path.join(data, f"site-{i}"), dataset), val_fraction, seed=0)
        counts.append(len(select_labelled(train, label_fraction, seed=0)))
    return counts


def check_run(run, data, dataset="retina", key_metric="val_accuracy", val_fraction=VAL_FRACTION, label_fraction=1.0):
    server = os.path.join(run["workspace"], "server", "simulate_job")
    with open(os.path.join(server, "test_metrics.json")) as f:
        report = json.load(f)
    # round 0 has no validation (untrained head); round 1's validation picks the round-1 global model
    assert report["model"] == "best" and report["selection"]["best_round"] == 1
    assert report["selection"]["key_metric"]["name"] == key_metric
    assert report["model_source"].startswith("best global model on validation (round 1")
    assert sorted(report["sites"]) == [f"site-{i}" for i in range(1, SITES + 1)] and report["failed_sites"] == []
    n_test = len(load_image_records(os.path.join(data, "test"), dataset))
    for metrics in report["sites"].values():
        assert metrics["n"] == n_test and 0.0 <= metrics["accuracy"] <= 1.0
        assert set(metrics["per_class"]) == set(class_names(dataset))
    for name in ("test_metrics.md", "test_metrics.png", "summary.json"):
        assert os.path.getsize(os.path.join(server, name)) > 0
    assert run["test_evaluation"]["model"] == "best"  # RunSummary's summary.json carries the test evaluation
    # FedAvg weights = labelled images per site (sorted by site name), every round
    log = open(run["log"]).read()
    expected = ", ".join(f"{n:g}" for n in labelled_counts(data, dataset, val_fraction, label_fraction))
    weights = re.findall(r"aggregated 3/3 sites, weights \(num_samples\): ([0-9, ]+)", log)
    assert weights == [expected, expected]
    return log


def test_finetune_from_pretrained_encoder(data, pretrained, tmp_path):
    run = run_simulation(JOB, str(tmp_path / "ws"), n_sites=SITES, data_root=os.path.join(data, "{site}"),
                         profile="quick", echo=False, sets=["server.scatter_and_gather.num_rounds=2",
                                           f"server.model.pretrained_path={pretrained}"])
    log = check_run(run, data)
    assert f"encoder initialised from pretrained weights {pretrained}" in log


def test_finetune_from_scratch_with_fedprox(data, tmp_path):
    run = run_simulation(JOB, str(tmp_path / "ws"), n_sites=SITES, data_root=os.path.join(data, "{site}"),
                         profile="quick", echo=False, sets=["server.scatter_and_gather.num_rounds=2",
                                           "client.cls_trainer.fedprox_mu=0.001"])
    log = check_run(run, data)
    assert "encoder initialised from" not in log


def test_fedmae_ks_finetune_on_derm(tmp_path, pretrained):
    """jobs/fedmae_derm_finetune: 8 ISIC classes, selection on validation macro F1, FedMAE's metric table."""
    data = write_parts(tmp_path / "derm", "derm", 320)
    job = os.path.join(REPO_ROOT, "jobs", "fedmae_derm_finetune")
    run = run_simulation(job, str(tmp_path / "ws"), n_sites=SITES, data_root=os.path.join(data, "{site}"),
                         profile="quick", echo=False, sets=["server.scatter_and_gather.num_rounds=2",
                                           f"server.model.pretrained_path={pretrained}"])
    # the job's validation fraction and labelled fraction (FedMAE-KS: 80% labelled); the quick profile keeps both
    log = check_run(run, data, "derm", "val_macro_f1", val_fraction=0.25, label_fraction=0.8)
    assert f"encoder initialised from pretrained weights {pretrained}" in log
    with open(os.path.join(run["workspace"], "server", "simulate_job", "test_metrics.json")) as f:
        mean = json.load(f)["mean"]
    for name in ("macro_recall", "macro_precision", "macro_f1", "macro_specificity", "auc", "accuracy"):
        assert mean[name] is None or 0.0 <= mean[name] <= 1.0, name
