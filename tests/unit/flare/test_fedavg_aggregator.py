import numpy as np
import pytest
from nvflare.apis.dxo import from_shareable
from nvflare.app_common.abstract.model import make_model_learnable
from nvflare.app_common.app_constant import AppConstants

from nvflare.app_common.app_event_type import AppEventType

from fedssl.flare.constants import COLLECTED, ROUND_PLAN_PROP, ROUND_STATS_PROP
from fedssl.flare.fedavg_aggregator import FedAvgAggregator
from fedssl.flare.feature_bank_collector import FeatureBankCollector
from tests.unit.flare.fakes import FakeEngine, context, contribution

GLOBAL = {"w": np.zeros((2,), np.float32), "b": np.zeros((1,), np.float32)}


def ctx(tmp_path, round_idx=0, glob=GLOBAL, **props):
    return context(engine=FakeEngine(tmp_path, n_clients=6),
                   props={AppConstants.GLOBAL_MODEL: make_model_learnable(glob, {}),
                                                                      AppConstants.CURRENT_ROUND: round_idx, **props})


def bank(v, k=4, d=3):
    """k distinct unit rows near e_(v mod d), partition ids 0..k-1: which site's bank arrived shows in the rows."""
    f = np.zeros((k, d), np.float32)
    angles = 0.1 * np.arange(1, k + 1)
    f[:, int(v) % d], f[:, (int(v) + 1) % d] = np.cos(angles), np.sin(angles)
    return {"bank_features": f, "bank_partitions": np.arange(k, dtype=np.int64)}


def test_weights_by_sample_count_by_hand(tmp_path):
    agg, c = FedAvgAggregator(weighting="num_samples"), ctx(tmp_path)
    assert agg.accept(contribution("site-1", {"w": np.array([1.0, 2.0], np.float32), "b": np.array([0.0], np.float32)},
                                   {"num_samples": 10, "loss": 1.0}), c)
    assert agg.accept(contribution("site-2", {"w": np.array([4.0, 8.0], np.float32), "b": np.array([3.0], np.float32)},
                                   {"num_samples": 30, "loss": 3.0}), c)
    out = from_shareable(agg.aggregate(c))
    # (10 * [1, 2] + 30 * [4, 8]) / 40 = [3.25, 6.5]; b = 30 * 3 / 40 = 2.25
    np.testing.assert_allclose(out.data["w"], [3.25, 6.5])
    np.testing.assert_allclose(out.data["b"], [2.25])
    assert out.data["w"].dtype == np.float32  # the global model's dtype
    # per-site losses go to the round's listeners in memory only, never into the aggregate (persisted)
    assert c.get_prop(ROUND_STATS_PROP) == {"sites": ["site-1", "site-2"], "losses": {"site-1": 1.0, "site-2": 3.0}}
    assert set(out.get_meta_props()) == {"aggregated_sites"}


def test_the_summing_threads_end_with_the_run(tmp_path, monkeypatch):
    """At END_RUN the aggregator stops the running sum's threads (FLARE's process manager otherwise warns "still
    running thread fedssl-sum_0" as the server's job process exits)."""
    import fedssl.flare.fedavg_aggregator as module
    released = []
    monkeypatch.setattr(module, "release_threads", lambda: released.append(True))
    agg = FedAvgAggregator(weighting="num_samples")
    agg.handle_event(AppEventType.ROUND_STARTED, ctx(tmp_path))
    assert not released
    from nvflare.apis.event_type import EventType

    agg.handle_event(EventType.END_RUN, ctx(tmp_path))
    assert released == [True]


def test_uniform_weighting(tmp_path):
    agg, c = FedAvgAggregator(weighting="uniform"), ctx(tmp_path)
    agg.accept(contribution("site-1", {"w": np.array([0.0, 0.0], np.float32), "b": np.zeros(1, np.float32)}), c)
    agg.accept(contribution("site-2", {"w": np.array([2.0, 4.0], np.float32), "b": np.zeros(1, np.float32)}), c)
    np.testing.assert_allclose(from_shareable(agg.aggregate(c)).data["w"], [1.0, 2.0])


