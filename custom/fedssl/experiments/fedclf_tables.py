"""FedCLF's Tables I (local fine-tuning) and II (federated fine-tuning) and the Fig. 6 ablation ("Federated
Self-Supervised Learning for Dermatological Disease Diagnosis", sec. V-A) on the 10 dermatology devices.

One pre-training run per method and training seed (``jobs/fedclf_derm`` and its switches, :data:`METHODS`) in the
FLARE simulator, then per label fraction L (10 / 20 / 40 / 80 % of each device's training images) and seed:

* Table I cells, one per (method, L, device, seed): :func:`fedssl.train.resnet_classifier.local_finetune_device`
  from the method's global encoder (Local CL: the device's own), Table I's protocol (Adam, batch 256, lr 1e-4, 20
  epochs, x0.2 at epochs 12 and 16; the profile's ``tables.fedclf.local`` may shorten it), best epoch on validation;
* Table II cells, one per (method, L, seed): ``jobs/fedclf_derm_finetune`` in the simulator (Local CL: device 1's own
  encoder), the validation-selected global model tested on every device.

Each table is written for mean recall and for mean precision (mean +- std over the 10 devices' test sets, each
device's value averaged over the seeds first; every row also holds its mean per seed) with the paper's numbers
beside it (labelled as the paper's); Fig. 6 is Table II's L = 10 % recall of W/o FE (FedMoCo), FE and FE+Neg
(FedCLF).  A verdict line compares FedCLF with random init at the smallest L, paired by device (several seeds: each
seed's mean over its devices, spread over seeds), and every method's paired difference against random init per L
(:func:`fedssl.eval.report.paired_against`, by device and seed) is printed under the table with its standard error
over seeds.  Cells run through :mod:`fedssl.experiments.table_runner` (resume, progress with ETA); data: the device
folders under ``data_root`` or, by default, synthetic sources written and built under ``out/data``.  The local cells
compute with ``threads`` torch threads per process (this one and each worker), recorded in ``run_config.json`` with
the environment.

Seeds.  ``seeds`` (default 0, 1, 2) are training seeds: the pre-training (initial model, the sites' sampling,
augmentations and bank draws) and the fine-tuning (the classifier's initial weights, batch order, augmentations) of
every cell run once per seed, a method's seed-s fine-tuning starting from its seed-s pre-training.  ``split_seed``
(default 0) is the data draw, the same for every training seed: the synthetic sources, the devices' shards and
60/20/20 splits and which training images are labelled at each L (``ResNetClassifierSettings.split_seed``), so a
difference paired by device and seed holds the training randomness only.  Every cell's key holds both; a folder
keeps its split seed (``run_config.json``; a re-run with another is refused) and may gain training seeds (recorded
there as the union).  A table whose rows rest on fewer than three seeds says so under it
(:func:`~fedssl.experiments.table_runner.few_seeds_note`).
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from fedssl.core.checks import require, require_int
from fedssl.data.fedclf_devices import build_devices, load_device
from fedssl.data.fedclf_synthetic import SOURCES, write_synthetic_derm_sources
from fedssl.eval.paper_tables import FEDCLF_SOURCE, fedclf_paper_rows
from fedssl.eval.report import format_paired, paired_against, paired_difference
from fedssl.experiments.diagnostics import (
    failed_mark,
    failed_verdict,
    failure_footer,
    failure_record,
    health_text,
    job_health_settings,
    mark_lines,
    pretraining_health,
    pretraining_rounds,
)
from fedssl.experiments.environment import DEFAULT_THREADS
from fedssl.experiments.fcl_finetune import load_global_state
from fedssl.experiments.table_runner import few_seeds_note, plain_json, run_cells, start_run, write_table
from fedssl.ops.jobs import REPO_ROOT, component_specs, configured_job, load_profile
from fedssl.ops.simulate import run_simulation
from fedssl.train.resnet_classifier import local_finetune_device

N_DEVICES = 10
PRETRAIN_JOB, FINETUNE_JOB = "fedclf_derm", "fedclf_derm_finetune"
_NO_BANKS = "server.aggregator.collectors=[]"
#: method -> label, the paper's row (Tables I / II) or Fig. 6 bar, and the pre-training job's overrides (None: random)
METHODS: dict[str, dict] = {
    "random": {"label": "Random Init.", "paper": "Random Init.", "sets": None},
    "local_cl": {"label": "Local CL", "paper": "Local CL",
                 "sets": ["client.fedclf_trainer.federated=false", "client.fedclf_trainer.queue=none",
                          'server.aggregator.exclude_patterns=["*"]', _NO_BANKS]},
    "fedrotation": {"label": "FedRotation", "paper": "FedRotation",
                    "sets": ["server.model.method=rotation", "client.fedclf_trainer.method=rotation",
                             "client.fedclf_trainer.queue=none", _NO_BANKS]},
    "fedsimclr": {"label": "FedSimCLR", "paper": "FedSimCLR",
                  "sets": ["server.model.method=simclr", "client.fedclf_trainer.method=simclr",
                           "client.fedclf_trainer.queue=none", _NO_BANKS]},
    "fedmoco": {"label": "FedMoCo (W/o FE)", "fig6": "W/o FE", "sets": ["client.fedclf_trainer.queue=none", _NO_BANKS]},
    "fe": {"label": "FE (eq. 4)", "fig6": "FE", "sets": ["client.fedclf_trainer.queue=fe"]},
    "fedclf": {"label": "FedCLF", "paper": "FedCLF", "fig6": "FE+Neg", "sets": []},
}
FRACTIONS = (0.1, 0.2, 0.4, 0.8)
TABLES = (1, 2)
METRICS = {"recall": "balanced_accuracy", "precision": "macro_precision"}
#: the runner's settings when the profile's ``tables.fedclf`` leaves them out
DEFAULTS = {"n_isic": 2000, "image_px": 80, "difficulty": None, "seeds": [0, 1, 2], "split_seed": 0,
            "methods": list(METHODS), "fractions": list(FRACTIONS), "tables": list(TABLES), "pretrain_rounds": None,
            "finetune_rounds": None, "pretrain_sets": [], "finetune_sets": [], "local": {}}
#: settings that only pick cells (their cells' keys hold them): a re-run may add some to a folder
SELECTORS = ("methods", "fractions", "tables", "seeds")
#: the selectors ``run_config.json`` records anyway (the union of the folder's runs)
RECORDED = ("seeds",)


def seeds_note(values: Mapping) -> str | None:
    """The line under a table where a method's rows rest on fewer than three training seeds; ``values``:
    :func:`per_device`'s."""
    covered: dict[str, set] = {}
    for (method, _), by_seed in values.items():
        covered.setdefault(METHODS[method]["label"], set()).update(by_seed)
    return few_seeds_note(covered)


