"""The fault drill (issue 46): one job, run on a provisioned loopback system through network and process faults.

``fedssl deploy-local JOB -w WS --sites 3 --data-root ... --faults SCENARIO[,SCENARIO...]`` first runs the job
fault-free (``WS/none``), then once per scenario (``WS/<scenario>``), each on a freshly provisioned system whose
sites reach the server through a :class:`fedssl.ops.faults.FaultProxy` each, and whose participants start with
the fault-free run's party secrets, so that the same job can repeat the same draws.  ``WS/fault_drill.json``
reports, per scenario: completed or not, rounds completed of those planned, every round's summary present, the
wall time over the fault-free run's, whether the final global model is bit-identical to the fault-free one (the
largest absolute difference otherwise), and the processes left behind after the stop (none expected).

Scenarios (the moments are tied to the job's progress: "mid-job" is one second after the server's log says round 1
started, or round 0 for a one-round job):

- ``none``: no fault (the fault-free run itself);
- ``latency``: every site's link 100 ms +- 20 ms each way, capped at 20 MB/s each way, from the start;
- ``partition``: mid-job, site-1's link holds all traffic for 30 s, then releases it;
- ``resets``: every site's link is reset (both sides, TCP RST) at 3 seeded moments in the job's first 60 s;
- ``kill-site``: mid-job, site-2 and its job process are SIGKILLed; its kit starts it again 30 s later;
- ``stop-site``: mid-job, site-2 and its job process are SIGSTOPped for 90 s, then SIGCONTinued;
- ``kill-server``: mid-job, the server and its job process are SIGKILLed; its kit starts it again 10 s later.
  FLARE 2.9 no longer resumes a job after a server restart: ``ServerEngine.persist_components`` is a no-op ("Component
  snapshot persistence has been removed") and nothing calls ``JobRunner.restore_running_job``; the kit's
  ``snapshot_persistor`` (kept inside the workspace, see ``isolate_server_storage``) is configured but never written.
  So once every site is connected again the drill does what the admin does: it aborts the stranded job and submits
  the same job again, which resumes after its last finished round (``fedssl.flare.round_checkpoint``, which this
  scenario adds to its copy of the job); the entry names both jobs, and the round the new one resumed after.
"""

from __future__ import annotations

import glob
import json
import os
import re
import threading
import time
from dataclasses import asdict, dataclass

from fedssl.ops.deploy import SERVER, LoopbackDeployment
from fedssl.ops.jobs import build_job

SCENARIOS = ("none", "latency", "partition", "resets", "kill-site", "stop-site", "kill-server")
REPORT = "fault_drill.json"


@dataclass
class DrillSettings:
    """The sizes of the faults; the defaults are the issue's."""

    latency_s: float = 0.1
    jitter_s: float = 0.02
    bandwidth_bytes_per_s: float = 20e6
    partition_s: float = 30.0
    resets: int = 3
    reset_window_s: float = 60.0
    restart_site_after_s: float = 30.0
    stop_site_for_s: float = 90.0
    restart_server_after_s: float = 10.0
    #: the site that is partitioned (partition) / the site that is killed or stopped (kill-site, stop-site)
    partition_site: str = "site-1"
    victim_site: str = "site-2"
    #: how long to wait for the job after the server came back (kill-server)
    after_server_restart_s: float = 120.0
    #: seconds after the server's "Round R started." that a mid-job fault strikes (the sites are training)
    mid_round_delay_s: float = 1.0

    def __post_init__(self):
        for name, value in asdict(self).items():
            if name.endswith("_site"):
                if not isinstance(value, str) or not re.fullmatch(r"site-[1-9]\d*", value):
                    raise ValueError(f"DrillSettings: {name}={value!r} is not a site name; use site-K, e.g. site-2")
            elif name == "resets":
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValueError(f"DrillSettings: resets={value!r} is not a whole number >= 0; use e.g. 3")
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ValueError(f"DrillSettings: {name}={value!r} is not a finite number >= 0; use seconds "
                                 "(bytes/s for bandwidth_bytes_per_s)")

    def check_sites(self, scenarios: list[str], n_sites: int) -> None:
        """ValueError unless the sites the scenarios act on exist among site-1..site-N."""
        uses = {"partition": self.partition_site, "kill-site": self.victim_site, "stop-site": self.victim_site}
        for scenario in scenarios:
            site = uses.get(scenario)
            if site is not None and int(site.split("-")[1]) > n_sites:
                raise ValueError(f"--faults {scenario}: acts on {site}, but --sites is {n_sites}; use --sites "
                                 f"{site.split('-')[1]} or more")


