"""Run a job folder in the FLARE simulator with a profile, and check that it really produced results.

``nvflare simulator`` can exit 0 when clients failed to build their components, so success here means:
the server wrote its summary and the global model, every round aggregated at least one site, and no
client logged a task failure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time

from fedssl.ops.jobs import build_job
from fedssl.ops.policy import write_site_local

RUN_NAME = "simulate_job"
PROGRESS = re.compile(r"(round \d+/\d+: .*|aggregated \d+/\d+ sites.*|REJECTED.*|task \w+ failed: .*|summary written.*)")
DUPLICATE = re.compile(r"(\S+) already contributed to round (\d+); duplicate discarded")
REJECTED = re.compile(r"Contribution from (\S+) REJECTED by the aggregator at round (\d+)")


class FailureLog:
    """The site failures in a simulator log, line by line.  FLARE re-sends a task to a site that asks again before
    the server has finished with its result (seen on a loaded machine); the aggregator then discards the second,
    identical-round contribution as a duplicate.  That rejection is not a failure: the site's round counted."""

    def __init__(self):
        self.failures: list[str] = []
        self._duplicates: set[tuple[str, str]] = set()
        self.duplicates = 0

    def read(self, line: str) -> None:
        dup = DUPLICATE.search(line)
        if dup:
            self._duplicates.add(dup.groups())
            return
        rej = REJECTED.search(line)
        if rej and rej.groups() in self._duplicates:
            self._duplicates.discard(rej.groups())
            self.duplicates += 1
            return
        m = PROGRESS.search(line)
        if m and ("failed:" in line or "REJECTED" in line):
            self.failures.append(m.group(1))


class SimulationError(RuntimeError):
    """The simulator run did not produce its results (exit code, missing model/summary, failed sites)."""


def server_run_dir(workspace: str) -> str:
    return os.path.join(workspace, "server", RUN_NAME)


def global_model_path(workspace: str) -> str:
    return os.path.join(server_run_dir(workspace), "app_server", "FL_global_model.pt")


def run_simulation(
    job_dir: str,
    workspace: str,
    *,
    n_sites: int,
    data_root: str,
    profile: str | None = None,
    sets: list[str] = (),
    threads: int | None = None,
    timeout_s: int | None = None,
    echo: bool = True,
    tolerate_site_failures: bool = False,
) -> dict:
    """Build the job with the profile, run ``nvflare simulator -n N -t N`` and return the server summary.

    A site that fails a task (bad data, rejected contribution) makes this raise SimulationError, unless
    ``tolerate_site_failures``: then the run must still complete, and the failures are listed in the
    summary under ``site_failures``.
    """
    workspace = os.path.abspath(workspace)
    os.makedirs(workspace, exist_ok=True)
    # the simulator owns the workspace folder (it clears it), so the built job and the log live beside it
    job = build_job(job_dir, os.path.join(workspace + "_job", os.path.basename(os.path.abspath(job_dir))),
                    profile=profile, sets=list(sets), n_sites=n_sites)
    write_site_local(os.path.join(workspace, "local"))
    for stale in ("server", *[f"site-{i}" for i in range(1, n_sites + 1)]):
        path = os.path.join(workspace, stale)
        if os.path.isdir(path):
            shutil.rmtree(path)
    env = dict(os.environ, FEDSSL_DATA_ROOT=data_root, PYTHONUNBUFFERED="1")
    # all sites share this machine's cores: one process per site, so split the cores between them
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n_sites)))
    threads = threads or n_sites  # -t = -n: no client restarts between tasks
    cmd = ["nvflare", "simulator", job, "-w", workspace, "-n", str(n_sites), "-t", str(threads)]
    log_path = workspace + "_simulator.log"
    t0 = time.time()
    failure_log = FailureLog()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for line in proc.stdout:
            log.write(line)
            failure_log.read(line)
            m = PROGRESS.search(line)
            if m:
                if echo:
                    print(f"  [{time.time() - t0:6.1f}s] {m.group(1)}", flush=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise SimulationError(f"simulator exceeded {timeout_s}s; see {log_path}")
    summary_path = os.path.join(server_run_dir(workspace), "summary.json")
    failures = failure_log.failures
    problems = []
    if rc != 0:
        problems.append(f"nvflare simulator exited with {rc}")
    if failures and not tolerate_site_failures:
        problems.append("site failures: " + "; ".join(failures[:5]))
    if not os.path.isfile(summary_path):
        problems.append(f"no run summary at {summary_path}")
    if not os.path.isfile(global_model_path(workspace)):
        problems.append(f"no global model at {global_model_path(workspace)}")
    if problems:
        raise SimulationError(f"{os.path.basename(job)}: " + "; ".join(problems) + f" (full log: {log_path})")
    with open(summary_path) as f:
        summary = json.load(f)
    summary["simulator_wall_time_s"] = round(time.time() - t0, 1)
    summary["workspace"] = workspace
    summary["global_model"] = global_model_path(workspace)
    summary["site_failures"] = failures
    summary["duplicate_results_discarded"] = failure_log.duplicates
    summary["log"] = log_path
    return summary
