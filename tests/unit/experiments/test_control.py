"""``fedssl bench control`` (experiments/control.py) at toy sizes: the cells and rows, the pooled centralised trainer
and its step count, the paired differences, resuming without retraining and the same numbers on a rerun."""

from __future__ import annotations

import inspect
import json
import math
import os

import numpy as np
import pytest
import torch

from fedssl.core.memory_bank import FeatureBank, remote_bank_for
from fedssl.data.acdc_synthetic import write_synthetic_acdc
from fedssl.experiments import control
from fedssl.experiments.fcl_finetune import protocol_settings
from fedssl.ops.jobs import load_profile

MULTIPLIERS, SEEDS, FEDERATED, RESEND = (1, 2), (0, 1), (1,), (1,)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("control"))
    result = control.fcl_control(out, multipliers=MULTIPLIERS, seeds=SEEDS, federated_multipliers=FEDERATED,
                                 resend_multipliers=RESEND, size="tiny", device="cpu", say=lambda m: None)
    return out, result


def _json(out):
    with open(os.path.join(out, "control.json"), encoding="utf-8") as f:
        return json.load(f)


def test_rows_cover_every_arm_multiplier_and_seed(run):
    out, result = run
    data = _json(out)
    n_sites = control.TINY["data"]["n_sites"]
    want = {("random", None)} | {("central", m) for m in MULTIPLIERS} | {("federated", m) for m in FEDERATED} \
        | {("federated-resend", m) for m in RESEND}
    assert {(c["arm"], c["multiplier"]) for c in data["cells"].values()} == want
    assert all(c["done"] for c in data["cells"].values())
    assert len(data["cells"]) == len(want) * len(SEEDS)
    rows = data["rows"]
    assert len(rows) == len(want) * len(SEEDS) * n_sites * len(control.N_LABELLED)
    methods = {"random", "central x1", "central x2", "federated x1", "federated-resend x1"}
    assert {r["method"] for r in rows} == methods
    for method in methods:
        assert sorted({r["seed"] for r in rows if r["method"] == method}) == list(SEEDS)
        assert sorted({r["n_labelled"] for r in rows if r["method"] == method}) == [1, 2]
    assert {r["mode"] for r in rows} == {"local"} and {r["fold"] for r in rows} == {0}
    assert os.path.isfile(os.path.join(out, "control.png"))
    assert len(result["verdicts"]) == len(want) - 1 + len(RESEND)  # one per arm and multiplier, one per cost
    assert result["chance_loss_local"] == pytest.approx(math.log(control.TINY["pretrain"]["bank_size"] + 1))


def test_central_trainer_pools_every_site_and_runs_m_times_the_base_steps(run):
    out, _ = run
    data = _json(out)
    pooled = sum(data["data"]["volumes_per_site"].values())
    base = data["base"]
    assert base["steps"] == control.TINY["rounds"] * base["steps_per_round"] == 4
    for m in MULTIPLIERS:
        for s in SEEDS:
            pre = data["cells"][control.cell_key("central", m, s)]["pretrain"]
            assert pre["volumes"] == pooled == 20
            assert pre["total_steps"] == sum(pre["steps"]) == m * base["steps"]
            assert pre["steps"] == [base["steps_per_round"]] * (m * control.TINY["rounds"])
            assert len(pre["loss_local"]) == len(pre["feature_std"]) == m * control.TINY["rounds"]
            assert pre["feature_exchange"] is False and set(pre["remote_features"]) == {0}
    fed = data["cells"][control.cell_key("federated", 1, 0)]["pretrain"]
    n_sites = len(data["data"]["volumes_per_site"])
    assert fed["steps_per_trainer"] == base["steps"] and fed["total_steps"] == n_sites * base["steps"]
    assert fed["feature_exchange"] is True and len(fed["loss"]) == control.TINY["rounds"]


def test_one_site_feature_exchange_would_bring_nothing():
    """The docstring's reason for turning exchange off in the centralised run: one site has no partners."""
    bank = FeatureBank(16, 4, seed=0)
    bank.enqueue(torch.nn.functional.normalize(torch.randn(16, 4), dim=1), torch.arange(16) % 4)
    assert (bank.partitions >= 0).all()  # a full bank of real features: still nothing comes back
    f, p = remote_bank_for({"pooled": bank.export_fresh()}, "pooled", 16, np.random.default_rng(0))
    assert f.shape == (0, 4) and p.shape == (0,)


