"""Run-level summary of a federated job: losses per round, bytes per round per site, and their plots."""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read_jsonl(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def communication_per_round(records: list[dict]) -> list[dict]:
    """Per round and direction: bytes per site (all exchanges of the round summed per site, e.g. DP's
    distance task and the train task), averaged over sites, total and split by content."""
    per_site: dict = defaultdict(lambda: defaultdict(int))  # (round, direction, site) -> part -> bytes
    for r in records:
        if r.get("round") is None:
            continue
        key = (int(r["round"]), r["direction"], r.get("site"))
        for part, value in r.items():
            if part not in ("round", "site", "direction", "task", "time"):
                per_site[key][part] += int(value)
    rows = []
    for rnd in sorted({k[0] for k in per_site}):
        row = {"round": rnd}
        for direction in ("upload", "download"):
            sites = [parts for (r, d, _), parts in per_site.items() if r == rnd and d == direction]
            names = sorted({p for parts in sites for p in parts})
            row[direction] = {p: sum(parts.get(p, 0) for parts in sites) / len(sites) for p in names} if sites else {}
            row[f"n_sites_{direction}"] = len(sites)
        rows.append(row)
    return rows


def mean_bytes_per_site_round(rows: list[dict]) -> dict:
    """Mean over rounds of the per-site totals: what the paper's Table 7 reports (up + down)."""
    if not rows:
        return {"upload": 0.0, "download": 0.0, "total": 0.0}
    up = sum(r["upload"].get("total", 0.0) for r in rows) / len(rows)
    down = sum(r["download"].get("total", 0.0) for r in rows) / len(rows)
    return {"upload": up, "download": down, "total": up + down}


#: bounds on a loss term a site streams (it is a site's value: checked before it is kept)
MAX_TERM_TAG, MAX_TERM_STEP, MAX_TERM_VALUE, MAX_TERMS_PER_ROUND = 64, 1_000_000, 1e6, 16


def loss_term_ok(tag: object, step: object, value: object, prefix: str = "loss_") -> bool:
    """A streamed per-round loss term worth keeping: a short ``loss_*`` tag, an integer round in range, a finite
    number of bounded magnitude."""
    return (isinstance(tag, str) and tag.startswith(prefix) and len(tag) <= MAX_TERM_TAG
            and isinstance(step, int) and not isinstance(step, bool) and 0 <= step <= MAX_TERM_STEP
            and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and abs(value) <= MAX_TERM_VALUE)


def loss_term_means(terms: dict, sites_per_round: dict | None = None) -> dict[int, dict[str, float]]:
    """``{round: {term: {site: value}}}`` -> ``{round: {term: mean over the sites}}`` (the site names go).

    With ``sites_per_round`` (round -> the sites whose contribution the round aggregated) only those sites count:
    a name that contributed nothing that round cannot move the mean."""
    out: dict[int, dict[str, float]] = {}
    for rnd, per_term in sorted(terms.items()):
        if sites_per_round is not None:
            allowed = set(sites_per_round.get(rnd, ()))
            per_term = {t: {s: v for s, v in by_site.items() if s in allowed} for t, by_site in per_term.items()}
        means = {term: sum(by_site.values()) / len(by_site) for term, by_site in sorted(per_term.items()) if by_site}
        if means:
            out[int(rnd)] = means
    return out


def loss_curves(rounds: list[dict]) -> dict[str, tuple[list, list]]:
    """What ``loss.png`` draws (mean over sites per round): ``loss`` (the total) and every term under the rounds'
    ``loss_terms`` (e.g. FCL's ``loss_local`` and ``loss_remote``), each as (rounds, values)."""
    curves: dict[str, tuple[list, list]] = {}
    pts = [(r["round"], r["mean_loss"]) for r in rounds if r.get("mean_loss") is not None]
    if pts:
        curves["loss"] = ([p[0] for p in pts], [p[1] for p in pts])
    for term in sorted({t for r in rounds for t in r.get("loss_terms") or {}}):
        pts = [(r["round"], r["loss_terms"][term]) for r in rounds if term in (r.get("loss_terms") or {})]
        curves[term] = ([p[0] for p in pts], [p[1] for p in pts])
    return curves


def write_run_report(out_dir: str, *, title: str, rounds: list[dict], comm_records: list[dict],
                     extra: dict | None = None) -> dict:
    """Write summary.json, loss.png and bytes_per_round.png into ``out_dir``; return the summary."""
    comm = communication_per_round(comm_records)
    summary = {
        "title": title,
        "rounds": rounds,
        "communication_per_round": comm,
        "bytes_per_site_per_round": mean_bytes_per_site_round(comm),
        **(extra or {}),
    }
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=float)

    fig, ax = plt.subplots(figsize=(6, 4))
    curves = loss_curves(rounds)
    total = curves.pop("loss", ([], []))
    ax.plot(*total, marker="o", label="loss, mean over sites" if curves else "mean over sites")
    for term, (xs, ys) in curves.items():  # the loss terms apart (FCL: the remote term grows as the bank fills)
        ax.plot(xs, ys, marker=".", ls="--", label=f"{term}, mean over sites")
    spread = [(r["round"], r["mean_loss"], r["loss_std_over_sites"]) for r in rounds
              if r.get("mean_loss") is not None and r.get("loss_std_over_sites") is not None]
    if spread:  # the spread over sites, without naming any site
        xs, ms, sd = (np.asarray(v, dtype=float) for v in zip(*spread))
        ax.fill_between(xs, ms - sd, ms + sd, alpha=0.2, label="+-1 std over sites")
    ax.set(xlabel="round", ylabel="training loss", title=title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "loss.png"), dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for direction in ("upload", "download"):
        ax.plot([r["round"] for r in comm], [r[direction].get("total", 0) / 1e6 for r in comm], marker="o",
                label=direction)
    ax.set(xlabel="round", ylabel="MB per site", title="bytes per site per round")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "bytes_per_round.png"), dpi=100)
    plt.close(fig)
    return summary
