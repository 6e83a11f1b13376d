"""Server aggregator: FedAvg of whole state dicts with explicit weighting, rejecting bad contributions.

Every contribution is checked against the current global model (keys, shapes, finite values) before it
is stored; a rejected site is logged and left out of the round.  Extra per-site payloads of the result meta
are the business of *collectors* (server components named in ``collectors``, e.g. FCL's
``FeatureBankCollector``): each accepted contribution goes through every collector's ``collect(site, dxo)``,
which validates and returns the site's items (or raises ValueError to reject the contribution); the items are
passed on, per site, in the meta of the aggregated DXO under ``"collected"`` so that a per-site task-data
filter can tailor the next broadcast.  The aggregator itself knows no method.
"""

from __future__ import annotations

import numpy as np
from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.event_type import EventType
from nvflare.apis.fl_constant import ReservedKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.app_common.abstract.aggregator import Aggregator
from nvflare.app_common.abstract.model import ModelLearnableKey
from nvflare.app_common.app_constant import AppConstants

from fedssl.core.checks import require, require_choice
from fedssl.core.state_dict import ContributionError, check_contribution, match_keys, weighted_average

COLLECTED = "collected"
WEIGHTINGS = ("num_samples", "num_steps", "uniform")


class RoundAggregator(Aggregator):
    """Per-round bookkeeping shared by the bundle's aggregators (FedAvgAggregator, SurgicalAggregator):
    the accepted states, their weights and reported losses by site, and the checks every ``accept()`` runs first."""

    def __init__(self):
        super().__init__()
        self._states: dict[str, dict] = {}
        self._weights: dict[str, float] = {}
        self._losses: dict[str, float] = {}

    def reset(self, fl_ctx: FLContext) -> None:
        self._states, self._weights, self._losses = {}, {}, {}

    def admitted_site(self, shareable: Shareable, fl_ctx: FLContext) -> str | None:
        """The sending site's name, or None (with a warning naming the site) when the result is left out of
        this round: an error return code, a result of another round, or a second result of the same site."""
        site = shareable.get_peer_prop(key=ReservedKey.IDENTITY_NAME, default="?")
        rc = shareable.get_return_code()
        if rc and rc != ReturnCode.OK:
            self.log_warning(fl_ctx, f"{site} returned {rc}; its contribution is left out of this round")
            return None
        contribution_round = shareable.get_cookie(AppConstants.CONTRIBUTION_ROUND)
        current_round = fl_ctx.get_prop(AppConstants.CURRENT_ROUND)
        if contribution_round is not None and current_round is not None and contribution_round != current_round:
            self.log_warning(fl_ctx, f"{site} sent a result for round {contribution_round} during round {current_round}; discarded")
            return None
        if site in self._states:
            self.log_warning(fl_ctx, f"{site} already contributed to round {current_round}; duplicate discarded")
            return None
        return site

    def keep(self, site: str, data: dict, weight: float, dxo: DXO) -> bool:
        """Record an accepted contribution (and the training loss the site reported, if any); returns True."""
        self._states[site] = data
        self._weights[site] = weight
        loss = dxo.get_meta_prop("loss")
        if loss is not None:
            self._losses[site] = float(loss)
        return True

    def round_sites(self, fl_ctx: FLContext) -> tuple[list[str], int]:
        """(sorted sites that contributed to this round, number of clients of the run); with no contribution
        the run is stopped (system panic) and the list is empty."""
        sites = sorted(self._states)
        n_clients = len(fl_ctx.get_engine().get_clients()) if fl_ctx.get_engine() else len(sites)
        if not sites:
            self.system_panic("no valid contribution this round: nothing to aggregate", fl_ctx)
        return sites, n_clients


