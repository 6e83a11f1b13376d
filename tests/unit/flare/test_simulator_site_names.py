"""FLARE 2.9's simulator site-name race and its fix (fedssl.flare.simulator_site_names): two site threads setting and
sending the shared build context together each send their own site's name; the fix reaches FLARE's runner through
``python -m fedssl.ops.flare_simulator`` and through every job's RunSummary in a plain ``nvflare simulator``."""

from __future__ import annotations

import inspect
import pickle
import subprocess
import sys
import threading
from types import ModuleType, SimpleNamespace

from fedssl.flare import run_summary
from fedssl.flare.run_summary import RunSummary
from fedssl.flare.simulator_site_names import SIMULATOR_MODULE, SiteNameContext, fix_in_simulator, fix_site_names
from fedssl.ops import simulate


def _send_interleaved(ctx) -> dict[str, dict]:
    """As ``do_one_task`` does in two site threads: set ``ctx["client_name"]``, then pickle a message holding
    ``ctx``; the order is forced to the losing one: site-1 sets, site-2 sets, site-1 sends, site-2 sends."""
    sent: dict[str, dict] = {}
    site1_set, site2_set, site1_sent = threading.Event(), threading.Event(), threading.Event()

    def site(name: str, wait_before_set, done_set, wait_before_send, done_send) -> None:
        if wait_before_set:
            wait_before_set.wait(5)
        ctx["client_name"] = name
        done_set.set()
        wait_before_send.wait(5)
        sent[name] = pickle.loads(pickle.dumps({"build_ctx": ctx}))["build_ctx"]
        if done_send:
            done_send.set()

    threads = [threading.Thread(target=site, args=("site-1", None, site1_set, site2_set, site1_sent)),
               threading.Thread(target=site, args=("site-2", site1_set, site2_set, site1_sent, None))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return sent


def test_a_shared_dict_sends_one_site_the_other_sites_name():
    """The race itself, as FLARE 2.9 has it: site-1's process is told it is site-2."""
    sent = _send_interleaved({"client_name": None, "other": 1})
    assert sent["site-1"]["client_name"] == "site-2" == sent["site-2"]["client_name"]


def test_the_fixed_context_sends_each_thread_its_own_name_as_a_plain_dict():
    sent = _send_interleaved(SiteNameContext({"client_name": None, "other": 1}))
    assert sent["site-1"] == {"client_name": "site-1", "other": 1}
    assert sent["site-2"] == {"client_name": "site-2", "other": 1}
    assert all(type(v) is dict for v in sent.values())  # the worker unpickles without importing fedssl


def test_the_context_reads_as_the_dict_it_wraps():
    ctx = SiteNameContext({"client_name": "x", "a": 1})
    assert ctx["client_name"] == "x" and ctx.get("client_name") == "x" and ctx["a"] == 1 and ctx.get("b", 2) == 2
    ctx["client_name"] = "site-3"
    ctx["a"] = 5
    assert ctx["client_name"] == "site-3" and ctx.snapshot() == {"client_name": "site-3", "a": 5}
    seen = {}
    t = threading.Thread(target=lambda: seen.update(name=ctx["client_name"]))
    t.start()
    t.join()
    assert seen["name"] == "x"  # another thread that set nothing sees the shared entry
    import copy

    assert copy.deepcopy(ctx) == {"client_name": "site-3", "a": 5} and type(copy.copy(ctx)) is dict


def test_flares_simulator_runner_gets_the_fixed_context():
    """The real class: its build context after the fix, and the lines of its do_one_task the fix relies on (a FLARE
    upgrade that changes them fails here, not in a long run)."""
    from nvflare.private.fed.app.simulator.simulator_runner import SimulatorClientRunner

    source = inspect.getsource(SimulatorClientRunner.do_one_task)
    assert 'self.build_ctx["client_name"] = client.client_name' in source
    assert "SimulatorConstants.BUILD_CTX: self.build_ctx" in source and "conn.send(data)" in source
    fix_site_names()
    fix_site_names()  # twice changes nothing
    runner = SimulatorClientRunner("/nonexistent", SimpleNamespace(workspace="/tmp/ws", set=[]), [], {}, None,
                                   {"client_name": None, "k": "v"})
    assert isinstance(runner.build_ctx, SiteNameContext)
    assert not isinstance(runner.build_ctx.snapshot(), SiteNameContext)
    sent = _send_interleaved(runner.build_ctx)
    assert sent["site-1"]["client_name"] == "site-1" and sent["site-2"]["client_name"] == "site-2"


class _Runner:
    """A stand-in for SimulatorClientRunner: only its build context matters."""

    def __init__(self, build_ctx):
        self.build_ctx = build_ctx


def _fake_simulator(monkeypatch) -> type:
    module = ModuleType(SIMULATOR_MODULE)
    runner = type("SimulatorClientRunner", (_Runner,), {})
    module.SimulatorClientRunner = runner
    monkeypatch.setitem(sys.modules, SIMULATOR_MODULE, module)
    return runner


def test_outside_the_simulator_nothing_is_imported_or_changed(monkeypatch):
    monkeypatch.delitem(sys.modules, SIMULATOR_MODULE, raising=False)
    assert fix_in_simulator() is False
    assert SIMULATOR_MODULE not in sys.modules
    assert RunSummary()._simulator_fixed is False


def test_in_the_simulator_the_runner_built_after_the_server_gets_the_fix(monkeypatch):
    runner = _fake_simulator(monkeypatch)
    assert type(runner({"client_name": None}).build_ctx) is dict
    summary = RunSummary()  # the server builds its components before the simulator builds its site runner
    assert summary._simulator_fixed is True
    assert isinstance(runner({"client_name": None, "k": 1}).build_ctx, SiteNameContext)
    assert fix_in_simulator() is True  # again: already fixed, still reported


def test_the_run_summary_says_so_in_the_servers_log(monkeypatch):
    _fake_simulator(monkeypatch)
    summary, said = RunSummary(), []
    monkeypatch.setattr(summary, "log_info", lambda ctx, msg: said.append(msg))
    from nvflare.apis.event_type import EventType
    from nvflare.apis.fl_context import FLContext

    monkeypatch.setattr(run_summary, "announce_start", lambda *a: None)  # needs a real engine; not under test here
    summary.handle_event(EventType.START_RUN, FLContext())
    assert any("site-name race fixed" in m for m in said)
    monkeypatch.delitem(sys.modules, SIMULATOR_MODULE)
    quiet, said[:] = RunSummary(), []
    monkeypatch.setattr(quiet, "log_info", lambda ctx, msg: said.append(msg))
    quiet.handle_event(EventType.START_RUN, FLContext())
    assert not said


def test_simulate_starts_flares_command_line_through_the_fix():
    assert simulate.simulator_command() == [sys.executable, "-m", "fedssl.ops.flare_simulator"]
    out = subprocess.run([*simulate.simulator_command(), "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "2.9" in out.stdout + out.stderr
