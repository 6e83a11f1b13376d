"""Bytes against score: the wire switches (``--set wire.weights=...`` / ``wire.banks=float16``) at the quick profile.

``fedssl bench wire`` runs, for each method and each wire setting, the whole pipeline with that setting on both
jobs, in the FLARE simulator on synthetic data:

- ``fcl``: FCL pre-training (``fcl_acdc``, feature exchange on) -> federated fine-tuning (``fcl_acdc_finetune``,
  N labelled patients per site) from the pre-trained encoder -> Dice of the global model on every site's
  held-out fold (mean over sites, foreground classes);
- ``fedmae``: Fed-MAE pre-training (``sslfl_mae_retina``) scored by its own masked-reconstruction loss in the last
  round (lower is better).  Federated fine-tuning at this size (900 synthetic fundus images at 32 px) stays at
  chance whatever the wire (measured: balanced accuracy 0.500 in every run, AUC 0.47-0.49), so it cannot show a
  cost; the pre-training loss can.

Bytes are the communication meter's (mean per site per round, both jobs, each direction).  The run-to-run spread
is measured, not assumed: the setting ``none`` (nothing changed on the wire) runs ``repeats`` times with
different seeds (``paired``: every setting does), a setting's score is compared with ``none`` of the same seed,
and its mean difference is within the spread when it is at most the standard deviation of ``none`` over seeds.
Each finished cell is written to ``cells/<method>__<setting>__<repeat>.json`` and is not run again.
"""

from __future__ import annotations

import json
import math
import os
import time

import numpy as np

from fedssl.ops.jobs import REPO_ROOT
from fedssl.ops.simulate import run_simulation

JOBS = os.path.join(REPO_ROOT, "jobs")
#: setting name -> its --set overrides (applied to both jobs of the pipeline)
SETTINGS: dict[str, list[str]] = {
    "none": [],
    "float16": ["wire.weights=float16"],
    "adaquant": ["wire.weights=adaquant"],
    "float16+banks": ["wire.weights=float16", "wire.banks=float16"],
    "blockwise8": ["wire.weights=blockwise8"],
    "normfloat4": ["wire.weights=normfloat4"],
}
METHODS = ("fcl", "fedmae")
N_SITES = 3


def _say(t0: float, msg: str) -> None:
    print(f"[{time.time() - t0:7.1f} s] {msg}", flush=True)


def _bytes(run: dict) -> dict:
    b = run.get("bytes_per_site_per_round") or {}
    if not b:
        return {}
    return {"upload": float(b.get("upload", 0.0)), "download": float(b.get("download", 0.0))}


def _fcl_data(out: str) -> str:
    from fedssl.data.acdc_synthetic import write_synthetic_acdc

    data = os.path.join(out, "data", "acdc")
    if not os.path.isdir(data):
        write_synthetic_acdc(data, n_patients=10 * N_SITES, n_sites=N_SITES, seed=0)
    return data


def _fedmae_data(out: str) -> str:
    from fedssl.data.image_sites import write_site_folders
    from fedssl.data.image_synthetic import write_synthetic_images

    src, parts = os.path.join(out, "data", "retina_full"), os.path.join(out, "data", "retina_sites")
    if not os.path.isfile(os.path.join(parts, "partition.json")):
        write_synthetic_images(src, "retina", n_images=900, seed=0, image_size=32)
        write_site_folders(src, "retina", parts, n_sites=N_SITES, alpha=0.5, seed=0)
    return parts


