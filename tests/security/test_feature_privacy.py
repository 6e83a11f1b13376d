"""A curious site against FCL's feature exchange: what it receives, what the server keeps, what the noise hides.

- nothing derived from one site (its bank, its loss) enters the global model that the persistor saves;
- a receiving site that knows the whole job configuration and its own secret cannot attribute remote rows to their
  sender: the order comes from the server's secret, kept in the server's own folder;
- the size of the remote bank tells it neither the number of sites nor how much the others shared (it is what the
  site shared itself);
- no row reaches it twice, so rows cannot be linked across rounds by value or lifetime;
- the perturbation noise cannot be subtracted by a receiver that knows the configuration and its own secret: it comes
  from the sender's secret, kept in the sender's own folder;
- a malformed bank is dropped at the server and never forwarded.
"""

import zlib

import numpy as np
import pytest
import torch
from nvflare.apis.dxo import from_shareable
from nvflare.apis.shareable import Shareable
from nvflare.app_common.abstract.model import ModelLearnableKey, make_model_learnable
from nvflare.app_common.app_constant import AppConstants

from fedssl.core.memory_bank import FeatureBank, remote_bank_for
from fedssl.core.party_secret import party_secret
from fedssl.core.privacy import perturb_features
from fedssl.core.seeds import site_seed
from fedssl.flare.constants import BANK_FEATURES, BANK_PARTITIONS, COLLECTED, REMOTE_FEATURES, REMOTE_PARTITIONS
from fedssl.flare.fedavg_aggregator import FedAvgAggregator
from fedssl.flare.feature_bank_collector import FeatureBankCollector
from fedssl.flare.feature_bank_perturbation import FeatureBankPerturbation
from fedssl.flare.feature_bank_shuttle import FeatureBankShuttle
from fedssl.flare.merging_shareable_generator import MergingShareableGenerator
from fedssl.flare.party_folder import SECRETS_DIR_ENV
from tests.unit.flare.fakes import FakeEngine, context, contribution

K, D, S = 9, 32, 4
SITES = ["site-1", "site-2", "site-3"]
GLOBAL = {"w": np.zeros(2, np.float32)}
JOB_SEED = 0


@pytest.fixture(autouse=True)
def no_secrets_dir(monkeypatch):
    monkeypatch.delenv(SECRETS_DIR_ENV, raising=False)


def known_seeds(own_folder):
    """Every seed a curious site could know: small integers (the job configuration's seed among them), every site's
    data seed (``site_seed``: job seed and site names are in the configuration), and its own secrets (its folder)."""
    own = [party_secret(str(own_folder), name) for name in ("feature_bank_perturbation", "feature_bank_shuttle")]
    return list(range(16)) + [site_seed(JOB_SEED, s) for s in SITES] + own


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


def receive(shuttle, base, site, folder):
    """What ``site`` receives from a server whose own folder (site config dir) is ``folder``."""
    copy = Shareable()
    copy.update(base)
    out = from_shareable(shuttle.process(copy, context(peer_site=site, engine=FakeEngine(folder), site="server")))
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


def attribution_with_seed(feats_received, banks, site, seed, round_idx=1):
    """The attack on a shuffle whose seed the site knows: it replays the shuttle on stand-in banks of the same shapes
    whose rows carry their sender's index, and reads each received row's sender off the replayed order.  Returns
    the share of rows it attributes correctly."""
    standins = {s: (np.tile(np.eye(D, dtype=np.float32)[SITES.index(s)], (b[0].shape[0], 1)), b[1])
                for s, b in banks.items()}
    replay = np.random.default_rng([seed, round_idx, zlib.crc32(site.encode())])
    guessed, _ = remote_bank_for(standins, site, feats_received.shape[0], replay)
    truth = feats_received.argmax(axis=1) // K
    return float(np.mean(guessed.argmax(axis=1) == truth))


