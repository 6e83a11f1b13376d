"""The FedCLF tables runner (fedssl.experiments.fedclf_tables) with a fake simulator and a fake local protocol:
cells keyed by training seed and split seed, the inits each cell starts from, rows pooled over seeds by hand, the paired
difference and its standard error over seeds by hand, the verdict, the one-seed note, files with the paper's numbers,
resume, seeds added to a folder and a changed split seed refused."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from fedssl.experiments import fedclf_tables as ft
from fedssl.models.resnet import PretrainingResNet

torch.set_num_threads(1)

RECALL = {"random": 0.40, "local_cl": 0.42, "fedclf": 0.50}
#: what a pre-trained start adds to the recall, per training seed: paired differences of 10, 4 and 1 points
GAIN = {0: 0.10, 1: 0.04, 2: 0.01}


def global_model(seed: int) -> dict:
    """The fake pre-training's global model of training seed ``seed`` (so a fine-tuning's init names its seed)."""
    return PretrainingResNet("moco", 4, 8, seed=1000 + seed).state_dict()


def _set(sets, name: str) -> str:
    return next(s.split("=", 1)[1] for s in sets if s.startswith(name + "="))


class FakeSimulator:
    """Writes what a finished run leaves: a pre-training global model (of the run's training seed) and the devices'
    checkpoints, or a fine-tuning test report whose mean recall per device depends on the method it started from
    and, for a pre-trained start, on the training seed (:data:`GAIN`)."""

    def __init__(self):
        self.calls = []

    def __call__(self, job_dir, workspace, *, n_sites, data_root, profile, sets, echo):
        self.calls.append({"job": os.path.basename(job_dir), "workspace": workspace, "sets": list(sets)})
        run_dir = os.path.join(workspace, "server", "simulate_job")
        os.makedirs(run_dir, exist_ok=True)
        model = os.path.join(run_dir, "FL_global_model.pt")
        if job_dir.endswith(ft.PRETRAIN_JOB):
            torch.save({"model": global_model(int(_set(sets, "server.model.seed")))}, model)
            rounds = [{"round": r, "mean_loss": 5.0 - 0.5 * r,
                       "site_record_means": {"feature_std": 0.1 / 2 ** r, "queue_remote_fraction": 1.0}}
                       for r in range(3)]
            with open(os.path.join(run_dir, "summary.json"), "w") as f:
                json.dump({"rounds": rounds}, f)
            for k in range(1, n_sites + 1):
                os.makedirs(os.path.join(workspace, f"site-{k}", "simulate_job"), exist_ok=True)
                torch.save({"trainer": {"model": PretrainingResNet("moco", 4, 8, seed=100 + k).state_dict()}},
                           os.path.join(workspace, f"site-{k}", "simulate_job", "fedclf_client_state.pt"))
        else:
            init = _set(sets, "server.model.pretrained_path")
            method = "random" if not init else "local_cl" if "local_cl" in init else "fedclf"
            gain = 0.0 if method == "random" else GAIN[int(_set(sets, "client.cls_trainer.seed"))]
            sites = {f"site-{k}": {"balanced_accuracy": RECALL[method] + 0.01 * k + gain, "macro_precision": 0.3}
                     for k in range(1, n_sites + 1)}
            with open(os.path.join(run_dir, "test_metrics.json"), "w") as f:
                json.dump({"sites": sites, "model": "best"}, f)
        return {"global_model": model, "workspace": workspace, "simulator_wall_time_s": 1.0}


@pytest.fixture
def fake_local(monkeypatch):
    """Table I's protocol replaced: records (site, kind of init, the init's training seed, L, epochs, the training
    seed and the split seed it was given) and scores random init 40 (+1 on odd devices), a device's own encoder 42,
    a global model 40 plus its seed's :data:`GAIN`."""
    seen = []

    def local(train, val, test, *, init, site, label_fraction, **kw):
        k = int(site.split("-")[1])
        head = "main.head.0.weight"
        if init is None:
            kind, init_seed = "random", None
        elif torch.equal(init[head], PretrainingResNet("moco", 4, 8, seed=100 + k).state_dict()[head]):
            kind, init_seed = "own", None
        else:
            kind, init_seed = "global", next(s for s in GAIN if torch.equal(init[head], global_model(s)[head]))
        seen.append({"site": site, "kind": kind, "init_seed": init_seed, "fraction": label_fraction,
                     "epochs": kw["epochs"], "seed": kw["seed"], "split_seed": kw["split_seed"]})
        base = {"random": 0.40, "own": 0.42, "global": 0.40 + GAIN.get(init_seed, 0.0)}[kind]
        return {"site": site, "test": {"balanced_accuracy": base + 0.01 * (k % 2), "macro_precision": 0.3}}

    monkeypatch.setattr(ft, "local_finetune_device", local)
    monkeypatch.setattr(ft, "load_device", lambda root, site, split: [])
    return seen