def parse_scenarios(text: str) -> list[str]:
    """``"latency,kill-site"`` or ``"all"`` -> the scenarios, each checked."""
    names = list(SCENARIOS) if text == "all" else [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in SCENARIOS]
    if not names or bad:
        raise ValueError(f"--faults {text!r}: unknown scenario {bad[0] if bad else text!r}; use one or more of "
                         f"{', '.join(SCENARIOS)} (comma-separated) or all")
    return names


def planned_rounds(job_dir: str) -> int:
    """``num_rounds`` of the job's round workflow (the one with ``num_rounds``)."""
    for path in glob.glob(os.path.join(job_dir, "**", "config_fed_server.json"), recursive=True):
        with open(path) as f:
            for wf in json.load(f).get("workflows", []):
                if "num_rounds" in wf.get("args", {}):
                    return int(wf["args"]["num_rounds"])
    raise ValueError(f"{job_dir}: no workflow with num_rounds in config_fed_server.json; the drill counts rounds")


def model_difference(a_path: str, b_path: str) -> dict:
    """Load both global models with ``torch.load(weights_only=True)``: ``{"identical", "max_abs_diff"}``."""
    import torch

    def flat(obj, prefix=""):
        if isinstance(obj, torch.Tensor):
            yield prefix, obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                yield from flat(v, f"{prefix}.{k}" if prefix else str(k))

    a = dict(flat(torch.load(a_path, map_location="cpu", weights_only=True)))
    b = dict(flat(torch.load(b_path, map_location="cpu", weights_only=True)))
    if a.keys() != b.keys():
        return {"identical": False, "max_abs_diff": None,
                "key_mismatch": sorted(set(a) ^ set(b))[:10]}
    diff = 0.0
    identical = True
    for k in a:
        if a[k].shape != b[k].shape or a[k].dtype != b[k].dtype:
            return {"identical": False, "max_abs_diff": None, "shape_mismatch": k}
        identical = identical and torch.equal(a[k], b[k])
        if a[k].numel() and (a[k].is_floating_point() or a[k].is_complex()):
            diff = max(diff, float((a[k].double() - b[k].double()).abs().max()))
        elif a[k].numel():
            diff = max(diff, float((a[k].long() - b[k].long()).abs().max()))
    return {"identical": identical, "max_abs_diff": diff}


def _server_job_log(d: LoopbackDeployment, job_id: str) -> str:
    return os.path.join(d.kits[SERVER], job_id, "log.txt")


def _rounds_in_log(path: str) -> list[int]:
    if not os.path.isfile(path):
        return []
    with open(path, errors="replace") as f:
        return [int(m) for m in re.findall(r"Round (\d+) finished\.", f.read())]


def training_seconds(log_path: str) -> float | None:
    """Seconds from the server's "Round 0 started." to its last "Round N finished." (the rounds themselves, without
    provisioning, start-up, scheduling and download), from the job's server log; None if either line is missing."""
    from datetime import datetime

    if not log_path or not os.path.isfile(log_path):
        return None
    start = end = None
    with open(log_path, errors="replace") as f:
        for line in f:
            if "Round 0 started." in line and start is None:
                start = line[:23]
            elif re.search(r"Round \d+ finished\.", line):
                end = line[:23]
    if not (start and end):
        return None
    fmt = "%Y-%m-%d %H:%M:%S,%f"
    return round((datetime.strptime(end, fmt) - datetime.strptime(start, fmt)).total_seconds(), 1)


