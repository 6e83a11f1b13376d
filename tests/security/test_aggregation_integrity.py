"""One malicious or faulty site against the server's aggregators (FedAvgAggregator, SurgicalAggregator).

Each attack is a contribution built the way an attacker would send it; in every case the round completes for
the honest sites, the global model equals their average bit for bit, and the log names the attacking site.
"""

import json
import logging

import numpy as np
import pytest
from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.fl_constant import ReservedKey
from nvflare.app_common.abstract.model import make_model_learnable
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.app_event_type import AppEventType

from fedssl.core.state_dict import weighted_average
from fedssl.flare.communication_meter import COMM_FILE, CommunicationMeter, register_decomposers
from fedssl.flare.constants import CLASSES_KEY, ROUND_PLAN_PROP
from fedssl.flare.fedavg_aggregator import FedAvgAggregator
from fedssl.flare.surgical_aggregator import SurgicalAggregator
from fedssl.flare.surgical_registration import REGISTRY_PROP, build_registry
from tests.unit.flare.fakes import FakeEngine, context, contribution

GLOBAL = {"enc.w": np.full((3, 2), 0.5, np.float32), "enc.cls": np.zeros(2, np.float32),
          "target.w": np.zeros(2, np.float32), "bn.num_batches_tracked": np.array(4, np.int64)}
HONEST = {
    "site-1": ({"enc.w": np.full((3, 2), 1.0, np.float32), "bn.num_batches_tracked": np.array(10, np.int64)}, 10),
    "site-2": ({"enc.w": np.full((3, 2), 0.25, np.float32), "bn.num_batches_tracked": np.array(20, np.int64)}, 30),
}
ATTACKER = "site-3"


def server_ctx(tmp_path, round_idx=0, plan=False):
    props = {AppConstants.GLOBAL_MODEL: make_model_learnable(GLOBAL, {}), AppConstants.CURRENT_ROUND: round_idx,
             ROUND_PLAN_PROP: {"round": round_idx, "optional": plan}}
    return context(engine=FakeEngine(tmp_path, n_clients=3), props=props)


def honest_average():
    return weighted_average([s for s, _ in HONEST.values()], [n for _, n in HONEST.values()])


def run_round(agg, ctx, attack, attacker_first=True):
    """Feed the attacker's contribution (first, so it could set the round's key set) and the honest ones."""
    order = [attack] if attacker_first else []
    order += [contribution(site, dict(state), {"num_samples": n, "loss": 1.0}) for site, (state, n) in HONEST.items()]
    order += [] if attacker_first else [attack]
    accepted = [agg.accept(s, ctx) for s in order]
    return accepted, from_shareable(agg.aggregate(ctx))


def fedavg():
    return FedAvgAggregator(weighting="num_samples", optional_prefixes=["target."], exclude_patterns=["enc.cls"],
                            average_excluded_at_end=True)


def poisoned(data=None, meta=None, site=ATTACKER, round_idx=0):
    state = dict(HONEST["site-1"][0]) if data is None else data
    return contribution(site, state, {"num_samples": 10, "loss": 1.0} if meta is None else meta, round_idx)


