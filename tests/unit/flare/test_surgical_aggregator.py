"""SurgicalAggregator through FLARE's accept/aggregate with fakes: head rows by class name, computed by hand."""

import numpy as np
import pytest
from nvflare.apis.dxo import from_shareable
from nvflare.app_common.abstract.model import make_model_learnable
from nvflare.app_common.app_constant import AppConstants

from fedssl.core.surgical import classes_to_meta
from fedssl.flare.fedavg_aggregator import FedAvgAggregator
from fedssl.flare.surgical_aggregator import SurgicalAggregator
from fedssl.flare.surgical_registration import REGISTRY_PROP, build_registry
from tests.unit.flare.fakes import FakeEngine, context, contribution

F = 2  # input features of the head
BN = ("features.norm0.weight", "features.norm0.running_mean")


def global_model(n_classes, bn=0.0):
    return {"features.conv0.weight": np.zeros((3,), np.float32),
            "features.norm0.weight": np.full((3,), bn, np.float32),
            "features.norm0.running_mean": np.full((3,), bn, np.float32),
            "classifier.weight": np.full((n_classes, F), -1.0, np.float32),
            "classifier.bias": np.full((n_classes,), -1.0, np.float32)}


def setup(tmp_path, declared, method="surgical", backbone="fedavg", num_samples=None):
    reg = build_registry(method, backbone, declared, num_samples=num_samples)
    ctx = context(engine=FakeEngine(tmp_path), props={
        AppConstants.GLOBAL_MODEL: make_model_learnable(global_model(len(reg.global_classes)), {}),
        AppConstants.CURRENT_ROUND: 0, REGISTRY_PROP: reg})
    return reg, ctx


def site_state(classes, rows, conv, bn=None, bias=None):
    """Head row i = rows[i] * [1, 1]; bias defaults to the row value."""
    w = np.array([[r, r] for r in rows], np.float32).reshape(len(rows), F)
    b = np.array(bias if bias is not None else rows, np.float32)
    s = {"features.conv0.weight": np.full((3,), conv, np.float32), "classifier.weight": w, "classifier.bias": b}
    if bn is not None:
        s.update({k: np.full((3,), bn, np.float32) for k in BN})
    return s


def send(agg, ctx, site, classes, state, n=1):
    return agg.accept(contribution(site, state, {"classes": classes_to_meta(classes), "num_samples": n}), ctx)


def test_disjoint_classes_each_row_copied_from_its_only_holder(tmp_path):
    reg, ctx = setup(tmp_path, {"site-1": ["A", "B"], "site-2": ["C"]})
    assert list(reg.global_classes) == ["A", "B", "C"]
    agg = SurgicalAggregator()
    assert send(agg, ctx, "site-1", ["A", "B"], site_state(["A", "B"], [1.0, 2.0], conv=0.0, bn=0.0))
    assert send(agg, ctx, "site-2", ["C"], site_state(["C"], [5.0], conv=4.0, bn=2.0))
    out = from_shareable(agg.aggregate(ctx)).data
    np.testing.assert_allclose(out["classifier.weight"], [[1, 1], [2, 2], [5, 5]])
    np.testing.assert_allclose(out["classifier.bias"], [1, 2, 5])
    np.testing.assert_allclose(out["features.conv0.weight"], [2, 2, 2])  # (0 + 4) / 2, uniform
    np.testing.assert_allclose(out["features.norm0.weight"], [1, 1, 1])  # fedavg averages batch-norm too


def test_overlapping_classes_in_different_orders(tmp_path):
    # site-2 declares the shared class B first: rows are matched by name, not position
    reg, ctx = setup(tmp_path, {"site-1": ["A", "B"], "site-2": ["B", "C"]})
    assert list(reg.global_classes) == ["A", "B", "C"] and reg.shared_classes() == ["B"]
    agg = SurgicalAggregator()
    assert send(agg, ctx, "site-1", ["A", "B"], site_state(["A", "B"], [1.0, 2.0], conv=0.0, bn=0.0))
    assert send(agg, ctx, "site-2", ["B", "C"], site_state(["B", "C"], [6.0, 7.0], conv=0.0, bn=0.0))
    out = from_shareable(agg.aggregate(ctx)).data
    # A from site-1 only; B = (2 + 6) / 2 = 4; C from site-2 only
    np.testing.assert_allclose(out["classifier.weight"], [[1, 1], [4, 4], [7, 7]])
    np.testing.assert_allclose(out["classifier.bias"], [1, 4, 7])


