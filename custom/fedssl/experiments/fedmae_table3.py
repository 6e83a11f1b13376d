"""Table III of "Federated Self-Supervised Learning for Dermatological Disease Diagnosis" (Wu et al., sec. V-B):
local fine-tuning with 80 % of each client's images labelled, on FedMAE's setting, so that the CNN methods (FedCLF
and its baselines) and the ViT ones (FedMAE with knowledge split) are compared on the same data in one table.

Setting (sec. V-B): the full ISIC 2019 (8 classes), a held-out test set (20 %), the rest split at random into 10
near-equal client partitions (``fedssl sslfl partition derm ... --split iid``, the layout ``jobs/fedmae_derm`` reads);
each client keeps a validation share of its partition (``val_fraction``, 0.25 of 80 % = the paper's 20 %) and
fine-tunes alone on 80 % of the rest; the epoch is chosen on validation and the model tested on the test set.

* CNN rows: ``jobs/fedclf_derm`` with each method's switches (:data:`fedssl.experiments.fedclf_tables.METHODS`) on the
  partition sites (``split=""``), at ResNet-50 (sec. V-B: "ResNet-50 is used as the backbone"; ``shape.depth=50``),
  then Table I's fine-tuning protocol (Adam, lr 1e-4, 20 epochs, x0.2 at 12 and 16) on each client;
* ViT rows: random init and ``jobs/fedmae_derm`` (FedMAE-KS, class token kept local), then the paper's ViT local
  fine-tuning (200 epochs, batch 512, lr 1e-3, cosine) through :func:`fedssl.experiments.sslfl_local.finetune_site`.

Each metric (recall = balanced accuracy, precision, F1, specificity, AUC, accuracy; macro over the 8 classes) is
the mean +- std over the 10 clients' models on the test set, beside the paper's (the mean of its 3 runs).  Cells
(one pre-training per method, one local fine-tuning per method and client) run through
:mod:`fedssl.experiments.table_runner`: resumable, with progress and ETA.  A profile's ``tables.fedmae_table3``
shortens it for a CPU (``quick``: the demo-sized run).  The local cells compute with ``threads`` torch threads per
process (this one and each worker), recorded in ``run_config.json`` with the environment.  One seed per folder
(``seed``: the images, the partition and the models): the table says under it that its comparison is not a finding.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import time
from collections.abc import Callable, Mapping

import numpy as np
import torch

from fedssl.core.checks import require, require_int
from fedssl.core.seeds import site_seed
from fedssl.data.image_sites import write_site_folders
from fedssl.data.image_synthetic import write_synthetic_images
from fedssl.data.images import load_image_records, train_val_split
from fedssl.eval.paper_tables import FEDCLF_SOURCE, FEDMAE_TABLE3_METRICS, fedmae_table3_rows
from fedssl.eval.report import paired_difference
from fedssl.experiments import fedclf_tables
from fedssl.experiments.fcl_finetune import load_global_state
from fedssl.experiments.environment import DEFAULT_THREADS
from fedssl.experiments.sslfl_local import PAPER_LOCAL, finetune_site
from fedssl.experiments.table_runner import few_seeds_note, plain_json, run_cells, start_run, write_table
from fedssl.ops.jobs import REPO_ROOT, component_specs, configured_job, load_profile
from fedssl.ops.simulate import run_simulation
from fedssl.train.resnet_classifier import local_finetune_device

N_CLIENTS = 10
DATASET = "derm"
#: Table III's label fraction (sec. V-B: "80% data is labeled on each device for fine-tuning")
LABEL_FRACTION = 0.8
CNN_JOB, MAE_JOB, MAE_FINETUNE_JOB = "fedclf_derm", "fedmae_derm", "fedmae_derm_finetune"
#: the FedCLF jobs read a partition site (its own folder, 8 ISIC classes) with ResNet-50
CNN_DATA_SETS = ['client.fedclf_trainer.split=""', f"client.fedclf_trainer.dataset={DATASET}", "shape.depth=50"]
#: method -> family, Table III's row, and the pre-training overrides (None: random init)
METHODS: dict[str, dict] = {
    **{m: {"family": "CNN", "row": row, "sets": fedclf_tables.METHODS[m]["sets"]}
       for m, row in (("random", "Random Init."), ("local_cl", "Local CL"), ("fedrotation", "FedRotation"),
                      ("fedsimclr", "FedSimCLR"), ("fedmoco", "FedMoCo"), ("fedclf", "FedCLF"))},
    "vit_random": {"family": "ViT", "row": "Random Init.", "sets": None},
    "fedmae": {"family": "ViT", "row": "FedMAE", "sets": []},
}
#: Table III's metric -> the key of :func:`fedssl.core.classification.classification_metrics`
METRIC_KEYS = dict(zip(FEDMAE_TABLE3_METRICS, ("balanced_accuracy", "macro_precision", "macro_f1",
                                                "macro_specificity", "auc", "accuracy")))
#: ViT local fine-tuning of sec. V-B ("200 epochs ... batch size 512 ... learning rate 1e-3 with a cosine decay")
VIT_LOCAL = {"epochs": 200, "batch_size": 512, "lr": 1e-3, "label_fraction": LABEL_FRACTION,
             "select_metric": "balanced_accuracy"}
DEFAULTS = {"n_images": 4000, "image_px": 64, "seed": 0, "methods": list(METHODS), "val_fraction": 0.25,
            "pretrain_rounds": None, "cnn_sets": [], "mae_sets": [], "cnn_local": {}, "vit_local": {}}
SELECTORS = ("methods",)


def table3_settings(profile: str = "bench", **overrides) -> dict:
    """:data:`DEFAULTS` < the profile's ``"tables": {"fedmae_table3": {...}}`` < ``overrides`` (None ignored),
    checked."""
    from_profile = load_profile(profile).get("tables", {}).get("fedmae_table3", {}) if profile else {}
    unknown = sorted(set(from_profile) - set(DEFAULTS))
    require(not unknown, f"profile {profile!r} tables.fedmae_table3", "keys", unknown,
            f"use keys of {sorted(DEFAULTS)}")
    s = {**DEFAULTS, **from_profile, **{k: v for k, v in overrides.items() if v is not None}, "profile": profile}
    vals = list(s["methods"])
    require(bool(vals) and all(v in METHODS for v in vals) and len(set(vals)) == len(vals), "fedmae table3",
            "methods", vals, f"use distinct values from {list(METHODS)}")
    s["methods"] = vals
    require_int("fedmae table3", "n_images", s["n_images"], 8 * 2 * (N_CLIENTS + 1),
                "use enough synthetic ISIC images for 10 clients and a test set (at least 176)")
    require(isinstance(s["val_fraction"], float) and 0 < s["val_fraction"] < 1, "fedmae table3", "val_fraction",
            s["val_fraction"], "use a fraction in (0, 1); 0.25 of a client's 80 % is the paper's 20 %")
    if s["pretrain_rounds"] is not None:
        require_int("fedmae table3", "pretrain_rounds", s["pretrain_rounds"], 1, "use a positive integer, or null")
    for name in ("cnn_sets", "mae_sets"):
        require(isinstance(s[name], list) and all(isinstance(x, str) and "=" in x for x in s[name]), "fedmae table3",
                name, s[name], 'use a list of --set overrides of the job, e.g. ["client.mim_trainer.batch_size=32"]')
    for name in ("cnn_local", "vit_local"):
        require(isinstance(s[name], dict), "fedmae table3", name, s[name], "use a JSON object of fine-tuning settings")
    return s


def prepare_partition(out: str, s: dict, say: Callable[[str], None]) -> str:
    """Synthetic ISIC 2019 (8 classes) and its 10 IID client partitions + test under ``out/data`` (kept across runs)."""
    src, parts = os.path.join(out, "data", "isic2019"), os.path.join(out, "data", "partition")
    if not os.path.isfile(os.path.join(parts, "partition.json")):
        if not os.path.isdir(src):
            say(f"writing {s['n_images']} synthetic ISIC 2019 images ({s['image_px']} px high) -> {src}")
            shutil.rmtree(src + ".partial", ignore_errors=True)  # a write that stopped half-way
            write_synthetic_images(src + ".partial", DATASET, n_images=s["n_images"], seed=s["seed"],
                                   image_size=s["image_px"])
            os.replace(src + ".partial", src)
        write_site_folders(src, DATASET, parts, n_sites=N_CLIENTS, seed=s["seed"], split="iid", test_fraction=0.2)
    return parts


def _common_sets(s: dict, trainer: str) -> list[str]:
    rounds = s["pretrain_rounds"]
    return [f"server.scatter_and_gather.min_clients={N_CLIENTS}"] + (
        [f"server.scatter_and_gather.num_rounds={rounds}"] if rounds is not None else []) + [
        f"server.model.seed={s['seed']}", f"client.{trainer}.seed={s['seed']}"]


def pretrain(key: dict, out: str, parts: str, s: dict, simulate=run_simulation) -> dict:
    """One pre-training run in the simulator: a CNN method on ``jobs/fedclf_derm`` or FedMAE-KS on
    ``jobs/fedmae_derm``."""
    method = key["method"]
    if METHODS[method]["family"] == "CNN":
        job, sets = CNN_JOB, [*_common_sets(s, "fedclf_trainer"), *CNN_DATA_SETS, *s["cnn_sets"],
                              *METHODS[method]["sets"]]
    else:
        job, sets = MAE_JOB, [*_common_sets(s, "mim_trainer"), *s["mae_sets"]]
    ws = os.path.join(out, "ws", f"pretrain_{method}")
    run = simulate(os.path.join(REPO_ROOT, "jobs", job), ws, n_sites=N_CLIENTS, data_root=os.path.join(parts, "{site}"),
                   profile=s["profile"], echo=False, sets=sets)
    sites = {f"site-{k}": os.path.join(ws, f"site-{k}", "simulate_job", "fedclf_client_state.pt")
             for k in range(1, N_CLIENTS + 1)} if METHODS[method]["family"] == "CNN" else {}
    return {"global_model": run["global_model"], "wall_time_s": run.get("simulator_wall_time_s"),
            "bytes_per_site_per_round": run.get("bytes_per_site_per_round"), "site_states": sites}


def _job_args(job: str, profile: str, config: str, cid: str, sets: list[str]) -> dict:
    files = configured_job(os.path.join(REPO_ROOT, "jobs", job), profile, sets=sets)
    return next(c for c in component_specs(files[f"app/config/{config}"]) if c["id"] == cid)["args"]


def cnn_local_settings(s: dict) -> dict:
    """The ResNet-50 of the CNN pre-training at the profile (width, crop) and Table I's protocol (profile-shortened)."""
    args = _job_args(CNN_JOB, s["profile"], "config_fed_client.json", "fedclf_trainer",
                     [*CNN_DATA_SETS, *s["cnn_sets"]])
    return {"dataset": DATASET, "image_size": args["image_size"], "width": args["width"], "depth": args["depth"],
            "eval_batch_size": 256, "seed": s["seed"], "split_seed": s["seed"],  # the folder's one seed draws all
            "device": "cuda" if torch.cuda.is_available() else "cpu", "epochs": 20, "milestones": [12, 16],
            "batch_size": 256, "lr": 1e-4, **s["cnn_local"]}


