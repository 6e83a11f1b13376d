"""The bundle's version of FCL (Wu et al., MedIA 2022) Tables 1-3, resumable, next to the paper's numbers.

Tables 1 (local), 2 (federated) and 3 (centralised fine-tuning) of FCL section 5: Dice (mean of LV, MYO, RV) of a
U-Net whose encoder comes from each pre-training method, fine-tuned with N = 1, 2, 4, 8 annotated patients
(per site in Tables 1-2, in total in Table 3), 5-fold cross-validation; mean +- std over sites (each site's Dice
averaged over folds first, Table 1 caption) for Tables 1-2, over folds for Table 3
(:func:`fedssl.eval.report.summarise`).

Cells (one :class:`~fedssl.experiments.table_runner.CellStore` at ``out/cells.jsonl``; an interrupted run
resumes where it stopped):

- pre-training, one FLARE simulator run per pre-trained method: the overrides of :data:`fedssl.experiments.table7.ROWS`
  (FedMoCo, FCL, FedBYOL, FCLOpt, FCLOpt-PTNU, FCLOpt-PTNU-DP), Local CL (:data:`LOCAL_CL`: FCL with
  ``federated=false``, nothing exchanged or aggregated) and the baselines FedRotation and FedSimCLR
  (:data:`BASELINES`: ``jobs/fcl_acdc`` with another ``objective``, FedAvg of the encoder and head, no feature
  exchanged).  "random" is not pre-trained.
- Table 1: one cell per (method, N, fold, site), the site fine-tuning alone (``local_finetune`` for that site).
  Local CL fine-tunes each site from that site's own encoder (``<workspace>/site-k/<run>/fcl_client_state.pt``).
- Table 2: one cell per (method, N, fold): federated fine-tuning (``jobs/fcl_acdc_finetune`` in the simulator, as
  :mod:`fedssl.experiments.fcl_demo`), the global model evaluated on each site's validation patients.
- Table 3: one cell per (method, N, fold): ``centralised_finetune`` (N patients in total from the pooled sites).

Local CL has no shared model; for Tables 2 and 3 it starts from **site-1's own encoder** (:data:`LOCAL_CL_SHARED`):
as if one site had pre-trained alone and shared its encoder.  Averaging the sites' encoders would be one FedAvg
round the baseline does not have, so it is not done; the choice is printed under each table.

Seeds (``seeds``, default [0, 1, 2]): every cell is run once per training seed -- the pre-training (the initial model
and the sites' sampling, augmentations and bank draws) and the fine-tuning (the decoder's initial weights, batch order
and augmentations) -- while the labelled patients of a (fold, N, site) stay the same for every seed.  A method's
seed-s fine-tuning starts from its seed-s pre-training, and is paired with random init's seed-s run.  Tables
average each site's (Table 3: each fold's) Dice over folds and seeds; the paired differences also give the mean per
seed and the standard error over seeds, which holds the run-to-run spread that folds and sites do not.  Seed 0's
cells carry no ``seed`` field, so a folder written before seeds existed resumes as seed 0.  A table whose rows
rest on fewer than three seeds says so under it (:func:`~fedssl.experiments.table_runner.few_seeds_note`): one
seed's sign is not a finding (FCL minus random at N = 1 was -0.058 / -0.042 / +0.029 over seeds 0-2).

The split of a (fold, N, site) is the same for every method (:func:`fedssl.train.protocol.site_fold`,
``site_labelled``: seeded by split seed, fold and site name only).  Fine-tuning cells may run in worker processes
(``workers``); every process computing cells uses ``threads`` torch threads (default one), recorded in
``run_config.json`` with the environment (:func:`~fedssl.experiments.table_runner.begin_run`); simulator cells run
one at a time in this process.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import time
from collections.abc import Sequence

from fedssl.data.acdc_synthetic import write_synthetic_acdc
from fedssl.eval.paper_tables import FCL_METHODS, FCL_SOURCE, FCL_TABLE_MODES, fcl_paper_rows
from fedssl.eval.report import PAIR_UNITS, format_paired, paired_against, pretraining_verdict, summarise
from fedssl.experiments.fcl_finetune import (
    encoder_init,
    evaluate_federated,
    export_unet_init,
    load_global_state,
    load_labelled_sites,
    protocol_settings,
    site_folders,
)
from fedssl.experiments.diagnostics import (
    diagnose_acdc,
    failed_mark,
    failed_verdict,
    failure_footer,
    failure_record,
    format_diagnostics,
    job_health_settings,
    mark_lines,
    pretraining_health,
)
from fedssl.experiments.table7 import JOBS, ROWS
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
from fedssl.ops.jobs import load_profile
from fedssl.ops.simulate import run_simulation, server_run_dir
from fedssl.train.protocol import centralised_finetune, local_finetune

#: random, Local CL, FedRotation, FedSimCLR, FedMoCo, FedBYOL, FCL, FCLOpt, FCLOpt-PTNU, FCLOpt-PTNU-DP
ALL_METHODS = tuple(FCL_METHODS)
TABLES = (1, 2, 3)
DEFAULT_FOLDS = (0, 1, 2, 3, 4)
#: Local CL (FCL sec. 5.1 baseline; README, FCL section): FCL pre-training with nothing exchanged or aggregated
LOCAL_CL = ("Local CL", "fcl_acdc", ["client.fcl_trainer.federated=false", 'server.aggregator.exclude_patterns=["*"]',
                                     "server.aggregator.collectors=[]"])
#: the site whose own Local CL encoder starts federated (Table 2) and centralised (Table 3) fine-tuning
LOCAL_CL_SHARED = "site-1"
LOCAL_CL_NOTE = (f"Local CL: local fine-tuning starts from each site's own encoder; federated and centralised "
                 f"fine-tuning from {LOCAL_CL_SHARED}'s (no shared model exists)")
#: FCL sec. 5 "Baselines": FedRotation (rotation prediction, Gidaris et al. 2018) and FedSimCLR (Chen et al. 2020)
#: "combined with FedAvg for pre-training the encoder": the FCL job with another objective on the server's model and
#: the sites' trainer (``shape.objective``, :mod:`fedssl.train.fcl_baselines`), no feature exchange, nothing collected
#: besides the weights; every other setting is the job's (sec. 5 "Training details")
BASELINES = [(name, "fcl_acdc", [f"shape.objective={objective}", "client.fcl_trainer.feature_exchange=false",
                                 "server.aggregator.collectors=[]"])
             for name, objective in (("FedRotation", "rotation"), ("FedSimCLR", "simclr"))]
PRETRAINED = {name: (job, sets) for name, job, sets in [*ROWS, LOCAL_CL, *BASELINES]}


def _slug(method: str) -> str:
    """A method label as a folder name ("Local CL" -> "Local_CL")."""
    return method.replace(" ", "_")


# ---------------------------------------------------------------- cells

def seeded(key: dict, seed: int) -> dict:
    """``key`` for training seed ``seed``: seed 0 adds nothing (folders from before seeds resume as seed 0)."""
    return dict(key, seed=int(seed)) if seed else dict(key)


def seed_of(key: dict) -> int:
    return int(key.get("seed", 0))


def pretrain_cells(methods: Sequence[str], seeds: Sequence[int] = (0,)) -> list[dict]:
    """One pre-training cell per seed and pre-trained method (random has none), seed-major."""
    return [seeded({"stage": "pretrain", "method": m}, sd) for sd in seeds for m in methods if m != "random"]


def table_cells(table: int, methods: Sequence[str], n_labelled: Sequence[int], folds: Sequence[int],
                sites: Sequence[str], seeds: Sequence[int] = (0,)) -> list[dict]:
    """The fine-tuning cells of ``table``, seed- then fold-major (an interrupted table has every method on its
    first seeds and folds)."""
    mode = FCL_TABLE_MODES[table]
    cells = []
    for sd in seeds:
        for fold in folds:
            for n in n_labelled:
                for method in methods:
                    base = seeded({"stage": mode, "method": method, "n_labelled": int(n), "fold": int(fold)}, sd)
                    cells += [dict(base, site=s) for s in sites] if table == 1 else [base]
    return cells


#: the id of each pre-training job's site trainer (its ``seed`` argument is set per seed)
TRAINER_IDS = {"fcl_acdc": "fcl_trainer", "fclopt_acdc": "byol_trainer"}


def seed_sets(trainer: str, seed: int) -> list[str]:
    """The job overrides of training seed ``seed``: the server's initial model and the sites' trainer."""
    return [f"server.model.seed={int(seed)}", f"client.{trainer}.seed={int(seed)}"]


def _suffix(seed: int) -> str:
    """The workspace name suffix of a seed ("" for seed 0: the folders of runs from before seeds)."""
    return f"_seed{seed}" if seed else ""


# ---------------------------------------------------------------- stages (module level: tests replace them)

def pretrain(method: str, workspace: str, *, data_root: str, n_sites: int, profile: str,
             rounds: int | None, seed: int = 0) -> dict:
    """One pre-training simulator run (training seed ``seed``); the paths the fine-tuning cells and the
    diagnostics need."""
    job, sets = PRETRAINED[method]
    sets = (list(sets) + ([f"server.scatter_and_gather.num_rounds={rounds}"] if rounds else [])
            + seed_sets(TRAINER_IDS[job], seed))
    s = run_simulation(os.path.join(JOBS, job), workspace, n_sites=n_sites, data_root=os.path.join(data_root, "{site}"),
                       profile=profile, sets=sets, echo=False)
    out = {"summary": os.path.join(server_run_dir(workspace), "summary.json"),
           "wall_time_s": s["simulator_wall_time_s"],
           "rounds": len(s.get("rounds", [])), "bytes_per_site_per_round": s.get("bytes_per_site_per_round")}
    if method == "Local CL":  # the server's model stays the initial one: only the sites' own encoders count
        out["site_encoders"] = local_cl_encoders(workspace, n_sites)
    else:
        out["global_model"] = s["global_model"]
    return out


def local_cl_encoders(workspace: str, n_sites: int) -> dict[str, str]:
    """site -> that site's own final FCL checkpoint of a Local CL run; an error naming the missing one."""
    encoders = {}
    for i in range(1, n_sites + 1):
        site = f"site-{i}"
        found = sorted(glob.glob(os.path.join(workspace, site, "*", "fcl_client_state.pt")))
        if not found:
            raise ValueError(f"Local CL run {workspace}: no {site}/<run>/fcl_client_state.pt; did {site} train?")
        encoders[site] = found[0]
    return encoders


