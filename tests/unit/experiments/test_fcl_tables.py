"""fedssl.experiments.fcl_tables: the cells of FCL Tables 1-3, resume, Local CL's encoders, splits, CLI.

The stage functions (pre-training, fine-tuning, federated fine-tuning) are replaced by fakes: no simulator, no
training, except in the split test (tiny volumes, one epoch) and the slow end-to-end test."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from fedssl.cli import main
from fedssl.data.volume import Volume
from fedssl.experiments import fcl_tables
from fedssl.experiments.fcl_tables import pretrain_cells, run_fcl_tables, table_cells, table_folds
from fedssl.models.unet import TINY_FEATURES

torch.set_num_threads(1)

SITES = ["site-1", "site-2"]
METHODS = ["random", "FCL"]


def _dice(method: str, n: int, fold: int, site: str, seed: int = 0) -> float:
    """Fake Dice: 0.1 N + 0.01 fold, + 0.02 at site-2, + 0.04 per seed, + 0.1 for FCL at seed 0 only."""
    return (0.1 * n + 0.01 * fold + (0.02 if site == "site-2" else 0.0) + 0.04 * seed
            + (0.1 if method == "FCL" and seed == 0 else 0.0))


class Fakes:
    """Stage functions that record what they were asked to do."""

    def __init__(self, fail_at: int | None = None):
        self.pretrained, self.finetuned, self.federated, self.fail_at = [], [], [], fail_at
        self.diagnosed = []

    def diagnose_one(self, method, pretrained, *, data_root, settings, seed=0):
        self.diagnosed.append((method, pretrained["summary"]))
        return {"method": method + (f" seed {seed}" if seed else ""),
                "rounds": [{"round": 0, "loss": 2.0, "bank_fill": 0.5}],
                "probe": {"metric": "dice", "setting": "N=1, fold 0", "n_sites": 2, "pretrained": 0.30,
                          "pretrained_std": 0.01, "random": 0.25, "random_std": 0.02}}

    def pretrain(self, method, workspace, *, data_root, n_sites, profile, rounds, seed=0):
        self.pretrained.append(method if not seed else (method, seed))
        out = {"summary": f"{workspace}/summary.json"}
        tag = f"_s{seed}" if seed else ""
        if method == "Local CL":  # as the real stage: the sites' own encoders, no global model
            out["site_encoders"] = {s: f"local_cl_{s}{tag}.pt" for s in SITES}
        else:
            out["global_model"] = f"{method}{tag}.pt"
        return out

    def finetune_one(self, key, init, data_root, settings):
        if self.fail_at is not None and len(self.finetuned) == self.fail_at:
            raise RuntimeError("killed")
        self.finetuned.append((dict(key), init))
        site = key.get("site", "all")
        return {"method": key["method"], "mode": key["stage"], "n_labelled": key["n_labelled"], "fold": key["fold"],
                "site": site, "dice": _dice(key["method"], key["n_labelled"], key["fold"], site, key.get("seed", 0))}

    def federated_one(self, key, init, workspace, *, data_root, n_sites, profile, settings):
        self.federated.append((dict(key), init))
        return {"rows": [{"method": key["method"], "mode": "federated", "n_labelled": key["n_labelled"],
                          "fold": key["fold"], "site": s,
                          "dice": _dice(key["method"], key["n_labelled"], key["fold"], s, key.get("seed", 0))}
                         for s in SITES], "wall_time_s": 0.0}


@pytest.fixture
def data_root(tmp_path):
    for s in SITES:
        (tmp_path / "data" / s).mkdir(parents=True)
    return str(tmp_path / "data")


def _run(monkeypatch, fakes, out, data_root, **kw):
    for name in ("pretrain", "finetune_one", "federated_one", "diagnose_one"):
        monkeypatch.setattr(fcl_tables, name, getattr(fakes, name))
    args = dict(methods=METHODS, n_labelled=[1, 2], folds=[0, 1], n_sites=2, profile="bench", data_root=data_root,
                workers=1, seeds=[0], say=lambda s: None)
    args.update(kw)
    return run_fcl_tables(str(out), **args)


def test_cell_counts_per_table():
    # 2 methods x 2 N x 2 folds (x 2 sites for the local table)
    assert len(table_cells(1, METHODS, [1, 2], [0, 1], SITES)) == 16
    assert len(table_cells(2, METHODS, [1, 2], [0, 1], SITES)) == 8
    assert len(table_cells(3, METHODS, [1, 2], [0, 1], SITES)) == 8
    assert pretrain_cells(METHODS) == [{"stage": "pretrain", "method": "FCL"}]  # random is not pre-trained
    assert len(pretrain_cells(fcl_tables.ALL_METHODS)) == 9


def test_run_calls_each_stage_once_per_cell_and_writes_the_tables(monkeypatch, tmp_path, data_root):
    fakes = Fakes()
    paths = _run(monkeypatch, fakes, tmp_path / "out", data_root)
    assert fakes.pretrained == ["FCL"]
    assert len(fakes.finetuned) == 16 + 8 and len(fakes.federated) == 8
    data = json.loads(open(paths[1]["json"]).read())
    # random, N=1: site-1 folds (0.10, 0.11) -> 0.105, site-2 (0.12, 0.13) -> 0.125: mean 0.115, std 0.010
    (row,) = [r for r in data["rows"] if r["method"] == "random" and r["column"] == "N=1"]
    assert row["mean"] == pytest.approx(0.115) and row["std"] == pytest.approx(0.010) and row["n"] == 2
    # centralised (site "all"): over folds (0.10, 0.11) -> 0.105 +- 0.005
    (row,) = [r for r in json.loads(open(paths[3]["json"]).read())["rows"]
              if r["method"] == "random" and r["column"] == "N=1"]
    assert row["mean"] == pytest.approx(0.105) and row["std"] == pytest.approx(0.005) and row["n"] == 2
    text = open(paths[1]["txt"]).read()
    assert "paper (FCL, Wu et al., MedIA 2022, Table 1)" in text and "0.280 +- 0.037" in text
    assert "folds [0, 1]" in text and data["extra"]["folds"] == [0, 1]
    assert "60 epochs (at least 140 optimiser steps" in text  # the bench profile's step floor is stated
    assert "over sites (each fold-averaged first); folds [0, 1], profile bench" in text
    assert "paired against random init over (site, fold) pairs:" in text
    assert "paired against random init over folds:" in open(paths[3]["txt"]).read()
    # one seed: said under the tables, after the paired differences it qualifies
    note = "one seed (0): not a finding; run --seeds 0 1 2 (a method's sign can change from one seed to the next)"
    assert text.rstrip().endswith(note) and data["footer"][-1] == note


def test_diagnostics_run_once_per_pretrained_method_and_print_under_every_table(monkeypatch, tmp_path, data_root):
    fakes, said = Fakes(), []
    _run(monkeypatch, fakes, tmp_path / "out", data_root, say=said.append)
    assert fakes.diagnosed == [("FCL", f"{tmp_path / 'out'}/ws/pretrain_FCL/summary.json")]
    blocks = [s for s in said if s.startswith("Diagnostics")]
    assert len(blocks) == 3  # one under each of the three tables
    assert "frozen encoder beats random by +0.050 Dice" in blocks[0]
    assert json.loads((tmp_path / "out" / "diagnostics.json").read_text())[0]["method"] == "FCL"
    again = Fakes()
    _run(monkeypatch, again, tmp_path / "out", data_root, say=said.append)
    assert again.diagnosed == []  # resumed from the cell store


def test_methods_added_one_command_at_a_time_end_up_in_one_table(monkeypatch, tmp_path, data_root):
    _run(monkeypatch, Fakes(), tmp_path / "out", data_root, methods=["random", "FCL"], tables=[1, 3])
    said = []
    paths = _run(monkeypatch, Fakes(), tmp_path / "out", data_root, methods=["random", "FedMoCo"], tables=[1],
                 n_labelled=[1], say=said.append)
    data = json.loads(open(paths[1]["json"]).read())
    # the folder's table: random and FCL from the first command, FedMoCo from the second, in the paper's order;
    # only the N asked for now
    assert [r["method"] for r in data["rows"]] == ["random", "FedMoCo", "FCL"]
    assert {r["column"] for r in data["rows"]} == {"N=1"}
    # FCL is +0.1 on every (site, fold) pair (the fakes' Dice), FedMoCo level
    paired = {p["method"]: p for p in data["extra"]["paired_against_random"]}
    assert (paired["FCL"]["diff_mean"] == pytest.approx(0.1)
            and (paired["FCL"]["ahead"], paired["FCL"]["pairs"]) == (4, 4))
    assert paired["FedMoCo"]["diff_mean"] == pytest.approx(0.0) and paired["FedMoCo"]["ahead"] == 0
    text = open(paths[1]["txt"]).read()
    assert "FCL minus random: N=1 +0.100 (SE 0.000) ahead in 4/4" in text.split("paper (")[-1]  # under the tables
    assert set(data["extra"]["pretraining"]) == {"FedMoCo", "FCL"}
    diags = json.loads((tmp_path / "out" / "diagnostics.json").read_text())
    assert [d["method"] for d in diags] == ["FedMoCo", "FCL"]  # both commands' pre-trained methods
    # a command with random init alone still prints the folder's diagnostics under its table
    said = []
    _run(monkeypatch, Fakes(), tmp_path / "out", data_root, methods=["random"], tables=[3], say=said.append)
    assert any(s.startswith("Diagnostics") and "FedMoCo" in s and "FCL" in s for s in said)


class FailingFakes(Fakes):
    """FCL's local loss per round by seed: seed 0 dips below ln(1025) = 6.932 (the bench bank, K = 1024), seed 1
    never does (a failed pre-training)."""

    LOCAL = {0: [7.0, 6.5], 1: [7.2, 7.0]}

    def diagnose_one(self, method, pretrained, *, data_root, settings, seed=0):
        d = super().diagnose_one(method, pretrained, data_root=data_root, settings=settings, seed=seed)
        return dict(d, rounds=[{"round": r, "loss": x + 2.0, "loss_local": x} for r, x in enumerate(self.LOCAL[seed])])


class StaleBankFakes(FailingFakes):
    """Seed 0's logged local loss dips below ln(1025) (FailingFakes), but its final network discriminates two views
    of a slice no better than chance without the bank (5.98 against 5.98)."""

    def diagnose_one(self, method, pretrained, *, data_root, settings, seed=0):
        d = super().diagnose_one(method, pretrained, data_root=data_root, settings=settings, seed=seed)
        return dict(d, discrimination={"tau": 0.1, "loss": 5.98, "start_loss": 5.99, "chance": 5.98, "top1": 0.01,
                                       "start_top1": 0.01, "per_site": {}})


def test_a_network_at_chance_without_its_bank_is_marked_although_its_logged_loss_is_below(monkeypatch, tmp_path,
                                                                                          data_root):
    out = tmp_path / "out"
    paths = _run(monkeypatch, StaleBankFakes(), out, data_root, n_labelled=[1], folds=[0], seeds=[0], tables=[1])
    data = json.loads(open(paths[1]["json"]).read())
    rows = {r["method"]: r for r in data["rows"]}
    reason = ("the network discriminates at chance without its bank: instance discrimination 5.980 is less than 5% "
              "below its chance level 5.980, its start 5.990")
    assert rows["FCL"]["pretraining_reasons"] == {"seed 0": [reason]}
    assert rows["FCL"]["mark"] == " [failed pre-training]"
    health = json.loads((out / "diagnostics.json").read_text())[0]["health"]
    assert health["min_loss"] == 6.5 and health["discrimination_loss"] == 5.98


def test_a_failed_pretraining_is_marked_in_the_table_its_rows_verdict_and_paired_lines(monkeypatch, tmp_path,
                                                                                       data_root):
    out = tmp_path / "out"
    paths = _run(monkeypatch, FailingFakes(), out, data_root, n_labelled=[1], folds=[0], seeds=[0, 1], tables=[1])
    text = open(paths[1]["txt"]).read()
    bundle, paper = text.split("bundle (measured here)")[1].split("paper (")
    assert [ln.split("  ")[0] for ln in bundle.splitlines()[3:5]] == ["random", "FCL [failed pre-training: seed 1]"]
    assert any(ln.startswith("FCL  ") for ln in paper.splitlines())  # the paper's row keeps the plain label
    reason = "loss never below chance: min loss_local 7.000 (round 1) vs ln(K+1), K = 1024 = 6.932"
    assert f"[failed pre-training] FCL seed 1: {reason}" in paper.splitlines()
    assert "FCL [failed pre-training: seed 1] minus random: N=1 +0.050" in text
    assert ("Dice over 2 seeds (each the mean over its sites) -> not FCL's result: its pre-training failed at seed 1 "
            "of 2 ([failed pre-training] below)") in text and "-> pre-training" not in text
    data = json.loads(open(paths[1]["json"]).read())
    rows = {r["method"]: r for r in data["rows"]}
    assert rows["FCL"]["pretraining_failed"] is True and rows["FCL"]["pretraining_failed_at"] == ["seed 1"]
    assert rows["FCL"]["pretraining_reasons"] == {"seed 1": [reason]}
    assert rows["FCL"]["mark"] == " [failed pre-training: seed 1]" and rows["FCL"]["mean"] is not None  # kept
    assert rows["random"]["pretraining_failed"] is False and "mark" not in rows["random"]
    assert data["extra"]["pretraining_health"]["FCL"]["seed 0"]["failed"] is False
    diags = json.loads((out / "diagnostics.json").read_text())
    assert [d["health"]["failed"] for d in diags] == [False, True]
    # the table of seed 1 alone: every pre-training it holds failed
    paths = _run(monkeypatch, FailingFakes(), out, data_root, n_labelled=[1], folds=[0], seeds=[1], tables=[1])
    text = open(paths[1]["txt"]).read()
    assert "\nFCL [failed pre-training]  " in text and "its pre-training failed ([failed pre-training] below)" in text
    # seed 0 alone: nothing failed, nothing marked
    paths = _run(monkeypatch, FailingFakes(), out, data_root, n_labelled=[1], folds=[0], seeds=[0], tables=[1])
    assert "failed" not in open(paths[1]["txt"]).read()


def test_interrupted_run_resumes_without_rerunning_finished_cells(monkeypatch, tmp_path, data_root):
    first = Fakes(fail_at=5)
    with pytest.raises(RuntimeError, match="killed"):
        _run(monkeypatch, first, tmp_path / "out", data_root)
    assert len(first.finetuned) == 5
    second = Fakes()
    _run(monkeypatch, second, tmp_path / "out", data_root)
    assert second.pretrained == []  # its cell was finished
    done = [json.dumps(k, sort_keys=True) for k, _ in first.finetuned]
    rerun = [json.dumps(k, sort_keys=True) for k, _ in second.finetuned]
    assert not set(done) & set(rerun) and len(rerun) == 16 + 8 - 5


def test_seeds_repeat_every_cell_pair_runs_of_one_seed_and_give_the_spread_over_seeds(monkeypatch, tmp_path, data_root):
    fakes = Fakes()
    paths = _run(monkeypatch, fakes, tmp_path / "out", data_root, n_labelled=[1], folds=[0], seeds=[0, 1])
    out = tmp_path / "out"
    assert fakes.pretrained == ["FCL", ("FCL", 1)]
    assert [d[1] for d in fakes.diagnosed] == [f"{out}/ws/pretrain_FCL/summary.json",
                                               f"{out}/ws/pretrain_FCL_seed1/summary.json"]
    # seed 0's keys carry no seed (folders from before seeds resume as seed 0); a seed-s cell starts from seed s
    keys = [(k["stage"], k["method"], k.get("site"), k.get("seed"), init) for k, init in fakes.finetuned
            + fakes.federated]
    assert ("local", "FCL", "site-2", None, "FCL.pt") in keys and ("local", "FCL", "site-2", 1, "FCL_s1.pt") in keys
    assert ("federated", "FCL", None, 1, "FCL_s1.pt") in keys and ("centralised", "random", None, 1, "random") in keys
    assert len(fakes.finetuned) == 2 * (2 * 2 + 2) and len(fakes.federated) == 2 * 2
    data = json.loads(open(paths[1]["json"]).read())
    # random, N=1, each site averaged over seeds: site-1 (0.10, 0.14) -> 0.12, site-2 (0.12, 0.16) -> 0.14
    (row,) = [r for r in data["rows"] if r["method"] == "random"]
    assert row["mean"] == pytest.approx(0.13) and row["std"] == pytest.approx(0.01) and row["n"] == 2
    # FCL - random: +0.1 on both sites at seed 0, 0.0 at seed 1 -> by seed +0.1 / 0.0, SE over seeds 0.05
    (p,) = data["extra"]["paired_against_random"]
    assert (p["pairs"], p["ahead"], p["seeds"]) == (4, 2, 2) and p["diff_mean"] == pytest.approx(0.05)
    assert p["by_seed"] == {"0": pytest.approx(0.1), "1": pytest.approx(0.0)} and p["seed_se"] == pytest.approx(0.05)
    text = open(paths[1]["txt"]).read()
    assert "seeds [0, 1]" in text and "by seed +0.100 / +0.000 (SE over seeds 0.050)" in text
    assert "two seeds (0, 1): not a finding; run --seeds 0 1 2" in text.split("paper (")[-1]
    assert "over (site, fold, seed) pairs" in text and data["extra"]["seeds"] == [0, 1]
    assert "Dice mean +- std over sites (each fold- and seed-averaged first); folds [0], seeds [0, 1]" in text
    text3 = open(paths[3]["txt"]).read()
    assert "over folds (each seed-averaged first)" in text3 and "over (fold, seed) pairs:" in text3
    assert "at N=1: +0.050 +- 0.050 Dice over 2 seeds (each the mean over its sites) -> pre-training within" in text
    assert set(data["extra"]["pretraining"]) == {"FCL", "FCL seed 1"}
    diags = json.loads((out / "diagnostics.json").read_text())
    assert [d["method"] for d in diags] == ["FCL", "FCL seed 1"]
    # resume: seed 0 alone reruns nothing and its table holds seed 0 only; adding seed 2 runs seed 2's cells only
    again = Fakes()
    paths = _run(monkeypatch, again, out, data_root, n_labelled=[1], folds=[0], tables=[1])
    assert again.pretrained == [] and again.finetuned == []
    (row,) = [r for r in json.loads(open(paths[1]["json"]).read())["rows"] if r["method"] == "random"]
    assert row["mean"] == pytest.approx(0.11)
    more = Fakes()
    _run(monkeypatch, more, out, data_root, n_labelled=[1], folds=[0], tables=[1], seeds=[0, 1, 2])
    assert more.pretrained == [("FCL", 2)] and {k["seed"] for k, _ in more.finetuned} == {2}
    # a method run at seed 0 only, shown with seeds 0-2: the table says which seeds each row averages
    paths = _run(monkeypatch, Fakes(), out, data_root, n_labelled=[1], folds=[0], tables=[1],
                 methods=["random", "FedMoCo"], seeds=[0])
    paths = _run(monkeypatch, Fakes(), out, data_root, n_labelled=[1], folds=[0], tables=[1], seeds=[0, 1, 2])
    text = open(paths[1]["txt"]).read()
    assert ("seeds finished per method (a row averages only these): random [0, 1, 2], FedMoCo [0], FCL [0, 1, 2]"
            in text)
    assert "FedMoCo: one seed (0): not a finding; run --seeds 0 1 2" in text.split("paper (")[-1]
    paths = _run(monkeypatch, Fakes(), tmp_path / "three", data_root, n_labelled=[1], folds=[0], tables=[1],
                 seeds=[0, 1, 2])
    assert "not a finding" not in open(paths[1]["txt"]).read()  # three seeds on every row: nothing to say
    for bad in ([0, 0], [-1], []):
        with pytest.raises(ValueError, match=r"seeds=.* is invalid; use distinct integers >= 0"):
            _run(monkeypatch, Fakes(), out, data_root, seeds=bad)


def test_every_pretraining_job_has_a_trainer_for_the_seed_override():
    assert {job for job, _ in fcl_tables.PRETRAINED.values()} <= set(fcl_tables.TRAINER_IDS)


def test_fedrotation_and_fedsimclr_rows_are_the_fcl_job_with_another_objective(tmp_path):
    """FCL Table 1's baselines (sec. 5 "Baselines"): the objective on the server's model and the sites' trainer, no
    feature exchange, no bank collector; the rows bind to the job (with the seed override) and sit after Local CL as
    in the paper's tables; the loss health reads each against its own chance level."""
    from fedssl.ops.jobs import build_job, component_specs, job_configs

    assert fcl_tables.ALL_METHODS[:4] == ("random", "Local CL", "FedRotation", "FedSimCLR")
    for method, objective, chance in (("FedRotation", "rotation", np.log(4)), ("FedSimCLR", "simclr", np.log(31))):
        job, sets = fcl_tables.PRETRAINED[method]
        assert job == "fcl_acdc" and sets == [f"shape.objective={objective}",
                                              "client.fcl_trainer.feature_exchange=false",
                                              "server.aggregator.collectors=[]"]
        out = build_job(os.path.join(fcl_tables.JOBS, job), str(tmp_path / method), profile="quick",
                        sets=sets + fcl_tables.seed_sets("fcl_trainer", 1), n_sites=2)
        comps = {c["id"]: c["args"] for _, cfg in job_configs(out) for c in component_specs(cfg)}
        assert comps["model"]["objective"] == comps["fcl_trainer"]["objective"] == objective
        assert comps["fcl_trainer"]["feature_exchange"] is False and comps["aggregator"]["collectors"] == []
        health = fcl_tables.loss_health_settings(method, "quick")  # quick: batch 16 slices
        assert health["loss_key"] == "loss" and health["chance"] == pytest.approx(chance)


