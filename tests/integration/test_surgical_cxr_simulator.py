"""jobs/surgical_cxr end to end in the FLARE simulator (quick profile): NIH-like site with 14 classes, CheXpert-like
site with 13, 7 shared (the paper's configuration), plus a MIMIC-like external test set.

Marked slow; CI runs it (the README's test command runs everything).
"""

import json
import os

import pytest

from fedssl.data.cxr import CHEXPERT_CLASSES, NIH_CLASSES
from fedssl.data.cxr_synthetic import write_synthetic_surgical
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
def surgical(data, tmp_path_factory):
    ws = tmp_path_factory.mktemp("ws") / "surgical"
    return run_simulation(JOB, str(ws), n_sites=2, data_root=str(data / "{site}"), profile="quick", echo=False,
                          sets=["server.scatter_and_gather.num_rounds=2", f"client.cxr_trainer.external_test_root={data / 'mimic'}"])


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
        metrics = [m for m in read_jsonl(os.path.join(ws, site, "simulate_job", "multilabel_metrics.jsonl")) if "round" in m]
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
    assert all(0.0 <= r["mean_auroc"] <= 1.0 for r in rows.values())
    ext = res["sites"]["site-1"]["external"]
    assert set(ext["per_class"]) == set(res["global_classes"])  # the global model scores every class of the union
    assert "| site-1 | global model |" in open(os.path.join(run, "results.md")).read()


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
