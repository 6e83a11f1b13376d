"""The SSL-FL retina table runner (fedssl.experiments.sslfl_tables): cells, resume with a fake simulator, rows and
files, settings checks, the CLI verb; one slow end-to-end run in the FLARE simulator."""

from __future__ import annotations

import json
import os

import pytest
import torch

from fedssl.experiments import sslfl_tables as st

torch.set_num_threads(1)

TINY = {"n_images": 120, "image_px": 16, "min_per_site": 2}


class FakeSimulator:
    """Stands in for run_simulation: records each call, writes what a finished run leaves behind (a global model;
    for fine-tuning test_metrics.json with a fixed accuracy per method) and can fail on a chosen call."""

    ACCURACY = {"scratch": 0.625, "fedmae": 0.75, "fedbeit": 0.5}

    def __init__(self, fail_at: int | None = None):
        self.calls: list[dict] = []
        self.fail_at = fail_at

    def __call__(self, job_dir, workspace, *, n_sites, data_root, profile, sets, echo):
        self.calls.append({"job": os.path.basename(job_dir), "workspace": workspace, "data_root": data_root,
                           "profile": profile, "sets": list(sets), "n_sites": n_sites})
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            raise RuntimeError("simulator died")
        run_dir = os.path.join(workspace, "server", "simulate_job")
        os.makedirs(run_dir, exist_ok=True)
        model = os.path.join(run_dir, "FL_global_model.pt")
        open(model, "w").close()
        if job_dir.endswith(st.FINETUNE_JOB):
            method = os.path.basename(workspace).split("_")[1]
            with open(os.path.join(run_dir, "test_metrics.json"), "w") as f:
                json.dump({"mean": {"accuracy": self.ACCURACY[method], "auc": 0.5, "n": 12}, "model": "best"}, f)
        return {"global_model": model, "simulator_wall_time_s": 1.0, "workspace": workspace,
                "rounds": [{"mean_loss": 1.0}, {"mean_loss": 0.5}]}


class FakeDiagnose:
    """Stands in for diagnose_cell: records the cells it is asked for and returns a diagnostics dict by hand."""

    def __init__(self):
        self.keys: list[dict] = []

    def __call__(self, key, out, settings, parts, store):
        self.keys.append(dict(key))
        store.get({**key, "stage": "pretrain"})  # the pre-training it diagnoses has run
        return {"method": f"{key['method']} split {key['split']}", "rounds": [],
                "spread": {"what": "pooled tokens", "value": 0.002, "random": 0.05, "reference": 0.14},
                "probe": {"metric": "accuracy", "setting": "label fraction 1", "pretrained": 0.6, "pretrained_std": 0.0,
                          "random": 0.7, "random_std": 0.0, "n_sites": 5}}


def test_cells_one_pretraining_per_split_and_method_then_every_finetuning():
    s = st.table_settings("bench", seeds=[0, 1])
    pre, fine = st.pretrain_cells(s), st.finetune_cells(s)
    assert len(pre) == 2 * 3 * 2 and len(fine) == 2 * 3 * 3  # seeds x splits x (pre-trained | all) methods
    assert pre[0] == {"stage": "pretrain", "method": "fedmae", "split": 1, "seed": 0}
    assert {c["method"] for c in pre} == {"fedmae", "fedbeit"}  # ViT scratch has nothing to pre-train
    assert fine[:3] == [{"stage": "finetune", "method": m, "split": 1, "seed": 0}
                        for m in ("scratch", "fedmae", "fedbeit")]
    assert st.pretrain_cells(st.table_settings("bench", methods=["scratch"])) == []
    assert st.diagnostics_cells(s) == [{**k, "stage": "diagnostics"} for k in pre]
    # SSL-FL sec. IV-B1: Split-1 / 2 / 3 = Dirichlet alpha 100 / 1.0 / 0.5
    assert st.SPLIT_ALPHA == {1: 100.0, 2: 1.0, 3: 0.5}


