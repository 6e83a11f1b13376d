"""Server aggregator of surgical aggregation (surgical aggregation (Kulkarni et al., ML4H 2024), sec. 2.1.2, eqs. 1-3)
and its baselines.

Backbone (eq. 1): FedAvg of every non-head tensor (``weighting`` "uniform", as the paper's public code,
or "num_samples"); under "fedbn" / "fedbn_plus" the batch-norm tensors stay on the sites (the job's
BackboneBNExclusion filters, which follow the strategy, hold them back) and keep their global value.
Head, by ``method`` (read from the :class:`~fedssl.flare.surgical_registration.ClassRegistry`):

- surgical: every global class row (weights and bias) is the mean over only the sites holding the class
  (``fedssl.core.surgical.merge_heads``; a class of one site is copied from it); each site sends its head
  cut to its own classes, in its own order;
- vanilla / partial_loss: every site holds the whole head over C; it is averaged like the backbone;
- personalised: heads never leave the sites; individual: nothing is exchanged (contributions are empty).

Every contribution is checked before it touches the global model: the site is registered and sends the
class list it declared (a changed list mid-run is rejected), exactly the expected keys, backbone shapes of
the global model, a head of one row per declared class; every tensor is cast to the global dtype before any
value check, must be finite and within ``max_update_ratio`` of the global model (the head against the global
rows of the site's classes); ``num_samples`` is capped by the size the site declared at registration.  A
rejected site is logged ("REJECTED ...", naming it) and left out of the round (see RoundAggregator).
"""

from __future__ import annotations

import numpy as np
from nvflare.apis.dxo import DXO, DataKind
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.app_common.abstract.model import ModelLearnableKey
from nvflare.app_common.app_constant import AppConstants

from fedssl.core.checks import require, require_choice
from fedssl.core.state_dict import ContributionError, check_contribution, to_numpy, update_ratio
from fedssl.core.surgical import aggregated_keys, classes_from_meta, is_head_key, merge_heads
from fedssl.flare.constants import CLASSES_KEY
from fedssl.flare.constants import AGGREGATED_SITES
from fedssl.flare.fedavg_aggregator import DEFAULT_MAX_UPDATE_RATIO, DEFAULT_MAX_WEIGHT, RoundAggregator, check_bounds
from fedssl.flare.surgical_registration import ClassRegistry, get_registry
from fedssl.models.densenet import is_bn_key

WEIGHTINGS = ("uniform", "num_samples")


def expected_keys(global_keys, reg: ClassRegistry, head: str) -> tuple[list[str], list[str]]:
    """(backbone keys a contribution must carry, head keys it must carry) for the registry's method/backbone."""
    backbone = aggregated_keys(global_keys, reg.backbone, is_bn_key, head)
    heads = [k for k in global_keys if is_head_key(k, head)]
    if reg.method == "individual":
        return [], []
    if reg.method == "personalised":
        return backbone, []
    return backbone, heads


