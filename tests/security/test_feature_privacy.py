"""A curious site against FCL's feature exchange: what it receives, what the server keeps, what the noise hides.

- nothing derived from one site (its bank, its loss) enters the global model that the persistor saves;
- a receiving site that knows the whole job configuration cannot attribute remote rows to their sender;
- the size of the remote bank tells it neither the number of sites nor how full their banks are;
- the perturbation noise cannot be subtracted by someone who knows the configuration;
- a malformed bank is dropped at the server and never forwarded.
"""

import zlib

import numpy as np
import pytest
from nvflare.apis.dxo import from_shareable
from nvflare.apis.shareable import Shareable
from nvflare.app_common.abstract.model import ModelLearnableKey, make_model_learnable
from nvflare.app_common.app_constant import AppConstants

from fedssl.core.memory_bank import remote_bank_for
from fedssl.core.privacy import perturb_features
from fedssl.flare.constants import BANK_FEATURES, BANK_PARTITIONS, COLLECTED, REMOTE_FEATURES, REMOTE_PARTITIONS
from fedssl.flare.fedavg_aggregator import FedAvgAggregator
from fedssl.flare.feature_bank_collector import FeatureBankCollector
from fedssl.flare.feature_bank_perturbation import FeatureBankPerturbation
from fedssl.flare.feature_bank_shuttle import FeatureBankShuttle
from fedssl.flare.merging_shareable_generator import MergingShareableGenerator
from tests.unit.flare.fakes import FakeEngine, context, contribution

K, D, S = 9, 32, 4
SITES = ["site-1", "site-2", "site-3"]
GLOBAL = {"w": np.zeros(2, np.float32)}


def site_bank(i):
    """Site i's rows e_(9i + j): a row says exactly which site (and slot) it came from."""
    return np.eye(D, dtype=np.float32)[K * i: K * i + K], np.arange(K, dtype=np.int64) % S


def server(tmp_path):
    collector = FeatureBankCollector(bank_size=K, proj_dim=D, n_partitions=S)
    ctx = context(engine=FakeEngine(tmp_path, components={"bank_collector": collector}),
                  props={AppConstants.GLOBAL_MODEL: make_model_learnable(GLOBAL, {}), AppConstants.CURRENT_ROUND: 0})
    return FedAvgAggregator(collectors=["bank_collector"]), ctx


def aggregate_banks(tmp_path, banks):
    agg, ctx = server(tmp_path)
    accepted = {}
    for site, (f, p) in banks.items():
        meta = {"num_samples": 1, "loss": 0.5, BANK_FEATURES: f, BANK_PARTITIONS: p}
        accepted[site] = agg.accept(contribution(site, {"w": np.ones(2, np.float32)}, meta), ctx)
    return agg.aggregate(ctx), accepted, ctx


def receive(shuttle, base, site):
    copy = Shareable()
    copy.update(base)
    out = from_shareable(shuttle.process(copy, context(peer_site=site)))
    return out.get_meta_prop(REMOTE_FEATURES), out.get_meta_prop(REMOTE_PARTITIONS)


def test_global_model_and_its_meta_carry_no_bank_loss_or_site_name(tmp_path):
    aggregate, _, ctx = aggregate_banks(tmp_path, {s: site_bank(i) for i, s in enumerate(SITES)})
    gen = MergingShareableGenerator()
    learnable = gen.shareable_to_learnable(aggregate, ctx)  # what the persistor saves (weights + meta)
    assert learnable[ModelLearnableKey.META] == {}
    assert not any(s in repr(learnable) for s in SITES)
    # the banks still reach the next broadcast (for the per-site shuttle), once
    first = from_shareable(gen.learnable_to_shareable(learnable, ctx))
    assert sorted(first.get_meta_prop(COLLECTED)) == SITES
    assert COLLECTED not in from_shareable(gen.learnable_to_shareable(learnable, ctx)).get_meta_props()


def attribution_with_config_seed(feats_received, banks, site, seed=0, round_idx=1):
    """The attack on a shuffle seeded from the configuration: a site that knows the seed replays the shuttle on
    stand-in banks of the same shapes whose rows carry their sender's index, and reads each received row's sender
    off the replayed order.  Returns the share of rows it attributes correctly."""
    standins = {s: (np.tile(np.eye(D, dtype=np.float32)[SITES.index(s)], (b[0].shape[0], 1)), b[1]) for s, b in banks.items()}
    replay = np.random.default_rng([seed, round_idx, zlib.crc32(site.encode())])
    guessed, _ = remote_bank_for(standins, site, feats_received.shape[0], replay)
    truth = feats_received.argmax(axis=1) // K
    return float(np.mean(guessed.argmax(axis=1) == truth))


def test_a_site_knowing_the_job_config_cannot_attribute_remote_rows(tmp_path):
    banks = {s: site_bank(i) for i, s in enumerate(SITES)}
    base, _, _ = aggregate_banks(tmp_path, banks)
    base.set_header("current_round", 1)
    rates = []
    for _ in range(20):  # 20 server starts, 20 secrets
        feats, _ = receive(FeatureBankShuttle(bank_size=2 * K), base, "site-1")
        rates.append(attribution_with_config_seed(feats, banks, "site-1"))
    # two senders: a guess is right half of the time (a shuffle seeded from the job config: 18 of 18)
    assert 0.3 < np.mean(rates) < 0.7 and max(rates) < 1.0


