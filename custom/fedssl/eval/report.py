"""Summaries, text tables and plots of fine-tuning results in the layout of the FCL paper's Tables 1-3.

FCL (Wu et al., MedIA 2022) Table 1 (local) caption: "The average dice score and standard deviation across 10 clients
are reported, in which on each client the dice score is averaged on 5-fold cross-validation." So for
the local and federated modes the Dice of each site is first averaged over folds, then mean +- std is
taken over sites. Centralised fine-tuning (Table 3) trains one model per fold, so its mean +- std is
over folds. The standard deviation is the population one (``numpy.std``, ddof=0).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

MODE_ORDER: tuple[str, ...] = ("local", "federated", "centralised")


def _mode_key(mode: str) -> tuple[int, str]:
    return (MODE_ORDER.index(mode), mode) if mode in MODE_ORDER else (len(MODE_ORDER), mode)


def summarise(rows: Sequence[Mapping[str, Any]]) -> list[dict]:
    """Group rows by (mode, method, n_labelled) -> ``{"mode", "method", "n_labelled", "dice_mean",
    "dice_std", "n"}``; ``n`` is the number of sites (local / federated: fold-averaged per site) or of
    folds (centralised) the mean and std are taken over. Order: mode (local, federated, centralised,
    others), method in order of first appearance, N ascending."""
    groups: dict[tuple[str, str, int], list[Mapping[str, Any]]] = {}
    method_order: dict[str, int] = {}
    for r in rows:
        groups.setdefault((str(r["mode"]), str(r["method"]), int(r["n_labelled"])), []).append(r)
        method_order.setdefault(str(r["method"]), len(method_order))
    out = []
    for (mode, method, n), group in sorted(
        groups.items(), key=lambda kv: (_mode_key(kv[0][0]), method_order[kv[0][1]], kv[0][2])
    ):
        unit = "fold" if mode == "centralised" else "site"
        per_unit: dict[Any, list[float]] = {}
        for r in group:
            per_unit.setdefault(r[unit], []).append(float(r["dice"]))
        values = np.array([np.mean(v) for v in per_unit.values()], dtype=np.float64)
        out.append(
            {
                "mode": mode,
                "method": method,
                "n_labelled": n,
                "dice_mean": float(values.mean()),
                "dice_std": float(values.std()),
                "n": int(values.size),
            }
        )
    return out


def paired_difference(a: Mapping[Any, float], b: Mapping[Any, float]) -> tuple[float, float, int, str]:
    """``a - b`` paired by key (site): mean, population std over the common keys, their count, and the word:
    "helped" when the mean exceeds the std, "hurt" when it is below minus the std, otherwise "within the spread"."""
    keys = sorted(set(a) & set(b), key=str)
    diffs = np.array([float(a[k]) - float(b[k]) for k in keys], dtype=np.float64)
    mean, std = float(diffs.mean()), float(diffs.std())
    word = "helped" if mean > std else "hurt" if mean < -std else "within the spread (no clear effect)"
    return mean, std, len(keys), word


def pretraining_verdict(rows: Sequence[Mapping[str, Any]], method: str, baseline: str = "random", *,
                        mode: str = "local") -> str:
    """One line: did ``method`` beat ``baseline`` beyond the spread, at the smallest N both were run with?

    Paired by site (each site's Dice averaged over folds first, as :func:`summarise` does): the mean difference
    and its population std over sites.  "helped" when the mean difference exceeds that std, "hurt" when it is
    below minus the std, otherwise "within the spread" (no clear effect).  Rows of several training seeds
    (``row["seed"]``) are compared seed by seed: each seed's difference is its mean over the sites, and the spread
    is the population std of those over the seeds (the run-to-run spread, which the sites' does not hold)."""
    per: dict[tuple[str, int], dict[int, dict[Any, list[float]]]] = {}
    for r in rows:
        if r["mode"] == mode and r["method"] in (method, baseline):
            per.setdefault((str(r["method"]), int(r["n_labelled"])), {}).setdefault(
                int(r.get("seed", 0)), {}).setdefault(r["site"], []).append(float(r["dice"]))
    ns = sorted({n for m, n in per if m == method} & {n for m, n in per if m == baseline})
    if not ns:
        return f"{method} vs {baseline}: no {mode} fine-tuning at a common N to compare"
    n = ns[0]
    a, b = per[(method, n)], per[(baseline, n)]
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return f"{method} vs {baseline}: no {mode} fine-tuning of a common seed at N={n} to compare"
    if len(seeds) > 1:
        by_seed = {sd: paired_difference({s: np.mean(v) for s, v in a[sd].items()},
                                         {s: np.mean(v) for s, v in b[sd].items()})[0] for sd in seeds}
        mean, std, count, word = paired_difference(by_seed, {sd: 0.0 for sd in seeds})
        return (f"{method} vs {baseline}, {mode} fine-tuning at N={n}: {mean:+.3f} +- {std:.3f} Dice over "
                f"{count} seeds (each the mean over its sites) -> pre-training {word}")
    (sd,) = seeds
    mean, std, n_sites, word = paired_difference({s: np.mean(v) for s, v in a[sd].items()},
                                                 {s: np.mean(v) for s, v in b[sd].items()})
    return (f"{method} vs {baseline}, {mode} fine-tuning at N={n}: {mean:+.3f} +- {std:.3f} Dice over "
            f"{n_sites} sites -> pre-training {word}")


PAIR_UNITS: dict[str, tuple[str, ...]] = {"local": ("site", "fold"), "federated": ("site", "fold"),
                                           "centralised": ("fold",)}


def paired_against(rows: Sequence[Mapping[str, Any]], baseline: str = "random", *, mode: str,
                   units: Sequence[str] | None = None, column: str = "n_labelled", score: str = "dice") -> list[dict]:
    """Every method against ``baseline``, per ``column`` value (N), paired by the unit each model was trained for
    (``units``; default :data:`PAIR_UNITS` of ``mode``: (site, fold) in the local and federated modes, fold in the
    centralised one) and the training seed (``row["seed"]``, 0 when absent): a method's run is compared with the
    baseline's run of the same unit and seed.  Rows are those of ``mode`` (``row["mode"]``); the compared value
    is ``row[score]``.

    Returns ``{"method", column, "diff_mean", "diff_se", "ahead", "pairs", "seeds"}`` per (method, column value)
    that has at least one pair, methods in order of first appearance, column values ascending: the mean of
    ``method - baseline`` over the common pairs, its standard error (sample std / sqrt(pairs); None with one pair),
    how many pairs the method is ahead in (strictly) and the number of seeds.  With more than one seed also
    ``"by_seed"`` (seed -> mean difference over that seed's pairs) and ``"seed_se"`` (sample std of those means /
    sqrt(seeds)): the standard error that holds the run-to-run spread, which the one over pairs does not."""
    if units is None:
        if mode not in PAIR_UNITS:
            raise ValueError(f"mode={mode!r} is not one of {sorted(PAIR_UNITS)}")
        units = PAIR_UNITS[mode]
    values: dict[tuple[str, Any], dict[tuple, float]] = {}
    order: dict[str, int] = {}
    for r in rows:
        if r["mode"] != mode:
            continue
        order.setdefault(str(r["method"]), len(order))
        key = (int(r.get("seed", 0)), *(str(r[u]) for u in units))
        values.setdefault((str(r["method"]), r[column]), {})[key] = float(r[score])
    out = []
    for method, n in sorted(values, key=lambda mn: (order[mn[0]], mn[1])):
        base = values.get((baseline, n))
        if method == baseline or base is None:
            continue
        keys = sorted(set(values[(method, n)]) & set(base))
        if not keys:
            continue
        d = np.array([values[(method, n)][k] - base[k] for k in keys], dtype=np.float64)
        se = float(d.std(ddof=1) / np.sqrt(d.size)) if d.size > 1 else None
        seeds = sorted({k[0] for k in keys})
        entry = {"method": method, column: n, "diff_mean": float(d.mean()), "diff_se": se,
                 "ahead": int((d > 0).sum()), "pairs": int(d.size), "seeds": len(seeds)}
        if len(seeds) > 1:
            means = np.array([d[[k[0] == s for k in keys]].mean() for s in seeds], dtype=np.float64)
            entry["by_seed"] = {str(s): float(m) for s, m in zip(seeds, means)}
            entry["seed_se"] = float(means.std(ddof=1) / np.sqrt(means.size))
        out.append(entry)
    return out


def format_paired(paired: Sequence[Mapping[str, Any]], baseline: str = "random", *, column: str = "n_labelled",
                  name: Callable[[Any], str] = "N={}".format, digits: int = 3) -> str:
    """:func:`paired_against`'s result as one line per method: ``"FCL minus random: N=1 -0.070 (SE 0.025) ahead
    in 2/15; ..."``, with several seeds ``"N=1 -0.070 (SE 0.025) ahead in 6/45, by seed -0.05 / -0.09 / -0.07
    (SE over seeds 0.012)"``; empty when there is nothing to compare.  ``column``: the field :func:`paired_against`
    grouped by, ``name``: its value as the text shows it, ``digits``: decimals of the differences."""
    lines: dict[str, list[str]] = {}
    for p in paired:
        se = "SE n/a" if p["diff_se"] is None else f"SE {p['diff_se']:.{digits}f}"
        text = f"{name(p[column])} {p['diff_mean']:+.{digits}f} ({se}) ahead in {p['ahead']}/{p['pairs']}"
        if "by_seed" in p:
            text += (", by seed " + " / ".join(f"{v:+.{digits}f}" for v in p["by_seed"].values())
                     + f" (SE over seeds {p['seed_se']:.{digits}f})")
        lines.setdefault(p["method"], []).append(text)
    return "\n".join(f"{m} minus {baseline}: " + "; ".join(parts) for m, parts in lines.items())


def accuracy_verdict(method: str, accuracy: float, baseline: str, baseline_accuracy: float, n_test: int) -> str:
    """One line: did ``method`` beat ``baseline`` on the same held-out test set of ``n_test`` images beyond the
    test set's sampling error?

    Both accuracies come from one run each, so the only spread available is the binomial standard error of the
    difference, sqrt(a(1-a)/n + b(1-b)/n); "helped" when the difference exceeds twice it, "hurt" when it is below
    minus twice it, otherwise "within the spread".  Seed-to-seed variation is not in it (the tables runner's
    ``--seeds`` measures that)."""
    if isinstance(n_test, bool) or not isinstance(n_test, int) or n_test <= 0:
        raise ValueError(f"n_test={n_test!r}: must be the positive number of test images both accuracies were measured "
                         "on")
    for name, value in ((method, accuracy), (baseline, baseline_accuracy)):
        if not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
            raise ValueError(f"accuracy of {name}={value!r}: must be a number in [0, 1]")
    a, b = float(accuracy), float(baseline_accuracy)
    diff, se = a - b, float(np.sqrt(a * (1.0 - a) / n_test + b * (1.0 - b) / n_test))
    word = "helped" if diff > 2.0 * se else "hurt" if diff < -2.0 * se else "within the spread (no clear effect)"
    return (f"{method} vs {baseline}: test accuracy {diff:+.3f} (2 x binomial SE {2.0 * se:.3f}, {n_test} test "
            f"images, one seed) -> pre-training {word}")


def format_table(summary: Sequence[Mapping[str, Any]]) -> str:
    """Plain-text table like the paper's: one row per (mode, method), one column per N, cells
    ``"0.712 +- 0.031"`` (``"-"`` where a combination was not run)."""
    ns = sorted({int(s["n_labelled"]) for s in summary})
    keys: list[tuple[str, str]] = []
    cells: dict[tuple[str, str, int], str] = {}
    for s in summary:
        key = (str(s["mode"]), str(s["method"]))
        if key not in keys:
            keys.append(key)
        cells[key + (int(s["n_labelled"]),)] = f"{s['dice_mean']:.3f} +- {s['dice_std']:.3f}"
    header = ["Mode", "Method"] + [f"N={n}" for n in ns]
    body = [[mode, method] + [cells.get((mode, method, n), "-") for n in ns] for mode, method in keys]
    widths = [max(len(row[i]) for row in [header] + body) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), sep] + [line(r) for r in body]) + "\n"


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def plot_dice_vs_n(summary: Sequence[Mapping[str, Any]], path: str, *, title: str = "") -> str:
    """Dice vs N per method, error bars = std, one subplot per mode; saved as PNG (Agg canvas, no
    pyplot state)."""
    modes = sorted({str(s["mode"]) for s in summary}, key=_mode_key)
    fig = Figure(figsize=(4.5 * max(len(modes), 1), 4.0))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, max(len(modes), 1), squeeze=False)[0]
    for ax, mode in zip(axes, modes):
        methods: list[str] = []
        for s in summary:
            if s["mode"] == mode and s["method"] not in methods:
                methods.append(str(s["method"]))
        ns_all: set[int] = set()
        for method in methods:
            pts = sorted((int(s["n_labelled"]), s["dice_mean"], s["dice_std"]) for s in summary if s["mode"] == mode
                         and s["method"] == method)
            ns_all.update(p[0] for p in pts)
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o", capsize=3,
                        label=method)
        if ns_all:
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted(ns_all))
            ax.set_xticklabels([str(n) for n in sorted(ns_all)])
        ax.set_ylim(0.0, 1.0)
        ax.set_xlabel("N annotated patients")
        ax.set_ylabel("Dice (mean of LV, MYO, RV)")
        ax.set_title(f"{mode} fine-tuning")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def write_report(
    rows: Sequence[Mapping[str, Any]], out_dir: str | os.PathLike, *, title: str, extra: Mapping[str, Any] | None = None
) -> dict[str, str]:
    """Write ``summary.json`` (title, rows, summary, extra), ``dice_table.txt`` and ``dice_vs_n.png``
    into ``out_dir`` (created if needed); returns ``{"summary_json", "dice_table", "dice_vs_n"}`` paths."""
    if not rows:
        raise ValueError("no result rows to report")
    out = os.fspath(out_dir)
    os.makedirs(out, exist_ok=True)
    summary = summarise(rows)
    paths = {
        "summary_json": os.path.join(out, "summary.json"),
        "dice_table": os.path.join(out, "dice_table.txt"),
        "dice_vs_n": os.path.join(out, "dice_vs_n.png"),
    }
    with open(paths["summary_json"], "w") as f:
        json.dump(
            {"title": title, "rows": [dict(r) for r in rows], "summary": summary, "extra": dict(extra or {})},
            f,
            indent=2,
            default=_json_default,
        )
    with open(paths["dice_table"], "w") as f:
        f.write(f"{title}\n\n{format_table(summary)}")
    plot_dice_vs_n(summary, paths["dice_vs_n"], title=title)
    return paths