def test_seed_overrides_reach_the_jobs(monkeypatch, tmp_path):
    """The real pre-training and federated stages pass the seed to the server's model and the sites' trainer, and
    those overrides bind to every job's components."""
    from fedssl.ops.jobs import build_job

    seen = []

    def fake_simulation(job_dir, workspace, *, sets, **kw):
        seen.append((os.path.basename(job_dir), sets))
        return {"simulator_wall_time_s": 0.0, "global_model": "g.pt"}

    monkeypatch.setattr(fcl_tables, "run_simulation", fake_simulation)
    for method in ("FCL", "FCLOpt"):
        fcl_tables.pretrain(method, str(tmp_path / method), data_root="d", n_sites=2, profile="quick", rounds=None,
                            seed=3)
    assert "server.model.seed=3" in seen[0][1] and "client.fcl_trainer.seed=3" in seen[0][1]
    assert "server.model.seed=3" in seen[1][1] and "client.byol_trainer.seed=3" in seen[1][1]
    monkeypatch.setattr(fcl_tables, "evaluate_federated", lambda *a, **kw: [{"dice": 0.5}])
    monkeypatch.setattr(fcl_tables, "load_sites", lambda data_root, settings: {})
    key = {"stage": "federated", "method": "random", "n_labelled": 1, "fold": 0, "seed": 2}
    result = fcl_tables.federated_one(key, "random", str(tmp_path / "ft"), data_root="d", n_sites=2, profile="quick",
                                      settings={})
    assert result["rows"] == [{"dice": 0.5, "seed": 2}]
    assert "server.model.seed=2" in seen[2][1] and "client.seg_trainer.seed=2" in seen[2][1]
    for job, sets in seen:  # each override names an argument the component's constructor takes
        build_job(os.path.join(fcl_tables.JOBS, job), str(tmp_path / "built" / job), profile="quick", sets=sets,
                  n_sites=2)


