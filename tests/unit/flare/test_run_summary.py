"""RunSummary: rounds, records from server components and sites, held-back keys, setup exchanges."""

import json

import numpy as np
import pytest
from nvflare.apis.analytix import AnalyticsDataType
from nvflare.apis.dxo import DXO, DataKind
from nvflare.apis.event_type import EventType
from nvflare.apis.fl_constant import EventScope, FLContextKey, ReservedKey
from nvflare.apis.utils.analytix_utils import create_analytic_dxo
from nvflare.app_common.abstract.model import make_model_learnable
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.app_event_type import AppEventType

from fedssl.flare.communication_meter import COMM_FILE
from fedssl.eval.run_report import loss_curves
from fedssl.flare.constants import INIT_PROP, REFUSAL_PROP, ROUND_STATS_PROP, SITE_RECORD_META
from fedssl.flare.run_summary import (ANALYTICS_EVENT, SUMMARY_RECORD_EVENT, RunSummary, outside_rounds,
                                      record_in_summary)
from tests.unit.flare.fakes import FakeEngine, contribution, context

GLOBAL = {"encoder.cls_token": np.zeros(3, np.float32), "encoder.w": np.ones(2, np.float32)}


def accept(rs, ctx, site, weights, meta, round_idx):
    ctx.set_prop(AppConstants.TRAINING_RESULT, contribution(site, weights, meta, round_idx), private=True, sticky=False)
    ctx.set_prop(AppConstants.AGGREGATION_ACCEPTED, True, private=True, sticky=False)
    rs.handle_event(AppEventType.AFTER_CONTRIBUTION_ACCEPT, ctx)


def aggregate(rs, ctx, round_idx, losses):
    """What the aggregators hand AFTER_AGGREGATION listeners: the count in the aggregate, the losses in memory."""
    meta = {"aggregated_sites": len(losses)}
    ctx.set_prop(AppConstants.AGGREGATION_RESULT, DXO(DataKind.WEIGHTS, data=GLOBAL, meta=meta).to_shareable(),
                 private=True, sticky=False)
    ctx.set_prop(ROUND_STATS_PROP, {"sites": sorted(losses), "losses": dict(losses)}, private=True, sticky=False)
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
        accept(rs, ctx, site, {"encoder.w": GLOBAL["encoder.w"]}, {SITE_RECORD_META: {"tokenizer": "x", "note": site}},
               0)
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
    assert summary["rounds"][0]["keys_not_uploaded"] == ["encoder.cls_token"]
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


def stream(rs, ctx, site, tag, value, step, scope=EventScope.FEDERATION):
    """A site's TBWriter scalar as the server sees it: the federated analytics event."""
    data = create_analytic_dxo(tag=tag, value=value, data_type=AnalyticsDataType.SCALAR,
                               global_step=step).to_shareable()
    data.set_peer_props({ReservedKey.IDENTITY_NAME: site})
    ctx.set_prop(FLContextKey.EVENT_DATA, data, private=True, sticky=False)
    ctx.set_prop(FLContextKey.EVENT_SCOPE, scope, private=True, sticky=False)
    rs.handle_event(ANALYTICS_EVENT, ctx)


