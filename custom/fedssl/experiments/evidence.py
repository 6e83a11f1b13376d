"""``fedssl bench evidence``: one command that asks, on one GPU in under 9 minutes, whether federated pre-training
makes a few labels go further -- FCL on ACDC at the paper's model size and Fed-MAE on SSL-FL's Split-3.

FCL (Wu et al., "Federated contrastive learning for volumetric medical image segmentation", MICCAI 2021, and
"Distributed contrastive learning for medical image segmentation", MedIA 2022), section 5 and Table 1:

1. synthetic ACDC in its real layout (100 patients, 10 sites, every cine frame unlabelled; the sites are written
   and loaded by parallel processes);
2. federated FCL pre-training at the paper's settings (10 sites, U-Net with 48 first-level channels and the
   reference code's batch norm and flatten head, batch 32 = 8 volumes x 4 partitions, 192 px at 1.25 mm, SGD lr
   0.05 cosine over the run, tau 0.1, m 0.99, bank 4,096, feature exchange + negative sampling + GSM) for as many
   rounds as the time budget holds (``rounds`` fixes it; the paper runs 200), one pre-training per seed.  The
   federation runs in this process without FLARE: every round each site loads the global model, trains one local
   epoch with :class:`fedssl.train.fcl.FCLLocalTrainer` (the class the FLARE executor runs) and receives the other
   sites' banks of the previous round through :func:`fedssl.core.memory_bank.remote_bank_for` (the server's
   shuttle); the server's weighted average (by local volumes, every tensor of the state dict, BN statistics
   included, as ``jobs/fcl_acdc``) is computed on the device in float64;
3. Table 1's local fine-tuning (:func:`fedssl.train.protocol.local_finetune`: each site alone on its N = 1 and
   2 annotated patients, fold 0, validated on every site's validation patients) from the pre-trained encoder and
   from random init, for every seed, in a pool of processes sharing the GPU; the epochs are the paper's 200 or
   what the budget holds.

Fed-MAE (:mod:`fedssl.experiments.evidence_mae`) runs after it, in a process of its own, in the rest of the
budget (side by side on one H200 the two parts slowed each other three- to fourfold).  The result: ``evidence.json``
(every setting, the chosen rounds and epochs, the loss curves, every fine-tuning row, the paired differences with
their standard error over seeds), ``evidence.png`` and one verdict line per method.  ``size="tiny"`` runs the
same code at toy sizes on a CPU (the tests).  Numbers of a run whose rounds were chosen by the budget repeat when
the command is given the recorded ``rounds`` and ``epochs``.
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import time
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import replace

import numpy as np
import torch

from fedssl.core.memory_bank import remote_bank_for
from fedssl.core.seeds import derived_seed
from fedssl.data.acdc import load_site
from fedssl.data.acdc_synthetic import write_synthetic_acdc
from fedssl.eval.report import paired_against
from fedssl.experiments.environment import environment
from fedssl.models.unet import encoder_state_from_global
from fedssl.train.fcl import FCLLocalTrainer, FCLSettings
from fedssl.train.protocol import local_finetune

#: every setting of the FCL part, per size: ``data`` = the synthetic ACDC writer's, ``pretrain`` = FCLSettings
#: fields, ``finetune`` = Table 1's local protocol (FCL section 5: 200 epochs, Adam lr 5e-4, batch 10)
FCL_SIZES: dict[str, dict] = {
    "gpu": {
        "data": {"n_patients": 100, "n_sites": 10, "shape": [128, 128], "n_frames": 10, "slices_range": [8, 10]},
        "pretrain": {"image_size": 192, "target_spacing": 1.25, "features": [48, 96, 192, 384, 768, 48],
                     "batch_size": 32, "lr": 0.05, "bank_size": 4096, "proj_dim": 128, "amp": True},
        "max_rounds": 200,
        "finetune": {"epochs": 200, "min_epochs": 20, "batch_size": 10, "lr": 5e-4, "n_labelled": [1, 2],
                     "folds": [0]},
        "workers": 8,
    },
    "tiny": {
        "data": {"n_patients": 10, "n_sites": 2, "shape": [32, 32], "n_frames": 2, "slices_range": [4, 5]},
        "pretrain": {"image_size": 32, "target_spacing": 2.5, "features": [4, 8, 16, 32, 64, 4], "batch_size": 8,
                     "lr": 0.005, "bank_size": 32, "proj_dim": 16, "max_steps_per_round": 2, "amp": False},
        "max_rounds": 4,
        "finetune": {"epochs": 3, "min_epochs": 1, "batch_size": 10, "lr": 0.01, "n_labelled": [1, 2], "folds": [0]},
        "workers": 2,
    },
}

#: the share of the FCL part's budget that pre-training may use (the rest: fine-tuning and the report)
PRETRAIN_SHARE = 0.5
#: the share of the command's budget the FCL part runs in (Fed-MAE runs after it, in the rest)
FCL_SHARE = 0.6


def pick_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def rounds_that_fit(budget_s: float, seconds_per_round: float, most: int, least: int = 1) -> int:
    """How many rounds of ``seconds_per_round`` fit in ``budget_s``, between ``least`` and ``most``."""
    if seconds_per_round <= 0 or not math.isfinite(seconds_per_round):
        return most
    return int(max(least, min(most, math.floor(budget_s / seconds_per_round))))


def se_over_seeds(values: Sequence[float]) -> float | None:
    """The standard error of the mean over seeds: sample std / sqrt(n); None for one value."""
    v = np.asarray(list(values), dtype=float)
    return None if v.size < 2 else float(v.std(ddof=1) / math.sqrt(v.size))


def verdict_line(name: str, diff: float, se: float | None, n_seeds: int, unit: str) -> str:
    """One line: the mean paired difference, its SE over seeds and what it means (2 SE is the bar)."""
    sign = f"{diff:+.3f}" if unit == "Dice" else f"{diff:+.1f} points"
    if se is None or n_seeds < 2:
        return f"{name}: {sign} ({unit}), one seed: not a finding"
    if se == 0:
        word = "ahead" if diff > 0 else "behind" if diff < 0 else "not separated"
        return f"{name}: {sign} ({unit}; SE 0 over {n_seeds} seeds) -> {word}"
    z = diff / se
    word = (f"ahead by {z:.1f} SE" if z > 2 else f"behind by {-z:.1f} SE" if z < -2
            else f"not separated ({z:+.1f} SE, within 2 SE)")
    return f"{name}: {sign} ({unit}; SE {se:.3f} over {n_seeds} seeds) -> {word}"


# ---------------------------------------------------------------------------------------------- data
def _write_and_load_site(args: tuple) -> tuple[str, list, int]:
    root, site, data, pre = args
    torch.set_num_threads(1)  # one process per site already fills the cores
    write_synthetic_acdc(root, seed=0, only_sites=[site], n_patients=data["n_patients"], n_sites=data["n_sites"],
                         shape=tuple(data["shape"]), n_frames=data["n_frames"],
                         slices_range=tuple(data["slices_range"]))
    vols = load_site(os.path.join(root, site), with_labels=False, frames="all", site=site,
                     target_spacing=pre["target_spacing"], image_size=pre["image_size"])
    return site, vols, len(vols)


def prepare_acdc(root: str, size: dict, processes: int) -> dict[str, list]:
    """Write the synthetic ACDC sites and load their unlabelled volumes (every frame), one process per site."""
    data, pre = size["data"], size["pretrain"]
    sites = [f"site-{k}" for k in range(1, data["n_sites"] + 1)]
    jobs = [(root, s, data, pre) for s in sites]
    if processes <= 1:
        out = [_write_and_load_site(j) for j in jobs]
    else:
        with mp.get_context("spawn").Pool(min(processes, len(jobs))) as pool:
            out = pool.map(_write_and_load_site, jobs)
    return {site: vols for site, vols, _ in out}


# ---------------------------------------------------------------------------------------------- pre-training
def fcl_settings(size: dict, seed: int, device: str) -> FCLSettings:
    pre = dict(size["pretrain"])
    pre["features"] = tuple(pre["features"])
    if device == "cpu":
        pre["amp"] = False
    return FCLSettings(seed=seed, device=device, **pre)


def probe_round_seconds(site_volumes: dict, size: dict, n_seeds: int, device: str) -> float:
    """Seconds one federated round of every seed will take, from a throwaway trainer of the first site: one round
    of 2 steps to warm up, then 3 timed steps, scaled to every site's steps and every seed (x 1.1 for the
    average and the bank shuttle)."""
    site = sorted(site_volumes)[0]
    s = replace(fcl_settings(size, 0, device), max_steps_per_round=3)
    probe = FCLLocalTrainer(site_volumes[site], replace(s, max_steps_per_round=2), num_rounds=2, device=device,
                            site=site)
    probe.train_round(0)
    probe.max_steps_per_round = 3
    _sync(device)
    t0 = time.perf_counter()
    probe.train_round(1)
    _sync(device)
    per_step = (time.perf_counter() - t0) / 3
    cap = int(size["pretrain"].get("max_steps_per_round", 0))
    steps = sum(_n_steps(v, s, cap) for v in site_volumes.values())
    del probe
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return 1.1 * per_step * steps * n_seeds


def _n_steps(volumes: Sequence, s: FCLSettings, cap: int) -> int:
    per_batch = s.batch_size // s.n_partitions
    n = len(volumes) // per_batch
    return min(n, cap) if cap > 0 else n


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class _DeviceAverage:
    """The server's weighted average of state dicts, on the device, accumulated in float64 (integer buffers
    rounded back), like :class:`fedssl.core.state_dict.RunningAverage` but without copying 0.9 GB per site to
    the host."""

    def __init__(self) -> None:
        self.acc: dict[str, torch.Tensor] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self.total = 0.0

    def add(self, state: dict[str, torch.Tensor], weight: float) -> None:
        for k, v in state.items():
            if k not in self.acc:
                self.acc[k] = torch.zeros(v.shape, dtype=torch.float64, device=v.device)
                self.dtypes[k] = v.dtype
            self.acc[k].add_(v.detach().to(torch.float64), alpha=float(weight))
        self.total += float(weight)

    def result(self) -> dict[str, torch.Tensor]:
        out = {}
        for k, a in self.acc.items():
            mean = a / self.total
            out[k] = (mean.round() if not self.dtypes[k].is_floating_point else mean).to(self.dtypes[k])
        return out


#: how the in-process federation exchanges features: "once" = the bundle's (each row leaves its site once, the
#: receiver keeps a FIFO; issue 45), "resend" = the exchange before issue 45, kept as a control arm only
EXCHANGES = ("once", "resend")


def resent_remote_bank(banks: dict[str, tuple[np.ndarray, np.ndarray]], site: str, rows: int,
                       rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """The remote bank of the exchange before issue 45, to measure what the defence costs (``fedssl bench control
    --resend-multipliers``): every site re-sent its WHOLE bank every round, and a receiver's remote bank was replaced
    by exactly ``rows`` rows: at most ``N - 1`` real rows per filled row it shared, drawn from the others' filled
    rows, the rest random unit vectors with partition id -1 (negatives only).  The bundle no longer sends this
    (rows linkable across rounds, padding that shows the others' fill)."""
    dim = next(iter(banks.values()))[0].shape[1]
    pooled = [banks[name] for name in sorted(banks) if name != site]
    f = np.concatenate([b[0] for b in pooled], axis=0) if pooled else np.zeros((0, dim), np.float32)
    p = np.concatenate([b[1] for b in pooled], axis=0) if pooled else np.zeros((0,), np.int64)
    f, p = f[p >= 0], p[p >= 0]
    own = int(np.sum(banks[site][1] >= 0)) if site in banks else 0
    take = rng.permutation(f.shape[0])[: min(rows, own * len(pooled))]
    f, p = f[take], p[take]
    pad = rows - f.shape[0]
    if pad > 0:
        noise = rng.standard_normal((pad, dim))
        noise /= np.maximum(np.linalg.norm(noise, axis=1, keepdims=True), 1e-12)
        f = np.concatenate([f, noise.astype(np.float32)], axis=0)
        p = np.concatenate([p, np.full(pad, -1, np.int64)], axis=0)
        order = rng.permutation(rows)
        f, p = f[order], p[order]
    return f.astype(np.float32, copy=False), p.astype(np.int64, copy=False)


def federated_fcl(site_volumes: dict, size: dict, seeds: Sequence[int], rounds: int | Callable[[float], int],
                  device: str, budget_s: float, say: Callable[[str], None], exchange: str = "once") -> dict:
    """FCL pre-training of every seed, interleaved round by round (see the module docstring).  ``rounds``: a count,
    or a function of the seconds left that chooses it once every trainer is built (before any step, so the
    learning-rate schedule is the chosen count's from the first step).  ``exchange``: one of :data:`EXCHANGES`.
    Returns per seed the global state (on the device) and the curves; stops when ``budget_s`` (wall seconds from
    the call) is spent and says so."""
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange={exchange!r}: use one of {list(EXCHANGES)}")
    deadline = time.time() + budget_s
    sites = sorted(site_volumes)
    runs = {}
    for seed in seeds:
        s = fcl_settings(size, seed, device)
        trainers = {site: FCLLocalTrainer(site_volumes[site], s, num_rounds=1, device=device, site=site)
                    for site in sites}
        runs[seed] = {"trainers": trainers, "global": None, "banks": None, "loss": [], "loss_local": [],
                      "feature_std": [], "remote_features": [], "secret": derived_seed(seed, "evidence_shuttle")}
    built_s = budget_s - (deadline - time.time())
    if callable(rounds):
        rounds = rounds(deadline - time.time())
    for run in runs.values():
        for tr in run["trainers"].values():
            tr.num_rounds = int(rounds)
    say(f"FCL pre-training: {len(seeds) * len(sites)} site trainers built in {built_s:.0f} s; {rounds} rounds")
    deadline += 0.15 * max(0.0, deadline - time.time())  # the count was chosen to fit: stop only on a real overrun
    done, t0 = 0, time.perf_counter()
    for r in range(rounds):
        if time.time() > deadline:
            say(f"FCL pre-training: the budget ends after round {r} of {rounds}")
            break
        for seed, run in runs.items():
            avg, losses, local, spread, weights, remote = _DeviceAverage(), [], [], [], [], []
            banks = {}
            for site, tr in run["trainers"].items():
                if run["global"] is not None:
                    tr.model.load_state_dict(run["global"])
                if run["banks"] is not None:
                    rng = np.random.default_rng([run["secret"], r, zlib.crc32(site.encode())])
                    if exchange == "once":
                        tr.set_remote(*remote_bank_for(run["banks"], site, tr.settings.bank_size, rng))
                    else:  # the receiver trained with the delivered bank as it came, replaced every round
                        f, p = resent_remote_bank(run["banks"], site, tr.settings.bank_size, rng)
                        tr.remote = (torch.from_numpy(f), torch.from_numpy(p))
                stats = tr.train_round(r)
                avg.add(tr.model.state_dict(), stats.samples)
                banks[site] = tr.export_bank() if exchange == "once" else tr.bank.export()
                losses.append(stats.loss)
                local.append(stats.metrics["loss_local"])
                spread.append(stats.metrics["feature_std"])
                remote.append(stats.metrics["remote_features"])
                weights.append(stats.samples)
            run["global"], run["banks"] = avg.result(), banks
            run["loss"].append(float(np.average(losses, weights=weights)))
            run["loss_local"].append(float(np.average(local, weights=weights)))
            run["feature_std"].append(float(np.mean(spread)))
            run["remote_features"].append(float(np.mean(remote)))
        done = r + 1
        if r == 0 or done % 5 == 0 or done == rounds:
            last = {sd: f"{run['loss'][-1]:.3f}" for sd, run in runs.items()}
            say(f"FCL pre-training round {done}/{rounds} ({time.perf_counter() - t0:.0f} s): loss by seed {last}, "
                f"feature spread {np.mean([run['feature_std'][-1] for run in runs.values()]):.3f}")
    return {"rounds": int(rounds), "rounds_done": done, "seconds": time.perf_counter() - t0, "build_s": built_s,
            "runs": {seed: {k: run[k] for k in ("global", "loss", "loss_local", "feature_std", "remote_features")}
                     for seed, run in runs.items()}}


# ---------------------------------------------------------------------------------------------- fine-tuning
_WORKER: dict = {}


def _init_finetune_worker(root: str, sites: Sequence[str], pre: dict, threads: int | None) -> None:
    """A pool worker's data (the sites' labelled volumes) and thread count (None: this process's, unchanged)."""
    if threads is not None:
        torch.set_num_threads(max(1, threads))
    _WORKER["volumes"] = {site: load_site(os.path.join(root, site), with_labels=True, site=site,
                                          target_spacing=pre["target_spacing"], image_size=pre["image_size"])
                          for site in sites}


def _finetune_task(task: dict) -> list[dict]:
    init = "random" if task["init_path"] is None else encoder_state_from_global(
        torch.load(task["init_path"], map_location="cpu", weights_only=True))
    rows = local_finetune(_WORKER["volumes"], {task["method"]: init}, sites=[task["site"]],
                          seed=task["seed"], device=task["device"], **task["protocol"])
    for row in rows:
        row["seed"] = task["seed"]
    return rows


def finetune_epochs(budget_s: float, step_s: float, steps_per_epoch: int, parallel: float, most: int,
                    least: int, run_s: float = 0.0, n_runs: int = 0) -> int:
    """Epochs of every fine-tuning run that fit in ``budget_s``: ``steps_per_epoch`` is the sum over all runs,
    ``step_s`` one step's seconds alone on the device, ``run_s`` the fixed seconds of each of the ``n_runs`` runs
    (building, validating), ``parallel`` the speed-up the worker pool is assumed to give."""
    return rounds_that_fit(budget_s * parallel - run_s * n_runs, step_s * steps_per_epoch, most, least)


def _probe_finetune_step(root: str, site: str, size: dict, device: str) -> dict:
    """The cost of Table 1's fine-tuning, from two throwaway runs of one site at N = 1 (1 and 3 epochs; their
    difference is 2 epochs of steps, their rest the fixed cost of a run): ``step_s``, ``run_s``, ``epoch_steps``
    (the sum over every run of one seed of the steps of one epoch) and ``runs`` (of one seed)."""
    pre, ft = size["pretrain"], size["finetune"]
    vols = {site: load_site(os.path.join(root, site), with_labels=True, site=site,
                            target_spacing=pre["target_spacing"], image_size=pre["image_size"])}
    slices = sum(v.n_slices for v in vols[site])
    per_patient = slices / max(1, len({v.patient_id for v in vols[site]}))
    kw = dict(n_labelled=[1], folds=[0], features=pre["features"], batch_size=ft["batch_size"], lr=ft["lr"],
              device=device, norm="batch")
    local_finetune(vols, {"random": "random"}, epochs=1, **kw)  # warm-up
    times = {}
    for epochs in (1, 3):
        _sync(device)
        t0 = time.perf_counter()
        local_finetune(vols, {"random": "random"}, epochs=epochs, **kw)
        _sync(device)
        times[epochs] = time.perf_counter() - t0
    steps = math.ceil(2 * per_patient / ft["batch_size"])  # one epoch at N = 1: two volumes (ED, ES)
    step_s = max(1e-4, times[3] - times[1]) / (2 * steps)
    n_sites = size["data"]["n_sites"]
    return {"step_s": step_s, "run_s": max(0.0, times[1] - steps * step_s),
            "epoch_steps": sum(math.ceil(2 * n * per_patient / ft["batch_size"]) for n in ft["n_labelled"])
            * n_sites * 2, "runs": len(ft["n_labelled"]) * n_sites * 2}


def run_finetuning(root: str, sites: Sequence[str], size: dict, seeds: Sequence[int], init_paths: dict[int, str],
                   epochs: int, device: str, workers: int, deadline: float,
                   say: Callable[[str], None]) -> tuple[list[dict], list[str]]:
    """Every (seed, site, init) run of Table 1's local protocol in a pool of ``workers`` processes; returns the rows
    and the tasks that did not finish before ``deadline``."""
    pre, ft = size["pretrain"], size["finetune"]
    protocol = {"n_labelled": ft["n_labelled"], "folds": ft["folds"], "features": pre["features"],
                "epochs": epochs, "batch_size": ft["batch_size"], "lr": ft["lr"], "norm": "batch"}
    tasks = [{"method": method, "init_path": path, "site": site, "seed": seed, "device": device,
              "protocol": protocol}
             for seed in seeds for site in sites
             for method, path in (("random", None), ("FCL", init_paths[seed]))]
    threads = max(1, (os.cpu_count() or 2) // max(1, workers))
    rows: list[dict] = []
    if workers <= 1:
        _init_finetune_worker(root, sites, pre, None)
        for t in tasks:
            rows += _finetune_task(t)
        return rows, []
    missing = []
    pool = ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_init_finetune_worker,
                               initargs=(root, list(sites), pre, threads))
    try:
        futures = {pool.submit(_finetune_task, t): t for t in tasks}
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=max(1.0, deadline - time.time()), return_when=FIRST_COMPLETED)
            for f in done:
                rows += f.result()
            if time.time() > deadline and pending:
                missing = [f"{futures[f]['method']} seed {futures[f]['seed']} {futures[f]['site']}" for f in pending]
                say(f"FCL fine-tuning: the budget ended with {len(pending)} of {len(tasks)} runs unfinished")
                break
            if done:
                say(f"FCL fine-tuning: {len(tasks) - len(pending)}/{len(tasks)} runs done")
    finally:
        if missing:  # running tasks cannot be cancelled: stop their processes
            for proc in list(getattr(pool, "_processes", {}).values()):
                proc.terminate()
        pool.shutdown(wait=not missing, cancel_futures=True)
    return rows, missing


