"""Per-class AUROC tables of surgical aggregation runs (surgical aggregation (Kulkarni et al., ML4H 2024) sec. 2.6 and
tables 2-4).

- :func:`auroc_table`: one site's predictions -> per-class AUROC with a bootstrap 95 % CI and their mean
  (a class with only positives or only negatives in the set has no AUROC and is listed as such);
- :func:`results_table`: the test replies of every site + which site holds which class -> per site the
  mean AUROC over its classes, over the *shared* classes (held by more than one site) and over its *unique*
  classes; on the external set the mean over all classes of the model and over each site's classes;
- :func:`write_results`: ``results.json``, ``results.md`` and ``auroc.png`` (per-class AUROC with CIs).

Pure numpy / matplotlib; the FLARE glue (``fedssl.flare.surgical_evaluation``) calls these.
"""

from __future__ import annotations

import json
import math
import os
from typing import Mapping, Sequence

import numpy as np

RESULTS_JSON, RESULTS_MD, RESULTS_PNG = "results.json", "results.md", "auroc.png"


def _mean(values) -> float | None:
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return float(np.mean(vals)) if vals else None


def auroc_table(probs: np.ndarray, targets: np.ndarray, classes: Sequence[str], n_bootstrap: int = 1000,
                seed: int = 0) -> dict:
    """{"per_class": {class: {"auroc", "ci95", "n_pos", "n"}}, "mean_auroc", "n_classes"} for [N, C] inputs.

    AUROC and percentile-bootstrap CI from ``fedssl.eval.auroc``; a class without positives or negatives in
    the set has ``auroc`` None (undefined, not 0.5) and is left out of the mean.
    """
    from fedssl.eval.auroc import auroc, per_class_auroc

    probs, targets = np.asarray(probs, dtype=np.float64), np.asarray(targets, dtype=np.float64)
    if probs.shape != targets.shape or probs.ndim != 2 or probs.shape[1] != len(classes):
        raise ValueError(f"scores {probs.shape} / targets {targets.shape} do not match {len(classes)} classes")
    if n_bootstrap:
        rows = per_class_auroc(probs, targets, list(classes), n_boot=n_bootstrap, seed=seed)
    else:
        rows = [{"class": c, "auroc": auroc(probs[:, j], targets[:, j]), "lo": float("nan"), "hi": float("nan"),
                 "n_pos": int(targets[:, j].sum())} for j, c in enumerate(classes)]
    finite = lambda v: v is not None and math.isfinite(v)  # noqa: E731
    per_class = {r["class"]: {"auroc": float(r["auroc"]) if finite(r["auroc"]) else None,
                              "ci95": [float(r["lo"]), float(r["hi"])] if finite(r["lo"]) and finite(r["hi"]) else None,
                              "n_pos": int(r["n_pos"]), "n": int(len(targets))} for r in rows}
    return {"per_class": per_class, "mean_auroc": _mean(e["auroc"] for e in per_class.values()),
            "n_classes": sum(e["auroc"] is not None for e in per_class.values())}


def results_table(sites: Mapping[str, dict], site_classes: Mapping[str, Sequence[str]],
                  global_classes: Sequence[str]) -> dict:
    """Means over shared / unique classes per site, and external-set means, from the sites' test replies."""
    holders = {c: [s for s, cs in site_classes.items() if c in cs] for c in global_classes}
    shared = [c for c in global_classes if len(holders[c]) > 1]
    rows, external = [], []
    for site, reply in sorted(sites.items()):
        own = list(site_classes.get(site, []))
        per = (reply.get("test") or {}).get("per_class", {})
        rows.append({
            "site": site, "model": reply.get("model"), "n_test": reply.get("n_test"),
            "n_classes": len(own),
            "mean_auroc": _mean(per.get(c, {}).get("auroc") for c in own),
            "shared_auroc": _mean(per.get(c, {}).get("auroc") for c in own if c in shared),
            "unique_auroc": _mean(per.get(c, {}).get("auroc") for c in own if c not in shared),
        })
        ext = reply.get("external")
        if ext:
            ep = ext.get("per_class", {})
            row = {"site": site, "model": reply.get("model"), "n_images": ext.get("n_images"),
                   "n_classes": ext.get("n_classes"), "mean_auroc": ext.get("mean_auroc"),
                   "shared_auroc": _mean(ep.get(c, {}).get("auroc") for c in shared),
                   "unique_auroc": _mean(e.get("auroc") for c, e in ep.items() if c not in shared),
                   "classes_of": {s: _mean(ep.get(c, {}).get("auroc") for c in cs)
                                  for s, cs in sorted(site_classes.items())}}
            external.append(row)
    return {"shared_classes": shared, "unique_classes": [c for c in global_classes if c not in shared],
            "sites": rows, "external": external,
            "mean": {k: _mean(r[k] for r in rows) for k in ("mean_auroc", "shared_auroc", "unique_auroc")}}


