"""The demo switches the backbone strategy by --set alone: the job's batch-norm filters follow the strategy."""

import json
import os

import pytest
import torch

from fedssl.experiments.surgical_demo import JOB, comparison_table, run_surgical_demo
from fedssl.ops.jobs import component_specs, job_configs


def test_job_batchnorm_filters_follow_the_strategy():
    paths = [c["path"] for _, cfg in job_configs(JOB) for c in component_specs(cfg)]
    assert "fedssl.flare.partial_exclusion.PartialModelExclusion" not in paths
    assert paths.count("fedssl.flare.backbone_exclusion.BackboneBNExclusion") == 3  # train + test download, upload


def test_demo_rejects_an_unknown_backbone_before_doing_anything(tmp_path):
    with pytest.raises(ValueError, match="backbone"):
        run_surgical_demo(str(tmp_path), backbone="fedprox")
    with pytest.raises(ValueError, match="central_missing='zero'"):
        run_surgical_demo(str(tmp_path), central_missing="zero")
    assert not os.listdir(tmp_path)


def test_comparison_table_prints_every_method():
    row = {"mean_auroc": 0.7, "shared_auroc": 0.6, "unique_auroc": None, "external_auroc": 0.65, "external_shared": 0.6,
           "external_unique": 0.7, "external_min_class": 0.55, "rounds": 3, "wall_time_s": 10.0,
           "kb_per_site_round": 1.5}
    text = comparison_table([{"method": "surgical", **row}, {"method": "vanilla", **row}])
    assert "surgical" in text and "vanilla" in text and "n/a" in text and "0.700" in text


def _results(site_aurocs: dict, external: dict) -> dict:
    sites = {s: {"test": {"per_class": {c: {"auroc": v} for c, v in per.items()}},
                 "external": {"per_class": {c: {"auroc": v} for c, v in external.items()}}}
             for s, per in site_aurocs.items()}
    row = {"mean_auroc": 0.7, "shared_auroc": 0.7, "unique_auroc": 0.7}
    return {"table": {"mean": row, "external": [{"mean_auroc": 0.6, "shared_auroc": 0.6, "unique_auroc": 0.6}]},
            "sites": sites, "global_classes": ["A", "B", "C"]}


def test_every_class_is_checked_on_the_sites_that_label_it_and_on_the_external_set():
    from fedssl.experiments.surgical_demo import class_check, result_row

    res = _results({"site-1": {"A": 0.9, "B": 0.55}, "site-2": {"B": 0.8, "C": None}}, {"A": 0.7, "B": 0.65, "C": 0.4})
    row, run = result_row("surgical", res, 3, 1.0, {"total": 1000}, "r.md")
    assert run["site_test_per_class"] == {"A": 0.9, "B": 0.55, "C": None}  # B: the lower of its two sites
    assert row["external_min_class"] == 0.4 and row["kb_per_site_round"] == 1.0
    check = class_check(run)
    assert check["site_test"] == {"undefined": ["C"], "at_most_threshold": {"B": 0.55}, "min": 0.55}
    assert check["external"] == {"undefined": [], "at_most_threshold": {"C": 0.4}, "min": 0.4}


def test_demo_records_its_threads_and_says_its_one_seed_comparison_is_not_a_finding(tmp_path, monkeypatch, capsys):
    """The simulator and the results are faked: what is checked is run_config.json and the note under the table."""
    from fedssl.experiments import surgical_demo as sd

    row = {"mean_auroc": 0.7, "shared_auroc": 0.6, "unique_auroc": 0.8, "external_auroc": 0.65, "external_shared": 0.6,
           "external_unique": 0.7, "external_min_class": 0.55, "rounds": 1, "wall_time_s": 1.0,
           "kb_per_site_round": 1.5}

    def simulate(job, workspace, **kw):
        os.makedirs(os.path.join(workspace, "server", "simulate_job"))
        open(os.path.join(workspace, "server", "simulate_job", "results.json"), "w").write("{}")
        return {"workspace": workspace, "simulator_wall_time_s": 1.0, "bytes_per_site_per_round": {"total": 1500}}

    monkeypatch.setattr(sd, "write_demo_data", lambda data, n: os.makedirs(os.path.join(data, "mimic")))
    monkeypatch.setattr(sd, "run_simulation", simulate)
    monkeypatch.setattr(sd, "result_row", lambda method, *a: ({"method": method, **row}, {}))
    try:
        report = sd.run_surgical_demo(str(tmp_path), rounds=1, methods=("vanilla", "partial_loss"), central=False,
                                      threads=2)
    finally:
        torch.set_num_threads(1)
    note = "one seed (0): not a finding; run " + sd.RERUN
    assert report["seeds_note"].startswith(note) and note in capsys.readouterr().out
    assert note in open(tmp_path / "surgical_demo.md").read()
    config = json.load(open(tmp_path / "run_config.json"))
    assert config["threads"] == 2 and config["methods"] == ["vanilla", "partial_loss"] and config["seeds"] == [0]