def test_exported_unet_keeps_the_encoder_and_draws_the_decoder_from_the_seed(tmp_path):
    from fedssl.experiments.fcl_finetune import encoder_init, export_unet_init
    from fedssl.models.unet import MoCoUNetEncoder

    torch.save({"model": MoCoUNetEncoder(TINY_FEATURES, proj_dim=8, image_size=32, seed=5).state_dict()},
               tmp_path / "g.pt")
    a, b, c = (torch.load(export_unet_init(str(tmp_path / "g.pt"), str(tmp_path / f"u{s}.pt"), TINY_FEATURES, seed=s),
                          weights_only=True)["model"] for s in (0, 1, 1))
    loaded = encoder_init(str(tmp_path / "g.pt"))
    enc = [k for k in a if k in loaded]
    dec = [k for k in a if k not in loaded and a[k].is_floating_point() and a[k].numel() > 1]
    assert enc and dec and all(torch.equal(a[k], b[k]) for k in enc)
    assert any(not torch.equal(a[k], b[k]) for k in dec) and all(torch.equal(b[k], c[k]) for k in a)


def test_diagnostics_of_a_seed_compare_with_that_seeds_start(monkeypatch):
    seen = {}
    monkeypatch.setattr(fcl_tables, "load_global_state", lambda path: {"path": path})
    monkeypatch.setattr(fcl_tables, "load_sites", lambda data_root, settings: {})
    monkeypatch.setattr(fcl_tables, "diagnose_acdc", lambda label, summary, state, sites, settings, *, seed:
                        seen.update(label=label, state=state, seed=seed) or {"method": label})
    fcl_tables.diagnose_one("FCL", {"summary": "s.json", "global_model": "FCL_s2.pt"}, data_root="d", settings={},
                            seed=2)
    assert seen == {"label": "FCL seed 2", "state": {"path": "FCL_s2.pt"}, "seed": 2}