def test_settings_are_checked_naming_the_setting():
    with pytest.raises(ValueError, match="splits=.*use distinct values from"):
        st.table_settings("bench", splits=[4])
    with pytest.raises(ValueError, match="methods=.*use distinct values from"):
        st.table_settings("bench", methods=["fedmae", "fedmae"])
    with pytest.raises(ValueError, match="seeds="):
        st.table_settings("bench", seeds=[-1])
    with pytest.raises(ValueError, match="n_images="):
        st.table_settings("bench", n_images=0)


def test_resume_after_a_failed_cell_runs_only_the_unfinished_cells(tmp_path):
    settings = st.table_settings("bench", splits=[3], methods=["scratch", "fedmae"], seeds=[0], **TINY)
    lines: list[str] = []
    failing, diagnose = FakeSimulator(fail_at=2), FakeDiagnose()  # 1: Fed-MAE pre-training, 2: scratch fine-tuning dies
    with pytest.raises(RuntimeError, match="simulator died"):
        st.run_sslfl_table(str(tmp_path), settings, say=lines.append, simulate=failing, diagnose=diagnose)
    assert any("FAILED" in m for m in lines) and diagnose.keys == []
    again = FakeSimulator()
    out = st.run_sslfl_table(str(tmp_path), settings, say=lines.append, simulate=again, diagnose=diagnose)
    assert [c["job"] for c in again.calls] == [st.FINETUNE_JOB, st.FINETUNE_JOB]  # pre-training not re-run
    assert diagnose.keys == [{"stage": "diagnostics", "method": "fedmae", "split": 3, "seed": 0}]
    text = open(out["paths"]["txt"]).read()
    # the diagnostics block under the table, and the verdict against scratch: 0.75 vs 0.625 on 12 images,
    # 2 x sqrt(.75 * .25 / 12 + .625 * .375 / 12) = 0.375 > 0.125 -> within the spread
    assert "fedmae split 3:" in text and "encoder collapsed (spread 0.002, random encoder 0.050)" in text
    assert ("Split-3, seed 0: Fed-MAE vs ViT scratch: test accuracy +0.125 (2 x binomial SE 0.375, 12 test images, "
            "one seed) -> pre-training within the spread") in text
    assert json.load(open(out["paths"]["json"]))["extra"]["diagnostics"][0]["method"] == "fedmae split 3"
    # one seed: said under the table, after the paper's block
    assert ("one seed (0): not a finding; run --seeds 0 1 2 (a method's sign can change from one seed to the next)"
            in text.split("paper (SSL-FL")[1])
    assert any("1 already done" in m for m in lines)
    # Fed-MAE fine-tunes from its split's pre-trained global model; scratch from random init; Split-3's sites
    pre_model = failing.calls[0]["workspace"] + "/server/simulate_job/FL_global_model.pt"
    assert f"server.model.pretrained_path={pre_model}" in again.calls[1]["sets"]
    assert "server.model.pretrained_path=" in again.calls[0]["sets"]
    assert again.calls[0]["data_root"].endswith(os.path.join("seed0", "split3", "{site}"))
    assert again.calls[0]["profile"] == "bench" and "client.cls_trainer.seed=0" in again.calls[0]["sets"]
    rows = {(r["method"], r["column"]): r for r in out["rows"]}
    assert rows[("ViT scratch", "Split3")]["mean"] == pytest.approx(62.5) and rows[("ViT scratch", "Split3")]["n"] == 1
    assert rows[("Fed-MAE", "Split3")]["mean"] == pytest.approx(75.0) and rows[("Fed-MAE", "Split3")]["std"] is None
    assert rows[("Fed-MAE", "Split3")]["by_seed"] == {"0": pytest.approx(75.0)}  # the figure's per-seed dots
    # a third run finds everything done and runs nothing
    third = FakeSimulator()
    st.run_sslfl_table(str(tmp_path), settings, say=lines.append, simulate=third, diagnose=diagnose)
    assert third.calls == [] and len(diagnose.keys) == 1
    # resuming into the folder with other settings is refused before anything runs
    with pytest.raises(ValueError, match="run_config.json.*n_images=120 \\(now 140\\)"):
        st.run_sslfl_table(str(tmp_path), {**settings, "n_images": 140}, say=lines.append, simulate=third)
    assert third.calls == []
    # adding a split only picks more cells: it resumes and runs only the new split's
    fourth = FakeSimulator()
    st.run_sslfl_table(str(tmp_path), {**settings, "splits": [1, 3]}, say=lines.append, simulate=fourth,
                       diagnose=diagnose)
    assert [(c["job"], c["workspace"].rsplit("_", 2)[-2]) for c in fourth.calls] == [
        ("sslfl_mae_retina", "split1"), (st.FINETUNE_JOB, "split1"), (st.FINETUNE_JOB, "split1")]


