"""Server scaling: time and peak memory of one aggregation as the number of sites grows.

``fedssl bench aggregation`` feeds the bundle's :class:`~fedssl.flare.fedavg_aggregator.FedAvgAggregator` (the
class every FedAvg-style job's server runs) ``n`` contributions of a ViT-B/16-sized model (timm
``vit_base_patch16_224``, 86.6 M parameters, float32) through its public ``accept`` / ``aggregate``, exactly as
ScatterAndGather does: each contribution is built, accepted and dropped before the next arrives (FLARE frees a
task result once the aggregator accepted it).  Each ``n`` runs in a fresh Python process, so its peak resident
set size (``ru_maxrss``) is its own.  Reported per ``n``:

Two rounds run back to back; the figures are the second's (every round after the first reuses the running
sum's buffers), the first's are under ``first_round``:

- ``accept_s``: mean seconds per contribution in ``accept`` (key / shape / dtype / finite / update-ratio checks,
  then the running sum);
- ``aggregate_s``: seconds in ``aggregate`` (the mean out of the running sum);
- ``peak_rss_mb`` and ``extra_rss_mb`` (peak minus the process with the global model and one contribution
  built, before the aggregator saw anything), over both rounds;
- ``extra_traced_mb``: the round's own peak of the buffers allocated after the global model (numpy reports them to
  ``tracemalloc``: the aggregator's sums and held contributions, the contributions in flight, the result) minus the
  one contribution in flight, comparable to ``extra_rss_mb`` but per round.

``mode="flare"`` feeds the same contributions to FLARE's own ``InTimeAccumulateWeightedAggregator`` (weighted by the
same counts, sent as ``NUM_STEPS_CURRENT_ROUND``; no cast, no check, a float32 running sum whose result depends on
the arrival order), the yardstick for the bundle's aggregator with every check on (issue 46).
``mode="held"`` measures the former design for comparison: every checked contribution is held until the round
closes and then averaged (``fedssl.core.state_dict.weighted_average``), which is what makes memory grow with
the number of sites.  The stand-in engine (:class:`BenchEngine`) only names the run's clients; nothing else of FLARE
is faked.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time
import tracemalloc

import numpy as np

SITES = (2, 5, 10, 20, 50)
MODES = ("running", "flare", "held", "paired")


#: model name -> timm architecture: the paper-size ViT-B/16 (86.6 M parameters) and a tiny one for tests
MODELS = {"vit_b16": "vit_base_patch16_224", "tiny": "vit_tiny_patch16_224"}


def vit_state(model: str = "vit_b16", seed: int = 0) -> dict[str, np.ndarray]:
    """A ViT state dict (timm, 1000 classes, random init) as float32 numpy arrays."""
    import timm
    import torch

    if model not in MODELS:
        raise ValueError(f"server scaling: model={model!r}; use one of {sorted(MODELS)}")
    torch.manual_seed(seed)
    model = timm.create_model(MODELS[model], pretrained=False)
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


class _Client:
    def __init__(self, name: str):
        self.name = name


class _Workspace:
    def __init__(self, root: str):
        self.root = root

    def get_site_config_dir(self) -> str:
        return self.root

    def get_run_dir(self, job_id) -> str:
        return self.root


class BenchEngine:
    """What the benches' FLARE components ask of FLARE's engine: the run's clients (an aggregator) or a
    workspace folder (an executor building its trainer); no components, no event listeners."""

    def __init__(self, sites: list[str] = (), root: str = ""):
        self.sites, self.ws = list(sites), _Workspace(root)

    def get_clients(self) -> list[_Client]:
        return [_Client(s) for s in self.sites]

    def get_workspace(self) -> _Workspace:
        return self.ws

    def get_component(self, component_id: str) -> None:
        return None

    def fire_event(self, event_type: str, fl_ctx) -> None:
        return None


def _max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: kilobytes


def measure_one(n_sites: int, mode: str = "running", seed: int = 0, model: str = "vit_b16") -> dict:
    """One aggregation of ``n_sites`` ViT-B contributions (run it in a fresh process for a meaningful peak RSS)."""
    from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
    from nvflare.apis.event_type import EventType
    from nvflare.apis.fl_constant import ReservedKey
    from nvflare.app_common.aggregators.intime_accumulate_model_aggregator import InTimeAccumulateWeightedAggregator
    from nvflare.apis.fl_context import FLContext
    from nvflare.app_common.abstract.model import make_model_learnable
    from nvflare.app_common.app_constant import AppConstants

    from fedssl.core.state_dict import check_contribution, weighted_average
    from fedssl.flare.fedavg_aggregator import FedAvgAggregator

    if mode not in MODES:
        raise ValueError(f"server scaling: mode={mode!r}; use one of {list(MODES)}")
    if mode == "paired":
        return measure_paired(n_sites, seed, model)
    global_model = vit_state(model, seed)
    n_params = int(sum(v.size for v in global_model.values()))
    sites = [f"site-{i}" for i in range(1, n_sites + 1)]
    ctx = FLContext()
    ctx.set_prop(ReservedKey.ENGINE, BenchEngine(sites), private=True, sticky=False)
    ctx.set_prop(AppConstants.GLOBAL_MODEL, make_model_learnable(global_model, {}), private=True, sticky=False)
    ctx.set_prop(AppConstants.CURRENT_ROUND, 0, private=True, sticky=False)

    def contribution(i: int):
        """Site i's model: the global model scaled by (1 + i / 1000) (a distinct, bounded update)."""
        s = DXO(DataKind.WEIGHTS, data={k: v * np.float32(1 + i / 1000) for k, v in global_model.items()},
                meta={"num_samples": 10 + i, MetaKey.NUM_STEPS_CURRENT_ROUND: 10 + i}).to_shareable()
        s.set_peer_props({ReservedKey.IDENTITY_NAME: sites[i]})
        s.add_cookie(AppConstants.CONTRIBUTION_ROUND, 0)
        return s

    probe = contribution(0)  # the baseline holds the global model and one contribution in flight
    del probe
    base_rss = _max_rss_mb()
    model_bytes = sum(v.nbytes for v in global_model.values())
    tracemalloc.start()  # numpy reports its buffers to tracemalloc: each round's own peak, which ru_maxrss cannot give
    if mode == "flare":
        agg = InTimeAccumulateWeightedAggregator(expected_data_kind=DataKind.WEIGHTS)
        agg.handle_event(EventType.START_RUN, ctx)  # builds its helper
    else:
        agg = FedAvgAggregator(weighting="num_samples")
    rounds = []
    for round_idx in range(2):  # round 0 allocates the running sum; round 1 reuses it, as every later round does
        if mode != "flare":  # FLARE's starts a new sum after each aggregate
            agg.reset(ctx)
        held, accept_s = [], 0.0
        tracemalloc.reset_peak()
        for i in range(n_sites):
            s = contribution(i)
            t0 = time.perf_counter()
            if mode in ("running", "flare"):
                if not agg.accept(s, ctx):
                    raise RuntimeError(f"server scaling: the aggregator refused {sites[i]}")
            else:
                held.append(check_contribution(global_model, from_shareable(s).data, sites[i], max_update_ratio=10.0))
            accept_s += time.perf_counter() - t0
            del s
        t0 = time.perf_counter()
        if mode in ("running", "flare"):
            out = from_shareable(agg.aggregate(ctx)).data
        else:
            out = weighted_average(held, [10 + i for i in range(n_sites)])
        aggregate_s = time.perf_counter() - t0
        traced_peak = tracemalloc.get_traced_memory()[1]
        del held
        expected = 1 + sum((10 + i) * i for i in range(n_sites)) / sum(10 + i for i in range(n_sites)) / 1000
        key = "blocks.0.attn.qkv.weight"
        np.testing.assert_allclose(out[key], global_model[key] * expected, rtol=1e-5, atol=1e-7)
        del out
        rounds.append({"accept_s": round(accept_s / n_sites, 3), "aggregate_s": round(aggregate_s, 3),
                       "round_s": round(accept_s + aggregate_s, 2),
                       "extra_traced_mb": round((traced_peak - model_bytes) / 2**20, 1)})
    peak = _max_rss_mb()
    return {"mode": mode, "sites": n_sites, "model": model, "parameters": n_params,
            "model_mb": round(sum(v.nbytes for v in global_model.values()) / 2**20, 1),
            "first_round": rounds[0], **rounds[1], "peak_rss_mb": round(peak, 1),
            "extra_rss_mb": round(peak - base_rss, 1)}