def init_path(method: str, pretrained: dict | None, site: str | None) -> str:
    """The encoder a fine-tuning cell starts from: "random", the method's global model, or for Local CL the
    site's own encoder (local cells) or :data:`LOCAL_CL_SHARED`'s (federated / centralised cells)."""
    if method == "random":
        return "random"
    if pretrained is None:
        raise ValueError(f"{method}: no pre-training result; its pre-training cell must run first")
    if "site_encoders" in pretrained:
        return pretrained["site_encoders"][site or LOCAL_CL_SHARED]
    return pretrained["global_model"]


#: the run settings a pre-training depends on; another folder's pre-training is reused only where they agree
PRETRAIN_SETTINGS = ("data_root", "difficulty", "n_sites", "rounds")


def pretraining_files(result: dict) -> list[str]:
    """The files a pre-training cell's result points at: its run summary and the global model or the sites'
    own encoders (Local CL)."""
    return [result["summary"], *([result["global_model"]] if "global_model" in result else []),
            *result.get("site_encoders", {}).values()]


def reuse_pretraining(source: str, store: CellStore, methods: Sequence[str], config: dict, profile: str,
                      say=print, seeds: Sequence[int] = (0,)) -> list[str]:
    """Copy the finished pre-training cells of ``methods`` from the tables folder ``source`` into ``store``, so a
    run with other fine-tuning settings (epochs, the step floor) starts from the same pre-trained encoders instead
    of pre-training again.  Refused, naming the setting, unless ``source`` ran on the same data, sites and rounds
    (``config``, :data:`PRETRAIN_SETTINGS`) and its profile sets the jobs exactly as ``profile`` does; a file the
    copied cell points at that is gone is an error naming it.  Cells already in ``store`` are kept.  Each copied
    result records ``reused_from``.  Returns the methods copied."""
    source = os.path.abspath(source)
    fix = "name a folder that `fedssl fcl tables` wrote"
    theirs = read_run_config(source, fix)
    if theirs is None:
        raise ValueError(f"pretrained_from={source!r}: {os.path.join(source, 'run_config.json')} is missing; {fix}")
    changed = [k for k in PRETRAIN_SETTINGS if theirs.get(k) != config.get(k)]
    if changed:
        raise ValueError(f"pretrained_from={source!r}: its pre-training ran with other settings: "
                         + ", ".join(f"{k}={theirs.get(k)!r} (here {config.get(k)!r})" for k in changed)
                         + "; pass the same --data-root / --sites / --rounds, or pre-train here")
    if load_profile(theirs.get("profile", "")).get("jobs") != load_profile(profile).get("jobs"):
        raise ValueError(f"pretrained_from={source!r}: its profile {theirs.get('profile')!r} sets the jobs "
                         f"differently from profile {profile!r}; reuse needs the same job settings")
    theirs_store = CellStore(os.path.join(source, "cells.jsonl"))
    copied = []
    for key in pretrain_cells(methods, seeds):
        if store.done(key) or not theirs_store.done(key):
            continue
        result = theirs_store.get(key)
        missing = [p for p in pretraining_files(result) if not os.path.isfile(p)]
        if missing:
            raise ValueError(f"pretrained_from={source!r}: {key['method']}'s pre-training points at {missing[0]}, "
                             "which is gone; pre-train here instead")
        store.put(key, {**result, "reused_from": source}, theirs_store.seconds(key))
        copied.append(key["method"] + (f" (seed {seed_of(key)})" if seed_of(key) else ""))
    if copied:
        say(f"pre-training of {', '.join(copied)} reused from {source} (same data, sites, rounds and job settings)")
    return copied


