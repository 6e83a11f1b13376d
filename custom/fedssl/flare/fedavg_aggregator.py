"""Server aggregator: FedAvg of whole state dicts with explicit weighting, rejecting bad contributions.

Every site is treated as possibly faulty or malicious.  The *server* decides what a round contains: the key
set comes from the global model and the job's ``exclude_patterns`` / ``optional_prefixes`` (with the round
number, and the round plan a workflow such as FCLOptController publishes), never from the first contribution
to arrive.  Each contribution must come from a registered client of the run, for the current round, once; its
tensors are cast to the global model's dtypes before any check (``fedssl.core.state_dict.check_contribution``),
must be finite and within ``max_update_ratio`` of the global model; its weight (``num_samples`` / steps) must be
a whole number in ``[1, max_weight]``, and a site's ``num_samples`` may not change during a run; every meta
value read (loss, counts) is type-checked.  The weight is also bounded relative to the others (issue 45): the
largest claim of a round counts at most ``max_weight_ratio`` times the median of the other sites' weights, so one
site that claims a million samples against three of a hundred cannot replace the global model with its own (its
contribution is held aside until the round's other weights are known, in a temporary file that never has a name,
in the run's folder (``fedssl.core.spill``), not in the server's memory; from the second round on, a claim that no
subset of the others' declared sizes could cap is summed at once, so an honest round holds none).  Accepted
tensors go straight into a running weighted sum (``fedssl.core.state_dict.RunningAverage``, float64): no site's
model is held, so the server's memory does not grow with the number of sites.  A rejected site is logged
("REJECTED ...", naming it) and left out of the round; nothing a site sends raises out of ``accept``.

Extra per-site payloads of the result meta are the business of *collectors* (server components named in
``collectors``, e.g. FCL's ``FeatureBankCollector``): each accepted contribution goes through every collector's
``collect(site, dxo)``, which validates and returns the site's items (or raises ValueError to reject the
contribution); the items are passed on, per site, in the meta of the aggregated DXO under ``"collected"``, which
the MergingShareableGenerator keeps out of the persisted global model and hands to the next broadcast, where a
per-site task-data filter tailors it.  The per-site losses go to AFTER_AGGREGATION listeners through the
FL-context property ``ROUND_STATS_PROP`` only (memory, never persisted).  The aggregator itself knows no method.
"""

from __future__ import annotations

import os

import numpy as np
from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.event_type import EventType
from nvflare.apis.fl_constant import ReservedKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.app_common.abstract.aggregator import Aggregator
from nvflare.app_common.abstract.model import ModelLearnableKey
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.app_event_type import AppEventType

from fedssl.core.checks import require, require_choice
from fedssl.core.spill import hold
from fedssl.core.state_dict import (ContributionError, RunningAverage, check_contribution, release_threads,
                                    round_key_set, squared_norm)
from fedssl.core.untrusted import as_count, as_finite_float
from fedssl.flare.constants import AGGREGATED_SITES, COLLECTED, REFUSAL_PROP, ROUND_PLAN_PROP, ROUND_STATS_PROP

WEIGHTINGS = ("num_samples", "num_steps", "uniform")
#: default bound on one site's weight (images / volumes / steps of a round): far above any site of the papers
DEFAULT_MAX_WEIGHT = 1_000_000
#: default bound on ||x - g|| / max(||g||, 1): an honest round moves a model by well under its own norm
DEFAULT_MAX_UPDATE_RATIO = 10.0
#: the largest weight of a round counts at most this many times the median of the others' (0 = no relative cap)
DEFAULT_MAX_WEIGHT_RATIO = 5.0


def check_ratio(component: str, max_weight_ratio: object) -> None:
    require(isinstance(max_weight_ratio, (int, float)) and not isinstance(max_weight_ratio, bool)
            and (max_weight_ratio == 0 or 1 <= max_weight_ratio < float("inf")), component, "max_weight_ratio",
            max_weight_ratio, f"use 0 (no relative cap: the papers' plain FedAvg) or a number >= 1: the largest weight "
            f"of a round counts at most that many times the median of the others' (default {DEFAULT_MAX_WEIGHT_RATIO})")


