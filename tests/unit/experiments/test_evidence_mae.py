"""The Fed-MAE part of ``fedssl bench evidence`` (fedssl.experiments.evidence_mae) at the tiny size on a CPU: the
result file, the rows and the paired statistics recomputed by hand, repeatability, the deadline, the round choice,
and that its device-side batches, local trainers, average and parallel data writer match the bundle's own."""

from __future__ import annotations

import filecmp
import json
import math
import os

import numpy as np
import pytest
import torch

from fedssl.core.state_dict import weighted_average
from fedssl.data.images import ImageDataset, load_image_records
from fedssl.experiments import evidence_mae as em
from fedssl.train.classifier import ClassifierLocalTrainer
from fedssl.train.mim import MIMLocalTrainer

SEEDS = (0, 1)


def _run(out, **kw):
    args = dict(size="tiny", seeds=SEEDS, device="cpu", pretrain_rounds=2, finetune_rounds=2, say=lambda m: None)
    args.update(kw)
    return em.fedmae_evidence(str(out), **args)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same command twice, each in its own folder (data written afresh)."""
    a, b = tmp_path_factory.mktemp("run_a"), tmp_path_factory.mktemp("run_b")
    return (a, _run(a)), (b, _run(b))


@pytest.fixture(scope="module")
def site_records(runs):
    out = runs[0][0]
    parts = next(os.path.join(out, "data", d) for d in os.listdir(os.path.join(out, "data")) if d.endswith("split3"))
    return {s: load_image_records(os.path.join(parts, s), "retina", site=s) for s in ("site-1", "site-2", "site-3",
                                                                                        "site-4", "site-5")}


def test_result_file_rows_and_paired_statistics(runs):
    (out, result), _ = runs
    with open(os.path.join(out, em.RESULT_FILE), encoding="utf-8") as f:
        assert json.load(f) == result
    assert (result["method"], result["split"], result["size"], result["seeds"]) == ("Fed-MAE", "Split-3", "tiny",
                                                                                      list(SEEDS))
    assert result["settings"]["pretrain_rounds"] == result["pretrain"]["rounds"] == 2
    assert result["settings"]["finetune_rounds"] == result["finetune"]["rounds"] == 2
    acc = {}
    for seed in SEEDS:
        rows = [r for r in result["rows"] if r["seed"] == seed]
        assert sorted(r["init"] for r in rows) == ["fedmae", "scratch"]
        acc[seed] = {r["init"]: r["accuracy"] for r in rows}
    diffs = [acc[s]["fedmae"] - acc[s]["scratch"] for s in SEEDS]
    paired = result["paired"]
    assert paired["n"] == len(SEEDS)
    assert paired["per_seed"] == pytest.approx(diffs, abs=1e-12)
    assert paired["mean"] == pytest.approx(sum(diffs) / len(diffs), abs=1e-12)
    mean = sum(diffs) / len(diffs)
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)) / math.sqrt(len(diffs))
    assert paired["se"] == pytest.approx(se, abs=1e-12)
    assert f"{100 * mean:+.1f} points" in result["verdict"]
    assert f"{len(SEEDS)} seeds" in result["verdict"]


def test_pretraining_curves_and_chance_loss(runs):
    (_, result), _ = runs
    pre = result["pretrain"]
    assert sorted(pre["loss_by_seed"]) == [str(s) for s in SEEDS]
    for curve in pre["loss_by_seed"].values():
        assert len(curve) == 2 and all(math.isfinite(x) and x > 0 for x in curve)
    assert math.isfinite(pre["chance_loss"]) and 0 < pre["chance_loss"] <= 1.0  # norm-pix targets: at most ~1
    assert pre["stopped_early"] is False and result["finetune"]["stopped_early"] is False


def test_same_command_same_numbers(runs):
    (_, a), (_, b) = runs
    for key in ("rows", "paired", "verdict"):
        assert a[key] == b[key]
    for stage in ("pretrain", "finetune"):
        assert a[stage]["loss_by_seed"] == b[stage]["loss_by_seed"]
    assert a["pretrain"]["chance_loss"] == b["pretrain"]["chance_loss"]
    assert a["data"]["sites"] == b["data"]["sites"] and a["data"]["test"] == b["data"]["test"]


def test_choose_rounds_by_hand():
    assert em.choose_rounds(100.0, 2.5, most=200) == 40
    assert em.choose_rounds(100.0, 2.5, most=30) == 30
    assert em.choose_rounds(100.0, 3.0, most=200) == 33  # floor: a 34th round would end at 102 s
    assert em.choose_rounds(1.0, 2.5, most=200) == 1
    assert em.choose_rounds(-5.0, 2.5, most=200) == 1
    with pytest.raises(ValueError):
        em.choose_rounds(100.0, 0.0, most=10)


def test_verdict_line_words():
    assert em.verdict_line([0.05, 0.04, 0.06], 0.01 / math.sqrt(3)).endswith("+5.0 points (SE 0.6) -> ahead by 8.7 SE")
    assert "behind by 8.7 SE" in em.verdict_line([-0.05, -0.04, -0.06], 0.01 / math.sqrt(3))
    assert "not separated (|diff| < 2 SE)" in em.verdict_line([0.03, -0.01, 0.01], 0.02 / math.sqrt(3))
    one = em.verdict_line([0.05], None)
    assert "+5.0 points" in one and "one seed: not a finding" in one


def test_device_batches_equal_the_image_dataset_items(site_records):
    records = site_records["site-1"]
    images = em.DeviceImages(records, 32, "cpu")
    idx = [3, 0, 7, 5, 1]
    for mode in ("pretrain", "finetune", "eval"):
        ds = ImageDataset(records, 32, mode, "retina", site="site-1", seed=1234)
        ds.set_epoch(3)
        x, y = images.batch(ds, idx, epoch=3)
        expected = torch.stack([ds[i][0] for i in idx])
        assert torch.allclose(x, expected, atol=1e-6), mode
        assert y.tolist() == [ds[i][1] for i in idx]


def test_local_trainers_match_the_bundle(site_records):
    cfg = em.SIZES["tiny"]
    records = site_records["site-3"]
    images = em.DeviceImages(records, 32, "cpu")
    settings = em.mim_settings(cfg, 3, 1, "cpu")
    ref = MIMLocalTrainer(records, settings, num_rounds=3, site="site-3")
    mine = em.MAESite("site-3", records, settings, 3, em.build_mae(cfg, 1), "cpu")
    assert mine.train_round(0, images) == pytest.approx(ref.train_round(0).loss, rel=1e-6)
    for p, q in zip(ref.model.state_dict().values(), mine.model.state_dict().values()):
        assert torch.allclose(p, q, atol=1e-6)
    cs = em.classifier_settings(cfg, 1, "cpu")
    ref_ft = ClassifierLocalTrainer(records, cs, num_rounds=3, site="site-3")
    mine_ft = em.FineTuneSite("site-3", records, cs, 3, em.build_classifier(cfg, 1), "cpu")
    assert mine_ft.samples == len(ref_ft.train_set)
    for r in range(2):
        assert mine_ft.train_round(r, images) == pytest.approx(ref_ft.train_round(r).loss, rel=1e-6)
    for p, q in zip(ref_ft.model.state_dict().values(), mine_ft.model.state_dict().values()):
        assert torch.allclose(p.float(), q.float(), atol=1e-6)


def test_device_average_is_weighted_average():
    cfg = em.SIZES["tiny"]
    states = []
    for seed in (0, 1, 2):
        model = em.build_classifier(cfg, seed)
        model.head_steps.fill_(seed * 3 + 1)
        states.append(model.state_dict())
    weights = [27, 45, 13]
    ref = weighted_average(states, weights)
    got = em.device_average(states, weights)
    assert sorted(got) == sorted(ref)
    for k, v in ref.items():
        assert got[k].dtype == torch.from_numpy(np.asarray(v)).dtype, k
        assert torch.equal(got[k], torch.from_numpy(np.asarray(v))), k
    assert int(got["head_steps"]) == round((1 * 27 + 4 * 45 + 7 * 13) / 85)


def test_parallel_writer_writes_the_serial_files(tmp_path):
    em.write_retina_images(str(tmp_path / "serial"), 24, 0, 32, workers=1)
    em.write_retina_images(str(tmp_path / "parallel"), 24, 0, 32, workers=2)
    assert filecmp.cmp(tmp_path / "serial" / "trainLabels.csv", tmp_path / "parallel" / "trainLabels.csv",
                       shallow=False)
    names = sorted(os.listdir(tmp_path / "serial" / "train"))
    assert len(names) == 24 and names == sorted(os.listdir(tmp_path / "parallel" / "train"))
    match, mismatch, errors = filecmp.cmpfiles(tmp_path / "serial" / "train", tmp_path / "parallel" / "train", names,
                                               shallow=False)
    assert (mismatch, errors) == ([], []) and len(match) == 24


def test_timing_probe_and_deadline(runs, site_records, tmp_path):
    cfg = em.SIZES["tiny"]
    images = em.DeviceImages([r for recs in site_records.values() for r in recs], 32, "cpu")
    probe = em.probe_pretrain(cfg, site_records, images, 0, "cpu")
    assert probe["round_s"] > 0 and math.isfinite(probe["round_s"]) and probe["steps_per_round"] >= 5
    # a budget far below the rounds asked for: both stages stop at their deadlines and say so
    os.symlink(os.path.join(runs[0][0], "data"), tmp_path / "data")
    result = _run(tmp_path, seeds=(0,), budget_s=3.0, pretrain_rounds=40, finetune_rounds=40)
    assert result["pretrain"]["stopped_early"] and result["finetune"]["stopped_early"]
    assert 1 <= result["pretrain"]["rounds_done_by_seed"]["0"] < 40
    assert 1 <= result["finetune"]["rounds_done_by_seed"]["0"] < 40
    assert len(result["pretrain"]["loss_by_seed"]["0"]) == result["pretrain"]["rounds_done_by_seed"]["0"]
    # the deadline bounds the wall time: one round past it at most per stage, with room for a loaded 2-core CI
    # machine (8.6 s was seen beside another pytest run; the 40 + 40 rounds asked for take far longer)
    assert result["seconds"] < 3.0 + 12.0
    assert "one seed: not a finding" in result["verdict"] and "stopped early" in result["verdict"]


def _ticks(start=0.0, step=1.0):
    """A fake clock: ``start``, ``start + step``, ... one value a call (a RoundBudget asks once a round)."""
    t = [start - step]

    def clock():
        t[0] += step
        return t[0]
    return clock


def _times(*values):
    it = iter(values)
    return lambda: next(it)


def _rounds_run(budget):
    """Drive ``budget`` as a stage does: ``while budget.next_round(r)``; the rounds run."""
    r = 0
    while budget.next_round(r):
        r += 1
    return r


def test_replan_rounds_by_hand():
    assert em.replan_rounds(40, 5, [1.0, 1.2, 1.5], 30.0) == 5 + 20
    assert em.replan_rounds(40, 5, [9.0, 1.0, 1.0, 1.0], 30.0) == 5 + 30  # the last three rounds only
    assert em.replan_rounds(40, 5, [1.0, 2.0, 1.0], 30.0) == 5 + 15  # the slowest of them, not the last
    assert em.replan_rounds(12, 5, [1.0, 1.0, 1.0], 30.0) == 12  # never more than planned
    assert em.replan_rounds(40, 5, [1.0, 1.0, 2.0], 1.0) == 5  # no time left: the rounds done
    assert em.replan_rounds(40, 5, [1.0, 1.0, 2.0], -3.0) == 5


def test_round_budget_replans_once_after_the_warm_up():
    calls = []
    b = em.RoundBudget(40, deadline=10.0, replan_at=2, on_replan=calls.append, clock=_ticks())
    assert _rounds_run(b) == 10 and calls == [10]  # at round 2: 8 s left at 1 s a round -> 2 + 8
    assert b.record() == {"planned": 40, "rounds": 10, "replanned": True, "stopped_early": False}
    assert b.seconds == [1.0] * 10
    # the slowest warm-up round counts: 1 s then 3 s, 10 - 4 = 6 s left -> 2 + 2 rounds
    b = em.RoundBudget(40, deadline=10.0, replan_at=2, clock=_times(0.0, 1.0, 4.0, 7.0, 10.0))
    assert _rounds_run(b) == 4 and b.rounds == 4 and not b.stopped_early
    # without a re-plan the deadline cuts the planned schedule and says so
    b = em.RoundBudget(40, deadline=10.0, clock=_ticks())
    assert _rounds_run(b) == 10
    assert b.record() == {"planned": 40, "rounds": 40, "replanned": False, "stopped_early": True}
    # a plan that fits is kept
    b = em.RoundBudget(6, deadline=100.0, replan_at=2, on_replan=calls.append, clock=_ticks())
    assert _rounds_run(b) == 6 and not b.replanned and calls == [10]
    for bad in ({"rounds": 0}, {"rounds": True}, {"replan_at": 0}, {"replan_at": 1.5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            em.RoundBudget(**{"rounds": 5, "deadline": 1.0, **bad})


def test_replanned_stages_repeat_a_run_planned_for_the_final_count(site_records):
    """Re-planned after the warm-up rounds, each stage trains exactly as a run given the final count from the
    start: the schedules of every site (both inits) follow the re-plan."""
    cfg = em.SIZES["tiny"]
    sites = {k: v for k, v in site_records.items() if k in ("site-1", "site-2", "site-3")}
    images = em.DeviceImages([r for recs in sites.values() for r in recs] + site_records["site-4"], 32, "cpu")
    pre_warmup, ft_warmup = cfg["pretrain"]["warmup_rounds"], cfg["finetune"]["warmup_rounds"]

    def pretrain(budget):
        return em.pretrain_seed(cfg, sites, images, 0, budget, "cpu", lambda m: None)

    # 1 s a round by the fake clock, the deadline at warm-up + 2: re-planned from 40 to warm-up + 2
    re = pretrain(em.RoundBudget(40, pre_warmup + 2.0, replan_at=pre_warmup, clock=_ticks()))
    fixed = pretrain(em.RoundBudget(pre_warmup + 2, math.inf))
    assert re["budget"] == {"planned": 40, "rounds": pre_warmup + 2, "replanned": True, "stopped_early": False}
    assert re["rounds_done"] == fixed["rounds_done"] == pre_warmup + 2
    assert re["loss"] == fixed["loss"]
    for k, v in fixed["encoder"].items():
        assert torch.equal(re["encoder"][k], v), k

    test = ImageDataset(site_records["site-4"], 32, "eval", "retina", site="test")

    def finetune(budget):
        return em.finetune_seed(cfg, sites, test, images, 0, fixed["encoder"], budget, "cpu", lambda m: None)

    re = finetune(em.RoundBudget(40, ft_warmup + 1.0, replan_at=ft_warmup, clock=_ticks()))
    fixed_ft = finetune(em.RoundBudget(ft_warmup + 1, math.inf))
    assert re["budget"]["rounds"] == re["rounds_done"] == ft_warmup + 1 and re["budget"]["replanned"]
    assert re["loss"] == fixed_ft["loss"] and re["rows"] == fixed_ft["rows"]


def test_budgeted_run_replans_from_the_warm_up_and_records_the_counts(runs, tmp_path, monkeypatch):
    made = []

    class Recording(em.RoundBudget):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(em, "RoundBudget", Recording)
    os.symlink(os.path.join(runs[0][0], "data"), tmp_path / "data")
    result = _run(tmp_path, seeds=(0,), budget_s=20.0, pretrain_rounds=None, finetune_rounds=None)
    cfg = em.SIZES["tiny"]
    pre, ft = made
    assert pre.planned == result["pretrain"]["rounds"] and ft.planned == result["finetune"]["rounds"]
    for b, stage in ((pre, "pretrain"), (ft, "finetune")):
        warmup = cfg[stage]["warmup_rounds"]
        assert b.replan_at == (warmup if warmup < b.planned else None), stage
        assert result[stage]["rounds_by_seed"] == {"0": b.rounds}
        curves = result[stage]["loss_by_seed"]["0"]
        for curve in curves.values() if stage == "finetune" else [curves]:  # fine-tuning: one curve an init
            assert len(curve) == result[stage]["rounds_done_by_seed"]["0"]
        assert result[stage]["rounds_done_by_seed"]["0"] <= b.rounds <= b.planned
    # given counts: no re-plan
    made.clear()
    _run(tmp_path, seeds=(0,), budget_s=60.0)
    assert [b.replan_at for b in made] == [None, None]
