"""``fedssl bench evidence`` (fedssl.experiments.evidence): the budget arithmetic and the verdict with hand-computed
values, the in-process server average against FLARE's, and the FCL part end to end at the tiny size on the CPU
(rows, curves, the pre-trained encoder really used, the same command giving the same numbers)."""

import json
import math
from collections import Counter

import numpy as np
import pytest
import torch

from fedssl.core.state_dict import weighted_average
from fedssl.experiments import evidence as ev
from fedssl.experiments.environment import cpu_id, onednn_isa


def test_rounds_that_fit_hand_computed():
    assert ev.rounds_that_fit(100.0, 2.5, most=200) == 40
    assert ev.rounds_that_fit(100.0, 2.5, most=30) == 30
    assert ev.rounds_that_fit(1.0, 2.5, most=30) == 1
    assert ev.rounds_that_fit(10.0, 3.0, most=30, least=5) == 5
    # 200 s with a 4x pool: 800 s of single-stream steps; 0.01 s x 500 steps = 5 s an epoch -> 160 epochs
    assert ev.finetune_epochs(200.0, 0.01, 500, 4.0, most=200, least=20) == 160
    # 60 runs of 5 s fixed cost take 300 of those 800 s: 500 s / 5 s an epoch -> 100 epochs
    assert ev.finetune_epochs(200.0, 0.01, 500, 4.0, most=200, least=20, run_s=5.0, n_runs=60) == 100


def test_se_over_seeds_and_verdict_hand_computed():
    # values 0.1, 0.2, 0.3: sample std 0.1, SE 0.1 / sqrt 3 = 0.0577
    assert ev.se_over_seeds([0.1, 0.2, 0.3]) == pytest.approx(0.1 / math.sqrt(3))
    assert ev.se_over_seeds([0.4]) is None
    line = ev.verdict_line("FCL vs random init, N=1", 0.2, 0.1 / math.sqrt(3), 3, "Dice")
    assert "+0.200" in line and "SE 0.058 over 3 seeds" in line and "ahead by 3.5 SE" in line
    assert "behind by 3.5 SE" in ev.verdict_line("x", -0.2, 0.1 / math.sqrt(3), 3, "Dice")
    assert "not separated (+1.0 SE" in ev.verdict_line("x", 0.1, 0.1, 3, "Dice")
    assert "one seed: not a finding" in ev.verdict_line("x", 0.3, None, 1, "Dice")
    assert "+4.0 points" in ev.verdict_line("Fed-MAE", 4.0, 1.0, 3, "accuracy")


def test_device_average_equals_the_servers_running_average():
    g = torch.Generator().manual_seed(0)
    states = [{"w": torch.randn(3, 2, generator=g), "bn.num_batches_tracked": torch.tensor(n)} for n in (3, 4, 8)]
    weights = [10.0, 20.0, 50.0]
    avg = ev._DeviceAverage()
    for s, w in zip(states, weights):
        avg.add(s, w)
    got = avg.result()
    want = weighted_average(states, weights)
    assert torch.allclose(got["w"], torch.as_tensor(want["w"]), atol=1e-7)
    # (3*10 + 4*20 + 8*50) / 80 = 6.375 -> 6, an int64 as the state's
    assert got["bn.num_batches_tracked"].dtype == torch.int64 and int(got["bn.num_batches_tracked"]) == 6
    assert int(want["bn.num_batches_tracked"]) == 6


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("evidence")
    result = ev.run_evidence(str(out), size="tiny", seeds=(0, 1), device="cpu", budget_s=300, methods=["fcl"],
                             rounds={"fcl_rounds": 2, "fcl_epochs": 2}, workers=1, say=lambda m: None)
    return out, result


def test_tiny_run_writes_every_row_curve_and_file(tiny_run):
    out, result = tiny_run
    assert json.load(open(out / "evidence.json")) == json.loads(json.dumps(result))
    assert (out / "evidence.png").stat().st_size > 5000
    # where it was computed, closely enough to tell two machines apart (the CPU's id and oneDNN's instruction set)
    assert result["environment"]["cpu_id"] == cpu_id() and result["environment"]["onednn_isa"] == onednn_isa()
    fcl = result["parts"]["fcl"]
    assert fcl["pretrain"]["rounds"] == 2 and fcl["pretrain"]["rounds_done"] == 2
    assert not fcl["pretrain"]["stopped_early"]
    for seed in ("0", "1"):
        curve = fcl["pretrain"]["by_seed"][seed]
        assert len(curve["loss"]) == 2 and all(np.isfinite(curve["loss"]))
        assert len(curve["feature_std"]) == 2
    assert fcl["pretrain"]["chance_loss_local"] == pytest.approx(math.log(32 + 1))
    rows = fcl["finetune"]["rows"]
    # 2 seeds x 2 sites x 2 inits x N in (1, 2)
    assert len(rows) == 16 and {r["method"] for r in rows} == {"random", "FCL"}
    assert {(r["seed"], r["site"]) for r in rows} == {(s, f"site-{k}") for s in (0, 1) for k in (1, 2)}
    assert all(r["epochs"] == 2 for r in rows)
    # the paired difference is recomputed from the rows, seed by seed
    for p in fcl["paired"]:
        for seed in (0, 1):
            d = [next(r["dice"] for r in rows if r["method"] == "FCL" and r["seed"] == seed and r["site"] == s
                      and r["n_labelled"] == p["n_labelled"]) -
                 next(r["dice"] for r in rows if r["method"] == "random" and r["seed"] == seed and r["site"] == s
                      and r["n_labelled"] == p["n_labelled"]) for s in ("site-1", "site-2")]
            assert p["by_seed"][str(seed)] == pytest.approx(np.mean(d))
    assert len(result["verdicts"]) == 2 and all("over 2 seeds" in v for v in result["verdicts"])