def _cause(job_log: str, server_log: str, job_id: str) -> str | None:
    """The first server line that says why a finished job failed: in the job's log (CRITICAL, a run aborted),
    else in the server's own log ("Failing job <id>: terminal outcome unavailable from site-2: missing job on
    client")."""
    sources = ((job_log, (" - CRITICAL - ", "Aborting current RUN")), (server_log, (f"Failing job {job_id}",)))
    for path, marks in sources:
        if os.path.isfile(path):
            with open(path, errors="replace") as f:
                for line in f:
                    if any(m in line for m in marks):
                        return re.sub(r"\[identity=[^]]*\] - ", "", line.strip())[:300]
    return None


class _Faults(threading.Thread):
    """Applies one scenario's faults, timed by the job's progress; records what it did and when."""

    def __init__(self, d: LoopbackDeployment, scenario: str, job_id: str, rounds: int, s: DrillSettings,
                 t0: float):
        super().__init__(name=f"drill-{scenario}", daemon=True)
        self.d, self.scenario, self.job_id, self.s, self.t0 = d, scenario, job_id, s, t0
        self.mid_round = 1 if rounds > 1 else 0
        self.done = threading.Event()
        self.events: list[dict] = []
        self.error: str | None = None
        self.server_back = threading.Event()

    def note(self, what: str) -> None:
        self.events.append({"t_s": round(time.time() - self.t0, 1), "event": what})

    def wait(self, seconds: float) -> bool:
        """Sleep; False if the drill is over."""
        return not self.done.wait(seconds)

    def wait_mid_job(self) -> bool:
        pattern = f"Round {self.mid_round} started."
        path = _server_job_log(self.d, self.job_id)
        while not self.done.is_set():
            if os.path.isfile(path):
                with open(path, errors="replace") as f:
                    if pattern in f.read():
                        self.note(f"server: {pattern}")
                        return self.wait(self.s.mid_round_delay_s)  # the sites have their task
            time.sleep(0.1)
        return False

    def run(self) -> None:
        try:
            getattr(self, "_" + self.scenario.replace("-", "_"))()
        except Exception as e:  # reported in the scenario's entry; the job's outcome is judged on its own
            self.error = f"{type(e).__name__}: {e}"
            self.note(f"fault driver failed: {self.error}")

    def _none(self) -> None:
        pass  # the fault-free run: nothing to drive mid-job

    def _latency(self) -> None:
        pass  # set before the job is submitted (see run_scenario)

    def _partition(self) -> None:
        if self.wait_mid_job():
            self.d.proxies[self.s.partition_site].partition(self.s.partition_s)
            self.note(f"{self.s.partition_site}: partition {self.s.partition_s:g} s")

    def _resets(self) -> None:
        for site, proxy in self.d.proxies.items():
            moments = proxy.schedule_resets(self.s.resets, self.s.reset_window_s)
            self.note(f"{site}: resets at {[round(m, 1) for m in moments]} s")

    def _kill_site(self) -> None:
        if self.wait_mid_job():
            site = self.s.victim_site
            self.d.kill(site)
            self.note(f"{site}: SIGKILL")
            time.sleep(self.s.restart_site_after_s)  # also when the job ended meanwhile: the site comes back
            self.d.start_participant(site)
            self.note(f"{site}: restarted from its kit")
            if self._connected(site):
                self.note(f"{site}: connected again")

    def _connected(self, site: str, timeout_s: float = 90.0) -> bool:
        """True once the restarted site has registered with the server again (its second "Successfully registered"
        line; the server keeps listing a killed site as connected until its heartbeat times out, so the server's
        client list proves nothing)."""
        path = os.path.join(self.d.kits[site], "log.txt")
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if os.path.isfile(path):
                with open(path, errors="replace") as f:
                    if f.read().count(f"Successfully registered client:{site}") >= 2:
                        return True
            time.sleep(1)
        return False

    def _stop_site(self) -> None:
        if self.wait_mid_job():
            n = self.d.pause(self.s.victim_site)
            self.note(f"{self.s.victim_site}: SIGSTOP ({n} processes)")
            time.sleep(self.s.stop_site_for_s)  # the full time, also when the job ended meanwhile
            self.d.resume(self.s.victim_site)
            self.note(f"{self.s.victim_site}: SIGCONT")

    def _kill_server(self) -> None:
        if self.wait_mid_job():
            self.d.kill(SERVER)
            self.note("server: SIGKILL")
            if self.wait(self.s.restart_server_after_s):  # the job cannot end while the server is down
                self.d.start_participant(SERVER)
                self.note("server: restarted from its kit")
                self.d.wait_for_sites()
                self.note("server: every site connected again")
                self.server_back.set()


