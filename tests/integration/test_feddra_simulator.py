"""FedDRA's jobs end to end in the FLARE simulator (quick profile: tiny ViT / BERT, 2 turns): the vocabulary
exchange, two-stage turns with DRO weights on 3 LDA clients of synthetic MIMIC-CXR, the retrieval test on every
client; and the retina job as plain FedAvg (the switches) on MESSIDOR-2 + BRSET layouts.  Marked slow."""

import json
import os

import pytest

from fedssl.data.vlp import load_brset, load_messidor2, load_mimic_vlp, write_client_manifests, write_source_manifests
from fedssl.ops.jobs import REPO_ROOT
from fedssl.ops.simulate import run_simulation, server_run_dir

pytestmark = pytest.mark.slow
JOBS = os.path.join(REPO_ROOT, "jobs")


def test_feddra_mimic_runs_two_stage_turns_with_dro_weights(tmp_path):
    from fedssl.data.vlp_synthetic import write_synthetic_mimic

    write_synthetic_mimic(str(tmp_path / "raw"), n_patients=60, image_px=32, seed=0)
    records, _ = load_mimic_vlp(str(tmp_path / "raw"), site="synthetic")
    write_client_manifests(records, str(tmp_path / "sites"), n_clients=3, alpha=1.0, seed=0)
    run = run_simulation(os.path.join(JOBS, "feddra_mimic"), str(tmp_path / "ws"), n_sites=3,
                         data_root=str(tmp_path / "sites" / "{site}"), profile="quick", echo=False)
    assert [r["round"] for r in run["rounds"]] == [0, 1] and all(r["aggregated_sites"] == 3 for r in run["rounds"])
    log = open(run["log"]).read()
    assert "vocabulary of 512 tokens" in log
    assert log.count("align: loss") == 6 and log.count("full_model: loss") == 6  # 3 sites x 2 turns x 2 stages
    run_dir = server_run_dir(run["workspace"])
    trajectory = json.load(open(os.path.join(run_dir, "dro_weights.json")))["trajectory"]
    assert [t["turn"] for t in trajectory] == [0, 1]
    assert all(sum(t["lambda"].values()) == pytest.approx(1.0) and len(t["lambda"]) == 3 for t in trajectory)
    report = json.load(open(os.path.join(run_dir, "test_metrics.json")))
    assert sorted(report["sites"]) == ["site-1", "site-2", "site-3"]
    for site, m in report["sites"].items():
        # each site tested its own test split: as many pairs as its manifest's test rows, and a recall is a whole
        # number of hits out of them
        rows = open(tmp_path / "sites" / site / "manifest.csv").read().splitlines()[1:]
        assert m["n_pairs"] == sum(",test," in r for r in rows)
        assert m["retrieval_batch"] == min(100, m["n_pairs"])  # the gallery its chance level is computed for
        for k in ("R@1", "R@5"):
            assert m[k] * m["n_pairs"] == pytest.approx(round(m[k] * m["n_pairs"]), abs=1e-6)
    # a turn moves the whole model up and down once plus the alignment part once each way
    comm = run["communication_per_round"][0]
    assert comm["upload"]["weights"] == pytest.approx(comm["download"]["weights"], rel=0.01)


def test_feddra_retina_as_fedavg_on_two_sources(tmp_path):
    from fedssl.data.vlp_synthetic import write_synthetic_brset, write_synthetic_messidor2

    write_synthetic_messidor2(str(tmp_path / "messidor2"), n_images=40, image_px=32, seed=0)
    write_synthetic_brset(str(tmp_path / "brset"), n_images=40, image_px=32, seed=1)
    write_source_manifests({"site-1": load_messidor2(str(tmp_path / "messidor2"), site="site-1")[0],
                            "site-2": load_brset(str(tmp_path / "brset"), site="site-2")[0]}, str(tmp_path / "sites"))
    run = run_simulation(os.path.join(JOBS, "feddra_retina"), str(tmp_path / "ws"), n_sites=2,
                         data_root=str(tmp_path / "sites" / "{site}"), profile="quick", echo=False,
                         sets=["server.scatter_and_gather.two_stage=false", "server.scatter_and_gather.dro=false",
                               "client.feddra_trainer.mu=0.0"])
    log = open(run["log"]).read()
    assert log.count("fedavg: loss") == 4 and "align: loss" not in log
    assert not os.path.exists(os.path.join(server_run_dir(run["workspace"]), "dro_weights.json"))
    report = json.load(open(os.path.join(server_run_dir(run["workspace"]), "test_metrics.json")))
    assert sorted(report["sites"]) == ["site-1", "site-2"]
