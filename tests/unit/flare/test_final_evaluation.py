"""FinalEvaluation: which model it tests (best on validation / last), what it collects and writes."""

import json
import os

import numpy as np
import pytest
from nvflare.apis.client import Client
from nvflare.apis.controller_spec import ClientTask
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.shareable import make_reply
from nvflare.apis.signal import Signal
from nvflare.app_common.abstract.model import make_model_learnable
from nvflare.app_common.abstract.model_persistor import ModelPersistor
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.app_event_type import AppEventType

from fedssl.flare.final_evaluation import FinalEvaluation, markdown_table, site_means
from tests.unit.flare.fakes import FakeEngine, context

BEST = {"w": np.array([1.0])}
LAST = {"w": np.array([2.0])}


class FakePersistor(ModelPersistor):
    best_global_model_file_name = "best_FL_global_model.pt"
    global_model_file_name = "FL_global_model.pt"

    def __init__(self, has_best):
        super().__init__()
        self.has_best = has_best

    def load_model(self, fl_ctx):
        return make_model_learnable(LAST, {})

    def save_model(self, model, fl_ctx):
        pass

    def get_model_inventory(self, fl_ctx):
        inv = {self.global_model_file_name: "last"}
        if self.has_best:
            inv[self.best_global_model_file_name] = "best"
        return inv

    def get_model(self, model_file, fl_ctx):
        return make_model_learnable(BEST if model_file == self.best_global_model_file_name else LAST, {})


class Engine(FakeEngine):
    def __init__(self, root, persistor):
        super().__init__(root, n_clients=3)
        self.persistor = persistor

    def get_component(self, cid):
        return self.persistor if cid == "persistor" else None


def run_controller(tmp_path, has_best, replies, model="best", selection=None):
    ctrl = FinalEvaluation(model=model, table_metrics=["accuracy", "auc"])
    engine = Engine(tmp_path, FakePersistor(has_best))
    ctx = context(engine=engine, props={AppConstants.GLOBAL_MODEL: make_model_learnable(LAST, {})})
    ctx.get_job_id = lambda: "job"
    ctrl._engine = engine
    ctrl.start_controller(ctx)
    if selection is not None:
        ctx.set_prop(AppConstants.METRICS_SELECTION_INFO, selection, private=True, sticky=False)
        ctrl.handle_event(AppEventType.GLOBAL_BEST_MODEL_AVAILABLE, ctx)
    sent = {}

    def fake_broadcast(task, fl_ctx, min_responses, abort_signal, **kw):
        sent["weights"] = from_shareable(task.data).data
        sent["meta"] = from_shareable(task.data).get_meta_props()
        sent["min_responses"] = min_responses
        for name, reply in replies.items():
            ct = ClientTask(Client(name, "t"), task)
            ct.result = reply
            task.client_tasks.append(ct)

    ctrl.broadcast_and_wait = fake_broadcast
    ctrl.fire_event = lambda *a, **k: None  # record_in_summary's event: nothing listens here
    ctrl.control_flow(Signal(), ctx)
    with open(tmp_path / "test_metrics.json") as f:
        return sent, json.load(f)


def metrics(acc, auc):
    return DXO(DataKind.METRICS, data={"accuracy": acc, "auc": auc, "n": 10,
                                       "per_class": {"a": {"recall": 1.0}}}).to_shareable()


def test_tests_the_validation_selected_model_and_writes_the_report(tmp_path):
    selection = {"best_round": 3, "key_metric": {"name": "val_accuracy"}, "best_metrics": {"val_accuracy": 0.8}}
    replies = {"site-2": metrics(0.5, 0.6), "site-1": metrics(0.7, None),
               "site-3": make_reply(ReturnCode.EXECUTION_EXCEPTION)}
    sent, report = run_controller(tmp_path, True, replies, selection=selection)
    assert sent["weights"]["w"].tolist() == [1.0] and sent["min_responses"] == 3  # 0 = every connected site
    assert report["model"] == "best" and "round 3" in report["model_source"] and "0.8000" in report["model_source"]
    assert report["selection"]["best_round"] == 3 and sent["meta"]["model_source"] == report["model_source"]
    assert list(report["sites"]) == ["site-1", "site-2"] and report["failed_sites"] == ["site-3"]
    assert report["mean"] == pytest.approx({"accuracy": 0.6, "auc": 0.6, "n": 10.0})  # None skipped
    md = open(tmp_path / "test_metrics.md").read()
    assert "| site-1 | 0.7000 | n/a |" in md and "| **mean** | 0.6000 | 0.6000 |" in md and "site-3" in md
    assert os.path.getsize(tmp_path / "test_metrics.png") > 0


