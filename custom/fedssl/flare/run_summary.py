"""Server component that leaves a machine-readable summary and plots in the job's run folder.

Listens to FLARE events: after each aggregation it records the round's mean training loss over the
aggregated sites and its spread (standard deviation over sites), from the aggregator's in-memory round
statistics (``ROUND_STATS_PROP``); no per-site value or site name is written; at the end of the run it reads the
communication records of ``CommunicationMeter`` and writes ``summary.json``, ``loss.png`` and ``bytes_per_round.png``.

Other components can add records to the summary (e.g. which tokenizer a BEiT run used):

- a server component calls ``record_in_summary(component, fl_ctx, {"tokenizer": "..."})``: each key becomes a
  top-level key of ``summary.json``;
- a site puts a dict under the result meta key ``summary_record`` (e.g. ``{"tokenizer": "local: /path"}``):
  its descriptions (non-numeric values) land under ``site_records`` per site, and a key on which every site
  agrees (and that no server record set) is also copied to the top level.

Per round, the numeric values of the aggregated sites' summary records are averaged over those sites under
``site_record_means`` (e.g. FCL's ``steps_per_round``, ``bank_filled`` and ``bank_fill``, the fraction of the
bank holding real features): bounded numbers, no site name.  Numbers are kept only as these means, never per
site: a site's volume count or steps per round describe its data and would be persisted under its name.

The initial weights: when the server's persistor set the FL-context property ``INIT_PROP`` (ImageNet, random or a
checkpoint, with path and digest), ``summary.json`` holds it under ``init``.

A round in which the aggregator refused contributions lists them under ``refused_contributions`` (site and
reason, at most 100 per round): the audit trail of a misbehaving site, without any of its data.

A round in which accepted contributions lack keys of the global model (a knowledge split,
PartialModelExclusion) lists them, as received by the server, under ``keys_not_uploaded`` (the keys that
no aggregated site uploaded); a round in which no aggregated site uploaded any weight (Local CL) says
``"model_uploaded": false`` instead (the global model did not change in that round).

Exchanges that belong to no round (e.g. the federated k-means tasks before round 0) are summed per task
and direction under ``communication_outside_rounds``.

Loss terms (e.g. FCL's ``loss_local`` and ``loss_remote``): the sites stream every per-round scalar through
FLARE's analytics path (client ``TBWriter`` -> ``ConvertToFedEvent`` -> the federated event
``fed.analytix_log_stats``, which the server's ``TBAnalyticsReceiver`` writes to TensorBoard).  RunSummary
listens to the same event, keeps each site's latest value of every ``loss_*`` tag per round in memory and
writes only the means over the sites that reported, per round, under ``loss_terms`` of that round; ``loss.png``
draws them beside the total.  The terms travel outside the task result, so the exchanged bytes are unchanged;
a job without the client ``TBWriter`` has no ``loss_terms``.
"""

from __future__ import annotations

import os
import threading
import time

from nvflare.apis.analytix import ANALYTIC_EVENT_TYPE, AnalyticsData
from nvflare.apis.dxo import DataKind, from_shareable
from nvflare.apis.event_type import EventType
from nvflare.apis.fl_constant import EventScope, FLContextKey, ReservedKey
from nvflare.apis.fl_component import FLComponent
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.abstract.model import ModelLearnableKey
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.app_event_type import AppEventType

from fedssl.core.checks import require
from fedssl.core.untrusted import ContributionError, bounded_json
from fedssl.eval.run_report import MAX_TERMS_PER_ROUND, loss_term_means, loss_term_ok, read_jsonl, write_run_report
from fedssl.flare.communication_meter import COMM_FILE
from fedssl.flare.run_check import announce_pace, announce_start
from fedssl.flare.simulator_site_names import fix_in_simulator
from fedssl.flare.constants import AGGREGATED_SITES, INIT_PROP, REFUSAL_PROP, ROUND_STATS_PROP, SITE_RECORD_META

