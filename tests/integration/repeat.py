"""Same command, same numbers: run a job twice in the FLARE simulator and compare the final global models bit for bit.

The second run goes into the same workspace, so every party reuses the secrets it drew in the first
(``<workspace>_secrets``, see ``fedssl.ops.simulate.run_simulation``): the same workspace and command must give the
same model.  A third run into the same workspace with another training seed must give another model, so that the
equality is not that of a run that ignores its seed (or trains nothing).
"""

from __future__ import annotations

import os

import torch

from fedssl.ops.simulate import run_simulation

#: run first in every Python process the simulator starts (sitecustomize on PYTHONPATH): the process-wide generators
#: of torch, numpy and random start from fresh OS entropy, so a draw from them (torch's would otherwise start from
#: the same default seed in every fresh process) makes two runs differ, as it would between a site's restarts
SCRAMBLER = """
import os, random
random.seed(os.urandom(16))
import numpy
numpy.random.seed(int.from_bytes(os.urandom(4), "little"))
import torch
torch.manual_seed(int.from_bytes(os.urandom(7), "little"))
"""


def scramble_global_rngs(monkeypatch, folder) -> None:
    """Every simulator process started after this call begins with entropy-seeded global generators."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "sitecustomize.py"), "w") as f:
        f.write(SCRAMBLER)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH")) if p))


def tensors(obj, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a saved object, by its path of keys."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(tensors(v, f"{prefix}/{k}" if prefix else str(k)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(tensors(v, f"{prefix}/{i}"))
    return out


#: one simulator run's bound: a run that hangs fails its test instead of stalling the whole suite
RUN_TIMEOUT_S = 420
#: how often a run that FLARE delivered incompletely is started again
INCOMPLETE_RETRIES = 2


def whole_run(job: str, workspace: str, *, n_sites: int, sets: list[str], **kwargs) -> dict:
    """``run_simulation`` whose every round aggregated all ``n_sites`` sites.  FLARE 2.9's simulator can start a
    site's process under another site's name (``SimulatorRunner.do_one_task`` writes each site's name into one
    dictionary shared by all site threads before sending it to the new process; seen in the server log as
    ``peer=site-1 ... got result from client site-2``): the aggregator discards the second result under that name
    and the round goes on without the other site (the summary counts it in ``duplicate_results_discarded``).  That
    run is another computation, not a repeat, so it is started again into the same workspace (same secrets, same
    command), at most INCOMPLETE_RETRIES times."""
    for _ in range(INCOMPLETE_RETRIES + 1):
        run = run_simulation(job, workspace, sets=list(sets), n_sites=n_sites, timeout_s=RUN_TIMEOUT_S, **kwargs)
        short = [r["round"] for r in run["rounds"] if r["aggregated_sites"] != n_sites]
        if not short and not run["duplicate_results_discarded"]:
            return run
        print(f"rounds {short} of {job} aggregated fewer than {n_sites} sites "
              f"({run['duplicate_results_discarded']} duplicate results discarded); running it again", flush=True)
    raise AssertionError(f"{job}: FLARE delivered an incomplete round in each of {INCOMPLETE_RETRIES + 1} runs "
                         f"(rounds {short}); see {run['log']}")


def final_model(run: dict) -> dict[str, torch.Tensor]:
    return tensors(torch.load(run["global_model"], map_location="cpu", weights_only=True))


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
    return [k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]


def repeat_twice(job: str, workspace: str, *, n_sites: int, data_root: str, sets: list[str],
                 profile: str = "quick") -> dict[str, torch.Tensor]:
    """Two runs of ``job`` with ``sets`` into ``workspace`` give the same global model to the bit; returns it."""
    kwargs = dict(n_sites=n_sites, data_root=data_root, profile=profile, echo=False)
    first = final_model(whole_run(job, workspace, sets=sets, **kwargs))
    again = final_model(whole_run(job, workspace, sets=sets, **kwargs))
    assert first, "the global model holds no tensors"
    diff = differing(first, again)
    assert not diff, f"{len(diff)} of {len(first)} tensors differ between two runs of the same command, e.g. {diff[:3]}"
    return first


def check_repeatable(job: str, workspace: str, *, n_sites: int, data_root: str, sets: list[str],
                     other_seed: list[str], profile: str = "quick") -> None:
    """:func:`repeat_twice`, and a run with ``other_seed`` added gives another global model."""
    first = repeat_twice(job, workspace, n_sites=n_sites, data_root=data_root, sets=sets, profile=profile)
    other = final_model(whole_run(job, workspace, sets=[*sets, *other_seed], n_sites=n_sites,
                                  data_root=data_root, profile=profile, echo=False))
    assert differing(first, other), f"a run with {other_seed} gave the same global model: the seed is not used"
