"""Twenty sites (issue 46, item 4): server memory, round time and the admin console's answer time as sites are added.

For each number of sites ``n`` the same small job (by default FCL's quick profile: U-Net 8 at 96 px, two rounds) runs
on ``n`` sites of synthetic ACDC (10 patients each, written once for the largest ``n``), in two deployments:

- ``simulator``: ``nvflare simulator -n n -t n`` (:func:`fedssl.ops.simulate.run_simulation`); FLARE runs the server
  in the simulator's process and each site in a process of its own;
- ``provisioned``: a provisioned server, ``n`` sites and the admin client on loopback, each a process started from
  its startup kit (:class:`fedssl.ops.deploy.LoopbackDeployment`), the job submitted through the admin API.

Measured per deployment and ``n`` (one row each in ``site_scaling.json``, written after every row; a rerun into
the same ``--out`` keeps the rows it has and runs the rest):

- ``server_peak_mb``: the peak resident memory of the server's processes (provisioned: the server's parent process
  and the job process it starts; simulator: its command, its manager and the process that holds the server, i.e.
  every process of the run but the site workers), sampled every ``SAMPLE_S`` seconds; ``sites_peak_mb``: the peak
  of all site processes together (the simulator's ``simulator_worker`` processes);
- ``round_s``: the seconds of a round after the first (the server log's "Round r started." to "Round r finished.";
  ``first_round_s``: the first, which also waits for each site's job process to start and import); on a machine
  with fewer cores than sites the sites' local training shares the cores, so this grows with ``n`` even when FLARE's
  own cost does not (``round_s_per_site`` divides it by ``n``);
- ``admin_ms`` (provisioned): how long the admin console takes to answer ``get_system_info`` (the server and every
  connected site), asked every ``ADMIN_EVERY_S`` seconds while the job runs: median and worst;
- ``startup_s`` (provisioned): provisioning and starting the system until every site is connected.

Nothing here is tuned on a score; the job's numbers are not read.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
import threading
import time
from datetime import datetime

import psutil

from fedssl.data.acdc_synthetic import write_synthetic_acdc
from fedssl.ops.deploy import SERVER, LoopbackDeployment
from fedssl.ops.drill import planned_rounds
from fedssl.ops.jobs import REPO_ROOT, build_job
from fedssl.ops.simulate import run_simulation

JOB = os.path.join(REPO_ROOT, "jobs", "fcl_acdc")
MODES: tuple[str, ...] = ("simulator", "provisioned")
REPORT = "site_scaling.json"
#: seconds between two memory samples
SAMPLE_S = 0.5
#: seconds between two admin questions while a job runs
ADMIN_EVERY_S = 2.0
#: the synthetic sites: patients per site, slice size, cine frames (the fault drill's small data)
PATIENTS_PER_SITE, SHAPE, FRAMES = 10, (96, 96), 6


def tree_rss_mb(pids, recursive: bool = True) -> float:
    """Resident memory (MB) of the processes ``pids`` and (``recursive``) all their descendants, each counted once."""
    seen, total = set(), 0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root, *(root.children(recursive=True) if recursive else [])]
        except psutil.NoSuchProcess:
            continue
        for p in procs:
            if p.pid in seen:
                continue
            seen.add(p.pid)
            with contextlib.suppress(psutil.NoSuchProcess):  # a process that ended while we looked holds nothing
                total += p.memory_info().rss
    return total / 2**20


class PeakMemory(threading.Thread):
    """Samples ``groups`` (name -> ``(pids, recursive)``: a callable returning the group's processes, and whether
    their descendants count too) every ``every_s`` seconds until :meth:`stop`; ``peaks`` holds each group's largest
    sum in MB."""

    def __init__(self, groups: dict, every_s: float = SAMPLE_S):
        super().__init__(name="peak-memory", daemon=True)
        self.groups, self.every_s = groups, float(every_s)
        self.peaks = {name: 0.0 for name in groups}
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            for name, (pids, recursive) in self.groups.items():
                with contextlib.suppress(psutil.Error, OSError):  # a process list changing under us: the next counts
                    self.peaks[name] = max(self.peaks[name], tree_rss_mb(pids(), recursive))
            self._halt.wait(self.every_s)

    def stop(self) -> dict:
        self._halt.set()
        self.join(timeout=10)
        return {name: round(v, 1) for name, v in self.peaks.items()}


def latency_summary(seconds: list[float], failed: int = 0) -> dict:
    """``{"calls", "failed", "median", "max"}``: the admin's answer times in milliseconds (``None`` when none was
    answered) and how many questions got no answer (their times are not in the median)."""
    if not seconds:
        return {"calls": int(failed), "failed": int(failed), "median": None, "max": None}
    return {"calls": len(seconds) + int(failed), "failed": int(failed),
            "median": round(1000 * statistics.median(seconds), 1), "max": round(1000 * max(seconds), 1)}


ROUND_LINE = re.compile(r"^(\S+ \S+) .*Round (\d+) (started|finished)\.")


def round_seconds(log_path: str | None) -> list[float]:
    """Each round's seconds in a server log, from its "Round r started." to its "Round r finished." (rounds that
    did not finish are left out)."""
    if not log_path or not os.path.isfile(log_path):
        return []
    start: dict[int, datetime] = {}
    out: dict[int, float] = {}
    with open(log_path, errors="replace") as f:
        for line in f:
            m = ROUND_LINE.match(line)
            if m:
                t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")
                r = int(m.group(2))
                if m.group(3) == "started":
                    start.setdefault(r, t)
                elif r in start:
                    out[r] = round((t - start[r]).total_seconds(), 2)
    return [out[r] for r in sorted(out)]


def _per_round(row: dict, log_path: str | None) -> None:
    """``round_s``: the mean of the rounds after the first (the first also waits for every site's job process to
    start); ``first_round_s``: the first round's."""
    rounds = round_seconds(log_path)
    row["rounds_s"] = rounds
    row["first_round_s"] = rounds[0] if rounds else None
    later = rounds[1:]
    row["round_s"] = round(sum(later) / len(later), 2) if later else None
    row["round_s_per_site"] = round(row["round_s"] / row["sites"], 3) if row["round_s"] is not None else None


