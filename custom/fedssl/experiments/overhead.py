"""What FLARE adds to the cost of training: the same local work as a bare loop and as a simulator job.

``fedssl bench overhead`` takes a job (default ``fcl_acdc_finetune``, federated U-Net fine-tuning) with a profile
and overrides, builds it, and runs its site-1 executor's local trainer -- the very trainer the executor builds,
from the job's own client arguments, on the same data, batch and steps -- in two ways:

(a) **bare**: one process, ``rounds`` calls of ``train_round``, nothing else;
(b) **FLARE**: ``nvflare simulator`` with one site and the same number of rounds.

Per round it reports the bare time, the FLARE round time (steady state: rounds after the first, from the server's
round timestamps) and the site's own ``train_round`` time inside FLARE (the site's metrics file), and splits the
difference into parts measured on their own, in this process, on the job's real payload:

- ``serialise``: FOBS encoding and decoding of the model message, both directions;
- ``aggregate``: the server's FedAvgAggregator ``accept`` + ``aggregate`` of one contribution;
- ``filters``: the communication meter's serialisation (download and upload meter);
- ``site_extras``: what the bundle's executor does around training (validation of the received global model
  where the executor does it, the client checkpoint);
- ``startup``: simulator wall time minus the rounds (process start, job deployment, end of run).

The FLARE round itself is split by the server log's timestamps (:func:`round_phases`): waiting for the site to
ask for its task (FLARE's clients ask again ``task_request_interval`` = 2 s after each task, a server setting),
the site's round trip (download, the executor's work, upload; its ``train_round`` time comes from the site's
metrics file), result to aggregation (``task_check_period`` 0.5 s), aggregation and persisting, and the
transition to the next round (memory clean-up every round, ``memory_gc_rounds`` = 1).
"""

from __future__ import annotations

import datetime
import importlib
import io
import json
import os
import re
import statistics
import tempfile
import time

import torch

from fedssl.experiments.job_data import write_job_data
from fedssl.experiments.server_scaling import BenchEngine
from fedssl.ops.jobs import REPO_ROOT, configured_job
from fedssl.ops.simulate import run_simulation

JOBS = os.path.join(REPO_ROOT, "jobs")


#: executors whose ``receive`` validates the received global model every round (timed as a site extra)
VALIDATING_EXECUTORS = ("SegmentationExecutor", "Seg3DExecutor")
#: executors whose trainer needs a handshake with the server before the first round, which the bare loop does
#: not replay: the bench refuses their jobs with the reason
HANDSHAKE_EXECUTORS = {
    "MultiLabelExecutor": "surgical aggregation's sites learn the network's classes and the method from the server's "
                          "registration round",
    "FedDRAExecutor": "FedDRA's sites need the federated vocabulary (a word-count exchange) before training, and a "
                      "turn is two tasks (stage 1 and 2)"}


def _site_context(site: str, root: str):
    from nvflare.apis.fl_constant import ReservedKey
    from nvflare.apis.fl_context import FLContext

    ctx = FLContext()
    ctx.set_prop(ReservedKey.IDENTITY_NAME, site, private=False, sticky=False)
    ctx.set_prop(ReservedKey.ENGINE, BenchEngine(root=root), private=True, sticky=False)
    return ctx


def _executor(job_dir: str, profile: str | None, sets: list[str], data_root: str):
    """The job's (first) client executor, built from its configured arguments, reading ``data_root``."""
    files = configured_job(job_dir, profile=profile, sets=sets, n_sites=1)
    client = next(v for k, v in files.items() if k.endswith("config_fed_client.json"))
    spec = client["executors"][0]["executor"]
    module, cls = spec["path"].rsplit(".", 1)
    args = dict(spec["args"], data_root=data_root)
    return spec["id"], getattr(importlib.import_module(module), cls)(**args)


def _executor_class(job_dir: str) -> str:
    """The class name of the job's (first) client executor, read from its config."""
    client = next(v for k, v in configured_job(job_dir).items() if k.endswith("config_fed_client.json"))
    return client["executors"][0]["executor"]["path"].rsplit(".", 1)[1]


