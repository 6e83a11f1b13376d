"""jobs/surgical_cxr end to end in the FLARE simulator (quick profile): NIH-like site with 14 classes, CheXpert-like
site with 13, 7 shared (the paper's configuration), plus a MIMIC-like external test set.

Marked slow; CI runs it (the README's test command runs everything).
"""

import json
import os

import numpy as np
import pytest
import torch

from fedssl.data.cxr import CHEXPERT_CLASSES, NIH_CLASSES
from fedssl.core.safe_load import safe_load
from fedssl.data.cxr_synthetic import write_synthetic_surgical
from fedssl.models.densenet import TinyDenseNet
from fedssl.ops.jobs import REPO_ROOT
from fedssl.ops.simulate import SimulationError, run_simulation

pytestmark = pytest.mark.slow
JOB = os.path.join(REPO_ROOT, "jobs", "surgical_cxr")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("cxr")
    write_synthetic_surgical(root, n_patients=60, seed=0, image_size=64)  # + 30 external (MIMIC-like) patients
    return root


@pytest.fixture(scope="module")
def stand_in_imagenet(tmp_path_factory):
    """A stand-in for the ImageNet checkpoint with non-default batch-norm statistics (running mean 0.5, var 4; torch's
    defaults are 0 / 1), in the quick profile's tiny shape; given to the server's model only."""
    sd = {k: v for k, v in TinyDenseNet(["A"], seed=5).state_dict().items() if k.startswith("features.")}
    for k, v in sd.items():
        if k.endswith("running_mean"):
            v.fill_(0.5)
        elif k.endswith("running_var"):
            v.fill_(4.0)
    path = tmp_path_factory.mktemp("imagenet") / "stand_in_densenet.pth"
    torch.save(sd, path)
    return path


@pytest.fixture(scope="module")
def surgical(data, stand_in_imagenet, tmp_path_factory):
    ws = tmp_path_factory.mktemp("ws") / "surgical"
    return run_simulation(JOB, str(ws), n_sites=2, data_root=str(data / "{site}"), profile="quick", echo=False,
                          sets=["server.scatter_and_gather.num_rounds=2",
                                f"client.cxr_trainer.external_test_root={data / 'mimic'}",
                                f"server.model.imagenet_path={stand_in_imagenet}"])


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_run_completes_and_registers_14_plus_13_classes(surgical):
    run = os.path.join(surgical["workspace"], "server", "simulate_job")
    with open(os.path.join(run, "classes.json")) as f:
        reg = json.load(f)
    assert reg["site_classes"] == {"site-1": list(NIH_CLASSES), "site-2": list(CHEXPERT_CLASSES)}
    assert len(reg["global_classes"]) == 20 and len(reg["shared_classes"]) == 7
    assert [r["round"] for r in surgical["rounds"]] == [0, 1]
    assert all(r["aggregated_sites"] == 2 for r in surgical["rounds"])


def test_each_site_receives_only_its_own_head_rows(surgical):
    ws = surgical["workspace"]
    for site, n in (("site-1", 14), ("site-2", 13)):
        metrics = [m for m in read_jsonl(os.path.join(ws, site, "simulate_job", "multilabel_metrics.jsonl"))
                   if "round" in m]
        assert [m["received_head_shape"][0] for m in metrics] == [n, n]
    # the download of the site holding one class more is larger by one head row (16 floats + 1 bias in the tiny model)
    comm = read_jsonl(os.path.join(ws, "server", "simulate_job", "communication.jsonl"))
    down = {(r["site"], r["round"]): r["weights"] for r in comm if r["direction"] == "download"}
    assert down[("site-1", 1)] > down[("site-2", 1)]


def test_results_table_and_plot_written(surgical):
    run = os.path.join(surgical["workspace"], "server", "simulate_job")
    for name in ("results.md", "results.json", "auroc.png", "test_metrics.json", "summary.json"):
        assert os.path.getsize(os.path.join(run, name)) > 0, name
    with open(os.path.join(run, "results.json")) as f:
        res = json.load(f)
    rows = {r["site"]: r for r in res["table"]["sites"]}
    assert rows["site-1"]["n_classes"] == 14 and rows["site-2"]["n_classes"] == 13
    for site, row in rows.items():  # a site's mean AUROC is the mean over its classes with a defined AUROC
        defined = [e["auroc"] for e in res["sites"][site]["test"]["per_class"].values() if e["auroc"] is not None]
        assert row["mean_auroc"] == pytest.approx(float(np.mean(defined)))
    ext = res["sites"]["site-1"]["external"]
    assert set(ext["per_class"]) == set(res["global_classes"])  # the global model scores every class of the union
    assert "| site-1 | global model |" in open(os.path.join(run, "results.md")).read()


def test_fedbn_plus_sites_run_at_the_servers_initial_batchnorm_statistics(surgical, stand_in_imagenet):
    """Issue 13 item 1: only the server loads the stand-in checkpoint; the round-0 broadcast carries its batch-norm
    statistics to both sites, which freeze them (FedBN+): after round 1 every site BN layer holds 0.5 / 4 (before the
    fix: torch's defaults 0 / 1).  The server says which initial weights the run uses."""
    for site in ("site-1", "site-2"):
        state = safe_load(os.path.join(surgical["workspace"], site, "simulate_job", "multilabel_client_state.pt"))
        model = state["trainer"]["model"]
        means = [v for k, v in model.items() if k.endswith("running_mean")]
        variances = [v for k, v in model.items() if k.endswith("running_var")]
        assert len(means) == 21 and all(torch.all(v == 0.5) for v in means), site
        assert all(torch.all(v == 4.0) for v in variances), site
    log = open(surgical["workspace"] + "_simulator.log").read()
    assert f"initial weights: imagenet from {stand_in_imagenet}" in log


def test_unknown_class_name_stops_the_run_naming_the_site(data, tmp_path):
    ws = tmp_path / "bad"
    os.makedirs(ws / "local")
    bad = [("Effusion" if c == "Pleural Effusion" else c) for c in CHEXPERT_CLASSES]
    with open(ws / "local" / "fedssl_site.json", "w") as f:
        json.dump({"classes": {"site-1": list(NIH_CLASSES), "site-2": bad}}, f)
    with pytest.raises(SimulationError) as err:
        run_simulation(JOB, str(ws), n_sites=2, data_root=str(data / "{site}"), profile="quick", echo=False,
                       sets=["server.scatter_and_gather.num_rounds=1", "client.cxr_trainer.classes=[]"])
    log = open(str(ws) + "_simulator.log").read()
    assert "REJECTED class declaration" in log and "site site-2: classes ['Effusion']" in log
    assert "REJECTED" in str(err.value)