def table_settings(profile: str = "bench", **overrides) -> dict:
    """:data:`DEFAULTS` < the profile's ``"tables": {"fedclf": {...}}`` < ``overrides`` (None ignored), checked."""
    from_profile = load_profile(profile).get("tables", {}).get("fedclf", {}) if profile else {}
    unknown = sorted(set(from_profile) - set(DEFAULTS))
    require(not unknown, f"profile {profile!r} tables.fedclf", "keys", unknown, f"use keys of {sorted(DEFAULTS)}")
    unknown = sorted(set(overrides) - set(DEFAULTS))
    require(not unknown, "fedclf tables", "settings", unknown, f"use keys of {sorted(DEFAULTS)}")
    s = {**DEFAULTS, **from_profile, **{k: v for k, v in overrides.items() if v is not None}, "profile": profile}
    for name, allowed in (("methods", list(METHODS)), ("fractions", list(FRACTIONS)), ("tables", list(TABLES))):
        vals = list(s[name])
        require(bool(vals) and all(v in allowed for v in vals) and len(set(vals)) == len(vals), "fedclf tables",
                name, vals, f"use distinct values from {allowed}")
        s[name] = vals
    seeds = list(s["seeds"])
    require(bool(seeds) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in seeds)
            and len(set(seeds)) == len(seeds), "fedclf tables", "seeds", seeds,
            "use distinct integers >= 0, e.g. [0, 1, 2]")
    s["seeds"] = seeds
    require_int("fedclf tables", "split_seed", s["split_seed"], 0, "use an integer >= 0")
    require_int("fedclf tables", "n_isic", s["n_isic"], 15, "use at least 15 synthetic ISIC images")
    for name in ("pretrain_rounds", "finetune_rounds"):
        if s[name] is not None:
            require_int("fedclf tables", name, s[name], 1, "use a positive integer, or null for the profile's")
    for name in ("pretrain_sets", "finetune_sets"):
        require(isinstance(s[name], list) and all(isinstance(x, str) and "=" in x for x in s[name]), "fedclf tables",
                name, s[name], 'use a list of --set overrides of the job, e.g. ["client.cls_trainer.local_epochs=2"]')
    return s


