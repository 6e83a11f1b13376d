"""The README's surgical-aggregation demo: synthetic NIH-like + CheXpert-like sites (+ a MIMIC-like external
test set) -> jobs/surgical_cxr in the FLARE simulator with surgical aggregation, vanilla FL and FL with
partial loss (quick profile), plus the centralised baseline (pooled data, ``fedssl.experiments.surgical_central``) ->
mean AUROC over shared and unique classes and on the external set.

Site 1 holds the 14 NIH classes, site 2 the 13 CheXpert classes (7 shared), as in the paper.  Every run is
the same job with switches (``server.class_registration.method`` and ``.backbone``).  Everything lands in
``out``: data, per training seed ``seed<S>/`` with the simulator workspaces (each server run folder has results.md /
results.json / auroc.png) and ``central/`` (the same files), ``surgical_demo.json`` / ``surgical_demo.md`` with the
comparison, ``surgical_demo.png`` (AUROC per method, mean over seeds with the SE over seeds as error bars, each seed
a dot) and ``run_config.json`` (the settings, the torch thread count of this process -- the centralised baseline
trains here -- and the environment).

``seeds`` are training seeds: the job's ``seed`` of the server's model and persistor and of the client trainer
(initial weights, sampling, augmentation and each site's train / val / test split); the synthetic data is the same
for every seed.  Every method is paired with the others by seed (surgical minus each, SE over seeds).  The default
is seed 0 alone, and the comparison then says it is not a finding.  A run whose ``results.json`` is already there
is not run again (a second call with more seeds adds them).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence

import numpy as np

from fedssl.core.multilabel import MISSING_CLASS_RULES
from fedssl.experiments.evidence import se_over_seeds
from fedssl.experiments.environment import DEFAULT_THREADS, set_threads
from fedssl.experiments.surgical_central import run_centralised
from fedssl.experiments.table_runner import few_seeds_note, write_run_config
from fedssl.ops.jobs import REPO_ROOT
from fedssl.ops.simulate import run_simulation

JOB = os.path.join(REPO_ROOT, "jobs", "surgical_cxr")
METHODS = ("surgical", "vanilla", "partial_loss")
#: how a comparison of the demo's one-seed runs becomes one over seeds
RERUN = "--seeds 0 1 2"
#: the AUROC columns the figure and the seed summary show: (row key, label)
METRICS = (("mean_auroc", "site mean"), ("shared_auroc", "shared"), ("unique_auroc", "unique"),
           ("external_auroc", "external"))


def _say(t0: float, msg: str) -> None:
    print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)


def write_demo_data(data: str, n_patients: int, seed: int = 0) -> dict:
    from fedssl.data.cxr_synthetic import write_synthetic_surgical

    return write_synthetic_surgical(data, n_patients, seed=seed, image_size=64)


def _fmt(v) -> str:
    return "  n/a" if v is None else f"{v:.3f}"


def comparison_table(rows: list[dict]) -> str:
    head = (f"{'method':<13} {'site mean':>9} {'shared':>7} {'unique':>7} {'external':>8} {'ext shared':>10} "
            f"{'ext unique':>10} {'min ext class':>13} {'rounds':>6} {'time s':>7} {'KB/site/round':>13}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['method']:<13} {_fmt(r['mean_auroc']):>9} {_fmt(r['shared_auroc']):>7} "
                     f"{_fmt(r['unique_auroc']):>7} {_fmt(r['external_auroc']):>8} {_fmt(r['external_shared']):>10} "
                     f"{_fmt(r['external_unique']):>10} {_fmt(r['external_min_class']):>13} {r['rounds']:>6} "
                     f"{r['wall_time_s']:>7.1f} {r['kb_per_site_round']:>13.1f}")
    return "\n".join(lines)


def result_row(method: str, res: dict, rounds: int, wall_time_s: float, bytes_per_site_per_round: dict,
               results_md: str) -> tuple[dict, dict]:
    """(table row, external per-class AUROC + classes) from a run's results.json payload."""
    table, ext = res["table"], res["table"]["external"]
    ext_per = next(iter(res["sites"].values())).get("external", {}).get("per_class", {}) if ext else {}
    ext_vals = {c: e["auroc"] for c, e in ext_per.items()}
    defined = [v for v in ext_vals.values() if v is not None]
    row = {"method": method, **{k: table["mean"][k] for k in ("mean_auroc", "shared_auroc", "unique_auroc")},
           "external_auroc": ext[0]["mean_auroc"] if ext else None,
           "external_shared": ext[0]["shared_auroc"] if ext else None,
           "external_unique": ext[0]["unique_auroc"] if ext else None,
           "external_min_class": min(defined) if defined else None,
           "external_classes": len(defined), "rounds": rounds, "wall_time_s": wall_time_s,
           "kb_per_site_round": bytes_per_site_per_round["total"] / 1e3,
           "bytes_per_site_per_round": bytes_per_site_per_round, "results": results_md}
    by_class: dict[str, list] = {}  # class -> its AUROCs on the test sets of the sites labelling it
    for site_res in res["sites"].values():
        for c, e in site_res.get("test", {}).get("per_class", {}).items():
            by_class.setdefault(c, []).append(e["auroc"])
    site_vals = {c: min((v for v in vals if v is not None), default=None) for c, vals in by_class.items()}
    return row, {"external_per_class": ext_vals, "site_test_per_class": site_vals,
                 "global_classes": res["global_classes"]}