# ---------------------------------------------------------------------------------------------- the FCL part
def fcl_evidence(out: str, *, size: str = "gpu", seeds: Sequence[int] = (0, 1, 2), device: str = "auto",
                 budget_s: float = 420.0, rounds: int | None = None, epochs: int | None = None,
                 workers: int | None = None, say: Callable[[str], None] = print) -> dict:
    """The FCL part (module docstring); writes ``out/fcl_evidence.json`` after each stage and returns it."""
    if size not in FCL_SIZES:
        raise ValueError(f"size={size!r}: use one of {sorted(FCL_SIZES)}")
    t_start = time.time()
    deadline = t_start + budget_s
    cfg, device = FCL_SIZES[size], pick_device(device)
    workers = cfg["workers"] if workers is None else int(workers)
    path = os.path.join(out, "fcl_evidence.json")
    result: dict = {"method": "FCL", "table": "Table 1, local fine-tuning", "metric": "Dice", "size": size,
                    "settings": cfg, "device": device, "seeds": list(seeds), "budget_s": budget_s}

    def save() -> None:
        result["seconds"] = round(time.time() - t_start, 1)
        _write_json(path, result)

    root = os.path.join(out, "data", "acdc")
    t = time.time()
    site_volumes = prepare_acdc(root, cfg, processes=min(cfg["data"]["n_sites"], os.cpu_count() or 1))
    result["data"] = {"seconds": round(time.time() - t, 1),
                      "volumes_per_site": {s: len(v) for s, v in site_volumes.items()}}
    say(f"FCL: {len(site_volumes)} sites written and loaded in {result['data']['seconds']} s")
    save()

    pre_budget = PRETRAIN_SHARE * (deadline - time.time())
    choose = rounds
    if rounds is None:
        def choose(seconds_left: float) -> int:
            per_round = probe_round_seconds(site_volumes, cfg, len(seeds), device)
            n = rounds_that_fit(seconds_left - per_round / len(seeds), per_round, cfg["max_rounds"])
            result["pretrain_probe_s_per_round"] = round(per_round, 3)
            say(f"FCL pre-training: about {per_round:.1f} s per round of {len(seeds)} seed(s) -> {n} rounds")
            return n
    pre = federated_fcl(site_volumes, cfg, seeds, choose, device, pre_budget, say)
    rounds = pre["rounds"]
    site_volumes.clear()  # the unlabelled volumes are not needed any more
    init_paths = {}
    for seed, run in pre["runs"].items():
        init_paths[seed] = os.path.join(out, f"fcl_global_seed{seed}.pt")
        torch.save({k: v.cpu() for k, v in run["global"].items()}, init_paths[seed])
        run.pop("global")
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    k = cfg["pretrain"]["bank_size"]
    result["pretrain"] = {"rounds": int(rounds), "rounds_done": pre["rounds_done"],
                          "stopped_early": pre["rounds_done"] < int(rounds), "seconds": round(pre["seconds"], 1),
                          "build_s": round(pre["build_s"], 1),
                          "chance_loss_local": math.log(k + 1),
                          "by_seed": {str(sd): run for sd, run in pre["runs"].items()}}
    save()

    sites = sorted(result["data"]["volumes_per_site"])
    if epochs is None:
        ft_budget = deadline - time.time() - 15.0
        probe = _probe_finetune_step(root, sites[0], cfg, device)
        parallel = float(min(workers, 4)) if device.startswith("cuda") else float(max(1, min(workers, 2)))
        epochs = finetune_epochs(ft_budget, probe["step_s"], probe["epoch_steps"] * len(seeds), parallel,
                                 cfg["finetune"]["epochs"], cfg["finetune"]["min_epochs"], probe["run_s"],
                                 probe["runs"] * len(seeds))
        result["finetune_probe"] = dict(probe, assumed_parallel=parallel)
        say(f"FCL fine-tuning: {probe['step_s'] * 1000:.1f} ms per step and {probe['run_s']:.1f} s per run alone "
            f"-> {epochs} epochs (paper 200)")
    t = time.time()
    rows, missing = run_finetuning(root, sites, cfg, seeds, init_paths, int(epochs), device, workers,
                                   deadline, say)
    result["finetune"] = {"epochs": int(epochs), "seconds": round(time.time() - t, 1), "unfinished": missing,
                          "rows": rows}
    paired = paired_against(rows, "random", mode="local")
    result["paired"] = paired
    result["verdicts"] = [
        verdict_line(f"FCL vs random init, Table 1 local, N={p['n_labelled']}", p["diff_mean"], p.get("seed_se"),
                     int(p["seeds"]), "Dice")
        for p in paired if p["method"] == "FCL"]
    save()
    return result