def test_paired_difference_recomputed_from_rows(run):
    out, result = run
    rows = _json(out)["rows"]
    for e in result["summary"]:
        if e["arm"] == "random":
            continue
        for n in control.N_LABELLED:
            per_seed = []
            for s in SEEDS:
                base = {r["site"]: r["dice"] for r in rows if r["method"] == "random" and r["seed"] == s
                        and r["n_labelled"] == n}
                mine = {r["site"]: r["dice"] for r in rows if r["method"] == e["method"] and r["seed"] == s
                        and r["n_labelled"] == n}
                per_seed.append(np.mean([mine[k] - base[k] for k in sorted(base)]))
            assert e[f"N={n}"]["diff"] == pytest.approx(float(np.mean(per_seed)), abs=1e-12)
            assert e[f"N={n}"]["diff_seed_se"] == pytest.approx(float(np.std(per_seed, ddof=1) / math.sqrt(2)),
                                                                abs=1e-12)


def test_summary_on_known_rows():
    """Made-up rows where the answer is known: central x4 is ahead by 0.1 and 0.2 in seeds 0 and 1."""
    def rows(method, seed, dice):
        return [{"method": method, "mode": "local", "n_labelled": n, "fold": 0, "site": site, "seed": seed,
                 "dice": dice + (0.05 if site == "site-2" else 0.0)} for n in (1, 2) for site in ("site-1", "site-2")]

    cells = {}
    for seed, lift in ((0, 0.1), (1, 0.2)):
        cells[f"random seed {seed}"] = {"arm": "random", "multiplier": None, "seed": seed, "method": "random",
                                        "done": True, "rows": rows("random", seed, 0.4)}
        cells[f"central x4 seed {seed}"] = {
            "arm": "central", "multiplier": 4, "seed": seed, "method": "central x4", "done": True,
            "rows": rows("central x4", seed, 0.4 + lift),
            "pretrain": {"steps_per_trainer": 2000, "total_steps": 2000, "seconds": 1.0, "loss_local": [7.0, 6.0],
                         "feature_std": [0.05, 0.04]}}
    summary, verdicts = control.summarise({"cells": cells, "chance_loss_local": 7.0})
    central = next(e for e in summary if e["method"] == "central x4")
    assert central["N=1"]["diff"] == pytest.approx(0.15)
    assert central["N=1"]["diff_seed_se"] == pytest.approx(0.05)
    assert central["N=1"]["dice"] == pytest.approx(0.575)
    assert central["N=1"]["diff_by_seed"] == {"0": pytest.approx(0.1), "1": pytest.approx(0.2)}
    assert len(verdicts) == 1 and verdicts[0].count("+0.150 (Dice; SE 0.050 over 2 seeds) -> ahead by 3.0 SE") == 2


def test_second_call_resumes_without_retraining(run, monkeypatch):
    out, first = run
    encoders = sorted(os.listdir(os.path.join(out, "encoders")))
    assert len(encoders) == len(SEEDS) * (len(MULTIPLIERS) + len(FEDERATED) + len(RESEND))
    mtimes = {e: os.stat(os.path.join(out, "encoders", e)).st_mtime_ns for e in encoders}

    def boom(*a, **k):
        raise AssertionError("retrained a cell that was done")

    monkeypatch.setattr(control, "pretrain_central", boom)
    monkeypatch.setattr(control, "pretrain_federated", boom)
    monkeypatch.setattr(control, "local_finetune", boom)
    again = control.fcl_control(out, multipliers=MULTIPLIERS, seeds=SEEDS, federated_multipliers=FEDERATED,
                                resend_multipliers=RESEND, size="tiny", device="cpu", say=lambda m: None)
    assert {e: os.stat(os.path.join(out, "encoders", e)).st_mtime_ns for e in encoders} == mtimes
    assert again["rows"] == first["rows"] and again["verdicts"] == first["verdicts"]