def run_cell(out: str, method: str, setting: str, seed: int, pre_rounds: int, ft_rounds: int) -> dict:
    """One pipeline (pre-training then federated fine-tuning) with ``setting`` on the wire."""
    from fedssl.experiments.fcl_finetune import (evaluate_federated, export_unet_init, load_labelled_sites,
                                                 protocol_settings)

    wire = SETTINGS[setting]
    ws = os.path.join(out, "ws", f"{method}__{setting}__{seed}")
    seed_sets = [f"client.{'fcl_trainer' if method == 'fcl' else 'mim_trainer'}.seed={seed}"]
    if method == "fcl":
        data = _fcl_data(out)
        pre = run_simulation(os.path.join(JOBS, "fcl_acdc"), ws + "_pre", n_sites=N_SITES,
                             data_root=os.path.join(data, "{site}"), profile="quick", echo=False,
                             sets=[f"server.scatter_and_gather.num_rounds={pre_rounds}", *seed_sets, *wire])
        settings = protocol_settings("quick")
        init = export_unet_init(pre["global_model"], ws + "_unet_init.pt", settings["features"])
        ft = run_simulation(os.path.join(JOBS, "fcl_acdc_finetune"), ws + "_ft", n_sites=N_SITES,
                            data_root=os.path.join(data, "{site}"), profile="quick", echo=False,
                            sets=[f"server.scatter_and_gather.num_rounds={ft_rounds}",
                                  "client.seg_trainer.n_labelled=2", f"client.seg_trainer.seed={seed}",
                                  f"server.persistor.source_ckpt_file_full_name={init}", *wire])
        rows = evaluate_federated(ft["global_model"], load_labelled_sites(data, settings), method=setting, n_labelled=2,
                                  fold=0, settings=settings)
        score, per_site = float(np.mean([r["dice"] for r in rows])), {r["site"]: r["dice"] for r in rows}
        metric = "dice"
    else:  # the pre-training's own score: at the quick profile, fine-tuning on 900 images stays at chance
        parts = _fedmae_data(out)
        pre = run_simulation(os.path.join(JOBS, "sslfl_mae_retina"), ws + "_pre", n_sites=N_SITES,
                             data_root=os.path.join(parts, "{site}"), profile="quick", echo=False,
                             sets=[f"server.scatter_and_gather.num_rounds={pre_rounds}", *seed_sets, *wire])
        ft = {}
        score, metric = float(pre["rounds"][-1]["mean_loss"]), "mae_loss_last_round"
        per_site = {"loss_per_round": [r["mean_loss"] for r in pre["rounds"]]}
    return {"method": method, "setting": setting, "seed": seed, "pre_rounds": pre_rounds, "ft_rounds": ft_rounds,
            "metric": metric, "score": score, "per_site": per_site,
            "pretraining_bytes": _bytes(pre), "finetuning_bytes": _bytes(ft),
            "wall_time_s": round(float(pre["simulator_wall_time_s"]) + float(ft.get("simulator_wall_time_s", 0.0)), 1)}


def summarise(cells: list[dict]) -> list[dict]:
    """One row per (method, setting): mean score, bytes and their ratio to ``none``, the score difference to
    ``none`` paired by seed (mean +- std over seeds), and whether that mean difference lies within the run-to-run
    spread (the std of ``none`` over seeds)."""
    rows = []
    for method in dict.fromkeys(c["method"] for c in cells):
        mine = [c for c in cells if c["method"] == method]
        base = [c for c in mine if c["setting"] == "none"]
        by_seed = {c["seed"]: c["score"] for c in base}
        spread = float(np.std([c["score"] for c in base])) if len(base) > 1 else None
        base_bytes = (np.mean([c["pretraining_bytes"]["upload"] + c["pretraining_bytes"]["download"] for c in base])
                      if base else None)
        for setting in sorted(dict.fromkeys(c["setting"] for c in mine), key=lambda x: list(SETTINGS).index(x)):
            cs = [c for c in mine if c["setting"] == setting]
            score = float(np.mean([c["score"] for c in cs]))
            pre_b = float(np.mean([c["pretraining_bytes"]["upload"] + c["pretraining_bytes"]["download"] for c in cs]))
            ft_b = (float(np.mean([c["finetuning_bytes"]["upload"] + c["finetuning_bytes"]["download"] for c in cs]))
                    if all(c["finetuning_bytes"] for c in cs) else None)
            diffs = [c["score"] - by_seed[c["seed"]] for c in cs if c["seed"] in by_seed]
            mean_diff = float(np.mean(diffs)) if diffs and setting != "none" else None
            rows.append({"method": method, "setting": setting, "runs": len(cs), "metric": cs[0]["metric"],
                         "score": round(score, 4), "scores": [round(c["score"], 4) for c in cs],
                         "pretraining_mb_per_site_round": round(pre_b / 1e6, 3),
                         "finetuning_mb_per_site_round": None if ft_b is None else round(ft_b / 1e6, 3),
                         "bytes_ratio_vs_none": round(base_bytes / pre_b, 2) if base_bytes and pre_b else None,
                         "paired_difference": None if mean_diff is None else round(mean_diff, 4),
                         "paired_difference_std": None if mean_diff is None else round(float(np.std(diffs)), 4),
                         "paired_seeds": len(diffs) if mean_diff is not None else 0,
                         "none_std_over_seeds": None if spread is None else round(spread, 4),
                         "within_spread": (abs(mean_diff) <= spread) if mean_diff is not None and spread else None})
    return rows