def _timed(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def component_times(trainer, site_extras_eval: bool, tmp: str) -> dict:
    """Seconds of each part of a FLARE round measured on its own, on this trainer's model message."""
    import numpy as np
    from nvflare.apis.dxo import DXO, DataKind
    from nvflare.apis.fl_constant import ReservedKey
    from nvflare.apis.shareable import Shareable
    from nvflare.app_common.abstract.model import make_model_learnable
    from nvflare.app_common.app_constant import AppConstants

    from fedssl.flare.communication_meter import register_decomposers
    from fedssl.flare.fedavg_aggregator import FedAvgAggregator

    register_decomposers()
    state = {k: v.detach().cpu().numpy() for k, v in trainer.global_state().items()}
    message = DXO(DataKind.WEIGHTS, data=state, meta={"num_samples": 10, "loss": 0.5}).to_shareable()
    encoded = message.to_bytes()
    serialise = 2 * _timed(lambda: Shareable.from_bytes(message.to_bytes()))  # download + upload

    def aggregate() -> None:
        from nvflare.apis.fl_context import FLContext

        ctx = FLContext()
        ctx.set_prop(ReservedKey.ENGINE, BenchEngine(["site-1"]), private=True, sticky=False)
        ctx.set_prop(AppConstants.GLOBAL_MODEL, make_model_learnable(state, {}), private=True, sticky=False)
        ctx.set_prop(AppConstants.CURRENT_ROUND, 0, private=True, sticky=False)
        s = DXO(DataKind.WEIGHTS, data={k: v.copy() for k, v in state.items()}, meta={"num_samples": 10}).to_shareable()
        s.set_peer_props({ReservedKey.IDENTITY_NAME: "site-1"})
        s.add_cookie(AppConstants.CONTRIBUTION_ROUND, 0)
        agg = FedAvgAggregator()
        if not agg.accept(s, ctx):
            raise RuntimeError("overhead: the aggregator refused the probe contribution")
        agg.aggregate(ctx)

    def extras() -> None:
        if site_extras_eval:
            trainer.evaluate("val")
        buf = io.BytesIO()
        torch.save({"round": 0, "trainer": trainer.state_dict()}, buf)

    return {"serialise": serialise, "aggregate": _timed(aggregate),
            "filters": serialise / 2,  # two meters, one encoding each
            "site_extras": _timed(extras), "message_mb": round(len(encoded) / 2**20, 3),
            "parameters": int(sum(np.asarray(v).size for v in state.values()))}


_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) - (\w+) - .*?\] - (.*)$")
#: server log messages (FLARE 2.9 ScatterAndGather / ServerRunner) that bound the phases of a round
_EVENTS = (("started", re.compile(r"^Round (\d+) started\.")), ("sent", re.compile(r"^sent task assignment to client")),
           ("accepted", re.compile(r"^Contribution from \S+ ACCEPTED by the aggregator at round (\d+)")),
           ("aggregating", re.compile(r"^Start aggregation\.")), ("finished", re.compile(r"^Round (\d+) finished\.")))
PHASES = ("waiting_for_task_request", "site_round_trip", "result_to_aggregation", "aggregation_and_persist",
          "round_transition")


def round_phases(log_path: str) -> list[dict]:
    """Per round, seconds between the server's log events: round started -> task sent to the (single) site
    (the site waits ``task_request_interval`` before it asks again) -> its result accepted (download, site
    work, upload) -> aggregation starts (``task_check_period``) -> round finished (aggregation, persist) ->
    next round started (memory clean-up, snapshot)."""
    events: list[tuple[str, float, int | None]] = []
    with open(log_path, errors="replace") as f:
        for line in f:
            m = _STAMP.match(line.rstrip("\n"))
            if not m:
                continue
            t = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            for name, pattern in _EVENTS:
                e = pattern.match(m.group(3))
                if e:
                    events.append((name, t, int(e.group(1)) if e.groups() else None))
    rounds: dict[int, dict[str, float]] = {}
    current = None
    for name, t, r in events:
        if name == "started":
            current = r
        if current is not None:
            rounds.setdefault(current, {}).setdefault(name, t)
    out = []
    for r in sorted(rounds):
        ev, nxt = rounds[r], rounds.get(r + 1, {})
        if all(k in ev for k in ("started", "sent", "accepted", "aggregating", "finished")):
            out.append({"round": r, "waiting_for_task_request": ev["sent"] - ev["started"],
                        "site_round_trip": ev["accepted"] - ev["sent"],
                        "result_to_aggregation": ev["aggregating"] - ev["accepted"],
                        "aggregation_and_persist": ev["finished"] - ev["aggregating"],
                        "round_transition": (nxt["started"] - ev["finished"]) if "started" in nxt else None})
    return out


