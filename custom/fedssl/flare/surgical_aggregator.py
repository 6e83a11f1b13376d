"""Server aggregator of surgical aggregation (surgical aggregation (Kulkarni et al., ML4H 2024), sec. 2.1.2, eqs. 1-3) and its baselines.

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
the global model, a head of one row per declared class, finite values.  A rejected site is logged
("REJECTED ...", naming it) and left out of the round.
"""

from __future__ import annotations

import numpy as np
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.app_common.abstract.model import ModelLearnableKey
from nvflare.app_common.app_constant import AppConstants

from fedssl.core.checks import require, require_choice
from fedssl.core.state_dict import ContributionError, check_contribution, to_numpy, weighted_average
from fedssl.core.surgical import aggregated_keys, classes_from_meta, is_head_key, merge_heads
from fedssl.flare.constants import CLASSES_KEY
from fedssl.flare.fedavg_aggregator import RoundAggregator
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
    def __init__(self, weighting: str = "uniform", head: str = "classifier"):
        """
        Args:
            weighting: backbone FedAvg weights: "uniform" (the paper's public code) or "num_samples" (meta
                ``num_samples``, training images); the surgical head merge uses the same weights per class.
            head: module name of the class layer (``<head>.weight [C, F]``, ``<head>.bias [C]``).
        """
        super().__init__()
        name = type(self).__name__
        require_choice(name, "weighting", weighting, WEIGHTINGS)
        require(isinstance(head, str) and bool(head.strip()), name, "head", head,
                'use the module name of the class layer, e.g. "classifier"')
        self.weighting = weighting
        self.head = head

    # ------------------------------------------------------------------ validation
    def _check(self, dxo: DXO, site: str, reg: ClassRegistry, global_weights: dict) -> float:
        if dxo.data_kind != DataKind.WEIGHTS:
            raise ContributionError(f"{site} sent data kind {dxo.data_kind}; expected {DataKind.WEIGHTS}")
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
                f"{site} sent {len(bn_sent)} batch-norm tensors (e.g. {bn_sent[0]!r}) but backbone {reg.backbone} keeps "
                "batch-norm on the sites; put fedssl.flare.backbone_exclusion.BackboneBNExclusion (direction upload) in the "
                "client's task-result filters")
        if reg.backbone == "fedavg" and data and not bn_sent and any(is_bn_key(k) for k in backbone):
            raise ContributionError(
                f"{site} sent no batch-norm tensors but backbone fedavg averages them; the client's batch-norm filter "
                "must follow the backbone strategy (BackboneBNExclusion), not exclude batch-norm unconditionally")
        check_contribution(global_weights, {k: v for k, v in data.items() if not is_head_key(k, self.head)}, site,
                           keys=backbone)
        extra_heads = sorted(set(k for k in data if is_head_key(k, self.head)) - set(heads))
        missing_heads = sorted(set(heads) - set(data))
        if extra_heads or missing_heads:
            raise ContributionError(f"{site} sent head tensors {sorted(k for k in data if is_head_key(k, self.head))}, "
                                    f"expected {heads} for method {reg.method}")
        if heads:
            rows = len(registered) if reg.method == "surgical" else len(reg.global_classes)
            w, b = to_numpy(data[f"{self.head}.weight"]), to_numpy(data[f"{self.head}.bias"])
            n_feat = to_numpy(global_weights[f"{self.head}.weight"]).shape[1]
            if w.shape != (rows, n_feat) or b.shape != (rows,):
                raise ContributionError(
                    f"{site} sent a head of shape {w.shape} / {b.shape}; method {reg.method} expects one row per "
                    f"{'declared' if reg.method == 'surgical' else 'network'} class: ({rows}, {n_feat}) / ({rows},)")
            for k, v in ((f"{self.head}.weight", w), (f"{self.head}.bias", b)):
                if v.dtype.kind != "f" or not np.all(np.isfinite(v)):
                    raise ContributionError(f"{site} sent non-finite or non-float values in {k!r}; contribution rejected")
        if self.weighting == "uniform":
            return 1.0
        n = dxo.get_meta_prop("num_samples")
        if n is None or not np.isfinite(float(n)) or float(n) <= 0:
            raise ContributionError(f"{site} sent num_samples={n!r}; a positive count is required for num_samples weighting")
        return float(n)

    def accept(self, shareable: Shareable, fl_ctx: FLContext) -> bool:
        site = self.admitted_site(shareable, fl_ctx)
        if site is None:
            return False
        try:
            reg = get_registry(fl_ctx, type(self).__name__)
            global_model = fl_ctx.get_prop(AppConstants.GLOBAL_MODEL)
            if not global_model:
                raise ContributionError("no global model in the FL context; the aggregator runs inside ScatterAndGather")
            dxo = from_shareable(shareable)
            weight = self._check(dxo, site, reg, global_model[ModelLearnableKey.WEIGHTS])
        except (ContributionError, ValueError, TypeError) as e:
            self.log_error(fl_ctx, f"REJECTED contribution: {e}")
            return False
        return self.keep(site, dxo.data or {}, weight, dxo)

    # ------------------------------------------------------------------ aggregation
    def aggregate(self, fl_ctx: FLContext) -> Shareable:
        sites, n_clients = self.round_sites(fl_ctx)
        if not sites:
            return Shareable()
        reg = get_registry(fl_ctx, type(self).__name__)
        global_weights = fl_ctx.get_prop(AppConstants.GLOBAL_MODEL)[ModelLearnableKey.WEIGHTS]
        backbone, heads = expected_keys(list(global_weights), reg, self.head)
        weights = [self._weights[s] for s in sites]
        out: dict[str, np.ndarray] = {}
        if backbone:
            out.update(weighted_average([{k: self._states[s][k] for k in backbone} for s in sites], weights))
        wk, bk = f"{self.head}.weight", f"{self.head}.bias"
        if heads and reg.method == "surgical":
            out[wk], out[bk] = merge_heads(
                {s: (self._states[s][wk], self._states[s][bk]) for s in sites},
                {s: reg.classes_of(s) for s in sites}, list(reg.global_classes),
                global_head=(global_weights[wk], global_weights[bk]),
                weights=None if self.weighting == "uniform" else dict(self._weights))
        elif heads:
            out.update(weighted_average([{k: self._states[s][k] for k in heads} for s in sites], weights))
        self.log_info(fl_ctx, f"aggregated {len(sites)}/{n_clients} sites ({reg.method}, backbone {reg.backbone}, "
                              f"{self.weighting} weights): {len(out)} tensors updated")
        meta = {"aggregated_sites": len(sites), "site_losses": {s: self._losses[s] for s in sites if s in self._losses}}
        return DXO(data_kind=DataKind.WEIGHTS, data=out, meta=meta).to_shareable()
