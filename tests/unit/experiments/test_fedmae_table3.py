"""Table III runner (fedssl.experiments.fedmae_table3): settings, the runs each method makes (job, overrides), the
init each client starts from, rows and verdicts by hand, the paper's numbers beside them, resume; and one real
client fine-tuning per family on a tiny synthetic partition."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from fedssl.core.seeds import site_seed
from fedssl.data.images import load_image_records, train_val_split
from fedssl.experiments import fedmae_table3 as t3
from fedssl.models.resnet import PretrainingResNet

torch.set_num_threads(1)


class FakeSimulator:
    """Writes what a finished pre-training leaves: a global model and, for the CNN job, each client's checkpoint."""

    def __init__(self):
        self.calls = []

    def __call__(self, job_dir, workspace, *, n_sites, data_root, profile, sets, echo):
        self.calls.append({"job": os.path.basename(job_dir), "sets": list(sets), "data_root": data_root})
        run_dir = os.path.join(workspace, "server", "simulate_job")
        os.makedirs(run_dir, exist_ok=True)
        model = os.path.join(run_dir, "FL_global_model.pt")
        torch.save({"model": PretrainingResNet("moco", 4, 8, seed=len(self.calls)).state_dict()}, model)
        for k in range(1, n_sites + 1):
            os.makedirs(os.path.join(workspace, f"site-{k}", "simulate_job"), exist_ok=True)
            torch.save({"trainer": {"model": PretrainingResNet("moco", 4, 8, seed=100 + k).state_dict()}},
                       os.path.join(workspace, f"site-{k}", "simulate_job", "fedclf_client_state.pt"))
        return {"global_model": model, "workspace": workspace, "simulator_wall_time_s": 2.0,
                "bytes_per_site_per_round": {"up": 10, "down": 20}}


def metrics(recall: float) -> dict:
    return {"balanced_accuracy": recall, "macro_precision": 0.5, "macro_f1": 0.4, "macro_specificity": 0.9,
            "auc": 0.8, "accuracy": 0.6, "per_class": {"x": 1}}


@pytest.fixture
def fakes(monkeypatch):
    seen = []
    heads = {k: PretrainingResNet("moco", 4, 8, seed=100 + k).state_dict()["main.head.0.weight"] for k in range(1, 11)}

    def cnn(train, val, test, *, init, site, label_fraction, **kw):
        k = int(site.split("-")[1])
        own = heads[k]
        kind = "random" if init is None else "own" if torch.equal(init["main.head.0.weight"], own) else "global"
        seen.append(("cnn", site, kind, label_fraction, kw["depth"], kw["epochs"]))
        return {"site": site, "test": metrics({"random": 0.30, "own": 0.32, "global": 0.36}[kind] + 0.01 * (k % 2))}

    def vit(site, root, test_root, dataset, settings, pretrained_path=""):
        k = int(site.split("-")[1])
        seen.append(("vit", site, bool(pretrained_path), settings["label_fraction"], settings["epochs"], dataset))
        return {"site": site, "best_epoch": 0, "n_labelled": 5,
                "test": metrics((0.40 if pretrained_path else 0.35) + 0.02 * (k % 2))}

    monkeypatch.setattr(t3, "local_finetune_device", cnn)
    monkeypatch.setattr(t3, "finetune_site", vit)
    monkeypatch.setattr(t3, "load_image_records", lambda root, dataset, site: list(range(20)))
    monkeypatch.setattr(t3, "train_val_split", lambda records, fraction, seed: (records[:15], records[15:]))
    return seen


def test_settings_and_refusals():
    s = t3.table3_settings("quick")
    assert s["methods"] == list(t3.METHODS) and s["val_fraction"] == 0.25
    with pytest.raises(ValueError, match="methods=.*'moco'"):
        t3.table3_settings("quick", methods=["moco"])
    with pytest.raises(ValueError, match="n_images=100"):
        t3.table3_settings("quick", n_images=100)
    with pytest.raises(ValueError, match="val_fraction=1.0"):
        t3.table3_settings("quick", val_fraction=1.0)