def simulator_row(job: str, workspace: str, n: int, data_root: str, rounds: int, timeout_s: float) -> dict:
    """One simulator run of the built ``job`` on ``n`` sites, measured."""
    me = os.getpid()

    def split() -> tuple[list[int], list[int]]:  # (the simulator's own processes, its site workers' trees)
        try:
            procs = psutil.Process(me).children(recursive=True)
        except psutil.NoSuchProcess:
            return [], []
        sites: set[int] = set()
        for p in procs:
            with contextlib.suppress(psutil.Error):  # a process that ended while we looked is no site
                if any("simulator_worker" in a for a in p.cmdline()):
                    sites |= {p.pid, *(c.pid for c in p.children(recursive=True))}
        return [p.pid for p in procs if p.pid not in sites], sorted(sites)

    mem = PeakMemory({"server": (lambda: split()[0], False), "sites": (lambda: split()[1], False)})
    t0 = time.time()
    mem.start()
    try:
        s = run_simulation(job, workspace, n_sites=n, data_root=data_root, timeout_s=int(timeout_s), echo=False)
    finally:
        peaks = mem.stop()
    if not peaks["sites"]:
        raise RuntimeError("simulator: no simulator_worker process was seen, so the sites' memory is unknown; FLARE's "
                           "simulator no longer runs its sites in such processes: update site_scaling.simulator_row")
    row = {"mode": "simulator", "sites": n, "completed": True, "job_s": round(time.time() - t0, 1),
           "server_peak_mb": peaks["server"], "sites_peak_mb": peaks["sites"],
           "rounds": len(s.get("rounds") or []), "rounds_planned": rounds, "admin_ms": latency_summary([])}
    _per_round(row, os.path.join(workspace, "server", "log.txt"))  # the simulated server's log
    return row


