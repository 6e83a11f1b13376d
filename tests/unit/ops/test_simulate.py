"""The simulator log reader: real failures count, a duplicate result FLARE re-sent does not, a component a site
refused is named by class; a job naming a class the sites do not allow is refused before the simulator starts."""

import io
import json
import os
import shutil

import pytest

from fedssl.ops import simulate
from fedssl.ops.jobs import REPO_ROOT
from fedssl.ops.simulate import FailureLog

LOG = """\
2026-11-23 14:00:07,311 - INFO - Contribution from site-1 ACCEPTED by the aggregator at round 0.
2026-11-23 14:00:15,462 - WARNING - site-3 already contributed to round 0; duplicate discarded
2026-11-23 14:00:15,463 - INFO - Contribution from site-3 REJECTED by the aggregator at round 0.
2026-11-23 14:00:16,000 - INFO - Contribution from site-2 REJECTED by the aggregator at round 0.
2026-11-23 14:00:17,000 - ERROR - site-2: task train failed: site-2: no Info.cfg in /data/patient001
2026-11-23 14:00:18,000 - INFO - Contribution from site-3 REJECTED by the aggregator at round 1.
2026-11-23 16:08:28,947 - WARNING - site-1 already contributed to round 2; duplicate discarded
2026-11-23 16:08:28,947 - INFO - Contribution from site-2 REJECTED by the aggregator at round 2.
"""


def test_duplicates_are_not_failures_but_rejections_and_task_errors_are():
    log = FailureLog()
    for line in LOG.splitlines():
        log.read(line)
    assert log.duplicates == 2  # round 2: a re-sent result FLARE delivered under another site's task (seen in CI)
    assert log.lost == ("site-3 already contributed to round 0; duplicate discarded: a site's process ran under "
                        "another site's name")  # the run is started again (simulate)
    assert log.failures == ["REJECTED by the aggregator at round 0.",
                            "task train failed: site-2: no Info.cfg in /data/patient001",
                            "REJECTED by the aggregator at round 1."]  # site-3's round 1: no duplicate announced


# ---- a site that refuses a component: named by class, before the run or from FLARE's log --------------------

#: what FLARE 2.9's simulator logs when site-1 refuses a component (lines from a real run, args shortened)
REFUSAL_LOG = """\
nvflare.fuel.common.excepts.ComponentNotAuthorized: component not authorized: Component 'fedssl.ops.jobs.build_job' \
at config path 'components.#1' is not in allow_list
Error processing config ['/tmp/ws/site-1/simulate_job/app_site-1/config/config_fed_client.json']: \
ComponentNotAuthorized: Error processing ['/tmp/ws/site-1/simulate_job/app_site-1/config/config_fed_client.json'] in \
JSON element {'id': 'evil', 'path': 'fedssl.ops.jobs.build_job', 'args': {}}: path: components.#1, exception: \
ComponentNotAuthorized: component not authorized: Component 'fedssl.ops.jobs.build_job' at config path \
'components.#1' is not in allow_list
2026-11-23 15:01:10,412 - ERROR - do_one_task execute exception: ComponentNotAuthorized: Error processing \
['/tmp/ws/site-1/simulate_job/app_site-1/config/config_fed_client.json'] in JSON element {'id': 'evil'}: \
path: components.#1, exception: ComponentNotAuthorized: component not authorized: Component \
'fedssl.ops.jobs.build_job' at config path 'components.#1' is not in allow_list
2026-11-23 15:01:11,070 - INFO - summary written to /tmp/ws/server/simulate_job/summary.json; bytes per site per \
round: up 0, down 0
"""
NAMED = "site refused the job: class fedssl.ops.jobs.build_job is not allowed (at site-1)"


def test_a_refused_component_is_read_by_class_and_site_once():
    log = FailureLog()
    for line in REFUSAL_LOG.splitlines():
        log.read(line)
    assert log.refusals() == [NAMED] and log.failures == []


def test_the_site_of_a_log_names_a_refusal_whose_line_does_not():
    log = FailureLog()
    log.read(REFUSAL_LOG.splitlines()[0], site="site-2")
    assert log.refusals() == ["site refused the job: class fedssl.ops.jobs.build_job is not allowed (at site-2)"]


def _evil_job(tmp_path, part="server") -> str:
    job = str(tmp_path / "fcl_acdc")
    shutil.copytree(os.path.join(REPO_ROOT, "jobs", "fcl_acdc"), job)
    path = os.path.join(job, "app", "config", f"config_fed_{part}.json")
    with open(path) as f:
        config = json.load(f)
    config.setdefault("components", []).insert(0, {"id": "evil", "path": "fedssl.ops.jobs.build_job",
                                                   "args": {"job_dir": job, "out_dir": str(tmp_path / "victim")}})
    with open(path, "w") as f:
        json.dump(config, f)
    return job


class _NoSimulator:
    def __init__(self, *args, **kwargs):
        raise AssertionError("the simulator must not start")


