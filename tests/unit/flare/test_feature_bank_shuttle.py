import numpy as np
import pytest
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.shareable import Shareable

from fedssl.flare.constants import COLLECTED, REMOTE_FEATURES, REMOTE_PARTITIONS
from fedssl.flare.feature_bank_shuttle import FeatureBankShuttle
from tests.unit.flare.fakes import context

SITES = ["site-1", "site-2", "site-3"]


def broadcast():
    """Site i's 4 rows are the unit vector e_i with partition id i."""
    collected = {s: {"bank_features": np.tile(np.eye(3, dtype=np.float32)[i], (4, 1)), "bank_partitions": np.full(4, i, np.int64)}
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
    f = FeatureBankShuttle(bank_size=8)
    outs = {}
    for i, site in enumerate(SITES):
        out = from_shareable(f.process(per_site_copy(base), context(peer_site=site)))
        feats, parts = out.get_meta_prop(REMOTE_FEATURES), out.get_meta_prop(REMOTE_PARTITIONS)
        assert feats.shape == (8, 3) and parts.shape == (8,)
        assert i not in set(parts.tolist()) and set(parts.tolist()) == set(range(3)) - {i}
        assert not feats[:, i].any()  # none of its own rows
        assert out.get_meta_prop(COLLECTED) is None  # no site names travel
        outs[site] = feats
    # the shared broadcast was never edited: it still holds every bank and no remote bank
    base_dxo = from_shareable(base)
    assert sorted(base_dxo.get_meta_prop(COLLECTED)) == SITES and base_dxo.get_meta_prop(REMOTE_FEATURES) is None
    assert outs["site-1"] is not outs["site-2"]


def test_remote_bank_is_shuffled_by_a_server_secret_not_a_config_seed(monkeypatch):
    """The order comes from a secret the server draws at start (``secrets.randbits``, stubbed here with fixed values),
    never from the job configuration: the same secret gives the same order, other secrets other orders, and none
    is the senders' order (site-2's four rows, then site-3's: partitions [1]*4 + [2]*4)."""
    import types

    import fedssl.flare.feature_bank_shuttle as shuttle_module

    def order(secret):
        monkeypatch.setattr(shuttle_module, "secrets", types.SimpleNamespace(randbits=lambda bits: secret))
        out = from_shareable(FeatureBankShuttle(bank_size=8).process(per_site_copy(broadcast()), context(peer_site="site-1")))
        return out.get_meta_prop(REMOTE_PARTITIONS).tolist()

    orders = {secret: order(secret) for secret in (1, 2, 3)}
    assert order(1) == orders[1]  # reproducible from the secret alone
    assert all(sorted(o) == [1] * 4 + [2] * 4 and o != sorted(o) for o in orders.values())
    assert len({tuple(o) for o in orders.values()}) == 3
    with pytest.raises(TypeError):
        FeatureBankShuttle(seed=0)  # a job configuration cannot choose the shuffle


def test_remote_bank_has_the_same_size_whatever_the_number_of_sites():
    """K = 6 rows whether 1 or 2 other sites sent banks: the size does not tell a site how many others there are."""
    two = {k: v for k, v in from_shareable(broadcast()).get_meta_prop(COLLECTED).items() if k != "site-3"}
    small = DXO(DataKind.WEIGHTS, data={"w": np.zeros(2)}, meta={COLLECTED: two}).to_shareable()
    shuttle = FeatureBankShuttle(bank_size=6)
    for base in (small, broadcast()):
        parts = from_shareable(shuttle.process(per_site_copy(base), context(peer_site="site-1"))).get_meta_prop(REMOTE_PARTITIONS)
        assert parts.shape == (6,)


def test_refuses_to_run_without_a_receiving_site():
    with pytest.raises(RuntimeError, match="server task-data filter"):
        FeatureBankShuttle(bank_size=4).process(broadcast(), context())