def test_an_unfinished_cell_finishes_only_its_missing_sites(run, monkeypatch):
    out, _ = run
    data = _json(out)
    key = control.cell_key("central", 2, 1)
    cell = data["cells"][key]
    kept, dropped = cell["rows"][:2], cell["rows"][2:]  # site-1's two rows stay, site-2's are to be redone
    cell["rows"], cell["done"] = kept, False
    with open(os.path.join(out, "control.json"), "w", encoding="utf-8") as f:
        json.dump(data, f)
    calls = []
    real = control.local_finetune

    def counting(*a, **k):
        calls.append(k)
        return real(*a, **k)

    monkeypatch.setattr(control, "local_finetune", counting)
    monkeypatch.setattr(control, "pretrain_central", lambda *a, **k: pytest.fail("retrained"))
    result = control.fcl_control(out, multipliers=MULTIPLIERS, seeds=SEEDS, federated_multipliers=FEDERATED,
                                 size="tiny", device="cpu", say=lambda m: None)
    assert [c["sites"] for c in calls] == [["site-2"]]
    ft = result["settings"]["finetune"]
    assert calls[0]["min_steps"] == ft["min_steps"] and calls[0]["epochs"] == ft["epochs"] and calls[0]["seed"] == 1
    redone = result["cells"][key]["rows"]
    assert redone[:2] == kept and [r["dice"] for r in redone[2:]] == [r["dice"] for r in dropped]


def test_same_numbers_on_a_fresh_run(run, tmp_path):
    out, first = run
    fresh = control.fcl_control(str(tmp_path), multipliers=(1,), seeds=(0,), federated_multipliers=(),
                                size="tiny", device="cpu", say=lambda m: None)
    for key, cell in fresh["cells"].items():
        assert cell["rows"] == first["cells"][key]["rows"]
        if "pretrain" in cell:
            assert cell["pretrain"]["loss"] == first["cells"][key]["pretrain"]["loss"]


def test_other_settings_in_the_same_folder_are_refused(run):
    out, _ = run
    with pytest.raises(ValueError, match="other settings"):
        control.fcl_control(out, multipliers=MULTIPLIERS, seeds=SEEDS, folds=(1,), size="tiny", device="cpu",
                            say=lambda m: None)


def test_bench_is_the_bench_profile():
    job = load_profile("bench")["jobs"]["fcl_acdc"]
    shape, client = job["shape"], job["client"]["fcl_trainer"]
    pre = control.BENCH["pretrain"]
    assert pre["features"] == shape["features"] and pre["proj_dim"] == shape["proj_dim"]
    assert pre["bank_size"] == shape["bank_size"] and pre["image_size"] == shape["image_size"]
    for k in ("target_spacing", "batch_size", "max_steps_per_round", "lr"):
        assert pre[k] == client[k], k
    assert control.BENCH["rounds"] == job["server"]["scatter_and_gather"]["num_rounds"]
    defaults = {k: p.default for k, p in inspect.signature(write_synthetic_acdc).parameters.items()}
    data = control.BENCH["data"]
    assert (data["n_patients"], data["n_sites"], tuple(data["shape"]), data["n_frames"], tuple(data["slices_range"])) \
        == (defaults["n_patients"], defaults["n_sites"], defaults["shape"], defaults["n_frames"],
            defaults["slices_range"])
    ft = control.finetune_settings("bench")
    assert ft == protocol_settings("bench") and ft["min_steps"] == 140 and ft["epochs"] == 60 and ft["lr"] == 0.005
    kw = control.finetune_kwargs(ft, [0], 2)
    assert (kw["min_steps"], kw["epochs"], kw["lr"], kw["seed"], kw["n_labelled"], kw["folds"]) == \
        (140, 60, 0.005, 2, [1, 2], [0])
    assert kw["features"] == ft["features"] and kw["norm"] == "batch"