#: event a server component fires (with the record under the same fl_ctx prop) to add keys to summary.json
SUMMARY_RECORD_EVENT = "fedssl.summary_record"
#: the federated analytics event the sites' TBWriter scalars arrive as (ConvertToFedEvent's default "fed." prefix)
ANALYTICS_EVENT = f"fed.{ANALYTIC_EVENT_TYPE}"
#: per-round analytics tags with this prefix are loss terms (averaged over sites into the round's ``loss_terms``)
LOSS_TERM_PREFIX = "loss_"
#: summary keys this component writes itself (a record cannot overwrite them)
_OWN_KEYS = ("title", "rounds", "communication_per_round", "bytes_per_site_per_round", "wall_time_s",
             "site_records", "communication_outside_rounds", "init")


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def numeric_means(records: list[dict]) -> dict[str, float]:
    """Per key, the mean over ``records`` of its real-number values (bools, strings and nested values skipped)."""
    values: dict[str, list[float]] = {}
    for rec in records:
        for k, v in rec.items():
            if _is_number(v):
                values.setdefault(k, []).append(float(v))
    return {k: sum(v) / len(v) for k, v in sorted(values.items())}


def record_in_summary(component: FLComponent, fl_ctx: FLContext, record: dict) -> None:
    """Add ``record`` (JSON values) to the run summary written by RunSummary at the end of the run."""
    fl_ctx.set_prop(SUMMARY_RECORD_EVENT, dict(record), private=True, sticky=False)
    component.fire_event(SUMMARY_RECORD_EVENT, fl_ctx)


def outside_rounds(comm_records: list[dict]) -> dict:
    """Bytes of the exchanges without a round (setup tasks): task -> direction -> {total, exchanges}."""
    out: dict = {}
    for r in comm_records:
        if r.get("round") is not None:
            continue
        entry = out.setdefault(str(r.get("task")), {}).setdefault(r["direction"], {"total": 0, "exchanges": 0})
        entry["total"] += int(r.get("total", 0))
        entry["exchanges"] += 1
    return out