def check_bounds(component: str, max_weight: object, max_update_ratio: object) -> None:
    require(isinstance(max_weight, (int, float)) and not isinstance(max_weight, bool)
            and 1 <= max_weight < float("inf"),
            component, "max_weight", max_weight, "use a finite number >= 1: the largest weight (samples or steps) one "
                                                 "site may claim")
    require(isinstance(max_update_ratio, (int, float)) and not isinstance(max_update_ratio, bool)
            and 0 < max_update_ratio < float("inf"), component, "max_update_ratio", max_update_ratio,
            "use a finite number > 0 (default 10): the largest ||update|| / ||global model|| accepted from a site")


class RoundAggregator(Aggregator):
    """Per-round bookkeeping shared by the bundle's aggregators (FedAvgAggregator, SurgicalAggregator):
    who may contribute, the checked weight and loss of each contribution, and the running weighted sum of the
    accepted tensors (plus the few a subclass must keep per site, e.g. surgical head rows)."""

    def __init__(self, weighting: str, max_weight: float, max_update_ratio: float,
                 max_weight_ratio: float = DEFAULT_MAX_WEIGHT_RATIO):
        super().__init__()
        self.weighting = weighting
        self.max_weight = max_weight
        self.max_update_ratio = max_update_ratio
        self.max_weight_ratio = float(max_weight_ratio)
        self._running = RunningAverage()
        #: (site, weight, tensors held aside by fedssl.core.spill.hold) of the largest claim so far this round, not
        #: yet in the running sum
        self._held: tuple | None = None
        self._spill_failed = ""  # why a held claim had to stay in memory (logged once a run)
        self._spill_dir: str | None = None  # the run's folder (START_RUN); the system's temporary folder without one
        #: site -> (claimed, counted) when the last round capped a weight
        self.capped: dict[str, tuple[float, float]] = {}
        self._retained: dict[str, dict] = {}  # site -> the tensors ``keep`` was told to hold per site
        self._weights: dict[str, float] = {}
        self._losses: dict[str, float] = {}
        self._declared: dict[str, int] = {}  # site -> num_samples it declared with its first accepted result
        self._num_rounds: int | None = None
        self._base_sq: tuple | None = None
        self._clients: set[str] | None = None  # the run's clients, as the engine names them

    def reset(self, fl_ctx: FLContext) -> None:
        self._running.clear()
        self._retained, self._weights, self._losses = {}, {}, {}
        if self._held is not None:  # a round that ended without aggregating: its held claim's file goes
            self._held[2].close()
        self._held, self.capped = None, {}
        self._base_sq: tuple | None = None  # (global model, keys) -> ||g||^2, once a round

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        if event_type == AppEventType.ROUND_STARTED:  # fired from the workflow's context, which holds NUM_ROUNDS
            n = fl_ctx.get_prop(AppConstants.NUM_ROUNDS)
            self._num_rounds = n if isinstance(n, int) else self._num_rounds
        elif event_type == EventType.START_RUN:  # a held claim's unnamed file goes where the job's own files are (on
            engine = fl_ctx.get_engine()          # disk, where a /tmp may be memory)
            run_dir = engine.get_workspace().get_run_dir(fl_ctx.get_job_id()) if engine else None
            self._spill_dir = run_dir if isinstance(run_dir, str) and os.path.isdir(run_dir) else None
        elif event_type == EventType.END_RUN:  # no summing thread left for FLARE's "still running thread" warning
            release_threads()

    def is_last_round(self, fl_ctx: FLContext) -> bool:
        current = fl_ctx.get_prop(AppConstants.CURRENT_ROUND)
        return self._num_rounds is not None and current == self._num_rounds - 1

    def admitted_site(self, shareable: Shareable, fl_ctx: FLContext) -> str | None:
        """The sending site's name, or None (with a warning naming the site) when the result is left out of
        this round: not a client of this run, an error return code, a result of another (or no) round, or a
        second result of the same site."""
        site = shareable.get_peer_prop(key=ReservedKey.IDENTITY_NAME, default=None)
        engine = fl_ctx.get_engine()
        clients = {c.name for c in engine.get_clients()} if engine is not None else None
        self._clients = clients
        if not isinstance(site, str) or (clients is not None and site not in clients):
            self.refused(fl_ctx, str(site)[:64], ContributionError(f"{site!r} is not a client of this run"))
            return None
        rc = shareable.get_return_code()
        if rc and rc != ReturnCode.OK:
            self.log_warning(fl_ctx, f"{site} returned {rc}; its contribution is left out of this round")
            return None
        contribution_round = shareable.get_cookie(AppConstants.CONTRIBUTION_ROUND)
        current_round = fl_ctx.get_prop(AppConstants.CURRENT_ROUND)
        if current_round is not None and contribution_round != current_round:
            self.refused(fl_ctx, site, ContributionError(
                f"{site} sent a result for round {str(contribution_round)[:20]} during round {current_round}"))
            return None
        if site in self._weights:
            self.log_warning(fl_ctx, f"{site} already contributed to round {current_round}; duplicate discarded")
            return None
        return site

    def checked_dxo(self, shareable: Shareable, site: str) -> DXO:
        """The result's DXO, refused unless it holds weights and every meta key is a string."""
        dxo = from_shareable(shareable)
        if dxo.data_kind != DataKind.WEIGHTS:
            raise ContributionError(f"{site} sent data kind {dxo.data_kind}; expected {DataKind.WEIGHTS}")
        if not isinstance(dxo.data or {}, dict) or not all(isinstance(k, str) for k in (dxo.data or {})):
            raise ContributionError(f"{site} sent weights that are not a dict of named tensors")
        if not all(isinstance(k, str) for k in dxo.get_meta_props()):
            raise ContributionError(f"{site} sent meta keys that are not strings: "
                                    f"{[k for k in dxo.get_meta_props() if not isinstance(k, str)][:3]}")
        return dxo

    def weight_of(self, dxo: DXO, site: str, declared: int | None = None) -> float:
        """The contribution's aggregation weight: 1 (uniform), or a whole number in [1, cap] read from the meta.

        ``num_samples`` is a dataset size: its cap is what the site declared at registration (``declared``,
        e.g. the surgical class registration) or, without one, ``max_weight``; it may not change during the run.
        """
        if self.weighting == "uniform":
            return 1.0
        if self.weighting == "num_steps":
            return float(as_count(dxo.get_meta_prop(MetaKey.NUM_STEPS_CURRENT_ROUND), MetaKey.NUM_STEPS_CURRENT_ROUND,
                                  site, cap=self.max_weight))
        n = as_count(dxo.get_meta_prop("num_samples"), "num_samples", site, cap=declared or self.max_weight)
        first = self._declared.get(site)
        if first is not None and n != first:
            raise ContributionError(f"{site} sent num_samples={n} after declaring {first} earlier in this run; "
                                    "a site's dataset size is fixed for a run")
        return float(n)

    def keep(self, site: str, data: dict, weight: float, dxo: DXO, retain: tuple = ()) -> bool:
        """Record an accepted contribution and its training loss (a real number if reported); returns True.
        Its tensors are added to the running weighted sum, except the keys in ``retain``, held for this site
        (small tensors that are not averaged key by key).  Raises ContributionError (before recording anything)
        when the loss is not a finite number or the tensors do not fit the round's running sum."""
        loss = dxo.get_meta_prop("loss")
        loss = None if loss is None else as_finite_float(loss, "loss", site)
        tensors = {k: v for k, v in data.items() if k not in retain}
        try:
            if not self._relative_cap() or self._never_capped(site, weight):
                self._running.add(tensors, weight)
            else:  # the largest claim waits for the others' weights (round_average), spilled to an unnamed file
                self._check_fits(tensors)
                held = self._held
                if held is None or weight > held[1]:
                    kept, why = hold(tensors, self._spill_dir)
                    if why and not self._spill_failed:
                        self._spill_failed = why
                        self.logger.warning(f"the round's largest claim is held in memory: its temporary file "
                                            f"could not be written ({why})")
                    if held is not None:
                        try:
                            self._running.add_held(held[2], held[1])
                        finally:
                            held[2].close()
                    self._held = (site, weight, kept)
                else:
                    self._running.add(tensors, weight)
        except ValueError as e:
            raise ContributionError(f"{site}: {e}") from None
        if self.weighting == "num_samples":
            self._declared.setdefault(site, int(weight))
        self._retained[site] = {k: data[k] for k in retain}
        self._weights[site] = weight
        if loss is not None:
            self._losses[site] = loss
        return True

    def refused(self, fl_ctx: FLContext, site: str, error: Exception) -> bool:
        """Log a refused contribution (naming the site) and leave the reason for AFTER_CONTRIBUTION_ACCEPT
        listeners (RunSummary lists refused contributions); returns False for ``accept``."""
        known = isinstance(error, (ContributionError, ValueError, TypeError, KeyError))
        reason = str(error) if known else f"unexpected {type(error).__name__}: {error}"  # never ends the round
        self.log_error(fl_ctx, f"REJECTED contribution from {site}: {reason}")
        fl_ctx.set_prop(REFUSAL_PROP, {"site": site, "reason": reason[:300]}, private=True, sticky=False)
        return False

    def round_sites(self, fl_ctx: FLContext) -> tuple[list[str], int]:
        """(sorted sites that contributed to this round, number of clients of the run); with no contribution
        the run is stopped (system panic) and the list is empty."""
        sites = sorted(self._weights)
        n_clients = len(fl_ctx.get_engine().get_clients()) if fl_ctx.get_engine() else len(sites)
        if not sites:
            self.system_panic("no valid contribution this round: nothing to aggregate", fl_ctx)
        return sites, n_clients

    def base_sq(self, reference: dict, keys: set) -> float:
        """``||g||^2`` of the round's global model over ``keys``, computed at the round's first contribution."""
        tag = (id(reference), frozenset(keys))
        if self._base_sq is None or self._base_sq[0] != tag:
            self._base_sq = (tag, squared_norm(reference, keys))
        return self._base_sq[1]

    def _relative_cap(self) -> bool:
        return self.max_weight_ratio > 0 and self.weighting != "uniform"

    def _never_capped(self, site: str, weight: float) -> bool:
        """True when no round can cap this claim, so it need not wait (issue 46: no model held in an honest round
        after the first).  With ``num_samples`` a site's weight is the size it declared in an earlier round; once
        every other client of the run has declared one, the median of whichever of them contribute is at least the
        smallest, and a claim within ``max_weight_ratio`` times that smallest size is never capped.  Nor does it
        change whether a held claim is capped: a held claim smaller than this one has, among its others, this
        claim and sites no smaller than ``weight / max_weight_ratio``, so their median is above its cap."""
        if self.weighting != "num_samples" or not self._clients:
            return False
        others = self._clients - {site}
        if not others or not others <= set(self._declared):
            return False
        return weight <= self.max_weight_ratio * min(self._declared[o] for o in others)

    def _check_fits(self, tensors: dict) -> None:
        """ValueError unless ``tensors`` have the keys and shapes of this round's other contributions."""
        first = self._held[2].shapes if self._held is not None else None
        if first is None:
            return
        if set(tensors) != set(first):
            missing, extra = sorted(set(first) - set(tensors))[:3], sorted(set(tensors) - set(first))[:3]
            raise ValueError(f"contribution keys differ from the first one's (missing {missing}, unexpected {extra})")
        for k, v in tensors.items():
            if np.shape(v) != first[k]:
                raise ValueError(f"{k!r} has shape {np.shape(v)}, the first contribution's is {first[k]}")

    def round_average(self) -> dict:
        """The weighted mean of this round's accepted tensors (empty when contributions carried none); the largest
        claim counts at most ``max_weight_ratio`` x the median of the other sites' weights."""
        if self._held is not None:
            site, claimed, tensors = self._held
            others = [w for s, w in self._weights.items() if s != site]
            counted = min(claimed, self.max_weight_ratio * float(np.median(others))) if others else claimed
            try:
                self._running.add_held(tensors, counted)
            finally:
                tensors.close()
            self._weights[site] = counted
            if counted < claimed:
                self.capped[site] = (claimed, counted)
            self._held = None
        return self._running.result() if self._running.count and self._running.total_weight > 0 else {}

    def round_average_or_stop(self, fl_ctx: FLContext) -> dict | None:
        """:meth:`round_average`, or None after stopping the run with its reason when the round's sum is incomplete
        (a held claim the server could not read back): a partial sum never becomes a global model."""
        try:
            return self.round_average()
        except ValueError as e:
            self.system_panic(str(e), fl_ctx)
            return None

    def retained(self, site: str) -> dict:
        """The tensors of ``site`` kept aside by ``keep(..., retain=...)`` this round."""
        return self._retained[site]

    def publish_round_stats(self, fl_ctx: FLContext, sites: list[str]) -> None:
        """Per-site losses for AFTER_AGGREGATION listeners (RunSummary), in memory only: never in the aggregate."""
        fl_ctx.set_prop(ROUND_STATS_PROP, {"sites": list(sites),
                                           "losses": {s: self._losses[s] for s in sites if s in self._losses}},
                        private=True, sticky=False)