def test_a_site_knowing_the_job_config_and_its_own_secret_cannot_attribute_remote_rows(tmp_path):
    banks = {s: site_bank(i) for i, s in enumerate(SITES)}
    base, _, _ = aggregate_banks(tmp_path, banks)
    base.set_header("current_round", 1)
    seeds = known_seeds(tmp_path / "site-1")
    rates, perfect = [], 0
    for start in range(10):  # 10 servers, each with its own folder: 10 secrets
        feats, _ = receive(FeatureBankShuttle(bank_size=2 * K), base, "site-1", tmp_path / f"server{start}")
        for seed in seeds:
            rates.append(attribution_with_seed(feats, banks, "site-1", seed))
            perfect += rates[-1] == 1.0
    # two senders: a guess is right half of the time, whatever seed it replays (a known seed: 18 of 18); the server
    # secrets are fresh each run, so a replay is all right by chance with p = 2^-rows: a few such trials happen (2 did
    # once in CI); the known-seed attack below is right in every trial
    assert 0.45 < np.mean(rates) < 0.55 and perfect <= 3, (np.mean(rates), perfect)
    # the attack itself works: against a server whose secret is a seed the site knows, it attributes every row
    leaked = tmp_path / "leaky_server"
    leaked.mkdir()
    (leaked / "feature_bank_shuttle.secret").write_text(f"{seeds[-1]:032x}\n")
    (leaked / "feature_bank_shuttle.secret").chmod(0o600)
    feats, _ = receive(FeatureBankShuttle(bank_size=2 * K), base, "site-1", leaked)
    assert attribution_with_seed(feats, banks, "site-1", seeds[-1]) == 1.0


def test_a_rerun_on_the_servers_folder_repeats_the_order_and_nothing_of_the_secret_travels(tmp_path):
    banks = {s: site_bank(i) for i, s in enumerate(SITES)}
    base, _, _ = aggregate_banks(tmp_path, banks)
    base.set_header("current_round", 1)
    first, _ = receive(FeatureBankShuttle(bank_size=2 * K), base, "site-1", tmp_path / "server")
    again, _ = receive(FeatureBankShuttle(bank_size=2 * K), base, "site-1", tmp_path / "server")
    np.testing.assert_array_equal(first, again)
    secret = party_secret(str(tmp_path / "server"), "feature_bank_shuttle")
    copy = Shareable()
    copy.update(base)
    out = FeatureBankShuttle(bank_size=2 * K).process(copy, context(peer_site="site-1",
                                                                    engine=FakeEngine(tmp_path / "server")))
    assert str(secret) not in repr(out) and f"{secret:032x}" not in repr(out)


@pytest.mark.parametrize("n_sites, filled", [(3, K), (6, K), (3, 5), (6, 2)])
def test_remote_bank_size_reveals_neither_site_count_nor_what_the_others_shared(n_sites, filled, tmp_path):
    """Sites that share alike: each receives exactly as many rows as it shared, whatever the number of sites."""
    names = [f"site-{i}" for i in range(1, n_sites + 1)]
    banks = {}
    for i, s in enumerate(names):
        f = np.eye(D, dtype=np.float32)[(np.arange(K) + K * i) % D]
        p = np.full(K, -1, np.int64)
        p[:filled] = i % S
        banks[s] = (f, p)
    agg, ctx = server(tmp_path)
    ctx.get_engine().sites = names
    for s, (f, p) in banks.items():
        assert agg.accept(contribution(s, {"w": np.ones(2, np.float32)},
                                       {"num_samples": 1, BANK_FEATURES: f, BANK_PARTITIONS: p}), ctx)
    feats, parts = receive(FeatureBankShuttle(bank_size=K), agg.aggregate(ctx), names[0], tmp_path / "server")
    assert feats.shape == (filled, D) and parts.shape == (filled,)
    assert (parts >= 0).all()  # no padding (-1)


def test_a_row_is_delivered_once_so_rows_cannot_be_linked_across_rounds(tmp_path):
    """Issue 45: banks re-sent every round came back round after round until their sender replaced them; a receiver
    linked them across rounds and grouped them by lifetime (100 % of rows with their sender under FedCLF's shuttle,
    84 % under FCL's) and averaged perturbed copies.  Now a row leaves its site once (``export_fresh``) and the
    server forwards a row once even from a client that re-sends its whole bank: over 6 rounds no row reaches
    site-1 twice, so neither its value nor its lifetime links it to anything."""
    rng = np.random.default_rng(0)
    repeats = {}
    # careless: a client that uploads its whole bank every round; undefended: and a server that forwards it all
    for careless, undefended in ((False, False), (True, False), (True, True)):
        senders = {s: FeatureBank(K, D, seed=i) for i, s in enumerate(SITES)}
        collector = FeatureBankCollector(bank_size=K, proj_dim=D, n_partitions=S)
        collector.fresh_rows.history = 0 if undefended else collector.fresh_rows.history
        shuttle, seen, received = FeatureBankShuttle(bank_size=K), {}, 0
        for r in range(6):
            agg = FedAvgAggregator(collectors=["bank_collector"])
            ctx = context(engine=FakeEngine(tmp_path, components={"bank_collector": collector}),
                          props={AppConstants.GLOBAL_MODEL: make_model_learnable(GLOBAL, {}),
                                 AppConstants.CURRENT_ROUND: r})
            for site, bank in senders.items():
                new = rng.standard_normal((4, D)).astype(np.float32)  # a round's 4 new features
                bank.enqueue(torch.as_tensor(new / np.linalg.norm(new, axis=1, keepdims=True)),
                             torch.arange(4) % S)
                f, p = bank.export() if careless else bank.export_fresh()
                assert agg.accept(contribution(site, {"w": np.ones(2, np.float32)},
                                               {"num_samples": 1, BANK_FEATURES: f, BANK_PARTITIONS: p}, r), ctx)
            base = agg.aggregate(ctx)
            base.set_header("current_round", r + 1)
            feats, _ = receive(shuttle, base, "site-1", tmp_path / "server")
            assert undefended or feats.shape == (4, D)  # what site-1 shared this round
            received += feats.shape[0]
            for row in feats:
                seen[row.tobytes()] = seen.get(row.tobytes(), 0) + 1
        assert undefended or received == 24
        repeats[careless, undefended] = sum(n > 1 for n in seen.values()) / len(seen)
    assert repeats[False, False] == repeats[True, False] == 0, repeats  # no row reaches site-1 twice
    assert repeats[True, True] > 0.2, repeats  # undefended: 34 % of the rows came back (K = 9, 4 new a round)


