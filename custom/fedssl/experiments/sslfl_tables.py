"""SSL-FL's retina table (Yan et al., IEEE TMI 2023, Table II) on synthetic retina: Split-1/2/3 x ViT scratch,
Fed-MAE, Fed-BEiT, federated fine-tuning test accuracy, next to the paper's numbers (issue 14 item 2).

One synthetic Kaggle-DR stand-in per seed (:func:`fedssl.data.image_synthetic.write_synthetic_images` at the
calibrated difficulty), balanced as SSL-FL does (sec. IV-A: "randomly selecting 9,000 balanced images"), one
held-out test set (the same for every split: the test split depends on the seed only) and per split one
Dirichlet partition of the rest over 5 sites (sec. IV-B1: alpha 100 / 1.0 / 0.5 = Split-1 / 2 / 3). Then, in the
FLARE simulator at the profile's settings (``bench`` by default):

* pre-training cells: one Fed-MAE (jobs/sslfl_mae_retina) and one Fed-BEiT (jobs/sslfl_beit_retina) run per
  split and seed, on that split's sites;
* fine-tuning cells: jobs/sslfl_retina_finetune per method, split and seed, from the split's pre-trained global
  model (Fed-BEiT with BEiT's layer scale 0.1) or from random initialisation (ViT scratch); the test accuracy is
  that of the global model selected on the sites' validation splits (FinalEvaluation's ``test_metrics.json``).
  ViT scratch fine-tunes for ``scratch_rounds_ratio`` times the pre-trained rows' rounds (:func:`finetune_rounds`;
  SSL-FL sec. IV-C: 1,000 rounds from random initialisation, 100 for the others), stated under the table.

* diagnostics cells (issue 14 item 4): per pre-training, the loss per round, the spread of the encoder's mean-pooled
  patch tokens against a random ViT's and a linear probe of both on each site's labelled images
  (:func:`fedssl.experiments.diagnostics.diagnose_vit`, with the fine-tuning job's ViT at the profile's settings),
  printed under the table with one verdict line per pre-trained method and split against ViT scratch
  (:func:`fedssl.eval.report.accuracy_verdict`: the difference against twice its binomial standard error on the
  shared test set).

Cells run through :mod:`fedssl.experiments.table_runner` (``cells.jsonl`` in the output folder: an interrupted run
resumes at the first unfinished cell; progress lines with ETA) and the table is written as JSON / CSV / TXT / PNG
with the paper's Table II beside it (labelled as the paper's).  Every number is read back from a run's files.

Seeds: every cell runs once per seed (data, partition and jobs), seeds 0, 1 and 2 unless told otherwise (the bench
profile's ``tables.sslfl.seeds``); a row of fewer than three seeds is marked under the table as not a finding.  The
diagnostics compute in this process with ``threads`` torch threads, recorded in ``run_config.json`` with the
environment.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Callable, Optional

from fedssl.core.checks import require, require_int
from fedssl.data.images import load_image_records
from fedssl.data.site_config import site_folders
from fedssl.eval.paper_tables import SSLFL_SOURCE, sslfl_paper_rows
from fedssl.eval.report import accuracy_verdict, paired_against
from fedssl.experiments.diagnostics import (
    diagnose_vit,
    failed_mark,
    failed_verdict,
    failure_footer,
    failure_record,
    format_diagnostics,
    job_health_settings,
    pretraining_health,
    reconstruction_reference,
)
from fedssl.experiments.sslfl_control import component_args
from fedssl.experiments.sslfl_demo import VARIANTS, balance_retina
from fedssl.experiments.environment import DEFAULT_THREADS
from fedssl.experiments.table_runner import (
    CellStore,
    begin_run,
    few_seeds_note,
    plain_json,
    read_run_config,
    run_cells,
    write_table,
)
from fedssl.ops.jobs import REPO_ROOT, component_specs, configured_job, load_profile
from fedssl.ops.simulate import run_simulation

#: SSL-FL sec. IV-B1: Dirichlet alpha of Split-1 (IID), Split-2 (moderate) and Split-3 (severe non-IID)
SPLIT_ALPHA = {1: 100.0, 2: 1.0, 3: 0.5}
#: methods of the table: label, pre-training job (None: random init) and the fine-tuning overrides of the method
METHODS = {
    "scratch": {"label": "ViT scratch", "pretrain": None, "finetune_sets": []},
    "fedmae": {"label": "Fed-MAE", "pretrain": VARIANTS["fedmae"]["pretrain"],
               "finetune_sets": VARIANTS["fedmae"]["finetune_sets"]},
    "fedbeit": {"label": "Fed-BEiT", "pretrain": VARIANTS["fedbeit"]["pretrain"],
                "finetune_sets": VARIANTS["fedbeit"]["finetune_sets"]},
}
FINETUNE_JOB = "sslfl_retina_finetune"
#: settings that only pick cells (each cell's key holds them): a re-run may add splits, methods or seeds to a folder
SELECTORS = ("splits", "methods", "seeds")
#: method -> its row label in :data:`fedssl.eval.paper_tables.SSLFL_METHODS` (SSL-FL Table II)
PAPER_LABELS = {"scratch": "scratch", "fedmae": "Fed-MAE", "fedbeit": "Fed-BEiT"}
PAPER_SOURCE = SSLFL_SOURCE.format(table="II") + " (ViT-B, 9,000 Kaggle DR images)"
#: ViT scratch's fine-tuning rounds as a multiple of the pre-trained rows' (issue 47).  SSL-FL sec. IV-C: "The
#: federated fine-tuning process is run for 1000 communication rounds for models trained from random initialization,
#: and 100 rounds for the others" (Table IV's T column: 1000 vs 100).  rui-yan/SSL-FL (commit 69c3388):
#: code/fed_beit/script/retina/retina_split1_scratch.sh line 18 FT_EPOCHS=1000 against retina_split1_imnet.sh line
#: 20 / retina_split1_ssl.sh line 48 FT_EPOCHS=100, passed as --max_communication_rounds; the rest of the scratch
#: script's fine-tuning is the ImageNet one's (lr 3e-3, batch 64, --warmup_epochs 5, E_epoch 1).  Only the rounds
#: scale: the cosine decay spans every round (code/util/misc.py cosine_scheduler; here the trainer's schedule
#: length is the workflow's num_rounds), the warm-up stays 5 rounds.
PAPER_SCRATCH_ROUNDS_RATIO = 10
#: the table's settings when the profile's "tables": {"sslfl": {...}} leaves them out (the demo's data size);
#: ``pretrain_rounds`` / ``finetune_rounds`` None = the profile's job settings; ``scratch_rounds_ratio``: see
#: :data:`PAPER_SCRATCH_ROUNDS_RATIO` (every profile's, the paper's and bench's included, unless one sets it)
#: test_fraction: SSL-FL sec. IV-A holds out 3,000 of 12,000 retina images
DEFAULTS = {"n_images": 2800, "image_px": 40, "difficulty": None, "n_sites": 5, "test_fraction": 0.25,
            "min_per_site": 10, "splits": [1, 2, 3], "methods": ["scratch", "fedmae", "fedbeit"], "seeds": [0, 1, 2],
            "pretrain_rounds": None, "finetune_rounds": None, "scratch_rounds_ratio": PAPER_SCRATCH_ROUNDS_RATIO}


def table_settings(profile: str = "bench", **overrides) -> dict:
    """The table's settings: :data:`DEFAULTS` < the profile's ``"tables": {"sslfl": {...}}`` < ``overrides``
    (None values are ignored); each checked, naming the setting and the fix."""
    from_profile = load_profile(profile).get("tables", {}).get("sslfl", {}) if profile else {}
    unknown = sorted(set(from_profile) - set(DEFAULTS))
    require(not unknown, f"profile {profile!r} tables.sslfl", "keys", unknown, f"use keys of {sorted(DEFAULTS)}")
    s = {**DEFAULTS, **from_profile, **{k: v for k, v in overrides.items() if v is not None}, "profile": profile}
    for name, allowed in (("splits", SPLIT_ALPHA), ("methods", METHODS)):
        vals = list(s[name])
        require(bool(vals) and all(v in allowed for v in vals) and len(set(vals)) == len(vals), "sslfl tables", name,
                vals, f"use distinct values from {list(allowed)}")
        s[name] = vals
    seeds = list(s["seeds"])
    require(bool(seeds) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in seeds)
            and len(set(seeds)) == len(seeds), "sslfl tables", "seeds", seeds,
            "use distinct integers >= 0, e.g. [0, 1]")
    s["seeds"] = seeds
    for name in ("n_images", "image_px", "n_sites", "min_per_site"):
        require_int("sslfl tables", name, s[name], 0 if name == "min_per_site" else 1, "use a positive integer")
    for name in ("pretrain_rounds", "finetune_rounds"):
        if s[name] is not None:
            require_int("sslfl tables", name, s[name], 1, "use a positive integer, or null for the profile's rounds")
    require_int("sslfl tables", "scratch_rounds_ratio", s["scratch_rounds_ratio"], 1,
                f"use a positive integer: ViT scratch's fine-tuning rounds over the pre-trained rows' (paper "
                f"{PAPER_SCRATCH_ROUNDS_RATIO}: 1,000 vs 100; 1 = the same rounds)")
    return s


def finetune_rounds(settings: dict, method: str) -> int:
    """The fine-tuning rounds of ``method``'s cells: the table's ``finetune_rounds`` (None: the fine-tuning job's
    ``scatter_and_gather.num_rounds`` at the table's profile), times ``scratch_rounds_ratio`` for ViT scratch (the
    method without pre-training)."""
    rounds = settings["finetune_rounds"]
    if rounds is None:
        files = configured_job(os.path.join(REPO_ROOT, "jobs", FINETUNE_JOB), settings["profile"], [])
        workflow = next(c for c in component_specs(files["app/config/config_fed_server.json"])
                        if c["id"] == "scatter_and_gather")
        rounds = int(workflow["args"]["num_rounds"])
    return rounds * (1 if METHODS[method]["pretrain"] else settings["scratch_rounds_ratio"])


def rounds_line(settings: dict) -> str:
    """The line under the table that gives ViT scratch's fine-tuning rounds next to the pre-trained rows'."""
    ratio = settings["scratch_rounds_ratio"]
    pre = [m for m in METHODS if METHODS[m]["pretrain"]]
    return (f"fine-tuning rounds: {METHODS['scratch']['label']} {finetune_rounds(settings, 'scratch')}, "
            f"{' / '.join(METHODS[m]['label'] for m in pre)} {finetune_rounds(settings, pre[0])} (scratch_rounds_ratio "
            f"{ratio}; SSL-FL sec. IV-C: 1,000 from random initialisation vs 100, ratio {PAPER_SCRATCH_ROUNDS_RATIO})")


def pretrain_cells(settings: dict) -> list[dict]:
    """One pre-training cell per seed, split and pre-trained method, in that order."""
    return [{"stage": "pretrain", "method": m, "split": sp, "seed": sd} for sd in settings["seeds"]
            for sp in settings["splits"] for m in settings["methods"] if METHODS[m]["pretrain"]]


def finetune_cells(settings: dict) -> list[dict]:
    """One fine-tuning cell per seed, split and method, in that order."""
    return [{"stage": "finetune", "method": m, "split": sp, "seed": sd} for sd in settings["seeds"]
            for sp in settings["splits"] for m in settings["methods"]]


def prepare_data(out: str, settings: dict, seed: int, say: Callable[[str], None] = print) -> dict[int, str]:
    """Write the seed's synthetic retina (balanced subset) once and its partition for every split (the same
    held-out test set: it depends on the seed only); returns {split: partition folder}. Re-runs reuse them."""
    from fedssl.data.image_sites import write_site_folders
    from fedssl.data.image_synthetic import write_synthetic_images

    root = os.path.join(out, "data", f"seed{seed}")
    src = os.path.join(root, "retina_full")
    done = os.path.join(root, "balanced.json")
    if not os.path.isfile(done):
        say(f"writing {settings['n_images']} synthetic retina images ({settings['image_px']} px, difficulty "
            f"{settings['difficulty'] if settings['difficulty'] is not None else 'default'}, seed {seed}) -> {src}")
        info = write_synthetic_images(src, "retina", settings["n_images"], seed=seed, image_size=settings["image_px"],
                                      difficulty=settings["difficulty"])
        kept = balance_retina(src, seed)
        with open(done, "w") as f:
            json.dump({"difficulty": info["difficulty"], **kept}, f)
    parts = {}
    for split in settings["splits"]:
        parts[split] = os.path.join(root, f"split{split}")
        write_site_folders(src, "retina", parts[split], n_sites=settings["n_sites"], alpha=SPLIT_ALPHA[split],
                           seed=seed, test_fraction=settings["test_fraction"], min_per_site=settings["min_per_site"])
    return parts


def _seed_sets(stage: str, method: str, seed: int) -> list[str]:
    """The job-seed overrides (model initialisation, trainer and, for Fed-BEiT, the tokenizer's k-means)."""
    trainer = "cls_trainer" if stage == "finetune" else "mim_trainer"
    sets = [f"server.model.seed={seed}", f"client.{trainer}.seed={seed}"]
    return sets + ([f"server.federated_kmeans.seed={seed}"] if stage == "pretrain" and method == "fedbeit" else [])


def _workspace(out: str, key: dict) -> str:
    return os.path.join(out, "runs", f"{key['stage']}_{key['method']}_split{key['split']}_seed{key['seed']}")


def run_cell(key: dict, out: str, settings: dict, parts: dict, store: CellStore, simulate=run_simulation) -> dict:
    """Run one cell in the simulator and return what the table needs, read back from the run's files."""
    stage, method, seed = key["stage"], key["method"], key["seed"]
    n = settings["n_sites"]
    common = dict(n_sites=n, data_root=os.path.join(parts[(seed, key["split"])], "{site}"),
                  profile=settings["profile"], echo=False)
    rounds = [f"server.scatter_and_gather.min_clients={n}"]
    if stage == "finetune" and not METHODS[method]["pretrain"]:
        # ViT scratch: scratch_rounds_ratio x the pre-trained rows' rounds; the sites' lr schedule (warm-up, then
        # cosine to the last round) takes its length from the workflow's num_rounds, the warm-up rounds stay
        rounds.append(f"server.scatter_and_gather.num_rounds={finetune_rounds(settings, method)}")
    elif settings[f"{stage}_rounds"] is not None:
        rounds.append(f"server.scatter_and_gather.num_rounds={settings[f'{stage}_rounds']}")
    if stage == "pretrain":
        run = simulate(os.path.join(REPO_ROOT, "jobs", METHODS[method]["pretrain"]), _workspace(out, key),
                       sets=[*rounds, *_seed_sets(stage, method, seed)], **common)
        return {"global_model": run["global_model"], "wall_time_s": run["simulator_wall_time_s"],
                "loss": [r.get("mean_loss") for r in run.get("rounds", [])]}
    init = ""
    if METHODS[method]["pretrain"]:
        init = store.get({"stage": "pretrain", "method": method, "split": key["split"], "seed": seed})["global_model"]
        require(os.path.isfile(init), f"{method} fine-tuning (split {key['split']}, seed {seed})", "pretrained_path",
                init, f"the pre-trained global model is gone; remove its pretrain line from {store.path} to re-run it")
    run = simulate(os.path.join(REPO_ROOT, "jobs", FINETUNE_JOB), _workspace(out, key),
                   sets=[*rounds, *_seed_sets(stage, method, seed), f"server.model.pretrained_path={init}",
                         *METHODS[method]["finetune_sets"]], **common)
    path = os.path.join(run["workspace"], "server", "simulate_job", "test_metrics.json")
    with open(path) as f:
        report = json.load(f)
    mean = report["mean"]
    return {"accuracy": mean.get("accuracy"), "auc": mean.get("auc"),
            "balanced_accuracy": mean.get("balanced_accuracy"),
            "n_test": mean.get("n"), "model": report.get("model"), "init": init or "random",
            "wall_time_s": run["simulator_wall_time_s"], "test_metrics": path}


#: the fine-tuning trainer's arguments the diagnostics' ViT and probe take over
VIT_KEYS = ("dataset", "image_size", "patch_size", "embed_dim", "depth", "num_heads", "layer_scale", "val_fraction",
            "seed", "device")


def vit_settings(settings: dict, method: str, seed: int = 0) -> dict:
    """The ViT of ``method``'s fine-tuning (``jobs/sslfl_retina_finetune`` at the table's profile, with the method's
    overrides, e.g. Fed-BEiT's layer scale) as :func:`~fedssl.experiments.diagnostics.diagnose_vit` takes it, plus
    the trainer's ``label_fraction``."""
    files = configured_job(os.path.join(REPO_ROOT, "jobs", FINETUNE_JOB), settings["profile"],
                           [*METHODS[method]["finetune_sets"], *_seed_sets("finetune", method, seed)])
    trainer = next(c for c in component_specs(files["app/config/config_fed_client.json"]) if c["id"] == "cls_trainer")
    return {**{k: trainer["args"][k] for k in VIT_KEYS}, "label_fraction": trainer["args"]["label_fraction"],
            "rel_pos_bias": trainer["args"].get("rel_pos_bias", "none")}


def diagnostics_cells(settings: dict) -> list[dict]:
    """One diagnostics cell per pre-training cell."""
    return [{**k, "stage": "diagnostics"} for k in pretrain_cells(settings)]


def diagnose_cell(key: dict, out: str, settings: dict, parts: dict, store: CellStore) -> dict:
    """:func:`~fedssl.experiments.diagnostics.diagnose_vit` of one pre-training: its rounds (the run's summary.json),
    the global model's spread and linear probe on every site of the split, against a random ViT's."""
    method, split, seed = key["method"], key["split"], key["seed"]
    pre_key = {"stage": "pretrain", "method": method, "split": split, "seed": seed}
    model = store.get(pre_key)["global_model"]
    summary = os.path.join(_workspace(out, pre_key), "server", "simulate_job", "summary.json")
    root = parts[(seed, split)]
    records = {site: load_image_records(path, "retina", site=site) for site, path in site_folders(root).items()}
    vit = vit_settings(settings, method, seed)
    label_fraction = vit.pop("label_fraction")
    d = diagnose_vit(f"{METHODS[method]['label']} (Split-{split}, seed {seed})",
                     summary if os.path.isfile(summary) else None, model, records, vit, label_fraction=label_fraction)
    masking = reconstruction_settings(settings, method, seed)
    if masking is not None:
        d["reconstruction"] = reconstruction_reference(records, **masking)
    return plain_json(d)


def reconstruction_settings(settings: dict, method: str, seed: int) -> dict | None:
    """The pre-training's views and masking as :func:`~fedssl.experiments.diagnostics.reconstruction_reference`
    takes them (``method``'s pre-training job's ``mim_trainer`` at the table's profile and ``seed``); None for a
    method that does not rebuild pixels (ViT scratch, Fed-BEiT)."""
    if not METHODS[method]["pretrain"]:
        return None
    args = component_args(METHODS[method]["pretrain"], settings["profile"], "mim_trainer",
                          _seed_sets("pretrain", method, seed))
    if args.get("method") != "mae":
        return None
    return {"dataset": args["dataset"], "image_size": args["image_size"], "patch_size": args["patch_size"],
            "mask_ratio": args["mask_ratio"], "norm_pix": bool(args["norm_pix_loss"]), "seed": seed}


def loss_health_settings(method: str, settings: dict) -> dict:
    """The loss-health settings of ``method``'s pre-training (:func:`fedssl.experiments.diagnostics.health_settings`
    of its job's ``mim_trainer`` at the table's profile: Fed-MAE (d-1)/d with d = patch_size^2 x 3 on norm-pix
    targets, Fed-BEiT ln(vocab_size); D = embed_dim)."""
    job = os.path.join(REPO_ROOT, "jobs", METHODS[method]["pretrain"])
    return job_health_settings(job, settings["profile"], [], "mim_trainer")


def diagnostics_health(settings: dict, keys: list[dict], diags: list[dict]) -> dict:
    """(method, split, seed) -> the loss health of that pre-training (its diagnostics' rounds)."""
    kw = {m: loss_health_settings(m, settings) for m in {k["method"] for k in keys}}
    return {(k["method"], k["split"], k["seed"]): pretraining_health(d.get("rounds") or [], **kw[k["method"]])
            for k, d in zip(keys, diags)}


def _unit_health(health: dict, method: str, splits, seeds) -> dict[str, dict]:
    """``{"Split-<s> seed <d>": health}`` of ``method``'s pre-trainings at ``splits`` x ``seeds`` (those diagnosed)."""
    return {f"Split-{sp} seed {sd}": health[(method, sp, sd)] for sp in splits for sd in seeds
            if (method, sp, sd) in health}


def mark_rows(settings: dict, rows: list[dict], health: dict) -> list[dict]:
    """Each row with its failure record (its split's seeds; :func:`~fedssl.experiments.diagnostics.failure_record`)
    and, on every row of a method with a failed pre-training, the method's ``mark`` naming where it failed."""
    keys = {METHODS[m]["label"]: m for m in settings["methods"]}
    out = []
    for r in rows:
        m, split = keys[r["method"]], int(r["column"].removeprefix("Split"))
        every = _unit_health(health, m, settings["splits"], settings["seeds"])
        mark = failed_mark(failure_record(every)["pretraining_failed_at"], list(every))
        per = {f"seed {sd}": health[(m, split, int(sd))] for sd in r["by_seed"] if (m, split, int(sd)) in health}
        out.append({**r, **failure_record(per), **({"mark": mark} if mark else {})})
    return out


def table_verdicts(settings: dict, results: dict, health: dict | None = None) -> list[str]:
    """Per split and seed, one :func:`~fedssl.eval.report.accuracy_verdict` line per pre-trained method against ViT
    scratch on the same test set (none where scratch or the method has not run); where ``health`` ((method, split,
    seed) -> loss health) says that pre-training failed, the line says so instead of its conclusion."""
    lines, health = [], health or {}
    for seed in settings["seeds"]:
        for split in settings["splits"]:
            base = results.get(("scratch", split, seed))
            if base is None or base.get("accuracy") is None:
                continue
            for method in settings["methods"]:
                r = results.get((method, split, seed))
                if method == "scratch" or r is None or r.get("accuracy") is None or not r.get("n_test"):
                    continue
                label, unit = METHODS[method]["label"], [f"Split-{split} seed {seed}"]
                h = health.get((method, split, seed))
                line = f"Split-{split}, seed {seed}: " + accuracy_verdict(
                    label, r["accuracy"], METHODS["scratch"]["label"], base["accuracy"], int(r["n_test"]))
                lines.append(failed_verdict(line, label, unit if h and h["failed"] else [], unit))
    return lines + seed_verdicts(settings, results, health)


def seed_verdicts(settings: dict, results: dict, health: dict | None = None) -> list[str]:
    """Per split and pre-trained method run on two or more seeds beside ViT scratch: the difference in test accuracy
    (points), paired by seed, its mean and standard error over seeds (:func:`~fedssl.eval.report.paired_against`
    with the seed as the only unit), each seed's difference, and "ahead" / "behind" when the mean is beyond twice
    the standard error (else "within the spread").  Where a seed's pre-training failed (``health``), the line says
    so instead of its conclusion.  The run-to-run spread is in it, which the per-seed binomial lines lack."""
    rows, health = [], health or {}
    for (method, split, seed), r in results.items():
        if r and r.get("accuracy") is not None:
            rows.append({"mode": "table", "method": method, "split": split, "seed": seed,
                         "accuracy": 100.0 * float(r["accuracy"])})
    lines = []
    for p in paired_against(rows, "scratch", mode="table", units=(), column="split", score="accuracy"):
        if p["seeds"] < 2:
            continue
        label = METHODS[p["method"]]["label"]
        mean, se = p["diff_mean"], p["diff_se"]
        word = "ahead" if mean > 2 * se else "behind" if mean < -2 * se else "within the spread (no clear effect)"
        line = (f"Split-{p['split']}, {p['seeds']} seeds: {label} minus {METHODS['scratch']['label']} {mean:+.1f} "
                f"points (SE {se:.1f} over seeds; per seed "
                + " / ".join(f"{v:+.1f}" for v in p["by_seed"].values()) + f") -> {word}")
        failed = [f"Split-{p['split']} seed {sd}" for sd in p["by_seed"]
                  if (health.get((p["method"], p["split"], int(sd))) or {}).get("failed")]
        lines.append(failed_verdict(line, label, failed, [f"Split-{p['split']} seed {sd}" for sd in p["by_seed"]]))
    return lines


def _mean_std(values: list[float]) -> tuple[Optional[float], Optional[float]]:
    """Mean and sample std (None for a single value) of percentages."""
    if not values:
        return None, None
    m = sum(values) / len(values)
    if len(values) < 2:
        return m, None
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def summary_rows(settings: dict, results: dict) -> list[dict]:
    """Table rows (test accuracy %, mean +- std over seeds, n = seeds) from ``results`` {(method, split, seed):
    fine-tuning result}; a method / split with no finished seed has mean None."""
    rows = []
    for method in settings["methods"]:
        for split in settings["splits"]:
            accs = [100.0 * results[(method, split, sd)]["accuracy"] for sd in settings["seeds"]
                    if (method, split, sd) in results]
            mean, std = _mean_std(accs)
            rows.append({"table": "sslfl_retina", "method": METHODS[method]["label"], "column": f"Split{split}",
                         "mean": mean, "std": std, "n": len(accs),
                         "by_seed": {str(sd): 100.0 * results[(method, split, sd)]["accuracy"]
                                     for sd in settings["seeds"] if (method, split, sd) in results}})
    return rows


def paper_rows(settings: dict) -> list[dict]:
    """SSL-FL Table II's numbers (:func:`fedssl.eval.paper_tables.sslfl_paper_rows`) for the table's methods and
    splits, under the bundle's method labels (no std: the paper gives none)."""
    columns = {f"Split{sp}" for sp in settings["splits"]}
    return [{**r, "method": METHODS[m]["label"]} for m in settings["methods"]
            for r in sslfl_paper_rows("II", [PAPER_LABELS[m]]) if r["column"] in columns]


def seeds_note(settings: dict, results: dict) -> str | None:
    """The line under the table where a row (method, split) rests on fewer than three finished seeds."""
    covered = {f"{METHODS[m]['label']} Split{sp}": [sd for sd in settings["seeds"] if (m, sp, sd) in results]
               for m in settings["methods"] for sp in settings["splits"]}
    return few_seeds_note({k: v for k, v in covered.items() if v})


def check_scratch_ratio_recorded(out: str, settings: dict) -> None:
    """Refuse a folder whose ``run_config.json`` predates ``scratch_rounds_ratio`` (its ViT scratch cells were
    fine-tuned for the pre-trained rows' rounds, ratio 1) with one line; a recorded ratio other than this run's is
    refused by :func:`~fedssl.experiments.table_runner.begin_run`'s settings check like any setting."""
    fix = "use another --out"
    config = read_run_config(out, fix)
    if config is not None and "scratch_rounds_ratio" not in config:
        raise ValueError(f"{os.path.join(out, 'run_config.json')}: the cells in {out} were computed before "
                         "scratch_rounds_ratio was recorded, ViT scratch fine-tuned for the pre-trained rows' rounds "
                         f"(ratio 1; now {settings['scratch_rounds_ratio']}); {fix}")


def run_sslfl_table(out: str, settings: dict, say: Callable[[str], None] = print, simulate=run_simulation,
                    diagnose=diagnose_cell, threads: int = DEFAULT_THREADS) -> dict:
    """Run (or resume) the table's cells into ``out`` and write ``sslfl_retina_table.{json,csv,txt,png}`` (the
    diagnostics block appended to the text).  ``simulate`` / ``diagnose`` stand in for the simulator and
    :func:`diagnose_cell` in tests.  ``threads``: torch threads of this process (the diagnostics), a setting of
    the folder."""
    t0 = time.time()
    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    check_scratch_ratio_recorded(out, settings)
    begin_run(out, {k: v for k, v in settings.items() if k not in SELECTORS}, threads=threads, say=say)
    store = CellStore(os.path.join(out, "cells.jsonl"))
    parts = {}
    for seed in settings["seeds"]:
        for split, folder in prepare_data(out, settings, seed, say).items():
            parts[(seed, split)] = folder

    def cell(key: dict) -> dict:
        return run_cell(key, out, settings, parts, store, simulate)

    pre = pretrain_cells(settings)
    if pre:
        run_cells(pre, cell, store, say=say, label="SSL-FL retina pre-training", threads=threads)
    fine = finetune_cells(settings)
    done = run_cells(fine, cell, store, say=say, label="SSL-FL retina fine-tuning", threads=threads)
    results = {(k["method"], k["split"], k["seed"]): r for k, r in zip(fine, done)}
    diag_keys = diagnostics_cells(settings)
    diags = run_cells(diag_keys, lambda key: diagnose(key, out, settings, parts, store), store, say=say,
                      label="diagnostics (spread, linear probe)", threads=threads) if diag_keys else []
    health = diagnostics_health(settings, diag_keys, diags)
    diags = [dict(d, health=health[(k["method"], k["split"], k["seed"])]) for k, d in zip(diag_keys, diags)]
    rows = mark_rows(settings, summary_rows(settings, results), health)
    n_seeds = len(settings["seeds"])
    notes = [f"synthetic retina: {settings['n_images']} images written ({settings['image_px']} px), balanced subset, "
             f"{settings['n_sites']} sites, Dirichlet alpha "
             f"{', '.join(f'{SPLIT_ALPHA[s]:g}' for s in settings['splits'])}; profile {settings['profile']}; test "
             "accuracy (%) of the validation-selected global model, mean"
             + (f" +- std over n={n_seeds} seeds" if n_seeds > 1 else " of n=1 seed (no std)"),
             "numbers are not comparable with the paper's in absolute terms (tiny ViT, synthetic data); the paper's "
             "block is its Table II", *table_verdicts(settings, results, health)]
    extra = {"settings": settings, "finetune_rounds": {METHODS[m]["label"]: finetune_rounds(settings, m)
                                                       for m in settings["methods"]},
             "cells": [{"key": k, "result": r} for k, r in zip(fine, done)],
             "diagnostics": diags, "wall_time_s": round(time.time() - t0, 1)}
    few = seeds_note(settings, results)
    failed = failure_footer({METHODS[m]["label"]: _unit_health(health, m, settings["splits"], settings["seeds"])
                             for m in settings["methods"]})
    paths = write_table(out, "sslfl_retina_table", rows, title="SSL-FL retina table (Table II): test accuracy (%)",
                        paper=paper_rows(settings), paper_source=PAPER_SOURCE, score="accuracy (%)", notes=notes,
                        extra=extra, digits=2, footer=[rounds_line(settings), *failed, *([few] if few else [])])
    diag_text = format_diagnostics(diags) if diags else ""
    if diag_text:
        with open(paths["txt"], "a") as f:
            f.write("\n" + diag_text + "\n")
    with open(paths["txt"]) as f:
        say(f.read().rstrip())
    return {"rows": rows, "paths": paths, "diagnostics": diags, "wall_time_s": extra["wall_time_s"]}


def run_reconstruction_reference(out: str, settings: dict, say: Callable[[str], None] = print) -> dict:
    """:func:`~fedssl.experiments.diagnostics.reconstruction_reference` of Fed-MAE's pre-training on the table's own
    data (written under ``out`` as :func:`run_sslfl_table` writes it, or reused) for every split and seed of
    ``settings``: what predicting the mean and harmonic inpainting score on MAE's loss, without any training.
    Writes ``out/reconstruction_reference.json`` and returns it (``rows``: split, seed and the reference)."""
    rows = []
    for seed in settings["seeds"]:
        parts = prepare_data(out, settings, seed, say)
        masking = reconstruction_settings(settings, "fedmae", seed)
        for split in settings["splits"]:
            records = {site: load_image_records(path, "retina", site=site)
                       for site, path in site_folders(parts[split]).items()}
            ref = reconstruction_reference(records, **masking)
            rows.append({"split": split, "seed": seed, **ref})
            say(f"Split-{split} seed {seed}: MAE loss without learning ({ref['images']} images, {ref['patch_size']} px "
                f"patches, {ref['mask_ratio']:g} masked): predicting the mean {ref['predict_mean']:.4f}, harmonic "
                f"inpainting {ref['inpainting']:.4f}")
    result = {"profile": settings["profile"], "rows": rows}
    with open(os.path.join(out, "reconstruction_reference.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result