@functools.lru_cache(maxsize=2)
def _sites_cached(data_root: str, settings_json: str) -> dict:
    return load_labelled_sites(data_root, json.loads(settings_json))


def load_sites(data_root: str, settings: dict) -> dict:
    """The labelled volumes of every site, loaded once per process (worker initialiser, then cached)."""
    return _sites_cached(data_root, json.dumps(settings, sort_keys=True))


def init_worker(data_root: str, settings: dict) -> None:
    """Worker process start (after :func:`~fedssl.experiments.table_runner.run_cells` has set its torch threads):
    the sites' volumes loaded once."""
    load_sites(data_root, settings)


def finetune_one(key: dict, init: str, data_root: str, settings: dict) -> dict:
    """One local (one site) or centralised fine-tuning run with the key's training seed; the protocol's result
    row, with ``seed``."""
    sites = load_sites(data_root, settings)
    start = "random" if init == "random" else encoder_init(init)
    kw = dict(n_labelled=[key["n_labelled"]], folds=[key["fold"]], features=settings["features"],
              epochs=settings["epochs"], lr=settings["lr"], device=settings["device"],
              min_steps=settings["min_steps"], seed=seed_of(key), norm=settings["norm"])
    if key["stage"] == "local":
        (row,) = local_finetune(sites, {key["method"]: start}, sites=[key["site"]], **kw)
    else:
        (row,) = centralised_finetune(sites, {key["method"]: start}, **kw)
    return plain_json(dict(row, seed=seed_of(key)))