def test_bad_contributions_are_rejected_and_never_averaged(tmp_path):
    agg, c = FedAvgAggregator(), ctx(tmp_path)
    good = {"w": np.ones(2, np.float32), "b": np.ones(1, np.float32)}
    assert not agg.accept(contribution("site-1", {"w": np.ones(2, np.float32)}, {"num_samples": 1}), c)  # missing key
    assert not agg.accept(contribution("site-2", {"w": np.ones(3, np.float32), "b": np.ones(1, np.float32)},
                                       {"num_samples": 1}), c)
    assert not agg.accept(contribution("site-3", {"w": np.array([np.nan, 1], np.float32), "b": np.ones(1, np.float32)},
                                       {"num_samples": 1}), c)
    assert not agg.accept(contribution("site-4", good, {}), c)  # no sample count for num_samples weighting
    assert not agg.accept(contribution("site-5", good, {"num_samples": 1}, round_idx=7), c)  # stale round
    assert agg.accept(contribution("site-6", good, {"num_samples": 5}), c)
    assert not agg.accept(contribution("site-6", good, {"num_samples": 5}), c)  # duplicate
    out = from_shareable(agg.aggregate(c))
    np.testing.assert_allclose(out.data["w"], [1.0, 1.0])
    assert out.get_meta_prop("aggregated_sites") == 1


def collecting_ctx(tmp_path, **components):
    return context(engine=FakeEngine(tmp_path, n_clients=6, components=components),
                   props={AppConstants.GLOBAL_MODEL: make_model_learnable(GLOBAL, {}), AppConstants.CURRENT_ROUND: 0})


def collector():
    return FeatureBankCollector(bank_size=4, proj_dim=3, n_partitions=4)


def test_banks_collected_per_site_and_bad_bank_rejected(tmp_path):
    agg, c = FedAvgAggregator(collectors=["bank_collector"]), collecting_ctx(tmp_path, bank_collector=collector())
    w = {"w": np.ones(2, np.float32), "b": np.ones(1, np.float32)}
    assert agg.accept(contribution("site-1", w, {"num_samples": 1, **bank(1.0)}), c)
    bad = bank(2.0)
    bad["bank_features"][0, 0] = np.inf
    assert not agg.accept(contribution("site-2", w, {"num_samples": 1, **bad}), c)
    assert not agg.accept(contribution("site-3", w, {"num_samples": 1}), c)  # FE on but no bank
    assert agg.accept(contribution("site-4", w, {"num_samples": 1, **bank(4.0, k=2)}), c)
    assert not agg.accept(contribution("site-5", {"w": np.ones(3, np.float32), "b": np.ones(1, np.float32)},
                                       {"num_samples": 1, **bank(5.0)}), c)  # bad weights: its bank is not kept
    out = from_shareable(agg.aggregate(c))
    collected = out.get_meta_prop(COLLECTED)
    assert list(collected) == ["site-1", "site-4"] and out.get_meta_prop("aggregated_sites") == 2
    for site, v, k in (("site-1", 1.0, 4), ("site-4", 4.0, 2)):
        f, p = collected[site]["bank_features"], collected[site]["bank_partitions"]
        assert f.dtype == np.float32 and p.dtype == np.int64 and f.shape == (k, 3)
        np.testing.assert_array_equal(f, bank(v, k)["bank_features"])
        np.testing.assert_array_equal(p, np.arange(k))
    agg.reset(c)  # a new round starts with nothing collected
    assert agg.accept(contribution("site-2", w, {"num_samples": 1, **bank(2.0)}), c)
    assert list(from_shareable(agg.aggregate(c)).get_meta_prop(COLLECTED)) == ["site-2"]


def test_without_collectors_banks_are_neither_required_nor_passed_on(tmp_path):
    """FedMoCo (collectors=[]): a bank in the meta is ignored, none is required, nothing is collected."""
    agg, c = FedAvgAggregator(), collecting_ctx(tmp_path, bank_collector=collector())
    w = {"w": np.ones(2, np.float32), "b": np.ones(1, np.float32)}
    assert agg.accept(contribution("site-1", w, {"num_samples": 1}), c)
    assert agg.accept(contribution("site-2", w, {"num_samples": 1, **bank(2.0)}), c)
    assert COLLECTED not in from_shareable(agg.aggregate(c)).get_meta_props()