def _num_rounds(sets: list[str]) -> list[int]:
    """The num_rounds overrides among a simulator call's ``--set`` overrides."""
    return [int(x.rsplit("=", 1)[1]) for x in sets if x.startswith("server.scatter_and_gather.num_rounds=")]


def _schedule(sets: list[str], profile: str = "bench") -> dict:
    """What the sites' lr schedule is built from in a fine-tuning cell's job: the workflow's num_rounds (the
    trainer's schedule length, from the round headers) and the trainer's lr / warm-up / min_lr."""
    files = st.configured_job(os.path.join(st.REPO_ROOT, "jobs", st.FINETUNE_JOB), profile, sets)
    comps = {c["id"]: c["args"] for name in ("app/config/config_fed_server.json", "app/config/config_fed_client.json")
             for c in st.component_specs(files[name])}
    cls = comps["cls_trainer"]
    return {"num_rounds": comps["scatter_and_gather"]["num_rounds"], "lr": cls["lr"],
            "warmup_rounds": cls["warmup_rounds"], "min_lr": cls["min_lr"]}


def test_scratch_fine_tunes_ratio_times_the_pretrained_rows_rounds_and_says_so(tmp_path):
    """Issue 47: SSL-FL sec. IV-C fine-tunes from random initialisation for 1,000 rounds and the pre-trained models for
    100; the table's scratch cells get scratch_rounds_ratio (10 at bench) x the pre-trained cells' rounds, the same
    warm-up and lr, and the cosine decay over all of their rounds; the ratio and both round counts are recorded."""
    from fedssl.core.schedule import warmup_cosine

    settings = st.table_settings("bench", splits=[3], seeds=[0], **TINY)
    assert settings["scratch_rounds_ratio"] == 10
    sim = FakeSimulator()
    out = st.run_sslfl_table(str(tmp_path), settings, say=lambda m: None, simulate=sim, diagnose=FakeDiagnose())
    fine = {os.path.basename(c["workspace"]).split("_")[1]: c["sets"] for c in sim.calls
            if c["job"] == st.FINETUNE_JOB}
    assert _num_rounds(fine["scratch"]) == [600]  # bench fine-tunes 60 rounds: 10 x 60
    assert _num_rounds(fine["fedmae"]) == _num_rounds(fine["fedbeit"]) == []  # the profile's 60, untouched
    assert all(_num_rounds(c["sets"]) == [] for c in sim.calls if c["job"] != st.FINETUNE_JOB)  # pre-training too
    scratch, pre = _schedule(fine["scratch"]), _schedule(fine["fedmae"])
    assert (scratch["num_rounds"], pre["num_rounds"]) == (600, 60)
    # only the rounds scale: lr 3e-3 and 5 warm-up rounds as the pre-trained rows (the reference's scratch and
    # ImageNet scripts both pass --warmup_epochs 5 --lr 3e-3); the decay spans the scratch run's 600 rounds
    assert {k: v for k, v in scratch.items() if k != "num_rounds"} == {k: v for k, v in pre.items()
                                                                         if k != "num_rounds"}
    assert scratch["warmup_rounds"] == 5 and scratch["lr"] == 0.003

    def lr(sched, at):
        return warmup_cosine(at, sched["lr"], sched["warmup_rounds"], sched["num_rounds"], sched["min_lr"])

    assert lr(pre, 60) == pre["min_lr"] and lr(scratch, 60) > 0.95 * scratch["lr"] and lr(scratch, 600) == 1e-6
    # recorded: the settings (run_config.json, the JSON) and both round counts, in the JSON and under the table
    with open(tmp_path / "run_config.json") as f:
        assert json.load(f)["scratch_rounds_ratio"] == 10
    with open(out["paths"]["json"]) as f:
        extra = json.load(f)["extra"]
    assert extra["settings"]["scratch_rounds_ratio"] == 10
    assert extra["finetune_rounds"] == {"ViT scratch": 600, "Fed-MAE": 60, "Fed-BEiT": 60}
    under = open(out["paths"]["txt"]).read().split("paper (SSL-FL")[1]
    assert ("fine-tuning rounds: ViT scratch 600, Fed-MAE / Fed-BEiT 60 (scratch_rounds_ratio 10; SSL-FL sec. IV-C: "
            "1,000 from random initialisation vs 100, ratio 10)") in under.splitlines()


