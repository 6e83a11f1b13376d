"""FLARE 2.9's simulator site-name race and its fix (fedssl.ops.flare_simulator): two site threads setting and
sending the shared build context together each send their own site's name."""

from __future__ import annotations

import inspect
import pickle
import subprocess
import sys
import threading
from types import SimpleNamespace

from fedssl.ops import simulate
from fedssl.ops.flare_simulator import SiteNameContext, fix_site_names


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


def test_simulate_starts_flares_command_line_through_the_fix():
    assert simulate.simulator_command() == [sys.executable, "-m", "fedssl.ops.flare_simulator"]
    out = subprocess.run([*simulate.simulator_command(), "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "2.9" in out.stdout + out.stderr