def federated_one(key: dict, init: str, workspace: str, *, data_root: str, n_sites: int, profile: str,
                  settings: dict) -> dict:
    """One federated fine-tuning simulator run (``jobs/fcl_acdc_finetune``, as the demo) evaluated per site; the
    key's training seed sets the U-Net's initial weights (the decoder's, from a pre-trained encoder) and the
    sites' batch order and augmentations."""
    seed = seed_of(key)
    sets = [f"client.seg_trainer.n_labelled={key['n_labelled']}", f"client.seg_trainer.fold={key['fold']}",
            *seed_sets("seg_trainer", seed)]
    if init != "random":
        unet = export_unet_init(init, workspace + "_unet_init.pt", settings["features"], seed=seed)
        sets.append(f"server.persistor.source_ckpt_file_full_name={unet}")
    s = run_simulation(os.path.join(JOBS, "fcl_acdc_finetune"), workspace, n_sites=n_sites,
                       data_root=os.path.join(data_root, "{site}"), profile=profile, sets=sets, echo=False)
    rows = evaluate_federated(s["global_model"], load_sites(data_root, settings), method=key["method"],
                              n_labelled=key["n_labelled"], fold=key["fold"], settings=settings)
    return {"rows": plain_json([dict(r, seed=seed) for r in rows]), "wall_time_s": s["simulator_wall_time_s"]}


def _finetune_cell(key: dict, *, inits: dict, data_root: str, settings: dict) -> dict:
    """A worker's cell: resolve the init of (method, seed, site), then :func:`finetune_one`."""
    pretrained = inits.get((key["method"], seed_of(key)))
    return finetune_one(key, init_path(key["method"], pretrained, key.get("site")), data_root, settings)


# ---------------------------------------------------------------- the run