def test_falls_back_to_the_last_model_and_says_so(tmp_path):
    sent, report = run_controller(tmp_path, False, {"site-1": metrics(0.5, 0.5)})
    assert sent["weights"]["w"].tolist() == [2.0]
    assert report["model"] == "last" and "not selected on validation" in report["model_source"]
    sent, report = run_controller(tmp_path, True, {"site-1": metrics(0.5, 0.5)}, model="last")
    assert sent["weights"]["w"].tolist() == [2.0] and report["model"] == "last" and report["selection"] is None


@pytest.mark.parametrize("kw, needle", [({"model": "first"}, "model='first'"),
                                        ({"min_responses": -1}, "min_responses=-1"),
                                        ({"table_metrics": "acc"}, "table_metrics='acc'")])
def test_rejects_bad_args(kw, needle):
    with pytest.raises(ValueError, match=needle):
        FinalEvaluation(**kw)


def test_site_means_and_table_helpers():
    sites = {"a": {"x": 1.0, "y": None, "flag": True}, "b": {"x": 3.0, "y": 2.0}}
    assert site_means(sites) == {"x": 2.0, "y": 2.0}
    report = {"title": "T", "model_source": "m", "sites": sites, "mean": site_means(sites), "failed_sites": []}
    assert "| a | 1.0000 | n/a |" in markdown_table(report, ["x", "y"])


@pytest.mark.parametrize("bad", [
    {"accuracy": "x" * 10_000},  # a huge string
    {"accuracy": float("inf")},
    {"accuracy": 1e300},
    {"accuracy": object()},
    {"per_class": {str(i): float(i) for i in range(5000)}},  # too many values
    {1: 0.5},  # a key that is not a string
    {"a": {"b": {"c": {"d": {"e": {"f": {"g": 1.0}}}}}}},  # too deep
])
def test_a_sites_forged_report_is_left_out_and_the_others_reported(bad, tmp_path):
    forged = DXO(DataKind.METRICS, data=bad).to_shareable() if 1 not in bad else None
    if forged is None:  # FLARE's DXO refuses nothing: build the shareable by hand
        forged = DXO(DataKind.METRICS, data={"x": 1}).to_shareable()
        forged["DXO"]["data"] = bad
    _, report = run_controller(tmp_path, False, {"site-1": metrics(0.5, 0.5), "site-3": forged})
    assert list(report["sites"]) == ["site-1"] and report["failed_sites"] == ["site-3"]
    assert report["mean"]["accuracy"] == 0.5


def test_nan_metrics_become_null_and_numpy_scalars_plain_numbers(tmp_path):
    reply = DXO(DataKind.METRICS, data={"accuracy": np.float32(0.5), "auc": float("nan"),
                                        "n": np.int64(4)}).to_shareable()
    _, report = run_controller(tmp_path, False, {"site-1": reply})
    assert report["sites"]["site-1"] == {"accuracy": 0.5, "auc": None, "n": 4}


def test_the_surgical_test_reply_passes_whole():
    """The multi-label test reply (per-class AUROC with bootstrap CIs, internal and external) is 5 levels deep."""
    from fedssl.core.untrusted import bounded_json
    from fedssl.eval.surgical_report import auroc_table

    rng = np.random.default_rng(0)
    probs, targets = rng.random((40, 14)), (rng.random((40, 14)) > 0.5).astype(float)
    table = auroc_table(probs, targets, [f"c{i}" for i in range(14)], n_bootstrap=20, seed=0)
    reply = {"model": "global model", "n_test": 40, "test": table, "mean_auroc": table["mean_auroc"],
             "external": {**table, "n_images": 40, "not_annotated": []}, "external_mean_auroc": table["mean_auroc"]}
    assert bounded_json(reply, "its test metrics", "site-1") == json.loads(json.dumps(reply))