def test_a_collector_that_is_not_configured_stops_the_run(tmp_path):
    agg, c = FedAvgAggregator(collectors=["bank_collector"]), collecting_ctx(tmp_path)  # no such component
    panics = []
    agg.system_panic = lambda reason, fl_ctx: panics.append(reason)
    w = {"w": np.ones(2, np.float32), "b": np.ones(1, np.float32)}
    assert not agg.accept(contribution("site-1", w, {"num_samples": 1, **bank(1.0)}), c)
    assert len(panics) == 1 and "'bank_collector'" in panics[0] and "collect(site, dxo)" in panics[0]
    with pytest.raises(ValueError, match="collectors="):
        FedAvgAggregator(collectors="bank_collector")


@pytest.mark.parametrize("kwargs, match", [
    ({"weighting": "by_size"}, "weighting='by_size'"),
    ({"max_weight": 0}, "max_weight=0"),
    ({"max_weight": float("inf")}, "max_weight=inf"),
    ({"max_update_ratio": -1}, "max_update_ratio=-1"),
    ({"average_excluded_at_end": "yes"}, "average_excluded_at_end='yes'"),
])
def test_constructor_errors_name_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FedAvgAggregator(**kwargs)


def test_optional_prefix_groups_follow_the_servers_round_plan(tmp_path):
    """The workflow's plan, not the first arrival, says whether a round carries the target network."""
    glob = {"online.w": np.zeros(2, np.float32), "target.w": np.zeros(2, np.float32)}
    online, target = {"online.w": np.ones(2, np.float32)}, {"target.w": np.ones(2, np.float32)}
    agg = FedAvgAggregator(weighting="uniform", optional_prefixes=["target."])
    c = ctx(tmp_path, glob=glob, **{ROUND_PLAN_PROP: {"round": 0, "optional": False}})
    # a first arrival that carries the target cannot make the round's key set: it is refused, the honest sites are not
    assert not agg.accept(contribution("site-1", {**online, **target}), c)
    assert agg.accept(contribution("site-2", online), c)
    assert agg.accept(contribution("site-3", online), c)
    assert set(from_shareable(agg.aggregate(c)).data) == {"online.w"}
    agg.reset(c)
    c = ctx(tmp_path, glob=glob, **{ROUND_PLAN_PROP: {"round": 0, "optional": True}})
    assert not agg.accept(contribution("site-1", online), c)  # the plan says the target comes along
    assert agg.accept(contribution("site-2", {**online, **target}), c)
    assert not agg.accept(contribution("site-3", target), c)  # online is always required
    stale = ctx(tmp_path, glob=glob, **{ROUND_PLAN_PROP: {"round": 5, "optional": True}})
    assert not agg.accept(contribution("site-4", {**online, **target}), stale)  # no plan for this round: refused


def test_excluded_keys_are_left_out_then_averaged_in_the_last_round(tmp_path):
    agg = FedAvgAggregator(weighting="uniform", exclude_patterns=["b"], average_excluded_at_end=True)
    agg.handle_event(AppEventType.ROUND_STARTED, context(props={AppConstants.NUM_ROUNDS: 2}))
    c = ctx(tmp_path, round_idx=0)
    assert agg.accept(contribution("site-1", {"w": np.array([1.0, 1.0], np.float32)}), c)
    assert agg.accept(contribution("site-2", {"w": np.array([3.0, 3.0], np.float32)}), c)
    assert set(from_shareable(agg.aggregate(c)).data) == {"w"}  # "b" keeps its global value (the generator merges)
    agg.reset(c)  # last round: the locally kept tensors come along and are averaged once
    c = ctx(tmp_path, round_idx=1)
    assert not agg.accept(contribution("site-3", {"w": np.ones(2, np.float32)}, round_idx=1), c)  # must carry "b" now
    assert agg.accept(contribution("site-1", {"w": np.ones(2, np.float32), "b": np.array([1.0], np.float32)},
                                   round_idx=1), c)
    assert agg.accept(contribution("site-2", {"w": np.ones(2, np.float32), "b": np.array([5.0], np.float32)},
                                   round_idx=1), c)
    np.testing.assert_allclose(from_shareable(agg.aggregate(c)).data["b"], [3.0])