def provisioned_row(job: str, workspace: str, n: int, data_root: str, rounds: int, timeout_s: float) -> dict:
    """One provisioned loopback system of ``n`` sites running the built ``job``, measured."""
    from fedssl.ops.admin import run_job_in_session

    with LoopbackDeployment(workspace, n_sites=n, data_root=data_root, startup_timeout_s=max(120.0, 15.0 * n)) as d:
        server_pid = d.procs[SERVER].pid
        site_pids = [d.procs[f"site-{i}"].pid for i in range(1, n + 1)]
        mem = PeakMemory({"server": (lambda: [server_pid], True), "sites": (lambda: site_pids, True)})
        answers: list[float] = []
        unanswered: list[str] = []
        done = threading.Event()

        def ask() -> None:  # the admin console's questions, in a session of their own, while the job runs
            sess = d.session()
            try:
                while not done.wait(ADMIN_EVERY_S):
                    t = time.perf_counter()
                    try:
                        sess.get_system_info()
                    except Exception as e:  # no answer: counted apart, with its cause, not as an answer time
                        unanswered.append(f"{type(e).__name__}: {e}")
                        continue
                    answers.append(time.perf_counter() - t)
            finally:
                sess.close()

        asker = threading.Thread(target=ask, name="admin-questions", daemon=True)
        mem.start()
        asker.start()
        sess = d.session()
        try:
            r = run_job_in_session(sess, job, timeout_s=timeout_s, echo=False,
                                   download_to=os.path.join(d.workspace, "results"))
        finally:
            sess.close()
            done.set()
            asker.join(timeout=60)
            peaks = mem.stop()
        row = {"mode": "provisioned", "sites": n, "completed": r["status"] == "FINISHED:COMPLETED",
               "status": r["status"], "job_s": r["job_s"], "startup_s": d.timings.get("startup_s"),
               "server_peak_mb": peaks["server"], "sites_peak_mb": peaks["sites"],
               "rounds_planned": rounds, "admin_ms": latency_summary(answers, len(unanswered)),
               "admin_unanswered": unanswered[:5]}
        log = os.path.join(r["result_dir"], "workspace", "log.txt") if r.get("result_dir") else None
        summary = os.path.join(r["result_dir"], "workspace", "summary.json") if r.get("result_dir") else None
        row["rounds"] = 0
        if summary and os.path.isfile(summary):
            with open(summary) as f:
                row["rounds"] = len(json.load(f).get("rounds") or [])
        _per_round(row, log)
    row["leftover_processes"] = d.leftover_processes()
    return row