def test_plan_runs_the_cells_that_can_give_a_verdict_first():
    plan = control._plan((1, 4, 16), (0, 1, 2), (1,), first_seed_only=(16,), resend_multipliers=(1,))
    assert plan == [("random", None, 0), ("random", None, 1), ("random", None, 2), ("central", 1, 0),
                    ("central", 1, 1), ("central", 1, 2), ("central", 4, 0), ("central", 4, 1), ("central", 4, 2),
                    ("federated", 1, 0), ("federated", 1, 1), ("federated", 1, 2), ("federated-resend", 1, 0),
                    ("federated-resend", 1, 1), ("federated-resend", 1, 2), ("central", 16, 0)]


def test_the_resend_arm_trains_with_whole_padded_banks_and_the_cost_is_paired_against_it(run):
    """The control arm of issue 45: the pre-defence exchange delivers K rows (padded) every round, the bundle's
    only what the others shared since; the cost line is ``federated - federated-resend`` paired by site and seed."""
    out, result = run
    data = _json(out)
    k = control.TINY["pretrain"]["bank_size"]
    for s in SEEDS:
        resend = data["cells"][control.cell_key("federated-resend", 1, s)]["pretrain"]
        once = data["cells"][control.cell_key("federated", 1, s)]["pretrain"]
        assert resend["exchange"] == "resend" and once["exchange"] == "once"
        assert resend["remote_features"][0] == 0 and set(resend["remote_features"][1:]) == {k}
        assert all(0 < n < k for n in once["remote_features"][1:])
    rows = data["rows"]
    (cost,) = result["exchange_cost"]
    assert (cost["method"], cost["baseline"]) == ("federated x1", "federated-resend x1")
    for n in control.N_LABELLED:
        per_seed = []
        for s in SEEDS:
            base = {r["site"]: r["dice"] for r in rows if r["method"] == "federated-resend x1" and r["seed"] == s
                    and r["n_labelled"] == n}
            mine = {r["site"]: r["dice"] for r in rows if r["method"] == "federated x1" and r["seed"] == s
                    and r["n_labelled"] == n}
            per_seed.append(np.mean([mine[x] - base[x] for x in sorted(base)]))
        assert cost[f"N={n}"]["diff"] == pytest.approx(float(np.mean(per_seed)), abs=1e-12)
    assert sum("minus federated-resend x1" in v for v in result["verdicts"]) == 1


def test_exchange_cost_on_known_rows():
    """federated x1 is behind the resend arm by 0.1 at seed 0 and 0.3 at seed 1: a cost of 0.2, SE 0.1."""
    def rows(method, seed, dice):
        return [{"method": method, "mode": "local", "n_labelled": n, "fold": 0, "site": site, "seed": seed,
                 "dice": dice + (0.05 if site == "site-2" else 0.0)} for n in (1, 2) for site in ("site-1", "site-2")]

    cells = {}
    for seed, cost in ((0, 0.1), (1, 0.3)):
        for arm, dice in (("federated", 0.5 - cost), ("federated-resend", 0.5)):
            method = f"{arm} x1"
            cells[f"{method} seed {seed}"] = {"arm": arm, "multiplier": 1, "seed": seed, "method": method,
                                              "done": True, "rows": rows(method, seed, dice)}
    entries, lines = control.exchange_cost({"cells": cells})
    (e,) = entries
    assert e["N=1"]["diff"] == pytest.approx(-0.2) and e["N=2"]["diff_seed_se"] == pytest.approx(0.1)
    assert e["N=1"]["diff_by_seed"] == {"0": pytest.approx(-0.1), "1": pytest.approx(-0.3)}
    assert len(lines) == 1 and lines[0].count("-0.200 (Dice; SE 0.100 over 2 seeds)") == 2
    del cells["federated-resend x1 seed 0"], cells["federated-resend x1 seed 1"]
    assert control.exchange_cost({"cells": cells}) == ([], [])


def test_threads_are_set_when_asked_and_every_cell_records_the_count_it_ran_with(run, monkeypatch, tmp_path):
    """The resend arm of issue 45 ran partly with two torch threads and partly with one: each cell says which."""
    out, _ = run
    data = _json(out)
    assert all(c["threads"] == [torch.get_num_threads()] for c in data["cells"].values())
    asked = []
    monkeypatch.setattr(control, "set_threads", lambda n: asked.append(n))
    control.fcl_control(str(tmp_path), multipliers=(1,), seeds=(0,), federated_multipliers=(), size="tiny",
                        device="cpu", threads=1, say=lambda m: None)
    assert asked == [1]