def test_excluded_keys_are_refused_outside_the_last_round_and_for_good_without_average_at_end(tmp_path):
    c = ctx(tmp_path)
    agg = FedAvgAggregator(weighting="uniform", exclude_patterns=["b"], average_excluded_at_end=True)
    # the first arrival carries the locally kept key: it cannot make the round average it
    assert not agg.accept(contribution("site-1", {"w": np.ones(2, np.float32), "b": np.zeros(1, np.float32)}), c)
    assert agg.accept(contribution("site-2", {"w": np.ones(2, np.float32)}), c)
    fedbn = FedAvgAggregator(weighting="uniform", exclude_patterns=["b"])
    fedbn.handle_event(AppEventType.ROUND_STARTED, context(props={AppConstants.NUM_ROUNDS: 1}))  # round 0 is the last
    assert not fedbn.accept(contribution("site-1", {"w": np.ones(2, np.float32), "b": np.zeros(1, np.float32)}), c)
    # a non-excluded key can never be left out
    assert not FedAvgAggregator(exclude_patterns=["b"]).accept(
        contribution("site-3", {"b": np.zeros(1, np.float32)}, {"num_samples": 1}), c)


def _peak_traced_bytes(tmp_path, n_sites, size=200_000):
    """Peak memory traced while FedAvgAggregator takes ``n_sites`` contributions (each built, accepted, dropped,
    as ScatterAndGather frees a result once accepted) and aggregates them."""
    import tracemalloc

    glob = {"w": np.ones(size, np.float32)}
    c = context(engine=FakeEngine(tmp_path, n_clients=n_sites),
                props={AppConstants.GLOBAL_MODEL: make_model_learnable(glob, {}), AppConstants.CURRENT_ROUND: 0})
    agg = FedAvgAggregator(weighting="uniform")
    tracemalloc.start()
    for i in range(1, n_sites + 1):
        assert agg.accept(contribution(f"site-{i}", {"w": np.full(size, 1 + i / 100, np.float32)}), c)
    out = from_shareable(agg.aggregate(c)).data["w"]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    np.testing.assert_allclose(out[:3], [1 + (n_sites + 1) / 200] * 3, rtol=1e-6)  # 1 + mean(1..n) / 100
    return peak


def test_server_memory_does_not_grow_with_the_number_of_sites(tmp_path):
    # a running sum holds one float64 copy of the model whatever the number of sites; holding every site's
    # model would make 12 sites cost ~6x what 2 sites cost
    two, twelve = _peak_traced_bytes(tmp_path / "a", 2), _peak_traced_bytes(tmp_path / "b", 12)
    assert twelve < 1.2 * two, (two, twelve)


def test_a_new_round_forgets_the_last_rounds_contributions(tmp_path):
    agg = FedAvgAggregator(weighting="uniform")
    c0 = ctx(tmp_path)
    assert agg.accept(contribution("site-1", {"w": np.array([2.0, 2.0], np.float32), "b": np.ones(1, np.float32)}), c0)
    np.testing.assert_allclose(from_shareable(agg.aggregate(c0)).data["w"], [2.0, 2.0])
    agg.reset(c0)  # ScatterAndGather resets the aggregator at the start of every round
    c1 = ctx(tmp_path, round_idx=1)
    assert agg.accept(contribution("site-1", {"w": np.array([0.5, 1.0], np.float32), "b": np.zeros(1, np.float32)},
                                   round_idx=1), c1)  # the same site may contribute again in a new round
    np.testing.assert_allclose(from_shareable(agg.aggregate(c1)).data["w"], [0.5, 1.0])