def test_runs_inits_rows_verdicts_and_resume(tmp_path, fakes):
    sim = FakeSimulator()
    s = t3.table3_settings("quick", methods=["random", "local_cl", "fedclf", "vit_random", "fedmae"])
    parts = tmp_path / "parts"
    parts.mkdir()
    out = str(tmp_path / "out")
    said = []
    t3.run_table3(out, s, data_root=str(parts), say=said.append, simulate=sim)
    # one pre-training per pre-trained method: the CNN ones on jobs/fedclf_derm at ResNet-50 on the partition sites
    assert [c["job"] for c in sim.calls] == ["fedclf_derm", "fedclf_derm", "fedmae_derm"]
    for c in sim.calls[:2]:
        assert {'client.fedclf_trainer.split=""', "client.fedclf_trainer.dataset=derm", "shape.depth=50",
                "server.scatter_and_gather.min_clients=10"} <= set(c["sets"])
        assert c["data_root"] == os.path.join(str(parts), "{site}")
    assert "client.fedclf_trainer.federated=false" in sim.calls[0]["sets"]  # Local CL's switches
    assert not any("fedclf_trainer" in x for x in sim.calls[2]["sets"])
    # every client fine-tunes from the right init: random, its own (Local CL), the global; 80 % labels
    cnn = [x for x in fakes if x[0] == "cnn"]
    assert [x[2] for x in cnn] == ["random"] * 10 + ["own"] * 10 + ["global"] * 10
    assert {x[3] for x in cnn} == {0.8} and {x[4] for x in cnn} == {50}
    vit = [x for x in fakes if x[0] == "vit"]
    assert [x[2] for x in vit] == [False] * 10 + [True] * 10 and {(x[3], x[5]) for x in vit} == {(0.8, "derm")}
    table = json.load(open(os.path.join(out, "tableIII.json")))
    rows = {(r["method"], r["column"]): r for r in table["rows"]}
    fed = [100 * (0.36 + 0.01 * (k % 2)) for k in range(1, 11)]
    assert rows[("CNN: FedCLF", "Recall")]["mean"] == pytest.approx(np.mean(fed))
    assert rows[("CNN: FedCLF", "Recall")]["std"] == pytest.approx(np.std(fed))
    assert rows[("ViT: FedMAE", "AUC")]["mean"] == pytest.approx(80.0) and rows[("ViT: FedMAE", "AUC")]["n"] == 10
    assert len(table["rows"]) == 5 * 6
    paper = {(r["method"], r["column"]): r["mean"] for r in table["paper"]["rows"]}
    assert paper[("CNN: FedCLF", "Recall")] == 37.52 and paper[("ViT: FedMAE", "Accuracy")] == 64.80
    assert ("CNN: FedMoCo", "Recall") not in paper  # only the methods run
    notes = " ".join(table["notes"])
    assert "CNN: FedCLF vs CNN: Random Init.: +6.00 +- 0.00" in notes and "helped" in notes
    assert "ViT: FedMAE vs ViT: Random Init.: +5.00 +- 0.00" in notes
    assert table["footer"] == ["one seed (0): not a finding; run the table again with --seed 1 and --seed 2, one --out "
                               "per seed (a method's sign can change from one seed to the next)"]
    costs = json.load(open(os.path.join(out, "pretraining.json")))
    assert costs["fedmae"]["bytes_per_site_per_round"] == {"up": 10, "down": 20}
    # resume: nothing re-runs
    n_calls, n_seen = len(sim.calls), len(fakes)
    t3.run_table3(out, s, data_root=str(parts), say=said.append, simulate=sim)
    assert len(sim.calls) == n_calls and len(fakes) == n_seen


def test_real_client_fine_tuning_of_each_family_on_a_tiny_partition(tmp_path):
    """No fakes: synthetic ISIC 2019 (8 classes), 10 IID clients + test, one CNN (ResNet-50) and one ViT client."""
    s = t3.table3_settings("quick", n_images=240, image_px=32, cnn_local={"epochs": 1, "batch_size": 8},
                           vit_local={"epochs": 1, "batch_size": 8, "warmup": 0})
    parts = t3.prepare_partition(str(tmp_path), s, say=lambda m: None)
    part = json.load(open(os.path.join(parts, "partition.json")))
    assert part["n_sites"] == 10 and part["split"] == "iid" and len(part["classes"]) == 8
    assert sum(v["n_images"] for v in part["sites"].values()) + part["test"]["n_images"] == 240
    cnn = t3.local_one({"method": "random", "site": "site-3"}, parts, s, {})
    vit = t3.local_one({"method": "vit_random", "site": "site-3"}, parts, s, {})
    for row in (cnn, vit):
        assert set(t3.METRIC_KEYS.values()) <= set(row["test"])
        assert row["test"]["n"] == part["test"]["n_images"]  # tested on the held-out test set
    # 80 % of each class of the client's training split (val_fraction 0.25 held out), counted by hand
    records = load_image_records(os.path.join(parts, "site-3"), "derm", site="site-3")
    train, val = train_val_split(records, 0.25, seed=site_seed(0, "site-3"))
    per_class = np.bincount([r.label for r in train])
    assert vit["n_labelled"] == sum(max(1, round(0.8 * n)) for n in per_class if n)
    assert cnn["label_fraction"] == 0.8 and cnn["site"] == "site-3" and len(val) > 0
    assert t3.cnn_local_settings(s)["depth"] == 50