def class_check(run: dict, threshold: float = 0.6) -> dict:
    """Does the global model predict every class of the union?  Each class is scored on the test sets of the sites
    that label it (lowest AUROC over those sites) and on the external set; classes at or below ``threshold`` and
    classes with no defined AUROC are listed for both."""
    out = {"classes": len(run["global_classes"]), "threshold": threshold}
    for name, per in (("site_test", run["site_test_per_class"]), ("external", run["external_per_class"])):
        defined = {c: v for c, v in per.items() if v is not None}
        out[name] = {"undefined": [c for c in run["global_classes"] if per.get(c) is None],
                     "at_most_threshold": {c: v for c, v in defined.items() if v <= threshold},
                     "min": min(defined.values(), default=None)}
    return out


def _verdict(part: dict, threshold: float) -> str:
    if not part["undefined"] and not part["at_most_threshold"]:
        return f"every class above AUROC {threshold}"
    return (f"classes at or below AUROC {threshold}: {sorted(part['at_most_threshold'])}"
            + (f"; undefined: {part['undefined']}" if part["undefined"] else ""))


def seed_sets(seed: int) -> list[str]:
    """The job switches of a training seed: the server's model and persistor and the client trainer."""
    return [f"server.model.seed={int(seed)}", f"server.persistor.seed={int(seed)}",
            f"client.cxr_trainer.seed={int(seed)}"]


