"""FedMoCo's control (fedssl.experiments.fedclf_control): the settings it takes from the job, its step count, its
in-process federation, its probe and its summary, with hand-computed values, and one tiny end-to-end run of both
arms that resumes."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fedssl.core.trainer import RoundStats
from fedssl.experiments import fedclf_control as fc
from fedssl.experiments.environment import cpu_id
from fedssl.models.resnet import PretrainingResNet


def test_settings_are_the_bench_pretraining_jobs_with_the_local_bank_only():
    s, rounds = fc.control_settings("bench", seed=2)
    # app_config/profiles/bench.json (fedclf_derm) and the job's paper values where bench is silent
    assert (s.batch_size, s.lr, s.bank_size, s.width, s.proj_dim, s.image_size) == (16, 0.00375, 256, 16, 128, 64)
    assert (s.momentum, s.tau, s.method, s.depth) == (0.999, 0.2, "moco", 18)
    assert (s.queue, s.federated, s.max_steps_per_round, s.seed, s.device) == ("none", False, 0, 2, "cpu")
    assert rounds == 30
    s2, _ = fc.control_settings("bench", seed=0, sets=["client.fedclf_trainer.lr=0.01"])
    assert s2.lr == 0.01


def test_one_x_is_the_largest_devices_steps_and_epochs_round_to_the_nearest():
    train = {"site-1": [None] * 170, "site-2": [None] * 35, "site-3": [None] * 173}
    assert fc.one_x_steps(train, batch_size=16, rounds=30) == 30 * 10  # 173 // 16 = 10
    # 1,265 pooled images at batch 16: 79 steps an epoch; 300 steps -> 3.8 -> 4 epochs, 1,200 -> 15.2 -> 15
    assert fc.pooled_epochs(1265, 16, 300) == 4
    assert fc.pooled_epochs(1265, 16, 1200) == 15
    assert fc.pooled_epochs(1265, 16, 10) == 1  # at least one epoch
    with pytest.raises(ValueError, match="batch_size"):
        fc.pooled_epochs(10, 16, 300)


def test_probe_scores_balanced_accuracy_the_mean_recall_over_the_classes_present(monkeypatch):
    """The probe's head predicts the class of the largest feature; test labels 0 0 0 0 1 1 2, predictions
    0 0 0 1 1 0 0: recalls 3/4, 1/2, 0/1 -> 5/12, where plain accuracy is 4/7."""
    y = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    pred = torch.tensor([0, 0, 0, 1, 1, 0, 0])
    x = torch.nn.functional.one_hot(pred, 5).float()
    monkeypatch.setattr(fc, "encoder_features", lambda model, records, settings: (x, y))
    head = torch.nn.Linear(5, 5)
    with torch.no_grad():  # identity on the standardised features keeps each row's argmax
        head.weight.copy_(torch.eye(5))
        head.bias.zero_()
    monkeypatch.setattr(fc, "fit_logistic", lambda *a, **k: head)
    s, _ = fc.control_settings("quick", seed=0)
    out = fc.linear_probe(None, [None] * 7, [None] * 7, s, seed=0)
    assert out["balanced_accuracy"] == pytest.approx(5 / 12)
    assert out["accuracy"] == pytest.approx(4 / 7)


def _cell(arm, m, seed, probe, loss=None, chance=None, failed=False):
    c = {"arm": arm, "multiplier": m, "seed": seed, "probe": {"balanced_accuracy": probe}}
    if arm != "random":
        c |= {"steps": 300 * m, "rounds": [{"loss": loss, "chance_loss": chance}],
              "health": {"failed": failed, "reasons": ["x"] if failed else []}}
    return c


def test_summary_pairs_each_multiplier_with_random_init_by_seed():
    cells = [_cell("random", 0, 0, 0.40), _cell("random", 0, 1, 0.50), _cell("random", 0, 2, 0.30),
             _cell("moco", 1, 0, 0.45, 5.5, 5.5, True), _cell("moco", 1, 1, 0.50, 5.5, 5.5, True),
             _cell("moco", 1, 2, 0.40, 4.4, 5.5)]
    rows, lines = fc.summarise(cells)
    (row,) = rows
    assert row["by_seed"] == pytest.approx({0: 5.0, 1: 0.0, 2: 10.0})
    assert row["minus_random"] == pytest.approx(5.0)
    assert row["se"] == pytest.approx(5.0 / math.sqrt(3))  # sample std of (5, 0, 10) is 5
    assert row["failed"] == 2 and row["last_loss_over_chance"] == pytest.approx((1 + 1 + 0.8) / 3)
    assert "minus random init +5.0 points (SE 2.9 over 3 seeds" in lines[0]
    rows1, lines1 = fc.summarise(cells[:1] + cells[3:4])
    assert rows1[0]["se"] is None and "one seed: not a finding" in lines1[0]


def test_probe_leaves_the_encoder_as_it_was(monkeypatch):
    model = PretrainingResNet("moco", 4, 8, seed=0, depth=18)
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.rand(6, 3, 16, 16)
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    monkeypatch.setattr(fc, "ImageDataset", lambda *a, **k: None)
    monkeypatch.setattr(fc, "batches", lambda *a, **k: iter([(x, y)]))
    s, _ = fc.control_settings("quick", seed=0)
    feats, labels = fc.encoder_features(model, [], s)
    assert feats.shape == (6, model.main.encoder.out_dim) and torch.equal(labels, y)
    # eval mode for the features (BatchNorm's running statistics untouched), training mode restored
    assert model.main.encoder.training
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # the features are the eval-mode encoder's
    model.main.encoder.eval()
    with torch.no_grad():
        assert torch.allclose(feats, model.main.encoder(x).flatten(1))


def test_tiny_run_writes_every_cell_and_resumes_without_training(tmp_path, monkeypatch):
    out = tmp_path / "ctl"
    said = []
    report = fc.run_control(str(out), profile="quick", multipliers=[1], federated_multipliers=[1], seeds=[0],
                            n_isic=40, say=said.append)
    assert [(c["arm"], c["multiplier"]) for c in report["cells"]] == [("random", 0), ("moco", 1), ("federated", 1)]
    fed = report["cells"][2]
    # the quick profile's table pre-trains for 15 rounds (app_config/profiles/quick.json, tables.fedclf)
    assert fed["federated_rounds"] == 15 and [r["round"] for r in fed["rounds"]] == list(range(15))
    assert fed["steps"] == sum(r["steps"] for r in fed["rounds"]) == fed["one_x_steps"]
    # every device with a full batch trains its full batches each round; the probe sees every image once
    train, test, pooled = fc.load_split(str(out / "data" / "devices"))
    batch = fed["settings"]["batch_size"]
    per_round = sum(len(r) // batch for r in train.values() if len(r) >= batch)
    assert fed["total_steps"] == 15 * per_round and [r["total_steps"] for r in fed["rounds"]] == [per_round] * 15
    assert (fed["probe"]["n_train"], fed["probe"]["n_test"]) == (len(pooled), len(test))
    last = fed["rounds"][-1]  # the H4 rule: failed when the last round ends less than 5 % below chance
    assert fed["health"]["failed"] == (last["loss"] > (1 - fc.CHANCE_MARGIN) * last["chance_loss"])
    assert [m.split(":")[0] for m in said if "federated round" in m] == ["  seed 0 federated round 10/15",
                                                                        "  seed 0 federated round 15/15"]
    moco = report["cells"][1]
    assert moco["steps"] == sum(r["steps"] for r in moco["rounds"]) > 0
    epochs = len(moco["rounds"])  # progress: a line per pre-training epoch
    assert [m.split(":")[0] for m in said if "epoch" in m] == [f"  seed 0 epoch {e}/{epochs}" for e in
                                                               range(1, epochs + 1)]
    assert moco["rounds"][-1]["chance_loss"] == pytest.approx(math.log(moco["settings"]["bank_size"] + 1))
    assert set(moco["health"]) >= {"failed", "reasons"}
    assert (moco["probe"]["n_train"], moco["probe"]["n_test"]) == (len(pooled), len(test))
    assert report["png"] == str(out / "control.png") and (out / "control.png").stat().st_size > 0
    saved = json.loads((out / "control.json").read_text())
    assert saved["lines"] == report["lines"] and len(saved["summary"]) == 2
    # where the cells were computed: run_config.json's record, which a resume in another environment warns about
    config = json.loads((out / "run_config.json").read_text())
    assert saved["environments"] == config["environments"] and saved["threads"] == config["threads"] == 1
    assert [e["cpu_id"] for e in saved["environments"]] == [cpu_id()]

    def no_training(*a, **k):
        raise AssertionError("a finished cell was trained again")

    monkeypatch.setattr(fc, "pretrain", no_training)
    monkeypatch.setattr(fc, "pretrain_federated", no_training)
    monkeypatch.setattr(fc, "linear_probe", no_training)
    again = fc.run_control(str(out), profile="quick", multipliers=[1], federated_multipliers=[1], seeds=[0],
                           n_isic=40, say=lambda m: None)
    assert again["lines"] == report["lines"]


def test_summary_keeps_the_arms_apart_pooled_first():
    cells = [_cell("random", 0, 0, 0.40), _cell("random", 0, 1, 0.50),
             _cell("federated", 1, 0, 0.38, 5.5, 5.5), _cell("federated", 1, 1, 0.46, 5.5, 5.5),
             _cell("moco", 1, 0, 0.41, 5.0, 5.5), _cell("moco", 1, 1, 0.52, 5.0, 5.5)]
    rows, lines = fc.summarise(cells)
    assert [(r["arm"], r["multiplier"]) for r in rows] == [("moco", 1), ("federated", 1)]
    assert rows[0]["by_seed"] == pytest.approx({0: 1.0, 1: 2.0})
    assert rows[1]["by_seed"] == pytest.approx({0: -2.0, 1: -4.0})
    assert rows[1]["minus_random"] == pytest.approx(-3.0) and rows[1]["se"] == pytest.approx(1.0)
    assert lines[0].startswith("MoCo x1") and lines[1].startswith("FedMoCo federated x1")


class _FakeTrainer:
    """A device whose every round sets all its weights to ``value`` (integer buffers too) and reports a loss."""

    made: list = []

    def __init__(self, records, settings, *, num_rounds, site):
        self.n, self.settings, self.num_rounds, self.site = len(records), settings, num_rounds, site
        self.value = {"a": 1.0, "b": 4.0, "c": 9.0}[site]
        self.loaded: list = []
        self.state: dict = {}
        _FakeTrainer.made.append(self)

    def load_global(self, state):
        self.loaded.append({k: v.clone() for k, v in state.items()})
        self.state = state

    def train_round(self, r):
        return RoundStats(loss=self.value + r, steps=self.n // self.settings.batch_size, samples=self.n,
                          metrics={"chance_loss": 2 * self.value, "feature_std": self.value / 10, "lr": 0.5 - r})

    def global_state(self):
        return {k: torch.full_like(v, self.value) for k, v in self.state.items()}


def test_federation_averages_the_devices_by_image_count_every_round(monkeypatch):
    """Devices a (16 images), b (48), c (8, less than a batch of 16: left out): the global model after a round is
    (16 x 1 + 48 x 4) / 64 = 3.25 everywhere (integer buffers rounded to 3); every trainer starts a round from the
    same global model; the round's loss is image-weighted, its steps the largest device's (48 // 16 = 3)."""
    _FakeTrainer.made = []
    monkeypatch.setattr(fc, "FedCLFLocalTrainer", _FakeTrainer)
    s, _ = fc.control_settings("quick", seed=0, sets=["client.fedclf_trainer.batch_size=16"])
    train = {"a": [None] * 16, "b": [None] * 48, "c": [None] * 8}
    model, curve = fc.pretrain_federated(train, s, rounds=2, say=lambda m: None)
    assert [t.site for t in _FakeTrainer.made] == ["a", "b"]
    assert all(t.num_rounds == 2 and t.settings.federated and t.settings.queue == "none" for t in _FakeTrainer.made)
    a, b = _FakeTrainer.made
    assert all(torch.equal(x, y) for k in a.loaded[1] for x, y in [(a.loaded[1][k], b.loaded[1][k])])
    for k, v in model.state_dict().items():
        want = 3.0 if not v.dtype.is_floating_point else 3.25
        assert torch.all(v == want), k
        assert torch.all(a.loaded[1][k] == want), k  # round 2 starts from round 1's average
    assert curve[0]["loss"] == pytest.approx(3.25) and curve[1]["loss"] == pytest.approx(4.25)
    assert curve[0]["chance_loss"] == pytest.approx(6.5) and curve[0]["feature_std"] == pytest.approx(0.25)
    assert [(c["steps"], c["total_steps"], c["lr_end"]) for c in curve] == [(3, 4, 0.5), (3, 4, -0.5)]


def test_federation_needs_a_device_with_a_full_batch():
    s, _ = fc.control_settings("quick", seed=0, sets=["client.fedclf_trainer.batch_size=16"])
    with pytest.raises(ValueError, match="batch_size"):
        fc.pretrain_federated({"a": [None] * 8}, s, rounds=1)


def test_control_refuses_bad_arguments_by_name(tmp_path):
    with pytest.raises(ValueError, match="federated_multipliers"):
        fc.run_control(str(tmp_path), profile="quick", multipliers=[1], federated_multipliers=[0], seeds=[0])
    with pytest.raises(ValueError, match="workers"):
        fc.run_control(str(tmp_path), profile="quick", multipliers=[1], seeds=[0], workers=0)
    with pytest.raises(ValueError, match="multiplier"):
        fc.run_control(str(tmp_path), profile="quick", multipliers=[], seeds=[0])


def test_costliest_cells_first():
    keys = [{"arm": "random", "multiplier": 0}, {"arm": "moco", "multiplier": 4}, {"arm": "federated", "multiplier": 1}]
    assert sorted(keys, key=fc._cost, reverse=True) == [keys[2], keys[1], keys[0]]


def test_one_tick_per_multiplier_when_the_arms_steps_are_close():
    assert fc.distinct_ticks({316, 300, 1185, 1200, 4819, 4800}) == [300, 1185, 4800]
    assert fc.distinct_ticks([300, 331]) == [300, 331]  # more than 10 % apart: both
