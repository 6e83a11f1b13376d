"""Paired comparison of two methods (surgical aggregation (Kulkarni et al., ML4H 2024), sec. 2.6 and 3.1).

The paper compares models with *paired t-tests*: in the ablation between the mean AUROCs of the runs (one pair per
iteration / seed), in the real-world experiments across the class-level AUROCs (one pair per class).
:func:`paired_t_test` is that test; :func:`wilcoxon_signed_rank` is its rank-based counterpart (no normality
assumption; exact null distribution, so it stays valid for the few pairs an ablation has).  :func:`compare`
runs both on the same pairs.  :func:`class_pairs` / :func:`seed_pairs` read the pairs from the ``results.json``
payloads that ``fedssl.eval.surgical_report.write_results`` writes (federated and centralised runs alike).

Pure numpy (no scipy): the Student t tail comes from the regularised incomplete beta function (continued
fraction, Numerical Recipes' ``betacf``), the Wilcoxon null distribution from counting the sign patterns.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np

__all__ = ["paired_t_test", "wilcoxon_signed_rank", "compare", "class_pairs", "seed_pairs", "student_t_sf"]


def _differences(a: Sequence[float], b: Sequence[float]) -> np.ndarray:
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.ndim != 1 or x.shape != y.shape:
        raise ValueError(f"paired samples need two flat sequences of one length (got {x.shape} and {y.shape})")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        raise ValueError("paired samples must be finite numbers (drop undefined AUROCs from both sides first)")
    return x - y


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def student_t_sf(t: float, df: int) -> float:
    """P(T > t) for Student's t with ``df`` degrees of freedom."""
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return tail if t >= 0 else 1.0 - tail


def paired_t_test(a: Sequence[float], b: Sequence[float]) -> dict:
    """Two-sided paired t-test of ``a - b`` (paper sec. 2.6): ``{"n", "mean_diff", "sd_diff", "t", "df", "p"}``.
    ``t = mean(d) / (sd(d) / sqrt(n))`` with the sample standard deviation (n - 1); needs n >= 2.  Identical
    differences (sd 0) give t = +-inf and p = 0, or t = NaN and p = 1 when they are all 0."""
    d = _differences(a, b)
    n = len(d)
    if n < 2:
        raise ValueError(f"a paired t-test needs at least 2 pairs (got {n})")
    mean, sd = float(d.mean()), float(d.std(ddof=1))
    if sd == 0.0:
        t, p = (math.copysign(math.inf, mean), 0.0) if mean != 0.0 else (float("nan"), 1.0)
    else:
        t = mean / (sd / math.sqrt(n))
        p = min(1.0, 2.0 * student_t_sf(abs(t), n - 1))
    return {"n": n, "mean_diff": mean, "sd_diff": sd, "t": t, "df": n - 1, "p": p}


def _average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks, ties given the mean of the ranks they span."""
    order = np.argsort(values, kind="mergesort")
    ranks = np.empty(len(values), dtype=np.float64)
    sv = values[order]
    starts = np.r_[0, np.flatnonzero(np.diff(sv)) + 1]
    ends = np.r_[starts[1:], len(sv)]
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    return ranks


def wilcoxon_signed_rank(a: Sequence[float], b: Sequence[float]) -> dict:
    """Two-sided Wilcoxon signed-rank test of ``a - b``: ``{"n", "w_plus", "w_minus", "p"}``.

    Zero differences are dropped (Wilcoxon's convention); |d| ties get average ranks.  The p-value is exact: the
    null distribution of W+ over all 2^n sign patterns of the (doubled, so integer) ranks, counted by dynamic
    programming; p = min(1, 2 * P(W <= min(W+, W-))).  No pair left: p = 1."""
    d = _differences(a, b)
    d = d[d != 0.0]
    n = len(d)
    if n == 0:
        return {"n": 0, "w_plus": 0.0, "w_minus": 0.0, "p": 1.0}
    ranks = _average_ranks(np.abs(d))
    w_plus, w_minus = float(ranks[d > 0].sum()), float(ranks[d < 0].sum())
    doubled = np.rint(2 * ranks).astype(int)  # average ranks are multiples of 1/2
    counts = np.zeros(int(doubled.sum()) + 1, dtype=np.float64)
    counts[0] = 1.0
    for r in doubled:
        counts[r:] = counts[r:] + counts[:-r]  # the right side is built before the assignment
    counts /= counts.sum()
    observed = int(round(2 * min(w_plus, w_minus)))
    return {"n": n, "w_plus": w_plus, "w_minus": w_minus, "p": min(1.0, 2.0 * float(counts[:observed + 1].sum()))}


def compare(a: Sequence[float], b: Sequence[float], labels: Sequence[str] | None = None) -> dict:
    """Both tests on the pairs ``(a[i], b[i])`` (``labels`` name them, e.g. "site-1/Mass" or "seed 3")."""
    labels = list(labels) if labels is not None else [str(i) for i in range(len(a))]
    if len(labels) != len(a):
        raise ValueError(f"{len(labels)} labels for {len(a)} pairs")
    return {"pairs": [{"label": lab, "a": float(x), "b": float(y)} for lab, x, y in zip(labels, a, b)],
            "t_test": paired_t_test(a, b), "wilcoxon": wilcoxon_signed_rank(a, b)}


def _per_class(payload: Mapping, where: str) -> dict[str, float]:
    out = {}
    for site, res in payload.get("sites", {}).items():
        for cls, row in (res.get(where) or {}).get("per_class", {}).items():
            if row.get("auroc") is not None and math.isfinite(float(row["auroc"])):
                out[f"{site}/{cls}"] = float(row["auroc"])
    return out


def class_pairs(payload_a: Mapping, payload_b: Mapping,
                where: str = "test") -> tuple[list[float], list[float], list[str]]:
    """The class-level pairs of two runs (paper sec. 2.6, real-world experiments): one pair per (site, class)
    whose AUROC both runs define, on the sites' test sets (``where="test"``) or the external set
    (``"external"``); ``(a, b, labels)`` in sorted label order."""
    if where not in ("test", "external"):
        raise ValueError(f"where={where!r}: use 'test' (the sites' test sets) or 'external'")
    pa, pb = _per_class(payload_a, where), _per_class(payload_b, where)
    labels = sorted(set(pa) & set(pb))
    if not labels:
        raise ValueError(f"the two runs share no (site, class) with a defined {where} AUROC")
    return [pa[k] for k in labels], [pb[k] for k in labels], labels


def _mean_of(payload: Mapping, where: str) -> float:
    table = payload["table"]
    value = table["mean"]["mean_auroc"] if where == "test" else (table["external"] or [{}])[0].get("mean_auroc")
    if value is None:
        raise ValueError(f"a run has no {where} mean AUROC (table of {payload.get('title', 'the run')!r})")
    return float(value)


def seed_pairs(payloads_a: Sequence[Mapping], payloads_b: Sequence[Mapping],
               where: str = "test") -> tuple[list[float], list[float], list[str]]:
    """The run-level pairs (paper sec. 2.6, ablation): run i of method A against run i of method B (same seed /
    iteration), each the run's mean AUROC on the sites' test sets or the external set."""
    if len(payloads_a) != len(payloads_b) or len(payloads_a) < 2:
        raise ValueError(f"pair runs one to one, at least 2 per method (got {len(payloads_a)} and {len(payloads_b)})")
    a = [_mean_of(p, where) for p in payloads_a]
    b = [_mean_of(p, where) for p in payloads_b]
    return a, b, [f"run {i + 1}" for i in range(len(a))]
