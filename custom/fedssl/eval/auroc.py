"""AUROC for multi-label chest X-ray classification (Surgical aggregation, surgical aggregation (Kulkarni et al., ML4H
2024), section 2.6).

- :func:`auroc`: rank-based (Mann-Whitney U / (n_pos n_neg)), ties counted one half; NaN when the labels
  hold one class only (the AUROC is undefined, not 0.5).
- :func:`bootstrap_ci`: percentile bootstrap over *images* (resampled with replacement, seeded); a resample
  in which a class lacks positives or negatives is skipped.  For ``[N, C]`` inputs the statistic is the mean
  AUROC over the classes defined on the full sample (the paper's "mean AUROC"), the same resampled images
  for every class.
- :func:`per_class_auroc`: one row per class (AUROC, 95 % CI, positives, negatives).
- :func:`shared_unique` / :func:`mean_auroc` / :func:`site_summary`: mean AUROC over a site's classes that
  another site also holds ("shared") and over those only it holds ("unique"), as in the paper's Table 3.

Pure numpy.
"""

from __future__ import annotations

import math
from typing import Mapping, NamedTuple, Sequence

import numpy as np

__all__ = ["auroc", "bootstrap_ci", "BootstrapCI", "per_class_auroc", "shared_unique", "mean_auroc", "site_summary",
           "labelled_bce", "labelled_mean_auroc"]


def _as_1d(scores, labels) -> tuple[np.ndarray, np.ndarray]:
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    y = np.asarray(labels).reshape(-1)
    if s.shape != y.shape:
        raise ValueError(f"scores {s.shape} and labels {y.shape} must have the same length")
    if not np.all(np.isfinite(s)):
        raise ValueError("scores contain NaN/Inf")
    if not np.all(np.isin(y, (0, 1))):
        raise ValueError("labels must be 0/1")
    return s, y.astype(bool)


def auroc(scores, labels) -> float:
    """Area under the ROC curve of one class; NaN when ``labels`` lack positives or negatives."""
    s, y = _as_1d(scores, labels)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    ss = s[order]
    ranks = np.empty(len(s), dtype=np.float64)
    # average rank (1-based) over each run of tied scores
    starts = np.r_[0, np.flatnonzero(np.diff(ss)) + 1]
    ends = np.r_[starts[1:], len(ss)]
    avg = (starts + ends + 1) / 2.0
    ranks[order] = np.repeat(avg, ends - starts)
    u = ranks[y].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def _weighted_auroc(s: np.ndarray, y: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """AUROC of every resample at once: ``counts [B, N]`` = how often each image is drawn."""
    order = np.argsort(s, kind="mergesort")
    ss, yy, cc = s[order], y[order], counts[:, order]
    starts = np.r_[0, np.flatnonzero(np.diff(ss)) + 1]
    wp = np.add.reduceat(cc * yy, starts, axis=1).astype(np.float64)   # [B, G] positives per tie group
    wn = np.add.reduceat(cc * ~yy, starts, axis=1).astype(np.float64)  # [B, G] negatives per tie group
    below = np.cumsum(wn, axis=1) - wn                     # negatives strictly below each group
    num = (wp * (below + 0.5 * wn)).sum(axis=1)
    den = wp.sum(axis=1) * wn.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def _resample_counts(n: int, n_boot: int, seed: int) -> np.ndarray:
    """``[n_boot, n]``: how often each image is drawn in each resample (n draws with replacement)."""
    idx = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
    flat = (idx + (np.arange(n_boot) * n)[:, None]).reshape(-1)
    return np.bincount(flat, minlength=n_boot * n).reshape(n_boot, n).astype(np.int32)


class BootstrapCI(NamedTuple):
    """Point estimate on the full sample, percentile interval, and the number of resamples used."""

    auroc: float
    lo: float
    hi: float
    n_valid: int


def bootstrap_ci(scores, labels, n_boot: int = 1000, seed: int = 0, alpha: float = 0.05,
                 counts: np.ndarray | None = None) -> BootstrapCI:
    """Percentile bootstrap CI of the AUROC (``[N]``) or of the mean AUROC over classes (``[N, C]``).

    The resamples are drawn from ``seed`` (``counts``, ``[n_boot, N]`` draw counts, reuses given ones)."""
    if not isinstance(n_boot, int) or n_boot < 1:
        raise ValueError(f"n_boot={n_boot!r}: use a positive int (1000 in the report)")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha={alpha!r}: use a level in (0, 1), e.g. 0.05 for a 95 % interval")
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels)
    if s.ndim == 1:
        s, y = s[:, None], y[:, None]
    if s.ndim != 2 or s.shape != y.shape:
        raise ValueError(f"scores {s.shape} and labels {y.shape} must both be [N] or [N, C]")
    cols = [j for j in range(s.shape[1]) if not math.isnan(auroc(s[:, j], y[:, j]))]
    nan = float("nan")
    if not cols:
        return BootstrapCI(nan, nan, nan, 0)
    point = float(np.mean([auroc(s[:, j], y[:, j]) for j in cols]))
    counts = _resample_counts(s.shape[0], n_boot, seed) if counts is None else counts
    per = np.stack([_weighted_auroc(s[:, j], y[:, j].astype(bool), counts) for j in cols], axis=1)  # [B, C']
    ok = ~np.isnan(per).any(axis=1)  # skip resamples in which a class lacks positives or negatives
    if not ok.any():
        return BootstrapCI(point, nan, nan, 0)
    stat = per[ok].mean(axis=1)
    lo, hi = np.quantile(stat, [alpha / 2, 1 - alpha / 2])
    return BootstrapCI(point, float(lo), float(hi), int(ok.sum()))