def run_site_scaling(out: str, *, sites=(2, 5, 10, 20), modes=MODES, job: str = JOB, profile: str = "quick",
                     sets=(), timeout_s: float = 1800.0, say=print) -> dict:
    """Every (mode, n) row, resumable in ``out``; writes ``site_scaling.json`` after each row and the plot at the
    end.  Returns the report."""
    sites = sorted({int(n) for n in sites})
    if not sites or sites[0] < 1:
        raise ValueError(f"sites={sites!r}: give one or more site counts of at least 1, e.g. 2 5 10 20")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"modes={list(modes)!r}: {bad} unknown; use some of {list(MODES)}")
    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, REPORT)
    config = {"job": os.path.relpath(os.path.abspath(job), REPO_ROOT), "profile": profile, "sets": list(sets),
              "patients_per_site": PATIENTS_PER_SITE, "shape": list(SHAPE), "frames": FRAMES,
              "cpu_count": os.cpu_count()}
    report = {"config": config, "rows": []}
    if os.path.isfile(path):
        with open(path) as f:
            old = json.load(f)
        if old.get("config") != config:
            raise ValueError(f"{path} was measured with {old.get('config')}; this run is {config}: use another --out")
        report = old
    data = os.path.join(out, "data")
    if not os.path.isdir(os.path.join(data, f"site-{sites[-1]}")):
        say(f"writing synthetic ACDC for {sites[-1]} sites -> {data}")
        write_synthetic_acdc(data, n_patients=PATIENTS_PER_SITE * sites[-1], n_sites=sites[-1], seed=0, shape=SHAPE,
                             n_frames=FRAMES)
    data_root = os.path.join(data, "{site}")
    t_all = time.time()
    for n in sites:
        built = build_job(job, os.path.join(out, "jobs", f"n{n}", os.path.basename(os.path.abspath(job))),
                          profile=profile, sets=list(sets), n_sites=n)
        rounds = planned_rounds(built)
        for mode in modes:
            if any(r["mode"] == mode and r["sites"] == n for r in report["rows"]):
                continue
            ws = os.path.join(out, "ws", f"{mode}_n{n}")
            say(f"[{mode}, {n} sites] running")
            measure = simulator_row if mode == "simulator" else provisioned_row
            row = measure(built, ws, n, data_root, rounds, timeout_s)
            say(f"[{mode}, {n} sites] {format_row(row)}")
            report["rows"].append(row)
            with open(path, "w") as f:
                json.dump(report, f, indent=1)
    report["wall_s"] = round(time.time() - t_all, 1)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    plot(report, os.path.join(out, "site_scaling.png"))
    say(table(report))
    return report


def format_row(r: dict) -> str:
    admin = r["admin_ms"]
    return (f"{'completed' if r['completed'] else 'NOT completed'} in {r['job_s']} s; round {r['round_s']} s; "
            f"server peak {r['server_peak_mb']:.0f} MB, sites {r['sites_peak_mb']:.0f} MB"
            + (f"; admin {admin['median']} ms median, {admin['max']} ms worst of {admin['calls']}"
               if admin["median"] is not None else "")
            + (f"; {admin['failed']} admin questions unanswered" if admin.get("failed") else ""))


def table(report: dict) -> str:
    """The rows as the markdown table in provisioning/README.md."""
    lines = ["| deployment | sites | completed | first round (s) | later rounds (s) | per site (s) | server peak (MB) "
             "| sites peak (MB) | admin answer, median / worst (ms) | start-up (s) |", "|---" * 10 + "|"]
    for r in sorted(report["rows"], key=lambda r: (r["mode"], r["sites"])):
        a = r["admin_ms"]
        admin = "-" if not a["calls"] else (f"{a['median']:.0f} / {a['max']:.0f}" if a["median"] is not None
                                            else "none answered") + f" ({a['calls']}"
        admin += f", {a['failed']} unanswered)" if a.get("failed") else (")" if a["calls"] else "")
        lines.append(f"| {r['mode']} | {r['sites']} | {'yes' if r['completed'] else 'no'} | {r.get('first_round_s')} | "
                     f"{r['round_s']} | "
                     f"{r['round_s_per_site']} | {r['server_peak_mb']:.0f} | {r['sites_peak_mb']:.0f} | {admin} | "
                     f"{r.get('startup_s') if r.get('startup_s') is not None else '-'} |")
    return "\n".join(lines)


def plot(report: dict, path: str) -> str:
    """Round time, server peak memory and the admin's median answer against sites, a line per deployment."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("round_s", "seconds per round"), ("server_peak_mb", "server peak memory (MB)"),
              ("admin_median_ms", "admin answer, median (ms)"))
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    for ax, (key, label) in zip(axes, panels):
        for mode in MODES:
            rows = sorted((r for r in report["rows"] if r["mode"] == mode), key=lambda r: r["sites"])
            pts = [(r["sites"], r["admin_ms"]["median"] if key == "admin_median_ms" else r[key]) for r in rows]
            pts = [(x, y) for x, y in pts if y is not None]
            if pts:  # a colour per deployment in every panel (the simulator has no admin answers)
                ax.plot(*zip(*pts), marker="o", label=mode, color=f"C{MODES.index(mode)}")
        ax.set_xlabel("sites")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
