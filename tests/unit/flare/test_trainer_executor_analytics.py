"""TrainerExecutor's training curves through FLARE's analytics path, without the simulator.

Client: the executor's ``log_writer`` is a real ``TBWriter``; the fake engine records the analytics events
it fires.  Server: those events, as the federated event ``fed.analytix_log_stats`` from a site, go to a real
``TBAnalyticsReceiver`` (TensorBoard files read back with EventAccumulator) and to ``RunSummary`` (loss terms).
"""

import json

import numpy as np
import pytest
import torch
from nvflare.apis.analytix import ANALYTIC_EVENT_TYPE, AnalyticsData
from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.event_type import EventType
from nvflare.apis.fl_constant import EventScope, FLContextKey, ReservedKey
from nvflare.apis.signal import Signal
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.app_event_type import AppEventType
from nvflare.app_opt.tracking.tb.tb_receiver import TBAnalyticsReceiver
from nvflare.app_opt.tracking.tb.tb_writer import TBWriter
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from fedssl.core.trainer import RoundStats
from fedssl.flare.constants import ROUND_STATS_PROP
from fedssl.flare.run_summary import ANALYTICS_EVENT, RunSummary
from fedssl.flare.trainer_executor import TrainerExecutor
from tests.unit.flare.fakes import FakeEngine, context


class DummyTrainer:
    """A LocalTrainer with FCL-like loss terms: round r has loss_local 1 + r and loss_remote r / 2."""

    def __init__(self):
        self.w = torch.zeros(2)
        self.rounds_done = 0

    def train_round(self, round_idx, should_stop):
        self.rounds_done += 1
        local, remote = 1.0 + round_idx, 0.5 * round_idx
        return RoundStats(loss=local + remote, steps=2, samples=8,
                          metrics={"loss_local": local, "loss_remote": remote, "lr": 0.1, "note": "text",
                                   "diverged": float("nan")},
                          curve=[{"loss": 3.0}, {"loss": 2.0}])

    def evaluate(self, split="val"):
        return {}

    def state_dict(self):
        return {"rounds_done": self.rounds_done}

    def load_state_dict(self, state):
        self.rounds_done = int(state["rounds_done"])

    def global_state(self):
        return {"w": self.w}

    def load_global(self, state, keep_local=()):
        return []


class DummyExecutor(TrainerExecutor):
    checkpoint_name = "dummy_state.pt"
    metrics_name = "dummy_metrics.jsonl"

    def build_trainer(self, fl_ctx, num_rounds):
        return DummyTrainer()

    def receive(self, dxo, fl_ctx, round_idx):
        super().receive(dxo, fl_ctx, round_idx)
        return {"val_accuracy": 0.25 * (round_idx + 1), "kept": ["not", "a", "scalar"]}  # validation of the download


class ClientEngine(FakeEngine):
    """A site's engine: components by id, and a record of the analytics events fired on it."""

    def __init__(self, root, components):
        super().__init__(root)
        self.components = components
        self.analytics = []

    def get_component(self, component_id):
        return self.components.get(component_id)

    def new_context(self):
        return context(engine=self, site="site-1")

    def fire_event(self, event_type, fl_ctx):
        if event_type == ANALYTIC_EVENT_TYPE:
            self.analytics.append(fl_ctx.get_prop(FLContextKey.EVENT_DATA))


def train_rounds(tmp_path, components, n_rounds=2):
    engine = ClientEngine(tmp_path / "site-1", components)
    (tmp_path / "site-1").mkdir()
    ctx = context(engine=engine, site="site-1")
    for comp in components.values():
        comp.handle_event(EventType.ABOUT_TO_START_RUN, ctx)
    executor, metas = DummyExecutor(), []
    for r in range(n_rounds):
        task = DXO(DataKind.WEIGHTS, data={"w": np.ones(2, np.float32)}).to_shareable()
        task.set_header(AppConstants.CURRENT_ROUND, r)
        task.set_header(AppConstants.NUM_ROUNDS, n_rounds)
        metas.append(from_shareable(executor.execute("train", task, ctx, Signal())).get_meta_props())
    return engine, metas