# ---------------------------------------------------------------------------------------------- the command
METHODS = ("fcl", "fedmae")


def _mae_process(out: str, size: str, seeds: list, device: str, budget_s: float, rounds: dict) -> None:
    from fedssl.experiments.evidence_mae import fedmae_evidence

    fedmae_evidence(out, size=size, seeds=seeds, device=device, budget_s=budget_s,
                    pretrain_rounds=rounds.get("mae_pretrain"), finetune_rounds=rounds.get("mae_finetune"),
                    say=lambda m: print(f"[Fed-MAE] {m}", flush=True))


def run_evidence(out: str, *, size: str = "gpu", seeds: Sequence[int] = (0, 1, 2), device: str = "auto",
                 budget_s: float = 480.0, methods: Sequence[str] = METHODS, rounds: dict | None = None,
                 workers: int | None = None, say: Callable[[str], None] = print) -> dict:
    """``fedssl bench evidence``: the FCL part here (:data:`FCL_SHARE` of ``budget_s``), then the Fed-MAE part in a
    process of its own in the rest, both within ``budget_s`` wall seconds; writes ``out/evidence.json`` and
    ``out/evidence.png`` and says one verdict line per method.  ``rounds``: fixed counts instead of the budget's
    (``fcl_rounds``, ``fcl_epochs``, ``mae_pretrain``, ``mae_finetune``; the JSON records the ones a run used)."""
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or not methods:
        raise ValueError(f"methods={list(methods)}: use some of {list(METHODS)}")
    if size not in FCL_SIZES:
        raise ValueError(f"size={size!r}: use one of {sorted(FCL_SIZES)}")
    if len(set(seeds)) != len(seeds) or not seeds:
        raise ValueError(f"seeds={list(seeds)}: give distinct seeds (3 for a finding)")
    rounds = dict(rounds or {})
    os.makedirs(out, exist_ok=True)
    device = pick_device(device)
    t0 = time.time()
    parts: dict = {}
    # the parts run one after the other: run side by side on one H200 they slowed each other 3-4x (an FCL step
    # took 120-140 ms in the first GPU run against 37 ms alone, experiments/fcl_step.py)
    fcl_share = FCL_SHARE if "fedmae" in methods else 1.0
    if "fcl" in methods:
        try:
            parts["fcl"] = fcl_evidence(out, size=size, seeds=seeds, device=device,
                                        budget_s=fcl_share * budget_s - 10.0, rounds=rounds.get("fcl_rounds"),
                                        epochs=rounds.get("fcl_epochs"), workers=workers,
                                        say=lambda m: say(f"[FCL] {m}"))
        except Exception as e:  # the other part still runs and is reported
            import traceback

            traceback.print_exc()
            parts["fcl"] = {"method": "FCL", "error": f"{type(e).__name__}: {e}",
                            "verdicts": [f"FCL: no result ({type(e).__name__}: {e})"]}
    if "fedmae" in methods:
        left = t0 + budget_s - time.time() - 10.0
        mae = mp.get_context("spawn").Process(target=_mae_process, name="fedmae-evidence",
                                              args=(out, size, list(seeds), device, max(30.0, left), rounds))
        mae.start()  # its own process: a crash there leaves this report standing
        mae.join(timeout=max(5.0, left + 40.0))
        if mae.is_alive():
            mae.terminate()
            mae.join()
        mae_path = os.path.join(out, "fedmae_evidence.json")
        if os.path.isfile(mae_path):
            with open(mae_path, encoding="utf-8") as f:
                parts["fedmae"] = json.load(f)
        else:
            parts["fedmae"] = {"method": "Fed-MAE", "verdict": "Fed-MAE: no result (the part failed or ran out of "
                                                               f"time; exit code {mae.exitcode})"}
    verdicts = [v for p in parts.values() for v in (p.get("verdicts") or [p.get("verdict")]) if v]
    summary = {"size": size, "device": device, "device_name": _device_name(device), "seeds": list(seeds),
               "budget_s": budget_s, "seconds": round(time.time() - t0, 1), "torch": torch.__version__,
               "environment": environment(), "verdicts": verdicts, "parts": parts}
    _write_json(os.path.join(out, "evidence.json"), summary)
    plot_evidence(summary, os.path.join(out, "evidence.png"))
    for v in verdicts:
        say(v)
    return summary