def test_tiny_run_fine_tunes_the_pretrained_encoder(tiny_run):
    """The FCL rows start from the saved global model (not from random init): their losses differ from the
    random-init runs of the same seed and site, and the saved model differs between seeds."""
    out, result = tiny_run
    rows = result["parts"]["fcl"]["finetune"]["rows"]
    key = lambda r: (r["seed"], r["site"], r["n_labelled"])  # noqa: E731
    random = {key(r): r["final_loss"] for r in rows if r["method"] == "random"}
    assert all(r["final_loss"] != random[key(r)] for r in rows if r["method"] == "FCL")
    g0 = torch.load(out / "fcl_global_seed0.pt", weights_only=True)
    g1 = torch.load(out / "fcl_global_seed1.pt", weights_only=True)
    assert any(not torch.equal(g0[k], g1[k]) for k in g0 if g0[k].is_floating_point())


def test_same_command_same_numbers(tiny_run, tmp_path):
    _, first = tiny_run
    again = ev.fcl_evidence(str(tmp_path), size="tiny", seeds=(0, 1), device="cpu", budget_s=300, rounds=2, epochs=2,
                            workers=1, say=lambda m: None)
    a, b = first["parts"]["fcl"], again
    assert a["pretrain"]["by_seed"] == b["pretrain"]["by_seed"]
    strip = lambda rows: sorted((r["method"], r["seed"], r["site"], r["n_labelled"], r["dice"], r["final_loss"])  # noqa
                                for r in rows)
    assert strip(a["finetune"]["rows"]) == strip(b["finetune"]["rows"])


def test_bad_arguments_are_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="methods=.*use some of"):
        ev.run_evidence(str(tmp_path), methods=["fedclf"])
    with pytest.raises(ValueError, match="size='huge'"):
        ev.run_evidence(str(tmp_path), size="huge")
    with pytest.raises(ValueError, match="distinct seeds"):
        ev.run_evidence(str(tmp_path), seeds=(0, 0))


def test_federation_starts_every_site_from_the_last_global_and_shuttles_the_banks(tmp_path, monkeypatch):
    """Every round, every site of a seed starts from the previous round's average (the server's) and, from the
    second round on, holds as many of the other site's features as it shared (the server's rule); the returned
    global is the average of the sites' models after the last round."""
    from fedssl.train.fcl import FCLLocalTrainer

    cfg = ev.FCL_SIZES["tiny"]
    sites = ev.prepare_acdc(str(tmp_path / "acdc"), cfg, processes=1)
    starts, finals, shared = [], {}, {}
    original = FCLLocalTrainer.train_round

    def recording(self, round_idx, should_stop=None):
        starts.append((self.settings.seed, round_idx, {k: v.clone() for k, v in self.model.state_dict().items()}))
        out = original(self, round_idx, should_stop)
        if round_idx == 0:
            shared.setdefault(self.settings.seed, []).append(self.bank.fresh)  # what it uploads after round 0
        finals[(self.settings.seed, round_idx, self.data_seed)] = (
            {k: v.clone() for k, v in self.model.state_dict().items()}, out.samples)
        return out

    monkeypatch.setattr(FCLLocalTrainer, "train_round", recording)
    pre = ev.federated_fcl(sites, cfg, (0, 1), 2, "cpu", 300.0, lambda m: None)
    for seed in (0, 1):
        run = pre["runs"][seed]
        # two sites: each gets min(own, other's) of the other's rows
        assert len(shared[seed]) == 2 and 0 < min(shared[seed]) <= cfg["pretrain"]["bank_size"]
        assert run["remote_features"] == [0.0, float(min(shared[seed]))]
        first = [st for sd, r, st in starts if sd == seed and r == 0]
        second = [st for sd, r, st in starts if sd == seed and r == 1]
        assert len(first) == len(second) == 2
        avg = ev._DeviceAverage()
        for (sd, r, _), (state, n) in finals.items():
            if sd == seed and r == 0:
                avg.add(state, n)
        round0 = avg.result()
        for st in second:  # both sites start round 1 from the round-0 average
            assert all(torch.equal(st[k], round0[k]) for k in st)
        last = ev._DeviceAverage()
        for (sd, r, _), (state, n) in finals.items():
            if sd == seed and r == 1:
                last.add(state, n)
        assert all(torch.equal(run["global"][k], v) for k, v in last.result().items())