def subtract(g, noise):
    """The attack on the noise: since f is a unit vector, solve |c g - n| = 1 for c > 0, then f = c g - n (exact when
    n is the real noise; rows without a real solution give nan)."""
    gn = (g * noise).sum(1)
    with np.errstate(invalid="ignore"):
        c = gn + np.sqrt(gn**2 - (noise**2).sum(1) + 1)
    return c[:, None] * g - noise


def cosine(a, b):
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_perturbation_noise_cannot_be_subtracted_with_any_seed_the_receiver_knows(tmp_path):
    """site-2 perturbs its bank with noise from its own secret (its folder); site-1 knows the job configuration, the
    round and its own secret, and subtracts the noise every seed it knows would give (as the old filter's
    ``default_rng(seed)``, per round ``[seed, round]``): no guess correlates with the real noise, and no recovery is
    closer to f than the perturbed g it started from.  With site-2's real secret the same attack recovers f exactly."""
    sigma, round_idx = 0.1, 4
    rng = np.random.default_rng(0)
    f = rng.standard_normal((200, 128)).astype(np.float32)
    f /= np.linalg.norm(f, axis=1, keepdims=True)
    from nvflare.apis.dxo import DXO, DataKind
    s = DXO(DataKind.WEIGHTS, data={}, meta={BANK_FEATURES: f}).to_shareable()
    s.set_header("current_round", round_idx)
    sender = context(engine=FakeEngine(tmp_path / "site-2"), site="site-2")
    g = from_shareable(FeatureBankPerturbation(sigma=sigma).process(s, sender)).get_meta_prop(BANK_FEATURES)
    true_noise = np.random.default_rng([party_secret(str(tmp_path / "site-2"), "feature_bank_perturbation"), round_idx])
    true_noise = true_noise.normal(0.0, sigma, size=f.shape).astype(np.float32)
    baseline = float(cosine(g, f).mean())  # what g alone tells: about 0.66 at sigma 0.1
    for seed in known_seeds(tmp_path / "site-1"):
        for entropy in (seed, [seed, 0], [seed, round_idx], [JOB_SEED, seed, round_idx]):
            noise = np.random.default_rng(entropy).normal(0.0, sigma, size=f.shape).astype(np.float32)
            assert abs(np.corrcoef(noise.ravel(), true_noise.ravel())[0, 1]) < 0.05  # chance: about 0.006
            assert np.nanmean(cosine(subtract(g, noise), f)) < baseline  # worse than not trying
    with pytest.raises(TypeError):
        FeatureBankPerturbation(sigma=0.1, seed=0)  # no seed can be configured
    # the attack works when it has the noise: the sender's real secret recovers f exactly
    assert np.allclose(subtract(g, true_noise), f, atol=1e-4)
    assert np.allclose(subtract(perturb_features(f, sigma, np.random.default_rng([0, 0])),
                                np.random.default_rng([0, 0]).normal(0.0, sigma, size=f.shape).astype(np.float32)), f,
                       atol=1e-4)  # the old filter with a configured seed 0: exact recovery


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
    feats, parts = receive(FeatureBankShuttle(bank_size=K), base, "site-1", tmp_path / "server")
    origin = feats[parts >= 0].argmax(axis=1) // K
    assert set(origin.tolist()) == {1}  # only site-2's rows reach site-1; site-3's bank went nowhere