def run_overhead(out: str, job: str = "fcl_acdc_finetune", data_root: str | None = None, profile: str | None = "quick",
                 sets: list[str] = (), rounds: int = 5) -> dict:
    """(a) bare loop vs (b) simulator, same trainer / data / steps; writes ``overhead.json`` under ``out``."""
    if rounds < 2:
        raise ValueError(f"bench overhead: rounds={rounds}; use at least 2 (the first round is the warm-up)")
    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    job_dir = job if os.path.isdir(job) else os.path.join(JOBS, job)
    kind = _executor_class(job_dir)
    if kind in HANDSHAKE_EXECUTORS:
        raise ValueError(f"bench overhead: {os.path.basename(job_dir)} is not supported: {HANDSHAKE_EXECUTORS[kind]}; "
                         "the bare loop starts from the job's configuration alone")
    if data_root is None:  # the job's own kind of data, synthetic, for one site
        data_root = write_job_data(job_dir, os.path.join(out, "data"), n_sites=1)
    site_dir = data_root.replace("{site}", "site-1")
    sets = [*sets, f"server.scatter_and_gather.num_rounds={rounds}"]

    # (a) bare
    _, executor = _executor(job_dir, profile, sets, site_dir)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = executor.build_trainer(_site_context("site-1", tmp), rounds)
        bare = []
        for r in range(rounds):
            t0 = time.perf_counter()
            trainer.train_round(r, lambda: False)
            bare.append(time.perf_counter() - t0)
        parts = component_times(trainer, type(executor).__name__ in VALIDATING_EXECUTORS, tmp)

    # (b) FLARE simulator, one site
    run = run_simulation(job_dir, os.path.join(out, "ws"), n_sites=1, data_root=data_root, profile=profile,
                         sets=sets, echo=False)
    ends = [r["time_s"] for r in run["rounds"]]
    flare_rounds = [b - a for a, b in zip(ends, ends[1:])]
    site_metrics = []
    run_site = os.path.join(run["workspace"], "site-1", "simulate_job")
    for name in os.listdir(run_site):
        if name.endswith("_metrics.jsonl"):
            with open(os.path.join(run_site, name)) as f:
                site_metrics = [json.loads(line) for line in f if line.strip()]
    site_train = [m["time_s"] for m in site_metrics if "time_s" in m]
    bare_round = statistics.median(bare[1:])
    flare_round = statistics.median(flare_rounds)
    site_round = statistics.median(site_train[1:]) if len(site_train) > 1 else None
    phases = round_phases(os.path.join(run["workspace"], "server", "log.txt"))[1:]  # steady rounds

    def median_phase(name: str) -> float | None:
        values = [p[name] for p in phases if p.get(name) is not None]
        return round(statistics.median(values), 3) if values else None
    result = {
        "job": os.path.basename(job_dir), "profile": profile, "sets": list(sets), "rounds": rounds,
        "device": "cuda" if torch.cuda.is_available() else "cpu", "threads": torch.get_num_threads(),
        "parameters": parts["parameters"], "message_mb": parts["message_mb"],
        "bare_round_s": round(bare_round, 3), "flare_round_s": round(flare_round, 3),
        "site_train_round_s_in_flare": None if site_round is None else round(site_round, 3),
        "ratio_flare_to_bare": round(flare_round / bare_round, 3),
        # the executor's training step against the bare trainer's: train_round time, bare / inside FLARE
        "training_throughput_vs_bare": None if not site_round else round(bare_round / site_round, 3),
        "phases_s": {name: median_phase(name) for name in PHASES},
        "site_other_s": (round(median_phase("site_round_trip") - site_round, 3)
                         if site_round is not None and median_phase("site_round_trip") is not None else None),
        "in_process_s": {"serialise_both_directions": round(parts["serialise"], 4),
                         "meters": round(parts["filters"], 4), "aggregate_one_site": round(parts["aggregate"], 4),
                         "site_validation_and_checkpoint": round(parts["site_extras"], 4)},
        "startup_and_shutdown_s": round(float(run["simulator_wall_time_s"]) - ends[-1], 1),
        "simulator_wall_time_s": run["simulator_wall_time_s"], "bare_rounds_s": [round(b, 3) for b in bare],
        "flare_rounds_s": [round(f, 3) for f in flare_rounds],
    }
    with open(os.path.join(out, "overhead.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(format_overhead(result))
    return result


def format_overhead(r: dict) -> str:
    p, q = r["phases_s"], r["in_process_s"]
    lines = [f"{r['job']} ({r['profile']} profile, {r['device']}, {r['parameters'] / 1e6:.2f} M parameters, "
             f"message {r['message_mb']} MB), median of rounds 2..{r['rounds']}:",
             f"  bare loop (train_round)        {r['bare_round_s']:8.3f} s/round",
             f"  FLARE simulator                {r['flare_round_s']:8.3f} s/round  ({r['ratio_flare_to_bare']:.2f}x "
             "bare)", "  the FLARE round, from the server log:"]
    if r.get("training_throughput_vs_bare") is not None:
        lines.insert(3, f"  training inside the executor   {100 * r['training_throughput_vs_bare']:7.1f} % of the bare "
                        "loop's throughput (train_round time)")
    labels = {"waiting_for_task_request": "site waits to ask for the task", "site_round_trip": "site round trip",
              "result_to_aggregation": "result -> aggregation", "aggregation_and_persist": "aggregation + persist",
              "round_transition": "round transition"}
    for name in PHASES:
        if p.get(name) is not None:
            lines.append(f"    {labels[name]:<30} {p[name]:8.3f} s")
            if name == "site_round_trip" and r.get("site_train_round_s_in_flare") is not None:
                lines.append(f"      of which train_round         {r['site_train_round_s_in_flare']:8.3f} s, the rest "
                             f"{r['site_other_s']:.3f} s (download, validation, checkpoint, upload)")
    lines.append("  measured on their own: " + ", ".join(f"{k.replace('_', ' ')} {v:.3f} s" for k, v in q.items()))
    lines.append(f"  start-up + shutdown            {r['startup_and_shutdown_s']:8.1f} s (once per run)")
    return "\n".join(lines)