def test_batch_norm_buffers_are_averaged_int64_counter_included(tmp_path):
    """Issue 44: with norm "batch" a U-Net state dict carries running_mean / running_var (float buffers) and
    num_batches_tracked (int64).  The aggregator averages every one by the sites' sample counts and gives the
    counter back as int64."""
    import torch

    from fedssl.models.unet import TINY_FEATURES, UNetEncoder

    def state(mean_offset: float, batches: int) -> dict:
        enc = UNetEncoder(TINY_FEATURES)  # norm "batch", the default
        with torch.no_grad():
            for _ in range(batches):
                enc(torch.rand(4, 1, 32, 32) + mean_offset)
        return {k: v.numpy().copy() for k, v in enc.state_dict().items()}

    torch.manual_seed(0)
    glob, a, b = state(0.0, 0), state(0.0, 2), state(2.0, 7)
    key = "conv_0.conv_0.adn.N."
    assert a[key + "num_batches_tracked"].dtype == np.int64 and not np.allclose(a[key + "running_mean"],
                                                                                 b[key + "running_mean"])
    agg, c = FedAvgAggregator(weighting="num_samples"), ctx(tmp_path, glob=glob)
    assert agg.accept(contribution("site-1", a, {"num_samples": 10}), c)
    assert agg.accept(contribution("site-2", b, {"num_samples": 30}), c)
    out = from_shareable(agg.aggregate(c)).data
    assert set(out) == set(glob)
    for i in range(2):  # by hand, two channels: (10 * a + 30 * b) / 40
        assert out[key + "running_mean"][i] == pytest.approx((10 * a[key + "running_mean"][i]
                                                              + 30 * b[key + "running_mean"][i]) / 40, rel=1e-6)
    np.testing.assert_allclose(out[key + "running_var"], (a[key + "running_var"] + 3 * b[key + "running_var"]) / 4,
                               rtol=1e-6)
    counter = out[key + "num_batches_tracked"]
    assert counter.dtype == np.int64 and int(counter) == 6  # (10 * 2 + 30 * 7) / 40 = 5.75 -> 6 (rounded)


@pytest.mark.parametrize("attacker_first", [True, False])
def test_one_inflated_sample_count_cannot_replace_the_global_model(tmp_path, attacker_first):
    """Issue 45: num_samples = 1,000,000 (the absolute cap) against three sites of 100 made the global model the
    attacker's (cosine 1.000000).  The largest claim now counts at most 5 x the median of the others', whatever
    the arrival order: (3 x 100 x honest + 500 x attacker) / 800."""
    agg, c = FedAvgAggregator(weighting="num_samples"), ctx(tmp_path)
    honest = [contribution(f"site-{i}", {"w": np.array([1.0, 0.0], np.float32), "b": np.zeros(1, np.float32)},
                           {"num_samples": 100}) for i in (1, 2, 3)]
    attacker = contribution("site-4", {"w": np.array([0.0, 8.0], np.float32), "b": np.ones(1, np.float32)},
                            {"num_samples": 1_000_000})
    for s in ([attacker] + honest if attacker_first else honest + [attacker]):
        assert agg.accept(s, c)
    out = from_shareable(agg.aggregate(c)).data
    np.testing.assert_allclose(out["w"], [300 / 800, 500 * 8 / 800])
    np.testing.assert_allclose(out["b"], [500 / 800])
    assert agg.capped == {"site-4": (1_000_000.0, 500.0)}
    # the papers' plain FedAvg (max_weight_ratio 0): the attacker's model, as before
    plain, c2 = FedAvgAggregator(weighting="num_samples", max_weight_ratio=0), ctx(tmp_path / "plain")
    for s in honest + [attacker]:
        assert plain.accept(s, c2)
    w = from_shareable(plain.aggregate(c2)).data["w"]
    assert float(w @ np.array([0.0, 8.0]) / np.linalg.norm(w) / 8.0) > 0.99999


