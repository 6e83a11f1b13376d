"""SSL-FL's pooled control (issue 44, H2 and H5 for Fed-MAE): the fine-tuning of ``fedssl sslfl tables`` without
federation, on all sites' labelled images pooled, in a bare loop (:func:`fedssl.experiments.sslfl_local.finetune_site`),
from three starts per seed:

* ``scratch``: the fine-tuning ViT's own initialisation (timm's truncated normal, std 0.02), the table's ViT scratch;
* ``fedmae``: the Fed-MAE global model of the same split and seed, read from the table's ``cells.jsonl``;
* ``mae_init``: the Fed-MAE model before pre-training (MAE's xavier-uniform initialisation, the pre-training job's
  model at the same profile and seed), so that what pre-training adds is told apart from the scale of MAE's
  initialisation (at width 48 xavier gives weights 4.6-7.2x timm's std 0.02; at ViT-B's width 768, 1.1-1.8x).

If pooled fine-tuning from the pre-trained encoder does not beat these starts, federated fine-tuning cannot be
expected to; if it does and the table's federated rows do not, the federation loses the effect.  The model and the
trainer's settings are the fine-tuning job's at the table's profile (shape, lr, batch, warm-up, weight and layer
decay, validation share); ``epochs`` passes over the pooled labelled set replace the rounds.  Each finished arm is
a line of ``control.jsonl`` under the table's folder (resumable).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import torch

from fedssl.core.checks import require, require_int
from fedssl.eval.report import paired_against
from fedssl.experiments.sslfl_local import PAPER_LOCAL, finetune_site
from fedssl.experiments.table_runner import CellStore
from fedssl.ops.jobs import REPO_ROOT, component_specs, configured_job

ARMS = ("scratch", "fedmae", "mae_init")
FINETUNE_JOB, PRETRAIN_JOB = "sslfl_retina_finetune", "sslfl_mae_retina"
#: the fine-tuning executor's arguments the bare loop takes over (the rest is the sites' data and FLARE's)
TRAINER_KEYS = ("image_size", "patch_size", "embed_dim", "depth", "num_heads", "drop_path_rate", "lr", "batch_size",
                "min_lr", "weight_decay", "layer_decay", "val_fraction", "eval_batch_size")


def component_args(job: str, profile: str, component: str, sets: Sequence[str] = ()) -> dict:
    """The arguments of ``component`` (its id, client or server config) of the bundle's job ``job`` at ``profile``
    with the ``--set`` overrides ``sets`` applied, as the simulator would run it."""
    files = configured_job(os.path.join(REPO_ROOT, "jobs", job), profile, list(sets))
    for name in ("app/config/config_fed_client.json", "app/config/config_fed_server.json"):
        for c in component_specs(files[name]):
            if c["id"] == component:
                return dict(c.get("args", {}))
    raise ValueError(f"{job} has no component {component!r}")  # the job folders are the bundle's own


def control_settings(profile: str, epochs: int, seed: int) -> dict:
    """The bare loop's settings: the fine-tuning job's ViT and trainer at ``profile``, ``epochs`` passes, ``seed``."""
    require_int("sslfl control", "epochs", epochs, 1, "use a positive number of passes over the pooled set")
    args = component_args(FINETUNE_JOB, profile, "cls_trainer")
    return {**PAPER_LOCAL, **{k: args[k] for k in TRAINER_KEYS if k in args}, "epochs": epochs,
            "warmup": min(int(args.get("warmup_rounds", 0)), epochs), "layer_scale": None, "seed": seed,
            "select_metric": "accuracy", "device": "cpu"}


def pooled_site(split_dir: str, out: str) -> str:
    """``out/site-1``: every ``site-*`` of ``split_dir`` in one folder (images linked, labels concatenated in site
    order); returns its path.  A re-run rebuilds the label file and keeps the links."""
    sites = sorted(d for d in (os.listdir(split_dir) if os.path.isdir(split_dir) else []) if d.startswith("site-"))
    require(bool(sites), "sslfl control", "split folder", split_dir, "run `fedssl sslfl tables` for this split first")
    pool = os.path.join(out, "site-1")
    os.makedirs(os.path.join(pool, "train"), exist_ok=True)
    header, lines = None, []
    for site in sites:
        with open(os.path.join(split_dir, site, "trainLabels.csv")) as f:
            rows = [r for r in f.read().splitlines() if r.strip()]
        header = header or rows[0]
        for row in rows[1:]:
            lines.append(row)
            name = row.split(",")[0] + ".jpeg"
            link = os.path.join(pool, "train", name)
            if not os.path.lexists(link):
                os.symlink(os.path.abspath(os.path.join(split_dir, site, "train", name)), link)
    with open(os.path.join(pool, "trainLabels.csv"), "w") as f:
        f.write("\n".join([header, *lines]) + "\n")
    return pool


def mae_init_model(profile: str, seed: int, like: str, path: str) -> str:
    """Write the Fed-MAE pre-training job's model at ``profile`` and ``seed`` before any training to ``path``, in the
    format of the global model ``like`` (a pre-training's ``FL_global_model.pt``); returns ``path``."""
    from fedssl.core.safe_load import safe_load
    from fedssl.models.vit import MAEViT

    args = {k: v for k, v in component_args(PRETRAIN_JOB, profile, "model").items() if k != "seed"}
    state = MAEViT(**args, seed=seed).state_dict()
    saved = safe_load(like)
    require(set(saved["model"]) == set(state), "sslfl control", "pre-trained model", like,
            f"its keys differ from {PRETRAIN_JOB}'s model at this profile; run the control with the table's profile")
    torch.save({**saved, "model": {k: state[k].clone() for k in saved["model"]}}, path)
    return path


def run_control(out: str, profile: str, split: int, seeds: Sequence[int], arms: Sequence[str] = ARMS,
                epochs: int = 40, threads: int = 1, say: Callable[[str], None] = print) -> list[dict]:
    """Run every (seed, arm) not yet in ``out/control.jsonl`` with ``threads`` torch threads (recorded in each
    result); returns one row per arm and seed."""
    require_int("sslfl control", "threads", threads, 1, "use a positive number of torch threads")
    torch.set_num_threads(threads)
    for arm in arms:
        require(arm in ARMS, "sslfl control", "arms", list(arms), f"use names from {list(ARMS)}")
    tables = CellStore(os.path.join(out, "cells.jsonl"))
    store = CellStore(os.path.join(out, "control.jsonl"))
    rows = []
    for seed in seeds:
        split_dir = os.path.join(out, "data", f"seed{seed}", f"split{split}")
        pre_key = {"stage": "pretrain", "method": "fedmae", "split": split, "seed": seed}
        pre = tables.get(pre_key) if tables.done(pre_key) else None
        require(pre is not None and os.path.isfile(pre.get("global_model", "")), "sslfl control", "seed", seed,
                f"no Fed-MAE pre-training of split {split} in {out}; run `fedssl sslfl tables --out {out} --splits "
                f"{split} --methods scratch fedmae --seeds {seed}` first")
        work = os.path.join(out, "control", f"seed{seed}")
        pool = pooled_site(split_dir, work)
        settings = control_settings(profile, epochs, seed)
        for arm in arms:
            key = {"stage": "control", "arm": arm, "split": split, "seed": seed, "epochs": epochs}
            result = store.get(key) if store.done(key) else None
            if result is None:
                t0 = time.time()
                init = {"scratch": "", "fedmae": pre["global_model"]}.get(arm)
                if init is None:
                    init = mae_init_model(profile, seed, pre["global_model"], os.path.join(work, "mae_init.pt"))
                r = finetune_site("site-1", pool, os.path.join(split_dir, "test"), "retina", settings, init)
                result = {"test_accuracy": r["test"]["accuracy"], "best_epoch": r["best_epoch"],
                          "n_labelled": r["n_labelled"], "threads": threads}
                result = store.put(key, result, time.time() - t0)
            say(f"seed {seed} {arm}: test accuracy {100 * result['test_accuracy']:.2f} % "
                f"(best epoch {result['best_epoch'] + 1} of {epochs})")
            rows.append({"seed": seed, "arm": arm, **result})
    return rows


def paired_lines(rows: Sequence[dict], pairs=(("fedmae", "scratch"), ("fedmae", "mae_init"),
                                              ("mae_init", "scratch"))) -> list[str]:
    """One line per pair of arms: the difference in test accuracy points paired by seed
    (:func:`fedssl.eval.report.paired_against`), its standard error over the seeds (sample std / sqrt(n)) and each
    seed's value; pairs without a common seed are left out."""
    points = [{"mode": "pooled", "method": r["arm"], "seed": int(r["seed"]), "split": 0,
               "points": 100 * float(r["test_accuracy"])} for r in rows]
    lines = []
    for a, b in pairs:
        entry = next((e for e in paired_against(points, b, mode="pooled", units=(), column="split", score="points")
                      if e["method"] == a), None)
        if entry is None:
            continue
        per_seed = list(entry["by_seed"].values()) if "by_seed" in entry else [entry["diff_mean"]]
        se = "one seed" if entry["diff_se"] is None else f"SE {entry['diff_se']:.2f} over {entry['seeds']} seeds"
        lines.append(f"{a} minus {b}: {entry['diff_mean']:+.2f} points ({se}; per seed "
                     + " / ".join(f"{x:+.2f}" for x in per_seed) + ")")
    return lines
