import numpy as np
from nvflare.apis.dxo import DXO, DataKind
from nvflare.app_common.abstract.model import ModelLearnableKey, make_model_learnable
from nvflare.app_common.app_constant import AppConstants

from fedssl.flare.merging_shareable_generator import MergingShareableGenerator
from tests.unit.flare.fakes import context


def test_keys_missing_from_aggregate_survive_and_meta_is_carried():
    gen = MergingShareableGenerator()
    prev = make_model_learnable({"a": np.zeros(1), "cls_token": np.ones(1)}, {})
    ctx = context(props={AppConstants.GLOBAL_MODEL: prev})
    agg = DXO(DataKind.WEIGHTS, data={"a": np.full(1, 5.0)}, meta={"x": 1}).to_shareable()
    ml = gen.shareable_to_learnable(agg, ctx)
    assert ml[ModelLearnableKey.WEIGHTS]["a"][0] == 5.0 and ml[ModelLearnableKey.WEIGHTS]["cls_token"][0] == 1.0
    assert ml[ModelLearnableKey.META]["x"] == 1
    assert prev[ModelLearnableKey.WEIGHTS]["a"][0] == 0.0  # previous model not mutated


def test_broadcast_never_carries_per_site_bookkeeping():
    from nvflare.apis.dxo import from_shareable

    ml = make_model_learnable({"a": np.zeros(1)}, {"site_losses": {"site-1": 1.0}, "aggregated_sites": 2, "keep": 1})
    meta = from_shareable(MergingShareableGenerator().learnable_to_shareable(ml, context())).get_meta_props()
    assert "site_losses" not in meta and "aggregated_sites" not in meta and meta["keep"] == 1