def _split_by_seed(out: str, root) -> list[str]:
    """The module run's control.json split into one folder per seed, as seeds run as separate processes leave it."""
    data = _json(out)
    folders = []
    for seed in SEEDS:
        folder = root / f"seed{seed}"
        (folder / "encoders").mkdir(parents=True)
        part = dict(data, cells={k: c for k, c in data["cells"].items() if c["seed"] == seed})
        for c in part["cells"].values():
            if "pretrain" in c:
                src = os.path.join(out, c["pretrain"]["encoder"])
                (folder / c["pretrain"]["encoder"]).write_bytes(open(src, "rb").read())
        (folder / "control.json").write_text(json.dumps(part))
        folders.append(str(folder))
    return folders


def test_merging_per_seed_folders_gives_the_report_of_one_run(run, tmp_path):
    out, first = run
    folders = _split_by_seed(out, tmp_path)
    merged = control.merge_controls(str(tmp_path / "all"), folders, say=lambda m: None)
    assert merged["table"] == first["table"] and merged["verdicts"] == first["verdicts"]
    assert {d["method"]: d["N=1"]["diff_by_seed"] for d in merged["summary"] if "diff" in d["N=1"]} == \
        {d["method"]: d["N=1"]["diff_by_seed"] for d in first["summary"] if "diff" in d["N=1"]}
    assert os.path.isfile(str(tmp_path / "all" / "control.png"))
    assert sorted(os.listdir(tmp_path / "all" / "encoders")) == sorted(os.listdir(os.path.join(out, "encoders")))
    # merging into a folder that already holds the merge changes nothing
    again = control.merge_controls(str(tmp_path / "all"), folders[:1], say=lambda m: None)
    assert again["table"] == first["table"]


def test_merge_refuses_other_settings_and_a_cell_that_differs(run, tmp_path):
    out, _ = run
    a, b = _split_by_seed(out, tmp_path)
    other = json.loads(open(os.path.join(b, "control.json")).read())
    other["settings"]["folds"] = [1]
    with open(os.path.join(b, "control.json"), "w") as f:
        json.dump(other, f)
    with pytest.raises(ValueError, match="other settings"):
        control.merge_controls(str(tmp_path / "m1"), [a, b], say=lambda m: None)
    clash = json.loads(open(os.path.join(a, "control.json")).read())
    key = next(iter(clash["cells"]))
    clash["cells"][key]["rows"][0]["dice"] += 0.5
    (tmp_path / "clash").mkdir()
    (tmp_path / "clash" / "control.json").write_text(json.dumps(clash))
    with pytest.raises(ValueError, match="differs"):
        control.merge_controls(str(tmp_path / "m2"), [a, str(tmp_path / "clash")], say=lambda m: None)
    with pytest.raises(ValueError, match="does not exist"):
        control.merge_controls(str(tmp_path / "m3"), [str(tmp_path / "nowhere")], say=lambda m: None)


def test_merge_takes_the_done_cell_over_an_unfinished_one(run, tmp_path):
    out, first = run
    a, _ = _split_by_seed(out, tmp_path)
    part = json.loads(open(os.path.join(a, "control.json")).read())
    key = next(iter(part["cells"]))
    part["cells"][key]["done"] = False
    part["cells"][key]["rows"] = part["cells"][key]["rows"][:1]
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "control.json").write_text(json.dumps(part))
    for order in ([str(tmp_path / "partial"), a], [a, str(tmp_path / "partial")]):
        merged = control.merge_controls(str(tmp_path / f"m{len(order[0])}"), order, say=lambda m: None)
        assert merged["cells"][key]["done"] and merged["cells"][key]["rows"] == first["cells"][key]["rows"]