def table_folds(profile: str, table: int, folds: Sequence[int] | None) -> list[int]:
    """``folds`` when given, else the profile's ``tables.fcl.folds["<table>"]`` (the bench profile runs fewer folds
    of the simulator-heavy Table 2), else all five."""
    if folds is not None:
        return [int(f) for f in folds]
    chosen = load_profile(profile).get("tables", {}).get("fcl", {}).get("folds", {}).get(str(table))
    if chosen is None:
        return list(DEFAULT_FOLDS)
    if not isinstance(chosen, list) or not chosen or not all(f in DEFAULT_FOLDS for f in chosen):
        raise ValueError(f"profile {profile!r}: tables.fcl.folds[{str(table)!r}]={chosen!r} is invalid; "
                         "use a non-empty list of folds 0-4")
    return [int(f) for f in chosen]


def _check_args(tables, methods, n_labelled, n_sites: int, workers: int, seeds) -> None:
    bad_tables = [t for t in tables if t not in TABLES]
    if bad_tables or not tables:
        raise ValueError(f"tables={list(tables)} is invalid; use some of {list(TABLES)}")
    bad = [m for m in methods if m not in ALL_METHODS]
    if bad or not methods:
        raise ValueError(f"methods={list(methods)} is invalid ({bad}); use some of {list(ALL_METHODS)}")
    bad_n = [n for n in n_labelled if n not in (1, 2, 4, 8)]
    if bad_n or not n_labelled:
        raise ValueError(f"n_labelled={list(n_labelled)} is invalid; use some of [1, 2, 4, 8] (FCL Tables 1-3)")
    if not isinstance(n_sites, int) or n_sites < 2:
        raise ValueError(f"n_sites={n_sites!r} is invalid; use an int >= 2 (federated runs need sites)")
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers={workers!r} is invalid; use an int >= 1")
    if (not seeds or len(set(seeds)) != len(seeds)
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in seeds)):
        raise ValueError(f"seeds={list(seeds)!r} is invalid; use distinct integers >= 0, e.g. [0, 1, 2]")


def summary_rows(table: int, rows: Sequence[dict]) -> list[dict]:
    """Protocol rows -> ``write_table`` rows (mean +- std over sites, fold-averaged first; over folds for Table 3),
    each with ``by_seed``: seed -> the same mean over that seed's rows alone (the figure's spread over seeds)."""
    by_seed: dict = {}
    for sd in sorted({int(r.get("seed", 0)) for r in rows}):
        for s in summarise([r for r in rows if int(r.get("seed", 0)) == sd]):
            by_seed.setdefault((s["method"], s["n_labelled"]), {})[str(sd)] = s["dice_mean"]
    return [{"table": f"Table {table}", "method": s["method"], "column": f"N={s['n_labelled']}",
             "mean": s["dice_mean"], "std": s["dice_std"], "n": s["n"],
             "by_seed": by_seed.get((s["method"], s["n_labelled"]), {})} for s in summarise(rows)]


#: the training seeds of a table run unless told otherwise: one seed's sign is not a finding
DEFAULT_SEEDS = (0, 1, 2)