def test_num_samples_weights_the_backbone_and_the_head_merge_stays_the_plain_mean_of_eq_2(tmp_path):
    """Issue 47: eq. 2 is a plain mean over the sites holding a class; the head merge used to take the sample weights
    too."""
    reg, ctx = setup(tmp_path, {"site-1": ["A", "B"], "site-2": ["B"]})
    agg = SurgicalAggregator(weighting="num_samples")
    assert send(agg, ctx, "site-1", ["A", "B"], site_state(["A", "B"], [1.0, 2.0], conv=0.0, bn=0.0), n=10)
    assert send(agg, ctx, "site-2", ["B"], site_state(["B"], [6.0], conv=4.0, bn=0.0), n=30)
    out = from_shareable(agg.aggregate(ctx)).data
    # B = (2 + 6) / 2 = 4 (not (10 * 2 + 30 * 6) / 40 = 5); conv = 30 * 4 / 40 = 3 (weighted); A copied
    np.testing.assert_allclose(out["classifier.weight"], [[1, 1], [4, 4]])
    np.testing.assert_allclose(out["features.conv0.weight"], [3, 3, 3])


@pytest.mark.parametrize("weighting", ["uniform", "num_samples"])
def test_identical_class_lists_equal_plain_fedavg(tmp_path, weighting):
    classes = ["A", "B", "C"]
    reg, ctx = setup(tmp_path, {"site-1": classes, "site-2": classes, "site-3": classes})
    rng = np.random.default_rng(0)
    states = {f"site-{i}": {k: rng.normal(size=v.shape).astype(np.float32) for k, v in global_model(3).items()}
              for i in (1, 2, 3)}
    counts = {"site-1": 3, "site-2": 5, "site-3": 11}
    surgical, fedavg = SurgicalAggregator(weighting=weighting), FedAvgAggregator(weighting=weighting)
    for site, st in states.items():
        assert send(surgical, ctx, site, classes, st, n=counts[site])
        assert fedavg.accept(contribution(site, st, {"num_samples": counts[site]}), ctx)
    a, b = from_shareable(surgical.aggregate(ctx)).data, from_shareable(fedavg.aggregate(ctx)).data
    assert set(a) == set(b)
    for k in a:
        # the head is eq. 2's plain mean under either weighting; the backbone is FedAvg's
        expected = np.mean([st[k] for st in states.values()], axis=0) if k.startswith("classifier.") else b[k]
        np.testing.assert_allclose(a[k], expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("backbone", ["fedbn", "fedbn_plus"])
def test_fedbn_keeps_batchnorm_out(tmp_path, backbone):
    reg, ctx = setup(tmp_path, {"site-1": ["A"], "site-2": ["A"]}, backbone=backbone)
    agg = SurgicalAggregator()
    assert send(agg, ctx, "site-1", ["A"], site_state(["A"], [1.0], conv=1.0))  # BN held back by the upload filter
    assert send(agg, ctx, "site-2", ["A"], site_state(["A"], [3.0], conv=3.0))
    out = from_shareable(agg.aggregate(ctx)).data
    assert not any(k in out for k in BN)  # the global model keeps its own batch-norm (MergingShareableGenerator)
    np.testing.assert_allclose(out["features.conv0.weight"], [2, 2, 2])
    # a site that lets batch-norm out under FedBN is rejected (the filter is missing)
    agg2 = SurgicalAggregator()
    assert not send(agg2, ctx, "site-1", ["A"], site_state(["A"], [1.0], conv=1.0, bn=5.0))


def test_fedavg_rejects_missing_batchnorm(tmp_path):
    reg, ctx = setup(tmp_path, {"site-1": ["A"], "site-2": ["A"]}, backbone="fedavg")
    assert not send(SurgicalAggregator(), ctx, "site-1", ["A"], site_state(["A"], [1.0], conv=1.0))


def test_bad_contributions_rejected_before_they_touch_the_model(tmp_path):
    reg, ctx = setup(tmp_path, {"site-1": ["A", "B"], "site-2": ["C"]})
    agg = SurgicalAggregator()
    good = site_state(["A", "B"], [1.0, 2.0], conv=0.0, bn=0.0)
    wrong_rows = site_state(["A"], [1.0], conv=0.0, bn=0.0)  # head of 1 row for 2 declared classes
    assert not send(agg, ctx, "site-1", ["A", "B"], wrong_rows)
    nan = dict(good, **{"classifier.weight": np.array([[np.nan, 1], [1, 1]], np.float32)})
    assert not send(agg, ctx, "site-1", ["A", "B"], nan)
    missing = {k: v for k, v in good.items() if k != "features.conv0.weight"}
    assert not send(agg, ctx, "site-1", ["A", "B"], missing)
    bad_shape = dict(good, **{"features.conv0.weight": np.zeros((4,), np.float32)})
    assert not send(agg, ctx, "site-1", ["A", "B"], bad_shape)
    assert not send(agg, ctx, "site-9", ["A"], site_state(["A"], [1.0], conv=0.0, bn=0.0))  # not registered
    assert send(agg, ctx, "site-1", ["A", "B"], good)
    assert not send(agg, ctx, "site-1", ["A", "B"], good)  # duplicate
    out = from_shareable(agg.aggregate(ctx))
    assert out.get_meta_prop("aggregated_sites") == 1
    # C held by no site this round keeps its previous global row (-1)
    np.testing.assert_allclose(out.data["classifier.weight"], [[1, 1], [2, 2], [-1, -1]])


def test_changed_class_list_mid_run_is_rejected(tmp_path, caplog):
    reg, ctx = setup(tmp_path, {"site-1": ["A", "B"], "site-2": ["C"]})
    agg = SurgicalAggregator()
    swapped = site_state(["B", "A"], [1.0, 2.0], conv=0.0, bn=0.0)
    assert not send(agg, ctx, "site-1", ["B", "A"], swapped)
    assert "site-1 changed its class list mid-run" in caplog.text


@pytest.mark.parametrize("method", ["vanilla", "partial_loss"])
def test_one_global_head_is_averaged(tmp_path, method):
    reg, ctx = setup(tmp_path, {"site-1": ["A", "B"], "site-2": ["C"]}, method=method)
    agg = SurgicalAggregator()
    assert send(agg, ctx, "site-1", ["A", "B"], site_state(["A", "B", "C"], [1.0, 2.0, 3.0], conv=0.0, bn=0.0))
    assert send(agg, ctx, "site-2", ["C"], site_state(["A", "B", "C"], [3.0, 4.0, 5.0], conv=0.0, bn=0.0))
    np.testing.assert_allclose(from_shareable(agg.aggregate(ctx)).data["classifier.bias"], [2, 3, 4])
    # a site-sized head is wrong for these methods
    agg2 = SurgicalAggregator()
    assert not send(agg2, ctx, "site-2", ["C"], site_state(["C"], [5.0], conv=0.0, bn=0.0))


def test_personalised_and_individual(tmp_path):
    reg, ctx = setup(tmp_path, {"site-1": ["A"], "site-2": ["B"]}, method="personalised")
    agg = SurgicalAggregator()
    st = site_state(["A"], [1.0], conv=2.0, bn=0.0)
    assert not send(agg, ctx, "site-1", ["A"], st)  # personalised heads never leave the site
    assert send(agg, ctx, "site-1", ["A"], {k: v for k, v in st.items() if not k.startswith("classifier")})
    out = from_shareable(agg.aggregate(ctx)).data
    assert "classifier.weight" not in out and out["features.conv0.weight"][0] == 2.0
    reg, ctx = setup(tmp_path, {"site-1": ["A"], "site-2": ["B"]}, method="individual")
    agg = SurgicalAggregator()
    assert not send(agg, ctx, "site-1", ["A"], {"features.conv0.weight": np.zeros(3, np.float32)})
    assert send(agg, ctx, "site-1", ["A"], {})
    assert from_shareable(agg.aggregate(ctx)).data == {}


def test_registry_rejects_bad_declarations():
    with pytest.raises(ValueError, match="site-2.*twice"):
        build_registry("surgical", "fedavg", {"site-1": ["A"], "site-2": ["B", "B"]})
    with pytest.raises(ValueError, match="site-1.*Effusion"):
        build_registry("surgical", "fedavg", {"site-1": ["Effusion"]}, allowed_classes=["Pleural Effusion"])
    with pytest.raises(ValueError, match="site-1"):
        build_registry("surgical", "fedavg", {"site-1": "Edema"})


def test_constructor_errors_name_argument():
    with pytest.raises(ValueError, match="weighting='by_size'"):
        SurgicalAggregator(weighting="by_size")


def test_an_incomplete_round_sum_stops_the_run_instead_of_making_a_global_model(tmp_path, monkeypatch):
    """The round's sum could not take a held claim whole (the shared RoundAggregator says so with a ValueError): the
    surgical aggregate stops the run with the reason and returns no model, as FedAvg's does."""
    reg, ctx = setup(tmp_path, {"site-1": ["A", "B"], "site-2": ["C"]})
    agg = SurgicalAggregator()
    assert send(agg, ctx, "site-1", ["A", "B"], site_state(["A", "B"], [1.0, 2.0], conv=0.0, bn=0.0))
    assert send(agg, ctx, "site-2", ["C"], site_state(["C"], [5.0], conv=4.0, bn=2.0))

    def incomplete(self):
        raise ValueError("the running sum is incomplete: disk gone")

    monkeypatch.setattr(SurgicalAggregator, "round_average", incomplete)
    panics = []
    agg.system_panic = lambda reason, fl_ctx: panics.append(reason)
    out = agg.aggregate(ctx)
    assert panics == ["the running sum is incomplete: disk gone"]
    with pytest.raises(Exception):  # an empty Shareable: no DXO, no global model
        from_shareable(out)