def per_class_auroc(scores, labels, classes: Sequence[str], n_boot: int = 1000, seed: int = 0,
                    alpha: float = 0.05) -> list[dict]:
    """One row per class: ``{"class", "auroc", "lo", "hi", "n_pos", "n_neg", "n_boot"}`` (CI by images)."""
    s, y = np.asarray(scores, dtype=np.float64), np.asarray(labels)
    if s.ndim != 2 or s.shape != y.shape or s.shape[1] != len(classes):
        raise ValueError(f"scores {s.shape} / labels {y.shape} must be [N, {len(classes)}] for classes {list(classes)}")
    rows = []
    counts = _resample_counts(s.shape[0], n_boot, seed) if n_boot >= 1 else None
    for j, c in enumerate(classes):
        ci = bootstrap_ci(s[:, j], y[:, j], n_boot=n_boot, seed=seed, alpha=alpha, counts=counts)
        rows.append({"class": c, "auroc": ci.auroc, "lo": ci.lo, "hi": ci.hi, "n_pos": int((y[:, j] == 1).sum()),
                     "n_neg": int((y[:, j] == 0).sum()), "n_boot": ci.n_valid})
    return rows


def shared_unique(site_classes: Mapping[str, Sequence[str]]) -> dict[str, dict[str, list[str]]]:
    """Per site: its classes another site also holds ("shared") and those only it holds ("unique"),
    each in the site's own order."""
    out = {}
    for s, cl in site_classes.items():
        others = {c for t, ocl in site_classes.items() if t != s for c in ocl}
        out[s] = {"shared": [c for c in cl if c in others], "unique": [c for c in cl if c not in others]}
    return out


def mean_auroc(per_class: Mapping[str, float] | Sequence[dict], classes: Sequence[str]) -> float:
    """Mean AUROC over ``classes`` (those with a defined AUROC); NaN when none is defined.

    ``per_class`` is a dict class -> AUROC or the rows of :func:`per_class_auroc`.  A class the model does
    not predict (absent from ``per_class``) is an error: the paper leaves such a mean undefined.
    """
    table = per_class if isinstance(per_class, Mapping) else {r["class"]: r["auroc"] for r in per_class}
    missing = [c for c in classes if c not in table]
    if missing:
        raise ValueError(f"no AUROC for classes {missing}: the model does not predict them, the mean is undefined")
    vals = [float(table[c]) for c in classes if not math.isnan(float(table[c]))]
    return float(np.mean(vals)) if vals else float("nan")


def site_summary(per_class: Mapping[str, float] | Sequence[dict], site: str,
                 site_classes: Mapping[str, Sequence[str]]) -> dict[str, float]:
    """``{"all", "shared", "unique"}`` mean AUROC over the site's classes on that site's test set."""
    groups = shared_unique(site_classes)[site]
    return {"all": mean_auroc(per_class, list(site_classes[site])),
            "shared": mean_auroc(per_class, groups["shared"]) if groups["shared"] else float("nan"),
            "unique": mean_auroc(per_class, groups["unique"]) if groups["unique"] else float("nan")}


def labelled_bce(probs, targets, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy of ``probs [N, C]`` over the labelled entries of ``targets [N, C]`` (NaN = not
    labelled: a class the image's source does not annotate, in pooled data); probabilities clipped to ``eps``."""
    p = np.clip(np.asarray(probs, dtype=np.float64), eps, 1 - eps)
    t = np.asarray(targets, dtype=np.float64)
    known = ~np.isnan(t)
    t = np.nan_to_num(t)
    return float(-np.sum(known * (t * np.log(p) + (1 - t) * np.log(1 - p))) / max(int(known.sum()), 1))


def labelled_mean_auroc(probs, targets) -> float:
    """Mean AUROC over the columns of ``probs [N, C]``; per column only the labelled rows (targets not NaN)
    count, and columns without both classes are left out (NaN when none is left)."""
    p, t = np.asarray(probs), np.asarray(targets, dtype=np.float64)
    known = ~np.isnan(t)
    values = [auroc(p[known[:, j], j], t[known[:, j], j]) for j in range(t.shape[1])]
    values = [v for v in values if not math.isnan(v)]
    return float(np.mean(values)) if values else float("nan")
