"""The README's surgical-aggregation demo: synthetic NIH-like + CheXpert-like sites (+ a MIMIC-like external
test set) -> jobs/surgical_cxr in the FLARE simulator with surgical aggregation, vanilla FL and FL with
partial loss (quick profile), plus the centralised baseline (pooled data, ``fedssl.experiments.surgical_central``) ->
mean AUROC over shared and unique classes and on the external set.

Site 1 holds the 14 NIH classes, site 2 the 13 CheXpert classes (7 shared), as in the paper.  Every run is
the same job with switches (``server.class_registration.method`` and ``.backbone``).  Everything lands in
``out``: data, simulator workspaces (each server run folder has results.md / results.json / auroc.png),
``central/`` (the same files), ``surgical_demo.json`` / ``surgical_demo.md`` with the comparison, and
``run_config.json`` (the settings, the torch thread count of this process -- the centralised baseline trains here --
and the environment).  Every method runs once, at the job's seed 0: the comparison says it is not a finding.
"""

from __future__ import annotations

import json
import os
import time

from fedssl.core.multilabel import MISSING_CLASS_RULES
from fedssl.experiments.environment import DEFAULT_THREADS, set_threads
from fedssl.experiments.surgical_central import run_centralised
from fedssl.experiments.table_runner import few_seeds_note, write_run_config
from fedssl.ops.jobs import REPO_ROOT
from fedssl.ops.simulate import run_simulation

JOB = os.path.join(REPO_ROOT, "jobs", "surgical_cxr")
METHODS = ("surgical", "vanilla", "partial_loss")
#: how a comparison of the demo's one-seed runs becomes one over seeds
RERUN = ("each method at job seeds 0 1 2 (--set server.model.seed=S --set client.cxr_trainer.seed=S) and "
         "fedssl surgical compare over the runs")


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