def test_scratch_ratio_scales_the_tables_own_rounds_and_is_checked():
    s = st.table_settings("bench", finetune_rounds=7, scratch_rounds_ratio=3)
    assert [st.finetune_rounds(s, m) for m in ("scratch", "fedmae", "fedbeit")] == [21, 7, 7]
    assert st.finetune_rounds(st.table_settings("bench", scratch_rounds_ratio=1), "scratch") == 60
    # the paper's ratio wherever no profile sets another: the paper profile, bench and quick (4 -> 40)
    assert [st.table_settings(p)["scratch_rounds_ratio"] for p in ("paper", "bench", "quick")] == [10, 10, 10]
    assert st.finetune_rounds(st.table_settings("quick"), "scratch") == 40
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="scratch_rounds_ratio=.*use a positive integer"):
            st.table_settings("bench", scratch_rounds_ratio=bad)


def test_a_folder_of_another_scratch_ratio_is_refused_in_one_line(tmp_path):
    settings = st.table_settings("bench", splits=[3], methods=["scratch"], seeds=[0], **TINY)
    st.run_sslfl_table(str(tmp_path), settings, say=lambda m: None, simulate=FakeSimulator(), diagnose=FakeDiagnose())
    again = FakeSimulator()
    with pytest.raises(ValueError) as e:
        st.run_sslfl_table(str(tmp_path), {**settings, "scratch_rounds_ratio": 1}, say=lambda m: None,
                           simulate=again)
    assert "scratch_rounds_ratio=10 (now 1)" in str(e.value) and "\n" not in str(e.value)
    # a folder written before the ratio was recorded ran scratch at the pre-trained rows' rounds: refused too
    path = tmp_path / "run_config.json"
    config = json.loads(path.read_text())
    del config["scratch_rounds_ratio"]
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError) as e:
        st.run_sslfl_table(str(tmp_path), settings, say=lambda m: None, simulate=again)
    assert str(e.value) == (f"{path}: the cells in {tmp_path} were computed before scratch_rounds_ratio was "
                            "recorded, ViT scratch fine-tuned for the pre-trained rows' rounds (ratio 1; now 10); "
                            "use another --out")
    assert again.calls == []


class FailingDiagnose(FakeDiagnose):
    """Fed-MAE's loss per round: Split-2 dips below (d-1)/d = 47/48 = 0.979 (4 x 4 RGB patches, norm-pix targets,
    the bench profile), Split-3 never does (a failed pre-training)."""

    LOSS = {2: [1.0, 0.9], 3: [1.0, 0.99]}

    def __call__(self, key, out, settings, parts, store):
        d = super().__call__(key, out, settings, parts, store)
        return dict(d, rounds=[{"round": r, "loss": x} for r, x in enumerate(self.LOSS[key["split"]])])