def test_local_cl_local_cells_use_each_sites_own_encoder(monkeypatch, tmp_path, data_root):
    fakes = Fakes()
    _run(monkeypatch, fakes, tmp_path / "out", data_root, methods=["Local CL", "FCL"], n_labelled=[1], folds=[0])
    inits = {(k["stage"], k["method"], k.get("site")): init for k, init in fakes.finetuned + fakes.federated}
    assert inits[("local", "Local CL", "site-1")] == "local_cl_site-1.pt"
    assert inits[("local", "Local CL", "site-2")] == "local_cl_site-2.pt"
    assert inits[("centralised", "Local CL", None)] == inits[("federated", "Local CL", None)] == "local_cl_site-1.pt"
    assert inits[("local", "FCL", "site-2")] == inits[("centralised", "FCL", None)] == "FCL.pt"


def _tiny_sites() -> dict[str, list[Volume]]:
    rng = np.random.default_rng(0)
    out = {}
    for site in SITES:
        out[site] = []
        for p in range(5):  # 5 folds -> 4 training / 1 validation patient per site
            for phase in ("ED", "ES"):
                label = rng.integers(0, 4, size=(2, 32, 32)).astype(np.uint8)
                out[site].append(Volume(f"{site}p{p}", phase, (label / 3.0).astype(np.float32), label, site))
    return out