def vit_local_settings(s: dict) -> dict:
    """The ViT of the FedMAE-KS fine-tuning job at the profile and sec. V-B's local protocol (profile-shortened)."""
    args = _job_args(MAE_FINETUNE_JOB, s["profile"], "config_fed_client.json", "cls_trainer", [])
    shape = {k: args[k] for k in ("image_size", "patch_size", "embed_dim", "depth", "num_heads", "drop_path_rate",
                                  "layer_scale", "weight_decay", "layer_decay", "min_lr", "eval_batch_size")}
    return {**PAPER_LOCAL, **shape, **VIT_LOCAL, "val_fraction": s["val_fraction"], "seed": s["seed"],
            "device": "cuda" if torch.cuda.is_available() else "cpu", **s["vit_local"]}


def local_one(key: dict, parts: str, s: dict, pretrained: Mapping, kw: Mapping | None = None) -> dict:
    """One client's local fine-tuning from one method's encoder: the test metrics of its validation-chosen model.
    ``kw``: the family's settings (:func:`cnn_local_settings` / :func:`vit_local_settings`; None = computed here)."""
    method, site = key["method"], key["site"]
    vit = METHODS[method]["family"] == "ViT"
    kw = dict(kw) if kw is not None else vit_local_settings(s) if vit else cnn_local_settings(s)
    pre = pretrained.get(method)
    test_root = os.path.join(parts, "test")
    if vit:
        row = finetune_site(site, os.path.join(parts, site), test_root, DATASET, kw,
                            pretrained_path=pre["global_model"] if pre else "")
        return plain_json({"site": site, "best_epoch": row["best_epoch"], "n_labelled": row["n_labelled"],
                           "test": {k: v for k, v in row["test"].items()
                                    if k not in ("per_class", "confusion_matrix")}})
    records = load_image_records(os.path.join(parts, site), DATASET, site=site)
    train, val = train_val_split(records, s["val_fraction"], seed=site_seed(s["seed"], site))
    init = None
    if pre is not None:
        init = load_global_state(pre["site_states"][site] if method == "local_cl" else pre["global_model"])
    row = local_finetune_device(train, val, load_image_records(test_root, DATASET, site="test"), init=init, site=site,
                                label_fraction=LABEL_FRACTION, **kw)
    return plain_json(row)