def test_loss_terms_are_means_over_sites_without_site_names(tmp_path):
    rs = RunSummary(title="t")
    ctx = context(engine=FakeEngine(tmp_path), site="server")
    rs.handle_event(EventType.START_RUN, ctx)
    # round 0: FCL's remote term is still 0 (empty bank); round 1: it appears
    for site, local, remote in (("site-1", 4.0, 0.0), ("site-2", 5.0, 0.0)):
        stream(rs, ctx, site, "loss", local + remote, 0)
        stream(rs, ctx, site, "loss_local", local, 0)
        stream(rs, ctx, site, "loss_remote", remote, 0)
        stream(rs, ctx, site, "lr", 0.05, 0)  # not a loss term
    aggregate(rs, ctx, 0, {"site-1": 4.0, "site-2": 5.0})
    stream(rs, ctx, "site-1", "loss_local", 9.0, 1)  # replaced by site-1's later value for round 1 (a resend)
    for site, local, remote in (("site-1", 3.0, 2.0), ("site-2", 4.0, 3.0), ("site-3", 2.0, 1.0)):
        stream(rs, ctx, site, "loss_local", local, 1)
        stream(rs, ctx, site, "loss_remote", remote, 1)
        stream(rs, ctx, site, "step/loss_local", 100.0, 7)  # per-step curve: not a round's term
    stream(rs, ctx, "site-1", "loss_local", 100.0, 1, scope=EventScope.LOCAL)  # the server's own event: ignored
    stream(rs, ctx, "site-1", "loss_remote", float("nan"), 1)  # not finite: ignored
    aggregate(rs, ctx, 1, {"site-1": 5.0, "site-2": 7.0, "site-3": 3.0})
    rs.handle_event(EventType.END_RUN, ctx)
    summary = json.load(open(tmp_path / "summary.json"))
    rounds = summary["rounds"]
    assert rounds[0]["loss_terms"] == {"loss_local": 4.5, "loss_remote": 0.0}
    assert rounds[1]["loss_terms"] == {"loss_local": 3.0, "loss_remote": 2.0}  # (3+4+2)/3, (2+3+1)/3
    assert rounds[1]["mean_loss"] == 5.0 and abs(rounds[1]["loss_std_over_sites"] - (8 / 3) ** 0.5) < 1e-12
    assert "site-" not in json.dumps(summary["rounds"])  # means and spreads only: no site names, no per-site value
    assert loss_curves(rounds) == {"loss": ([0, 1], [4.5, 5.0]), "loss_local": ([0, 1], [4.5, 3.0]),
                                   "loss_remote": ([0, 1], [0.0, 2.0])}
    assert (tmp_path / "loss.png").stat().st_size > 0


def test_no_streamed_terms_no_loss_terms(tmp_path):
    rs = RunSummary(title="t")
    ctx = context(engine=FakeEngine(tmp_path), site="server")
    rs.handle_event(EventType.START_RUN, ctx)
    aggregate(rs, ctx, 0, {"site-1": 1.0})
    rs.handle_event(EventType.END_RUN, ctx)
    rounds = json.load(open(tmp_path / "summary.json"))["rounds"]
    assert "loss_terms" not in rounds[0] and loss_curves(rounds) == {"loss": ([0], [1.0])}


def test_a_sites_streamed_terms_are_checked_and_bounded(tmp_path):
    rs = RunSummary(title="t")
    ctx = context(engine=FakeEngine(tmp_path), site="server")
    rs.handle_event(EventType.START_RUN, ctx)
    stream(rs, ctx, "site-1", "loss_local", 2.0, 0)
    stream(rs, ctx, "site-1", "loss_remote", 1e30, 0)  # beyond the magnitude bound
    stream(rs, ctx, "site-1", "loss_" + "x" * 80, 1.0, 0)  # tag too long
    stream(rs, ctx, "site-1", "loss_local", 1.0, 10 ** 9)  # round out of range
    for i in range(40):  # a flood of made-up terms: at most MAX_TERMS_PER_ROUND kept
        stream(rs, ctx, "site-2", f"loss_t{i}", 1.0, 0)
    stream(rs, ctx, "intruder", "loss_local", 1000.0, 0)  # a name the round did not aggregate
    aggregate(rs, ctx, 0, {"site-1": 3.0, "site-2": 1.0})
    rs.handle_event(EventType.END_RUN, ctx)
    terms = json.load(open(tmp_path / "summary.json"))["rounds"][0]["loss_terms"]
    assert terms["loss_local"] == 2.0 and "loss_remote" not in terms
    assert len(terms) == 16 and not any(len(t) > 64 for t in terms)