def over_seeds(rows: Sequence[dict], reference: str = "surgical") -> tuple[list[dict], list[dict]]:
    """Per method (in order of first appearance): every AUROC column as the mean over seeds, the SE over seeds and
    the value per seed; and ``reference`` minus every other method, paired by seed, per column (mean, SE over
    seeds, per seed).  ``rows``: the per-(method, seed) rows of :func:`result_row` with ``seed`` added."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    by = {(r["method"], int(r["seed"])): r for r in rows}
    summary = []
    for m in methods:
        seeds = sorted(s for mm, s in by if mm == m)
        e: dict = {"method": m, "seeds": seeds}
        for key, _ in METRICS:
            vals = {s: by[(m, s)][key] for s in seeds if by[(m, s)][key] is not None}
            e[key] = {"mean": float(np.mean(list(vals.values()))) if vals else None,
                      "se": se_over_seeds(list(vals.values())), "by_seed": vals}
        summary.append(e)
    diffs = []
    if reference in methods:
        for m in methods:
            if m == reference:
                continue
            d: dict = {"method": reference, "minus": m}
            for key, _ in METRICS:
                per = {s: by[(reference, s)][key] - by[(m, s)][key] for mm, s in by
                       if mm == m and (reference, s) in by and by[(reference, s)][key] is not None
                       and by[(m, s)][key] is not None}
                d[key] = {"mean": float(np.mean(list(per.values()))) if per else None,
                          "se": se_over_seeds(list(per.values())), "by_seed": per}
            diffs.append(d)
    return summary, diffs


def seeds_table(summary: Sequence[dict], diffs: Sequence[dict]) -> str:
    """Mean AUROC over seeds +- SE over seeds per method, then the paired differences."""
    head = f"{'':<28}" + "".join(f"{label:>16}" for _, label in METRICS) + f"{'seeds':>7}"

    def cell(v: dict, signed: bool = False) -> str:
        if v["mean"] is None:
            return f"{'n/a':>16}"
        text = f"{v['mean']:+.3f}" if signed else f"{v['mean']:.3f}"
        if v["se"] is not None:
            text += f" +- {v['se']:.3f}"
        return f"{text:>16}"

    lines = [head, "-" * len(head)]
    for e in summary:
        lines.append(f"{e['method']:<28}" + "".join(cell(e[k]) for k, _ in METRICS) + f"{len(e['seeds']):>7}")
    for d in diffs:
        n = len(d[METRICS[0][0]]["by_seed"])
        lines.append(f"{d['method'] + ' - ' + d['minus']:<28}" + "".join(cell(d[k], True) for k, _ in METRICS)
                     + f"{n:>7}")
    return "\n".join(lines)


def plot_demo(summary: Sequence[dict], path: str, title: str) -> str:
    """Grouped bars: AUROC per column (site mean, shared, unique, external) and method, mean over seeds, the SE over
    seeds as error bars, each seed a dot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / max(1, len(summary))
    for j, e in enumerate(summary):
        xs = [i + (j - (len(summary) - 1) / 2) * width for i in range(len(METRICS))]
        ys = [e[k]["mean"] if e[k]["mean"] is not None else np.nan for k, _ in METRICS]
        err = [e[k]["se"] or 0.0 for k, _ in METRICS]
        ax.bar(xs, ys, width=width * 0.95, yerr=err, capsize=3, label=e["method"])
        for x, (k, _) in zip(xs, METRICS):
            vals = list(e[k]["by_seed"].values())
            ax.plot([x] * len(vals), vals, "o", color="black", markersize=2.5, zorder=3)
    ax.set_xticks(range(len(METRICS)), [label for _, label in METRICS])
    ax.set_ylabel("mean AUROC")
    lows = [v for e in summary for k, _ in METRICS for v in e[k]["by_seed"].values()]
    ax.set_ylim(max(0.0, min(lows, default=0.5) - 0.05), 1.0)
    ax.axhline(0.5, color="grey", linestyle="--", linewidth=1)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, ncol=len(summary))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def run_surgical_demo(out: str, *, rounds: int = 10, n_patients: int = 500, methods=METHODS, lr: float = 0.01,
                      local_epochs: int = 3, backbone: str = "fedavg", central: bool = True,
                      central_missing: str = "negative", threads: int = DEFAULT_THREADS,
                      seeds: Sequence[int] = (0,)) -> dict:
    """Without ImageNet weights there are no pre-trained batch-norm statistics for FedBN+ (the job's paper
    setting) to freeze, so the demo runs the paper's other global-model strategy, FedAvg, by default.
    ``central``: add the centralised baseline (``fedssl.experiments.surgical_central``: same code, pooled data, same
    settings; nothing is exchanged, so its KB/site/round is 0); ``central_missing``: its sources' unlabelled classes
    are "negative" (paper sec. 2.3) or "ignore"d (masked).  ``threads``: torch threads of this process (the
    centralised baseline), recorded in ``out/run_config.json`` with the environment.  ``seeds``: training seeds
    (module docstring)."""
    t0 = time.time()
    out = os.path.abspath(out)
    from fedssl.flare.constants import BACKBONES

    if backbone not in BACKBONES:
        raise ValueError(f"backbone={backbone!r}: use one of {list(BACKBONES)}")
    if central_missing not in MISSING_CLASS_RULES:
        raise ValueError(f"central_missing={central_missing!r}: use one of {list(MISSING_CLASS_RULES)}")
    seeds = [int(x) for x in seeds]
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise ValueError(f"seeds={seeds}: give distinct non-negative training seeds (3 for a finding)")
    set_threads(threads)
    write_run_config(out, {"demo": "surgical", "rounds": rounds, "n_patients": n_patients, "methods": list(methods),
                           "lr": lr, "local_epochs": local_epochs, "backbone": backbone, "central": central,
                           "central_missing": central_missing, "seeds": seeds}, threads=threads)
    data = os.path.join(out, "data")
    if not os.path.isdir(os.path.join(data, "mimic")):
        _say(t0, f"writing synthetic NIH-like (site-1), CheXpert-like (site-2) and MIMIC-like (external) data, "
                 f"{n_patients} patients per site -> {data}")
        write_demo_data(data, n_patients)
    client_sets = [f"client.cxr_trainer.external_test_root={os.path.join(data, 'mimic')}",
                   f"client.cxr_trainer.lr={lr}", f"client.cxr_trainer.local_epochs={local_epochs}"]
    rows, runs = [], {}
    for seed in seeds:
        here = os.path.join(out, f"seed{seed}")
        for method in methods:
            ws = os.path.join(here, f"ws_{method}")
            results = os.path.join(ws, "server", "simulate_job", "results.json")
            sim_path = os.path.join(ws, "demo_run.json")
            if not (os.path.isfile(results) and os.path.isfile(sim_path)):
                _say(t0, f"{method}, seed {seed}: jobs/surgical_cxr in the FLARE simulator (2 sites, {rounds} rounds, "
                         f"backbone {backbone}, quick profile)")
                sets = [f"server.class_registration.method={method}", f"server.class_registration.backbone={backbone}",
                        f"server.scatter_and_gather.num_rounds={rounds}"] + client_sets + seed_sets(seed)
                s = run_simulation(JOB, ws, n_sites=2, data_root=os.path.join(data, "{site}"), profile="quick",
                                   sets=sets, echo=False)
                with open(sim_path, "w") as f:
                    json.dump({"wall_time_s": s["simulator_wall_time_s"],
                               "bytes_per_site_per_round": s["bytes_per_site_per_round"]}, f)
            with open(sim_path) as f:
                sim = json.load(f)
            with open(results) as f:
                res = json.load(f)
            row, run = result_row(method, res, rounds, sim["wall_time_s"], sim["bytes_per_site_per_round"],
                                  os.path.relpath(results.replace(".json", ".md"), out))
            row["seed"], runs[(method, seed)] = seed, run
            rows.append(row)
            _say(t0, f"{method}, seed {seed}: site mean AUROC {_fmt(row['mean_auroc'])} (shared "
                     f"{_fmt(row['shared_auroc'])}, unique {_fmt(row['unique_auroc'])}), external "
                     f"{_fmt(row['external_auroc'])} in {row['wall_time_s']} s")
        if central:
            cdir = os.path.join(here, "central")
            if os.path.isfile(os.path.join(cdir, "results.json")):
                with open(os.path.join(cdir, "results.json")) as f:
                    res = json.load(f)
            else:
                _say(t0, f"centralised, seed {seed}: the same training code on the pooled data of both sites "
                         f"({rounds} x {local_epochs} epochs, quick profile, missing classes {central_missing})")
                res = run_centralised(os.path.join(data, "{site}"), cdir, profile="quick",
                                      sets=client_sets + [f"server.scatter_and_gather.num_rounds={rounds}",
                                                          f"client.cxr_trainer.seed={seed}"],
                                      missing=central_missing, freeze_bn=backbone == "fedbn_plus", say=lambda m: None)
            md = os.path.relpath(os.path.join(cdir, "results.md"), out)
            row, runs[("centralised", seed)] = result_row("centralised", res, rounds, res.get("wall_time_s", 0.0),
                                                          {"total": 0}, md)
            row["seed"] = seed
            rows.append(row)
            _say(t0, f"centralised, seed {seed}: site mean AUROC {_fmt(row['mean_auroc'])} (shared "
                     f"{_fmt(row['shared_auroc'])}, unique {_fmt(row['unique_auroc'])}), external "
                     f"{_fmt(row['external_auroc'])} in {row['wall_time_s']} s")
    summary, diffs = over_seeds(rows)
    first = [r for r in rows if r["seed"] == seeds[0]]
    table = comparison_table(first)
    stable = seeds_table(summary, diffs)
    note = few_seeds_note({e["method"]: e["seeds"] for e in summary}, rerun=RERUN) if len(summary) > 1 else None
    report = {"backbone": backbone, "seeds": seeds, "rows": rows, "summary": summary, "differences": diffs,
              "seeds_note": note, "demo_wall_time_s": round(time.time() - t0, 1),
              "runs": {f"{m} seed {sd}": r for (m, sd), r in runs.items()}}
    check = None
    if ("surgical", seeds[0]) in runs:
        check = report["surgical_predicts_every_class"] = class_check(runs[("surgical", seeds[0])])
    title = (f"surgical aggregation demo: synthetic CXR, quick profile, backbone {backbone}, {rounds} rounds, "
             f"seeds {', '.join(map(str, seeds))}")
    plot_demo(summary, os.path.join(out, "surgical_demo.png"), title)
    with open(os.path.join(out, "surgical_demo.json"), "w") as f:
        json.dump(report, f, indent=2)
    with open(os.path.join(out, "surgical_demo.md"), "w") as f:
        f.write("# Surgical aggregation demo (synthetic data, quick profile)\n\n"
                f"Seed {seeds[0]}:\n\n```\n" + table + "\n```\n\n"
                f"Over seeds {', '.join(map(str, seeds))} (mean +- SE over seeds; differences paired by seed):\n\n```\n"
                + stable + "\n```\n" + (f"\n{note}\n" if note else ""))
    print()
    print(f"Mean AUROC (backbone {backbone}; site test sets: each site's classes; external: the MIMIC-like set, "
          f"all 20 classes), seed {seeds[0]}")
    print(table)
    print(f"\nover seeds {', '.join(map(str, seeds))}: mean +- SE over seeds; differences paired by seed")
    print(stable)
    if note:
        print(note)
    if check is not None:
        surg = runs[("surgical", seeds[0])]
        print(f"\nsurgical global model, seed {seeds[0]}, per class ({check['classes']} classes of the union; site "
              "test sets: lowest over the sites labelling the class):")
        for name, title in (("site_test", "site test sets"), ("external", "external set")):
            per = surg[f"{name}_per_class"]
            print(f"  {title}: " + ", ".join(f"{c} {_fmt(per.get(c)).strip()}" for c in surg["global_classes"]))
            print(f"    min AUROC {_fmt(check[name]['min']).strip()}: {_verdict(check[name], check['threshold'])}")
    print(f"\nreport: {os.path.join(out, 'surgical_demo.md')}, surgical_demo.png; per-run tables: "
          "seed<S>/ws_<method>/server/simulate_job/results.md" + (", seed<S>/central/results.md" if central else ""))
    _say(t0, "demo finished")
    return report