def measure_paired(n_sites: int, seed: int = 0, model: str = "vit_b16") -> dict:
    """The bundle's and FLARE's aggregator in one process, each contribution accepted by both back to back (which one
    first alternates), so that a machine whose load changes loads both alike: the median over the second round's
    contributions of each one's ``accept`` time and of their ratio, and each one's ``aggregate`` time.  The CPU time
    of each ``accept`` (``process_time``: every thread of the process, and only one aggregator runs at a time) is
    reported beside it (``accept_cpu_s``, ``cpu_ratio``): the bundle sums on up to ``SUM_THREADS`` threads and FLARE
    on one, so on a machine whose cores are busy the wall-time ratio moves with the load and the CPU-time ratio
    much less.  Memory is not separable here (``measure_one`` measures it)."""
    from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
    from nvflare.apis.event_type import EventType
    from nvflare.apis.fl_constant import ReservedKey
    from nvflare.apis.fl_context import FLContext
    from nvflare.app_common.abstract.model import make_model_learnable
    from nvflare.app_common.aggregators.intime_accumulate_model_aggregator import InTimeAccumulateWeightedAggregator
    from nvflare.app_common.app_constant import AppConstants

    from fedssl.flare.fedavg_aggregator import FedAvgAggregator

    global_model = vit_state(model, seed)
    sites = [f"site-{i}" for i in range(1, n_sites + 1)]
    ctx = FLContext()
    ctx.set_prop(ReservedKey.ENGINE, BenchEngine(sites), private=True, sticky=False)
    ctx.set_prop(AppConstants.GLOBAL_MODEL, make_model_learnable(global_model, {}), private=True, sticky=False)
    ctx.set_prop(AppConstants.CURRENT_ROUND, 0, private=True, sticky=False)
    flare = InTimeAccumulateWeightedAggregator(expected_data_kind=DataKind.WEIGHTS)
    flare.handle_event(EventType.START_RUN, ctx)
    bundle = FedAvgAggregator(weighting="num_samples")
    times: dict = {}
    for round_idx in range(2):
        bundle.reset(ctx)
        mine, theirs, mine_cpu, theirs_cpu = [], [], [], []
        for i in range(n_sites):
            s = DXO(DataKind.WEIGHTS, data={k: v * np.float32(1 + i / 1000) for k, v in global_model.items()},
                    meta={"num_samples": 10 + i, MetaKey.NUM_STEPS_CURRENT_ROUND: 10 + i}).to_shareable()
            s.set_peer_props({ReservedKey.IDENTITY_NAME: sites[i]})
            s.add_cookie(AppConstants.CONTRIBUTION_ROUND, 0)
            order = [(bundle, mine, mine_cpu), (flare, theirs, theirs_cpu)]
            for agg, seen, cpu in (order if i % 2 == 0 else order[::-1]):
                t0, c0 = time.perf_counter(), time.process_time()
                if not agg.accept(s, ctx):
                    raise RuntimeError(f"server scaling: {type(agg).__name__} refused {sites[i]}")
                seen.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
            del s
        agg_s = {}
        for name, agg in (("bundle", bundle), ("flare", flare)):
            t0 = time.perf_counter()
            out = from_shareable(agg.aggregate(ctx)).data
            agg_s[name] = time.perf_counter() - t0
            expected = 1 + sum((10 + i) * i for i in range(n_sites)) / sum(10 + i for i in range(n_sites)) / 1000
            key = "blocks.0.attn.qkv.weight"
            np.testing.assert_allclose(out[key], global_model[key] * expected, rtol=1e-5, atol=1e-7)
            del out
        times = {"accept_s": float(np.median(mine)), "flare_accept_s": float(np.median(theirs)),
                 "accept_ratio": float(np.median(np.array(mine) / np.array(theirs))),
                 "accept_cpu_s": float(np.median(mine_cpu)), "flare_accept_cpu_s": float(np.median(theirs_cpu)),
                 "cpu_ratio": float(np.median(np.array(mine_cpu) / np.maximum(theirs_cpu, 1e-9))),
                 "aggregate_s": agg_s["bundle"], "flare_aggregate_s": agg_s["flare"]}
    return {"mode": "paired", "sites": n_sites, "model": model,
            **{k: round(v, 4) for k, v in times.items()}}