def _status(d: LoopbackDeployment, job_id: str, sess_box: list) -> str | None:
    """The job's status, or None when the server does not answer (a new admin session is tried next time)."""
    try:
        if not sess_box:
            sess_box.append(d.session(timeout=10))
        return sess_box[0].get_job_meta(job_id).get("status")
    except Exception:  # server down or restarting: try again with a fresh session
        if sess_box:
            try:
                sess_box.pop().close()
            except Exception:  # the broken session cannot close cleanly: dropped
                pass
        return None


def with_round_checkpoint(job_dir: str) -> str:
    """A copy of the built job ``job_dir`` (``<job_dir>_resumable``) whose server config also names
    :class:`fedssl.flare.round_checkpoint.RoundCheckpoint`, which the kill-server scenario needs to resume; the
    jobs do not name it by default (it is opt-in, see provisioning/README.md)."""
    import shutil

    out = job_dir.rstrip(os.sep) + "_resumable"
    if os.path.isdir(out):
        shutil.rmtree(out)
    shutil.copytree(job_dir, out)
    for path in glob.glob(os.path.join(out, "**", "config_fed_server.json"), recursive=True):
        with open(path) as f:
            config = json.load(f)
        if not any(c.get("id") == "round_checkpoint" for c in config.get("components", [])):
            config.setdefault("components", []).append(
                {"id": "round_checkpoint", "path": "fedssl.flare.round_checkpoint.RoundCheckpoint", "args": {}})
        with open(path, "w") as f:
            json.dump(config, f, indent=2)
    return out


def _close_sessions(sess_box: list) -> None:
    """Close every admin session in ``sess_box`` and empty it.  A session that a server kill broke raises on close;
    it holds nothing left to release, so that error is the one dropped (an open session keeps threads alive)."""
    for sess in sess_box:
        try:
            sess.close()
        except Exception:  # noqa: BLE001 -- broken by the kill: nothing left to close
            continue
    sess_box.clear()


def _resubmit(d: LoopbackDeployment, job_dir: str, old_id: str, sess_box: list, entry: dict, say) -> str:
    """kill-server: what the admin does once the server is back.  FLARE 2.9 leaves the killed job RUNNING in its
    store with nothing running it, so: abort it, and submit the same job again, which resumes after its last
    finished round (the job's RoundCheckpoint).  Returns the new job's id; ``entry`` records both."""
    _close_sessions(sess_box)
    sess_box.append(d.session(timeout=30))
    try:
        sess_box[0].abort_job(old_id)
        answer = "aborted"
    except Exception as e:  # the old job's record may refuse an abort; the new submission goes ahead
        answer = f"abort refused: {str(e)[:160]}"
    entry["aborted_job"], entry["abort_answer"] = old_id, answer
    new_id = sess_box[0].submit_job(os.path.abspath(job_dir))
    entry["resubmitted_job"] = new_id
    say(f"[kill-server] {old_id}: {answer}; submitted again as {new_id}")
    return new_id