def test_default_seeds_and_cells_keyed_by_seed_and_split_seed():
    for profile in ("bench", "quick"):
        s = ft.table_settings(profile)
        assert tuple(s["seeds"]) == (0, 1, 2) and s["split_seed"] == 0
    s = ft.table_settings("bench", split_seed=4)
    pre, local, fed = ft.pretrain_cells(s), ft.local_cells(s), ft.federated_cells(s)
    assert len(pre) == 3 * 6  # every method but random init pre-trains, once per training seed
    assert len(local) == 3 * 4 * 7 * 10 and len(fed) == 3 * 4 * 7
    assert pre[0] == {"stage": "pretrain", "method": "local_cl", "seed": 0, "split_seed": 4}
    assert local[0] == {"stage": "local", "method": "random", "fraction": 0.1, "site": "site-1", "seed": 0,
                        "split_seed": 4}
    assert fed[-1] == {"stage": "federated", "method": "fedclf", "fraction": 0.8, "seed": 2, "split_seed": 4}
    for cells in (pre, local, fed):
        assert [c["seed"] for c in cells] == sorted(c["seed"] for c in cells)  # seed-major
        assert {c["split_seed"] for c in cells} == {4} and {c["seed"] for c in cells} == {0, 1, 2}
    assert ft.local_cells(ft.table_settings("bench", tables=[2])) == []
    with pytest.raises(ValueError, match="fractions="):
        ft.table_settings("bench", fractions=[0.3])
    for bad in ([0, 0], [], [-1], [True]):
        with pytest.raises(ValueError, match="seeds="):
            ft.table_settings("bench", seeds=bad)
    with pytest.raises(ValueError, match="split_seed"):
        ft.table_settings("bench", split_seed=-1)
    with pytest.raises(ValueError, match=r"fedclf tables: argument settings=\['seed'\]"):  # no alias of before
        ft.table_settings("bench", seed=1)


