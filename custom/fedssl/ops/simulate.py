"""Run a job folder in the FLARE simulator with a profile, and check that it really produced results.

``nvflare simulator`` can exit 0 when clients failed to build their components, so success here means:
the server wrote its summary and the global model, every round aggregated at least one site, and no
client logged a task failure.  Before it starts, the job is checked against the allow-list the sites get
(:func:`fedssl.ops.policy.refusals`): a job naming a class a site would refuse is not run at all, and a
refusal FLARE logs during a run is reported by class name, not only as a missing global model.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

from fedssl.flare.party_folder import SECRETS_DIR_ENV
from fedssl.ops.jobs import build_job
from fedssl.ops.policy import REFUSED, refusals, write_allow_list

RUN_NAME = "simulate_job"
PROGRESS = re.compile(r"(round \d+/\d+: .*|aggregated \d+/\d+ sites.*|REJECTED.*|task \w+ failed: .*|summary "
                      r"written.*)")
DUPLICATE = re.compile(r"(\S+) already contributed to round (\d+); duplicate discarded")
REJECTED = re.compile(r"Contribution from (\S+) REJECTED by the aggregator at round (\d+)")
#: FLARE's ComponentPathAuthorizer refusing a component, and the config file it was in (<site>/<run>/app_*/config/)
NOT_ALLOWED = re.compile(r"Component '([^']+)' at config path '[^']*' is not in allow_list")
#: FLARE's authorisation refusing a job with custom code (the role has no ``byoc`` right)
NO_BYOC = re.compile(r"BYOC not permitted")
#: FLARE's simulator losing the process of a site (its runner thread gives the site up: the site never runs again
#: in this simulation, and a round that waits for every site waits forever).  Seen on a loaded machine, before the
#: site had run anything: "Communication error with client site-1: [Errno 104] Connection reset by peer"; or a
#: site's runner giving up before its first task: "cannot sync with server Runner after 60.0 seconds".
LOST_SITE = re.compile(r"(Communication error with client \S+: .*|Subprocess died for client \S+[ ,].*"
                       r"|cannot sync with \S+ Runner after [\d.]+ seconds)")
CONFIG_OF_SITE = re.compile(r"/([^/'\s]+)/[^/'\s]+/app_[^/'\s]*/config/config_fed_\w+\.json")


class FailureLog:
    """The site failures in a simulator log, line by line.  A second result under a name that already contributed
    (the aggregator: "site-1 already contributed to round 1; duplicate discarded", then FLARE: "Contribution from
    site-2 REJECTED ... round 1") means FLARE's simulator ran a site's process under another site's name
    (jobs/README.md): the REJECTED line that follows a duplicate warning of the same round is paired with it,
    whatever the name, and is not a site failure; the summary's ``duplicate_results_discarded`` counts both kinds,
    and :attr:`lost` makes :func:`simulate` start the run again."""

    def __init__(self):
        self.failures: list[str] = []
        self._duplicates: list[str] = []  # rounds of duplicate warnings not yet paired with FLARE's REJECTED line
        self.duplicates = 0
        self._refused: dict[str, set[str]] = {}
        self.lost: str | None = None  # FLARE's first line saying the simulator lost a site's process

    def read(self, line: str, site: str | None = None) -> None:
        """One log line; ``site`` names whose log it is, where the line itself does not say."""
        lost = LOST_SITE.search(line)
        if lost and self.lost is None:
            self.lost = lost.group(1).strip()
        refused = NOT_ALLOWED.search(line)
        if refused or NO_BYOC.search(line):
            what = (f"class {refused.group(1)} is not allowed" if refused
                    else "it carries custom code (BYOC not permitted)")
            where = CONFIG_OF_SITE.search(line)
            names = self._refused.setdefault(what, set())
            if where or site:
                names.add(where.group(1) if where else site)
            return
        dup = DUPLICATE.search(line)
        if dup:
            self._duplicates.append(dup.group(2))
            if self.lost is None:  # a second result under one name: a site's process ran as another site
                self.lost = f"{dup.group(0)}: a site's process ran under another site's name"
            return
        rej = REJECTED.search(line)
        if rej and rej.group(2) in self._duplicates:
            self._duplicates.remove(rej.group(2))
            self.duplicates += 1
            return
        m = PROGRESS.search(line)
        if m and ("failed:" in line or "REJECTED" in line):
            self.failures.append(m.group(1))

    def refusals(self) -> list[str]:
        """One line per class a site refused to build (or per refused BYOC job), with the sites (FLARE logs each
        refusal several times)."""
        return [f"{REFUSED}: {what}" + (f" (at {', '.join(sorted(sites))})" if sites else "")
                for what, sites in sorted(self._refused.items())]


class SimulationError(RuntimeError):
    """The simulator run did not produce its results (exit code, missing model/summary, failed sites)."""


def secrets_dir(workspace: str) -> str:
    """Where the simulated parties keep their secrets (``<workspace>_secrets/<party name>/``): beside the workspace,
    which the simulator clears, so they survive a rerun into the same workspace."""
    return os.path.abspath(workspace) + "_secrets"


def server_run_dir(workspace: str) -> str:
    return os.path.join(workspace, "server", RUN_NAME)


def global_model_path(workspace: str) -> str:
    return os.path.join(server_run_dir(workspace), "app_server", "FL_global_model.pt")


def nvflare_command() -> list[str]:
    """How to start FLARE's command line: the ``nvflare`` beside this Python (its virtual environment, also when
    it is not on PATH), else the one on PATH, else ``python -m nvflare.cli`` with this Python."""
    beside = os.path.join(os.path.dirname(sys.executable), "nvflare")
    if os.path.isfile(beside) and os.access(beside, os.X_OK):
        return [beside]
    found = shutil.which("nvflare")
    return [found] if found else [sys.executable, "-m", "nvflare.cli"]


def simulator_command() -> list[str]:
    """How to start FLARE's simulator: FLARE's own command line with its site-name race fixed
    (:mod:`fedssl.ops.flare_simulator`), by this Python."""
    return [sys.executable, "-m", "fedssl.ops.flare_simulator"]


def stop_process_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stop ``proc`` and every process of its group (it was started with ``start_new_session``): SIGTERM, then
    SIGKILL after ``grace_s``; a group already gone is fine."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        # the parent is gone; its children may linger in the group (a group already empty is the goal reached)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        return


def simulate(job: str, workspace: str, *, n_sites: int, env: dict, threads: int | None = None,
             timeout_s: float | None = None, echo: bool = True, retries: int = 2
             ) -> tuple[int, FailureLog, str, float]:
    """``nvflare simulator job -w workspace -n N -t threads`` (built job, the parties' environment ``env``), its
    output into ``<workspace>_simulator.log``; returns (exit code, the log's FailureLog, the log's path, start time).

    FLARE's simulator runs through :mod:`fedssl.ops.flare_simulator`, which fixes its site-name race (a site's
    process started under another site's name).  It can still lose a site's process (:data:`LOST_SITE`); it then
    runs on without the site, and a round that needs every site never ends.  Should a result still arrive under a
    name that already contributed (the aggregator's "already contributed ... duplicate discarded"; that run trains
    one site's data twice and another's never), it is treated the same.  The run is stopped at once and started
    again into the same workspace (the parties reuse their secrets, so it is the same run), at most ``retries``
    times, each with one line on stdout; after that SimulationError names the site and FLARE's line.
    ``timeout_s`` bounds each attempt."""
    if not (isinstance(retries, int) and not isinstance(retries, bool) and retries >= 0):
        raise ValueError(f"retries={retries!r} must be a whole number >= 0 (0: never start a run again)")
    workspace = os.path.abspath(workspace)
    threads = threads or n_sites  # -t = -n: no client restarts between tasks
    cmd = [*simulator_command(), "simulator", job, "-w", workspace, "-n", str(n_sites), "-t", str(threads)]
    log_path = workspace + "_simulator.log"
    for attempt in range(retries + 1):
        for stale in ("server", *[f"site-{i}" for i in range(1, n_sites + 1)]):
            path = os.path.join(workspace, stale)
            if os.path.isdir(path):
                shutil.rmtree(path)
        t0 = time.time()
        rc, failure_log = _simulate_once(cmd, env, log_path, timeout_s, echo, t0)
        if failure_log.lost is None:
            return rc, failure_log, log_path, t0
        if attempt < retries:
            print(f"FLARE's simulator lost a site's process ({failure_log.lost}); starting the run again "
                  f"(attempt {attempt + 2} of {retries + 1})", flush=True)
    raise SimulationError(f"{os.path.basename(job)}: FLARE's simulator lost a site's process in each of "
                          f"{retries + 1} attempts ({failure_log.lost}); full log: {log_path}")


def _simulate_once(cmd: list[str], env: dict, log_path: str, timeout_s: float | None, echo: bool,
                   t0: float) -> tuple[int, FailureLog]:
    failure_log = FailureLog()
    lost = threading.Event()
    with open(log_path, "w") as log:
        # its own process group: stopping this run (Ctrl-C, a timeout, an error here) stops every process the
        # simulator started, its site processes included, not only the parent
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)

        def pump() -> None:  # the output is read beside the wait, so timeout_s holds while the output is open
            for line in proc.stdout:
                log.write(line)
                failure_log.read(line)
                if failure_log.lost is not None:
                    lost.set()
                m = PROGRESS.search(line)
                if m and echo:
                    print(f"  [{time.time() - t0:6.1f}s] {m.group(1)}", flush=True)

        reader = threading.Thread(target=pump, name="simulator-output", daemon=True)
        reader.start()
        try:
            while True:
                if lost.is_set():  # the run cannot complete: stop it now rather than wait for the timeout
                    stop_process_group(proc)
                    reader.join(timeout=10.0)
                    return -1, failure_log
                try:
                    rc = proc.wait(timeout=1.0)
                    break
                except subprocess.TimeoutExpired:
                    if timeout_s is not None and time.time() - t0 > timeout_s:
                        raise
            reader.join(timeout=60.0)
            if reader.is_alive():  # the simulator exited but something it started still holds its output
                stop_process_group(proc)
                reader.join(timeout=10.0)
        except subprocess.TimeoutExpired:
            stop_process_group(proc)
            reader.join(timeout=10.0)
            raise SimulationError(f"simulator exceeded {timeout_s}s; see {log_path}") from None
        except BaseException:
            stop_process_group(proc)
            raise
    return rc, failure_log


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
    retries: int = 2,
) -> dict:
    """Build the job with the profile, run ``nvflare simulator -n N -t N`` and return the server summary.

    A job that names a class the sites' allow-list does not hold (or carries custom code) is refused before
    anything runs: SimulationError "site refused the job: class X is not allowed".  A site that fails a task
    (bad data, rejected contribution, a refused component) makes this raise SimulationError, unless
    ``tolerate_site_failures``: then the run must still complete, and the failures are listed in the
    summary under ``site_failures``.

    Each party's secrets (feature noise, remote-bank order) are kept in ``<workspace>_secrets/<party>/``
    (:func:`secrets_dir`, passed as ``FEDSSL_SECRETS_DIR``): rerunning into the same workspace repeats the run,
    a new workspace draws new secrets.  A run in which FLARE's simulator lost a site's process is started again
    (at most ``retries`` times, see :func:`simulate`).
    """
    workspace = os.path.abspath(workspace)
    os.makedirs(workspace, exist_ok=True)
    # the simulator owns the workspace folder (it clears it), so the built job and the log live beside it
    job = build_job(job_dir, os.path.join(workspace + "_job", os.path.basename(os.path.abspath(job_dir))),
                    profile=profile, sets=list(sets), n_sites=n_sites)
    # the simulator runs without an authorisation policy (no secure mode), so a site here is its allow-list
    refused = refusals(job, write_allow_list(os.path.join(workspace, "local")))
    if refused:
        raise SimulationError(f"{os.path.basename(job)}: " + "; ".join(refused) + "; nothing was run")
    # the simulator deletes every party's workspace (site config dir included) before each run, so the parties'
    # secrets (fedssl.flare.party_folder) live beside it: a rerun into this workspace repeats them, another draws anew
    env = dict(os.environ, FEDSSL_DATA_ROOT=data_root, PYTHONUNBUFFERED="1",
               **{SECRETS_DIR_ENV: secrets_dir(workspace)})
    # all sites share this machine's cores: one process per site, so split the cores between them
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n_sites)))
    rc, failure_log, log_path, t0 = simulate(job, workspace, n_sites=n_sites, env=env, threads=threads,
                                             timeout_s=timeout_s, echo=echo, retries=retries)
    summary_path = os.path.join(server_run_dir(workspace), "summary.json")
    refused = failure_log.refusals()
    failures = failure_log.failures + refused
    problems = []
    if rc != 0:
        problems.append(f"nvflare simulator exited with {rc}")
    if failure_log.failures and not tolerate_site_failures:
        problems.append("site failures: " + "; ".join(failure_log.failures[:5]))
    if not os.path.isfile(summary_path):
        problems.append(f"no run summary at {summary_path}")
    if not os.path.isfile(global_model_path(workspace)):
        problems.append(f"no global model at {global_model_path(workspace)}")
    if refused and (problems or not tolerate_site_failures):
        problems = refused + problems  # the cause first, then what it left missing
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
    summary["torch_threads_per_site"] = int(env["OMP_NUM_THREADS"])  # what the sites' torch ran with (recorded)
    return summary
