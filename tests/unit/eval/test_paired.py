"""Paired comparison of two methods (paper sec. 2.6: paired t-tests; plus the exact Wilcoxon signed-rank test), with
p-values computed by hand from closed forms and from counting sign patterns."""

import math

import pytest

from fedssl.eval.paired import class_pairs, compare, paired_t_test, seed_pairs, wilcoxon_signed_rank


def test_paired_t_test_with_three_degrees_of_freedom():
    """d = 1, 2, 3, 4: mean 2.5, sd sqrt(5/3), t = 2.5 / (sd / 2) = sqrt(15); df 3, whose CDF has the closed form
    F(t) = 1/2 + (u / (1 + u^2) + atan(u)) / pi with u = t / sqrt(3) = sqrt(5)."""
    res = paired_t_test([1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0])
    u = math.sqrt(5.0)
    p = 2 * (1 - (0.5 + (u / (1 + u * u) + math.atan(u)) / math.pi))
    assert res["n"] == 4 and res["df"] == 3 and res["mean_diff"] == 2.5
    assert math.isclose(res["sd_diff"], math.sqrt(5 / 3)) and math.isclose(res["t"], math.sqrt(15))
    assert math.isclose(res["p"], p, rel_tol=1e-9)  # 0.030466...


def test_paired_t_test_with_one_degree_of_freedom_is_cauchy():
    """a - b = (1, 3): mean 2, sd sqrt(2), t = 2; df 1 (Cauchy): p = 1 - 2 atan(2) / pi.  The sign of t follows
    a - b, the p-value does not."""
    res = paired_t_test([1.5, 3.5], [0.5, 0.5])
    assert res["t"] == pytest.approx(2.0) and res["p"] == pytest.approx(1 - 2 * math.atan(2) / math.pi, rel=1e-9)
    assert paired_t_test([0.5, 0.5], [1.5, 3.5])["t"] == pytest.approx(-2.0)


def test_paired_t_test_degenerate_and_bad_inputs():
    assert paired_t_test([1.0, 2.0], [0.0, 1.0])["p"] == 0.0  # identical non-zero differences
    assert paired_t_test([1.0, 2.0], [1.0, 2.0])["p"] == 1.0
    with pytest.raises(ValueError, match="at least 2 pairs"):
        paired_t_test([1.0], [0.0])
    with pytest.raises(ValueError, match="one length"):
        paired_t_test([1.0, 2.0], [0.0])
    with pytest.raises(ValueError, match="finite"):
        paired_t_test([1.0, float("nan")], [0.0, 0.0])


def test_wilcoxon_all_positive_is_one_sign_pattern_in_sixteen():
    """d = 1..4, all positive: W+ = 10, W- = 0; of the 2^4 sign patterns only 'all positive' has W- <= 0, so
    p = 2 * 1/16."""
    res = wilcoxon_signed_rank([1.0, 2.0, 3.0, 4.0], [0.0] * 4)
    assert (res["w_plus"], res["w_minus"], res["p"]) == (10.0, 0.0, 0.125)


def test_wilcoxon_counts_the_subsets_of_ranks_at_most_the_observed_sum():
    """d = 1, -2, 3, 4, 5: W- = 2; the subsets of {1..5} with sum <= 2 are {}, {1}, {2}: p = 2 * 3/32.  A zero
    difference is dropped (n 5, not 6)."""
    res = wilcoxon_signed_rank([1.0, -2.0, 3.0, 4.0, 5.0, 7.0], [0.0] * 5 + [7.0])
    assert (res["n"], res["w_plus"], res["w_minus"]) == (5, 13.0, 2.0) and res["p"] == 2 * 3 / 32


def test_wilcoxon_ties_get_average_ranks():
    """|d| = 1, 1, 2 -> ranks 1.5, 1.5, 3; W+ = 3 = W-.  Half-ranks: sign-pattern sums 0, 1.5, 1.5, 3, 3, 4.5, 4.5,
    6; P(W <= 3) = 5/8, p = min(1, 2 * 5/8) = 1."""
    res = wilcoxon_signed_rank([1.0, 1.0, -2.0], [0.0, 0.0, 0.0])
    assert (res["w_plus"], res["w_minus"], res["p"]) == (3.0, 3.0, 1.0)
    res = wilcoxon_signed_rank([1.0, 1.0, 2.0], [0.0, 0.0, 0.0])  # W- = 0: only 'all positive', p = 2/8
    assert res["p"] == 0.25
    # d = -1, 1, 2: W- = 1.5 (not 1 or 2 as ordinal ranks would give); P(W <= 1.5) = 3/8, p = 3/4
    res = wilcoxon_signed_rank([-1.0, 1.0, 2.0], [0.0, 0.0, 0.0])
    assert (res["w_plus"], res["w_minus"], res["p"]) == (4.5, 1.5, 0.75)


def payload(per_site, external=None, mean=None, ext_mean=None):
    sites = {s: {"test": {"per_class": {c: {"auroc": v} for c, v in cl.items()}}} for s, cl in per_site.items()}
    if external is not None:
        for s in sites:
            sites[s]["external"] = {"per_class": {c: {"auroc": v} for c, v in external.items()}}
    return {"sites": sites, "table": {"mean": {"mean_auroc": mean}, "external": [{"mean_auroc": ext_mean}]}}


def test_class_pairs_keep_the_classes_both_runs_define():
    a = payload({"site-1": {"A": 0.875, "B": 0.75}, "site-2": {"A": 0.625, "C": None}})
    b = payload({"site-1": {"A": 0.625, "B": 0.5}, "site-2": {"A": 0.375, "C": 0.9}})
    x, y, labels = class_pairs(a, b)
    assert labels == ["site-1/A", "site-1/B", "site-2/A"] and x == [0.875, 0.75, 0.625] and y == [0.625, 0.5, 0.375]
    res = compare(x, y, labels)
    assert res["t_test"]["p"] == 0.0 and res["wilcoxon"]["p"] == 0.25  # every difference +0.25; 3 pairs: 2/8
    assert [p["label"] for p in res["pairs"]] == labels
    with pytest.raises(ValueError, match="external"):
        class_pairs(a, b, where="external")


def test_seed_pairs_pair_the_runs_mean_aurocs_in_order():
    runs_a = [payload({}, mean=m, ext_mean=e) for m, e in ((0.80, 0.70), (0.82, 0.71), (0.78, 0.69))]
    runs_b = [payload({}, mean=m, ext_mean=e) for m, e in ((0.75, 0.70), (0.80, 0.72), (0.77, 0.66))]
    a, b, labels = seed_pairs(runs_a, runs_b)
    assert (a, b, labels) == ([0.80, 0.82, 0.78], [0.75, 0.80, 0.77], ["run 1", "run 2", "run 3"])
    assert seed_pairs(runs_a, runs_b, where="external")[:2] == ([0.70, 0.71, 0.69], [0.70, 0.72, 0.66])
    with pytest.raises(ValueError, match="one to one"):
        seed_pairs(runs_a, runs_b[:2])
