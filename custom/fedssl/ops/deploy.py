"""A real provisioned FLARE system on one machine (loopback): provision, start, submit, download, stop.

Everything a hospital deployment does, with mTLS and separate server / client processes, but all on
127.0.0.1 and a free port: ``nvflare provision`` makes the startup kits from ``provisioning/project.yml``
(with the requested number of sites), each site gets its local configuration (class allow-list, no-BYOC
authorisation policy, data root, privacy scopes) and the server the same policy, the server and the sites
are started as the kits' ``sub_start.sh`` starts them, an admin drives the jobs through the FLARE API, and
everything is stopped on exit, on error and on Ctrl-C (each participant runs in its own process group,
killed as a group).  A job a participant refuses to build is reported by the class it refused.

For the fault drill (``fedssl.ops.drill``), ``proxied=True`` puts a :class:`fedssl.ops.faults.FaultProxy` on
127.0.0.1 between each site and the server (the site's ``startup/fed_client.json`` names the proxy's port as the
server's), and the participants can be killed, paused and restarted from their kits.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import yaml

from fedssl.data.site_config import SITE_CONFIG_FILE
from fedssl.ops.jobs import REPO_ROOT, build_job
from fedssl.ops.policy import write_site_local
from fedssl.ops.simulate import FailureLog, nvflare_command

PROJECT_YML = os.path.join(REPO_ROOT, "provisioning", "project.yml")
PRIVACY_JSON = os.path.join(REPO_ROOT, "app_config", "privacy.json")
ADMIN = "admin@fedssl.org"
#: the server participant's name on loopback (its kit's folder and its certificate's name)
SERVER = "localhost"


class DeploymentError(RuntimeError):
    """Provisioning or start-up of the loopback system failed."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_project(out_path: str, n_sites: int, port: int, base: str = PROJECT_YML) -> dict:
    """``base`` with the clients replaced by site-1..site-N and the server on ``port``."""
    with open(base) as f:
        project = yaml.safe_load(f)
    others = [p for p in project["participants"] if p["type"] != "client"]
    for p in others:
        if p["type"] == "server":
            p["name"], p["fed_learn_port"] = SERVER, port
    sites = [{"name": f"site-{i}", "type": "client", "org": f"hospital_{i}"} for i in range(1, n_sites + 1)]
    project["participants"] = others[:1] + sites + others[1:]
    with open(out_path, "w") as f:
        yaml.safe_dump(project, f, sort_keys=False)
    return project


def configure_site(kit: str, site: str, data_root: str) -> None:
    """What a site admin does once: allow exactly the bundle's classes and no BYOC (``local/resources.json``
    and ``local/authorization.json``, see fedssl.ops.policy), point to the data, set privacy scopes."""
    local = os.path.join(kit, "local")
    write_site_local(local)
    with open(os.path.join(local, SITE_CONFIG_FILE), "w") as f:
        json.dump({"data_root": data_root.replace("{site}", site)}, f, indent=2)
    shutil.copy(PRIVACY_JSON, os.path.join(local, "privacy.json"))


def isolate_server_storage(resources_json: str, root: str) -> None:
    """Point the server's job store and snapshot store into ``root``.  The kit's defaults are shared
    folders under /tmp/nvflare: every deployment on the machine would see (and resume) the others' jobs.
    A production server should point them at persistent, backed-up storage the same way."""
    with open(resources_json) as f:
        resources = json.load(f)
    resources["snapshot_persistor"]["args"]["storage"]["args"]["root_dir"] = os.path.join(root, "snapshot-storage")
    for comp in resources["components"]:
        if comp["id"] == "job_manager":
            comp["args"]["uri_root"] = os.path.join(root, "jobs-storage")
    with open(resources_json, "w") as f:
        json.dump(resources, f, indent=2)


def point_site_at(kit: str, port: int) -> str:
    """Rewrite the site's ``startup/fed_client.json`` so that it connects to ``localhost:port`` (a fault proxy)
    instead of the server's own port; the host name stays ``localhost`` (127.0.0.1 here), the name in the server's
    certificate.  The site's job processes take the same target from their parent.  Returns the new target."""
    path = os.path.join(kit, "startup", "fed_client.json")
    with open(path) as f:
        conf = json.load(f)
    service = conf["servers"][0]["service"]
    host = service["target"].rsplit(":", 1)[0]
    if host != "localhost":
        raise DeploymentError(f"{path}: server target {service['target']!r} is not on localhost; the fault drill "
                              "runs on loopback only")
    service["target"] = f"{host}:{port}"
    with open(path, "w") as f:
        json.dump(conf, f, indent=2)
    return service["target"]