def _drive(d: LoopbackDeployment, job_dir: str, scenario: str, rounds: int, s: DrillSettings, timeout_s: float,
           sess_box: list, entry: dict, say) -> None:
    """Submit the job, apply the scenario's faults, wait for the end; fill ``entry``."""
    t0 = time.time()
    job_id = sess_box[0].submit_job(os.path.abspath(job_dir))
    say(f"[{scenario}] submitted job {job_id}")
    faults = _Faults(d, scenario, job_id, rounds, s, t0)
    faults.start()
    status, deadline = None, t0 + timeout_s
    try:
        while time.time() < deadline:
            status = _status(d, job_id, sess_box) if d.procs[SERVER].poll() is None else None
            if status and status.startswith("FINISHED"):
                break
            if scenario == "kill-server" and faults.server_back.is_set():
                faults.server_back.clear()
                job_id = _resubmit(d, job_dir, job_id, sess_box, entry, say)
                faults.note(f"admin: aborted {entry['aborted_job']} ({entry['abort_answer']}), submitted it again "
                            f"as {job_id}")
                deadline = time.time() + s.after_server_restart_s
            time.sleep(2)
    finally:
        faults.done.set()  # on Ctrl-C the deployment stops at once and refuses the driver's late restarts
    faults.join(timeout=s.stop_site_for_s + s.restart_site_after_s + s.restart_server_after_s + 180)
    entry["job_s"] = round(time.time() - t0, 1)
    entry["status"] = status or "UNKNOWN (no answer)"
    entry["completed"] = status == "FINISHED:COMPLETED"
    entry["faults"] = faults.events
    if faults.error:
        entry["fault_error"] = faults.error
    result_dir = None
    if status and status.startswith("FINISHED") and sess_box:
        result_dir = sess_box[0].download_job_result(job_id, os.path.join(d.workspace, "results"))
    ws = os.path.join(result_dir, "workspace") if result_dir else None
    summary_path = os.path.join(ws, "summary.json") if ws else None
    if summary_path and os.path.isfile(summary_path):
        with open(summary_path) as f:
            summary = json.load(f)
        per_round = summary.get("rounds", [])
        resumed = summary.get("resumed_after_round")  # a resubmitted job that resumed (RoundCheckpoint)
        before = resumed + 1 if isinstance(resumed, int) and not isinstance(resumed, bool) else 0
        if before:
            entry["resumed_after_round"] = resumed
        entry["rounds_completed"] = before + len(per_round)
        entry["aggregated_sites"] = [r.get("aggregated_sites") for r in per_round]
        entry["round_summaries_present"] = len(per_round) == rounds - before and all(
            isinstance(r, dict) and "aggregated_sites" in r for r in per_round)
    else:
        logged = _rounds_in_log(os.path.join(ws, "log.txt") if ws else _server_job_log(d, job_id))
        entry["rounds_completed"] = len(set(logged))
        entry["round_summaries_present"] = False
    if ws and not entry["completed"]:
        entry["cause"] = _cause(os.path.join(ws, "log.txt"), os.path.join(d.kits[SERVER], "log.txt"), job_id)
    entry["training_s"] = training_seconds(os.path.join(ws, "log.txt") if ws else _server_job_log(d, job_id))
    model = os.path.join(ws, "app_server", "FL_global_model.pt") if ws else None
    entry["global_model"] = model if model and os.path.isfile(model) else None
    entry["proxies"] = {n: {k: p.stats()[k] for k in ("connections", "refused_upstream", "resets", "up", "down")}
                        for n, p in d.proxies.items()}
    try:
        entry["connected_at_end"] = sorted(c.name for c in sess_box[0].get_connected_client_list())
    except Exception:  # no session (server down at the end): unknown
        entry["connected_at_end"] = None


def run_scenario(job_dir: str, workspace: str, scenario: str, *, n_sites: int, data_root: str, seed: int = 0,
                 settings: DrillSettings | None = None, timeout_s: float = 900, secrets_from: str | None = None,
                 say=print) -> dict:
    """Run ``job_dir`` once on a fresh proxied loopback system under ``scenario``; the entry of the report
    (without the comparison with the fault-free run)."""
    if scenario not in SCENARIOS:
        raise ValueError(f"scenario={scenario!r} is unknown; use one of {', '.join(SCENARIOS)}")
    s = settings or DrillSettings()
    s.check_sites([scenario], n_sites)
    rounds = planned_rounds(job_dir)
    entry = {"scenario": scenario, "rounds_planned": rounds}
    if scenario == "kill-server":  # resuming needs the server's round checkpoint, which jobs opt into
        job_dir = with_round_checkpoint(job_dir)
    with LoopbackDeployment(workspace, n_sites=n_sites, data_root=data_root, proxied=True, seed=seed,
                            secrets_from=secrets_from) as d:
        if scenario == "latency":
            for proxy in d.proxies.values():
                proxy.set_latency(s.latency_s, s.jitter_s)
                proxy.set_bandwidth(s.bandwidth_bytes_per_s)
        sess_box = [d.session()]
        try:
            _drive(d, job_dir, scenario, rounds, s, timeout_s, sess_box, entry, say)
        finally:  # an open admin session keeps threads alive: close it on every way out
            _close_sessions(sess_box)
    entry["leftover_processes"] = d.leftover_processes()
    entry["ports_in_use"] = [p.port for p in d.proxies.values() if _listening(p.port)] + (
        [d.port] if d.port_in_use() else [])
    say(f"[{scenario}] {entry['status']} in {entry['job_s']} s, rounds {entry['rounds_completed']}/{rounds}, "
        f"left behind: {entry['leftover_processes'] or 'none'}")
    return entry