class FedAvgAggregator(RoundAggregator):
    def __init__(self, weighting: str = "num_samples", optional_prefixes: list = (), exclude_patterns: list = (),
                 average_excluded_at_end: bool = False, collectors: list = (), max_weight: float = DEFAULT_MAX_WEIGHT,
                 max_update_ratio: float = DEFAULT_MAX_UPDATE_RATIO,
                 max_weight_ratio: float = DEFAULT_MAX_WEIGHT_RATIO):
        """
        Args:
            weighting: "num_samples" (meta ``num_samples``: images/volumes, as FCL and SSL-FL weight),
                "num_steps" (FLARE's NUM_STEPS_CURRENT_ROUND) or "uniform".
            optional_prefixes: parameter-name prefixes that a round carries only when the workflow's round plan
                says so (``ROUND_PLAN_PROP``; e.g. ``["target."]``, FCLOptController: the BYOL target network is
                uploaded only in some modes and rounds); otherwise they keep their previous global value.
            exclude_patterns: parameter-name patterns (fnmatch, e.g. ``["encoder.cls_token"]``) that sites keep
                local (PartialModelExclusion on both sides): contributions leave out exactly these keys, which
                keep their global value.
            average_excluded_at_end: the excluded keys are carried, and averaged, in the last round (FedMAE-KS,
                the client filter's ``average_at_end``); false keeps them local for good (FedBN).
            collectors: ids of server components with ``collect(site, dxo) -> dict`` (e.g. ``["bank_collector"]``,
                a ``FeatureBankCollector`` for FCL's feature exchange); [] = only the weights are kept.
            max_weight: largest weight one site may claim (``num_samples`` or steps of a round).
            max_update_ratio: largest ``||x - g|| / max(||g||, 1)`` accepted from a site (float tensors).
            max_weight_ratio: the largest weight of a round counts at most this many times the median of the other
                sites' weights (default 5; 0 = no relative cap, the papers' plain FedAvg).
        """
        name = type(self).__name__
        require_choice(name, "weighting", weighting, WEIGHTINGS)
        require(isinstance(optional_prefixes, (list, tuple))
                and all(isinstance(p, str) and p for p in optional_prefixes),
                name, "optional_prefixes", optional_prefixes, 'use a list of parameter-name prefixes, e.g. ["target."]')
        require(isinstance(exclude_patterns, (list, tuple)) and all(isinstance(p, str) and p for p in exclude_patterns),
                name, "exclude_patterns", exclude_patterns,
                'use a list of parameter-name patterns, e.g. ["encoder.cls_token"]')
        require(isinstance(average_excluded_at_end, bool), name, "average_excluded_at_end", average_excluded_at_end,
                "use true (knowledge split: averaged once, in the last round) or false (kept local for good)")
        require(isinstance(collectors, (list, tuple)) and all(isinstance(c, str) and c for c in collectors),
                name, "collectors", collectors, 'use a list of server component ids, e.g. ["bank_collector"]')
        check_bounds(name, max_weight, max_update_ratio)
        check_ratio(name, max_weight_ratio)
        super().__init__(weighting, max_weight, max_update_ratio, max_weight_ratio)
        self.exclude_patterns = list(exclude_patterns)
        self.optional_prefixes = list(optional_prefixes)
        self.average_excluded_at_end = average_excluded_at_end
        self.collectors = list(collectors)
        self._collector_components: list | None = None
        self._collected: dict[str, dict] = {}

    def reset(self, fl_ctx: FLContext) -> None:
        super().reset(fl_ctx)
        self._collected = {}

    def collector_components(self, fl_ctx: FLContext) -> list:
        """The components named in ``collectors`` (looked up once); ValueError naming a missing or unfit one."""
        if self._collector_components is None:
            engine, found = fl_ctx.get_engine(), []
            for cid in self.collectors:
                comp = engine.get_component(cid) if engine is not None else None
                if not callable(getattr(comp, "collect", None)):
                    raise ValueError(f"{type(self).__name__}: collectors names {cid!r}, but the server config has no "
                                     "component of that id with a collect(site, dxo) method; add it to the components")
                found.append(comp)
            self._collector_components = found
        return self._collector_components

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        super().handle_event(event_type, fl_ctx)
        if event_type == EventType.START_RUN and self.collectors:
            try:
                self.collector_components(fl_ctx)
            except ValueError as e:
                self.system_panic(str(e), fl_ctx)

    def round_keys(self, reference: dict, fl_ctx: FLContext) -> set:
        """The keys every contribution of this round carries, decided here from the global model, the job's
        exclusions and the workflow's round plan, never from what a site sent."""
        with_optional = False
        if self.optional_prefixes:
            plan, current = fl_ctx.get_prop(ROUND_PLAN_PROP), fl_ctx.get_prop(AppConstants.CURRENT_ROUND)
            if not isinstance(plan, dict) or plan.get("round") != current:
                raise ContributionError(
                    f"no round plan for round {current} (FL-context property {ROUND_PLAN_PROP!r}); "
                    f"optional_prefixes {self.optional_prefixes} need a workflow that decides when they are uploaded "
                    "(FCLOptController); remove optional_prefixes for a plain ScatterAndGather")
            with_optional = bool(plan.get("optional"))
        with_excluded = bool(self.exclude_patterns) and self.average_excluded_at_end and self.is_last_round(fl_ctx)
        return round_key_set(reference, self.exclude_patterns, self.optional_prefixes, with_excluded, with_optional)

    def accept(self, shareable: Shareable, fl_ctx: FLContext) -> bool:
        site = self.admitted_site(shareable, fl_ctx)
        if site is None:
            return False
        try:
            collectors = self.collector_components(fl_ctx)
        except ValueError as e:
            self.system_panic(str(e), fl_ctx)
            return False
        try:
            dxo = self.checked_dxo(shareable, site)
            global_model = fl_ctx.get_prop(AppConstants.GLOBAL_MODEL)
            if not global_model:
                raise ContributionError("no global model in the FL context; the aggregator runs inside "
                                        "ScatterAndGather")
            reference = global_model[ModelLearnableKey.WEIGHTS]
            keys = self.round_keys(reference, fl_ctx)
            data = check_contribution(reference, dxo.data or {}, site, keys=keys,
                                      max_update_ratio=self.max_update_ratio, base_sq=self.base_sq(reference, keys))
            weight = self.weight_of(dxo, site)
            items: dict = {}
            for collector in collectors:
                items.update(collector.collect(site, dxo))
            self.keep(site, data, weight, dxo)
        except Exception as e:  # noqa: BLE001 -- one site's payload never ends the round (refused() names the type)
            return self.refused(fl_ctx, site, e)
        if collectors:
            self._collected[site] = items
        return True

    def aggregate(self, fl_ctx: FLContext) -> Shareable:
        sites, n_clients = self.round_sites(fl_ctx)
        if not sites:
            return Shareable()
        avg = self.round_average_or_stop(fl_ctx)
        if avg is None:
            return Shareable()
        for site, (claimed, counted) in self.capped.items():
            self.log_warning(fl_ctx, f"{site} claimed weight {claimed:g}; counted {counted:g} "
                                     f"({self.max_weight_ratio:g} x the median of the other sites')")
        self.log_info(fl_ctx, f"aggregated {len(sites)}/{n_clients} sites, weights ({self.weighting}): "
                      + ", ".join(f"{self._weights[s]:g}" for s in sites))
        self.publish_round_stats(fl_ctx, sites)
        meta: dict = {AGGREGATED_SITES: len(sites)}
        if self.collectors:
            meta[COLLECTED] = {s: self._collected[s] for s in sites}
        return DXO(data_kind=DataKind.WEIGHTS, data=avg, meta=meta).to_shareable()