def test_same_split_for_every_method(monkeypatch):
    """The real fine-tuning cell: which patients train and validate depends on (fold, N, site), not the method."""
    monkeypatch.setattr(fcl_tables, "load_sites", lambda data_root, settings: _tiny_sites())
    settings = {"features": TINY_FEATURES, "epochs": 1, "lr": 1e-3, "device": "cpu", "min_steps": 0,
                "norm": "batch"}
    for stage, site in (("local", "site-2"), ("centralised", None)):
        seen = []
        for method in ("random", "FCL"):
            key = {"stage": stage, "method": method, "n_labelled": 2, "fold": 1}
            if site:
                key["site"] = site
            row = fcl_tables.finetune_one(key, "random", "unused", settings)
            seen.append((row["train_patients"], row["val_patients"], row["site"]))
        assert seen[0] == seen[1]
        key["seed"] = 1  # another training seed: the same patients, another run
        other = fcl_tables.finetune_one(key, "random", "unused", settings)
        assert (other["train_patients"], other["val_patients"]) == seen[0][:2] and other["seed"] == 1
        assert other["dice"] != row["dice"] and row["seed"] == 0
        assert len(seen[0][0]) == 2 and len(seen[0][1]) == 2  # N=2; one validation patient per site, pooled
        if site:  # a local cell trains on its own site's patients only
            assert all(p.startswith(site) for p in seen[0][0]) and seen[0][2] == site