def run_fcl_tables(out: str, *, tables: Sequence[int] = TABLES, methods: Sequence[str] = ALL_METHODS,
                   n_labelled: Sequence[int] = (1, 2, 4, 8), folds: Sequence[int] | None = None, n_sites: int = 3,
                   profile: str = "bench", data_root: str | None = None, difficulty: float | None = None,
                   epochs: int | None = None, rounds: int | None = None, workers: int = 2,
                   pretrained_from: str | None = None, seeds: Sequence[int] = DEFAULT_SEEDS,
                   threads: int = DEFAULT_THREADS, say=print) -> dict:
    """Run (or resume) the cells of FCL ``tables`` and write ``out/table{t}.{json,csv,txt,png}`` after each table.

    ``folds``: the folds of every table; None = the profile's per-table folds (``tables.fcl.folds``), else all five.
    ``data_root``: ``site-*`` folders; None = synthetic ACDC (10 patients per site, seed 0, ``difficulty`` when
    given) under ``out/data/acdc``.  ``epochs`` overrides the profile's fine-tuning epochs, ``rounds`` the
    pre-training rounds.  ``pretrained_from``: another tables folder whose finished pre-training cells are reused
    (:func:`reuse_pretraining`).  ``seeds``: training seeds, each pre-training and fine-tuning cell run once per
    seed (module docstring); a later command may add seeds to a folder (its tables show the seeds it names).
    ``threads``: torch threads of this process and of each worker (a setting of the folder, like the epochs).
    Returns ``{table: paths of its files}``."""
    tables, methods, n_labelled, seeds = [int(t) for t in tables], list(methods), [int(n)
                                                                                   for n in n_labelled], list(seeds)
    _check_args(tables, methods, n_labelled, n_sites, workers, seeds)
    t0 = time.time()
    out = os.path.abspath(out)
    if data_root is None:
        data_root = os.path.join(out, "data", "acdc")
        if not os.path.isdir(data_root):
            say(f"writing synthetic ACDC: {n_sites} sites x 10 patients -> {data_root}")
            extra = {} if difficulty is None else {"difficulty": difficulty}
            write_synthetic_acdc(data_root, n_patients=10 * n_sites, n_sites=n_sites, seed=0, **extra)
    data_root = os.path.abspath(data_root)
    sites = list(site_folders(data_root))
    if len(sites) != n_sites:
        raise ValueError(f"{data_root} holds {len(sites)} site folders {sites}, not n_sites={n_sites}")
    settings = protocol_settings(profile, epochs)
    config = {"profile": profile, "data_root": data_root, "difficulty": difficulty, "n_sites": n_sites,
              "epochs": settings["epochs"], "min_steps": settings["min_steps"], "rounds": rounds}
    begin_run(out, config, threads=threads, say=say)
    store = CellStore(os.path.join(out, "cells.jsonl"))
    if pretrained_from is not None:
        reuse_pretraining(pretrained_from, store, methods, config, profile, say=say, seeds=seeds)

    pre_cells = pretrain_cells(methods, seeds)
    pre = dict(zip([(c["method"], seed_of(c)) for c in pre_cells], run_cells(
        pre_cells, lambda key: pretrain(
            key["method"], os.path.join(out, "ws", f"pretrain_{_slug(key['method'])}{_suffix(seed_of(key))}"),
            data_root=data_root, n_sites=n_sites, profile=profile, rounds=rounds, seed=seed_of(key)),
        store, say=say, label="pre-training (FLARE simulator, one run at a time)", threads=threads)))
    inits = {(m, sd): pre.get((m, sd)) for m in methods for sd in seeds}
    diag_text, health = _diagnostics(out, pre, store, data_root=data_root, settings=settings, say=say,
                                     profile=profile, threads=threads)
    written = {}
    for table in tables:
        used = table_folds(profile, table, folds)
        cells = table_cells(table, methods, n_labelled, used, sites, seeds)
        label = f"Table {table} ({FCL_TABLE_MODES[table]} fine-tuning, folds {used})"
        if table == 2:
            run_cells(cells, lambda key: federated_one(
                key, init_path(key["method"], inits[(key["method"], seed_of(key))], None), os.path.join(
                    out, "ws", f"ft_{_slug(key['method'])}_n{key['n_labelled']}_f{key['fold']}{_suffix(seed_of(key))}"),
                data_root=data_root, n_sites=n_sites, profile=profile, settings=settings),
                store, say=say, label=label + ", FLARE simulator", threads=threads)
        else:
            fn = functools.partial(_finetune_cell, inits=inits, data_root=data_root, settings=settings)
            pool = workers > 1
            run_cells(cells, fn, store, say=say, cost=lambda key: key["n_labelled"], workers=workers,
                      initializer=init_worker if pool else None, initargs=(data_root, settings) if pool else (),
                      label=label, threads=threads)
        rows, shown = stored_rows(store, table, n_labelled, used, seeds)
        written[table] = _write(out, table, rows, shown, n_labelled, used, seeds, profile, settings,
                                stored_pretraining(store, shown, seeds), say, health)
        if diag_text:
            say(diag_text)
    say(f"FCL tables {tables} done in {time.time() - t0:.0f} s; files under {out}")
    return written


def stored_rows(store: CellStore, table: int, n_labelled: Sequence[int], folds: Sequence[int],
                seeds: Sequence[int] = (0,)) -> tuple[list[dict], list[str]]:
    """Every finished fine-tuning row of ``table`` in the folder's cell store at these N, folds and seeds,
    whichever command ran it, so methods added one command at a time end up in one table; with the methods they
    cover in :data:`ALL_METHODS` order (rows sorted the same way, as :func:`summarise` orders methods by first
    row).  Every row has its ``seed`` (0 for rows from before seeds)."""
    mode = FCL_TABLE_MODES[table]
    rows = []
    for record in store.results():
        key = record["key"]
        if (key.get("stage") == mode and key.get("n_labelled") in n_labelled and key.get("fold") in folds
                and seed_of(key) in seeds):
            found = record["result"]["rows"] if table == 2 else [record["result"]]
            rows.extend(dict(r, seed=seed_of(key)) for r in found)
    methods = [m for m in ALL_METHODS if any(r["method"] == m for r in rows)]
    rows.sort(key=lambda r: methods.index(r["method"]))
    return rows, methods


