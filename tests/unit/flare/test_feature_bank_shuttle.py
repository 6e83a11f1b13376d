import numpy as np
import pytest
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.shareable import Shareable

from fedssl.flare.constants import REMOTE_FEATURES, REMOTE_PARTITIONS
from fedssl.flare.fedavg_aggregator import COLLECTED
from fedssl.flare.feature_bank_shuttle import FeatureBankShuttle
from tests.unit.flare.fakes import context

SITES = ["site-1", "site-2", "site-3"]


def broadcast():
    collected = {s: {"bank_features": np.full((4, 2), i + 1, np.float32), "bank_partitions": np.full(4, i, np.int64)}
                 for i, s in enumerate(SITES)}
    dxo = DXO(DataKind.WEIGHTS, data={"w": np.zeros(2)}, meta={COLLECTED: collected, "aggregated_sites": 3})
    s = dxo.to_shareable()
    s.set_header("current_round", 1)
    return s


def per_site_copy(base: Shareable) -> Shareable:
    """What FLARE hands each site's filter chain: a shallow copy sharing the DXO underneath."""
    c = Shareable()
    c.update(base)
    return c


def test_each_site_gets_all_others_never_its_own_fresh_per_site():
    base = broadcast()
    f = FeatureBankShuttle(seed=0)
    outs = {}
    for i, site in enumerate(SITES):
        out = from_shareable(f.process(per_site_copy(base), context(peer_site=site)))
        feats, parts = out.get_meta_prop(REMOTE_FEATURES), out.get_meta_prop(REMOTE_PARTITIONS)
        assert feats.shape == (8, 2) and parts.shape == (8,)
        assert i not in set(parts.tolist()) and set(parts.tolist()) == set(range(3)) - {i}
        assert float(i + 1) not in set(feats[:, 0].tolist())
        assert out.get_meta_prop(COLLECTED) is None  # no site names travel
        outs[site] = feats
    # the shared broadcast was never edited: it still holds every bank and no remote bank
    base_dxo = from_shareable(base)
    assert sorted(base_dxo.get_meta_prop(COLLECTED)) == SITES and base_dxo.get_meta_prop(REMOTE_FEATURES) is None
    assert outs["site-1"] is not outs["site-2"]


def test_remote_bank_is_shuffled():
    out = from_shareable(FeatureBankShuttle(seed=3).process(per_site_copy(broadcast()), context(peer_site="site-1")))
    parts = out.get_meta_prop(REMOTE_PARTITIONS).tolist()
    assert parts != sorted(parts)


def test_refuses_to_run_without_a_receiving_site():
    with pytest.raises(RuntimeError, match="server task-data filter"):
        FeatureBankShuttle().process(broadcast(), context())