def test_after_the_first_round_a_claim_no_median_can_cap_is_summed_at_once(tmp_path):
    """Issue 46: the relative cap held the round's largest claim until the others' weights were known, a model's
    worth of memory in every round. Once every client has declared its size (round 0), a claim within 5 x the
    smallest other size is summed at once: in round 1 only the attacker's 1,000,000 waits, and the aggregate is
    round 0's, (3 x 100 x honest + 500 x attacker) / 800."""
    agg = FedAvgAggregator(weighting="num_samples")
    honest = {"w": np.array([1.0, 0.0], np.float32), "b": np.zeros(1, np.float32)}
    attacker = {"w": np.array([0.0, 8.0], np.float32), "b": np.ones(1, np.float32)}
    sizes = {"site-1": 100, "site-2": 100, "site-3": 100, "site-4": 1_000_000}
    outs = []
    for round_idx in (0, 1):
        c = context(engine=FakeEngine(tmp_path, n_clients=4),
                    props={AppConstants.GLOBAL_MODEL: make_model_learnable(GLOBAL, {}),
                           AppConstants.CURRENT_ROUND: round_idx})
        agg.reset(c)
        held = []
        for site in ("site-1", "site-4", "site-2", "site-3"):
            assert agg.accept(contribution(site, attacker if site == "site-4" else honest,
                                           {"num_samples": sizes[site]}, round_idx=round_idx), c)
            held.append(None if agg._held is None else agg._held[0])
        outs.append(from_shareable(agg.aggregate(c)).data)
        assert agg.capped == {"site-4": (1_000_000.0, 500.0)}
        # round 0: nothing declared yet, each new largest claim waits; round 1: only the attacker's
        assert held == ["site-1" if round_idx == 0 else None, "site-4", "site-4", "site-4"]
    for out in outs:
        np.testing.assert_allclose(out["w"], [300 / 800, 500 * 8 / 800])
    # a site of 1 among sites of 100: 100 > 5 x 1, so a claim of 100 could be capped and still waits in round 1
    small = FedAvgAggregator(weighting="num_samples")
    for round_idx in (0, 1):
        c = context(engine=FakeEngine(tmp_path, n_clients=3),
                    props={AppConstants.GLOBAL_MODEL: make_model_learnable(GLOBAL, {}),
                           AppConstants.CURRENT_ROUND: round_idx})
        small.reset(c)
        for site, n in (("site-1", 1), ("site-2", 100)):
            assert small.accept(contribution(site, honest, {"num_samples": n}, round_idx=round_idx), c)
        assert small._held[0] == "site-2"
        assert small.accept(contribution("site-3", honest, {"num_samples": 100}, round_idx=round_idx), c)
        np.testing.assert_allclose(from_shareable(small.aggregate(c)).data["w"], [1.0, 0.0])


def test_the_largest_claim_is_capped_by_the_median_of_the_others_not_their_mean(tmp_path):
    """Issue 47 mutation run: with equal honest sizes the median and the mean agree. Sizes 100, 100, 1,000: the
    median is 100 (cap 500), the mean 400 (cap 2,000). (100 + 100 + 1,000) x [1, 0] + 500 x [0, 8] over 1,700."""
    agg, c = FedAvgAggregator(weighting="num_samples"), ctx(tmp_path)
    honest = {"w": np.array([1.0, 0.0], np.float32), "b": np.zeros(1, np.float32)}
    for i, n in enumerate((100, 100, 1000), start=1):
        assert agg.accept(contribution(f"site-{i}", honest, {"num_samples": n}), c)
    assert agg.accept(contribution("site-4", {"w": np.array([0.0, 8.0], np.float32), "b": np.ones(1, np.float32)},
                                   {"num_samples": 10_000}), c)
    out = from_shareable(agg.aggregate(c)).data
    assert agg.capped == {"site-4": (10000.0, 500.0)}
    np.testing.assert_allclose(out["w"], [1200 / 1700, 4000 / 1700], rtol=1e-6)
    np.testing.assert_allclose(out["b"], [500 / 1700], rtol=1e-6)


def test_honest_sizes_within_the_ratio_keep_plain_fedavg(tmp_path):
    agg, c = FedAvgAggregator(weighting="num_samples"), ctx(tmp_path)
    for i, (n, v) in enumerate([(100, 1.0), (300, 2.0), (450, 4.0)], start=1):
        assert agg.accept(contribution(f"site-{i}", {"w": np.full(2, v, np.float32), "b": np.zeros(1, np.float32)},
                                       {"num_samples": n}), c)
    # 450 <= 5 x median(100, 300) = 1000: (100 + 600 + 1800) / 850
    np.testing.assert_allclose(from_shareable(agg.aggregate(c)).data["w"], [2500 / 850] * 2, rtol=1e-6)
    assert agg.capped == {}
    with pytest.raises(ValueError, match="max_weight_ratio=0.5"):
        FedAvgAggregator(max_weight_ratio=0.5)