def _seeded(key: dict, s: dict, seed: int) -> dict:
    """``key`` of training seed ``seed`` on the run's data draw (``split_seed``)."""
    return {**key, "seed": int(seed), "split_seed": int(s["split_seed"])}


def pretrain_cells(s: dict) -> list[dict]:
    """One pre-training cell per training seed and pre-trained method (random init has none), seed-major."""
    return [_seeded({"stage": "pretrain", "method": m}, s, sd) for sd in s["seeds"] for m in s["methods"]
            if METHODS[m]["sets"] is not None]


def local_cells(s: dict) -> list[dict]:
    """Table I: one cell per (seed, L, method, device), seed-major (an interrupted table has every method on its
    first seeds)."""
    return [_seeded({"stage": "local", "method": m, "fraction": f, "site": f"site-{k}"}, s, sd) for sd in s["seeds"]
            for f in s["fractions"] for m in s["methods"] for k in range(1, N_DEVICES + 1)] if 1 in s["tables"] else []


def federated_cells(s: dict) -> list[dict]:
    """Table II: one cell per (seed, L, method), seed-major."""
    return [_seeded({"stage": "federated", "method": m, "fraction": f}, s, sd) for sd in s["seeds"]
            for f in s["fractions"] for m in s["methods"]] if 2 in s["tables"] else []


def prepare_devices(out: str, s: dict, say: Callable[[str], None]) -> str:
    """Synthetic sources (once) and the 10 device folders under ``out/data``, both drawn with the run's
    ``split_seed`` (never a training seed); returns the devices folder."""
    raw, devices = os.path.join(out, "data", "raw"), os.path.join(out, "data", "devices")
    if not all(os.path.isdir(os.path.join(raw, src)) for src in SOURCES):
        say(f"writing synthetic dermatology sources ({s['n_isic']} ISIC images, {s['image_px']} px) -> {raw}")
        write_synthetic_derm_sources(raw, n_isic=s["n_isic"], seed=s["split_seed"], image_size=s["image_px"],
                                     difficulty=s["difficulty"])
    build_devices(devices, *(os.path.join(raw, src) for src in SOURCES), seed=s["split_seed"])
    return devices


#: the component that trains on the sites, per stage (its ``seed`` and the server model's follow the training seed)
_TRAINER = {"pretrain": "fedclf_trainer", "finetune": "cls_trainer"}


def _job_sets(s: dict, stage: str, seed: int) -> list[str]:
    """The ``--set`` overrides of every run of one stage at training seed ``seed``: all devices, the rounds, the
    seed (model init and the sites' sampling and augmentations), for fine-tuning the run's ``split_seed`` (which
    images are labelled), then ``<stage>_sets``."""
    rounds = s[f"{stage}_rounds"]
    split = [f"client.cls_trainer.split_seed={s['split_seed']}"] if stage == "finetune" else []
    return [f"server.scatter_and_gather.min_clients={N_DEVICES}"] + (
        [f"server.scatter_and_gather.num_rounds={rounds}"] if rounds is not None else []) + [
        f"server.model.seed={seed}", f"client.{_TRAINER[stage]}.seed={seed}", *split, *s[f"{stage}_sets"]]


def _pretrain_workspace(out: str, method: str, seed: int) -> str:
    return os.path.join(out, "ws", f"pretrain_{method}_seed{seed}")