def test_table_folds_from_the_profile(tmp_path):
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"tables": {"fcl": {"folds": {"2": [0], "3": [1, 3]}}}}))
    assert table_folds(str(profile), 2, None) == [0]
    assert table_folds(str(profile), 3, None) == [1, 3]
    assert table_folds(str(profile), 1, None) == [0, 1, 2, 3, 4]  # not in the profile: all five
    assert table_folds(str(profile), 2, [2, 4]) == [2, 4]  # --folds wins
    profile.write_text(json.dumps({"tables": {"fcl": {"folds": {"2": [7]}}}}))
    with pytest.raises(ValueError, match=r"folds\['2'\]=\[7\]"):
        table_folds(str(profile), 2, None)


def test_rerun_with_other_settings_is_refused(monkeypatch, tmp_path, data_root):
    _run(monkeypatch, Fakes(), tmp_path / "out", data_root, tables=[3])
    with pytest.raises(ValueError, match=r"run_config\.json.*epochs"):
        _run(monkeypatch, Fakes(), tmp_path / "out", data_root, tables=[3], epochs=3)


@pytest.fixture
def one_thread_after():
    """Tests that run a runner at another thread count leave this process at one thread, as the suite runs."""
    yield
    torch.set_num_threads(1)


def test_thread_count_is_a_setting_and_the_environment_is_recorded(monkeypatch, tmp_path, data_root, one_thread_after):
    said = []
    _run(monkeypatch, Fakes(), tmp_path / "out", data_root, tables=[3], threads=2, say=said.append)
    assert torch.get_num_threads() == 2  # this process computes with the run's threads
    config = json.loads((tmp_path / "out" / "run_config.json").read_text())
    assert config["threads"] == 2 and config["environments"][0]["threads"] == 2
    assert {"torch", "nvflare", "monai", "numpy", "python", "cpu", "blas", "env"} <= set(config["environments"][0])
    with pytest.raises(ValueError, match=r"threads=2 \(now 1\).*pass --threads 2 to resume this folder"):
        _run(monkeypatch, Fakes(), tmp_path / "out", data_root, tables=[3], threads=1)