def copy_secrets(src_kit: str, dst_kit: str) -> list[str]:
    """Give a participant the party secrets (``local/*.secret``) of the same participant of another deployment, so
    that a drill's run repeats the fault-free run's draws (feature noise, bank order).  A drill only: a real
    participant never shares its secrets."""
    copied = []
    for src in sorted(glob.glob(os.path.join(src_kit, "local", "*.secret"))):
        dst = os.path.join(dst_kit, "local", os.path.basename(src))
        shutil.copyfile(src, dst)
        os.chmod(dst, 0o600)
        copied.append(os.path.basename(src))
    return copied


def configure_server(kit: str, storage_root: str) -> None:
    """The server's policy is the sites' (exact-class allow-list, BYOC off for every role: the server checks
    BYOC when a job is submitted, each site again when it is deployed), and its stores live in ``storage_root``."""
    isolate_server_storage(write_site_local(os.path.join(kit, "local")), storage_root)


@dataclass
class LoopbackDeployment:
    """Context manager: ``with LoopbackDeployment(ws, n_sites=2, data_root=...) as d: d.run_job(job)``."""

    workspace: str
    n_sites: int
    data_root: str
    port: int = 0
    startup_timeout_s: float = 120.0
    #: how long the server waits for a site's end-of-job outcome before finalising the job from its own
    #: outcome (FLARE's client_outcome_wait_timeout, default 900 s): a crashed site would otherwise keep
    #: the job RUNNING for 15 minutes after its last round
    client_outcome_wait_s: float = 30.0
    #: a FaultProxy between each site and the server (the fault drill)
    proxied: bool = False
    #: seeds the proxies' jitter and reset moments (site-K's proxy: seed + K)
    seed: int = 0
    #: another deployment's workspace whose participants' secrets each participant starts with (the drill)
    secrets_from: str | None = None
    procs: dict = field(default_factory=dict)
    proxies: dict = field(default_factory=dict)
    paused: set = field(default_factory=set)
    #: set by stop(): nothing is started after it (a fault driver's late restart would be left behind)
    stopped: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    kits: dict = field(default_factory=dict)
    orgs: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "LoopbackDeployment":
        self._old_handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for s in self._old_handlers:
            signal.signal(s, self._on_signal)
        try:
            t0 = time.time()
            self.provision()
            self.timings["provision_s"] = round(time.time() - t0, 1)
            self.start()
            self.wait_for_sites()
            self.timings["startup_s"] = round(time.time() - t0, 1)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        for s, h in self._old_handlers.items():
            signal.signal(s, h)

    def _on_signal(self, signum, frame):
        raise KeyboardInterrupt(f"signal {signum}: stopping the deployment")

    # ------------------------------------------------------------------ steps
    def provision(self) -> None:
        self.workspace = os.path.abspath(self.workspace)
        if os.path.exists(self.workspace):
            shutil.rmtree(self.workspace)
        os.makedirs(self.workspace)
        self.port = self.port or free_port()
        project_yml = os.path.join(self.workspace, "project.yml")
        project = write_project(project_yml, self.n_sites, self.port)
        out = subprocess.run([*nvflare_command(), "provision", "-p", project_yml, "-w",
                              os.path.join(self.workspace, "provision")],
                             capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            raise DeploymentError(f"nvflare provision failed ({out.returncode}): "
                                  f"{out.stderr[-2000:] or out.stdout[-2000:]}")
        prod = os.path.join(self.workspace, "provision", project["name"], "prod_00")
        for p in project["participants"]:
            self.kits[p["name"]] = os.path.join(prod, p["name"])
            self.orgs[p["name"]] = p["org"]
        for i in range(1, self.n_sites + 1):
            configure_site(self.kits[f"site-{i}"], f"site-{i}", self.data_root)
        configure_server(self.kits[SERVER], os.path.join(self.workspace, "server_storage"))
        if self.secrets_from:
            prod_from = os.path.join(os.path.abspath(self.secrets_from), "provision", project["name"], "prod_00")
            for name in [SERVER] + [f"site-{i}" for i in range(1, self.n_sites + 1)]:
                copy_secrets(os.path.join(prod_from, name), self.kits[name])
        if self.proxied:
            from fedssl.ops.faults import FaultProxy

            for i in range(1, self.n_sites + 1):
                site = f"site-{i}"
                self.proxies[site] = FaultProxy(self.port, seed=self.seed + i, name=site).start()
                point_site_at(self.kits[site], self.proxies[site].port)

    def _launch(self, name: str, module: str, extra: list[str]) -> None:
        kit = self.kits[name]
        org = self.orgs[name]
        cmd = [sys.executable, "-u", "-m", module, "-m", kit, "-s", extra[0], "--set", "secure_train=true",
               *extra[1:], f"org={org}", "config_folder=config"]
        log = open(os.path.join(kit, "console.log"), "a")  # a restarted participant appends
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                   NVFLARE_CLIENT_OUTCOME_WAIT_TIMEOUT=str(self.client_outcome_wait_s))
        self.procs[name] = subprocess.Popen(cmd, cwd=kit, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)  # own process group: killed as one

    def start(self) -> None:
        """Start the server, then each site, exactly as the kits' sub_start.sh do (without their restart loop)."""
        self.start_participant(SERVER)
        for i in range(1, self.n_sites + 1):
            self.start_participant(f"site-{i}")

    def start_participant(self, name: str) -> None:
        """Start (or restart, after :meth:`kill`) the server or a site from its kit; refused after :meth:`stop`."""
        with self._lock:
            if self.stopped:
                raise DeploymentError(f"{name} not started: the deployment in {self.workspace} is stopping")
            self._start_participant(name)

    def _start_participant(self, name: str) -> None:
        if name == SERVER:
            self._launch(SERVER, "nvflare.private.fed.app.server.server_train", ["fed_server.json"])
        else:
            self._launch(name, "nvflare.private.fed.app.client.client_train", ["fed_client.json", f"uid={name}"])

    def session(self, timeout: float = 30.0):
        from nvflare.fuel.flare_api.flare_api import new_secure_session

        return new_secure_session(ADMIN, self.kits[ADMIN], timeout=timeout)

    def wait_for_sites(self) -> None:
        deadline = time.time() + self.startup_timeout_s
        last = None
        while time.time() < deadline:
            self.check_alive()
            try:
                sess = self.session(timeout=10)
                try:
                    names = sorted(c.name for c in sess.get_connected_client_list())
                finally:
                    sess.close()
                if len(names) >= self.n_sites:
                    return
                last = f"connected: {names}"
            except Exception as e:  # server not up yet
                last = f"{type(e).__name__}: {e}"
            time.sleep(2)
        raise DeploymentError(f"{self.n_sites} sites not connected after {self.startup_timeout_s}s ({last})")

    def check_alive(self) -> None:
        dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
        if dead:
            raise DeploymentError(f"processes exited early: {dead}; see console.log in their kits")

    def run_job(self, job_dir: str, timeout_s: float = 600.0, download_to: str | None = None,
                echo: bool = False) -> dict:
        """Submit, monitor, download through the FLARE API: {"job_id", "status", "result_dir", "job_s"}, and for
        a job that did not complete "refused": the components a participant refused to build (see refusals)."""
        from fedssl.ops.admin import run_job_in_session

        sess = self.session()
        try:
            r = run_job_in_session(sess, job_dir, timeout_s=timeout_s, echo=echo,
                                   download_to=download_to or os.path.join(self.workspace, "results"))
        finally:
            sess.close()
        if r["status"] != "FINISHED:COMPLETED":
            r["refused"] = self.refusals(r["job_id"], r["result_dir"])
        return r

    def refusals(self, job_id: str, result_dir: str | None = None) -> list[str]:
        """"site refused the job: class X is not allowed (at site-1)", one line per refusal, from the job's logs:
        each site's ``<kit>/<job_id>/``, the server's, which FLARE removes from its kit when the job ends and
        hands over in the downloaded result (``<result_dir>/workspace/``), and the lines of each participant's
        own ``log.txt`` that name the job (a BYOC job is refused there, before any job log exists)."""
        log = FailureLog()
        sources = [(name, os.path.join(kit, job_id)) for name, kit in self.kits.items()]
        sources += [(SERVER, os.path.join(result_dir, "workspace"))] if result_dir else []
        for name, folder in sources:
            for path in sorted(glob.glob(os.path.join(folder, "*log*.txt"))):
                self._read_log(log, path, name)
        for name, kit in self.kits.items():
            self._read_log(log, os.path.join(kit, "log.txt"), name, only=job_id)
        return log.refusals()

    @staticmethod
    def _read_log(log: FailureLog, path: str, site: str, only: str | None = None) -> None:
        if os.path.isfile(path):
            with open(path, errors="replace") as f:
                for line in f:
                    if only is None or only in line:
                        log.read(line, site=site)

    def _processes_of(self, name: str | None = None) -> list:
        """The participant's process, its descendants, and any process started from its kit folder
        (FLARE starts each job in a process of its own, not always in the parent's group)."""
        import psutil

        roots = [self.procs[name]] if name else list(self.procs.values())
        marker = self.kits[name] if name else self.workspace
        found = {}
        for p in roots:
            with contextlib.suppress(psutil.NoSuchProcess):  # a participant that already exited has no tree
                parent = psutil.Process(p.pid)
                found[parent.pid] = parent
                for child in parent.children(recursive=True):
                    found[child.pid] = child
        for proc in psutil.process_iter(["pid", "cmdline"]):
            args = proc.info.get("cmdline") or []
            # whole path components only: site-1 must not match site-10
            if proc.pid != os.getpid() and any(a == marker or a.startswith(marker + os.sep) for a in args):
                found[proc.pid] = proc
        return list(found.values())

    def kill_site(self, name: str) -> None:
        """Simulate a site crash: SIGKILL the site's process and every job process it started."""
        self.kill(name)

    def kill(self, name: str) -> None:
        """Simulate a crash of a participant (a site or the server): SIGKILL it and every job process it started."""
        import psutil

        for proc in self._processes_of(name):
            with contextlib.suppress(psutil.NoSuchProcess):  # already gone: nothing to kill
                proc.kill()
        self.procs[name].wait()
        self.paused.discard(name)

    def pause(self, name: str) -> int:
        """SIGSTOP a participant and its job processes (a hung machine); returns how many were stopped."""
        return self._signal_all(name, signal.SIGSTOP, pause=True)

    def resume(self, name: str) -> int:
        """SIGCONT what :meth:`pause` stopped."""
        return self._signal_all(name, signal.SIGCONT, pause=False)

    def _signal_all(self, name: str, signum: int, pause: bool) -> int:
        import psutil

        n = 0
        for proc in self._processes_of(name):
            with contextlib.suppress(psutil.NoSuchProcess):  # exited meanwhile: nothing to signal
                proc.send_signal(signum)
                n += 1
        (self.paused.add if pause else self.paused.discard)(name)
        return n

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop every participant politely (SIGTERM to each process group), then by force, job processes
        included; nothing is left behind."""
        import psutil

        with self._lock:
            self.stopped = True
        for name in list(self.paused):  # a stopped process would sit on SIGTERM until the grace period ends
            self.resume(name)
        everyone = self._processes_of() if self.procs else []
        for p in self.procs.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):  # group already gone
                    os.killpg(p.pid, signal.SIGTERM)
        gone, alive = psutil.wait_procs(everyone, timeout=grace_s)
        for proc in alive:
            with contextlib.suppress(psutil.NoSuchProcess):  # exited after the grace period ended
                proc.kill()
        psutil.wait_procs(alive, timeout=5)
        for p in self.procs.values():
            p.wait()
        for proxy in self.proxies.values():
            proxy.close()

    def leftover_processes(self) -> list[str]:
        """Processes still running that belong to this deployment (should be none after stop)."""
        import psutil

        out = []
        for proc in self._processes_of():
            with contextlib.suppress(psutil.NoSuchProcess):  # ended while we looked: not a leftover
                if proc.is_running() and proc.status() != "zombie":
                    out.append(f"{proc.pid}: {' '.join(proc.cmdline())[:200]}")
        return out

    def port_in_use(self) -> bool:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            return s.connect_ex(("127.0.0.1", self.port)) == 0


def _say(msg: str) -> None:
    print(msg, flush=True)


def deploy_and_run(workspace: str, jobs: list[str], *, n_sites: int, data_root: str, profile: str | None = None,
                   sets: list[str] = (), timeout_s: float = 1800, hold: bool = False, say=_say) -> list[str]:
    """``fedssl deploy-local``: provision and start the server and ``n_sites`` sites on loopback, run ``jobs`` in
    order (each built with ``profile`` / ``sets``), raise on the first that does not complete; with ``hold`` keep
    the system up (checked every 5 s) until Ctrl-C.  Everything is stopped on the way out; returns the processes
    left over after the stop."""
    with LoopbackDeployment(workspace, n_sites=n_sites, data_root=data_root) as d:
        say(f"server and {n_sites} sites up on 127.0.0.1:{d.port} in {d.timings['startup_s']} s "
            f"(admin startup kit: {d.kits['admin@fedssl.org']})")
        for job_dir in jobs:
            job = build_job(job_dir, os.path.join(d.workspace, "jobs", os.path.basename(os.path.abspath(job_dir))),
                            profile=profile, sets=sets, n_sites=n_sites)
            r = d.run_job(job, timeout_s=timeout_s)
            say(f"{os.path.basename(job)}: job {r['job_id']} {r['status']} in {r['job_s']} s; result in "
                f"{r['result_dir']}")
            if r["status"] != "FINISHED:COMPLETED":
                cause = "".join(f"; {line}" for line in r.get("refused", []))
                raise RuntimeError(f"job {r['job_id']} ended {r['status']}{cause}; see {r['result_dir']}")
        if hold:
            say("holding the system up; Ctrl-C stops everything")
            while True:
                d.check_alive()
                time.sleep(5)
    return d.leftover_processes()