def test_one_seed_inits_rows_verdict_note_and_resume(tmp_path, fake_local):
    s = ft.table_settings("bench", methods=["random", "local_cl", "fedclf"], fractions=[0.1], local={"epochs": 2},
                          seeds=[0])
    sim = FakeSimulator()
    lines = []
    written = ft.run_fedclf_tables(str(tmp_path / "out"), s, data_root=str(tmp_path), say=lines.append, simulate=sim)
    jobs = [c["job"] for c in sim.calls]
    assert jobs == [ft.PRETRAIN_JOB] * 2 + [ft.FINETUNE_JOB] * 3
    # Table I: random init from nothing, Local CL from each device's own encoder, FedCLF from the global model
    kinds = {(c["site"], c["kind"]) for c in fake_local}
    assert ("site-3", "own") in kinds and ("site-3", "global") in kinds and ("site-3", "random") in kinds
    assert {c["epochs"] for c in fake_local} == {2} and {c["fraction"] for c in fake_local} == {0.1}
    # Table II: Local CL fine-tunes from device 1's own encoder, exported as a model file
    local_cl = next(c for c in sim.calls[2:] if "local_cl_site-1_seed0.pt" in " ".join(c["sets"]))
    assert "client.cls_trainer.label_fraction=0.1" in local_cl["sets"]
    # rows by hand: Table I recall for FedCLF = mean of 50 / 51 over 10 devices = 50.5 +- 0.5
    with open(written["tableI_recall"]["json"]) as f:
        t1 = json.load(f)
    row = next(r for r in t1["rows"] if r["method"] == "FedCLF")
    assert row["mean"] == pytest.approx(50.5) and row["std"] == pytest.approx(0.5) and row["n"] == 10
    assert row["seeds"] == [0] and row["by_seed"] == {"0": pytest.approx(50.5)}
    assert any(r["method"] == "FedCLF" and r["mean"] == 30.41 for r in t1["paper"]["rows"])  # the paper's Table I
    assert t1["extra"]["seeds"] == [0] and t1["extra"]["split_seed"] == 0
    # Table II: 60 + k vs 40 + k per device: +20.00 +- 0.00 -> helped
    text = open(written["tableII_recall"]["txt"]).read()
    assert "FedCLF vs Random Init., Table II at L=10%: +20.00 +- 0.00 mean recall (points) over 10 devices -> " \
           "pre-training helped" in text
    # one seed: said under every table (its verdict above is not a finding)
    note = "one seed (0): not a finding; run --seeds 0 1 2 (a method's sign can change from one seed to the next)"
    assert note in text.split("paper (")[-1]
    assert all(note in open(written[name]["txt"]).read() for name in ("tableI_recall", "tableI_precision", "fig6"))
    assert os.path.isfile(written["fig6"]["png"])
    # diagnostics: first / middle / last round of each pre-training's summary
    diag = open(written["diagnostics"]["txt"]).read()
    assert "FedCLF seed 0: rounds 0 / 1 / 2: loss 5.000 / 4.500 / 4.000; feature spread 0.100 / 0.050 / 0.025; " \
           "remote share of the negative queue 1.00" in diag and "Local CL seed 0: rounds" in diag
    # resume: nothing runs again
    again = FakeSimulator()
    fake_local.clear()
    ft.run_fedclf_tables(str(tmp_path / "out"), s, data_root=str(tmp_path), say=lines.append, simulate=again)
    assert again.calls == [] and fake_local == []
    config = json.load(open(tmp_path / "out" / "run_config.json"))
    assert config["threads"] == 1 and config["seeds"] == [0] and config["split_seed"] == 0