def format_table(rows: list[dict]) -> str:
    head = (f"{'method':<7} {'wire':<14} {'runs':>4} {'score':>7} {'pre-train MB':>13} {'fine-tune MB':>13} "
            f"{'x fewer':>8} {'vs none (paired)':>18}  within spread")
    lines = [head, "-" * len(head)]
    for r in rows:
        within = "" if r["within_spread"] is None else ("yes" if r["within_spread"] else "no")
        diff = ("" if r["paired_difference"] is None else
                f"{r['paired_difference']:+.3f} +- {r['paired_difference_std']:.3f}")
        ratio = "" if r["bytes_ratio_vs_none"] is None else f"{r['bytes_ratio_vs_none']:.2f}"
        finetuning = ("-" if r["finetuning_mb_per_site_round"] is None
                      else format(r["finetuning_mb_per_site_round"], ".3f"))
        lines.append(f"{r['method']:<7} {r['setting']:<14} {r['runs']:>4} {r['score']:>7.3f} "
                     f"{r['pretraining_mb_per_site_round']:>13.3f} "
                     f"{finetuning:>13} "
                     f"{ratio:>8} {diff:>18}  {within} {r['metric']}")
    return "\n".join(lines)


def run_wire_cost(out: str, methods=METHODS, settings=("none", "float16", "adaquant", "float16+banks"),
                  repeats: int = 2, pre_rounds: int = 4, ft_rounds: int = 4, paired: bool = False) -> list[dict]:
    """Every (method, setting) once, ``none`` ``repeats`` times (seeds 0..repeats-1); with ``paired`` every
    setting over the same seeds.  Resumable; prints the table and writes ``wire_cost.json``."""
    unknown = [s for s in settings if s not in SETTINGS] + [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"bench wire: unknown {unknown}; settings {sorted(SETTINGS)}, methods {list(METHODS)}")
    out = os.path.abspath(out)
    os.makedirs(os.path.join(out, "cells"), exist_ok=True)
    plan = [(m, s, seed) for m in methods for s in settings
            for seed in (range(repeats) if s == "none" or paired else [0])]
    t0, cells = time.time(), []
    for i, (method, setting, seed) in enumerate(plan, 1):
        path = os.path.join(out, "cells", f"{method}__{setting}__{seed}.json")
        if os.path.isfile(path):
            with open(path) as f:
                cells.append(json.load(f))
            continue
        _say(t0, f"cell {i}/{len(plan)}: {method}, wire {setting}, seed {seed}")
        cell = run_cell(out, method, setting, seed, pre_rounds, ft_rounds)
        with open(path + ".tmp", "w") as f:
            json.dump(cell, f, indent=1)
        os.replace(path + ".tmp", path)
        cells.append(cell)
        _say(t0, f"  {cell['metric']} {cell['score']:.3f}, pre-training "
                 f"{sum(cell['pretraining_bytes'].values()) / 1e6:.2f} MB per site per round, {cell['wall_time_s']} s")
    rows = summarise(cells)
    with open(os.path.join(out, "wire_cost.json"), "w") as f:
        json.dump({"settings": {"pre_rounds": pre_rounds, "ft_rounds": ft_rounds, "repeats": repeats, "sites": N_SITES,
                                "profile": "quick"}, "cells": cells, "summary": rows}, f, indent=1)
    print(format_table(rows))
    return rows


#: wire settings whose message size ``message_sizes`` measures without a GPU
MESSAGE_SETTINGS = ("none", "float16", "adaquant")


def message_settings() -> tuple[str, ...]:
    """The settings :func:`message_sizes` can measure on this machine: FLARE 2.9's CUDA-only quantisers
    (``fedssl.flare.quantization.GPU_ONLY``) only where CUDA is present."""
    import torch

    from fedssl.flare.quantization import GPU_ONLY

    return MESSAGE_SETTINGS + (GPU_ONLY if torch.cuda.is_available() else ())