def test_fixed_view_discrimination_is_the_bank_free_infonce_in_eval_mode():
    """Two views = the same 4 orthonormal rows, every slice its own patient: each row's loss is
    log(e^(1/tau) + 3) - 1/tau by hand; a BatchNorm in train mode would normalise the batch and change it."""
    tau = 0.5
    net = torch.nn.BatchNorm1d(4)
    net.train()
    eye = torch.eye(4)
    got = control.fixed_view_discrimination(net, eye, eye.clone(), torch.arange(4), tau, batch_size=3)
    assert got["fixed_infonce"] == pytest.approx(math.log(math.exp(1 / tau) + 3) - 1 / tau, rel=1e-5)
    assert got["fixed_chance"] == pytest.approx(math.log(4)) and got["fixed_top1"] == 1.0
    assert net.training  # the caller's mode is restored


def test_loss_trace_is_the_central_arm_with_a_measure_that_does_not_touch_it(run):
    """The trace trains exactly the control's central x1 (the same logged losses, to the last digit): the fixed-view
    measure neither trains nor draws from the trainer's generator; without structural matching the remote term is
    0 and the local loss moves."""
    out, result = run
    rec = control.loss_trace(out, seed=0, multiplier=1, size="tiny", probe_slices=12, say=lambda m: None)
    central = result["cells"]["central x1 seed 0"]["pretrain"]
    rounds = control.TINY["rounds"]
    assert rec["loss_local"] == central["loss_local"] and rec["loss"] == central["loss"]
    assert len(rec["fixed_infonce"]) == len(rec["lr_end"]) == len(rec["bank_fill"]) == rounds
    assert rec["probe_slices"] == 12
    pre = control.TINY["pretrain"]  # every step enqueues one batch of momentum features into the bank of K rows
    assert rec["bank_fill"] == [min(1.0, pre["batch_size"] * sum(rec["steps"][:r + 1]) / pre["bank_size"])
                                for r in range(rounds)]
    assert len(rec["fresh_bank_local"]) == len(rec["stale_bank_local"]) == rounds
    assert all(math.isfinite(v) for v in rec["fixed_infonce"])
    assert rec["lr_end"][-1] < rec["lr_end"][0]
    assert os.path.isfile(os.path.join(out, "loss_trace_gsm_x1_seed0.json"))
    assert os.path.isfile(os.path.join(out, "loss_trace_gsm_x1_seed0.png"))
    bare = control.loss_trace(out, seed=0, multiplier=1, size="tiny", probe_slices=12, structural_matching=False,
                              say=lambda m: None)
    assert set(bare["loss_remote"]) == {0.0} and bare["loss_local"] != rec["loss_local"]
    assert os.path.isfile(os.path.join(out, "loss_trace_nogsm_x1_seed0.json"))
    with pytest.raises(ValueError, match="probe_slices"):
        control.loss_trace(out, probe_slices=1, size="tiny", say=lambda m: None)


def test_the_lowest_logged_loss_is_taken_once_the_bank_is_full():
    rec = {"loss_local": [4.0, 5.5, 5.0, 5.2, 6.0], "bank_fill": [0.4, 0.8, 1.0, 1.0, 1.0]}
    assert control.lowest_full_bank_round(rec) == 2
    assert control.lowest_full_bank_round({"loss_local": [4.0, 5.0], "bank_fill": [0.2, 0.4]}) == 1


def _pooled_trainer(out):
    from fedssl.experiments.evidence import fcl_settings

    vols = control.load_or_write_data(os.path.join(out, "data", "acdc"), control.TINY, lambda m: None)
    pooled = [v for site in sorted(vols) for v in vols[site]]
    s = fcl_settings({"pretrain": dict(control.TINY["pretrain"], feature_exchange=False)}, 0, "cpu")
    tr = control.FCLLocalTrainer(pooled, s, num_rounds=2, device="cpu", site="pooled")
    tr.train_round(0)
    return tr