def test_a_cell_run_again_with_the_recorded_settings_is_bit_identical(tmp_path):
    """The real Table 1 cell (local fine-tuning of a U-Net on one site, one epoch) run twice, into two folders at the
    same recorded settings and thread count: the same result to the last bit, not merely close."""
    from fedssl.data.acdc_synthetic import write_synthetic_acdc

    write_synthetic_acdc(tmp_path / "data", n_patients=10, n_sites=2, shape=(32, 32), n_frames=2, slices_range=(2, 3))
    profile = tmp_path / "tiny.json"
    profile.write_text(json.dumps({"extends": "quick", "finetune": {"features": list(TINY_FEATURES), "image_size": 32,
                                                                    "target_spacing": 5.0}}))
    runs = []
    for name in ("a", "b"):
        torch.manual_seed(len(runs))  # the process's global generator is not the cell's: its own seed decides
        run_fcl_tables(str(tmp_path / name), tables=[1], methods=["random"], n_labelled=[1], folds=[0], n_sites=2,
                       profile=str(profile), data_root=str(tmp_path / "data"), epochs=1, workers=1, seeds=[0],
                       threads=1, say=lambda m: None)
        runs.append([json.loads(line) for line in open(tmp_path / name / "cells.jsonl")])
        assert json.loads((tmp_path / name / "run_config.json").read_text())["threads"] == 1
    (a, b) = ([(r["key"], r["result"]) for r in run] for run in runs)
    assert len(a) == 2 and a == b  # every key and result field, Dice included, exactly equal


class FileFakes(Fakes):
    """Pre-training that leaves its files on disk (summary, global model or the sites' encoders), as the real one."""

    def pretrain(self, method, workspace, *, data_root, n_sites, profile, rounds, seed=0):
        out = super().pretrain(method, workspace, data_root=data_root, n_sites=n_sites, profile=profile,
                               rounds=rounds, seed=seed)
        os.makedirs(workspace, exist_ok=True)
        out = {k: (os.path.join(workspace, os.path.basename(v)) if isinstance(v, str) else
                   {s: os.path.join(workspace, os.path.basename(p)) for s, p in v.items()}) for k, v in out.items()}
        for path in fcl_tables.pretraining_files(out):
            open(path, "w").close()
        return out


def test_pretraining_reused_from_another_folder(monkeypatch, tmp_path, data_root):
    first = FileFakes()
    _run(monkeypatch, first, tmp_path / "a", data_root, methods=["random", "Local CL", "FCL"], tables=[1])
    assert first.pretrained == ["Local CL", "FCL"]
    said, second = [], FileFakes()
    # other fine-tuning epochs (another run config), one more method: only that one is pre-trained here
    _run(monkeypatch, second, tmp_path / "b", data_root, methods=["random", "Local CL", "FCL", "FedMoCo"],
         tables=[1], epochs=3, pretrained_from=str(tmp_path / "a"), say=said.append)
    assert second.pretrained == ["FedMoCo"]
    assert "pre-training of Local CL, FCL reused from" in " ".join(said)
    inits = {(k["method"], k["site"]): init for k, init in second.finetuned}
    assert inits[("FCL", "site-2")] == str(tmp_path / "a" / "ws" / "pretrain_FCL" / "FCL.pt")
    assert inits[("Local CL", "site-2")] == str(tmp_path / "a" / "ws" / "pretrain_Local_CL" / "local_cl_site-2.pt")
    assert inits[("FedMoCo", "site-2")] == str(tmp_path / "b" / "ws" / "pretrain_FedMoCo" / "FedMoCo.pt")
    assert [m for m, _ in second.diagnosed] == ["Local CL", "FCL", "FedMoCo"]  # diagnostics run in the new folder
    records = [json.loads(line) for line in open(tmp_path / "b" / "cells.jsonl")]
    reused = {r["key"]["method"]: r["result"].get("reused_from") for r in records if r["key"]["stage"] == "pretrain"}
    assert reused == {"Local CL": str(tmp_path / "a"), "FCL": str(tmp_path / "a"), "FedMoCo": None}
    third = FileFakes()  # resuming b without the option: nothing pre-trained again
    _run(monkeypatch, third, tmp_path / "b", data_root, methods=["random", "Local CL", "FCL", "FedMoCo"],
         tables=[1], epochs=3)
    assert third.pretrained == [] and third.finetuned == []


