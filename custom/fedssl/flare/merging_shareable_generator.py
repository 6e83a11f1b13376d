"""Shareable generator that merges the aggregate into the previous global model.

FLARE's FullModelShareableGenerator replaces the global weights with whatever was aggregated, so a key
left out of aggregation would vanish.  Here every key of the previous global model survives.

Nothing derived from one site is persisted: the persistor saves the global model *with its meta*, so the
aggregate's server-only meta (the number of sites) and the per-site items the aggregator collected (FCL's
feature banks, keyed by site) never enter the ModelLearnable.  The collected items are held in memory and
put on the next broadcast only, where a per-site task-data filter (FeatureBankShuttle) turns them into what
each site may receive.  After a server restart they are gone: that round runs without them.
"""

from __future__ import annotations

from nvflare.apis.dxo import DataKind, from_shareable
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.app_common.abstract.model import ModelLearnable, ModelLearnableKey, make_model_learnable
from nvflare.app_common.abstract.shareable_generator import ShareableGenerator
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.shareablegenerators.full_model_shareable_generator import FullModelShareableGenerator

from fedssl.core.state_dict import merge_into
from fedssl.flare.constants import AGGREGATED_SITES, COLLECTED

#: aggregate meta that never enters the global model (persisted) nor a broadcast
SERVER_ONLY_META = (AGGREGATED_SITES, COLLECTED, "site_losses")


class MergingShareableGenerator(ShareableGenerator):
    def __init__(self):
        super().__init__()
        self._to_shareable = FullModelShareableGenerator()
        self._collected: dict | None = None  # per-site items of the last aggregate, for the next broadcast only

    def learnable_to_shareable(self, model_learnable: ModelLearnable, fl_ctx: FLContext) -> Shareable:
        meta = {k: v for k, v in (model_learnable.get(ModelLearnableKey.META) or {}).items()
                if k not in SERVER_ONLY_META}
        if self._collected:  # one broadcast only: the next round's, tailored per site by the task-data filter
            meta[COLLECTED], self._collected = self._collected, None
        return self._to_shareable.learnable_to_shareable(
            make_model_learnable(model_learnable[ModelLearnableKey.WEIGHTS], meta), fl_ctx)

    def shareable_to_learnable(self, shareable: Shareable, fl_ctx: FLContext) -> ModelLearnable:
        dxo = from_shareable(shareable)
        if dxo.data_kind != DataKind.WEIGHTS:
            raise ValueError(f"MergingShareableGenerator handles {DataKind.WEIGHTS}, got {dxo.data_kind}")
        base = fl_ctx.get_prop(AppConstants.GLOBAL_MODEL)
        base_weights = base[ModelLearnableKey.WEIGHTS] if base else {}
        meta = dxo.get_meta_props()
        self._collected = meta.get(COLLECTED) or None
        kept = {k: v for k, v in meta.items() if k not in SERVER_ONLY_META}
        return make_model_learnable(merge_into(base_weights, dxo.data or {}), kept)
