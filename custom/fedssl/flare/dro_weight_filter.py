"""Server task-data filter for FedDRA: each site receives its own DRO weight lambda_i, and no other site's.

"Distributionally Robust Alignment for Medical Federated Vision-Language Pre-training Under Data Heterogeneity"
(Shuai, Wu, Tang and Shen, TMLR), Algorithm 1: the server sends each client its weight, which scales the client's
step size.  The weights of all sites never enter the broadcast: the FedDRAController keeps them in a private
FL-context property (``DRO_WEIGHTS_PROP``), and this filter, running once per site as it pulls the task, writes
that site's lambda_i and N into a DXO built new for it (the broadcast shared by all sites is never edited).  A
lambda_i reveals only that site's own relative loss.

Without this filter a DRO task reaches the site with no weight, and the site refuses it (it never guesses a
uniform weight), so a forgotten filter stops the run with a message naming the filter instead of silently
training without DRO.
"""

from __future__ import annotations

from nvflare.apis.dxo import DXO, from_shareable
from nvflare.apis.filter import Filter
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.app_common.app_constant import AppConstants

from fedssl.flare.constants import DRO_ON_KEY, DRO_SITES_KEY, DRO_WEIGHT_KEY, DRO_WEIGHTS_PROP


class DROWeightFilter(Filter):
    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        dxo = from_shareable(shareable)
        if not dxo.get_meta_prop(DRO_ON_KEY):
            return shareable
        peer = fl_ctx.get_peer_context()
        site = peer.get_identity_name() if peer else None
        if not site:
            raise RuntimeError("DROWeightFilter must run as a server task-data filter (no receiving site known)")
        plan = fl_ctx.get_prop(DRO_WEIGHTS_PROP)
        current = fl_ctx.get_prop(AppConstants.CURRENT_ROUND)
        if not isinstance(plan, dict) or plan.get("round") != current:
            self.log_error(fl_ctx, f"no DRO weights for round {current}: DROWeightFilter needs the FedDRAController "
                                   f"workflow; {site} gets no weight and will refuse the task")
            return shareable
        weights = plan.get("weights") or {}
        n = len(weights)
        if site not in weights:  # a client that joined after the run started: the uniform weight of the run's sites
            self.log_warning(fl_ctx, f"{site} is not among the run's DRO sites {sorted(weights)}; sending 1/{n or 1}")
        meta = dict(dxo.get_meta_props())  # new meta, never the shared one
        meta[DRO_WEIGHT_KEY] = float(weights.get(site, 1.0 / max(n, 1)))
        meta[DRO_SITES_KEY] = max(n, 1)
        return DXO(data_kind=dxo.data_kind, data=dxo.data, meta=meta).update_shareable(shareable)