class FedAvgAggregator(RoundAggregator):
    def __init__(self, weighting: str = "num_samples", optional_prefixes: list = (), exclude_patterns: list = (),
                 collectors: list = ()):
        """
        Args:
            weighting: "num_samples" (meta ``num_samples``: images/volumes, as FCL and SSL-FL weight),
                "num_steps" (FLARE's NUM_STEPS_CURRENT_ROUND) or "uniform".
            optional_prefixes: parameter-name prefixes a contribution may leave out as a whole (e.g.
                ``["target."]`` when the BYOL target network is uploaded only on some rounds); every
                contribution of a round must then carry the same key set, and the keys left out keep their
                previous global value.
            exclude_patterns: parameter-name patterns (fnmatch, e.g. ``["encoder.cls_token"]``) that sites keep
                local (PartialModelExclusion on both sides): contributions leave out exactly these keys (all
                sites of a round alike), which keep their global value; when a round carries them (the last
                round of a knowledge split) they are averaged like every other key.
            collectors: ids of server components with ``collect(site, dxo) -> dict`` (e.g. ``["bank_collector"]``,
                a ``FeatureBankCollector`` for FCL's feature exchange); [] = only the weights are kept.
        """
        super().__init__()
        name = type(self).__name__
        require_choice(name, "weighting", weighting, WEIGHTINGS)
        require(isinstance(optional_prefixes, (list, tuple)) and all(isinstance(p, str) and p for p in optional_prefixes),
                name, "optional_prefixes", optional_prefixes, 'use a list of parameter-name prefixes, e.g. ["target."]')
        require(isinstance(exclude_patterns, (list, tuple)) and all(isinstance(p, str) and p for p in exclude_patterns),
                name, "exclude_patterns", exclude_patterns, 'use a list of parameter-name patterns, e.g. ["encoder.cls_token"]')
        require(isinstance(collectors, (list, tuple)) and all(isinstance(c, str) and c for c in collectors),
                name, "collectors", collectors, 'use a list of server component ids, e.g. ["bank_collector"]')
        self.weighting = weighting
        self.exclude_patterns = list(exclude_patterns)
        self.optional_prefixes = list(optional_prefixes)
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
        if event_type == EventType.START_RUN and self.collectors:
            try:
                self.collector_components(fl_ctx)
            except ValueError as e:
                self.system_panic(str(e), fl_ctx)

    def _weight_of(self, dxo: DXO, site: str) -> float:
        if self.weighting == "uniform":
            return 1.0
        key = "num_samples" if self.weighting == "num_samples" else MetaKey.NUM_STEPS_CURRENT_ROUND
        w = dxo.get_meta_prop(key)
        if w is None or not np.isfinite(float(w)) or float(w) <= 0:
            raise ContributionError(f"{site} sent {key}={w!r}; a positive count is required for {self.weighting} weighting")
        return float(w)

    def _expected_keys(self, reference: dict, data: dict, site: str) -> set:
        full = set(reference)
        optional = {k for k in full if k.startswith(tuple(self.optional_prefixes))}
        optional |= set(match_keys(full, self.exclude_patterns))
        required = full - optional
        expected = full if set(data) - required else required  # all optional/excluded keys, or none
        if self._states:
            round_keys = set(next(iter(self._states.values())))
            if expected != round_keys:
                raise ContributionError(f"{site} sent {len(expected)} keys but this round's contributions carry "
                                        f"{len(round_keys)}; every site must upload the same parts in a round")
        return expected

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
            dxo = from_shareable(shareable)
            if dxo.data_kind != DataKind.WEIGHTS:
                raise ContributionError(f"{site} sent data kind {dxo.data_kind}; expected {DataKind.WEIGHTS}")
            global_model = fl_ctx.get_prop(AppConstants.GLOBAL_MODEL)
            reference = global_model[ModelLearnableKey.WEIGHTS] if global_model else next(iter(self._states.values()), dxo.data)
            check_contribution(reference, dxo.data, site, keys=self._expected_keys(reference, dxo.data, site))
            weight = self._weight_of(dxo, site)
            items: dict = {}
            for collector in collectors:
                items.update(collector.collect(site, dxo))
        except (ContributionError, ValueError, TypeError) as e:
            self.log_error(fl_ctx, f"REJECTED contribution: {e}")
            return False
        if collectors:
            self._collected[site] = items
        return self.keep(site, dxo.data, weight, dxo)

    def aggregate(self, fl_ctx: FLContext) -> Shareable:
        sites, n_clients = self.round_sites(fl_ctx)
        if not sites:
            return Shareable()
        avg = weighted_average([self._states[s] for s in sites], [self._weights[s] for s in sites])
        self.log_info(fl_ctx, f"aggregated {len(sites)}/{n_clients} sites, weights ({self.weighting}): "
                      + ", ".join(f"{self._weights[s]:g}" for s in sites))
        meta = {
            "aggregated_sites": len(sites),
            "site_losses": {s: self._losses[s] for s in sites if s in self._losses},
        }
        if self.collectors:
            meta[COLLECTED] = dict(self._collected)
        return DXO(data_kind=DataKind.WEIGHTS, data=avg, meta=meta).to_shareable()