def test_simulate_refuses_the_job_before_anything_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(simulate.subprocess, "Popen", _NoSimulator)
    ws = tmp_path / "ws"
    (ws / "server").mkdir(parents=True)  # a previous run's results
    with pytest.raises(simulate.SimulationError) as e:
        simulate.run_simulation(_evil_job(tmp_path), str(ws), n_sites=1, data_root=str(tmp_path), echo=False)
    assert ("site refused the job: class fedssl.ops.jobs.build_job is not allowed "
            "(app/config/config_fed_server.json, components, id 'evil')") in str(e.value)
    assert (ws / "server").is_dir() and not (tmp_path / "victim").exists()


class _FakeSimulator:
    """``nvflare simulator`` that prints REFUSAL_LOG and exits 0 (as FLARE does when a site refused)."""

    def __init__(self, *args, **kwargs):
        self.stdout = io.StringIO(REFUSAL_LOG)

    def wait(self, timeout=None):
        return 0  # never times out, so run_simulation never calls kill()


@pytest.mark.parametrize("tolerate", [False, True])
def test_a_refusal_during_the_run_is_named_not_only_the_missing_model(tmp_path, monkeypatch, tolerate):
    """A site with a narrower list than ours refuses during the run: the report names the class first."""
    monkeypatch.setattr(simulate.subprocess, "Popen", _FakeSimulator)
    with pytest.raises(simulate.SimulationError) as e:
        simulate.run_simulation(os.path.join(REPO_ROOT, "jobs", "fcl_acdc"), str(tmp_path / "ws"), n_sites=1,
                                data_root=str(tmp_path), echo=False, tolerate_site_failures=tolerate)
    assert str(e.value).startswith(f"fcl_acdc: {NAMED}; ")
    assert "no global model" in str(e.value)


class _ResultSimulator:
    """``nvflare simulator``: writes the server's summary and global model; remembers the environment it got."""

    envs = []

    def __init__(self, cmd, env, **kwargs):
        run = simulate.server_run_dir(cmd[cmd.index("-w") + 1])
        os.makedirs(os.path.join(run, "app_server"), exist_ok=True)
        with open(os.path.join(run, "summary.json"), "w") as f:
            json.dump({"rounds": []}, f)
        open(simulate.global_model_path(cmd[cmd.index("-w") + 1]), "wb").close()
        self.envs.append(env)
        self.stdout = io.StringIO("")

    def wait(self, timeout=None):
        return 0


@pytest.mark.parametrize("preset, expected", [(None, 2), ("3", 3)])
def test_the_summary_records_the_sites_torch_thread_count(tmp_path, monkeypatch, preset, expected):
    """The cores split between the site processes (4 cores, 2 sites: 2 each) unless OMP_NUM_THREADS is set."""
    monkeypatch.setattr(simulate.subprocess, "Popen", _ResultSimulator)
    monkeypatch.setattr(simulate.os, "cpu_count", lambda: 4)
    if preset is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", preset)
    s = simulate.run_simulation(os.path.join(REPO_ROOT, "jobs", "fcl_acdc"), str(tmp_path / "ws"), n_sites=2,
                                data_root=str(tmp_path), echo=False)
    assert s["torch_threads_per_site"] == expected == int(_ResultSimulator.envs[-1]["OMP_NUM_THREADS"])