def test_refused_contributions_are_listed_per_round(tmp_path):
    """The aggregator leaves each refusal's reason in the context; the round's summary lists site and reason."""
    rs = RunSummary(title="t")
    ctx = context(engine=FakeEngine(tmp_path), site="server")
    rs.handle_event(EventType.START_RUN, ctx)
    ctx.set_prop(REFUSAL_PROP, {"site": "site-3", "reason": "site-3 sent non-finite values"}, private=True,
                 sticky=False)
    ctx.set_prop(AppConstants.TRAINING_RESULT, contribution("site-3", GLOBAL), private=True, sticky=False)
    ctx.set_prop(AppConstants.AGGREGATION_ACCEPTED, False, private=True, sticky=False)
    rs.handle_event(AppEventType.AFTER_CONTRIBUTION_ACCEPT, ctx)
    aggregate(rs, ctx, 0, {"site-1": 1.0, "site-2": 2.0})
    aggregate(rs, ctx, 1, {"site-1": 1.0, "site-2": 2.0})
    rs.handle_event(EventType.END_RUN, ctx)
    rounds = json.load(open(tmp_path / "summary.json"))["rounds"]
    assert rounds[0]["refused_contributions"] == [{"site": "site-3", "reason": "site-3 sent non-finite values"}]
    assert "refused_contributions" not in rounds[1]


def test_a_sites_summary_record_is_bounded_and_kept_only_when_its_contribution_is(tmp_path):
    rs = RunSummary(title="t")
    ctx = context(engine=FakeEngine(tmp_path), site="server")
    rs.handle_event(EventType.START_RUN, ctx)
    accept(rs, ctx, "site-1", GLOBAL, {SITE_RECORD_META: {"tokenizer": "x", "n": np.int64(3)}}, 0)
    accept(rs, ctx, "site-2", GLOBAL, {SITE_RECORD_META: {"blob": "y" * 100_000}}, 0)  # too large: ignored
    ctx.set_prop(AppConstants.TRAINING_RESULT, contribution("site-3", GLOBAL, {SITE_RECORD_META: {"a": 1}}, 0),
                 private=True, sticky=False)
    ctx.set_prop(AppConstants.AGGREGATION_ACCEPTED, False, private=True, sticky=False)  # a refused contribution
    rs.handle_event(AppEventType.AFTER_CONTRIBUTION_ACCEPT, ctx)
    aggregate(rs, ctx, 0, {"site-1": 1.0})
    rs.handle_event(EventType.END_RUN, ctx)
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["site_records"] == {"site-1": {"tokenizer": "x"}}  # a number is kept only as a round mean
    assert summary["rounds"][0]["site_record_means"] == {"n": 3.0}


def fcl_record(steps, filled, k=4096):
    return {SITE_RECORD_META: {"volumes": 8 * steps, "steps_per_round": steps, "bank_filled": filled,
                               "bank_fill": filled / k, "bank_size": k, "feature_std": steps / 100}}


def test_steps_and_bank_fill_per_round_are_means_over_the_aggregated_sites(tmp_path):
    """Issue 13 item 7: FCL sites report steps and filled bank slots; each round's summary holds their means over
    the sites the round aggregated (a refused site's record does not count), no site name."""
    rs = RunSummary(title="t")
    ctx = context(engine=FakeEngine(tmp_path), site="server",
                  props={AppConstants.GLOBAL_MODEL: make_model_learnable(GLOBAL, {})})
    rs.handle_event(EventType.START_RUN, ctx)
    accept(rs, ctx, "site-1", GLOBAL, fcl_record(12, 384), 0)
    accept(rs, ctx, "site-2", GLOBAL, fcl_record(10, 320), 0)
    aggregate(rs, ctx, 0, {"site-1": 1.0, "site-2": 1.0})
    accept(rs, ctx, "site-1", GLOBAL, fcl_record(12, 768), 1)
    ctx.set_prop(AppConstants.TRAINING_RESULT, contribution("site-2", GLOBAL, fcl_record(99, 4096), 1),
                 private=True, sticky=False)
    ctx.set_prop(AppConstants.AGGREGATION_ACCEPTED, False, private=True, sticky=False)
    rs.handle_event(AppEventType.AFTER_CONTRIBUTION_ACCEPT, ctx)
    aggregate(rs, ctx, 1, {"site-1": 1.0})
    rs.handle_event(EventType.END_RUN, ctx)
    summary = json.load(open(tmp_path / "summary.json"))
    r0, r1 = (r["site_record_means"] for r in summary["rounds"])
    assert r0 == {"bank_fill": 352 / 4096, "bank_filled": 352.0, "bank_size": 4096.0, "steps_per_round": 11.0,
                  "volumes": 88.0, "feature_std": pytest.approx(0.11)}  # issue 14: the sites' feature spread
    assert (r1["steps_per_round"], r1["bank_filled"], r1["feature_std"]) == (12.0, 768.0, 0.12)
    assert "site-" not in json.dumps(summary)  # the counts of a site are never persisted under its name
    assert "site_records" not in summary and "bank_size" not in summary