ATTACKS = {
    # keys meant to stay local arrive first: they must not fix the round's key set
    "local class token first": poisoned({**HONEST["site-1"][0], "enc.cls": np.ones(2, np.float32)}),
    "target network first": poisoned({**HONEST["site-1"][0], "target.w": np.ones(2, np.float32)}),
    # values
    "float64 1e300 (inf in float32)": poisoned({**HONEST["site-1"][0], "enc.w": np.full((3, 2), 1e300)}),
    "float32 1e38": poisoned({**HONEST["site-1"][0], "enc.w": np.full((3, 2), 1e38, np.float32)}),
    "NaN": poisoned({**HONEST["site-1"][0], "enc.w": np.full((3, 2), np.nan, np.float32)}),
    "bool weights": poisoned({**HONEST["site-1"][0], "enc.w": np.ones((3, 2), bool)}),
    "complex weights": poisoned({**HONEST["site-1"][0], "enc.w": np.ones((3, 2), np.complex64)}),
    "object array": poisoned({**HONEST["site-1"][0], "enc.w": np.array([["a", None]] * 3, dtype=object)}),
    "float counter": poisoned({**HONEST["site-1"][0], "bn.num_batches_tracked": np.array(2.5)}),
    "wrong shape": poisoned({**HONEST["site-1"][0], "enc.w": np.ones((2, 3), np.float32)}),
    # weights and meta
    "num_samples 1e300": poisoned(meta={"num_samples": 1e300, "loss": 1.0}),
    "num_samples 2e6 > max_weight": poisoned(meta={"num_samples": 2_000_000, "loss": 1.0}),
    "num_samples 5.5": poisoned(meta={"num_samples": 5.5, "loss": 1.0}),
    "num_samples True": poisoned(meta={"num_samples": True, "loss": 1.0}),
    "num_samples '10'": poisoned(meta={"num_samples": "10", "loss": 1.0}),
    "num_samples -4": poisoned(meta={"num_samples": -4, "loss": 1.0}),
    "loss 'abc'": poisoned(meta={"num_samples": 10, "loss": "abc"}),
    "loss 1e400 (inf)": poisoned(meta={"num_samples": 10, "loss": float("inf")}),
    "integer meta key": poisoned(meta={"num_samples": 10, "loss": 1.0, 7: "x"}),
    # who and when
    "unregistered name": poisoned(site="site-99"),
    "another round": poisoned(round_idx=3),
    "no round cookie": None,  # built in the test (contribution() always sets one)
}


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_one_malicious_site_cannot_change_the_honest_average(name, tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    attack = ATTACKS[name]
    if attack is None:
        attack = poisoned()
        attack.set_cookie_jar({})
    accepted, out = run_round(fedavg(), server_ctx(tmp_path), attack)
    assert accepted == [False, True, True], name
    expected = honest_average()
    assert set(out.data) == set(expected)
    for k, v in expected.items():  # bit for bit, in the global model's dtype
        assert out.data[k].dtype == GLOBAL[k].dtype and out.data[k].tobytes() == v.tobytes(), k
    assert out.get_meta_prop("aggregated_sites") == 2
    named = "site-99" if name == "unregistered name" else ATTACKER
    assert named in caplog.text


def test_a_site_cannot_change_its_declared_sample_count_mid_run(tmp_path, caplog):
    agg = fedavg()
    _, _ = run_round(agg, server_ctx(tmp_path), poisoned(meta={"num_samples": 10, "loss": 1.0}))
    agg.reset(server_ctx(tmp_path))
    accepted, out = run_round(agg, server_ctx(tmp_path), poisoned(meta={"num_samples": 10_000, "loss": 1.0}))
    assert accepted == [False, True, True] and "declaring 10" in caplog.text


def test_bound_on_the_update_is_configurable_and_relative_to_the_global_model(tmp_path):
    """||x - g|| / max(||g||, 1): g has norm 1.22 here, so an update of 5 x that passes the default (10) only."""
    big = poisoned({**HONEST["site-1"][0], "enc.w": np.full((3, 2), 0.5 + 2.5, np.float32)})  # ||x-g|| = 6.1
    assert run_round(fedavg(), server_ctx(tmp_path), big)[0] == [True, True, True]
    tight = FedAvgAggregator(weighting="num_samples", optional_prefixes=["target."], exclude_patterns=["enc.cls"],
                             max_update_ratio=2.0)
    big = poisoned({**HONEST["site-1"][0], "enc.w": np.full((3, 2), 0.5 + 2.5, np.float32)})
    assert run_round(tight, server_ctx(tmp_path), big)[0] == [False, True, True]


def test_the_last_round_of_a_knowledge_split_needs_the_class_token_from_everyone(tmp_path):
    """In the last round the server expects the locally kept keys; a site that withholds them cannot
    make the round skip their average."""
    agg = fedavg()
    agg.handle_event(AppEventType.ROUND_STARTED, context(props={AppConstants.NUM_ROUNDS: 2}))
    ctx = server_ctx(tmp_path, round_idx=1)
    withholding = poisoned(round_idx=1)
    honest = [contribution(s, {**st, "enc.cls": np.full(2, i + 1.0, np.float32)}, {"num_samples": n}, 1)
              for i, (s, (st, n)) in enumerate(HONEST.items())]
    assert [agg.accept(c, ctx) for c in [withholding, *honest]] == [False, True, True]
    np.testing.assert_array_equal(from_shareable(agg.aggregate(ctx)).data["enc.cls"], np.full(2, 1.75, np.float32))


# ---------------------------------------------------------------- the surgical head (class-heterogeneous)
SURG_GLOBAL = {"features.w": np.ones((2, 2), np.float32), "classifier.weight": np.zeros((3, 2), np.float32),
               "classifier.bias": np.zeros(3, np.float32)}
SURG_CLASSES = {"site-1": ["a", "b"], "site-2": ["b", "c"], ATTACKER: ["a", "c"]}


def surgical_ctx(tmp_path):
    reg = build_registry("surgical", "fedavg", SURG_CLASSES, num_samples={"site-1": 5, "site-2": 5, ATTACKER: 5})
    return context(engine=FakeEngine(tmp_path, n_clients=3), props={
        AppConstants.GLOBAL_MODEL: make_model_learnable(SURG_GLOBAL, {}), AppConstants.CURRENT_ROUND: 0,
        REGISTRY_PROP: reg})


def surgical_contribution(site, head_value, meta=None, backbone=None):
    classes = SURG_CLASSES[site]
    data = {"features.w": np.full((2, 2), 2.0, np.float32) if backbone is None else backbone,
            "classifier.weight": np.full((2, 2), head_value, np.float32) if not isinstance(head_value, np.ndarray)
            else head_value, "classifier.bias": np.full(2, 0.5, np.float32)}
    return contribution(site, data, {CLASSES_KEY: classes, "num_samples": 5, **(meta or {})})


@pytest.mark.parametrize("attack", ["head 1e300", "head 1e38", "num_samples above its registration", "backbone 1e300"])
def test_surgical_head_and_backbone_refuse_poison(attack, tmp_path, caplog):
    ctx = surgical_ctx(tmp_path)
    agg = SurgicalAggregator(weighting="num_samples")
    bad = {
        "head 1e300": lambda: surgical_contribution(ATTACKER, np.full((2, 2), 1e300)),
        "head 1e38": lambda: surgical_contribution(ATTACKER, 1e38),
        "num_samples above its registration": lambda: surgical_contribution(ATTACKER, 1.0, {"num_samples": 6}),
        "backbone 1e300": lambda: surgical_contribution(ATTACKER, 1.0, backbone=np.full((2, 2), 1e300)),
    }[attack]()
    accepted = [agg.accept(s, ctx) for s in (bad, surgical_contribution("site-1", 1.0),
                                             surgical_contribution("site-2", 3.0))]
    assert accepted == [False, True, True] and ATTACKER in caplog.text
    out = from_shareable(agg.aggregate(ctx)).data
    assert np.isfinite(out["classifier.weight"]).all()
    # class a: site-1 only (1.0); b: both (2.0); c: site-2 only (3.0)
    np.testing.assert_array_equal(out["classifier.weight"], np.array([[1, 1], [2, 2], [3, 3]], np.float32))


# ---------------------------------------------------------------- the communication meter sees everything first
#: what the meter records for each payload: measured parts, or "unmeasured" with the serialisation error
METER_RECORDS = {"int meta key": {"unmeasured": "RuntimeError"}, "object meta": {"unmeasured": "RuntimeError"},
                 "not a dxo": {"total": None}, "bad round cookie": {"total": None, "weights": None}}


@pytest.mark.parametrize("payload", ["int meta key", "object meta", "not a dxo", "bad round cookie"])
def test_the_meter_never_crashes_on_a_payload(payload, tmp_path):
    if payload == "int meta key":
        s = DXO(DataKind.WEIGHTS, data={"w": np.ones(2)}, meta={7: "x", "bank": object}).to_shareable()
    elif payload == "object meta":
        s = DXO(DataKind.WEIGHTS, data={"w": np.ones(2)}, meta={"x": np.array([object()], dtype=object)}).to_shareable()
    elif payload == "not a dxo":
        from nvflare.apis.shareable import Shareable
        s = Shareable()
        s["junk"] = {1: 2}
    else:
        s = DXO(DataKind.WEIGHTS, data={"w": np.ones(2)}).to_shareable()
        s.add_cookie(AppConstants.CONTRIBUTION_ROUND, {"round": "x"})
    s.set_peer_props({ReservedKey.IDENTITY_NAME: ATTACKER})
    register_decomposers()  # as FLARE does at start-up: numpy arrays serialise, whatever ran before
    meter = CommunicationMeter(direction="upload")
    assert meter.process(s, context(peer_site=ATTACKER, engine=FakeEngine(tmp_path))) is s
    (record,) = [json.loads(line) for line in (tmp_path / COMM_FILE).read_text().splitlines()]
    expected = METER_RECORDS[payload]
    # one line per payload, the attacker named, no round (the cookie is not an int), only the parts that were measured
    assert {k: record[k] for k in ("round", "site", "direction", "task")} == {
        "round": None, "site": ATTACKER, "direction": "upload", "task": None}
    assert set(record) - {"round", "site", "direction", "task"} == set(expected)
    for key, prefix in expected.items():
        if prefix is None:
            assert isinstance(record[key], int) and record[key] > 0, key
        else:
            assert record[key].startswith(prefix + ": "), record[key]


def test_num_steps_weighting_is_bounded_too(tmp_path):
    agg = FedAvgAggregator(weighting="num_steps", optional_prefixes=["target."], exclude_patterns=["enc.cls"])
    ctx = server_ctx(tmp_path)
    attack = poisoned(meta={MetaKey.NUM_STEPS_CURRENT_ROUND: 1e300})
    honest = [contribution(s, dict(st), {MetaKey.NUM_STEPS_CURRENT_ROUND: n}) for s, (st, n) in HONEST.items()]
    assert [agg.accept(c, ctx) for c in [attack, *honest]] == [False, True, True]
    out = from_shareable(agg.aggregate(ctx)).data
    for k, v in honest_average().items():
        assert out[k].tobytes() == v.tobytes()