def stored_pretraining(store: CellStore, methods: Sequence[str], seeds: Sequence[int] = (0,)) -> dict:
    """The finished pre-training cells of ``methods`` (random has none): method (``"<method> seed <s>"`` for
    seeds other than 0) -> its stored result."""
    keys = {m + (f" seed {sd}" if sd else ""): seeded({"stage": "pretrain", "method": m}, sd)
            for sd in seeds for m in methods if m != "random"}
    return {m: store.get(k) for m, k in keys.items() if store.done(k)}


def diagnose_one(method: str, pretrained: dict, *, data_root: str, settings: dict, seed: int = 0) -> dict:
    """The diagnostics of one pre-trained method (:func:`fedssl.experiments.diagnostics.diagnose_acdc`): loss terms
    and bank fill per round from its run summary, feature spread and frozen-encoder probe (N=1, fold 0) of its
    global model (Local CL: :data:`LOCAL_CL_SHARED`'s own encoder) against a random encoder.  The training seed
    ``seed`` is the random encoder's (so it is this pre-training's start) and the probe's; seeds other than 0 are
    named in the label ("FCL seed 1")."""
    state = load_global_state(init_path(method, pretrained, None))
    label = method + (f" seed {seed}" if seed else "")
    return plain_json(diagnose_acdc(label, pretrained["summary"], state, load_sites(data_root, settings), settings,
                                    seed=seed))


@functools.lru_cache(maxsize=32)
def loss_health_settings(method: str, profile: str) -> dict:
    """The loss-health settings of ``method``'s pre-training (:func:`fedssl.experiments.diagnostics.health_settings`
    of its job's trainer at ``profile``: FCL / FedMoCo / Local CL ``loss_local`` against ln(K+1), K the trainer's
    ``bank_size``; FedSimCLR ``loss`` against ln(2B-1), FedRotation against ln 4; the BYOL family spread only; D its
    ``proj_dim``)."""
    job, sets = PRETRAINED[method]
    return job_health_settings(os.path.join(JOBS, job), profile, sets, TRAINER_IDS[job])


def _diagnostics(out: str, pre: dict, store: CellStore, *, data_root: str, settings: dict, say, profile: str,
                 threads: int | None = None) -> tuple[str, dict]:
    """Diagnostics cells (one per pre-trained method, resumable like every cell); the diagnostics of every
    method finished in this folder, each with its loss health (:func:`~fedssl.experiments.diagnostics.
    pretraining_health` of its rounds at ``profile``'s job settings), are written to ``out/diagnostics.{json,txt}``;
    returns the text printed under every table and the health per (method, seed)."""
    cells = [seeded({"stage": "diagnostics", "method": m}, sd) for m, sd in pre]
    if cells:
        run_cells(cells, lambda key: diagnose_one(key["method"], pre[(key["method"], seed_of(key))],
                                                  data_root=data_root, settings=settings, seed=seed_of(key)),
                  store, say=say, label="diagnostics (spread, probe)", threads=threads)
    # every method and seed diagnosed in this folder, whichever command ran it (methods are often added one at a
    # time), in the paper's method order, seeds ascending
    found = [r for r in store.results() if r["key"].get("stage") == "diagnostics"]
    found.sort(key=lambda r: (ALL_METHODS.index(r["key"]["method"]), seed_of(r["key"])))
    health = {(r["key"]["method"], seed_of(r["key"])): pretraining_health(
        r["result"].get("rounds") or [], discrimination=r["result"].get("discrimination"),
        **loss_health_settings(r["key"]["method"], profile)) for r in found}
    diags = [dict(r["result"], health=health[(r["key"]["method"], seed_of(r["key"]))]) for r in found]
    if not diags:
        return "", health
    text = format_diagnostics(diags)
    with open(os.path.join(out, "diagnostics.json"), "w") as f:
        json.dump(diags, f, indent=2)
    with open(os.path.join(out, "diagnostics.txt"), "w") as f:
        f.write(text + "\n")
    return text, health


def seed_health(health: dict, method: str, seeds) -> dict[str, dict]:
    """``{"seed <s>": health}`` of ``method``'s pre-trainings at ``seeds`` (those diagnosed)."""
    return {f"seed {int(sd)}": health[(method, int(sd))] for sd in seeds if (method, int(sd)) in health}


