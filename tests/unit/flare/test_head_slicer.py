"""HeadSlicer: each site receives the global head cut to its own classes in its own order, in a fresh DXO."""

import numpy as np
import pytest
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.app_common.app_constant import AppConstants

from fedssl.flare.head_slicer import HeadSlicer
from fedssl.flare.surgical_registration import REGISTRY_PROP, build_registry
from tests.unit.flare.fakes import FakeEngine, context

DECLARED = {"site-1": ["B", "A"], "site-2": ["C", "B"]}  # global order: B, A, C


def broadcast(round_idx=0):
    w = np.array([[0, 0], [1, 1], [2, 2]], np.float32)  # row j = global class j
    data = {"features.conv0.weight": np.ones(3, np.float32), "classifier.weight": w,
            "classifier.bias": np.array([0, 1, 2], np.float32)}
    s = DXO(DataKind.WEIGHTS, data=data, meta={"note": 1}).to_shareable()
    s.set_header(AppConstants.CURRENT_ROUND, round_idx)
    return s


def ctx_for(site, tmp_path, method="surgical"):
    reg = build_registry(method, "fedbn_plus", DECLARED)
    return context(peer_site=site, engine=FakeEngine(tmp_path), props={REGISTRY_PROP: reg}), reg


def per_site_copy(shared):
    """What FLARE hands each site's filter: a shallow copy over the round's one shared DXO."""
    from nvflare.apis.shareable import Shareable

    s = Shareable()
    s.update(shared)
    return s


def test_each_site_gets_its_rows_in_its_order_and_the_shared_dxo_is_untouched(tmp_path):
    shared = broadcast()
    f = HeadSlicer()
    c1, reg = ctx_for("site-1", tmp_path)
    assert list(reg.global_classes) == ["B", "A", "C"]
    out1 = from_shareable(f.process(per_site_copy(shared), c1))
    c2, _ = ctx_for("site-2", tmp_path)
    out2 = from_shareable(f.process(per_site_copy(shared), c2))
    np.testing.assert_array_equal(out1.data["classifier.bias"], [0, 1])  # B, A
    np.testing.assert_array_equal(out2.data["classifier.bias"], [2, 0])  # C, B
    np.testing.assert_array_equal(out2.data["classifier.weight"], [[2, 2], [0, 0]])
    assert list(out1.get_meta_prop("classes")) == ["B", "A"] and out1.get_meta_prop("method") == "surgical"
    assert out1.get_meta_prop("global_classes") is None  # surgical sites never learn the other sites' classes
    orig = from_shareable(shared)
    assert orig.data["classifier.weight"].shape == (3, 2) and "classes" not in orig.get_meta_props()
    out1.data["classifier.weight"][0, 0] = 99.0  # a fresh array, not a view of the global head
    assert orig.data["classifier.weight"][0, 0] == 0.0


def test_full_head_for_the_test_task_and_baselines(tmp_path):
    c1, _ = ctx_for("site-1", tmp_path)
    full = from_shareable(HeadSlicer(full_head=True).process(per_site_copy(broadcast()), c1))
    assert (full.data["classifier.weight"].shape == (3, 2)
            and list(full.get_meta_prop("global_classes")) == ["B", "A", "C"])
    c1, _ = ctx_for("site-1", tmp_path, method="vanilla")
    van = from_shareable(HeadSlicer().process(per_site_copy(broadcast()), c1))
    assert van.data["classifier.bias"].shape == (3,) and list(van.get_meta_prop("global_classes")) == ["B", "A", "C"]
    c1, _ = ctx_for("site-1", tmp_path, method="personalised")
    per = from_shareable(HeadSlicer().process(per_site_copy(broadcast()), c1))
    assert set(per.data) == {"features.conv0.weight"}
    c1, _ = ctx_for("site-1", tmp_path, method="individual")
    assert set(from_shareable(HeadSlicer().process(per_site_copy(broadcast(0)), c1)).data) == {"features.conv0.weight"}
    assert from_shareable(HeadSlicer().process(per_site_copy(broadcast(3)), c1)).data == {}


def test_unregistered_site_and_missing_registry_fail_loudly(tmp_path):
    c, _ = ctx_for("site-9", tmp_path)
    with pytest.raises(ValueError, match="site-9 is not registered"):
        HeadSlicer().process(per_site_copy(broadcast()), c)
    bare = context(peer_site="site-1", engine=FakeEngine(tmp_path))
    with pytest.raises(ValueError, match="ClassRegistration"):
        HeadSlicer().process(per_site_copy(broadcast()), bare)


def test_constructor_checks():
    with pytest.raises(ValueError, match="full_head"):
        HeadSlicer(full_head="yes")
