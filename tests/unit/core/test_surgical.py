"""Surgical head merge (surgical aggregation (Kulkarni et al., ML4H 2024), eq. 2-3): hand-computed columns, FedAvg
equivalence, slicing, BN key selection."""

import numpy as np
import pytest
import torch

from fedssl.core.state_dict import weighted_average
from fedssl.core.surgical import (
    STRATEGIES,
    aggregated_keys,
    check_class_list,
    class_index,
    frozen_keys,
    local_keys,
    merge_heads,
    slice_head,
    slice_head_state,
    surgical_merge,
    union_classes,
)
from fedssl.models.densenet import TinyDenseNet, is_bn_key


def head(rows):
    """A head whose row i is rows[i] * [1, 10] (F = 2) and bias rows[i]."""
    r = np.asarray(rows, dtype=np.float32)
    return np.stack([r, 10 * r], axis=1), r.copy()


# --------------------------------------------------------------------------------------------- class lists
def test_check_class_list_accepts_and_rejects():
    assert check_class_list(("a", "b"), "s1") == ["a", "b"]
    for bad, msg in [(["a", "a"], "listed twice"), ([], "empty"), (["a", ""], "empty name"), (["a", 3], "not a string"),
                     ("ab", "must be a list"), ([" a"], "blanks"), (None, "must be a list")]:
        with pytest.raises(ValueError, match=msg) as e:
            check_class_list(bad, "site-7")
        assert "site-7" in str(e.value)
    with pytest.raises(ValueError, match=r"site-2.*\['z'\] are not in the global class list"):
        check_class_list(["a", "z"], "site-2", allowed=["a", "b"])


def test_union_classes_stable_order():
    # dict: sites visited in sorted name order, classes by first appearance
    assert union_classes({"site-2": ["c", "a"], "site-1": ["b", "a"]}) == ["b", "a", "c"]
    assert union_classes([["c", "a"], ["b", "a"]]) == ["c", "a", "b"]
    assert union_classes({"s1": ["c", "a"], "s2": ["b"]}, order=["a", "b", "c", "d"]) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="s2"):
        union_classes({"s1": ["a"], "s2": ["x"]}, order=["a", "b"])
    with pytest.raises(ValueError, match="twice"):
        union_classes({"s1": ["a", "a"]})


# ---------------------------------------------------------------------------------------------- head merge
def test_merge_disjoint_classes_copies_each_row():
    w, b = merge_heads({"s1": head([1, 2]), "s2": head([3])}, {"s1": ["a", "b"], "s2": ["c"]}, ["c", "a", "b"])
    np.testing.assert_array_equal(b, [3, 1, 2])
    np.testing.assert_array_equal(w, [[3, 30], [1, 10], [2, 20]])


def test_merge_overlapping_classes_hand_computed():
    # s1: a=1 b=2 c=3 ; s2 (own order): c=5 a=7 ; s3: d=11 a=4
    heads = {"s1": head([1, 2, 3]), "s2": head([5, 7]), "s3": head([11, 4])}
    classes = {"s1": ["a", "b", "c"], "s2": ["c", "a"], "s3": ["d", "a"]}
    glob = ["a", "b", "c", "d"]
    w, b = merge_heads(heads, classes, glob)
    expected = np.array([(1 + 7 + 4) / 3, 2, (3 + 5) / 2, 11], dtype=np.float32)  # unweighted over holders
    np.testing.assert_allclose(b, expected, rtol=1e-6)
    np.testing.assert_allclose(w, np.stack([expected, 10 * expected], 1), rtol=1e-6)
    # weighted by sample counts, renormalised over the holders of each class
    w2, b2 = merge_heads(heads, classes, glob, weights={"s1": 1, "s2": 2, "s3": 3})
    np.testing.assert_allclose(b2, [(1 + 14 + 12) / 6, 2, (3 + 10) / 3, 11], rtol=1e-6)


def test_merge_class_held_by_no_site_keeps_previous_global_row():
    prev = (np.full((3, 2), -1.0, np.float32), np.array([-1, -2, -3], np.float32))
    w, b = merge_heads({"s1": head([5])}, {"s1": ["b"]}, ["a", "b", "c"], global_head=prev)
    np.testing.assert_array_equal(b, [-1, 5, -3])
    np.testing.assert_array_equal(w, [[-1, -1], [5, 50], [-1, -1]])
    with pytest.raises(ValueError, match="held by no site"):
        merge_heads({"s1": head([5])}, {"s1": ["b"]}, ["a", "b"])


def test_merge_identical_lists_equals_fedavg_exactly():
    rng = np.random.default_rng(0)
    cl = ["x", "y", "z", "w"]
    heads = {s: (rng.normal(size=(4, 6)).astype(np.float32), rng.normal(size=4).astype(np.float32))
             for s in ("s1", "s2", "s3")}
    for weights in (None, {"s1": 10, "s2": 3, "s3": 7}):
        w, b = merge_heads(heads, {s: cl for s in heads}, cl, weights=weights)
        ws = [1, 1, 1] if weights is None else [weights[s] for s in sorted(heads)]
        fa = weighted_average([{"w": heads[s][0], "b": heads[s][1]} for s in sorted(heads)], ws)
        assert np.array_equal(w, fa["w"]) and np.array_equal(b, fa["b"])
        assert w.dtype == np.float32