def _device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    import platform

    return platform.processor() or platform.machine()


def _seed_points(ax, x: float, values: Sequence[float]) -> None:
    if values:
        ax.plot([x] * len(values), values, "o", color="black", markersize=3, zorder=3)


def _loss_panel(ax, curves: dict, chance: tuple, ylabel: str, title: str) -> None:
    """One loss curve per seed by round, and ``chance = (level, label)`` as a dashed line when the level is known."""
    for seed, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=f"seed {seed}")
    if chance[0] is not None:
        ax.axhline(chance[0], color="grey", linestyle="--", label=chance[1])
    ax.set_xlabel("round")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)


def evidence_panels(summary: dict) -> list[str]:
    """The panels :func:`plot_evidence` draws, in order, from what ``summary["parts"]`` holds: ``fcl`` (its
    fine-tuning rows), ``fcl_loss`` (its pre-training curves), ``fedmae`` (its test rows), ``fedmae_pretrain`` and
    ``fedmae_finetune`` (its loss curves by seed)."""
    parts = summary["parts"]
    fcl, mae = parts.get("fcl") or {}, parts.get("fedmae") or {}
    have = {
        "fcl": bool(fcl.get("finetune", {}).get("rows")),
        "fcl_loss": bool(fcl.get("pretrain", {}).get("by_seed")),
        "fedmae": bool(mae.get("rows")),
        "fedmae_pretrain": bool(mae.get("pretrain", {}).get("loss_by_seed")),
        "fedmae_finetune": bool(mae.get("finetune", {}).get("loss_by_seed")),
    }
    return [k for k, ok in have.items() if ok]