def test_over_seeds_pairs_surgical_with_every_method_by_seed():
    """By hand: surgical 0.80 / 0.90 and vanilla 0.70 / 0.75 at seeds 0 / 1: surgical - vanilla = 0.10 / 0.15,
    mean 0.125, SE std([0.10, 0.15]) / sqrt(2) = 0.025; a column undefined in one run is left out of its mean."""
    from fedssl.experiments.surgical_demo import METRICS, over_seeds, seeds_table

    def row(method, seed, v, ext=0.6):
        return {"method": method, "seed": seed, "mean_auroc": v, "shared_auroc": v, "unique_auroc": v,
                "external_auroc": ext}

    rows = [row("surgical", 0, 0.80), row("vanilla", 0, 0.70, None), row("surgical", 1, 0.90), row("vanilla", 1, 0.75)]
    summary, diffs = over_seeds(rows)
    assert [e["method"] for e in summary] == ["surgical", "vanilla"] and summary[0]["seeds"] == [0, 1]
    assert summary[0]["mean_auroc"]["mean"] == pytest.approx(0.85)
    assert summary[0]["mean_auroc"]["se"] == pytest.approx(0.05)
    assert summary[1]["external_auroc"] == {"mean": 0.6, "se": None, "by_seed": {1: 0.6}}
    (d,) = diffs
    assert (d["method"], d["minus"]) == ("surgical", "vanilla")
    assert d["mean_auroc"]["mean"] == pytest.approx(0.125) and d["mean_auroc"]["se"] == pytest.approx(0.025)
    assert d["mean_auroc"]["by_seed"] == {0: pytest.approx(0.10), 1: pytest.approx(0.15)}
    assert d["external_auroc"]["by_seed"] == {1: pytest.approx(0.0)}
    text = seeds_table(summary, diffs)
    assert "0.850 +- 0.050" in text and "+0.125 +- 0.025" in text and len(METRICS) == 4


def test_demo_over_three_seeds_sets_each_seed_pairs_them_and_draws_the_figure(tmp_path, monkeypatch, capsys):
    """Faked simulator: every run gets its seed's switches, the seed-0 runs are reused by a second call, the note
    goes away at three seeds and the figure is written."""
    from fedssl.experiments import surgical_demo as sd

    calls = []

    def simulate(job, workspace, **kw):
        calls.append((workspace, kw["sets"]))
        os.makedirs(os.path.join(workspace, "server", "simulate_job"))
        open(os.path.join(workspace, "server", "simulate_job", "results.json"), "w").write("{}")
        return {"workspace": workspace, "simulator_wall_time_s": 1.0, "bytes_per_site_per_round": {"total": 1500}}

    def fake_row(method, res, rounds, wall, sent, md):
        seed = int(md.split(os.sep)[0].removeprefix("seed"))
        v = (0.8 if method == "surgical" else 0.7) + 0.01 * seed
        return ({"method": method, "mean_auroc": v, "shared_auroc": v, "unique_auroc": v, "external_auroc": v,
                 "external_shared": v, "external_unique": v, "external_min_class": v, "rounds": rounds,
                 "wall_time_s": wall, "kb_per_site_round": 1.5},
                {"global_classes": ["A"], "site_test_per_class": {"A": v}, "external_per_class": {"A": v}})

    monkeypatch.setattr(sd, "write_demo_data", lambda data, n: os.makedirs(os.path.join(data, "mimic")))
    monkeypatch.setattr(sd, "run_simulation", simulate)
    monkeypatch.setattr(sd, "result_row", fake_row)
    try:
        sd.run_surgical_demo(str(tmp_path), rounds=1, methods=("surgical", "vanilla"), central=False, seeds=(0,))
        assert len(calls) == 2
        report = sd.run_surgical_demo(str(tmp_path), rounds=1, methods=("surgical", "vanilla"), central=False,
                                      seeds=(0, 1, 2))
    finally:
        torch.set_num_threads(1)
    assert len(calls) == 6  # seed 0 was already there
    for ws, sets in calls:
        seed = int(os.path.basename(os.path.dirname(ws)).removeprefix("seed"))
        assert {f"server.model.seed={seed}", f"server.persistor.seed={seed}",
                f"client.cxr_trainer.seed={seed}"} <= set(sets)
    assert report["seeds_note"] is None and report["seeds"] == [0, 1, 2]
    (d,) = report["differences"]
    assert d["mean_auroc"]["mean"] == pytest.approx(0.1) and d["mean_auroc"]["se"] == pytest.approx(0.0, abs=1e-12)
    assert os.path.getsize(tmp_path / "surgical_demo.png") > 1000
    assert "surgical - vanilla" in capsys.readouterr().out
    with pytest.raises(ValueError, match="seeds="):
        sd.run_surgical_demo(str(tmp_path), seeds=(1, 1))