def test_a_round_without_any_uploaded_weight_says_so(tmp_path):
    """Issue 13 item 6: Local CL sites upload no weight; the summary says the model was not uploaded (instead of
    listing every key), so a Local CL run's global model is not mistaken for a trained one."""
    rs = RunSummary(title="t")
    ctx = context(engine=FakeEngine(tmp_path), site="server",
                  props={AppConstants.GLOBAL_MODEL: make_model_learnable(GLOBAL, {})})
    rs.handle_event(EventType.START_RUN, ctx)
    for site in ("site-1", "site-2"):
        accept(rs, ctx, site, {}, {"num_samples": 16}, 0)
    aggregate(rs, ctx, 0, {"site-1": 1.0, "site-2": 1.0})
    accept(rs, ctx, "site-1", {}, {}, 1)
    accept(rs, ctx, "site-2", {"encoder.w": GLOBAL["encoder.w"]}, {}, 1)  # one site uploads part of the model
    aggregate(rs, ctx, 1, {"site-1": 1.0, "site-2": 1.0})
    rs.handle_event(EventType.END_RUN, ctx)
    r0, r1 = json.load(open(tmp_path / "summary.json"))["rounds"]
    assert r0["model_uploaded"] is False and "keys_not_uploaded" not in r0
    assert "model_uploaded" not in r1 and r1["keys_not_uploaded"] == ["encoder.cls_token", "encoder.w"]  # site-1's


def test_the_persistors_init_record_lands_in_the_summary(tmp_path):
    """INIT_PROP (set by the server's persistor, here by hand) becomes summary["init"]; a site record cannot fake it."""
    rs = RunSummary(title="t")
    ctx = context(engine=FakeEngine(tmp_path), site="server",
                  props={AppConstants.GLOBAL_MODEL: make_model_learnable(GLOBAL, {})})
    rs.handle_event(EventType.START_RUN, ctx)
    init = {"init": "imagenet", "path": "/models/densenet121.pth", "sha256": "ab" * 32}
    ctx.set_prop(INIT_PROP, init, private=True, sticky=True)
    for site in ("site-1", "site-2"):
        accept(rs, ctx, site, GLOBAL, {SITE_RECORD_META: {"init": "random"}}, 0)
    aggregate(rs, ctx, 0, {"site-1": 1.0, "site-2": 1.0})
    rs.handle_event(EventType.END_RUN, ctx)
    assert json.load(open(tmp_path / "summary.json"))["init"] == init
    plain = RunSummary(title="t")  # no persistor record: no init key
    (tmp_path / "plain").mkdir()
    ctx2 = context(engine=FakeEngine(tmp_path / "plain"), site="server")
    plain.handle_event(EventType.START_RUN, ctx2)
    aggregate(plain, ctx2, 0, {"site-1": 1.0})
    plain.handle_event(EventType.END_RUN, ctx2)
    assert "init" not in json.load(open(tmp_path / "plain" / "summary.json"))
