"""Tables and plots of FedDRA runs beside the paper's numbers.

FedDRA: Z. Shuai, C. Wu, Z. Tang, L. Shen, "Distributionally Robust Alignment for Medical Federated Vision-Language
Pre-training Under Data Heterogeneity", TMLR.

- :func:`lambda_trajectory_png`: the DRO client weights per communication turn, one line per site, with the
  uniform weight 1/N dashed (the server's lambda; FedAvg would sit on the dashed line).
- :func:`cosine_per_turn_png`: mean cosine of matched image-text pairs per turn, per method (and site), unmatched
  pairs dashed in the same colour (Fig. 4(d-f); values from :func:`fedssl.eval.retrieval.matched_cosine`).
- :func:`variants_png`: average and worst-client recall per variant, mean over seeds with the standard error over
  seeds as error bars and every seed as a dot (the page's figure).
- :func:`format_table3`: a markdown table in the layout of the paper's Table 3 (ablations) for the bundle's
  variants, then the paper's Table 3 as printed (labelled as the paper's numbers, its own column order).
- :func:`write_summary`: ``summary.json`` and a flat ``summary.csv`` (``key,value``; nested keys joined by ``.``).

Our table's values are fractions in [0, 1] (what :mod:`fedssl.eval.retrieval` and :mod:`fedssl.train.vlp_probe`
return) printed in % with one decimal, as the paper prints them; a list of values (one per seed) prints as
``mean ± std`` (population std, ``numpy.std``, as :mod:`fedssl.eval.report`).
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from fedssl.core.checks import require
from fedssl.eval.paper_tables import FEDDRA_SOURCE, FEDDRA_TABLE3, FEDDRA_TABLE3_COLUMNS, FEDDRA_TABLE3_NOTE
from fedssl.eval.report import _json_default

__all__ = ["TABLE3_FLAGS", "TABLE3_METRICS", "lambda_series", "lambda_trajectory_png", "cosine_series",
           "cosine_per_turn_png", "variant_stats", "variants_png", "format_table3", "write_summary"]

#: (row key, column header) of the ablation switches, in the paper's order
TABLE3_FLAGS = (("two_stage", "Two-stage"), ("anchor", "Anchor (global constraint)"), ("dro", "DRO"))
#: (row key, column header) of the metrics; keys as :func:`fedssl.train.vlp_probe.few_shot_probe` ("1%", "10%")
#: and :func:`fedssl.eval.retrieval.client_summary` ("avg_R@1", "worst_R@1") name them
TABLE3_METRICS = (("rsna_1%", "RSNA cls 1%"), ("rsna_10%", "RSNA cls 10%"), ("covidx_1%", "COVIDx cls 1%"),
                  ("covidx_10%", "COVIDx cls 10%"), ("avg_R@1", "R@1"), ("avg_R@5", "R@5"),
                  ("worst_R@1", "Worst R@1"), ("worst_R@5", "Worst R@5"))


def _finite(component: str, arg: str, value: Any, where: str) -> float:
    ok = isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool)
    require(ok and math.isfinite(float(value)), component, arg, f"{where}={value!r}", "use finite numbers")
    return float(value)


def lambda_series(trajectory: Sequence[Mapping[str, Any]]) -> tuple[list[int], list[str], np.ndarray]:
    """``(turns ascending, sites in order of first appearance, weights [turns, sites])``; a site absent at a turn
    is NaN there (a gap in its line)."""
    component = "lambda_trajectory_png"
    require(len(trajectory) > 0, component, "trajectory", trajectory, "pass at least one {'turn', 'lambda'} record")
    sites: list[str] = []
    by_turn: dict[int, Mapping[str, Any]] = {}
    for i, rec in enumerate(trajectory):
        require(isinstance(rec, Mapping) and "turn" in rec and isinstance(rec.get("lambda"), Mapping), component,
                "trajectory", f"record {i}: {rec!r}", "each record is {'turn': int, 'lambda': {site: weight}}")
        turn = int(rec["turn"])
        require(turn not in by_turn, component, "trajectory", f"turn {turn} twice", "give one record per turn")
        by_turn[turn] = rec["lambda"]
        for site in rec["lambda"]:
            if site not in sites:
                sites.append(site)
    turns = sorted(by_turn)
    values = np.full((len(turns), len(sites)), np.nan)
    for t, turn in enumerate(turns):
        for site, w in by_turn[turn].items():
            values[t, sites.index(site)] = _finite(component, "trajectory", w, f"turn {turn} lambda[{site!r}]")
    return turns, sites, values


def _save(fig: Figure, path: str | os.PathLike, title: str) -> str:
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=100)
    return os.fspath(path)


#: the columns of :func:`variants_png`: (row key, label)
VARIANT_METRICS = (("avg_R@1", "R@1"), ("worst_R@1", "worst R@1"), ("avg_R@5", "R@5"), ("worst_R@5", "worst R@5"))


def variant_stats(rows: Sequence[Mapping[str, Any]], variants: Sequence[str]) -> dict[str, dict[str, dict]]:
    """Per variant with rows (in ``variants``' order) and metric of :data:`VARIANT_METRICS`: the values in % (one per
    seed), their mean and the standard error over seeds (sample std / sqrt(seeds); None for one seed)."""
    out: dict[str, dict[str, dict]] = {}
    for v in variants:
        rs = [r for r in rows if r["variant"] == v]
        if not rs:
            continue
        out[v] = {}
        for key, _ in VARIANT_METRICS:
            vals = [100.0 * float(r[key]) for r in rs if r.get(key) is not None]
            out[v][key] = {"values": vals, "mean": float(np.mean(vals)) if vals else None,
                           "se": float(np.std(vals, ddof=1) / math.sqrt(len(vals))) if len(vals) > 1 else None}
    return out


def variants_png(rows: Sequence[Mapping[str, Any]], variants: Sequence[str], path: str | os.PathLike,
                 title: str = "") -> str:
    """Grouped bars of text-to-image recall (%) per metric of :data:`VARIANT_METRICS` and variant (one row per
    (variant, seed), values as fractions): :func:`variant_stats`' mean over seeds, its standard error over seeds as
    error bars, each seed a black dot.  Returns ``path``."""
    stats = variant_stats(rows, variants)
    require(bool(stats), "variants_png", "rows", len(rows), "give at least one row of the listed variants")
    fig = Figure(figsize=(7.5, 3.6))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    width = 0.8 / len(stats)
    for j, (v, per) in enumerate(stats.items()):
        xs = [i + (j - (len(stats) - 1) / 2) * width for i in range(len(VARIANT_METRICS))]
        for x, (key, _) in zip(xs, VARIANT_METRICS):
            ax.plot([x] * len(per[key]["values"]), per[key]["values"], "o", color="black", markersize=2.5, zorder=3)
        ax.bar(xs, [float("nan") if per[k]["mean"] is None else per[k]["mean"] for k, _ in VARIANT_METRICS],
               width=width * 0.95, yerr=[per[k]["se"] or 0.0 for k, _ in VARIANT_METRICS], capsize=3, label=v)
    ax.set_xticks(range(len(VARIANT_METRICS)), [label for _, label in VARIANT_METRICS])
    ax.set_ylabel("text-to-image recall (%)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize="small", ncol=len(stats))
    return _save(fig, path, title)


def lambda_trajectory_png(trajectory: Sequence[Mapping[str, Any]], path: str | os.PathLike, title: str = "") -> str:
    """One line per site of its DRO weight over communication turns, the uniform weight 1/N (N = sites seen)
    dashed; saved as PNG (Agg canvas, no pyplot state).  Returns ``path``."""
    turns, sites, values = lambda_series(trajectory)
    fig = Figure(figsize=(6.0, 4.0))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for j, site in enumerate(sites):
        ax.plot(turns, values[:, j], marker="o", markersize=3, label=str(site))
    ax.axhline(1.0 / len(sites), color="black", linestyle="--", linewidth=1, label=f"uniform 1/{len(sites)}")
    ax.set_xlabel("communication turn")
    ax.set_ylabel("client weight lambda")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path, title)


def cosine_series(records: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, list[float]]]:
    """``{label: {"turn", "matched", "unmatched"}}`` sorted by turn; label = method, or ``"method / site"`` when
    the records carry a ``"site"``."""
    component = "cosine_per_turn_png"
    require(len(records) > 0, component, "records", records,
            "pass at least one {'turn', 'method', 'matched', 'unmatched'} record")
    groups: dict[str, list[tuple[int, float, float]]] = {}
    for i, r in enumerate(records):
        require(isinstance(r, Mapping) and all(k in r for k in ("turn", "method", "matched", "unmatched")),
                component, "records", f"record {i}: {r!r}",
                "each record needs 'turn', 'method', 'matched', 'unmatched'")
        label = str(r["method"]) if r.get("site") is None else f"{r['method']} / {r['site']}"
        matched = _finite(component, "records", r["matched"], f"record {i} matched")
        unmatched = _finite(component, "records", r["unmatched"], f"record {i} unmatched")
        groups.setdefault(label, []).append((int(r["turn"]), matched, unmatched))
    out = {}
    for label, pts in groups.items():
        pts.sort()
        out[label] = {"turn": [p[0] for p in pts], "matched": [p[1] for p in pts], "unmatched": [p[2] for p in pts]}
    return out


def cosine_per_turn_png(records: Sequence[Mapping[str, Any]], path: str | os.PathLike, title: str = "") -> str:
    """Mean matched-pair cosine per turn (solid) and unmatched-pair cosine (dashed, same colour) per method (and
    site), FedDRA Fig. 4(d-f) style; PNG.  Returns ``path``."""
    series = cosine_series(records)
    fig = Figure(figsize=(6.0, 4.0))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for label, s in series.items():
        (line,) = ax.plot(s["turn"], s["matched"], marker="o", markersize=3, label=f"{label} matched")
        ax.plot(s["turn"], s["unmatched"], linestyle="--", color=line.get_color(), linewidth=1,
                label=f"{label} unmatched")
    ax.set_xlabel("communication turn")
    ax.set_ylabel("mean image-text cosine similarity")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path, title)


def _cell(component: str, variant: str, key: str, value: Any) -> str:
    """``"83.2"`` for one fraction, ``"83.2 ± 0.4"`` for a list (mean ± population std, in %), ``"-"`` if absent."""
    if value is None:
        return "-"
    values = list(value) if isinstance(value, (list, tuple, np.ndarray)) else [value]
    if not values:
        return "-"
    xs = np.array([_finite(component, "rows", v, f"{variant}[{key!r}]") for v in values])
    require(bool(((xs >= 0) & (xs <= 1)).all()), component, "rows", f"{variant}[{key!r}]={value!r}",
            "pass fractions in [0, 1] (the table prints them in %)")
    xs = 100.0 * xs
    return f"{xs.mean():.1f}" if xs.size == 1 else f"{xs.mean():.1f} ± {xs.std():.1f}"


def _markdown(header: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
            + ["| " + " | ".join(row) + " |" for row in body])


def format_table3(rows: Sequence[Mapping[str, Any]], paper: bool = True) -> str:
    """Markdown table like FedDRA's Table 3: one row per bundle variant, ``{"variant": name, "two_stage": bool,
    "anchor": bool, "dro": bool}`` plus any of the :data:`TABLE3_METRICS` keys (a fraction, or a list of them over
    seeds; absent or None prints ``-``).  With ``paper``, the paper's Table 3 follows, labelled as the paper's
    numbers (%, ConVIRT backbone) and in the paper's own column order (Covid before RSNA; see
    :data:`fedssl.eval.paper_tables.FEDDRA_TABLE3_NOTE`)."""
    component = "format_table3"
    require(len(rows) > 0, component, "rows", rows, "pass at least one variant row")
    header = ["Variant"] + [h for _, h in TABLE3_FLAGS] + [h for _, h in TABLE3_METRICS]
    body = []
    for i, r in enumerate(rows):
        variant = str(r.get("variant", f"row {i}"))
        for key, _ in TABLE3_FLAGS:
            require(isinstance(r.get(key), bool), component, "rows", f"{variant}[{key!r}]={r.get(key)!r}",
                    f"give every row '{key}': True/False (is that component on in the variant?)")
        body.append([variant] + ["✓" if r[k] else "" for k, _ in TABLE3_FLAGS]
                    + [_cell(component, variant, k, r.get(k)) for k, _ in TABLE3_METRICS])
    lines = ["Ours (%; mean ± std over seeds where several): few-shot classification = linear probe on the frozen "
             "image encoder; R@k = text-to-image recall averaged over clients, Worst = the worst client's.", ""]
    lines += _markdown(header, body)
    if paper:
        p_header = ["Two-stage", "Global Constraint", "DRO-Weighing"] + list(FEDDRA_TABLE3_COLUMNS)
        p_body = [["✓" if t else "", "✓" if a else "", "✓" if d else ""] + [f"{x:.1f}" for x in v]
                  for (t, a, d), v in FEDDRA_TABLE3.items()]
        lines += ["", f"Paper's numbers, not ours -- {FEDDRA_SOURCE.format(table=3)} (ConVIRT backbone, %; the "
                  "paper fine-tunes with a linear layer, its column order and names as printed):", ""]
        lines += _markdown(p_header, p_body)
        lines += ["", f"Note: {FEDDRA_TABLE3_NOTE}"]
    return "\n".join(lines) + "\n"


def _flatten(prefix: str, value: Any, out: list[tuple[str, Any]]) -> None:
    if isinstance(value, Mapping) and value:
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out.append((prefix, value))


def write_summary(out_dir: str | os.PathLike, summary: Mapping[str, Any]) -> dict[str, str]:
    """Write ``summary.json`` (the dict as is) and ``summary.csv`` (columns ``key,value``: one row per leaf, nested
    keys joined by ``.``, lists and empty dicts as JSON) into ``out_dir`` (created if needed).  Returns
    ``{"json", "csv"}`` paths."""
    require(isinstance(summary, Mapping), "write_summary", "summary", type(summary).__name__, "pass a dict")
    out = os.fspath(out_dir)
    os.makedirs(out, exist_ok=True)
    paths = {"json": os.path.join(out, "summary.json"), "csv": os.path.join(out, "summary.csv")}
    with open(paths["json"], "w") as f:
        json.dump(summary, f, indent=2, default=_json_default)
    leaves: list[tuple[str, Any]] = []
    _flatten("", summary, leaves)
    with open(paths["csv"], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["key", "value"])
        for key, value in leaves:
            if isinstance(value, (list, tuple, dict, np.ndarray)):
                value = json.dumps(value, default=_json_default)
            elif isinstance(value, np.generic):
                value = value.item()
            w.writerow([key, value])
    return paths