def _local_cell(key: dict, parts: str, s: dict, pretrained: Mapping, kw: Mapping) -> dict:
    """:func:`local_one` with the family's settings, as a picklable function for worker processes."""
    return local_one(key, parts, s, pretrained, kw[METHODS[key["method"]]["family"]])


def label(method: str) -> str:
    return f"{METHODS[method]['family']}: {METHODS[method]['row']}"


def summary_rows(results: Mapping[tuple[str, str], dict]) -> list[dict]:
    """mean +- std (population, over clients) in %, one row per (method, metric)."""
    rows = []
    for method in dict.fromkeys(m for m, _ in results):
        tests = [r["test"] for (m, _), r in results.items() if m == method]
        for metric, k in METRIC_KEYS.items():
            vals = [100.0 * t[k] for t in tests if t.get(k) is not None]
            if vals:
                rows.append({"table": "Table III", "method": label(method), "column": metric,
                             "mean": float(np.mean(vals)), "std": float(np.std(vals)), "n": len(vals)})
    return rows


def verdicts(results: Mapping[tuple[str, str], dict]) -> list[str]:
    """FedCLF vs random ResNet and FedMAE vs random ViT: mean recall paired by client (helped / hurt beyond the std)."""
    lines = []
    for method, base in (("fedclf", "random"), ("fedmae", "vit_random")):
        a = {s: 100.0 * r["test"]["balanced_accuracy"] for (m, s), r in results.items() if m == method}
        b = {s: 100.0 * r["test"]["balanced_accuracy"] for (m, s), r in results.items() if m == base}
        if set(a) & set(b):
            mean, std, n, word = paired_difference(a, b)
            lines.append(f"{label(method)} vs {label(base)}: {mean:+.2f} +- {std:.2f} mean recall (points) over "
                         f"{n} clients -> pre-training {word}")
    return lines