def test_resent_remote_bank_is_the_exchange_before_issue_45():
    """The control arm's delivery, by hand: three sites; site-1 filled 2 rows, so it gets at most 2 x (3 - 1) = 4
    real rows of the others' 5 filled ones, and 4 padding rows (unit vectors, partition -1) to make K = 8."""
    d = 3
    banks = {"site-1": (np.ones((4, d), np.float32), np.array([0, 1, -1, -1])),
             "site-2": (np.full((4, d), 2.0, np.float32), np.array([2, 3, 2, -1])),
             "site-3": (np.full((3, d), 3.0, np.float32), np.array([1, 1, -1]))}
    f, p = ev.resent_remote_bank(banks, "site-1", 8, np.random.default_rng(0))
    assert f.shape == (8, d) and p.shape == (8,) and f.dtype == np.float32 and p.dtype == np.int64
    real = p >= 0
    assert int(real.sum()) == 4 and set(np.unique(f[real][:, 0])) <= {2.0, 3.0}
    pool = Counter([2, 3, 2, 1, 1])  # the other sites' filled rows' partitions
    assert not Counter(p[real].tolist()) - pool
    assert np.allclose(np.linalg.norm(f[~real], axis=1), 1.0)
    f2, p2 = ev.resent_remote_bank(banks, "site-1", 3, np.random.default_rng(0))
    assert f2.shape == (3, d) and (p2 >= 0).all()  # K below the real rows: no padding
    with pytest.raises(ValueError, match="exchange='both'"):
        ev.federated_fcl({}, ev.FCL_SIZES["tiny"], (0,), 1, "cpu", 1.0, lambda m: None, exchange="both")


def _fedmae_part(rows: bool = True) -> dict:
    return {"rows": [{"seed": s, "init": i, "accuracy": 0.5} for s in (0, 1) for i in ("scratch", "fedmae")]
            if rows else [],
            "pretrain": {"loss_by_seed": {"0": [1.5, 0.8, 0.4], "1": [1.4, 0.9]}, "chance_loss": 0.9987},
            "finetune": {"loss_by_seed": {"0": {"fedmae": [0.7, 0.6], "scratch": [0.7, 1.4]},
                                          "1": {"fedmae": [0.69], "scratch": [0.71]}}},
            "data": {"test": {"no_dr": 254, "dr": 254}}}


def test_evidence_panels_follow_what_each_part_holds():
    fcl = {"finetune": {"rows": [{"method": "random", "n_labelled": 1, "seed": 0, "dice": 0.3}]},
           "pretrain": {"by_seed": {"0": {"loss_local": [4.0, 5.0]}}, "chance_loss_local": 8.32}}
    both = {"parts": {"fcl": fcl, "fedmae": _fedmae_part()}}
    assert ev.evidence_panels(both) == ["fcl", "fcl_loss", "fedmae", "fedmae_pretrain", "fedmae_finetune"]
    # a Fed-MAE run whose fine-tuning rows never came (deadline) still shows its loss curves; FCL absent
    assert ev.evidence_panels({"parts": {"fedmae": _fedmae_part(rows=False)}}) == ["fedmae_pretrain",
                                                                                   "fedmae_finetune"]
    assert ev.evidence_panels({"parts": {"fcl": {"finetune": {"rows": []}, "pretrain": {"by_seed": {}}}}}) == []


def test_plot_evidence_draws_fedmae_losses_by_seed_and_init(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    saved = {}
    real_savefig = plt.Figure.savefig

    def keep(fig, path, **kw):
        saved["axes"] = fig.axes
        return real_savefig(fig, path, **kw)

    summary = {"parts": {"fedmae": _fedmae_part()}, "size": "tiny", "device_name": "cpu", "seeds": [0, 1]}
    plt.Figure.savefig = keep
    try:
        path = ev.plot_evidence(summary, str(tmp_path / "e.png"))
    finally:
        plt.Figure.savefig = real_savefig
    assert (tmp_path / "e.png").stat().st_size > 5000 and path.endswith("e.png")
    bars, pre, fine = saved["axes"]
    # pre-training: one curve per seed at its own length, the chance level as a line
    assert [list(line.get_ydata()) for line in pre.lines[:2]] == [[1.5, 0.8, 0.4], [1.4, 0.9]]
    assert list(pre.lines[2].get_ydata()) == [0.9987, 0.9987]
    # fine-tuning: fedmae solid and scratch dotted per seed, same colour per seed, then ln 2 for two classes
    assert [(line.get_linestyle(), list(line.get_ydata())) for line in fine.lines[:4]] == [
        ("-", [0.7, 0.6]), (":", [0.7, 1.4]), ("-", [0.69]), (":", [0.71])]
    assert fine.lines[0].get_color() == fine.lines[1].get_color() != fine.lines[2].get_color()
    assert list(fine.lines[4].get_ydata()) == pytest.approx([math.log(2)] * 2)
