"""The README's demo: synthetic ACDC -> FCL pre-training in the FLARE simulator -> fine-tuning -> Dice table.

Runs on a CPU on the calibrated synthetic data (:mod:`fedssl.data.acdc_synthetic`): FCL (feature exchange, negative
sampling, structural matching) is pre-trained across ``n_sites`` simulated sites with the bench profile's pre-training
(full local epochs over every cine frame: 25 steps per round and site, 1,024-entry bank) for ``rounds`` rounds;
then both the FCL encoder and a random init are fine-tuned locally on each site with N annotated patients and
federatedly (a FLARE job), and evaluated with the paper's protocol (fold 0; pooled validation for local, per-site
validation for federated). Everything lands in ``out``: data, simulator workspaces, ``run_config.json`` (the settings,
the torch thread count of this process, ``threads``, and the environment: versions, CPU, BLAS), ``report/summary.json``,
``dice_table.txt`` and ``dice_vs_n.png``.  The demo runs one training seed: its comparison is not a finding
(``fedssl fcl tables`` runs seeds 0-2), and its table says so.
"""

from __future__ import annotations

import json
import os
import time

from fedssl.data.acdc_synthetic import write_synthetic_acdc
from fedssl.eval.report import format_table, pretraining_verdict, summarise, write_report
from fedssl.experiments.fcl_finetune import (
    encoder_init,
    evaluate_federated,
    export_unet_init,
    load_labelled_sites,
    protocol_settings,
    run_protocols,
)
from fedssl.experiments.environment import DEFAULT_THREADS, set_threads
from fedssl.experiments.table_runner import few_seeds_note, write_run_config
from fedssl.ops.jobs import REPO_ROOT
from fedssl.ops.simulate import run_simulation

JOBS = os.path.join(REPO_ROOT, "jobs")


def _say(t0: float, msg: str) -> None:
    print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)


#: what the demo's one-seed comparison is not, and how to get one that is
SEEDS_NOTE = few_seeds_note({"FCL": [0], "random": [0]}, rerun="fedssl fcl tables --seeds 0 1 2")


def run_demo(out: str, *, n_sites: int = 3, rounds: int = 10, ft_rounds: int = 10, n_labelled=(1, 2),
             epochs: int | None = None, fold: int = 0, threads: int = DEFAULT_THREADS) -> dict:
    """``threads``: torch threads of this process (the local fine-tuning runs here), recorded in
    ``out/run_config.json`` with the environment."""
    t0 = time.time()
    out = os.path.abspath(out)
    set_threads(threads)
    write_run_config(out, {"demo": "fcl", "n_sites": n_sites, "rounds": rounds, "ft_rounds": ft_rounds,
                           "n_labelled": list(n_labelled), "epochs": epochs, "fold": fold, "seeds": [0]},
                     threads=threads)
    data = os.path.join(out, "data", "acdc")
    if not os.path.isdir(data):
        _say(t0, f"writing synthetic ACDC: {n_sites} sites x 10 patients -> {data}")
        write_synthetic_acdc(data, n_patients=10 * n_sites, n_sites=n_sites, seed=0)
    data_root = os.path.join(data, "{site}")

    _say(t0, f"FCL pre-training in the FLARE simulator ({n_sites} sites, {rounds} rounds of full local epochs, bench "
             "profile)")
    pre = run_simulation(os.path.join(JOBS, "fcl_acdc"), os.path.join(out, "ws_fcl"), n_sites=n_sites,
                         data_root=data_root, profile="bench", sets=[f"server.scatter_and_gather.num_rounds={rounds}"])
    _say(t0, f"pre-training done in {pre['simulator_wall_time_s']} s")

    settings = protocol_settings("quick", epochs)
    sites = load_labelled_sites(data, settings)
    inits = {"FCL": encoder_init(pre["global_model"]), "random": "random"}
    _say(t0, f"local fine-tuning: N={list(n_labelled)}, fold {fold}, {settings['epochs']} epochs per site"
              + (f", at least {settings['min_steps']} optimiser steps" if settings["min_steps"] else ""))
    rows = run_protocols(sites, inits, modes=["local"], n_labelled=n_labelled, folds=[fold], settings=settings,
                         progress=lambda r: _say(t0, f"  local {r['method']:<6} N={r['n_labelled']} {r['site']}: Dice "
                                                     f"{r['dice']:.3f}"))

    fed_runs = {}
    for method in inits:
        for n in n_labelled:
            sets = [f"server.scatter_and_gather.num_rounds={ft_rounds}", f"client.seg_trainer.n_labelled={n}",
                    f"client.seg_trainer.fold={fold}"]
            if method != "random":
                init_path = export_unet_init(pre["global_model"], os.path.join(out, "unet_init_fcl.pt"),
                                             settings["features"])
                sets.append(f"server.persistor.source_ckpt_file_full_name={init_path}")
            _say(t0, f"federated fine-tuning in the FLARE simulator: {method}, N={n}, {ft_rounds} rounds")
            ft = run_simulation(os.path.join(JOBS, "fcl_acdc_finetune"), os.path.join(out, f"ws_ft_{method}_n{n}"),
                                n_sites=n_sites, data_root=data_root, profile="quick", sets=sets, echo=False)
            rows += evaluate_federated(ft["global_model"], sites, method=method, n_labelled=n, fold=fold,
                                       settings=settings)
            fed_runs[f"{method}_n{n}"] = {"wall_time_s": ft["simulator_wall_time_s"],
                                          "bytes_per_site_per_round": ft["bytes_per_site_per_round"]}

    extra = {
        "settings": settings,
        "pretraining": {"rounds": rounds, "wall_time_s": pre["simulator_wall_time_s"],
                        "bytes_per_site_per_round": pre["bytes_per_site_per_round"],
                        "final_mean_loss": pre["rounds"][-1]["mean_loss"] if pre["rounds"] else None,
                        "site_record_means_last_round": pre["rounds"][-1].get("site_record_means") if pre["rounds"]
                        else None},
        "federated_finetuning": fed_runs,
        "demo_wall_time_s": round(time.time() - t0, 1),
    }
    extra["verdict"] = pretraining_verdict(rows, "FCL")
    extra["seeds_note"] = SEEDS_NOTE
    paths = write_report(rows, os.path.join(out, "report"),
                         title="FCL on synthetic ACDC (bench pre-training, quick fine-tuning)", extra=extra)
    with open(paths["dice_table"], "a") as f:
        f.write(f"\n\n{SEEDS_NOTE}\n")
    b = pre["bytes_per_site_per_round"]
    print()
    print(format_table(summarise(rows)))
    print(extra["verdict"])
    print(SEEDS_NOTE)
    print(f"\nFCL pre-training bytes per site per round: upload {b['upload'] / 1e6:.3f} MB, download "
          f"{b['download'] / 1e6:.3f} MB")
    print(f"report: {json.dumps(paths)}")
    _say(t0, "demo finished")
    return extra
