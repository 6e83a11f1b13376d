"""FCL's bank exchange on the server: FeatureBankCollector (through FedAvgAggregator's collectors hook), then
the FeatureBankShuttle: every site gets the other sites' banks, shuffled, without names; FedMoCo gets none."""

import json
import os

import numpy as np
import pytest
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.shareable import Shareable
from nvflare.app_common.abstract.model import make_model_learnable
from nvflare.app_common.app_constant import AppConstants

from fedssl.core.state_dict import ContributionError
from fedssl.flare.constants import BANK_FEATURES, BANK_PARTITIONS, COLLECTED, REMOTE_FEATURES, REMOTE_PARTITIONS
from fedssl.flare.fedavg_aggregator import FedAvgAggregator
from fedssl.flare.feature_bank_collector import FeatureBankCollector
from fedssl.flare.feature_bank_shuttle import FeatureBankShuttle
from fedssl.flare.merging_shareable_generator import MergingShareableGenerator
from fedssl.ops.jobs import REPO_ROOT, build_job, component_specs, job_configs
from tests.unit.flare.fakes import FakeEngine, context, contribution

SITES = ["site-1", "site-2", "site-3"]
GLOBAL = {"w": np.zeros(2, np.float32)}
K, D = 3, 9  # row j of site i is the unit vector e_(3i + j): every row says where it came from


def collector(**kw):
    return FeatureBankCollector(**{"bank_size": K, "proj_dim": D, "n_partitions": 2, **kw})


def server_ctx(tmp_path, collect=True):
    engine = FakeEngine(tmp_path, components={"bank_collector": collector()} if collect else None)
    return context(engine=engine, props={AppConstants.GLOBAL_MODEL: make_model_learnable(GLOBAL, {}),
                                         AppConstants.CURRENT_ROUND: 0})


def site_bank(i, k=K):
    return {BANK_FEATURES: np.eye(D, dtype=np.float32)[3 * i: 3 * i + k],
            BANK_PARTITIONS: np.arange(k, dtype=np.int64) % 2}


def test_collector_validates_and_returns_the_bank():
    dxo = DXO(DataKind.WEIGHTS, data={}, meta={BANK_FEATURES: np.eye(D)[:2],
                                               BANK_PARTITIONS: np.array([0, 1], np.int32)})
    out = collector().collect("site-1", dxo)
    assert set(out) == {BANK_FEATURES, BANK_PARTITIONS}
    assert out[BANK_FEATURES].dtype == np.float32 and out[BANK_PARTITIONS].dtype == np.int64
    with pytest.raises(ContributionError, match="site-2 sent no feature "
                                                "bank.*feature_exchange=false.*collectors=\\[\\]"):
        collector().collect("site-2", DXO(DataKind.WEIGHTS, data={}, meta={}))
    with pytest.raises(ValueError, match="site-3 sent its bank partition ids with shape"):
        collector().collect("site-3", DXO(DataKind.WEIGHTS, data={}, meta={
            BANK_FEATURES: np.eye(D, dtype=np.float32)[:2], BANK_PARTITIONS: np.zeros(3, np.int64)}))
    with pytest.raises(ValueError, match="site-4 sent a feature bank of shape \\(4, 9\\)"):  # more rows than K
        collector().collect("site-4", DXO(DataKind.WEIGHTS, data={}, meta={
            BANK_FEATURES: np.eye(D, dtype=np.float32)[:4], BANK_PARTITIONS: np.zeros(4, np.int64)}))


def test_collector_forwards_a_row_once_and_forgets_with_the_run():
    """Issue 45: a row re-sent round after round let a receiver link it across rounds; the server forwards each row
    of a site once, also when a client re-sends its whole bank, and forgets the digests when a run starts."""
    from nvflare.apis.event_type import EventType
    c = collector()
    rows = np.eye(D, dtype=np.float32)

    def sent(site, idx):
        meta = {BANK_FEATURES: rows[idx], BANK_PARTITIONS: np.zeros(len(idx), np.int64)}
        dxo = DXO(DataKind.WEIGHTS, data={}, meta=meta)
        return c.collect(site, dxo)[BANK_FEATURES].argmax(axis=1).tolist()

    assert sent("site-1", [0, 1]) == [0, 1]
    assert sent("site-1", [0, 1, 2]) == [2]  # the whole bank again: only the new row
    assert sent("site-2", [0, 1]) == [0, 1]  # per site
    c.handle_event(EventType.START_RUN, context())
    assert sent("site-1", [0, 1]) == [0, 1]


@pytest.mark.parametrize("kwargs", [{"bank_size": 0}, {"proj_dim": "128"}, {"n_partitions": True}])
def test_collector_arguments_are_checked(kwargs):
    with pytest.raises(ValueError, match=f"{next(iter(kwargs))}="):
        collector(**kwargs)


def aggregate(tmp_path, collect=True):
    agg, c = FedAvgAggregator(collectors=["bank_collector"] if collect else []), server_ctx(tmp_path, collect)
    for i, site in enumerate(SITES):
        assert agg.accept(contribution(site, {"w": np.full(2, i, np.float32)}, {"num_samples": 1, **site_bank(i)}), c)
    out = agg.aggregate(c)
    out.set_header("current_round", 1)
    return out


