"""The ablation tooling of surgical aggregation (Kulkarni et al., ML4H 2024, sec. 2.4.1 and 2.6).

- :func:`partition`: IID subsets of NIH (real, or a synthetic NIH-like source) for ``n_clients`` sites with
  ``n_shared`` classes held by every site (``fedssl.data.cxr.write_nih_partition``), and the job overrides that run
  ``jobs/surgical_cxr`` on them: each site's classes, the held-out NIH test set as the sites' external test set,
  FedBN+ ("We used FedBN+ for all FL approaches").  The paper's two ablations are these switches: the number of
  clients (K = 2 .. 10 at a fixed setting of shared classes) and the number of shared classes (K = 4).
- :func:`compare_runs`: the paired comparison of two methods from their ``results.json`` files
  (``fedssl.eval.paired``): one run each -> class-level pairs (the paper's real-world experiments), several runs
  each (one per seed / iteration, in the same order) -> run-level pairs of mean AUROC (the paper's ablation).
"""

from __future__ import annotations

import json
import os
from typing import Sequence

from fedssl.data.cxr import write_nih_partition
from fedssl.data.cxr_synthetic import write_synthetic_ablation
from fedssl.eval.paired import class_pairs, compare, seed_pairs

PARTITION_FILE = "partition.json"


def run_overrides(summary: dict, out: str) -> list[str]:
    """The ``--set`` overrides that run jobs/surgical_cxr on a partition written to ``out`` (pass ``n_sites`` =
    the number of sites to the simulator as well)."""
    return ["client.cxr_trainer.dataset=nih",
            "client.cxr_trainer.classes=" + json.dumps(summary["classes"]),
            f"client.cxr_trainer.external_test_root={os.path.join(os.path.abspath(out), 'nih_test')}",
            "server.class_registration.backbone=fedbn_plus"]


def partition(out: str, n_clients: int, n_shared: int, *, nih_root: str = "", synthetic_patients: int = 0,
              seed: int = 0, holdout: float = 0.2, image_size: int = 64) -> dict:
    """Write the ablation's site folders under ``out`` from the NIH folder ``nih_root`` or, with
    ``synthetic_patients``, from a synthetic NIH-like source (+ a MIMIC-like external set); write and return
    ``partition.json``: the summary, ``n_sites`` and the ``sets`` for ``fedssl simulate`` / ``run_simulation``."""
    if bool(nih_root) == bool(synthetic_patients):
        raise ValueError("give either nih_root (a real NIH ChestX-ray14 folder) or synthetic_patients (> 0)")
    out = os.path.abspath(out)
    if nih_root:
        summary = write_nih_partition(nih_root, out, n_clients, n_shared, seed=seed, holdout=holdout)
    else:
        summary = write_synthetic_ablation(out, n_clients, n_shared, n_patients=synthetic_patients, seed=seed,
                                           image_size=image_size, holdout=holdout)
    record = {"n_sites": n_clients, "n_shared": n_shared, "seed": seed, "holdout": holdout,
              "data_root": os.path.join(out, "{site}"), "sets": run_overrides(summary, out),
              "sites": summary["sites"], "held_out": summary["held_out"]}
    with open(os.path.join(out, PARTITION_FILE), "w") as f:
        json.dump(record, f, indent=2)
    return record


def _load(path: str) -> dict:
    path = os.path.join(path, "results.json") if os.path.isdir(path) else path
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable results.json ({e})") from None


def compare_runs(runs_a: Sequence[str], runs_b: Sequence[str], where: str = "test") -> dict:
    """Paired t-test and Wilcoxon signed-rank test of method A against method B (``results.json`` files or the run
    folders holding them): one run each -> per (site, class) AUROC pairs; several -> per-run mean AUROC pairs."""
    if not runs_a or not runs_b:
        raise ValueError("give at least one results.json per method")
    payloads_a, payloads_b = [_load(p) for p in runs_a], [_load(p) for p in runs_b]
    if len(runs_a) == len(runs_b) == 1:
        a, b, labels = class_pairs(payloads_a[0], payloads_b[0], where)
        unit = "class"
    else:
        a, b, labels = seed_pairs(payloads_a, payloads_b, where)
        unit = "run"
    return {"unit": unit, "where": where, "a": list(runs_a), "b": list(runs_b), **compare(a, b, labels)}