def _listening(port: int) -> bool:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def run_drill(job: str, workspace: str, scenarios: list[str], *, n_sites: int, data_root: str,
              profile: str | None = None, sets: list[str] = (), seed: int = 0, timeout_s: float = 900,
              settings: DrillSettings | None = None, say=print) -> dict:
    """The fault-free run, then each scenario; writes and returns ``WS/fault_drill.json``."""
    s = settings or DrillSettings()
    s.check_sites(scenarios, n_sites)
    workspace = os.path.abspath(workspace)
    os.makedirs(workspace, exist_ok=True)
    job_dir = build_job(job, os.path.join(workspace, "job", os.path.basename(os.path.abspath(job))),
                        profile=profile, sets=list(sets), n_sites=n_sites)
    t_all = time.time()
    ref_ws = os.path.join(workspace, "none")
    ref = run_scenario(job_dir, ref_ws, "none", n_sites=n_sites, data_root=data_root, seed=seed, settings=s,
                       timeout_s=timeout_s, say=say)
    report = {"job": os.path.abspath(job), "profile": profile, "sets": list(sets), "sites": n_sites, "seed": seed,
              "settings": asdict(s), "reference": ref, "scenarios": []}
    for scenario in scenarios:
        if scenario == "none":
            entry = dict(ref)
        else:
            entry = run_scenario(job_dir, os.path.join(workspace, scenario), scenario, n_sites=n_sites,
                                 data_root=data_root, seed=seed, settings=s, timeout_s=timeout_s,
                                 secrets_from=ref_ws, say=say)
        entry["rounds_lost"] = entry["rounds_planned"] - entry["rounds_completed"]
        entry["extra_wall_s"] = round(entry["job_s"] - ref["job_s"], 1)
        if entry["rounds_lost"] == 0 and entry.get("training_s") is not None and ref.get("training_s") is not None:
            entry["extra_training_s"] = round(entry["training_s"] - ref["training_s"], 1)
        if entry["global_model"] and ref["global_model"]:
            entry["final_model"] = model_difference(ref["global_model"], entry["global_model"])
        else:
            entry["final_model"] = {"identical": False, "max_abs_diff": None, "note": "no final global model"}
        report["scenarios"].append(entry)
        _write(report, workspace)
    report["drill_wall_s"] = round(time.time() - t_all, 1)
    _write(report, workspace)
    say(f"fault drill report: {os.path.join(workspace, REPORT)}")
    return report


def _write(report: dict, workspace: str) -> None:
    with open(os.path.join(workspace, REPORT), "w") as f:
        json.dump(report, f, indent=1)


def table(report: dict) -> str:
    """The report as a markdown table (the one in provisioning/README.md)."""
    rows = ["| scenario | completed | rounds lost | extra wall time (job / rounds) | final model equal | "
            "processes left behind |", "|---|---|---|---|---|---|"]
    for e in report["scenarios"]:
        fm = e["final_model"]
        equal = "yes" if fm.get("identical") else (f"no (max abs diff {fm['max_abs_diff']:.3g})"
                                                   if fm.get("max_abs_diff") is not None else "no model")
        rounds_s = f"{e['extra_training_s']:+.0f} s" if e.get("extra_training_s") is not None else "-"
        rows.append(f"| {e['scenario']} | {'yes' if e['completed'] else 'no (' + e['status'] + ')'} | "
                    f"{e['rounds_lost']} of {e['rounds_planned']} | {e['extra_wall_s']:+.0f} s / {rounds_s} | "
                    f"{equal} | {len(e['leftover_processes'])} |")
    return "\n".join(rows)