def test_a_failed_pretraining_is_marked_in_the_table_its_rows_and_its_verdict(tmp_path):
    settings = st.table_settings("bench", splits=[2, 3], methods=["scratch", "fedmae"], seeds=[0], **TINY)
    out = st.run_sslfl_table(str(tmp_path), settings, say=lambda m: None, simulate=FakeSimulator(),
                             diagnose=FailingDiagnose())
    text = open(out["paths"]["txt"]).read()
    bundle, paper = text.split("bundle (measured here)")[1].split("paper (")
    assert [ln.split("  ")[0] for ln in bundle.splitlines()[3:5]] == [
        "ViT scratch", "Fed-MAE [failed pre-training: Split-3 seed 0]"]
    assert any(ln.startswith("Fed-MAE  ") for ln in paper.splitlines())  # the paper's row keeps the plain label
    reason = "loss never below chance: min loss 0.990 (round 1) vs (d-1)/d, d = 48 = 0.979"
    assert f"[failed pre-training] Fed-MAE Split-3 seed 0: {reason}" in paper.splitlines()
    # Split-2's verdict stands; Split-3's says the pre-training failed instead of its conclusion
    assert "Split-2, seed 0: Fed-MAE vs ViT scratch: test accuracy +0.125" in text
    assert "images, one seed) -> pre-training within the spread" in text.split("Split-2, seed 0:")[1].splitlines()[0]
    split3 = text.split("Split-3, seed 0: ")[1].splitlines()[0]
    assert split3.endswith("-> not Fed-MAE's result: its pre-training failed ([failed pre-training] below)")
    with open(out["paths"]["json"]) as f:
        rows = {(r["method"], r["column"]): r for r in json.load(f)["rows"]}
    assert rows[("Fed-MAE", "Split3")]["pretraining_failed"] is True and rows[("Fed-MAE", "Split3")]["mean"] == 75.0
    assert rows[("Fed-MAE", "Split3")]["pretraining_reasons"] == {"seed 0": [reason]}
    assert rows[("Fed-MAE", "Split2")]["pretraining_failed"] is False
    assert rows[("Fed-MAE", "Split2")]["mark"] == " [failed pre-training: Split-3 seed 0]"  # the label's mark
    assert rows[("ViT scratch", "Split3")]["pretraining_failed"] is False and "mark" not in rows[("ViT scratch",
                                                                                                   "Split3")]
    assert [d["health"]["failed"] for d in out["diagnostics"]] == [False, True]
    assert "loss health: FAILED pre-training: " + reason in text  # the diagnostics block under the table


def test_table_files_carry_the_paper_numbers_beside_and_std_over_seeds(tmp_path):
    settings = st.table_settings("bench", splits=[1, 3], methods=["scratch"], seeds=[0, 1], **TINY)
    accs = iter([0.5, 0.75, 0.6, 0.7])  # split 1 seed 0, split 3 seed 0, split 1 seed 1, split 3 seed 1

    class Seeded(FakeSimulator):
        def __call__(self, *a, **kw):
            self.ACCURACY = {"scratch": next(accs)}
            return super().__call__(*a, **kw)

    out = st.run_sslfl_table(str(tmp_path), settings, say=lambda m: None, simulate=Seeded(), diagnose=FakeDiagnose())
    rows = {r["column"]: r for r in out["rows"]}
    assert rows["Split1"]["mean"] == pytest.approx(55.0) and rows["Split1"]["n"] == 2
    assert rows["Split1"]["std"] == pytest.approx(7.0710678)  # sample std of 50 and 60
    assert rows["Split3"]["mean"] == pytest.approx(72.5)
    for ext in ("json", "csv", "txt", "png"):
        assert os.path.isfile(out["paths"][ext])
    text = open(out["paths"]["txt"]).read()
    assert "paper (SSL-FL" in text and "74.33" in text and "64.13" in text  # Table II's None row, Split-1 / 3
    assert "n=2 seeds" in text
    assert "two seeds (0, 1): not a finding" in text
    with open(out["paths"]["json"]) as f:
        assert [r["mean"] for r in json.load(f)["paper"]["rows"]] == [74.33, 64.13]


def test_verdicts_per_split_against_scratch_by_hand():
    s = st.table_settings("bench", splits=[1, 3])
    results = {("scratch", 1, 0): {"accuracy": 0.625, "n_test": 1000},
               ("fedmae", 1, 0): {"accuracy": 0.75, "n_test": 1000},
               ("fedbeit", 1, 0): {"accuracy": 0.5, "n_test": 1000},
               ("fedmae", 3, 0): {"accuracy": 0.9, "n_test": 1000}}
    lines = st.table_verdicts(s, results)
    # 2 x sqrt(.75 * .25 / 1000 + .625 * .375 / 1000) = 0.041; Fed-BEiT: 2 x sqrt((.25 + .234375) / 1000) = 0.044
    assert lines == [
        "Split-1, seed 0: Fed-MAE vs ViT scratch: test accuracy +0.125 (2 x binomial SE 0.041, 1000 test images, one "
        "seed) -> pre-training helped",
        "Split-1, seed 0: Fed-BEiT vs ViT scratch: test accuracy -0.125 (2 x binomial SE 0.044, 1000 test images, one "
        "seed) -> pre-training hurt"]  # Split-3 has no scratch cell: no verdict