def pretrain(key: dict, out: str, devices: str, s: dict, simulate=run_simulation) -> dict:
    """One pre-training run; its global model, summary and each device's checkpoint (Local CL's encoders)."""
    ws = _pretrain_workspace(out, key["method"], key["seed"])
    run = simulate(os.path.join(REPO_ROOT, "jobs", PRETRAIN_JOB), ws, n_sites=N_DEVICES,
                   data_root=os.path.join(devices, "{site}"), profile=s["profile"], echo=False,
                   sets=[*_job_sets(s, "pretrain", key["seed"]), *METHODS[key["method"]]["sets"]])
    sites = {f"site-{k}": os.path.join(ws, f"site-{k}", "simulate_job", "fedclf_client_state.pt")
             for k in range(1, N_DEVICES + 1)}
    return {"global_model": run["global_model"], "wall_time_s": run.get("simulator_wall_time_s"),
            "bytes_per_site_per_round": run.get("bytes_per_site_per_round"), "site_states": sites}


def init_state(method: str, pretrained: Mapping | None, site: str) -> dict | None:
    """The state a fine-tuning starts from: None (random), the global model, or Local CL's device's own model."""
    if pretrained is None:
        return None
    path = pretrained["site_states"][site] if method == "local_cl" else pretrained["global_model"]
    return load_global_state(path)


def local_settings(s: dict, seed: int = 0) -> dict:
    """The ResNet of the fine-tuning job at the profile (width, crop), training seed ``seed`` and the run's
    ``split_seed``, and Table I's protocol (profile-shortened)."""
    files = configured_job(os.path.join(REPO_ROOT, "jobs", FINETUNE_JOB), s["profile"],
                           sets=_job_sets(s, "finetune", seed))
    args = next(c for c in component_specs(files["app/config/config_fed_client.json"]) if c["id"]
                == "cls_trainer")["args"]
    base = {"dataset": args["dataset"], "image_size": args["image_size"], "width": args["width"],
            "eval_batch_size": args["eval_batch_size"], "max_steps_per_epoch": args["max_steps_per_epoch"],
            "depth": args["depth"],
            "seed": args["seed"], "split_seed": args["split_seed"],
            "device": "cuda" if torch.cuda.is_available() else "cpu"}
    return {**base, "epochs": 20, "milestones": [12, 16], "batch_size": 256, "lr": 1e-4, **s["local"]}


def local_one(key: dict, devices: str, s: dict, pretrained: Mapping) -> dict:
    """One Table I cell (a device's local fine-tuning at one L and training seed); ``pretrained``: (method, seed)
    -> its pre-training result."""
    site = key["site"]
    splits = [load_device(devices, site, split) for split in ("train", "val", "test")]
    kw = local_settings(s, key["seed"])
    row = local_finetune_device(*splits, init=init_state(key["method"], pretrained.get((key["method"], key["seed"])),
                                                         site), site=site, label_fraction=key["fraction"], **kw)
    return plain_json(row)


def federated_one(key: dict, out: str, devices: str, s: dict, pretrained: Mapping, simulate=run_simulation) -> dict:
    """One Table II cell: federated fine-tuning in the simulator at the key's training seed, the selected model
    tested on every device."""
    seed = key["seed"]
    tag = f"{key['method']}_L{int(round(100 * key['fraction']))}_seed{seed}"
    init = ""
    if key["method"] != "random":
        pre = pretrained[(key["method"], seed)]
        init = pre["global_model"]
        if key["method"] == "local_cl":  # Local CL has no shared model: device 1's own encoder
            init = os.path.join(out, "ws", f"local_cl_site-1_seed{seed}.pt")
            torch.save({"model": init_state("local_cl", pre, "site-1")}, init)
    run = simulate(os.path.join(REPO_ROOT, "jobs", FINETUNE_JOB), os.path.join(out, "ws", f"ft_{tag}"),
                   n_sites=N_DEVICES, data_root=os.path.join(devices, "{site}"), profile=s["profile"], echo=False,
                   sets=[*_job_sets(s, "finetune", seed), f"server.model.pretrained_path={init}",
                         f"client.cls_trainer.label_fraction={key['fraction']}"])
    with open(os.path.join(run["workspace"], "server", "simulate_job", "test_metrics.json")) as f:
        report = json.load(f)
    per_site = {site: {m: v.get(m) for m in METRICS.values()} for site, v in report["sites"].items()}
    return {"sites": per_site, "model": report.get("model"), "wall_time_s": run.get("simulator_wall_time_s")}