def test_nvflare_is_found_beside_this_python_before_path(tmp_path, monkeypatch):
    """Issue 45: a virtual environment's nvflare was found only on PATH."""
    bindir = tmp_path / "venv" / "bin"
    bindir.mkdir(parents=True)
    fake = bindir / "nvflare"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    monkeypatch.setattr(simulate.sys, "executable", str(bindir / "python3"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert simulate.nvflare_command() == [str(fake)]
    fake.unlink()
    assert simulate.nvflare_command() == [str(bindir / "python3"), "-m", "nvflare.cli"]


def test_stopping_a_run_stops_every_process_the_simulator_started(tmp_path, monkeypatch):
    """Issue 45: a timeout (as Ctrl-C or an error) killed the simulator but left its site processes running."""
    import signal
    import time

    bindir = tmp_path / "bin"
    bindir.mkdir()
    pidfile = tmp_path / "child.pid"
    fake = bindir / "nvflare"
    fake.write_text(f"#!/bin/sh\nsleep 120 &\necho $! > {pidfile}\necho started\nsleep 120\n")
    fake.chmod(0o755)
    monkeypatch.setattr(simulate, "simulator_command", lambda: [str(bindir / "nvflare")])
    with pytest.raises(simulate.SimulationError, match="exceeded 2s"):
        simulate.run_simulation(os.path.join(REPO_ROOT, "jobs", "fcl_acdc"), str(tmp_path / "ws"), n_sites=1,
                                data_root=str(tmp_path), echo=False, timeout_s=2)
    child = int(pidfile.read_text())
    for _ in range(50):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(child, signal.SIGKILL)
        raise AssertionError("the simulator's child process outlived the run")


LOST = "2026-11-29 20:19:13,237 - SimulatorClientRunner - ERROR - Communication error with client site-1: " \
       "[Errno 104] Connection reset by peer\n"


@pytest.mark.parametrize("line, expected", [
    (LOST, "Communication error with client site-1: [Errno 104] Connection reset by peer"),
    ("... - ERROR - Subprocess died for client site-2, exit code: -9\n",
     "Subprocess died for client site-2, exit code: -9"),
    ("... - ERROR - Subprocess died for client site-3 before send, exit code: 1\n",
     "Subprocess died for client site-3 before send, exit code: 1"),
    ("RuntimeError: cannot sync with server Runner after 60.0 seconds\n",
     "cannot sync with server Runner after 60.0 seconds"),
    ("... - INFO - Simulate Run client: site-1 on GPU group: None\n", None),
])
def test_the_log_reader_notices_when_flare_loses_a_site_process(line, expected):
    log = FailureLog()
    log.read(line)
    log.read(LOST.replace("site-1", "site-9"))  # the first such line is the one reported
    assert log.lost == (expected or "Communication error with client site-9: [Errno 104] Connection reset by peer")
    assert log.failures == []


def _flaky_nvflare(tmp_path, lose: int, line: str = LOST):
    """An ``nvflare`` that, for its first ``lose`` starts, prints FLARE's lost-site line and then hangs (as the
    simulator does: the round waits for the lost site forever); afterwards it writes the server's results."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    count = tmp_path / "starts"
    fake = bindir / "nvflare"
    fake.write_text(f"""#!/bin/sh
n=$(cat {count} 2>/dev/null || echo 0); n=$((n + 1)); echo $n > {count}
ws=$4
if [ $n -le {lose} ]; then printf '%s' '{line.strip()}'; echo; sleep 120; exit 0; fi
mkdir -p $ws/server/simulate_job/app_server
echo '{{"rounds": []}}' > $ws/server/simulate_job/summary.json
: > $ws/server/simulate_job/app_server/FL_global_model.pt
""")
    fake.chmod(0o755)
    return bindir, count


def test_a_run_in_which_flare_lost_a_site_is_stopped_at_once_and_started_again(tmp_path, monkeypatch, capsys):
    """CI hung for 15 minutes: FLARE's simulator lost site-1's process at start and the round waited for it."""
    import time

    bindir, count = _flaky_nvflare(tmp_path, lose=2)
    monkeypatch.setattr(simulate, "simulator_command", lambda: [str(bindir / "nvflare")])
    t0 = time.time()
    s = simulate.run_simulation(os.path.join(REPO_ROOT, "jobs", "fcl_acdc"), str(tmp_path / "ws"), n_sites=1,
                                data_root=str(tmp_path), echo=False, timeout_s=100)
    assert time.time() - t0 < 30  # neither hang was waited out
    assert count.read_text().strip() == "3" and s["rounds"] == []
    out = capsys.readouterr().out
    assert "lost a site's process (Communication error with client site-1" in out
    assert "(attempt 2 of 3)" in out and "(attempt 3 of 3)" in out


def test_a_site_lost_in_every_attempt_is_one_clear_error(tmp_path, monkeypatch):
    bindir, count = _flaky_nvflare(tmp_path, lose=9)
    monkeypatch.setattr(simulate, "simulator_command", lambda: [str(bindir / "nvflare")])
    with pytest.raises(simulate.SimulationError, match=r"lost a site's process in each of 2 attempts "
                                                       r"\(Communication error with client site-1: .*\)"):
        simulate.run_simulation(os.path.join(REPO_ROOT, "jobs", "fcl_acdc"), str(tmp_path / "ws"), n_sites=1,
                                data_root=str(tmp_path), echo=False, timeout_s=100, retries=1)
    assert count.read_text().strip() == "2"


@pytest.mark.parametrize("retries", [-1, 1.5, True, "2"])
def test_retries_must_be_a_whole_number(tmp_path, retries):
    with pytest.raises(ValueError, match=rf"retries={retries!r} must be a whole number >= 0"):
        simulate.simulate("job", str(tmp_path / "ws"), n_sites=1, env={}, retries=retries)


def test_a_run_with_a_site_under_another_sites_name_is_started_again(tmp_path, monkeypatch, capsys):
    """CI: site-2's process ran as site-3 (server log: peer=site-3 ... got result from client site-2), the round
    aggregated one site fewer and the test that checked it failed."""
    dup = "2026-11-29 22:25:53,096 - WARNING - site-3 already contributed to round 0; duplicate discarded\n"
    bindir, count = _flaky_nvflare(tmp_path, lose=1, line=dup)
    monkeypatch.setattr(simulate, "simulator_command", lambda: [str(bindir / "nvflare")])
    simulate.run_simulation(os.path.join(REPO_ROOT, "jobs", "fcl_acdc"), str(tmp_path / "ws"), n_sites=1,
                            data_root=str(tmp_path), echo=False, timeout_s=100)
    assert count.read_text().strip() == "2"
    assert "(site-3 already contributed to round 0; duplicate discarded: a site's process ran under another " \
           "site's name); starting the run again (attempt 2 of 3)" in capsys.readouterr().out