def test_merge_rejects_inconsistent_heads():
    with pytest.raises(ValueError, match="s2: head has 1 rows but the site declares 2"):
        merge_heads({"s1": head([1]), "s2": head([1])}, {"s1": ["a"], "s2": ["a", "b"]}, ["a", "b"])
    with pytest.raises(ValueError, match=r"s2.*\['q'\] are not in the global"):
        merge_heads({"s2": head([1])}, {"s2": ["q"]}, ["a"])
    with pytest.raises(ValueError, match="s1: sent a head but declared no class list"):
        merge_heads({"s1": head([1])}, {}, ["a"])
    with pytest.raises(ValueError, match="input features"):
        merge_heads({"s1": head([1]), "s2": (np.zeros((1, 3)), np.zeros(1))}, {"s1": ["a"], "s2": ["a"]}, ["a"])


# -------------------------------------------------------------------------------------------------- slicing
def test_slice_head_site_order_and_copy():
    w, b = head([0, 1, 2, 3])
    ws, bs = slice_head(w, b, ["a", "b", "c", "d"], ["d", "a"])
    np.testing.assert_array_equal(bs, [3, 0])
    np.testing.assert_array_equal(ws, [[3, 30], [0, 0]])
    ws[0, 0] = 99
    assert w[3, 0] == 3  # fresh copy
    tw, tb = slice_head(torch.tensor(w), torch.tensor(b), ["a", "b", "c", "d"], ["c"])
    assert isinstance(tw, torch.Tensor) and tb.tolist() == [2.0]
    with pytest.raises(ValueError, match="site-9"):
        slice_head(w, b, ["a", "b", "c", "d"], ["e"], site="site-9")
    assert class_index(["a", "b", "c"], ["c", "a"]) == [2, 0]


def test_merge_then_slice_round_trip():
    heads = {"s1": head([1, 2]), "s2": head([4, 6])}
    classes = {"s1": ["a", "b"], "s2": ["b", "c"]}
    glob = union_classes(classes)
    w, b = merge_heads(heads, classes, glob)
    _, b2 = slice_head(w, b, glob, classes["s2"])
    np.testing.assert_allclose(b2, [(2 + 4) / 2, 6])
    state = slice_head_state({"classifier.weight": w, "classifier.bias": b, "other": np.ones(2)}, glob, ["c"])
    assert state["classifier.bias"].tolist() == [6.0] and state["other"] is not None


# --------------------------------------------------------------------------------- backbone key selection
def test_strategy_key_selection_on_densenet():
    keys = list(TinyDenseNet(["a", "b"]).state_dict())
    bn = [k for k in keys if is_bn_key(k)]
    head_keys = ["classifier.weight", "classifier.bias"]
    assert bn and set(head_keys) <= set(keys)
    fedavg = aggregated_keys(keys, "fedavg", is_bn_key)
    assert set(fedavg) == set(keys) - set(head_keys)
    for s in ("fedbn", "fedbn_plus"):
        assert set(aggregated_keys(keys, s, is_bn_key)) == set(keys) - set(head_keys) - set(bn)
        assert set(local_keys(keys, s, is_bn_key)) == set(bn)
    assert local_keys(keys, "fedavg", is_bn_key) == []
    assert set(frozen_keys(keys, "fedbn_plus", is_bn_key)) == set(bn)
    assert frozen_keys(keys, "fedbn", is_bn_key) == [] and "pre_classifier.0.weight" in fedavg
    with pytest.raises(ValueError, match="fedprox"):
        aggregated_keys(keys, "fedprox", is_bn_key)
    assert STRATEGIES == ("fedavg", "fedbn", "fedbn_plus")


def _states(classes):
    return {s: TinyDenseNet(cl, seed=i + 1).state_dict() for i, (s, cl) in enumerate(sorted(classes.items()))}


def test_surgical_merge_identical_classes_is_fedavg():
    cl = ["a", "b", "c"]
    classes = {"s1": cl, "s2": cl}
    states = _states(classes)
    glob = TinyDenseNet(cl, seed=0).state_dict()
    w = {"s1": 30, "s2": 10}
    out = surgical_merge(states, classes, cl, glob, "fedavg", is_bn_key, weights=w, head_weights=w)
    fa = weighted_average([states["s1"], states["s2"]], [30, 10])
    assert set(out) == set(glob)
    for k in fa:
        assert np.array_equal(out[k], fa[k]), k


def test_surgical_merge_fedbn_keeps_global_bn_and_merges_head():
    classes = {"s1": ["a", "b"], "s2": ["b", "c"]}
    states = _states(classes)
    glob_cl = ["a", "b", "c"]
    glob = TinyDenseNet(glob_cl, seed=0).state_dict()
    out = surgical_merge(states, classes, glob_cl, glob, "fedbn", is_bn_key)
    bn = next(k for k in glob if k.endswith("norm0.running_mean"))
    conv = "features.conv0.weight"
    np.testing.assert_array_equal(out[bn], glob[bn].numpy())
    np.testing.assert_allclose(out[conv], (states["s1"][conv].numpy() + states["s2"][conv].numpy()) / 2, rtol=1e-6)
    b1, b2 = states["s1"]["classifier.bias"].numpy(), states["s2"]["classifier.bias"].numpy()
    np.testing.assert_allclose(out["classifier.bias"], [b1[0], (b1[1] + b2[0]) / 2, b2[1]], rtol=1e-6)
    # under FedBN the sites may keep BN tensors home: omitting them is accepted
    lean = {s: {k: v for k, v in st.items() if not is_bn_key(k)} for s, st in states.items()}
    out2 = surgical_merge(lean, classes, glob_cl, glob, "fedbn_plus", is_bn_key)
    assert all(np.array_equal(out[k], out2[k]) for k in out)
    with pytest.raises(ValueError, match="s1: model lacks"):
        surgical_merge(lean, classes, glob_cl, glob, "fedavg", is_bn_key)
