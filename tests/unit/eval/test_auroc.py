"""AUROC: hand-computed and brute-force pair counts, ties, undefined cases, bootstrap CI, shared/unique means."""

import math

import numpy as np
import pytest

from fedssl.eval.auroc import (
    _resample_counts,
    _weighted_auroc,
    auroc,
    bootstrap_ci,
    mean_auroc,
    per_class_auroc,
    shared_unique,
    site_summary,
)


def brute(s, y):
    s, y = np.asarray(s, float), np.asarray(y)
    p, n = s[y == 1], s[y == 0]
    return ((p[:, None] > n[None]).sum() + 0.5 * (p[:, None] == n[None]).sum()) / (len(p) * len(n))


def test_hand_computed_example():
    # positives 0.8, 0.4 ; negatives 0.1, 0.4, 0.9 -> pairs: (0.8>0.1, 0.8>0.4, 0.8<0.9) = 2,
    # (0.4>0.1, 0.4=0.4 -> 1/2, 0.4<0.9) = 1.5 ; total 3.5 / 6
    assert auroc([0.8, 0.1, 0.4, 0.4, 0.9], [1, 0, 1, 0, 0]) == pytest.approx(3.5 / 6)
    assert auroc([0.1, 0.2, 0.9], [0, 0, 1]) == 1.0
    assert auroc([0.9, 0.2, 0.1], [0, 0, 1]) == 0.0
    assert auroc([0.5, 0.5, 0.5, 0.5], [1, 0, 1, 0]) == 0.5


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_brute_force_pair_count_with_ties(seed):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, 200)
    s = np.round(rng.normal(size=200) + y, 1)  # many ties
    assert auroc(s, y) == pytest.approx(brute(s, y), abs=1e-12)


def test_undefined_and_bad_input():
    assert math.isnan(auroc([0.1, 0.2], [1, 1]))
    assert math.isnan(auroc([0.1, 0.2], [0, 0]))
    with pytest.raises(ValueError, match="0/1"):
        auroc([0.1, 0.2], [0, 2])
    with pytest.raises(ValueError, match="same length"):
        auroc([0.1, 0.2], [0])
    with pytest.raises(ValueError, match="NaN"):
        auroc([0.1, float("nan")], [0, 1])


def test_weighted_resample_equals_explicit_resample():
    rng = np.random.default_rng(3)
    y = rng.integers(0, 2, 60)
    s = np.round(rng.normal(size=60), 1)
    counts = _resample_counts(60, 5, seed=9)
    assert counts.sum(axis=1).tolist() == [60] * 5
    fast = _weighted_auroc(s, y.astype(bool), counts)
    for b in range(5):
        idx = np.repeat(np.arange(60), counts[b])
        assert fast[b] == pytest.approx(auroc(s[idx], y[idx]), abs=1e-12)


def test_bootstrap_ci_contains_point_and_is_seeded():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 150)
    s = rng.normal(size=150) + 1.2 * y
    ci = bootstrap_ci(s, y, n_boot=300, seed=1)
    assert ci.auroc == pytest.approx(auroc(s, y))
    assert ci.lo < ci.auroc < ci.hi and ci.n_valid == 300
    assert 0.05 < ci.hi - ci.lo < 0.3
    assert bootstrap_ci(s, y, n_boot=300, seed=1) == ci
    assert bootstrap_ci(s, y, n_boot=300, seed=2) != ci
    narrow = bootstrap_ci(s, y, n_boot=300, seed=1, alpha=0.5)
    assert ci.lo < narrow.lo < narrow.hi < ci.hi


def test_bootstrap_skips_single_class_resamples():
    s = np.array([0.1, 0.2, 0.3, 0.4, 0.9])
    y = np.array([0, 0, 0, 0, 1])  # one positive: many resamples miss it
    ci = bootstrap_ci(s, y, n_boot=200, seed=0)
    assert 0 < ci.n_valid < 200 and ci.lo == ci.hi == ci.auroc == 1.0
    assert math.isnan(bootstrap_ci([0.1, 0.2], [0, 0], n_boot=10).auroc)


def test_multilabel_mean_and_per_class_table():
    rng = np.random.default_rng(5)
    y = (rng.random((120, 3)) < 0.3).astype(int)
    y[:, 2] = 0  # class "c" absent from this test set
    s = rng.normal(size=(120, 3)) + y * np.array([2.0, 0.5, 0.0])
    ci = bootstrap_ci(s, y, n_boot=100, seed=0)
    assert ci.auroc == pytest.approx((auroc(s[:, 0], y[:, 0]) + auroc(s[:, 1], y[:, 1])) / 2)
    rows = per_class_auroc(s, y, ["a", "b", "c"], n_boot=100, seed=0)
    assert [r["class"] for r in rows] == ["a", "b", "c"]
    assert rows[0]["auroc"] > rows[1]["auroc"] and math.isnan(rows[2]["auroc"])
    assert rows[0]["lo"] <= rows[0]["auroc"] <= rows[0]["hi"] and rows[0]["n_pos"] == int(y[:, 0].sum())
    assert rows[2]["n_pos"] == 0 and rows[2]["n_boot"] == 0
    assert mean_auroc(rows, ["a", "b", "c"]) == pytest.approx(ci.auroc)  # NaN classes left out
    with pytest.raises(ValueError, match="does not predict"):
        mean_auroc(rows, ["a", "zzz"])


def test_shared_unique_paper_setting():
    from fedssl.data.cxr import CHEXPERT_CLASSES, NIH_CLASSES, SHARED_CLASSES

    g = shared_unique({"nih": list(NIH_CLASSES), "chexpert": list(CHEXPERT_CLASSES)})
    assert g["nih"]["shared"] == [c for c in NIH_CLASSES if c in SHARED_CLASSES]
    assert len(g["nih"]["unique"]) == 7 and len(g["chexpert"]["unique"]) == 6
    table = {c: 0.9 for c in NIH_CLASSES} | {c: 0.7 for c in CHEXPERT_CLASSES if c not in NIH_CLASSES}
    summ = site_summary(table, "chexpert", {"nih": list(NIH_CLASSES), "chexpert": list(CHEXPERT_CLASSES)})
    assert summ["shared"] == pytest.approx(0.9) and summ["unique"] == pytest.approx(0.7)
    assert summ["all"] == pytest.approx((7 * 0.9 + 6 * 0.7) / 13)


def test_labelled_metrics_leave_out_unlabelled_entries():
    import math

    from fedssl.eval.auroc import labelled_bce, labelled_mean_auroc

    nan = float("nan")
    probs = np.array([[0.9, 0.5], [0.2, 0.5], [0.6, 0.7]])
    targets = np.array([[1.0, nan], [0.0, 1.0], [nan, 0.0]])
    # labelled entries: (0.9, 1), (0.2, 0), (0.5, 1), (0.7, 0)
    expected = -(math.log(0.9) + math.log(0.8) + math.log(0.5) + math.log(0.3)) / 4
    assert labelled_bce(probs, targets) == pytest.approx(expected)
    # column 0: rows 0, 1 -> AUROC 1; column 1: rows 1, 2 -> positive 0.5 below negative 0.7 -> 0
    assert labelled_mean_auroc(probs, targets) == pytest.approx(0.5)
    assert math.isnan(labelled_mean_auroc(probs[:1], targets[:1]))  # no column has both classes
