"""Shareable generator that merges the aggregate into the previous global model.

FLARE's FullModelShareableGenerator replaces the global weights with whatever was aggregated, so a key
left out of aggregation would vanish.  Here every key of the previous global model survives; the DXO
meta (e.g. feature banks collected by the aggregator) becomes the global model's meta, which
``learnable_to_shareable`` puts on the next broadcast.
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


#: aggregation bookkeeping that stays on the server (per-site losses name the sites)
SERVER_ONLY_META = ("site_losses", "aggregated_sites")


class MergingShareableGenerator(ShareableGenerator):
    def __init__(self):
        super().__init__()
        self._to_shareable = FullModelShareableGenerator()

    def learnable_to_shareable(self, model_learnable: ModelLearnable, fl_ctx: FLContext) -> Shareable:
        meta = {k: v for k, v in (model_learnable.get(ModelLearnableKey.META) or {}).items() if k not in SERVER_ONLY_META}
        return self._to_shareable.learnable_to_shareable(make_model_learnable(model_learnable[ModelLearnableKey.WEIGHTS], meta), fl_ctx)

    def shareable_to_learnable(self, shareable: Shareable, fl_ctx: FLContext) -> ModelLearnable:
        dxo = from_shareable(shareable)
        if dxo.data_kind != DataKind.WEIGHTS:
            raise ValueError(f"MergingShareableGenerator handles {DataKind.WEIGHTS}, got {dxo.data_kind}")
        base = fl_ctx.get_prop(AppConstants.GLOBAL_MODEL)
        base_weights = base[ModelLearnableKey.WEIGHTS] if base else {}
        return make_model_learnable(merge_into(base_weights, dxo.data or {}), dxo.get_meta_props())