def test_three_seeds_pool_rows_and_pair_by_seed_with_the_standard_error_over_seeds(tmp_path, fake_local):
    """FedCLF minus random init is 10, 4 and 1 points on every device at seeds 0, 1, 2: the per-seed differences
    are 10 / 4 / 1, their mean 5, sample std sqrt((25 + 1 + 16) / 2) = sqrt(21), so the standard error over seeds is
    sqrt(21 / 3) = sqrt(7) = 2.65; their population std (the verdict's spread) sqrt(42 / 3) = 3.74."""
    s = ft.table_settings("bench", methods=["random", "fedclf"], fractions=[0.1], local={"epochs": 1})
    sim = FakeSimulator()
    written = ft.run_fedclf_tables(str(tmp_path / "out"), s, data_root=str(tmp_path), say=lambda m: None,
                                   simulate=sim)
    # every training seed fine-tunes on split seed 0, a pre-trained start from its own seed's pre-training
    assert {c["split_seed"] for c in fake_local} == {0} and {c["seed"] for c in fake_local} == {0, 1, 2}
    assert all(c["init_seed"] == c["seed"] for c in fake_local if c["kind"] == "global")
    fine = [c for c in sim.calls if c["job"] == ft.FINETUNE_JOB]
    assert sorted(_set(c["sets"], "client.cls_trainer.seed") for c in fine) == ["0", "0", "1", "1", "2", "2"]
    assert {_set(c["sets"], "client.cls_trainer.split_seed") for c in fine} == {"0"}
    pre = [c for c in sim.calls if c["job"] == ft.PRETRAIN_JOB]
    assert [_set(c["sets"], "client.fedclf_trainer.seed") for c in pre] == ["0", "1", "2"]
    # cells keyed by training seed and split seed
    keys = [json.loads(line)["key"] for line in open(tmp_path / "out" / "cells.jsonl")]
    assert {(k["stage"], k["seed"], k["split_seed"]) for k in keys if k["method"] == "fedclf"} == {
        (stage, sd, 0) for stage in ("pretrain", "local", "federated") for sd in (0, 1, 2)}
    assert len(keys) == 3 + 3 * 2 * 10 + 3 * 2
    # Table I rows: each device averaged over seeds first (40 + k % 2 + 5), then mean +- std over devices
    t1 = json.load(open(written["tableI_recall"]["json"]))
    rows = {r["method"]: r for r in t1["rows"]}
    assert rows["FedCLF"]["mean"] == pytest.approx(45.5) and rows["FedCLF"]["std"] == pytest.approx(0.5)
    assert rows["FedCLF"]["n"] == 10 and rows["FedCLF"]["seeds"] == [0, 1, 2]
    assert rows["FedCLF"]["by_seed"] == {"0": pytest.approx(50.5), "1": pytest.approx(44.5), "2": pytest.approx(41.5)}
    assert rows["Random Init."]["by_seed"] == {sd: pytest.approx(40.5) for sd in ("0", "1", "2")}
    (p,) = t1["extra"]["paired_against_random"]
    assert p["method"] == "FedCLF" and p["fraction"] == 0.1 and p["pairs"] == 30 and p["seeds"] == 3
    assert p["by_seed"] == {"0": pytest.approx(10.0), "1": pytest.approx(4.0), "2": pytest.approx(1.0)}
    assert p["diff_mean"] == pytest.approx(5.0) and p["seed_se"] == pytest.approx(math.sqrt(7.0))
    assert p["diff_se"] == pytest.approx(math.sqrt(420 / 29) / math.sqrt(30))  # over all 30 (device, seed) pairs
    text = open(written["tableI_recall"]["txt"]).read()
    assert "FedCLF minus Random Init.: L=10% +5.00 (SE 0.69) ahead in 30/30, by seed +10.00 / +4.00 / +1.00 " \
           "(SE over seeds 2.65)" in text
    assert "FedCLF vs Random Init., Table I at L=10%: +5.00 +- 3.74 mean recall (points) over 3 seeds (each the " \
           "mean over its devices) -> pre-training helped" in text
    # Table II the same by seed (its devices differ by 1 point each, the gain is the same)
    (p2,) = json.load(open(written["tableII_recall"]["json"]))["extra"]["paired_against_random"]
    assert p2["seed_se"] == pytest.approx(math.sqrt(7.0)) and p2["diff_mean"] == pytest.approx(15.0)
    assert all("not a finding" not in open(written[n]["txt"]).read() for n in ("tableI_recall", "tableII_recall"))


class FailingSimulator(FakeSimulator):
    """FakeSimulator whose seed-1 pre-trainings never get below ln(257) = 5.549 (the bench bank, K = 256): their
    loss stays at 6.0, their spread healthy."""

    def __call__(self, job_dir, workspace, *, n_sites, data_root, profile, sets, echo):
        out = super().__call__(job_dir, workspace, n_sites=n_sites, data_root=data_root, profile=profile, sets=sets,
                               echo=echo)
        if job_dir.endswith(ft.PRETRAIN_JOB) and _set(sets, "server.model.seed") == "1":
            rounds = [{"round": r, "mean_loss": 6.0, "site_record_means": {"feature_std": 0.1}} for r in range(3)]
            with open(os.path.join(workspace, "server", "simulate_job", "summary.json"), "w") as f:
                json.dump({"rounds": rounds}, f)
        return out


