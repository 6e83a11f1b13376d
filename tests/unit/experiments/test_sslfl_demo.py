"""The SSL-FL demo's pieces: method variants bind to real jobs, data set checks."""

import json
import os

import pytest

from fedssl.experiments.sslfl_demo import (
    FINETUNE_SETS,
    PRETRAIN_SETS,
    VARIANTS,
    check_methods,
    format_table,
    verdicts,
)
from fedssl.ops.jobs import REPO_ROOT, build_job


@pytest.mark.parametrize("method", sorted(VARIANTS))
def test_every_variant_builds_its_jobs_with_the_demo_overrides(method, tmp_path):
    v = VARIANTS[method]
    build_job(os.path.join(REPO_ROOT, "jobs", v["pretrain"]), str(tmp_path / "pre"), profile="quick",
              sets=["server.scatter_and_gather.min_clients=5", *PRETRAIN_SETS], n_sites=5)
    build_job(os.path.join(REPO_ROOT, "jobs", v["finetune"]), str(tmp_path / "ft"), profile="quick",
              sets=["server.model.pretrained_path=", *FINETUNE_SETS, *v["finetune_sets"]], n_sites=5)


def test_methods_must_share_one_data_set():
    assert check_methods(["fedmae", "fedbeit"]) == "retina"
    assert check_methods(["fedmae_ks"]) == "derm"
    with pytest.raises(ValueError, match="different data sets"):
        check_methods(["fedmae", "fedmae_ks"])
    with pytest.raises(ValueError, match="use one or more of"):
        check_methods(["simclr"])
    with pytest.raises(ValueError, match="use one or more of"):
        check_methods([])


def test_table_prints_missing_metrics_as_na():
    table = format_table([{"method": "Fed-MAE", "accuracy": 0.5, "balanced_accuracy": None, "auc": 0.75,
                           "macro_f1": 0.25, "selected": "round 3"}])
    assert "Fed-MAE" in table and "0.500" in table and "n/a" in table and "round 3" in table


def test_fedmae_ks_demo_splits_derm_into_iid_shards_as_the_paper(tmp_path):
    """FedMAE-KS sec. V-B: random IID partitions; the SSL-FL variants keep the Dirichlet splitter."""
    from fedssl.experiments.sslfl_demo import VARIANTS, write_demo_images

    assert VARIANTS["fedmae_ks"]["split"] == "iid"
    assert VARIANTS["fedmae"]["split"] == VARIANTS["fedbeit"]["split"] == "dirichlet"
    parts = write_demo_images(str(tmp_path), "derm", 100, 16, 4, 0.5, 0, 0.0, VARIANTS["fedmae_ks"]["split"])
    assert parts.endswith("derm_iid_4sites")
    with open(f"{parts}/partition.json") as f:
        partition = json.load(f)
    sizes = sorted(sum(v["class_counts"].values()) for v in partition["sites"].values())
    n_test = sum(partition["test"]["class_counts"].values())
    assert sum(sizes) == 100 - n_test and sizes[-1] - sizes[0] <= 1  # near-equal shards of the training images


def test_verdicts_compare_each_pretrained_row_with_scratch():
    rows = [{"method": "Fed-MAE", "accuracy": 0.70, "n_test": 400.0},
            {"method": "Fed-BEiT", "accuracy": None, "n_test": 400},
            {"method": "ViT scratch", "accuracy": 0.60, "n_test": 400}]
    assert verdicts(rows) == ["Fed-MAE vs ViT scratch: test accuracy +0.100 (2 x binomial SE 0.067, 400 test images, "
                              "one seed) -> pre-training helped"]
    assert verdicts(rows[:1]) == []  # no scratch row: nothing to compare with


def test_demo_records_its_threads_and_says_its_one_seed_comparison_is_not_a_finding(tmp_path, monkeypatch, capsys):
    """Data, simulator and test reports faked: what is checked is run_config.json and the note under the table."""
    import torch

    from fedssl.experiments import sslfl_demo as sd

    parts = tmp_path / "parts"
    parts.mkdir()
    (parts / "partition.json").write_text(json.dumps({"sites": {"site-1": {"class_counts": {"0": 3, "1": 3}}},
                                                      "test": {"class_counts": {"0": 2, "1": 2}}}))
    monkeypatch.setattr(sd, "write_demo_images", lambda *a, **kw: str(parts))
    monkeypatch.setattr(sd, "run_simulation", lambda job, ws, **kw: {
        "rounds": [{"mean_loss": 1.0}], "simulator_wall_time_s": 1.0, "bytes_per_site_per_round": {},
        "global_model": "g.pt"})
    monkeypatch.setattr(sd, "_test_row", lambda method, run: {
        "method": method, "accuracy": 0.5, "balanced_accuracy": 0.5, "auc": 0.5, "macro_f1": 0.5, "n_test": 4,
        "selected": "round 1", "model_source": "best"})
    monkeypatch.setattr(sd, "_plot", lambda rows, path, title: None)
    try:
        summary = sd.run_sslfl_demo(str(tmp_path / "out"), seed=3, threads=2)
    finally:
        torch.set_num_threads(1)
    note = "one seed (3): not a finding; run fedssl sslfl tables --seeds 0 1 2"
    assert summary["seeds_note"].startswith(note) and note in capsys.readouterr().out
    config = json.load(open(tmp_path / "out" / "run_config.json"))
    assert config["threads"] == 2 and config["seed"] == 3 and config["environments"][0]["threads"] == 2