def test_the_held_claim_waits_in_a_file_not_in_the_servers_memory(tmp_path, monkeypatch, caplog):
    """Issue 46: the round's largest claim waits for the others' weights in an unnamed temporary file, so the
    server holds the running sum and nothing else (a 4 MB model: holding the claim in memory keeps 4 MB traced).
    When no file can be written the claim is held in memory, said once, and the round is the same."""
    import os
    import tempfile
    import tracemalloc

    import fedssl.flare.fedavg_aggregator as module
    from fedssl.core.spill import HeldInMemory, SpilledState
    big = {"w": np.full(1 << 20, 0.9, np.float32), "b": np.ones(1, np.float32)}

    def run_round(agg, traced=True):
        c = ctx(tmp_path, glob=big)
        agg.reset(c)
        tracemalloc.start()
        try:
            for site, n in (("site-1", 10), ("site-2", 12)):  # each in turn the largest claim so far: held
                before = tracemalloc.get_traced_memory()[0]
                s = contribution(site, {"w": np.full(1 << 20, n / 10, np.float32), "b": np.ones(1, np.float32)},
                                 {"num_samples": n})
                accepted = agg.accept(s, c)
                del s
                assert accepted
                held = agg._held[2]
                # the running sum of 1 M float64 values (8 MB) once site-1 is added; never the 4 MB claim on top
                grown = tracemalloc.get_traced_memory()[0] - before
                assert not traced or grown < (8 << 20 if site == "site-2" else 0) + (1 << 20), (site, grown)
        finally:
            tracemalloc.stop()
        assert agg.accept(contribution("site-3", {"w": np.full(1 << 20, 1.0, np.float32), "b": np.ones(1, np.float32)},
                                       {"num_samples": 11}), c)
        return held, from_shareable(agg.aggregate(c)).data

    from nvflare.apis.event_type import EventType

    agg = FedAvgAggregator(weighting="num_samples")
    agg.handle_event(EventType.START_RUN, ctx(tmp_path, glob=big))  # the file goes in the run's folder
    run_dir = FakeEngine(tmp_path).get_workspace().get_run_dir(None)
    real_hold, where = module.hold, []
    monkeypatch.setattr(module, "hold", lambda t, d=None: where.append(d) or real_hold(t, d))
    held, out = run_round(agg)
    assert where == [run_dir, run_dir] and os.listdir(run_dir) == []  # no name in it
    assert isinstance(held, SpilledState) and held._file.closed  # added at the aggregate: its file is gone
    np.testing.assert_allclose(out["w"][:3], (10 * 1.0 + 12 * 1.2 + 11 * 1.0) / 33, rtol=1e-6)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-such-folder"))
    agg = FedAvgAggregator(weighting="num_samples")
    with caplog.at_level("WARNING"):
        with pytest.raises(AssertionError):  # held in memory: the claim is traced
            run_round(agg)
        held, fallback = run_round(agg, traced=False)
    assert isinstance(held, HeldInMemory)
    assert np.array_equal(fallback["w"], out["w"])
    lines = [r.getMessage() for r in caplog.records if "held in memory" in r.getMessage()]
    assert len(lines) == 1 and "FileNotFoundError" in lines[0]


def test_a_held_claim_that_cannot_be_read_back_stops_the_run_instead_of_making_a_global_model(tmp_path, monkeypatch):
    """The server's own file fails half way through the held claim: no partial mean is returned, the run is stopped
    with the reason, and the file is closed."""
    from fedssl.core.spill import SpilledState
    agg, c = FedAvgAggregator(weighting="num_samples"), ctx(tmp_path)
    honest = {"w": np.array([1.0, 0.0], np.float32), "b": np.zeros(1, np.float32)}
    for i, n in enumerate((10, 12), start=1):  # round 0: the larger claim waits
        assert agg.accept(contribution(f"site-{i}", honest, {"num_samples": n}), c)
    held = agg._held[2]
    assert isinstance(held, SpilledState)

    def broken(self, key):
        raise OSError("read error")
        yield

    monkeypatch.setattr(SpilledState, "pieces", broken)
    panics = []
    agg.system_panic = lambda reason, fl_ctx: panics.append(reason)
    out = agg.aggregate(c)
    assert from_shareable_or_none(out) is None and held._file.closed
    assert len(panics) == 1 and "could not be read back whole (OSError: read error)" in panics[0]
    # a second round is whole again
    monkeypatch.undo()
    agg.system_panic = lambda reason, fl_ctx: panics.append(reason)
    agg.reset(c)
    for i, n in enumerate((10, 12), start=1):
        assert agg.accept(contribution(f"site-{i}", honest, {"num_samples": n}), c)
    np.testing.assert_allclose(from_shareable(agg.aggregate(c)).data["w"], [1.0, 0.0])
    assert len(panics) == 1


def from_shareable_or_none(s):
    try:
        return from_shareable(s).data
    except Exception:  # noqa: BLE001 -- an empty Shareable holds no DXO
        return None