def run_surgical_demo(out: str, *, rounds: int = 10, n_patients: int = 500, methods=METHODS, lr: float = 0.01,
                      local_epochs: int = 3, backbone: str = "fedavg", central: bool = True,
                      central_missing: str = "negative", threads: int = DEFAULT_THREADS) -> dict:
    """Without ImageNet weights there are no pre-trained batch-norm statistics for FedBN+ (the job's paper
    setting) to freeze, so the demo runs the paper's other global-model strategy, FedAvg, by default.
    ``central``: add the centralised baseline (``fedssl.experiments.surgical_central``: same code, pooled data, same
    settings; nothing is exchanged, so its KB/site/round is 0); ``central_missing``: its sources' unlabelled classes
    are "negative" (paper sec. 2.3) or "ignore"d (masked).  ``threads``: torch threads of this process (the
    centralised baseline), recorded in ``out/run_config.json`` with the environment."""
    t0 = time.time()
    out = os.path.abspath(out)
    from fedssl.flare.constants import BACKBONES

    if backbone not in BACKBONES:
        raise ValueError(f"backbone={backbone!r}: use one of {list(BACKBONES)}")
    if central_missing not in MISSING_CLASS_RULES:
        raise ValueError(f"central_missing={central_missing!r}: use one of {list(MISSING_CLASS_RULES)}")
    set_threads(threads)
    write_run_config(out, {"demo": "surgical", "rounds": rounds, "n_patients": n_patients, "methods": list(methods),
                           "lr": lr, "local_epochs": local_epochs, "backbone": backbone, "central": central,
                           "central_missing": central_missing, "seeds": [0]}, threads=threads)
    data = os.path.join(out, "data")
    if not os.path.isdir(os.path.join(data, "mimic")):
        _say(t0, f"writing synthetic NIH-like (site-1), CheXpert-like (site-2) and MIMIC-like (external) data, "
                 f"{n_patients} patients per site -> {data}")
        write_demo_data(data, n_patients)
    client_sets = [f"client.cxr_trainer.external_test_root={os.path.join(data, 'mimic')}",
                   f"client.cxr_trainer.lr={lr}", f"client.cxr_trainer.local_epochs={local_epochs}"]
    rows, runs = [], {}
    for method in methods:
        _say(t0, f"{method}: jobs/surgical_cxr in the FLARE simulator (2 sites, {rounds} rounds, backbone {backbone}, "
                 "quick profile)")
        sets = [f"server.class_registration.method={method}", f"server.class_registration.backbone={backbone}",
                f"server.scatter_and_gather.num_rounds={rounds}"] + client_sets
        s = run_simulation(JOB, os.path.join(out, f"ws_{method}"), n_sites=2, data_root=os.path.join(data, "{site}"),
                           profile="quick", sets=sets, echo=False)
        results = os.path.join(s["workspace"], "server", "simulate_job", "results.json")
        with open(results) as f:
            res = json.load(f)
        row, runs[method] = result_row(method, res, rounds, s["simulator_wall_time_s"], s["bytes_per_site_per_round"],
                                       results.replace(".json", ".md"))
        rows.append(row)
        _say(t0, f"{method}: site mean AUROC {_fmt(row['mean_auroc'])} (shared {_fmt(row['shared_auroc'])}, unique "
                 f"{_fmt(row['unique_auroc'])}), external {_fmt(row['external_auroc'])} in {row['wall_time_s']} s")
    if central:
        _say(t0, f"centralised: the same training code on the pooled data of both sites ({rounds} x {local_epochs} "
                 f"epochs, quick profile, missing classes {central_missing})")
        res = run_centralised(os.path.join(data, "{site}"), os.path.join(out, "central"), profile="quick",
                              sets=client_sets + [f"server.scatter_and_gather.num_rounds={rounds}"],
                              missing=central_missing, freeze_bn=backbone == "fedbn_plus", say=lambda m: None)
        row, runs["centralised"] = result_row("centralised", res, rounds, res["wall_time_s"], {"total": 0},
                                              os.path.join(out, "central", "results.md"))
        rows.append(row)
        _say(t0, f"centralised: site mean AUROC {_fmt(row['mean_auroc'])} (shared {_fmt(row['shared_auroc'])}, unique "
                 f"{_fmt(row['unique_auroc'])}), external {_fmt(row['external_auroc'])} in {row['wall_time_s']} s")
    table = comparison_table(rows)
    note = few_seeds_note({r["method"]: [0] for r in rows}, rerun=RERUN) if len(rows) > 1 else None
    report = {"backbone": backbone, "rows": rows, "runs": runs, "seeds_note": note,
              "demo_wall_time_s": round(time.time() - t0, 1)}
    check = None
    if "surgical" in runs:
        check = report["surgical_predicts_every_class"] = class_check(runs["surgical"])
    with open(os.path.join(out, "surgical_demo.json"), "w") as f:
        json.dump(report, f, indent=2)
    with open(os.path.join(out, "surgical_demo.md"), "w") as f:
        f.write("# Surgical aggregation demo (synthetic data, quick profile)\n\n```\n" + table + "\n```\n"
                + (f"\n{note}\n" if note else ""))
    print()
    print(f"Mean AUROC (backbone {backbone}; site test sets: each site's classes; external: the MIMIC-like set, "
          "all 20 classes)")
    print(table)
    if note:
        print(note)
    if check is not None:
        print(f"\nsurgical global model, per class ({check['classes']} classes of the union; site test sets: lowest "
              "over the sites labelling the class):")
        for name, title in (("site_test", "site test sets"), ("external", "external set")):
            per = runs["surgical"][f"{name}_per_class"]
            print(f"  {title}: " + ", ".join(f"{c} {_fmt(per.get(c)).strip()}"
                                             for c in runs["surgical"]["global_classes"]))
            print(f"    min AUROC {_fmt(check[name]['min']).strip()}: {_verdict(check[name], check['threshold'])}")
    print(f"\nreport: {os.path.join(out, 'surgical_demo.md')}; per-run tables: "
          "ws_<method>/server/simulate_job/results.md" + (", central/results.md" if central else ""))
    _say(t0, "demo finished")
    return report