def test_round_scalars_reach_tensorboard_and_the_summary(tmp_path):
    engine, metas = train_rounds(tmp_path, {"log_writer": TBWriter()})
    sent = [AnalyticsData.from_dxo(from_shareable(s)) for s in engine.analytics]
    by_round = {}
    for a in sent:
        by_round.setdefault(a.step if not a.tag.startswith("step/") else "curve", {})[a.tag] = a.value
    assert set(by_round[0]) == {"loss", "steps", "num_samples", "loss_local", "loss_remote", "lr", "time_s",
                                "steps_per_s", "val_accuracy"}
    assert by_round[1]["val_accuracy"] == 0.5
    assert {k: by_round[1][k] for k in ("loss", "loss_local", "loss_remote", "lr", "steps")} == {
        "loss": 2.5, "loss_local": 2.0, "loss_remote": 0.5, "lr": 0.1, "steps": 2.0}
    # per-step curve: step = round x steps + i
    assert [(a.tag, a.step, a.value) for a in sent if a.tag.startswith("step/")] == [
        ("step/loss", 0, 3.0), ("step/loss", 1, 2.0), ("step/loss", 2, 3.0), ("step/loss", 3, 2.0)]
    # the loss terms travel outside the task result: its meta (and so the bytes exchanged) is unchanged
    assert all(set(m) == {"num_samples", MetaKey.NUM_STEPS_CURRENT_ROUND, "loss"} for m in metas)

    # the server: the same events as the federated event from site-1
    server_dir = tmp_path / "server"
    server_dir.mkdir()
    sctx = context(engine=FakeEngine(server_dir), site="server")
    receiver, summary = TBAnalyticsReceiver(events=[ANALYTICS_EVENT]), RunSummary(title="t")
    for comp in (receiver, summary):
        comp.handle_event(EventType.START_RUN, sctx)
    for data in engine.analytics:
        data.set_peer_props({ReservedKey.IDENTITY_NAME: "site-1"})
        sctx.set_prop(FLContextKey.EVENT_DATA, data, private=True, sticky=False)
        sctx.set_prop(FLContextKey.EVENT_SCOPE, EventScope.FEDERATION, private=True, sticky=False)
        for comp in (receiver, summary):
            comp.handle_event(ANALYTICS_EVENT, sctx)
    for r, loss in enumerate((1.0, 2.5)):
        agg = DXO(DataKind.WEIGHTS, data={"w": np.ones(2)}, meta={"aggregated_sites": 1})
        sctx.set_prop(AppConstants.AGGREGATION_RESULT, agg.to_shareable(), private=True, sticky=False)
        sctx.set_prop(ROUND_STATS_PROP, {"sites": ["site-1"], "losses": {"site-1": loss}}, private=True, sticky=False)
        sctx.set_prop(AppConstants.CURRENT_ROUND, r, private=True, sticky=False)
        summary.handle_event(AppEventType.AFTER_AGGREGATION, sctx)
    for comp in (receiver, summary):
        comp.handle_event(EventType.END_RUN, sctx)

    acc = EventAccumulator(str(server_dir / "tb_events" / "site-1"), size_guidance={"scalars": 0})
    acc.Reload()
    for tag, values in {"loss": [1.0, 2.5], "loss_local": [1.0, 2.0], "loss_remote": [0.0, 0.5],
                        "lr": [0.1, 0.1]}.items():
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [0, 1] and np.allclose([e.value for e in events], values), tag
    assert [e.step for e in acc.Scalars("step/loss")] == [0, 1, 2, 3]
    rounds = json.load(open(server_dir / "summary.json"))["rounds"]
    assert [r["loss_terms"] for r in rounds] == [{"loss_local": 1.0, "loss_remote": 0.0},
                                                 {"loss_local": 2.0, "loss_remote": 0.5}]


def test_without_a_log_writer_training_goes_on_and_says_so(tmp_path, caplog):
    caplog.set_level("INFO")
    engine, metas = train_rounds(tmp_path, {}, n_rounds=1)
    assert engine.analytics == [] and metas[0]["loss"] == 1.0
    assert "no 'log_writer' component in the client config" in caplog.text


def test_an_executor_must_build_its_trainer_and_a_restart_resumes_its_state(tmp_path):
    class NoTrainer(TrainerExecutor):
        """An executor whose author forgot build_trainer."""

    with pytest.raises(TypeError, match="build_trainer"):
        NoTrainer()
    engine, _ = train_rounds(tmp_path, {}, n_rounds=2)  # writes dummy_state.pt after each round
    restarted = DummyExecutor()
    task = DXO(DataKind.WEIGHTS, data={"w": np.ones(2, np.float32)}).to_shareable()
    task.set_header(AppConstants.CURRENT_ROUND, 2)
    restarted.ensure_trainer(task, context(engine=engine, site="site-1"))
    assert restarted.last_round == 1 and restarted.trainer.rounds_done == 2
