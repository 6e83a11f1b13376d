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
from fedssl.flare.constants import BANK_FEATURES, BANK_PARTITIONS, REMOTE_FEATURES, REMOTE_PARTITIONS
from fedssl.flare.fedavg_aggregator import COLLECTED, FedAvgAggregator
from fedssl.flare.feature_bank_collector import FeatureBankCollector
from fedssl.flare.feature_bank_shuttle import FeatureBankShuttle
from fedssl.ops.jobs import REPO_ROOT, build_job, component_specs, job_configs
from tests.unit.flare.fakes import FakeEngine, context, contribution

SITES = ["site-1", "site-2", "site-3"]
GLOBAL = {"w": np.zeros(2, np.float32)}


def server_ctx(tmp_path, collect=True):
    engine = FakeEngine(tmp_path, components={"bank_collector": FeatureBankCollector()} if collect else None)
    return context(engine=engine, props={AppConstants.GLOBAL_MODEL: make_model_learnable(GLOBAL, {}),
                                         AppConstants.CURRENT_ROUND: 0})


def site_bank(i, k=3):
    """Site i's bank: feature rows (i, j) so every row says where it came from; partitions j % 2."""
    return {BANK_FEATURES: np.stack([np.full(k, i, np.float32), np.arange(k, dtype=np.float32)], 1),
            BANK_PARTITIONS: np.arange(k, dtype=np.int64) % 2}


def test_collector_validates_and_returns_the_bank():
    dxo = DXO(DataKind.WEIGHTS, data={}, meta={BANK_FEATURES: np.ones((2, 3), np.float64),
                                               BANK_PARTITIONS: np.array([0, 1], np.int32)})
    out = FeatureBankCollector().collect("site-1", dxo)
    assert set(out) == {BANK_FEATURES, BANK_PARTITIONS}
    assert out[BANK_FEATURES].dtype == np.float32 and out[BANK_PARTITIONS].dtype == np.int64
    with pytest.raises(ContributionError, match="site-2 sent no feature bank.*feature_exchange=false.*collectors=\\[\\]"):
        FeatureBankCollector().collect("site-2", DXO(DataKind.WEIGHTS, data={}, meta={}))
    with pytest.raises(ValueError, match="site-3 sent bank partitions of shape"):
        FeatureBankCollector().collect("site-3", DXO(DataKind.WEIGHTS, data={}, meta={
            BANK_FEATURES: np.ones((2, 3), np.float32), BANK_PARTITIONS: np.zeros(3, np.int64)}))


def aggregate(tmp_path, collect=True):
    agg, c = FedAvgAggregator(collectors=["bank_collector"] if collect else []), server_ctx(tmp_path, collect)
    for i, site in enumerate(SITES):
        assert agg.accept(contribution(site, {"w": np.full(2, i, np.float32)}, {"num_samples": 1, **site_bank(i)}), c)
    out = agg.aggregate(c)
    out.set_header("current_round", 1)
    return out


def test_each_site_receives_the_others_banks_shuffled_and_without_names(tmp_path):
    base = aggregate(tmp_path)
    shuttle = FeatureBankShuttle(seed=0)
    for i, site in enumerate(SITES):
        copy = Shareable()
        copy.update(base)  # what FLARE hands each site's filter chain
        out = from_shareable(shuttle.process(copy, context(peer_site=site)))
        feats, parts = out.get_meta_prop(REMOTE_FEATURES), out.get_meta_prop(REMOTE_PARTITIONS)
        others = [j for j in range(len(SITES)) if j != i]
        expected = sorted((float(j), float(r)) for j in others for r in range(3))
        assert sorted(map(tuple, feats.tolist())) == expected  # exactly the other sites' rows, never its own
        assert [tuple(f) for f in feats.tolist()] != expected  # shuffled, not in site order
        np.testing.assert_array_equal(parts, feats[:, 1].astype(np.int64) % 2)  # each row keeps its partition id
        meta = out.get_meta_props()
        assert COLLECTED not in meta and not any(s in json.dumps(sorted(map(str, meta))) for s in SITES)


def test_fedmoco_exchanges_no_bank(tmp_path):
    base = aggregate(tmp_path, collect=False)
    assert COLLECTED not in from_shareable(base).get_meta_props()
    out = from_shareable(FeatureBankShuttle(seed=0).process(base, context(peer_site="site-1")))
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