class SurgicalAggregator(RoundAggregator):
    def __init__(self, weighting: str = "uniform", head: str = "classifier", max_weight: float = DEFAULT_MAX_WEIGHT,
                 max_update_ratio: float = DEFAULT_MAX_UPDATE_RATIO):
        """
        Args:
            weighting: backbone FedAvg weights: "uniform" (the paper's public code) or "num_samples" (meta
                ``num_samples``, training images); the surgical head merge is always the plain mean of eq. 2 over
                the sites holding each class (issue 47: it used to take the same sample weights).
            head: module name of the class layer (``<head>.weight [C, F]``, ``<head>.bias [C]``).
            max_weight: largest ``num_samples`` a site without a registered size may claim.
            max_update_ratio: largest ``||x - g|| / max(||g||, 1)`` accepted from a site.
        """
        name = type(self).__name__
        require_choice(name, "weighting", weighting, WEIGHTINGS)
        require(isinstance(head, str) and bool(head.strip()), name, "head", head,
                'use the module name of the class layer, e.g. "classifier"')
        check_bounds(name, max_weight, max_update_ratio)
        super().__init__(weighting, max_weight, max_update_ratio)
        self.head = head

    # ------------------------------------------------------------------ validation
    def _check(self, dxo: DXO, site: str, reg: ClassRegistry, global_weights: dict) -> tuple[dict, float]:
        """(the contribution cast to the global dtypes, its weight), or ContributionError naming the site."""
        registered = reg.classes_of(site)
        sent = classes_from_meta(dxo.get_meta_prop(CLASSES_KEY), site)
        if sent != registered:
            raise ContributionError(f"{site} changed its class list mid-run: registered {registered}, now {sent}; "
                                    "a site's classes are fixed for a run (restart the run to change them)")
        data = dxo.data or {}
        backbone, heads = expected_keys(list(global_weights), reg, self.head)
        bn_sent = [k for k in data if is_bn_key(k) and not is_head_key(k, self.head)]
        if reg.backbone != "fedavg" and bn_sent:
            raise ContributionError(
                f"{site} sent {len(bn_sent)} batch-norm tensors (e.g. {bn_sent[0]!r}) but backbone {reg.backbone} "
                "keeps batch-norm on the sites; put fedssl.flare.backbone_exclusion.BackboneBNExclusion (direction "
                "upload) in the client's task-result filters")
        if reg.backbone == "fedavg" and data and not bn_sent and any(is_bn_key(k) for k in backbone):
            raise ContributionError(
                f"{site} sent no batch-norm tensors but backbone fedavg averages them; the client's batch-norm filter "
                "must follow the backbone strategy (BackboneBNExclusion), not exclude batch-norm unconditionally")
        sent_heads = sorted(k for k in data if is_head_key(k, self.head))
        if sent_heads != sorted(heads):
            raise ContributionError(f"{site} sent head tensors {sent_heads}, expected {heads} for method {reg.method}")
        reference = {k: global_weights[k] for k in backbone}
        if heads:  # the reference of a surgical head is the global rows of the site's classes, in its order
            wk, bk = f"{self.head}.weight", f"{self.head}.bias"
            rows = ([list(reg.global_classes).index(c) for c in registered] if reg.method == "surgical"
                    else list(range(len(reg.global_classes))))
            reference[wk], reference[bk] = to_numpy(global_weights[wk])[rows], to_numpy(global_weights[bk])[rows]
        cast = check_contribution(reference, data, site, keys=list(reference))
        ratio = update_ratio(reference, cast)
        if not ratio <= self.max_update_ratio:
            raise ContributionError(f"{site} sent an update of norm {ratio:.3g} x the global model's (bound "
                                    f"{self.max_update_ratio:g}); contribution rejected")
        return cast, self.weight_of(dxo, site, declared=reg.num_samples.get(site))

    def accept(self, shareable: Shareable, fl_ctx: FLContext) -> bool:
        site = self.admitted_site(shareable, fl_ctx)
        if site is None:
            return False
        try:
            reg = get_registry(fl_ctx, type(self).__name__)
            global_model = fl_ctx.get_prop(AppConstants.GLOBAL_MODEL)
            if not global_model:
                raise ContributionError("no global model in the FL context; the aggregator runs inside "
                                        "ScatterAndGather")
            dxo = self.checked_dxo(shareable, site)
            data, weight = self._check(dxo, site, reg, global_model[ModelLearnableKey.WEIGHTS])
            heads = (f"{self.head}.weight", f"{self.head}.bias") if reg.method == "surgical" and data else ()
            return self.keep(site, data, weight, dxo, retain=heads)  # surgical heads: merged per class below
        except Exception as e:  # noqa: BLE001 -- one site's payload never ends the round (refused() names the type)
            return self.refused(fl_ctx, site, e)

    # ------------------------------------------------------------------ aggregation
    def aggregate(self, fl_ctx: FLContext) -> Shareable:
        sites, n_clients = self.round_sites(fl_ctx)
        if not sites:
            return Shareable()
        reg = get_registry(fl_ctx, type(self).__name__)
        global_weights = fl_ctx.get_prop(AppConstants.GLOBAL_MODEL)[ModelLearnableKey.WEIGHTS]
        _, heads = expected_keys(list(global_weights), reg, self.head)
        avg = self.round_average_or_stop(fl_ctx)
        if avg is None:
            return Shareable()
        out: dict[str, np.ndarray] = dict(avg)  # backbone, and the heads unless surgical
        wk, bk = f"{self.head}.weight", f"{self.head}.bias"
        if heads and reg.method == "surgical":
            out[wk], out[bk] = merge_heads(
                {s: (self.retained(s)[wk], self.retained(s)[bk]) for s in sites},
                {s: reg.classes_of(s) for s in sites}, list(reg.global_classes),
                global_head=(global_weights[wk], global_weights[bk]))  # eq. 2: a plain mean, whatever the weighting
        self.log_info(fl_ctx, f"aggregated {len(sites)}/{n_clients} sites ({reg.method}, backbone {reg.backbone}, "
                              f"{self.weighting} weights): {len(out)} tensors updated")
        self.publish_round_stats(fl_ctx, sites)
        return DXO(data_kind=DataKind.WEIGHTS, data=out, meta={AGGREGATED_SITES: len(sites)}).to_shareable()
