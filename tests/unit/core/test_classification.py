"""Classification metrics against hand-computed confusion matrices."""

import itertools

import numpy as np
import pytest

from fedssl.core.classification import binary_roc_auc, classification_metrics, confusion_matrix, flat_metrics

NAMES3 = ["a", "b", "c"]


def one_hot_probs(pred, n_classes, confidence=0.8):
    p = np.full((len(pred), n_classes), (1 - confidence) / (n_classes - 1))
    p[np.arange(len(pred)), pred] = confidence
    return p


def test_confusion_matrix_rows_are_true_classes():
    m = confusion_matrix([0, 1, 1, 2], [0, 0, 1, 2], 3)
    assert m.tolist() == [[1, 1, 0], [0, 1, 0], [0, 0, 1]]
    with pytest.raises(ValueError, match="0..2"):
        confusion_matrix([0, 3], [0, 1], 3)


def test_metrics_with_a_class_never_predicted():
    labels = [0, 0, 0, 1, 1, 2, 2, 2]
    pred = [0, 0, 1, 1, 1, 0, 0, 1]  # class c never predicted
    # M = [[2,1,0],[0,2,0],[2,1,0]]; tp = [2,2,0]; fn = [1,0,3]; fp = [2,2,0]; tn = [3,4,5]
    m = classification_metrics(one_hot_probs(pred, 3), labels, NAMES3)
    assert m["confusion_matrix"] == [[2, 1, 0], [0, 2, 0], [2, 1, 0]]
    assert m["n"] == 8 and m["accuracy"] == pytest.approx(4 / 8)
    pc = m["per_class"]
    assert [pc[c]["recall"] for c in NAMES3] == pytest.approx([2 / 3, 1.0, 0.0])
    assert [pc[c]["precision"] for c in NAMES3] == pytest.approx([2 / 4, 2 / 4, 0.0])  # never predicted -> 0
    assert [pc[c]["specificity"] for c in NAMES3] == pytest.approx([3 / 5, 4 / 6, 5 / 5])
    assert [pc[c]["f1"] for c in NAMES3] == pytest.approx([4 / 7, 4 / 6, 0.0])
    assert [pc[c]["support"] for c in NAMES3] == [3, 2, 3]
    assert m["balanced_accuracy"] == pytest.approx((2 / 3 + 1 + 0) / 3) == m["macro_recall"]
    assert m["macro_precision"] == pytest.approx(1 / 3)
    assert m["macro_f1"] == pytest.approx((4 / 7 + 2 / 3) / 3)
    assert m["macro_specificity"] == pytest.approx((3 / 5 + 2 / 3 + 1) / 3)


def test_metrics_with_a_class_absent_from_labels_and_predictions():
    labels, pred = [0, 0, 1, 1], [0, 1, 1, 1]
    m = classification_metrics(one_hot_probs(pred, 3), labels, NAMES3)
    c = m["per_class"]["c"]
    assert c["support"] == 0 and c["recall"] is None and c["f1"] is None and c["precision"] == 0.0
    assert c["specificity"] == pytest.approx(1.0)
    # macro means over the classes present (a, b): recall [1/2, 1], precision [1, 2/3], f1 [2/3, 4/5]
    assert m["balanced_accuracy"] == pytest.approx(0.75)
    assert m["macro_precision"] == pytest.approx((1 + 2 / 3) / 2)
    assert m["macro_f1"] == pytest.approx((2 / 3 + 4 / 5) / 2)
    assert m["auc"] is not None and m["per_class"]["c"]["auc"] is None  # no positives for c: left out of the mean


def test_binary_auc_hand_computed_with_ties():
    assert binary_roc_auc([0.1, 0.4, 0.35, 0.8], [False, False, True, True]) == pytest.approx(0.75)
    # positives {0.5, 0.9} vs negatives {0.5, 0.2}: pairs 0.5 (tie), 1, 1, 1 -> 3.5 / 4
    assert binary_roc_auc([0.5, 0.5, 0.2, 0.9], [True, False, False, True]) == pytest.approx(0.875)
    assert binary_roc_auc([0.1, 0.2], [True, True]) is None


def test_binary_metrics_use_p_class1_for_auc():
    probs = np.array([[0.9, 0.1], [0.6, 0.4], [0.65, 0.35], [0.2, 0.8]])
    m = classification_metrics(probs, [0, 0, 1, 1], ["no_dr", "dr"])
    assert m["auc"] == pytest.approx(0.75)
    assert m["accuracy"] == pytest.approx(0.75)  # predictions 0, 0, 0, 1
    assert (m["per_class"]["dr"]["recall"] == pytest.approx(0.5)
            and m["per_class"]["dr"]["specificity"] == pytest.approx(1.0))
    assert m["per_class"]["no_dr"]["auc"] is None
    assert classification_metrics(probs[:2], [0, 0], ["no_dr", "dr"])["auc"] is None  # one class only: undefined


def pair_auc(scores, positive):
    pos = [s for s, t in zip(scores, positive) if t]
    neg = [s for s, t in zip(scores, positive) if not t]
    return sum(1.0 if p > q else 0.5 if p == q else 0.0 for p, q in itertools.product(pos, neg)) / (len(pos) * len(neg))


def test_multiclass_auc_is_macro_one_vs_rest():
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(3), size=30)
    labels = rng.integers(0, 3, size=30)
    m = classification_metrics(probs, labels, NAMES3)
    per = [pair_auc(probs[:, c], labels == c) for c in range(3)]
    assert [m["per_class"][c]["auc"] for c in NAMES3] == pytest.approx(per)
    assert m["auc"] == pytest.approx(sum(per) / 3)


def test_metrics_reject_bad_input():
    with pytest.raises(ValueError, match=r"shape \[N, 3\]"):
        classification_metrics(np.ones((2, 2)), [0, 1], NAMES3)
    with pytest.raises(ValueError, match="2 probability rows for 3 labels"):
        classification_metrics(np.ones((2, 3)) / 3, [0, 1, 2], NAMES3)
    with pytest.raises(FloatingPointError):
        classification_metrics(np.array([[np.nan, 0.5, 0.5]]), [0], NAMES3)


def test_flat_metrics_has_scalars_and_per_class_entries():
    m = classification_metrics(one_hot_probs([0, 1], 2), [0, 1], ["x", "y"])
    flat = flat_metrics(m, prefix="val_")
    assert flat["val_accuracy"] == 1.0 and flat["val_recall_y"] == 1.0 and flat["val_auc"] == 1.0