def test_diagnostics_vit_is_the_finetuning_jobs_at_the_profile():
    scratch, beit = st.vit_settings(st.table_settings("bench"),
                                    "scratch"), st.vit_settings(st.table_settings("bench"), "fedbeit")
    assert (scratch["image_size"], scratch["patch_size"], scratch["embed_dim"], scratch["depth"]) == (32, 4, 48, 2)
    assert scratch["layer_scale"] is None and beit["layer_scale"] == 0.1  # BEiT's layer scale in its fine-tuning
    # BEiT fine-tunes with a bias table per block (initialised from the pre-training's shared one): the diagnostics'
    # ViT must be built the same way, or loading the Fed-BEiT encoder is refused
    assert scratch["rel_pos_bias"] == "none" and beit["rel_pos_bias"] == "per_layer"
    assert scratch["dataset"] == "retina" and scratch["label_fraction"] == 1.0
    assert st.vit_settings(st.table_settings("bench"), "fedmae", seed=3)["seed"] == 3


def test_cli_tables_parses_and_passes_the_settings(tmp_path, monkeypatch):
    from fedssl.cli import main

    seen = {}
    monkeypatch.setattr(st, "run_sslfl_table", lambda out, settings, say, threads: seen.update(
        out=out, settings=settings, threads=threads))
    assert main(["sslfl", "tables", "--out", str(tmp_path), "--splits", "3", "--methods", "scratch", "fedmae",
                 "--seeds", "0", "1", "--threads", "2"]) == 0
    assert seen["out"] == str(tmp_path) and seen["threads"] == 2
    s = seen["settings"]
    assert (s["splits"], s["methods"], s["seeds"], s["profile"]) == ([3], ["scratch", "fedmae"], [0, 1], "bench")
    assert (s["pretrain_rounds"], s["finetune_rounds"]) == (None, None)  # the profile's job settings
    assert main(["sslfl", "tables", "--out", str(tmp_path), "--pretrain-rounds", "320", "--finetune-rounds",
                 "70"]) == 0  # the compute curve's multiples
    assert (seen["settings"]["pretrain_rounds"], seen["settings"]["finetune_rounds"]) == (320, 70)
    assert seen["settings"]["scratch_rounds_ratio"] == st.PAPER_SCRATCH_ROUNDS_RATIO  # not given: the paper's
    assert main(["sslfl", "tables", "--out", str(tmp_path), "--scratch-rounds-ratio", "1"]) == 0
    assert seen["settings"]["scratch_rounds_ratio"] == 1
    assert main(["sslfl", "tables", "--out", str(tmp_path)]) == 0  # the defaults: three seeds, one thread
    assert seen["settings"]["seeds"] == [0, 1, 2] and seen["threads"] == 1
    with pytest.raises(SystemExit):
        main(["sslfl", "tables", "--out", str(tmp_path), "--pretrain-rounds", "0"])
    assert st.table_settings("quick")["seeds"] == [0, 1, 2]  # a profile without tables.sslfl: the runner's own
    with pytest.raises(SystemExit):
        main(["sslfl", "tables", "--out", str(tmp_path), "--splits", "4"])


