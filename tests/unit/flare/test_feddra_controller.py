"""FedDRAController's turn (stage 1, stage 2's download, DRO weights) and DROWeightFilter, with FLARE's broadcast
and the stage-1 aggregator faked."""

import json

import numpy as np
import pytest
from nvflare.apis.client import Client
from nvflare.apis.controller_spec import ClientTask
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.shareable import make_copy
from nvflare.app_common.abstract.aggregator import Aggregator
from nvflare.app_common.abstract.model import make_model_learnable
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.workflows.scatter_and_gather import ScatterAndGather

from fedssl.core.dro import chi2_divergence
from fedssl.flare.constants import (ALIGN_TASK, DRO_LOSS_KEY, DRO_ON_KEY, DRO_SITES_KEY, DRO_WEIGHT_KEY,
                                    DRO_WEIGHTS_PROP, STAGE_KEY)
from fedssl.flare.dro_weight_filter import DROWeightFilter
from fedssl.flare.feddra_controller import TRAJECTORY_FILE, FedDRAController
from tests.unit.flare.fakes import FakeEngine, context

WEIGHTS = {"image_encoder.w": np.ones(3, np.float32), "text_encoder.w": np.ones(2, np.float32),
           "image_align.w": np.zeros(2, np.float32), "text_proj.w": np.zeros(2, np.float32)}
SITES = ["site-1", "site-2", "site-3"]


class FakeAlignAggregator(Aggregator):
    def __init__(self):
        super().__init__()
        self.accepted, self.resets = [], 0

    def accept(self, shareable, fl_ctx):
        self.accepted.append(shareable)
        return True

    def reset(self, fl_ctx):
        self.resets += 1
        self.accepted = []

    def aggregate(self, fl_ctx):
        states = [from_shareable(s).data for s in self.accepted]
        mean = {k: np.mean([s[k] for s in states], axis=0) for k in states[0]} if states else {}
        return DXO(DataKind.WEIGHTS, data=mean).to_shareable()


def controller(tmp_path, two_stage=True, dro=True, **kw):
    ctrl = FedDRAController(two_stage=two_stage, dro=dro, rho=kw.pop("rho", 0.1), gamma=kw.pop("gamma", 0.5),
                            min_clients=3, num_rounds=5, **kw)
    engine = FakeEngine(tmp_path, sites=SITES)
    ctrl._engine = engine
    ctrl.align_aggregator = FakeAlignAggregator()
    ctrl.weights = {s: 1 / 3 for s in SITES}
    sent = []

    def fake_broadcast(task, min_responses, wait_time_after_min_received, fl_ctx, abort_signal):
        sent.append(task)
        data = from_shareable(task.data)
        for i, site in enumerate(SITES):  # every site returns its alignment part + (i + 1)
            up = {k: v + (i + 1) for k, v in data.data.items() if k.startswith(("image_align.", "text_proj."))}
            ct = ClientTask(Client(site, None), task)
            ct.result = DXO(DataKind.WEIGHTS, data=up).to_shareable()
            task.result_received_cb(ct, fl_ctx)

    ctrl.broadcast_and_wait = fake_broadcast
    return ctrl, sent, engine


def turn(ctrl, engine, round_idx, weights=None):
    ctx = context(engine=engine, props={AppConstants.CURRENT_ROUND: round_idx})
    model = make_model_learnable({k: v.copy() for k, v in (weights or WEIGHTS).items()}, {})
    return from_shareable(ctrl.turn_data(model, ctx)), model, ctx


def test_a_two_stage_turn_runs_stage_one_then_downloads_only_the_averaged_alignment_part(tmp_path):
    ctrl, sent, engine = controller(tmp_path)
    stage2, model, _ = turn(ctrl, engine, 0)
    assert [t.name for t in sent] == [ALIGN_TASK]
    stage1 = from_shareable(sent[0].data)
    assert set(stage1.data) == set(WEIGHTS) and stage1.get_meta_prop(STAGE_KEY) == "align"
    assert sent[0].data.get_header(AppConstants.CURRENT_ROUND) == 0
    assert ctrl.align_aggregator.resets == 1
    # the sites sent alignment + 1, + 2, + 3: their plain mean is + 2, merged into the global model
    np.testing.assert_allclose(model["weights"]["image_align.w"], np.full(2, 2.0))
    np.testing.assert_allclose(model["weights"]["image_encoder.w"], np.ones(3))
    assert stage2.get_meta_prop(STAGE_KEY) == "full_model"
    assert set(stage2.data) == {"image_align.w", "text_proj.w"}
    np.testing.assert_allclose(stage2.data["text_proj.w"], np.full(2, 2.0))


def test_without_two_stages_a_turn_is_one_fedavg_task_with_the_whole_model(tmp_path):
    ctrl, sent, engine = controller(tmp_path, two_stage=False, dro=False)
    data, _, _ = turn(ctrl, engine, 0)
    assert sent == [] and data.get_meta_prop(STAGE_KEY) == "fedavg" and set(data.data) == set(WEIGHTS)
    assert data.get_meta_prop(DRO_ON_KEY) is False


def report(ctrl, site, loss, monkeypatch):
    monkeypatch.setattr(ScatterAndGather, "_accept_train_result", lambda self, **kw: True)
    result = DXO(DataKind.WEIGHTS, data={}, meta={} if loss == "missing" else {DRO_LOSS_KEY: loss}).to_shareable()
    ctrl._accept_train_result(client_name=site, result=result, fl_ctx=context())