def marked_rows(table: int, rows: Sequence[dict], covered: dict, health: dict) -> tuple[list[dict], dict]:
    """:func:`summary_rows` with each row's failure record (:func:`~fedssl.experiments.diagnostics.failure_record`
    of its seeds) and, on every row of a method with a failed pre-training at a seed it covers, its ``mark``;
    and the marks by method."""
    marks = {}
    for m, sds in covered.items():
        per = seed_health(health, m, sds)
        marks[m] = failed_mark(failure_record(per)["pretraining_failed_at"], list(per))
    out = []
    for r in summary_rows(table, rows):
        r.update(failure_record(seed_health(health, r["method"], r["by_seed"])))
        out.append(dict(r, mark=marks[r["method"]]) if marks.get(r["method"]) else r)
    return out, marks


def _write(out: str, table: int, rows: list[dict], methods, n_labelled, folds, seeds, profile: str,
           settings: dict, inits: dict, say, health: dict | None = None) -> dict:
    """One table's files; ``health``: (method, seed) -> its pre-training's loss health (a failed one is marked in
    the rows, the verdict, the paired differences and a line per seed under the table)."""
    mode, health = FCL_TABLE_MODES[table], health or {}
    several = len(seeds) > 1
    if table == 3:
        over = "folds (each seed-averaged first)" if several else "folds"
    else:
        over = f"sites (each {'fold- and seed' if several else 'fold'}-averaged first)"
    title = (f"FCL Table {table}: {mode} fine-tuning on ACDC, Dice mean +- std over {over}; folds {list(folds)}, "
             + (f"seeds {list(seeds)}, " if seeds != [0] else "") + f"profile {profile}")
    if table == 2:
        notes = ["fine-tuning: jobs/fcl_acdc_finetune in the FLARE simulator, rounds and local epochs of profile "
                 f"{profile}"]
    else:
        floor = settings["min_steps"]
        notes = [f"fine-tuning: {settings['epochs']} epochs"
                 + (f" (at least {floor} optimiser steps: more epochs where N is small)" if floor else "")
                 + f", {settings['image_size']} px at {settings['target_spacing']} mm, U-Net {settings['features']} "
                 f"with {settings['norm']} norm"]
    if "Local CL" in methods:
        notes.append(LOCAL_CL_NOTE)
    covered = {m: sorted({int(r["seed"]) for r in rows if r["method"] == m}) for m in methods}
    if len({tuple(v) for v in covered.values()}) > 1:  # e.g. a method added at seed 0 only to a seeds run
        notes.append("seeds finished per method (a row averages only these): "
                     + ", ".join(f"{m} {v}" for m, v in covered.items()))
    table_rows, marks = marked_rows(table, rows, covered, health)
    if "random" in methods and "FCL" in methods and mode != "centralised":
        fcl = seed_health(health, "FCL", covered["FCL"])
        notes.append(failed_verdict(pretraining_verdict(rows, "FCL", mode=mode), "FCL",
                                    failure_record(fcl)["pretraining_failed_at"], list(fcl)))
    paired, footer = paired_against(rows, "random", mode=mode), []
    if paired:
        unit = PAIR_UNITS[mode] + (("seed",) if several else ())
        unit = f"({', '.join(unit)}) pairs" if len(unit) > 1 else f"{unit[0]}s"
        footer = [f"paired against random init over {unit}: mean difference (standard error), pairs ahead",
                  *mark_lines(format_paired(paired, "random").splitlines(), marks)]
    footer += failure_footer({m: seed_health(health, m, covered[m]) for m in methods})
    few = few_seeds_note(covered)  # the rows (and their paired differences) of fewer than three seeds
    if few:
        footer.append(few)
    extra = {"folds": list(folds), "seeds": list(seeds), "mode": mode, "profile": profile, "settings": settings,
             "pretraining": {m: v for m, v in inits.items() if v is not None}, "paired_against_random": paired,
             "pretraining_health": {m: seed_health(health, m, covered[m]) for m in methods if m != "random"},
             "cell_rows": rows}
    paths = write_table(out, f"table{table}", table_rows,
                        paper=fcl_paper_rows(table, methods, n_labelled),
                        paper_source=FCL_SOURCE.format(table=table), title=title, notes=notes, extra=extra,
                        footer=footer)
    with open(paths["txt"]) as f:
        say("\n" + f.read())
    say(f"Table {table} written: " + ", ".join(paths[k] for k in ("txt", "csv", "json", "png")))
    return paths