def per_device(results: Mapping, stage: str) -> dict[tuple[str, float], dict[int, dict[str, dict[str, float]]]]:
    """{(method, L): {training seed: {site: {metric: value}}}} of the finished cells of one stage; ``results``:
    {(stage, method, L, seed, site or None): cell result}."""
    out: dict = {}
    for (st, method, fraction, seed, site), r in results.items():
        if st != stage:
            continue
        by_seed = out.setdefault((method, fraction), {})
        if stage == "local":
            by_seed.setdefault(seed, {})[site] = {m: r["test"][v] for m, v in METRICS.items()}
        else:
            by_seed[seed] = {s: {m: vals[v] for m, v in METRICS.items()} for s, vals in r["sites"].items()}
    return out


def column_name(fraction: float) -> str:
    """A label fraction as the tables' column: ``L=10%``."""
    return f"L={int(round(100 * fraction))}%"


def summary_rows(values: Mapping, table: str, metric: str) -> list[dict]:
    """One row per (method, L), in %: mean +- std (population) over devices, each device's value averaged over the
    training seeds first (``n`` = devices), with the row's ``seeds`` and ``by_seed`` (seed -> the mean over its
    devices)."""
    rows = []
    for (method, fraction), by_seed in values.items():
        per_site: dict[str, list[float]] = {}
        seed_means = {}
        for seed in sorted(by_seed):
            vals = {site: 100.0 * v[metric] for site, v in by_seed[seed].items() if v[metric] is not None}
            for site, v in vals.items():
                per_site.setdefault(site, []).append(v)
            if vals:
                seed_means[str(seed)] = float(np.mean(list(vals.values())))
        if per_site:
            site_means = [float(np.mean(v)) for v in per_site.values()]
            rows.append({"table": table, "method": METHODS[method]["label"], "column": column_name(fraction),
                         "mean": float(np.mean(site_means)), "std": float(np.std(site_means)), "n": len(site_means),
                         "seeds": [int(sd) for sd in seed_means], "by_seed": seed_means})
    return rows


def paired_rows(values: Mapping, stage: str, metric: str) -> list[dict]:
    """One row per (method, L, seed, device) in :func:`fedssl.eval.report.paired_against`'s form, ``metric`` in %."""
    return [{"mode": stage, "method": METHODS[method]["label"], "fraction": fraction, "seed": seed, "site": site,
             metric: 100.0 * v[metric]}
            for (method, fraction), by_seed in values.items() for seed, sites in by_seed.items()
            for site, v in sites.items() if v[metric] is not None]


def paired_footer(values: Mapping, stage: str, metric: str) -> tuple[list[dict], list[str]]:
    """Every method minus random init per L, paired by device and training seed: the
    :func:`~fedssl.eval.report.paired_against` entries (with several seeds, the mean per seed and the standard error
    over seeds: sample std of the per-seed means / sqrt(seeds)) and the lines printed under the table."""
    baseline = METHODS["random"]["label"]
    paired = paired_against(paired_rows(values, stage, metric), baseline, mode=stage, units=("site",),
                            column="fraction", score=metric)
    if not paired:
        return [], []
    several = any(p["seeds"] > 1 for p in paired)
    head = (f"paired against {baseline} over {'(device, seed) pairs' if several else 'devices'}: mean difference "
            f"in {metric} points (standard error), pairs ahead" + (", by seed (SE over seeds)" if several else ""))
    text = format_paired(paired, baseline, column="fraction", name=column_name, digits=2)
    return paired, [head, *text.splitlines()]


def verdict(values: Mapping, table: str, method: str = "fedclf", baseline: str = "random") -> str:
    """FedCLF vs random init at the smallest L both ran, mean recall paired by device: helped / hurt when the mean
    difference is beyond its spread.  With one training seed the spread is the std over devices; with several,
    each seed's difference is its mean over the devices and the spread is the std of those over the seeds."""
    names = f"{METHODS[method]['label']} vs {METHODS[baseline]['label']}"
    common = sorted({f for m, f in values if m == method} & {f for m, f in values if m == baseline})
    if not common:
        return f"{names} ({table}): no common L"
    f = common[0]
    a, b = values[(method, f)], values[(baseline, f)]
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return f"{names} ({table}): no common seed at {column_name(f)}"

    def recall(sites: Mapping) -> dict:
        return {s: 100.0 * v["recall"] for s, v in sites.items()}

    if len(seeds) > 1:
        by_seed = {sd: paired_difference(recall(a[sd]), recall(b[sd]))[0] for sd in seeds}
        mean, std, n, word = paired_difference(by_seed, dict.fromkeys(seeds, 0.0))
        over = f"{n} seeds (each the mean over its devices)"
    else:
        mean, std, n, word = paired_difference(recall(a[seeds[0]]), recall(b[seeds[0]]))
        over = f"{n} devices"
    return (f"{names}, {table} at {column_name(f)}: {mean:+.2f} +- {std:.2f} mean recall (points) over {over} -> "
            f"pre-training {word}")