def run_scaling(out: str | None = None, sites=SITES, modes=("running",), seed: int = 0,
                model: str = "vit_b16") -> list[dict]:
    """Every (mode, n) in its own process, the modes of each ``n`` one after the other; prints a table and writes the
    rows (and the machine) to ``out``."""
    rows = []
    for n in sites:  # the modes of one count back to back, so that a shared machine loads them alike
        for mode in modes:
            cmd = [sys.executable, "-m", "fedssl.experiments.server_scaling", str(int(n)), mode, str(int(seed)), model]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"server scaling: {mode} with {n} sites failed:\n{done.stderr[-2000:]}")
            row = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append(row)
            if mode == "paired":
                print(f"paired   {n:>3} sites: accept {row['accept_s']:.3f} s (bundle) / {row['flare_accept_s']:.3f} s "
                      f"(FLARE), median ratio {row['accept_ratio']:.2f}x (CPU time {row['accept_cpu_s']:.3f} / "
                      f"{row['flare_accept_cpu_s']:.3f} s, {row['cpu_ratio']:.2f}x); aggregate "
                      f"{row['aggregate_s']:.2f} / {row['flare_aggregate_s']:.2f} s", flush=True)
                continue
            print(f"{mode:<8} {n:>3} sites: accept {row['accept_s']:.2f} s/site, aggregate {row['aggregate_s']:.2f} s, "
                  f"round {row['round_s']:.1f} s (first round {row['first_round']['round_s']:.1f} s), peak RSS "
                  f"{row['peak_rss_mb']:.0f} MB (+{row['extra_rss_mb']:.0f} MB over model + one contribution; rounds "
                  f"+{row['first_round']['extra_traced_mb']:.0f} / +{row['extra_traced_mb']:.0f} MB traced)",
                  flush=True)
        pair = {r["mode"]: r for r in rows if r["sites"] == n}
        if "running" in pair and "flare" in pair and pair["flare"]["accept_s"] > 0:
            mine, theirs = pair["running"], pair["flare"]
            print(f"{n:>3} sites: the bundle's accept takes {mine['accept_s'] / theirs['accept_s']:.2f}x FLARE's, its "
                  f"peak RSS is {mine['peak_rss_mb'] - theirs['peak_rss_mb']:+.0f} MB", flush=True)
    for mode in modes:
        mine = [r for r in rows if r["mode"] == mode and "peak_rss_mb" in r]
        if len(mine) > 1:
            ratio = max(r["peak_rss_mb"] for r in mine) / min(r["peak_rss_mb"] for r in mine)
            print(f"{mode}: peak RSS from {mine[0]['sites']} to {mine[-1]['sites']} sites grows {ratio:.2f}x")
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump({"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                                   "python": platform.python_version()}, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":  # one measurement per process: python -m fedssl.experiments.server_scaling N MODE SEED MODEL
    print(json.dumps(measure_one(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4])))