def relative_error(original: dict, restored: dict) -> float:
    """||restored - original|| / ||original|| over every float tensor of ``original`` taken as one vector (a tensor
    that is not a float travels as it is): e.g. ``{"w": [3, 4]}`` restored as ``[3, 4.5]`` -> 0.5 / 5 = 0.1."""
    num = den = 0.0
    for k, v in original.items():
        a = np.asarray(v)
        if a.dtype.kind != "f":
            continue
        b = np.asarray(restored[k].detach().cpu().float() if hasattr(restored[k], "detach") else restored[k],
                       dtype=np.float64)
        num += float(np.sum((b - a.astype(np.float64)) ** 2))
        den += float(np.sum(a.astype(np.float64) ** 2))
    return math.sqrt(num / den) if den > 0 else 0.0


def message_sizes(job: str, profile: str | None = "paper", settings=MESSAGE_SETTINGS) -> dict:
    """Serialised bytes of the job's model as a FLARE weights message (its server ``model`` component, at the
    profile's size), as sent (``none``) and through the wire quantiser of each setting, and the relative error
    (:func:`relative_error`) of the weights after the receiving side's dequantiser: no training, no data.

    The message is the full model state; a job that exchanges part of it (e.g. FedDRA's stage 1) sends less, and
    the ratio between settings is what this measures.  The per-tensor quantisation meta is counted too, which is
    why float16 saves a little less than 2x on small models.  blockwise8 / float4 / normfloat4 are measured only
    where CUDA is present (FLARE 2.9 runs them there alone)."""
    import importlib

    from nvflare.apis.dxo import DXO, DataKind, from_shareable
    from nvflare.apis.fl_context import FLContext

    from fedssl.flare.communication_meter import register_decomposers
    from fedssl.flare.quantization import GPU_ONLY, Dequantizer, Quantizer
    from fedssl.ops.jobs import configured_job

    allowed = message_settings()
    unknown = [s for s in settings if s not in allowed]
    if unknown:
        why = " (the others need a GPU)" if set(unknown) <= set(GPU_ONLY) else ""
        raise ValueError(f"settings {unknown}: use {list(allowed)}{why}")
    register_decomposers()
    job_dir = job if os.path.isdir(job) else os.path.join(JOBS, job)
    files = configured_job(job_dir, profile=profile)
    server = next(v for k, v in files.items() if k.endswith("config_fed_server.json"))
    comp = next((c for c in server.get("components", []) if c.get("id") == "model"), None)
    if comp is None:
        raise ValueError(f"{os.path.basename(job_dir)}: no server component with id 'model' to size")
    module, cls = comp["path"].rsplit(".", 1)
    model = getattr(importlib.import_module(module), cls)(**comp.get("args", {}))
    state = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
    sizes, errors = {}, {}
    for setting in settings:
        dxo = DXO(DataKind.WEIGHTS, data=dict(state), meta={"num_samples": 1})
        if setting != "none":
            dxo = Quantizer(setting).process_dxo(dxo, dxo.to_shareable(), FLContext())
        sent = dxo.to_shareable()
        sizes[setting] = len(sent.to_bytes())
        if setting != "none":
            restored = from_shareable(Dequantizer(setting).process(sent, FLContext())).data
            errors[setting] = relative_error(state, restored)
    return {"job": os.path.basename(job_dir), "profile": profile,
            "parameters": int(sum(v.size for v in state.values())), "tensors": len(state), "bytes": sizes,
            "relative_error": errors}


def format_message_sizes(rows: list[dict]) -> str:
    settings = list(rows[0]["bytes"]) if rows else []
    lines = ["| job | profile | parameters | tensors | " + " | ".join(f"{s} MB (x fewer, error)" if s != "none" else
                                                                      f"{s} MB" for s in settings) + " |",
             "|---|---|---|---|" + "---|" * len(settings)]
    for r in rows:
        base = r["bytes"].get("none") or next(iter(r["bytes"].values()))
        err = r["relative_error"]
        cells = [f"{b / 2**20:.3f} ({base / b:.3f}x" + (f", error {err[k]:.1e})" if k in err else ")")
                 for k, b in r["bytes"].items()]
        lines.append(f"| {r['job']} | {r['profile']} | {r['parameters'] / 1e6:.2f} M | {r['tensors']} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)