def test_each_site_receives_the_others_banks_shuffled_and_without_names(tmp_path):
    base = aggregate(tmp_path)
    shuttle = FeatureBankShuttle(bank_size=K)
    for i, site in enumerate(SITES):
        copy = Shareable()
        copy.update(base)  # what FLARE hands each site's filter chain
        out = from_shareable(shuttle.process(copy, context(peer_site=site, engine=FakeEngine(tmp_path / "server"))))
        feats, parts = out.get_meta_prop(REMOTE_FEATURES), out.get_meta_prop(REMOTE_PARTITIONS)
        origin = feats.argmax(axis=1)  # 3 * site + row
        others = {3 * j + r for j in range(len(SITES)) if j != i for r in range(K)}
        assert len(set(origin.tolist())) == K and set(origin.tolist()) <= others  # as many as it shared, never its own
        np.testing.assert_array_equal(parts, (origin % 3) % 2)  # each row keeps its partition id
        meta = out.get_meta_props()
        assert COLLECTED not in meta and not any(s in json.dumps(sorted(map(str, meta))) for s in SITES)


def test_fedmoco_exchanges_no_bank(tmp_path):
    base = aggregate(tmp_path, collect=False)
    assert COLLECTED not in from_shareable(base).get_meta_props()
    out = from_shareable(FeatureBankShuttle(bank_size=K).process(base, context(peer_site="site-1")))
    assert out.get_meta_prop(REMOTE_FEATURES) is None and out.get_meta_prop(REMOTE_PARTITIONS) is None


def server_args(job_dir, comp_id):
    for path, config in job_configs(job_dir):
        for comp in component_specs(config):
            if comp["id"] == comp_id and path.endswith("config_fed_server.json"):
                return comp
    raise AssertionError(f"{job_dir}: no server component {comp_id}")


@pytest.mark.parametrize("row", ["FCL", "FedMoCo"])
def test_fcl_job_collects_banks_and_table7_fedmoco_turns_it_off(row, tmp_path):
    from fedssl.experiments.table7 import ROWS

    name, job, sets = next(r for r in ROWS if r[0] == row)
    out = build_job(os.path.join(REPO_ROOT, "jobs", job), str(tmp_path / name), profile="quick", sets=sets)
    collectors = server_args(out, "aggregator")["args"]["collectors"]
    assert server_args(out, "bank_collector")["path"] == "fedssl.flare.feature_bank_collector.FeatureBankCollector"
    assert collectors == ([] if row == "FedMoCo" else ["bank_collector"])
    trainer = next(c for p, cfg in job_configs(out) for c in component_specs(cfg) if c["id"] == "fcl_trainer")["args"]
    # FedMoCo = plain MoCo with FedAvg (FCL sec. 5.1 "Baselines"; Table 6 "Without FE" has its numbers)
    assert (trainer["feature_exchange"], trainer["plain_moco"]) == ((False, True) if row == "FedMoCo"
                                                                    else (True, False))


#: Local CL on the server: sites upload no weight and no bank, so the aggregator expects no key and collects nothing
LOCAL_CL_SETS = ["client.fcl_trainer.federated=false", 'server.aggregator.exclude_patterns=["*"]',
                 "server.aggregator.collectors=[]"]


def test_local_cl_rounds_aggregate_nothing_and_keep_the_global_model(tmp_path):
    """Issue 13 item 6: contributions without weights or bank (FCLExecutor federated=false) pass an aggregator with
    exclude_patterns ["*"] and collectors []; the aggregate is empty, the global model stays as it was, the next
    broadcast carries no remote bank.  With the FCL server (bank collected, every key expected) the same upload is
    refused naming the site, so a half-configured Local CL run fails loudly, not silently."""
    agg, c = FedAvgAggregator(exclude_patterns=["*"], collectors=[]), server_ctx(tmp_path, collect=False)
    for site in SITES:
        assert agg.accept(contribution(site, {}, {"num_samples": 16, "loss": 1.0}), c)
    out = agg.aggregate(c)
    assert from_shareable(out).data == {} and COLLECTED not in from_shareable(out).get_meta_props()
    merged = MergingShareableGenerator().shareable_to_learnable(out, c)
    assert list(merged["weights"]) == ["w"] and np.array_equal(merged["weights"]["w"], GLOBAL["w"])
    out.set_header("current_round", 1)
    sent = from_shareable(FeatureBankShuttle(bank_size=K).process(out, context(peer_site="site-1")))
    assert sent.get_meta_prop(REMOTE_FEATURES) is None
    fcl, c2 = FedAvgAggregator(collectors=["bank_collector"]), server_ctx(tmp_path / "fcl")
    assert not fcl.accept(contribution("site-1", {}, {"num_samples": 16}), c2)
    assert c2.get_prop("fedssl.refusal")["site"] == "site-1"


def test_local_cl_overrides_build_the_job(tmp_path):
    out = build_job(os.path.join(REPO_ROOT, "jobs", "fcl_acdc"), str(tmp_path / "local_cl"), profile="quick",
                    sets=LOCAL_CL_SETS)
    args = server_args(out, "aggregator")["args"]
    assert (args["exclude_patterns"], args["collectors"]) == (["*"], [])