class RunSummary(FLComponent):
    def __init__(self, title: str = "federated run"):
        super().__init__()
        require(isinstance(title, str) and bool(title), type(self).__name__, "title", title, "use a non-empty string")
        self.title = title
        self._rounds: list[dict] = []
        self._records: dict = {}
        self._site_records: dict[str, dict] = {}
        self._not_uploaded: dict[str, list] = {}  # this round: site -> global keys its contribution lacked
        self._uploaded: dict[str, bool] = {}  # this round: accepted site -> whether it uploaded any global key
        self._round_records: dict[str, dict] = {}  # this round: site -> its accepted summary record (memory only)
        self._init: dict | None = None  # the persistor's INIT_PROP record (bounded copy)
        self._contributors: dict[int, list] = {}  # round -> aggregated sites (memory only, never written)
        self._refused: list[dict] = []  # this round: contributions the aggregator refused (site, reason)
        self._terms: dict[int, dict[str, dict[str, float]]] = {}  # round -> term -> site -> value (memory only)
        self._terms_lock = threading.Lock()  # analytics events arrive on FLARE's fed-event thread
        self._t0 = time.time()
        # in FLARE's simulator (every job has a RunSummary), before the simulator builds its site runner: FLARE 2.9's
        # site-name race fixed for a plain `nvflare simulator` too (fedssl.flare.simulator_site_names)
        self._simulator_fixed = fix_in_simulator()

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        if event_type == EventType.START_RUN:
            self._rounds, self._records, self._site_records, self._not_uploaded = [], {}, {}, {}
            self._contributors, self._refused, self._uploaded, self._round_records = {}, [], {}, {}
            self._init = None
            with self._terms_lock:
                self._terms = {}
            self._t0 = time.time()
            if self._simulator_fixed:
                self.log_info(fl_ctx, "FLARE simulator: each site thread sends its own site name (FLARE 2.9's "
                                      "site-name race fixed by fedssl.flare.simulator_site_names)")
            announce_start(self, fl_ctx)
        elif event_type == ANALYTICS_EVENT:
            self._take_loss_term(fl_ctx)
        elif event_type == SUMMARY_RECORD_EVENT:
            record = fl_ctx.get_prop(SUMMARY_RECORD_EVENT) or {}
            clash = sorted(set(record) & set(_OWN_KEYS))
            if clash:
                self.log_error(fl_ctx, f"summary record keys {clash} are RunSummary's own; record ignored")
            else:
                self._records.update(record)
        elif event_type == AppEventType.AFTER_CONTRIBUTION_ACCEPT:
            self._take_site_record(fl_ctx)
        elif event_type == AppEventType.AFTER_AGGREGATION:
            self._take_round(fl_ctx)
            self._take_init(fl_ctx)
            if len(self._rounds) == 1:
                announce_pace(self, fl_ctx, self._rounds[0]["time_s"])
        elif event_type == EventType.END_RUN:
            self._take_init(fl_ctx)
            run_dir = fl_ctx.get_engine().get_workspace().get_run_dir(fl_ctx.get_job_id())
            comm = read_jsonl(os.path.join(run_dir, COMM_FILE))
            self._attach_loss_terms()
            summary = write_run_report(run_dir, title=self.title, rounds=self._rounds, comm_records=comm,
                                       extra=self._extra(comm))
            b = summary["bytes_per_site_per_round"]
            self.log_info(fl_ctx, f"summary written to {run_dir}/summary.json; bytes per site per round: "
                                  f"up {b['upload']:.0f}, down {b['download']:.0f}")

    def _take_round(self, fl_ctx: FLContext) -> None:
        """The round's mean loss and spread over the aggregated sites (the aggregator checked every loss)."""
        result = fl_ctx.get_prop(AppConstants.AGGREGATION_RESULT)
        try:
            n_sites = from_shareable(result).get_meta_prop(AGGREGATED_SITES)
        except (ValueError, TypeError, AttributeError):
            n_sites = None
        stats = fl_ctx.get_prop(ROUND_STATS_PROP) or {}
        losses = list((stats.get("losses") or {}).values())
        rnd = fl_ctx.get_prop(AppConstants.CURRENT_ROUND)
        self._contributors[rnd] = list(stats.get("sites") or [])
        mean = sum(losses) / len(losses) if losses else None
        self._rounds.append({
            "round": rnd,
            "time_s": round(time.time() - self._t0, 2),
            "aggregated_sites": n_sites,
            "mean_loss": mean,
            "loss_std_over_sites": (sum((x - mean) ** 2 for x in losses) / len(losses)) ** 0.5 if losses else None,
        })
        if self._refused:  # who was left out and why: the audit trail of a round (no data of the site)
            self._rounds[-1]["refused_contributions"] = self._refused
            self._refused = []
        contributors = self._contributors[rnd]
        records = [self._round_records[s] for s in contributors if s in self._round_records]
        if records:  # e.g. FCL's steps per round and bank fill, averaged over the aggregated sites
            self._rounds[-1]["site_record_means"] = numeric_means(records)
        if contributors and all(self._uploaded.get(s) is False for s in contributors):
            self._rounds[-1]["model_uploaded"] = False  # Local CL: no weight reached the server
        elif self._not_uploaded:  # keys no aggregated site uploaded (a knowledge split); no site names
            lacking = sorted({k for s, v in self._not_uploaded.items() if s in contributors for k in v})
            if lacking:
                self._rounds[-1]["keys_not_uploaded"] = lacking
        self._not_uploaded, self._uploaded, self._round_records = {}, {}, {}
        if losses:
            self.log_info(fl_ctx, f"round {rnd}: mean loss {mean:.4f} over {len(losses)} sites")

    def _take_site_record(self, fl_ctx: FLContext) -> None:
        refusal = fl_ctx.get_prop(REFUSAL_PROP)
        if not fl_ctx.get_prop(AppConstants.AGGREGATION_ACCEPTED) and isinstance(refusal,
                                                                                 dict) and len(self._refused) < 100:
            self._refused.append({"site": str(refusal.get("site"))[:64], "reason": str(refusal.get("reason"))[:300]})
        result = fl_ctx.get_prop(AppConstants.TRAINING_RESULT)
        try:
            dxo = from_shareable(result)
        except (ValueError, TypeError, AttributeError):
            return
        site = result.get_peer_prop(ReservedKey.IDENTITY_NAME, "?")
        record = dxo.get_meta_prop(SITE_RECORD_META)
        if fl_ctx.get_prop(AppConstants.AGGREGATION_ACCEPTED) and isinstance(record, dict) and record:
            try:  # a site's record is small JSON, kept only with an accepted contribution
                kept = bounded_json(record, "its summary record", site, max_items=64)
                described = {k: v for k, v in kept.items() if not _is_number(v)}  # numbers: only round means
                if described:
                    self._site_records.setdefault(site, {}).update(described)
                self._round_records[site] = kept
            except ContributionError as e:
                self.log_warning(fl_ctx, f"{e}; record ignored")
        global_model = fl_ctx.get_prop(AppConstants.GLOBAL_MODEL)
        if fl_ctx.get_prop(AppConstants.AGGREGATION_ACCEPTED) and global_model and dxo.data_kind == DataKind.WEIGHTS:
            keys = set(global_model[ModelLearnableKey.WEIGHTS])
            lacking = sorted(keys - set(dxo.data or {}))
            if lacking:
                self._not_uploaded[site] = lacking
            self._uploaded[site] = len(lacking) < len(keys)

    def _take_init(self, fl_ctx: FLContext) -> None:
        """The persistor's record of the initial weights (``INIT_PROP``, a sticky property) as bounded JSON; read
        after each aggregation and at the end of the run; absent from the summary if no persistor set it."""
        init = fl_ctx.get_prop(INIT_PROP)
        if not isinstance(init, dict) or not init:
            return
        try:
            self._init = bounded_json(init, "the initial-weights record", "the server's persistor", max_items=16,
                                      max_str=1024)
        except ContributionError as e:
            self.log_warning(fl_ctx, f"{e}; init not written to the summary")

    def _take_loss_term(self, fl_ctx: FLContext) -> None:
        """A site's per-round ``loss_*`` scalar from the federated analytics event (step = round)."""
        if fl_ctx.get_prop(FLContextKey.EVENT_SCOPE) != EventScope.FEDERATION:
            return
        data = fl_ctx.get_prop(FLContextKey.EVENT_DATA)
        try:
            record = AnalyticsData.from_dxo(from_shareable(data))
        except (ValueError, TypeError, KeyError, AttributeError):
            return
        if record is None or not loss_term_ok(record.tag, record.step, record.value, LOSS_TERM_PREFIX):
            return
        site = data.get_peer_prop(ReservedKey.IDENTITY_NAME, None)
        if not isinstance(site, str) or not site:
            return
        with self._terms_lock:  # a site's repeated value for a round replaces its earlier one
            per_round = self._terms.setdefault(record.step, {})
            if record.tag in per_round or len(per_round) < MAX_TERMS_PER_ROUND:  # bounded, whatever a site sends
                per_round.setdefault(record.tag, {})[site] = float(record.value)

    def _attach_loss_terms(self) -> None:
        """Each round's ``loss_terms``: the mean over the reporting sites of every loss term (no site names)."""
        with self._terms_lock:  # only the sites the round aggregated count
            means = loss_term_means(self._terms, self._contributors)
        for r in self._rounds:
            if r.get("round") in means:
                r["loss_terms"] = means[r["round"]]

    def _extra(self, comm_records: list[dict]) -> dict:
        extra: dict = {"wall_time_s": round(time.time() - self._t0, 2)}
        if self._site_records:
            extra["site_records"] = dict(sorted(self._site_records.items()))
            keys = {k for rec in self._site_records.values() for k in rec}
            for k in sorted(keys - set(self._records) - set(_OWN_KEYS)):
                values = [rec.get(k) for rec in self._site_records.values()]
                if all(v == values[0] for v in values):
                    extra[k] = values[0]
        setup = outside_rounds(comm_records)
        if setup:
            extra["communication_outside_rounds"] = setup
        extra.update(self._records)
        if self._init is not None:
            extra["init"] = self._init
        return extra