def plot_evidence(summary: dict, path: str) -> str:
    """One panel per method: the baseline and the pre-trained model at each cell, mean over seeds with the SE
    over seeds as error bars and every seed's value as a dot; each pre-training's loss by round against its chance
    level (FCL: ln(K+1); Fed-MAE: predicting the mean of the normalised pixels), and Fed-MAE's fine-tuning loss by
    round from both starts against ln(classes), so a run at chance shows whether the losses moved."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = summary["parts"]
    panels = evidence_panels(summary)
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(4.2 * max(1, len(panels)), 3.4), squeeze=False)
    for ax, key in zip(axes[0], panels):
        if key == "fcl":
            rows = parts["fcl"]["finetune"]["rows"]
            ns = sorted({r["n_labelled"] for r in rows})
            for j, method in enumerate(("random", "FCL")):
                for i, n in enumerate(ns):
                    by_seed = {}
                    for r in rows:
                        if r["method"] == method and r["n_labelled"] == n:
                            by_seed.setdefault(r["seed"], []).append(r["dice"])
                    vals = [float(np.mean(v)) for v in by_seed.values()]
                    x = i + (j - 0.5) * 0.35
                    se = se_over_seeds(vals)
                    ax.bar(x, np.mean(vals), 0.33, yerr=se or 0, capsize=3, color=("#bbbbbb", "#3b75af")[j],
                           label=method if i == 0 else None)
                    _seed_points(ax, x, vals)
            ax.set_xticks(range(len(ns)), [f"N={n}" for n in ns])
            ax.set_ylabel("Dice (mean over sites)")
            ax.set_title("FCL, Table 1 local fine-tuning")
            ax.legend(fontsize=8)
        elif key == "fcl_loss":
            pre = parts["fcl"]["pretrain"]
            _loss_panel(ax, {seed: run["loss_local"] for seed, run in pre["by_seed"].items()},
                        (pre["chance_loss_local"], "ln(K+1)"), "local contrastive loss", "FCL pre-training")
        elif key == "fedmae_pretrain":
            pre = parts["fedmae"]["pretrain"]
            _loss_panel(ax, pre["loss_by_seed"], (pre.get("chance_loss"), "predict the mean"),
                        "MAE loss (normalised pixels)", "Fed-MAE pre-training")
        elif key == "fedmae_finetune":
            mae = parts["fedmae"]
            for c, (seed, by_init) in enumerate(mae["finetune"]["loss_by_seed"].items()):
                for init, style in (("fedmae", "-"), ("scratch", ":")):
                    losses = by_init.get(init) or []
                    ax.plot(range(1, len(losses) + 1), losses, style, color=f"C{c}", label=f"{init}, seed {seed}")
            n_classes = len((mae.get("data") or {}).get("test") or {})
            if n_classes > 1:
                ax.axhline(math.log(n_classes), color="grey", linestyle="--", label=f"ln {n_classes}")
            ax.set_xlabel("round")
            ax.set_ylabel("fine-tuning loss (sites' mean)")
            ax.set_title("Fed-MAE (solid) and scratch (dotted)")
            ax.legend(fontsize=6, ncol=2)
        else:
            rows = parts["fedmae"]["rows"]
            for j, init in enumerate(("scratch", "fedmae")):
                vals = [float(r["accuracy"]) for r in rows if r["init"] == init]
                se = se_over_seeds(vals)
                ax.bar(j, np.mean(vals), 0.6, yerr=se or 0, capsize=3, color=("#bbbbbb", "#c4622d")[j])
                _seed_points(ax, j, vals)
            ax.set_xticks([0, 1], ["ViT scratch", "Fed-MAE"])
            ax.set_ylabel("test accuracy")
            ax.set_title("Fed-MAE, Split-3")
    fig.suptitle(f"fedssl bench evidence ({summary['size']}, {summary['device_name']}, seeds "
                 f"{', '.join(map(str, summary['seeds']))})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, default=_json_default)
    os.replace(tmp, path)


def _json_default(obj):
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return float(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, tuple):
        return list(obj)
    raise TypeError(f"not JSON: {type(obj).__name__}")