@pytest.mark.slow
def test_end_to_end_one_split_fedmae_one_round_each(tmp_path):
    """The real simulator on a tiny setting: Split-3 Fed-MAE, 1 round of pre-training and of fine-tuning (profile
    quick, 3 sites). The fine-tuning job from scratch runs in tests/integration; the runner's scratch rows are
    covered with the fake simulator above, so one fine-tuning run is enough here."""
    settings = st.table_settings("quick", splits=[3], methods=["fedmae"], n_images=200, image_px=32,
                                 n_sites=3, min_per_site=4, pretrain_rounds=1, finetune_rounds=1, seeds=[0])
    out = st.run_sslfl_table(str(tmp_path), settings, say=print)
    rows = {(r["method"], r["column"]): r for r in out["rows"]}
    assert set(rows) == {("Fed-MAE", "Split3")}
    assert all(0.0 <= r["mean"] <= 100.0 and r["n"] == 1 for r in rows.values())
    cells = [json.loads(line) for line in open(tmp_path / "cells.jsonl")]
    assert [c["key"]["stage"] for c in cells] == ["pretrain", "finetune", "diagnostics"]
    diag = out["diagnostics"][0]
    assert diag["probe"]["n_sites"] == 3 and len(diag["rounds"]) == 1  # every site probed; the run's one round
    assert "frozen-encoder probe accuracy" in open(out["paths"]["txt"]).read()


def test_diagnose_cell_hands_the_cells_own_pretraining_and_split_to_the_diagnostics(monkeypatch, tmp_path):
    """diagnose_cell: the global model of the cell's own (method, split, seed) pre-training, that run's summary
    (None when the run left none), the records of every site of the seed's split partition, and the ViT settings
    without label_fraction, which goes to the probe."""
    seen = {}

    def fake_diagnose_vit(label, summary, model, records, vit, *, label_fraction):
        seen.update(label=label, summary=summary, model=model, records=dict(records), vit=dict(vit),
                    label_fraction=label_fraction)
        return {"method": label}

    monkeypatch.setattr(st, "diagnose_vit", fake_diagnose_vit)
    monkeypatch.setattr(st, "reconstruction_reference", lambda records, **kw: seen.update(
        reference_records=dict(records), masking=kw) or {"inpainting": 0.25})
    monkeypatch.setattr(st, "load_image_records", lambda path, dataset, site: [(dataset, site, path)])
    parts = {}
    for seed, split in ((0, 3), (1, 3), (1, 2)):
        root = tmp_path / f"part_s{seed}_split{split}"
        for site in ("site-1", "site-2"):
            (root / site).mkdir(parents=True)
        parts[(seed, split)] = str(root)
    store = st.CellStore(str(tmp_path / "cells.jsonl"))
    for seed, split in parts:
        store.put({"stage": "pretrain", "method": "fedmae", "split": split, "seed": seed},
                  {"global_model": f"model_s{seed}_split{split}.pt"}, 1.0)
    settings = st.table_settings("bench", methods=["fedmae"])
    key = {"stage": "diagnostics", "method": "fedmae", "split": 3, "seed": 1}
    summary = os.path.join(st._workspace(str(tmp_path), {**key, "stage": "pretrain"}), "server", "simulate_job",
                           "summary.json")
    assert st.diagnose_cell(key, str(tmp_path), settings, parts, store) == {"method": seen["label"],
                                                                            "reconstruction": {"inpainting": 0.25}}
    assert seen["reference_records"] == seen["records"] and seen["masking"] == st.reconstruction_settings(
        settings, "fedmae", 1)
    assert seen["model"] == "model_s1_split3.pt" and seen["summary"] is None  # no summary.json: no rounds
    root = parts[(1, 3)]
    assert seen["records"] == {s: [("retina", s, os.path.join(root, s))] for s in ("site-1", "site-2")}
    assert seen["label"].endswith("(Split-3, seed 1)")
    expected = st.vit_settings(settings, "fedmae", 1)
    assert seen["label_fraction"] == expected.pop("label_fraction") and seen["vit"] == expected
    os.makedirs(os.path.dirname(summary))
    open(summary, "w").close()
    st.diagnose_cell(key, str(tmp_path), settings, parts, store)
    assert seen["summary"] == summary