#: filled rows the other sites (site-2 .. site-n; site i holds partition i mod S) offer site-1, by partition id
OTHERS_FILLED = {(3, K): {1: 9, 2: 9}, (6, K): {1: 9, 2: 9, 3: 9, 0: 9}, (3, 5): {1: 5, 2: 5}, (6, 2): {1: 4, 2: 2, 3: 2, 0: 2}}


@pytest.mark.parametrize("n_sites, filled", [(3, K), (6, K), (3, 5), (6, 2)])
def test_remote_bank_size_reveals_neither_site_count_nor_fill_level(n_sites, filled, tmp_path):
    names = [f"site-{i}" for i in range(1, n_sites + 1)]
    banks = {}
    for i, s in enumerate(names):
        f = np.eye(D, dtype=np.float32)[np.arange(K) % D]
        p = np.full(K, -1, np.int64)
        p[:filled] = i % S
        banks[s] = (f, p)
    agg, ctx = server(tmp_path)
    ctx.get_engine().sites = names
    for s, (f, p) in banks.items():
        assert agg.accept(contribution(s, {"w": np.ones(2, np.float32)},
                                       {"num_samples": 1, BANK_FEATURES: f, BANK_PARTITIONS: p}), ctx)
    feats, parts = receive(FeatureBankShuttle(bank_size=K), agg.aggregate(ctx), names[0])
    assert feats.shape == (K, D) and parts.shape == (K,)
    # the others hold >= K filled rows between them: K of those, no padding (-1) and none of site-1's own rows
    counts = dict(zip(*np.unique(parts, return_counts=True)))
    available = OTHERS_FILLED[n_sites, filled]
    assert sum(counts.values()) == K and all(0 < n <= available.get(int(p), 0) for p, n in counts.items()), counts


def test_perturbation_noise_cannot_be_subtracted_with_a_known_seed():
    """With a seed from the configuration the receiver regenerates the noise n, and since f is a unit vector
    it recovers f from g = (f + n) / |f + n| exactly; the site-secret noise leaves it with nothing better than g."""
    rng = np.random.default_rng(0)
    f = rng.standard_normal((200, 128)).astype(np.float32)
    f /= np.linalg.norm(f, axis=1, keepdims=True)
    from nvflare.apis.dxo import DXO, DataKind
    s = DXO(DataKind.WEIGHTS, data={}, meta={BANK_FEATURES: f}).to_shareable()
    g = from_shareable(FeatureBankPerturbation(sigma=0.1).process(s, context())).get_meta_prop(BANK_FEATURES)
    noise = np.random.default_rng([0, 0]).normal(0.0, 0.1, size=f.shape).astype(np.float32)  # the old filter's draw
    # solve |c g - n| = 1 for c > 0, then f = c g - n
    gn = (g * noise).sum(1)
    with np.errstate(invalid="ignore"):  # no real solution for many rows: the guessed noise is not the real one
        c = gn + np.sqrt(gn**2 - (noise**2).sum(1) + 1)
    recovered = c[:, None] * g - noise
    cos = (recovered * f).sum(1) / np.linalg.norm(recovered, axis=1)
    assert np.nanmean(cos) < 0.9  # the old filter with seed 0: cosine 1.000 (exact recovery)
    with pytest.raises(TypeError):
        FeatureBankPerturbation(sigma=0.1, seed=0)  # no seed can be configured
    # the same perturbation function with the attacker's noise recovers f exactly: the attack works when it can
    g_old = perturb_features(f, 0.1, np.random.default_rng([0, 0]))
    gn = (g_old * noise).sum(1)
    rec = (gn + np.sqrt(gn**2 - (noise**2).sum(1) + 1))[:, None] * g_old - noise
    assert np.allclose(rec, f, atol=1e-4)


@pytest.mark.parametrize("sigma", [0, -0.1, 0.001, 5.0, float("nan"), float("inf"), "0.1", True, None])
def test_a_misconfigured_perturbation_refuses_to_run(sigma):
    with pytest.raises(ValueError, match="sigma="):
        FeatureBankPerturbation(sigma=sigma)


@pytest.mark.parametrize("attack", ["not unit norm", "partition out of range", "too many rows", "wrong width",
                                    "float64 overflow", "complex"])
def test_a_malformed_bank_is_dropped_and_never_forwarded(attack, tmp_path, caplog):
    f, p = site_bank(2)
    bad = {
        "not unit norm": (f * 3, p),
        "partition out of range": (f, p + S),
        "too many rows": (np.eye(D, dtype=np.float32)[: K + 1], np.zeros(K + 1, np.int64)),
        "wrong width": (np.eye(D + 1, dtype=np.float32)[:K], p),
        "float64 overflow": (np.where(f > 0, 1e300, 0.0), p),
        "complex": (f.astype(np.complex64), p),
    }[attack]
    base, accepted, _ = aggregate_banks(tmp_path, {"site-1": site_bank(0), "site-2": site_bank(1), "site-3": bad})
    assert accepted == {"site-1": True, "site-2": True, "site-3": False} and "site-3" in caplog.text
    base.set_header("current_round", 1)
    feats, parts = receive(FeatureBankShuttle(bank_size=K), base, "site-1")
    origin = feats[parts >= 0].argmax(axis=1) // K
    assert set(origin.tolist()) == {1}  # only site-2's rows reach site-1; site-3's bank went nowhere