def run_table3(out: str, settings: dict, *, data_root: str | None = None, workers: int = 1,
               say: Callable[[str], None] = print, simulate=run_simulation, threads: int = DEFAULT_THREADS) -> dict:
    """Run (or resume) Table III's cells into ``out`` and write ``tableIII.{json,csv,txt,png}``.  ``threads``: torch
    threads of this process and of each of the ``workers`` (a setting of the folder)."""
    t0 = time.time()
    out, parts, store = start_run(out, settings, SELECTORS, data_root, lambda o: prepare_partition(o, settings, say),
                                  threads=threads, say=say)
    pre = [{"stage": "pretrain", "method": m} for m in settings["methods"] if METHODS[m]["sets"] is not None]
    done = run_cells(pre, lambda key: pretrain(key, out, parts, settings, simulate), store, say=say,
                     label="Table III pre-training (FLARE simulator)", threads=threads)
    pretrained = {k["method"]: r for k, r in zip(pre, done)}
    cells = [{"stage": "local", "method": m, "site": f"site-{k}"} for m in settings["methods"]
             for k in range(1, N_CLIENTS + 1)]
    families = {METHODS[m]["family"] for m in settings["methods"]}
    kw = {"CNN": cnn_local_settings(settings) if "CNN" in families else None,
          "ViT": vit_local_settings(settings) if "ViT" in families else None}
    rows = run_cells(cells, functools.partial(_local_cell, parts=parts, s=settings, pretrained=pretrained, kw=kw),
                     store, say=say, workers=workers, label="Table III cells (local fine-tuning, 80 % labels)",
                     threads=threads)
    results = {(k["method"], k["site"]): r for k, r in zip(cells, rows)}
    lines = verdicts(results)
    notes = [f"profile {settings['profile']}; local fine-tuning with {int(100 * LABEL_FRACTION)} % labels; mean +- std "
             f"over the {N_CLIENTS} clients' models on the test set; CNN = ResNet-50, ViT = FedMAE-KS's ViT", *lines]
    paper = fedmae_table3_rows([(METHODS[m]["family"], METHODS[m]["row"]) for m in settings["methods"]])
    few = few_seeds_note({label(m): [settings["seed"]] for m in settings["methods"]},
                         rerun="the table again with --seed 1 and --seed 2, one --out per seed")
    written = {"table3": write_table(out, "tableIII", summary_rows(results), paper=paper, notes=notes, digits=2,
                                     footer=[few] if few else [],
                                     title="FedMAE-KS Table III: local fine-tuning, 80 % labels (%)",
                                     paper_source=FEDCLF_SOURCE.format(table="Table III"), score="metric (%)")}
    with open(written["table3"]["txt"]) as f:
        say(f.read().rstrip())
    costs = {k["method"]: {"wall_time_s": r.get("wall_time_s"),
                           "bytes_per_site_per_round": r.get("bytes_per_site_per_round")}
             for k, r in zip(pre, done)}
    with open(os.path.join(out, "pretraining.json"), "w") as f:
        json.dump(plain_json(costs), f, indent=2)
    say(f"Table III done in {time.time() - t0:.0f} s; files under {out}")
    return written