def test_over_seeds_the_paired_difference_and_its_standard_error_by_hand():
    s = st.table_settings("bench", splits=[3])
    acc = {"scratch": (0.70, 0.60, 0.80), "fedmae": (0.60, 0.55, 0.50), "fedbeit": (0.75, 0.65, 0.85)}
    results = {(m, 3, seed): {"accuracy": a[seed], "n_test": 400} for m, a in acc.items() for seed in range(3)}
    results[("fedmae", 1, 0)] = {"accuracy": 0.9, "n_test": 400}  # one seed on Split-1: no over-seeds line
    lines = st.seed_verdicts(s, results)
    # Fed-MAE: -10, -5, -30 points; mean -15, std sqrt(175) = 13.23, SE 7.64: -15 is within twice the SE
    assert lines == [
        "Split-3, 3 seeds: Fed-MAE minus ViT scratch -15.0 points (SE 7.6 over seeds; per seed -10.0 / -5.0 / -30.0) "
        "-> within the spread (no clear effect)",
        "Split-3, 3 seeds: Fed-BEiT minus ViT scratch +5.0 points (SE 0.0 over seeds; per seed +5.0 / +5.0 / +5.0) "
        "-> ahead"]
    assert st.table_verdicts(s, results)[-2:] == lines  # printed under the per-seed lines
    health = {("fedmae", 3, 1): {"failed": True}}
    assert st.seed_verdicts(s, results, health)[0].endswith(
        "-> not Fed-MAE's result: its pre-training failed at Split-3 seed 1 of 3 ([failed pre-training] below)")


def test_the_reconstruction_reference_takes_the_pretraining_jobs_views_and_masking():
    """Fed-MAE's pre-training job at bench: 32 px views, 4 px patches, SSL-FL's mask ratio 0.6, norm-pix targets;
    the cell's seed; methods that rebuild no pixels have none."""
    settings = st.table_settings("bench")
    assert st.reconstruction_settings(settings, "fedmae", 2) == {
        "dataset": "retina", "image_size": 32, "patch_size": 4, "mask_ratio": 0.6, "norm_pix": True, "seed": 2}
    assert st.reconstruction_settings(settings, "fedbeit", 0) is None
    assert st.reconstruction_settings(settings, "scratch", 0) is None
    assert st.reconstruction_settings(st.table_settings("bench64"), "fedmae", 0)["patch_size"] == 8


def test_cli_mae_reference_runs_the_tables_data_and_masking(tmp_path, monkeypatch):
    from fedssl.cli import main

    seen = {}
    monkeypatch.setattr(st, "run_reconstruction_reference", lambda out, settings, say: seen.update(
        out=out, settings=settings))
    assert main(["sslfl", "mae-reference", "--out", str(tmp_path / "ref"), "--seeds", "1", "2"]) == 0
    assert seen["out"] == str(tmp_path / "ref") and os.path.isdir(seen["out"])
    s = seen["settings"]
    assert (s["profile"], s["splits"], s["seeds"], s["methods"]) == ("bench", [3], [1, 2], ["fedmae"])


def test_run_reconstruction_reference_measures_every_split_and_seed(tmp_path, monkeypatch):
    parts = {0: {3: str(tmp_path / "p0")}, 1: {3: str(tmp_path / "p1")}}
    for seed in parts:
        for site in ("site-1", "site-2"):
            os.makedirs(os.path.join(parts[seed][3], site))
    monkeypatch.setattr(st, "prepare_data", lambda out, settings, seed, say: parts[seed])
    monkeypatch.setattr(st, "load_image_records", lambda path, dataset, site: [site])
    calls = []
    monkeypatch.setattr(st, "reconstruction_reference", lambda records, **kw: calls.append((records, kw)) or {
        "predict_mean": 0.98, "inpainting": 0.2 + kw["seed"], "images": 2, "patch_size": 4, "mask_ratio": 0.6})
    said = []
    out = st.run_reconstruction_reference(str(tmp_path), st.table_settings("bench", splits=[3], seeds=[0, 1]),
                                          say=said.append)
    assert [(r["split"], r["seed"], r["inpainting"]) for r in out["rows"]] == [(3, 0, 0.2), (3, 1, 1.2)]
    assert [c[0] for c in calls] == [{"site-1": ["site-1"], "site-2": ["site-2"]}] * 2
    assert json.load(open(tmp_path / "reconstruction_reference.json")) == out
    assert said[0].startswith("Split-3 seed 0: MAE loss without learning") and "harmonic inpainting 0.2000" in said[0]