def test_a_failed_pretraining_is_marked_in_the_tables_rows_verdict_and_paired_lines(tmp_path, fake_local):
    s = ft.table_settings("bench", methods=["random", "fedclf"], fractions=[0.1], tables=[1], local={"epochs": 1},
                          seeds=[0, 1])
    lines = []
    written = ft.run_fedclf_tables(str(tmp_path / "out"), s, data_root=str(tmp_path), say=lines.append,
                                   simulate=FailingSimulator())
    text = open(written["tableI_recall"]["txt"]).read()
    bundle, paper = text.split("bundle (measured here)")[1].split("paper (")
    assert [ln.split("  ")[0] for ln in bundle.splitlines()[3:5]] == [
        "Random Init.", "FedCLF [failed pre-training: seed 1]"]
    assert any(ln.startswith("FedCLF  ") for ln in paper.splitlines())  # the paper's row keeps the plain label
    reason = "loss never below chance: min loss 6.000 (round 0) vs ln(K+1), K = 256 = 5.549"
    assert f"[failed pre-training] FedCLF seed 1: {reason}" in paper.splitlines()
    assert "FedCLF [failed pre-training: seed 1] minus Random Init.: L=10% +7.00" in text
    assert ("over 2 seeds (each the mean over its devices) -> not FedCLF's result: its pre-training failed at seed 1 "
            "of 2 ([failed pre-training] below)") in text and "-> pre-training" not in text
    rows = {r["method"]: r for r in json.load(open(written["tableI_precision"]["json"]))["rows"]}
    assert rows["FedCLF"]["pretraining_failed"] is True and rows["FedCLF"]["pretraining_failed_at"] == ["seed 1"]
    assert rows["FedCLF"]["pretraining_reasons"] == {"seed 1": [reason]} and rows["FedCLF"]["mean"] is not None
    assert rows["Random Init."]["pretraining_failed"] is False and "mark" not in rows["Random Init."]
    diag = open(written["diagnostics"]["txt"]).read()
    assert f"FedCLF seed 1: rounds 0 / 1 / 2: loss 6.000 / 6.000 / 6.000; feature spread 0.100 / 0.100 / 0.100; " \
           f"loss health: FAILED pre-training: {reason}" in diag
    assert "FedCLF seed 0: rounds" in diag and "loss health: ok (min loss 4.000 vs ln(K+1), K = 256 = 5.549" in diag


def test_seeds_add_to_a_folder_but_another_split_seed_is_refused(tmp_path, fake_local):
    out = str(tmp_path / "out")
    s = ft.table_settings("bench", methods=["random", "fedclf"], fractions=[0.1], tables=[2], seeds=[0])
    ft.run_fedclf_tables(out, s, data_root=str(tmp_path), say=lambda m: None, simulate=FakeSimulator())
    more = FakeSimulator()
    ft.run_fedclf_tables(out, {**s, "seeds": [0, 1]}, data_root=str(tmp_path), say=lambda m: None, simulate=more)
    assert {_set(c["sets"], "server.model.seed") for c in more.calls} == {"1"}  # seed 0's cells resumed
    assert json.load(open(os.path.join(out, "run_config.json")))["seeds"] == [0, 1]
    with pytest.raises(ValueError, match=r"split_seed=0 \(now 1\)") as e:
        ft.run_fedclf_tables(out, {**s, "split_seed": 1}, data_root=str(tmp_path), say=lambda m: None,
                             simulate=FakeSimulator())
    assert "\n" not in str(e.value)