def test_bank_staleness_scores_the_same_queries_against_the_trainers_bank_and_a_fresh_one(run):
    """Give the trainer the very bank the measurement encodes: both losses are then equal to the last digit (the
    same queries, only the bank differs); with the trainer's own bank they differ.  The trainer is untouched."""
    out, _ = run
    tr = _pooled_trainer(out)
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    bank, gen = tr.bank.features.clone(), tr.generator.get_state().clone()
    own = control.bank_staleness(tr, epoch=77, seed=5, query_batches=2)
    assert own["stale_bank_local"] != own["fresh_bank_local"]
    assert all(torch.equal(v, tr.model.state_dict()[k]) for k, v in before.items())  # BatchNorm buffers too
    assert torch.equal(tr.bank.features, bank) and torch.equal(tr.generator.get_state(), gen)
    model, g, batches = control._staleness_draws(tr, 77, 5, 2)
    fresh = control.fresh_bank(tr, model, batches, g)
    assert fresh.shape == bank.shape
    tr.bank.features = fresh.clone()
    same = control.bank_staleness(tr, epoch=77, seed=5, query_batches=2)
    assert same["stale_bank_local"] == same["fresh_bank_local"] == own["fresh_bank_local"]


def test_every_cell_records_the_environment_it_was_computed_in_and_a_new_one_is_warned_and_added(run, monkeypatch,
                                                                                                  tmp_path):
    """Two machines gave the same random-init cell 0.314 and 0.318 Dice: each cell names where it was computed."""
    out, _ = run
    data = _json(out)
    assert len(data["environments"]) == 1 and data["environments"][0]["cpu_id"]
    assert all(c["environments"] == [0] for c in data["cells"].values())
    # the same folder resumed on "another machine": said once, added, and the cells it computes point at it
    folder = str(tmp_path / "resumed")
    first = control.fcl_control(folder, multipliers=(), seeds=(0,), federated_multipliers=(), size="tiny",
                                device="cpu", say=lambda m: None)
    other = dict(first["environments"][0], onednn_isa="Intel AVX2")
    monkeypatch.setattr(control, "environment", lambda: other)
    said = []
    again = control.fcl_control(folder, multipliers=(), seeds=(0, 1), federated_multipliers=(), size="tiny",
                                device="cpu", say=said.append)
    warned = [s for s in said if s.startswith("warning:")]
    assert len(warned) == 1, said
    assert "this run's environment differs" in warned[0] and "onednn_isa " in warned[0] and "-> Intel AVX2" in \
        warned[0]
    assert again["environments"] == [first["environments"][0], other]
    assert again["cells"]["random seed 0"]["environments"] == [0]
    assert again["cells"]["random seed 1"]["environments"] == [1]


def test_a_paired_difference_that_mixes_environments_is_named():
    envs = [{"cpu_id": "A", "onednn_isa": "AVX-512"}, {"cpu_id": "A", "onednn_isa": "AVX2"}]
    cells = {"random seed 0": {"arm": "random", "seed": 0, "done": True, "environments": [0]},
             "central x1 seed 0": {"arm": "central", "method": "central x1", "seed": 0, "done": True,
                                   "environments": [1]},
             "random seed 1": {"arm": "random", "seed": 1, "done": True, "environments": [1]},
             "central x1 seed 1": {"arm": "central", "method": "central x1", "seed": 1, "done": True,
                                   "environments": [1]},
             "central x4 seed 1": {"arm": "central", "method": "central x4", "seed": 1, "done": True}}
    lines = control.environment_lines({"environments": envs, "cells": cells})
    assert lines == ["warning: central x1 seed 0 was computed in environment [1] and its random init in [0] "
                     "(onednn_isa AVX-512 -> AVX2): its paired difference mixes them; compute both in one "
                     "environment"]


def test_merging_folders_of_two_machines_keeps_each_cells_environment(run, tmp_path):
    out, _ = run
    a, b = _split_by_seed(out, tmp_path)
    part = json.loads(open(os.path.join(b, "control.json")).read())
    machine_b = dict(part["environments"][0], cpu_id="B")
    part["environments"] = [machine_b]  # seed 1's folder was computed on machine B only
    with open(os.path.join(b, "control.json"), "w") as f:
        json.dump(part, f)
    merged = control.merge_controls(str(tmp_path / "all"), [a, b], say=lambda m: None)
    data = _json(str(tmp_path / "all"))
    assert data["environments"] == [_json(a)["environments"][0], machine_b]
    assert {k: c["environments"] for k, c in data["cells"].items()} == \
        {k: [0 if c["seed"] == SEEDS[0] else 1] for k, c in data["cells"].items()}
    assert not [v for v in merged["verdicts"] if v.startswith("warning:")]  # each pair within one machine