def test_pretraining_reuse_refused_when_it_ran_otherwise(monkeypatch, tmp_path, data_root):
    _run(monkeypatch, FileFakes(), tmp_path / "a", data_root, tables=[1])
    with pytest.raises(ValueError, match=r"pretrained_from=.*rounds=None \(here 2\)"):
        _run(monkeypatch, FileFakes(), tmp_path / "b", data_root, tables=[1], rounds=2,
             pretrained_from=str(tmp_path / "a"))
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"extends": "bench", "jobs": {"fcl_acdc": {"meta": {"x": 1}}}}))
    with pytest.raises(ValueError, match="sets the jobs differently"):
        _run(monkeypatch, FileFakes(), tmp_path / "c", data_root, tables=[1], profile=str(profile),
             pretrained_from=str(tmp_path / "a"))
    profile.write_text(json.dumps({"extends": "bench", "finetune": {"min_steps": 100}}))  # fine-tuning only: allowed
    _run(monkeypatch, FileFakes(), tmp_path / "d", data_root, tables=[1], profile=str(profile),
         pretrained_from=str(tmp_path / "a"))
    os.remove(tmp_path / "a" / "ws" / "pretrain_FCL" / "FCL.pt")
    with pytest.raises(ValueError, match=r"FCL's pre-training points at .*FCL\.pt, which is gone"):
        _run(monkeypatch, FileFakes(), tmp_path / "e", data_root, tables=[1], pretrained_from=str(tmp_path / "a"))
    with pytest.raises(ValueError, match="run_config.json is missing; name a folder"):
        _run(monkeypatch, FileFakes(), tmp_path / "f", data_root, tables=[1], pretrained_from=str(tmp_path))
    (tmp_path / "a" / "run_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="run_config.json is unreadable .*; name a folder"):
        _run(monkeypatch, FileFakes(), tmp_path / "g", data_root, tables=[1], pretrained_from=str(tmp_path / "a"))


def test_cli_parses_into_run_fcl_tables(monkeypatch):
    seen = {}
    monkeypatch.setattr(fcl_tables, "run_fcl_tables", lambda out, **kw: seen.update(out=out, **kw))
    assert main(["fcl", "tables", "--out", "o", "--tables", "1", "3", "--methods", "random", "Local CL",
                 "--n", "1", "8", "--folds", "0", "2", "--sites", "4", "--difficulty", "0.5", "--epochs", "3",
                 "--rounds", "2", "--workers", "1", "--pretrained-from", "runs/pf", "--seeds", "0", "2"]) == 0
    assert seen == {"out": "o", "tables": [1, 3], "methods": ["random", "Local CL"], "n_labelled": [1, 8],
                    "folds": [0, 2], "n_sites": 4, "profile": "bench", "data_root": None, "difficulty": 0.5,
                    "epochs": 3, "rounds": 2, "workers": 1, "pretrained_from": "runs/pf", "seeds": [0, 2],
                    "threads": 1}
    main(["fcl", "tables", "--out", "o"])
    assert seen["folds"] is None and seen["workers"] == 2 and seen["tables"] == [1, 2, 3]
    assert seen["pretrained_from"] is None and seen["seeds"] == [0, 1, 2] and seen["threads"] == 1
    main(["fcl", "tables", "--out", "o", "--threads", "2"])
    assert seen["threads"] == 2


def test_the_runner_defaults_to_three_seeds_and_one_thread():
    import inspect

    params = inspect.signature(run_fcl_tables).parameters
    assert params["seeds"].default == (0, 1, 2) and params["threads"].default == 1


@pytest.mark.slow
def test_end_to_end_tiny(tmp_path):
    """The real thing: synthetic ACDC, FCL pre-training in the FLARE simulator (1 round), local and centralised
    fine-tuning (1 epoch), tables 1 and 3 written and parseable."""
    paths = run_fcl_tables(str(tmp_path / "out"), tables=[1, 3], methods=["random", "FCL"], n_labelled=[1],
                           folds=[0], n_sites=2, profile="quick", epochs=1, rounds=1, workers=1, seeds=[0])
    for table in (1, 3):
        data = json.loads(open(paths[table]["json"]).read())
        assert {r["method"] for r in data["rows"]} == {"random", "FCL"}
        # the table's cell = the mean of its cells' Dice (one fold: no averaging within a site)
        for row in data["rows"]:
            cells = [c["dice"] for c in data["extra"]["cell_rows"] if c["method"] == row["method"]]
            assert len(cells) == (2 if table == 1 else 1)  # two sites locally, one centralised model
            assert row["mean"] == pytest.approx(sum(cells) / len(cells)) and row["n"] == len(cells)
        assert open(paths[table]["png"], "rb").read(4) == b"\x89PNG"
        assert open(paths[table]["csv"]).read().startswith("source,table,method,column,mean,std,n")


def test_summary_rows_carry_each_seeds_mean_for_the_figure():
    def row(site, dice, seed=None):
        r = {"mode": "local", "method": "FCL", "n_labelled": 1, "fold": 0, "site": site, "dice": dice}
        return r if seed is None else {**r, "seed": seed}

    rows = [row("site-1", 0.2), row("site-2", 0.4), row("site-1", 0.6, 1), row("site-2", 0.4, 1)]
    (summary,) = fcl_tables.summary_rows(1, rows)
    assert summary["by_seed"] == {"0": pytest.approx(0.3), "1": pytest.approx(0.5)}  # seed 0 rows carry no seed
    assert (summary["mean"], summary["n"]) == (pytest.approx(0.4), 2)  # sites averaged over seeds first