def test_stage_sets_reach_every_run_of_their_stage(tmp_path, fake_local):
    s = ft.table_settings("bench", methods=["random", "fedclf"], fractions=[0.1], tables=[2], pretrain_rounds=3,
                          pretrain_sets=["client.fedclf_trainer.batch_size=32"],
                          finetune_sets=["client.cls_trainer.local_epochs=2"], seeds=[0])
    sim = FakeSimulator()
    ft.run_fedclf_tables(str(tmp_path / "out"), s, data_root=str(tmp_path), say=lambda m: None, simulate=sim)
    pre, *fine = sim.calls
    assert pre["sets"] == ["server.scatter_and_gather.min_clients=10", "server.scatter_and_gather.num_rounds=3",
                           "server.model.seed=0", "client.fedclf_trainer.seed=0", "client.fedclf_trainer.batch_size=32"]
    assert all("client.cls_trainer.local_epochs=2" in c["sets"] for c in fine) and len(fine) == 2
    assert all("client.fedclf_trainer.batch_size=32" not in c["sets"] for c in fine)
    # Table I's model shape follows the fine-tuning job with the same overrides
    assert ft.local_settings(ft.table_settings("bench", finetune_sets=["shape.width=4"]))["width"] == 4
    with pytest.raises(ValueError, match="finetune_sets"):
        ft.table_settings("bench", finetune_sets=["local_epochs"])


def test_demo_runs_its_cells_at_the_quick_profile(tmp_path, fake_local, monkeypatch):
    seen = {}

    def tables(out, settings, **kw):
        seen.update(settings)
        return {}

    monkeypatch.setattr(ft, "run_fedclf_tables", tables)
    ft.run_fedclf_demo(str(tmp_path))
    assert seen["profile"] == "quick" and seen["methods"] == ["random", "fedmoco", "fedclf"]
    assert seen["fractions"] == [0.1, 0.8] and seen["tables"] == [1, 2] and seen["seeds"] == [0]
    assert len(ft.local_cells(seen)) == 3 * 2 * 10 and len(ft.federated_cells(seen)) == 6


def test_the_training_seed_reaches_the_models_and_the_split_seed_the_labelled_draw():
    s = ft.table_settings("bench", seeds=[3], split_seed=5)
    for stage, trainer in (("pretrain", "fedclf_trainer"), ("finetune", "cls_trainer")):
        sets = ft._job_sets(s, stage, 3)
        assert "server.model.seed=3" in sets and f"client.{trainer}.seed=3" in sets
    assert "client.cls_trainer.split_seed=5" in ft._job_sets(s, "finetune", 3)
    assert not any("split_seed" in x for x in ft._job_sets(s, "pretrain", 3))
    for seed in (0, 3):
        kw = ft.local_settings(s, seed)
        assert kw["seed"] == seed and kw["split_seed"] == 5


def test_fig6_bars_are_wired_to_the_papers_equations():
    """Issue 47: the "FE" bar wired to eq. 5 (remote negatives only) passed every test.  Fig. 6: W/o FE = plain
    MoCo (queue none), FE = local + remote negatives (eq. 4, queue fe), FE+Neg = FedCLF (eq. 5, queue fe_neg, the
    job's own setting)."""
    import json as _json

    from fedssl.experiments.fedclf_tables import METHODS
    from fedssl.ops.jobs import REPO_ROOT

    config = _json.load(open(f"{REPO_ROOT}/jobs/fedclf_derm/app/config/config_fed_client.json"))
    trainer = next(e for e in config["executors"] if e["executor"]["id"] == "fedclf_trainer")["executor"]["args"]

    def queue(method):
        sets = [s.split("=", 1)[1] for s in METHODS[method]["sets"] if s.startswith("client.fedclf_trainer.queue=")]
        return sets[-1] if sets else trainer["queue"]

    assert {m["fig6"]: queue(name) for name, m in METHODS.items() if "fig6" in m} == {
        "W/o FE": "none", "FE": "fe", "FE+Neg": "fe_neg"}