def test_the_weights_follow_the_reported_losses_and_stay_in_the_ball(tmp_path, monkeypatch):
    ctrl, _, engine = controller(tmp_path, two_stage=False)
    _, _, ctx = turn(ctrl, engine, 0)
    assert ctx.get_prop(DRO_WEIGHTS_PROP) == {"round": 0, "weights": {s: pytest.approx(1 / 3) for s in SITES}}
    for site, loss in zip(SITES, (3.0, 2.0, 1.0)):
        report(ctrl, site, loss, monkeypatch)
    _, _, ctx = turn(ctrl, engine, 1)
    w = ctx.get_prop(DRO_WEIGHTS_PROP)["weights"]
    assert w["site-1"] > w["site-2"] > w["site-3"] and sum(w.values()) == pytest.approx(1.0)
    assert chi2_divergence(np.array(list(w.values()))) <= 0.1 + 1e-9
    saved = json.load(open(tmp_path / TRAJECTORY_FILE))
    assert [t["turn"] for t in saved["trajectory"]] == [0, 1] and saved["rho"] == 0.1
    assert saved["min_share"] == 0.5  # the floor in force is on record
    assert "loss" not in json.dumps(saved)  # the per-site losses are not written


def test_each_turn_starts_from_the_last_turns_weights(tmp_path, monkeypatch):
    """Issue 47: weights reset to uniform every turn passed every test (each checked one update).  Two turns with
    the same losses: the second moves on from the first's weights, as hand-computed by dro_update twice."""
    from fedssl.core.dro import dro_update

    ctrl, _, engine = controller(tmp_path, two_stage=False, rho=10.0)
    turn(ctrl, engine, 0)
    losses = dict(zip(SITES, (3.0, 2.0, 1.0)))
    expected = {s: 1 / 3 for s in SITES}
    for r in (1, 2):
        for site, loss in losses.items():
            report(ctrl, site, loss, monkeypatch)
        _, _, ctx = turn(ctrl, engine, r)
        expected, _ = dro_update(expected, losses, 0.5, 10.0, 0.5)
        assert ctx.get_prop(DRO_WEIGHTS_PROP)["weights"] == pytest.approx(expected)
    once, _ = dro_update({s: 1 / 3 for s in SITES}, losses, 0.5, 10.0, 0.5)
    assert expected["site-1"] > once["site-1"] + 1e-3  # two steps went further than one


@pytest.mark.parametrize("bad", ["missing", float("nan"), -1.0, "2.0"])
def test_a_site_without_a_valid_loss_keeps_its_weight(tmp_path, monkeypatch, bad):
    ctrl, _, engine = controller(tmp_path, two_stage=False)
    ctrl.weights = {"site-1": 0.3, "site-2": 0.4, "site-3": 0.3}
    turn(ctrl, engine, 0)
    report(ctrl, "site-1", 2.0, monkeypatch)
    report(ctrl, "site-2", bad, monkeypatch)
    report(ctrl, "site-3", 1.0, monkeypatch)
    _, _, ctx = turn(ctrl, engine, 1)
    w = ctx.get_prop(DRO_WEIGHTS_PROP)["weights"]
    assert w["site-2"] == 0.4 and w["site-1"] > w["site-3"]


@pytest.mark.parametrize("args,name", [(dict(rho=0.0), "rho"), (dict(gamma=-1.0), "gamma"), (dict(rho="0.1"), "rho"),
                                       (dict(min_share=1.0), "min_share"), (dict(min_share=True), "min_share")])
def test_a_bad_radius_or_step_is_refused_at_start(args, name):
    with pytest.raises(ValueError, match=f"argument {name}="):
        FedDRAController(min_clients=3, num_rounds=5, **{"rho": 0.1, "gamma": 0.5, **args})


# ------------------------------------------------------------------ the per-site filter
def broadcast(dro=True, round_idx=0):
    s = DXO(DataKind.WEIGHTS, data={"w": np.ones(2)}, meta={DRO_ON_KEY: dro, STAGE_KEY: "full_model"}).to_shareable()
    s.set_header(AppConstants.CURRENT_ROUND, round_idx)
    return s


def test_each_site_receives_exactly_its_own_weight():
    plan = {"round": 2, "weights": {"site-1": 0.5, "site-2": 0.3, "site-3": 0.2}}
    shared = broadcast(round_idx=2)
    got = {}
    for site in SITES:
        ctx = context(peer_site=site, props={DRO_WEIGHTS_PROP: plan, AppConstants.CURRENT_ROUND: 2})
        out = from_shareable(DROWeightFilter().process(make_copy(shared), ctx))
        got[site] = out.get_meta_props()
        assert out.get_meta_prop(DRO_SITES_KEY) == 3
        other = set(plan["weights"]) - {site}
        assert not any(str(plan["weights"][o]) in json.dumps({k: v for k, v in got[site].items()
                                                              if k != DRO_WEIGHT_KEY}) for o in other)
    assert {s: m[DRO_WEIGHT_KEY] for s, m in got.items()} == plan["weights"]
    assert DRO_WEIGHT_KEY not in from_shareable(shared).get_meta_props()  # the shared broadcast is untouched


def test_the_filter_leaves_non_dro_tasks_alone_and_sends_no_weight_without_a_plan():
    ctx = context(peer_site="site-1", props={AppConstants.CURRENT_ROUND: 0})
    assert DRO_WEIGHT_KEY not in from_shareable(DROWeightFilter().process(broadcast(dro=False), ctx)).get_meta_props()
    stale = context(peer_site="site-1", props={AppConstants.CURRENT_ROUND: 1,
                                               DRO_WEIGHTS_PROP: {"round": 0, "weights": {"site-1": 1.0}}})
    assert DRO_WEIGHT_KEY not in from_shareable(DROWeightFilter().process(broadcast(round_idx=1),
                                                                          stale)).get_meta_props()