def _paper(table: str, metric: str, methods: Sequence[str]) -> list[dict]:
    rows = fedclf_paper_rows(table, metric, [METHODS[m]["paper"] for m in methods if METHODS[m].get("paper")])
    label = {METHODS[m]["paper"]: METHODS[m]["label"] for m in methods if METHODS[m].get("paper")}
    return [{**r, "method": label[r["method"]]} for r in rows]


def pretrain_diagnostics(out: str, methods: Sequence[str], seeds: Sequence[int]) -> dict[str, dict]:
    """Per pre-trained method and training seed (``"<method> seed <s>"``), from its run summary: the mean loss over
    devices and the devices' mean feature spread (std of the normalised momentum features; a collapse shows as ~0) at
    the first, middle and last round, and the mean number of remote features in the negative queue at the last
    round."""
    diag = {}
    for m in methods:
        for seed in seeds:
            path = os.path.join(_pretrain_workspace(out, m, seed), "server", "simulate_job", "summary.json")
            if METHODS[m]["sets"] is None or not os.path.isfile(path):
                continue
            with open(path) as f:
                rounds = json.load(f).get("rounds", [])
            if not rounds:
                continue
            picks = [rounds[0], rounds[len(rounds) // 2], rounds[-1]]
            means = [r.get("site_record_means", {}) for r in picks]
            diag[f"{m} seed {seed}"] = {
                "method": m, "seed": seed, "rounds": [r["round"] for r in picks],
                "loss": [r.get("mean_loss") for r in picks], "feature_spread": [x.get("feature_std") for x in means],
                "queue_remote_fraction": means[-1].get("queue_remote_fraction")}
    return diag


def loss_health_settings(s: dict, method: str, seed: int) -> dict:
    """The loss-health settings of ``method``'s pre-training at training seed ``seed``
    (:func:`fedssl.experiments.diagnostics.health_settings` of ``fedclf_trainer`` as the run configures it: MoCo
    ln(K+1) with K its ``bank_size``, SimCLR ln(2B-1), rotation ln 4; D its ``proj_dim``)."""
    sets = [*_job_sets(s, "pretrain", seed), *METHODS[method]["sets"]]
    return job_health_settings(os.path.join(REPO_ROOT, "jobs", PRETRAIN_JOB), s["profile"], sets, "fedclf_trainer")


def pretraining_health_of(out: str, s: dict) -> dict[tuple[str, int], dict]:
    """(method, training seed) -> the loss health (:func:`~fedssl.experiments.diagnostics.pretraining_health`) of
    every pre-training of the run whose summary.json exists."""
    health = {}
    for m in s["methods"]:
        for seed in s["seeds"]:
            path = os.path.join(_pretrain_workspace(out, m, seed), "server", "simulate_job", "summary.json")
            if METHODS[m]["sets"] is not None and os.path.isfile(path):
                health[(m, seed)] = pretraining_health(pretraining_rounds(path), **loss_health_settings(s, m, seed))
    return health


def _seed_health(health: Mapping, method: str, seeds) -> dict[str, dict]:
    return {f"seed {int(sd)}": health[(method, int(sd))] for sd in seeds if (method, int(sd)) in health}


def mark_rows(rows: list[dict], values: Mapping, health: Mapping) -> tuple[list[dict], dict[str, str]]:
    """Each row with its failure record (its seeds; :func:`~fedssl.experiments.diagnostics.failure_record`) and, on
    every row of a method with a failed pre-training at a seed the table holds, the method's ``mark``; and the marks
    by label."""
    keys = {METHODS[m]["label"]: m for m in METHODS}
    marks = {}
    for m in {m for m, _ in values}:
        per = _seed_health(health, m, {sd for (mm, _), by_seed in values.items() if mm == m for sd in by_seed})
        marks[METHODS[m]["label"]] = failed_mark(failure_record(per)["pretraining_failed_at"], sorted(per))
    out = [{**r, **failure_record(_seed_health(health, keys[r["method"]], r["seeds"]))} for r in rows]
    return [dict(r, mark=marks[r["method"]]) if marks.get(r["method"]) else r for r in out], marks


def diagnostics_text(diag: Mapping[str, dict]) -> str:
    def fmt(vals, digits):
        return " / ".join("-" if v is None else f"{v:.{digits}f}" for v in vals)

    lines = ["Pre-training diagnostics (mean over devices; feature spread ~0 = collapse)"]
    for d in diag.values():
        lines.append(f"  {METHODS[d['method']]['label']} seed {d['seed']}: rounds {fmt(d['rounds'], 0)}: loss "
                     f"{fmt(d['loss'], 3)}; feature spread {fmt(d['feature_spread'], 3)}"
                     + ("" if d["queue_remote_fraction"] is None else
                        f"; remote share of the negative queue {d['queue_remote_fraction']:.2f}")
                     + (f"; loss health: {health_text(d['health'])}" if d.get("health") else ""))
    return "\n".join(lines)


def health_verdict(values: Mapping, table: str, health: Mapping) -> str:
    """:func:`verdict`, saying FedCLF's pre-training failed (at which of the table's seeds) where it did."""
    seeds = {sd for (m, _), by_seed in values.items() if m == "fedclf" for sd in by_seed}
    per = _seed_health(health, "fedclf", seeds)
    return failed_verdict(verdict(values, table), METHODS["fedclf"]["label"],
                          failure_record(per)["pretraining_failed_at"], sorted(per))


def write_tables(out: str, s: dict, results: Mapping, say: Callable[[str], None],
                 health: Mapping | None = None) -> dict:
    """Tables I / II (recall, precision) and Fig. 6; ``health``: (method, seed) -> its pre-training's loss health (a
    failed one is marked in the rows, the verdict, the paired differences and a line per seed under the table)."""
    written, health = {}, health or {}
    for table, stage, roman in ((1, "local", "I"), (2, "federated", "II")):
        values = per_device(results, stage)
        if table not in s["tables"] or not values:
            continue
        seeds = sorted({sd for by_seed in values.values() for sd in by_seed})
        notes = [f"profile {s['profile']}; {stage} fine-tuning; mean +- std over the {N_DEVICES} devices' test sets"
                 + (f", each device's averaged over training seeds {seeds} first" if len(seeds) > 1 else
                    f", training seed {seeds[0]}") + f"; split seed {s['split_seed']} (the labelled images)",
                 health_verdict(values, f"Table {roman}", health)]
        few = seeds_note(values)
        failed = failure_footer({METHODS[m]["label"]: _seed_health(health, m, seeds) for m in s["methods"]})
        for metric in METRICS:
            name = f"table{roman}_{metric}"
            paired, footer = paired_footer(values, stage, metric)
            rows, marks = mark_rows(summary_rows(values, f"Table {roman}", metric), values, health)
            footer = mark_lines(footer, marks) + failed
            written[name] = write_table(out, name, rows,
                                        title=f"FedCLF Table {roman}: {stage} fine-tuning, mean {metric} (%)",
                                        paper=_paper(roman, metric, s["methods"]),
                                        paper_source=FEDCLF_SOURCE.format(table=f"Table {roman}"),
                                        score=f"{metric} (%)", notes=notes, digits=2,
                                        footer=footer + ([few] if few else []),
                                        extra={"seeds": seeds, "split_seed": s["split_seed"],
                                               "paired_against_random": paired, "pretraining_health": {
                                                   METHODS[m]["label"]: _seed_health(health, m, seeds)
                                                   for m in s["methods"] if METHODS[m]["sets"] is not None}})
            with open(written[name]["txt"]) as f:
                say(f.read().rstrip())
        fig = {k: v for k, v in values.items() if METHODS[k[0]].get("fig6") and k[1] == 0.1}
        if stage == "federated" and fig:
            rows, _ = mark_rows(summary_rows(fig, "Fig. 6", "recall"), fig, health)
            paper = [{**r, "method": next(METHODS[m]["label"] for m in METHODS if METHODS[m].get("fig6")
                                          == r["method"])}
                     for r in fedclf_paper_rows("Fig6")]
            few = seeds_note(fig)
            failed_fig = failure_footer({METHODS[m]["label"]: _seed_health(health, m, seeds) for m in METHODS
                                         if any(k[0] == m for k in fig)})
            written["fig6"] = write_table(out, "fig6_recall", rows, title="FedCLF Fig. 6: ablation, federated L=10%",
                                          paper=paper, paper_source=FEDCLF_SOURCE.format(table="Fig. 6"),
                                          score="recall (%)", digits=2, footer=failed_fig + ([few] if few else []),
                                          extra={"seeds": seeds, "split_seed": s["split_seed"]})
    return written


def run_fedclf_tables(out: str, settings: dict, *, data_root: str | None = None, workers: int = 1,
                      say: Callable[[str], None] = print, simulate=run_simulation,
                      threads: int = DEFAULT_THREADS) -> dict:
    """Run (or resume) the cells of the chosen tables and training seeds into ``out`` and write their files.
    ``threads``: torch threads of this process and of each of the ``workers`` (a setting of the folder, like
    ``split_seed``; the seeds run are recorded in ``run_config.json`` as they are added)."""
    t0 = time.time()
    out, devices, store = start_run(out, settings, SELECTORS, data_root, lambda o: prepare_devices(o, settings, say),
                                    threads=threads, collected=RECORDED, say=say)
    pre = pretrain_cells(settings)
    done = run_cells(pre, lambda key: pretrain(key, out, devices, settings, simulate), store, say=say,
                     label="FedCLF pre-training (FLARE simulator)", threads=threads)
    pretrained = {(k["method"], k["seed"]): r for k, r in zip(pre, done)}
    results = {}
    cells = local_cells(settings)
    if cells:
        fn = functools.partial(local_one, devices=devices, s=settings, pretrained=pretrained)
        rows = run_cells(cells, fn, store, say=say, workers=workers, cost=lambda key: key["fraction"],
                         label="Table I cells (local fine-tuning)", threads=threads)
        results.update({("local", k["method"], k["fraction"], k["seed"], k["site"]): r for k, r in zip(cells, rows)})
    cells = federated_cells(settings)
    if cells:
        rows = run_cells(cells, lambda key: federated_one(key, out, devices, settings, pretrained, simulate), store,
                         say=say, label="Table II cells (federated fine-tuning, FLARE simulator)", threads=threads)
        results.update({("federated", k["method"], k["fraction"], k["seed"], None): r for k, r in zip(cells, rows)})
    health = pretraining_health_of(out, settings)
    written = write_tables(out, settings, results, say, health)
    diag = pretrain_diagnostics(out, settings["methods"], settings["seeds"])
    for d in diag.values():
        d["health"] = health.get((d["method"], d["seed"]))
    if diag:
        with open(os.path.join(out, "diagnostics.json"), "w") as f:
            json.dump(plain_json(diag), f, indent=2)
        with open(os.path.join(out, "diagnostics.txt"), "w") as f:
            f.write(diagnostics_text(diag) + "\n")
        say(diagnostics_text(diag))
        written["diagnostics"] = {"json": os.path.join(out, "diagnostics.json"),
                                  "txt": os.path.join(out, "diagnostics.txt")}
    say(f"FedCLF tables done in {time.time() - t0:.0f} s; files under {out}")
    return written


#: ``fedssl fedclf demo``: FedCLF vs FedMoCo vs random init, local and federated fine-tuning at L = 10 and 80 %, at
#: the quick profile (its ``tables.fedclf`` holds the demo's data size, rounds and overrides), one training seed (its
#: tables say so under them)
DEMO = {"methods": ["random", "fedmoco", "fedclf"], "fractions": [0.1, 0.8], "tables": [1, 2], "seeds": [0]}


def run_fedclf_demo(out: str, *, workers: int = 2, profile: str = "quick", say: Callable[[str], None] = print,
                    simulate=run_simulation, threads: int = DEFAULT_THREADS) -> dict:
    """The FedCLF demo: :func:`run_fedclf_tables` with :data:`DEMO`'s cells at ``profile`` (resumable like it)."""
    return run_fedclf_tables(out, table_settings(profile, **DEMO), workers=workers, say=say, simulate=simulate,
                             threads=threads)