def _cell(v) -> str:
    return "n/a" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))


def markdown(table: dict, title: str, model_source: str) -> str:
    lines = [f"# {title}", "", f"Model: {model_source}", "",
             f"Shared classes ({len(table['shared_classes'])}): {', '.join(table['shared_classes']) or '-'}", "",
             "## Site test sets (each site's classes)", "",
             "| site | model | test images | classes | mean AUROC | shared | unique |", "|---|---|---|---|---|---|---|"]
    for r in table["sites"]:
        lines.append(f"| {r['site']} | {r['model']} | {_cell(r['n_test'])} | {r['n_classes']} | "
                     f"{_cell(r['mean_auroc'])} | {_cell(r['shared_auroc'])} | {_cell(r['unique_auroc'])} |")
    m = table["mean"]
    lines.append(f"| **mean** | | | | {_cell(m['mean_auroc'])} | {_cell(m['shared_auroc'])} | "
                 f"{_cell(m['unique_auroc'])} |")
    if table["external"]:
        owners = list(table["external"][0]["classes_of"])
        lines += ["", "## External test set (every class of the model)", "",
                  "| evaluated at | model | images | classes | mean AUROC | shared | unique | "
                  + " | ".join(f"{s} classes" for s in owners) + " |", "|---" * (7 + len(owners)) + "|"]
        for r in table["external"]:
            lines.append(f"| {r['site']} | {r['model']} | {_cell(r['n_images'])} | {_cell(r['n_classes'])} | "
                         f"{_cell(r['mean_auroc'])} | {_cell(r['shared_auroc'])} | {_cell(r['unique_auroc'])} | "
                         + " | ".join(_cell(r["classes_of"][s]) for s in owners) + " |")
    return "\n".join(lines) + "\n"


def auroc_plot(sites: Mapping[str, dict], path: str, title: str) -> None:
    """Per-class AUROC with 95 % CI error bars: one panel per site test set (+ one per external evaluation)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    for site, reply in sorted(sites.items()):
        if reply.get("test"):
            panels.append((f"{site} test", reply["test"]["per_class"]))
        if reply.get("external"):
            panels.append((f"external ({site})", reply["external"]["per_class"]))
    if not panels:
        return
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.8 * len(panels)), squeeze=False)
    for ax, (name, per) in zip(axes[:, 0], panels):
        names = list(per)
        vals = [per[c]["auroc"] if per[c]["auroc"] is not None else np.nan for c in names]
        err = np.array([[v - (per[c]["ci95"] or [v, v])[0], (per[c]["ci95"] or [v, v])[1] - v]
                        if per[c]["auroc"] is not None and per[c]["ci95"] and None not in per[c]["ci95"] else [0.0, 0.0]
                        for c, v in zip(names, vals)]).T
        # a percentile bootstrap interval need not contain the point estimate (few resamples, few positives):
        # the bar then shows the side that does, never a negative error (matplotlib refuses one)
        err = np.maximum(err, 0.0)
        ax.bar(range(len(names)), vals, yerr=err, capsize=2, color="tab:blue", alpha=0.8)
        ax.axhline(0.5, color="grey", lw=0.8, ls="--")
        ax.set_ylim(0, 1.05)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=35, ha="right", fontsize=7)
        ax.set_ylabel("AUROC")
        ax.set_title(name, fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_results(out_dir: str, sites: Mapping[str, dict], registry: dict, title: str, model_source: str) -> dict:
    """results.json (table + per-site replies + registry), results.md and auroc.png in ``out_dir``."""
    table = results_table(sites, registry["site_classes"], registry["global_classes"])
    payload = {"title": title, "model_source": model_source, "method": registry.get("method"),
               "backbone": registry.get("backbone"), "global_classes": registry["global_classes"],
               "site_classes": registry["site_classes"], "table": table, "sites": dict(sites)}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, RESULTS_JSON), "w") as f:
        json.dump(payload, f, indent=2)
    with open(os.path.join(out_dir, RESULTS_MD), "w") as f:
        f.write(markdown(table, title, model_source))
    auroc_plot(sites, os.path.join(out_dir, RESULTS_PNG), title)
    return payload
