import numpy as np
import pytest
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.shareable import Shareable

from fedssl.flare.constants import COLLECTED, REMOTE_FEATURES, REMOTE_PARTITIONS
from fedssl.flare.feature_bank_shuttle import FeatureBankShuttle
from fedssl.flare.party_folder import SECRETS_DIR_ENV
from tests.unit.flare.fakes import FakeEngine, context

SITES = ["site-1", "site-2", "site-3"]


@pytest.fixture(autouse=True)
def no_secrets_dir(monkeypatch):
    monkeypatch.delenv(SECRETS_DIR_ENV, raising=False)


def to(site, folder):
    """The server's context as it filters the task for ``site``; ``folder``: the server's site config dir."""
    return context(peer_site=site, engine=FakeEngine(folder), site="server")


def broadcast(round_idx=1):
    """Site i's 4 rows are the unit vector e_i with partition id i."""
    collected = {s: {"bank_features": np.tile(np.eye(3, dtype=np.float32)[i], (4, 1)),
                     "bank_partitions": np.full(4, i, np.int64)}
                 for i, s in enumerate(SITES)}
    dxo = DXO(DataKind.WEIGHTS, data={"w": np.zeros(2)}, meta={COLLECTED: collected, "aggregated_sites": 3})
    s = dxo.to_shareable()
    s.set_header("current_round", round_idx)
    return s


def per_site_copy(base: Shareable) -> Shareable:
    """What FLARE hands each site's filter chain: a shallow copy sharing the DXO underneath."""
    c = Shareable()
    c.update(base)
    return c


def test_each_site_gets_all_others_never_its_own_fresh_per_site(tmp_path):
    base = broadcast()
    f = FeatureBankShuttle(bank_size=8)
    outs = {}
    for i, site in enumerate(SITES):
        out = from_shareable(f.process(per_site_copy(base), to(site, tmp_path)))
        feats, parts = out.get_meta_prop(REMOTE_FEATURES), out.get_meta_prop(REMOTE_PARTITIONS)
        assert feats.shape == (4, 3) and parts.shape == (4,)  # as many as it shared
        assert set(parts.tolist()) <= set(range(3)) - {i}
        assert not feats[:, i].any()  # none of its own rows
        assert out.get_meta_prop(COLLECTED) is None  # no site names travel
        outs[site] = feats
    # the shared broadcast was never edited: it still holds every bank and no remote bank
    base_dxo = from_shareable(base)
    assert sorted(base_dxo.get_meta_prop(COLLECTED)) == SITES and base_dxo.get_meta_prop(REMOTE_FEATURES) is None
    assert outs["site-1"] is not outs["site-2"]


def distinct_broadcast(round_idx):
    """Site i's 8 rows are e_(8i) .. e_(8i+7), partition id i: a received row names its sender and slot."""
    collected = {s: {"bank_features": np.eye(24, dtype=np.float32)[8 * i: 8 * i + 8], "bank_partitions": np.full(8, i)}
                 for i, s in enumerate(SITES)}
    s = DXO(DataKind.WEIGHTS, data={"w": np.zeros(2)}, meta={COLLECTED: collected}).to_shareable()
    s.set_header("current_round", round_idx)
    return s


def order(folder, site="site-1", round_idx=1, shuttle=None):
    """The rows (by index) ``site`` receives in round ``round_idx`` from a server whose folder is ``folder``: 8 of
    the other two sites' 16 rows (as many as it shared), in one of 16! / 8! draws."""
    shuttle = shuttle or FeatureBankShuttle(bank_size=16)
    out = from_shareable(shuttle.process(per_site_copy(distinct_broadcast(round_idx)), to(site, folder)))
    return out.get_meta_prop(REMOTE_FEATURES).argmax(axis=1).tolist()


def test_remote_bank_is_shuffled_by_the_servers_kept_secret_not_a_config_seed(tmp_path):
    """The order is a function of the server's secret (its folder's ``feature_bank_shuttle.secret``), the round and
    the receiving site: a second server start on the same folder repeats it, another folder gives another order,
    and none is the senders' order (site-2's rows 8-15, then site-3's rows 16-23)."""
    orders = {k: order(tmp_path / f"server{k}") for k in range(3)}
    assert (tmp_path / "server0" / "feature_bank_shuttle.secret").is_file()
    assert order(tmp_path / "server0") == orders[0]  # a new instance (a restarted server): the same order
    assert all(len(set(o)) == 8 and set(o) <= set(range(8, 24)) and o != sorted(o) for o in orders.values())
    assert len({tuple(o) for o in orders.values()}) == 3
    with pytest.raises(TypeError):
        FeatureBankShuttle(seed=0)  # a job configuration cannot choose the shuffle


def test_a_restarted_server_continues_the_same_sequence_of_orders(tmp_path):
    """Draws are a pure function of (secret, round, site), not of a generator advanced across calls: a server that
    ran rounds 1-3 and one restarted at round 3 hand site-1 the same round-3 order, whatever came before."""
    first = FeatureBankShuttle(bank_size=16)
    seen = {(r, s): order(tmp_path, s, r, first) for r in (1, 2, 3) for s in SITES}
    restarted = FeatureBankShuttle(bank_size=16)
    assert order(tmp_path, "site-1", 3, restarted) == seen[3, "site-1"]
    assert order(tmp_path, "site-1", 3, restarted) == seen[3, "site-1"]  # asking twice changes nothing
    assert len({tuple(seen[r, "site-1"]) for r in (1, 2, 3)}) == 3  # each round its own order


def test_the_secret_file_is_read_once_at_the_first_filtering(tmp_path):
    shuttle = FeatureBankShuttle(bank_size=16)
    assert not any(tmp_path.iterdir())  # building the filter touches no folder (it has no context yet)
    before = order(tmp_path, shuttle=shuttle)
    (tmp_path / "feature_bank_shuttle.secret").unlink()
    assert order(tmp_path, shuttle=shuttle) == before


def test_a_corrupt_secret_stops_the_filter_in_one_line_naming_the_file(tmp_path):
    path = tmp_path / "feature_bank_shuttle.secret"
    path.write_text("not a secret\n")
    path.chmod(0o600)
    with pytest.raises(RuntimeError, match=f"party secret {path} is not 32 hex digits"):
        order(tmp_path)


def test_remote_bank_has_the_same_size_whatever_the_number_of_sites(tmp_path):
    """4 rows (what site-1 shared) whether 1 or 2 other sites sent banks: the size does not tell a site how many
    others there are."""
    two = {k: v for k, v in from_shareable(broadcast()).get_meta_prop(COLLECTED).items() if k != "site-3"}
    small = DXO(DataKind.WEIGHTS, data={"w": np.zeros(2)}, meta={COLLECTED: two}).to_shareable()
    shuttle = FeatureBankShuttle(bank_size=6)
    for base in (small, broadcast()):
        parts = from_shareable(shuttle.process(per_site_copy(base),
                                               to("site-1", tmp_path))).get_meta_prop(REMOTE_PARTITIONS)
        assert parts.shape == (4,)


def test_refuses_to_run_without_a_receiving_site():
    with pytest.raises(RuntimeError, match="server task-data filter"):
        FeatureBankShuttle(bank_size=4).process(broadcast(), context())
