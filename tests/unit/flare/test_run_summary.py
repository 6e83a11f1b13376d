"""RunSummary: rounds, records from server components and sites, held-back keys, setup exchanges."""

import json

import numpy as np
from nvflare.apis.dxo import DXO, DataKind
from nvflare.apis.event_type import EventType
from nvflare.app_common.abstract.model import make_model_learnable
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.app_event_type import AppEventType

from fedssl.flare.communication_meter import COMM_FILE
from fedssl.flare.run_summary import SITE_RECORD_META, SUMMARY_RECORD_EVENT, RunSummary, outside_rounds, record_in_summary
from tests.unit.flare.fakes import FakeEngine, contribution, context

GLOBAL = {"encoder.cls_token": np.zeros(3, np.float32), "encoder.w": np.ones(2, np.float32)}


def accept(rs, ctx, site, weights, meta, round_idx):
    ctx.set_prop(AppConstants.TRAINING_RESULT, contribution(site, weights, meta, round_idx), private=True, sticky=False)
    ctx.set_prop(AppConstants.AGGREGATION_ACCEPTED, True, private=True, sticky=False)
    rs.handle_event(AppEventType.AFTER_CONTRIBUTION_ACCEPT, ctx)


def aggregate(rs, ctx, round_idx, losses):
    meta = {"site_losses": losses, "aggregated_sites": len(losses)}
    ctx.set_prop(AppConstants.AGGREGATION_RESULT, DXO(DataKind.WEIGHTS, data=GLOBAL, meta=meta).to_shareable(),
                 private=True, sticky=False)
    ctx.set_prop(AppConstants.CURRENT_ROUND, round_idx, private=True, sticky=False)
    rs.handle_event(AppEventType.AFTER_AGGREGATION, ctx)


def test_summary_carries_records_held_back_keys_and_setup_bytes(tmp_path):
    rs = RunSummary(title="t")
    ctx = context(engine=FakeEngine(tmp_path), site="server",
                  props={AppConstants.GLOBAL_MODEL: make_model_learnable(GLOBAL, {})})
    rs.handle_event(EventType.START_RUN, ctx)
    # a server component (e.g. FederatedKMeans) records which tokenizer was used
    captured = []
    rs.fire_event = lambda event_type, fl_ctx: (captured.append(event_type), rs.handle_event(event_type, fl_ctx))
    record_in_summary(rs, ctx, {"tokenizer": "federated k-means K=8, iters=2", "tokenizer_details": {"K": 8}})
    assert captured == [SUMMARY_RECORD_EVENT]
    # round 0: both sites hold back the class token; round 1 (last): full uploads
    for site in ("site-1", "site-2"):
        accept(rs, ctx, site, {"encoder.w": GLOBAL["encoder.w"]}, {SITE_RECORD_META: {"tokenizer": "x", "note": site}}, 0)
    aggregate(rs, ctx, 0, {"site-1": 1.0, "site-2": 2.0})
    for site in ("site-1", "site-2"):
        accept(rs, ctx, site, GLOBAL, {SITE_RECORD_META: {"device": "cpu"}}, 1)
    aggregate(rs, ctx, 1, {"site-1": 0.5, "site-2": 0.7})
    with open(tmp_path / COMM_FILE, "w") as f:
        for rec in ({"round": None, "site": "site-1", "direction": "download", "task": "kmeans_step", "total": 100},
                    {"round": None, "site": "site-2", "direction": "download", "task": "kmeans_step", "total": 100},
                    {"round": None, "site": "site-1", "direction": "upload", "task": "kmeans_step", "total": 40},
                    {"round": 0, "site": "site-1", "direction": "upload", "task": "train", "total": 7}):
            f.write(json.dumps(rec) + "\n")
    rs.handle_event(EventType.END_RUN, ctx)
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["tokenizer"] == "federated k-means K=8, iters=2"  # the server's record wins over the sites'
    assert summary["tokenizer_details"] == {"K": 8}
    assert summary["device"] == "cpu"  # every site agrees: promoted to the top level
    assert "note" not in summary and summary["site_records"]["site-2"]["note"] == "site-2"
    assert summary["rounds"][0]["keys_not_uploaded"] == {"site-1": ["encoder.cls_token"], "site-2": ["encoder.cls_token"]}
    assert "keys_not_uploaded" not in summary["rounds"][1]
    assert summary["communication_outside_rounds"] == {"kmeans_step": {"download": {"total": 200, "exchanges": 2},
                                                                       "upload": {"total": 40, "exchanges": 1}}}
    assert summary["bytes_per_site_per_round"]["upload"] == 7  # setup exchanges stay out of the per-round figure


def test_a_record_cannot_overwrite_the_summary_itself(tmp_path, caplog):
    rs = RunSummary()
    ctx = context(engine=FakeEngine(tmp_path), site="server")
    rs.handle_event(EventType.START_RUN, ctx)
    ctx.set_prop(SUMMARY_RECORD_EVENT, {"rounds": []}, private=True, sticky=False)
    rs.handle_event(SUMMARY_RECORD_EVENT, ctx)
    rs.handle_event(EventType.END_RUN, ctx)
    assert "are RunSummary's own; record ignored" in caplog.text


def test_outside_rounds_ignores_round_records():
    assert outside_rounds([{"round": 3, "direction": "upload", "task": "train", "total": 5}]) == {}
