"""The 20-site scaling bench's measuring parts (issue 46, item 4): process-tree memory, the admin's answer times,
the table, and the refusals.  The whole bench on a real simulator and loopback system is a documented command."""

import json
import subprocess
import sys
import time

import psutil
import pytest

from fedssl.experiments.site_scaling import (
    PeakMemory,
    _per_round,
    latency_summary,
    plot,
    round_seconds,
    run_site_scaling,
    table,
    tree_rss_mb,
)

#: a child that holds about 200 MB and starts a grandchild that holds about 100 MB, then sleeps
HOLDER = """
import subprocess, sys, time
big = bytearray(200 * 2**20)
for i in range(0, len(big), 4096): big[i] = 1
GRANDCHILD = ("import time; b = bytearray(100 * 2**20)\\nfor i in range(0, len(b), 4096): b[i] = 1\\n"
              "print('ok', flush=True); time.sleep(60)")
child = subprocess.Popen([sys.executable, "-c", GRANDCHILD], stdout=sys.stdout)
print("ok", flush=True)
time.sleep(60)
"""


@pytest.fixture()
def holder():
    p = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ok" and p.stdout.readline().strip() == "ok"
        yield p
    finally:
        for c in psutil.Process(p.pid).children(recursive=True):
            c.kill()
        p.kill()
        p.wait()


def test_a_process_trees_memory_counts_its_descendants_only_when_asked(holder):
    alone, tree = tree_rss_mb([holder.pid], recursive=False), tree_rss_mb([holder.pid])
    assert 200 < alone < 300  # the child's 200 MB and its interpreter
    assert 100 < tree - alone < 150  # plus the grandchild's 100 MB
    assert tree_rss_mb([holder.pid, holder.pid]) == pytest.approx(tree, rel=0.05)  # each process counted once
    assert tree_rss_mb([2**22 + 7]) == 0.0  # no such process: nothing, no error


def test_peak_memory_keeps_each_groups_largest_sample(holder):
    pids = [holder.pid]
    mem = PeakMemory({"tree": (lambda: pids, True), "root": (lambda: pids, False)}, every_s=0.05)
    mem.start()
    time.sleep(0.3)
    pids.clear()  # the group is gone: later samples are 0 and do not lower the peak
    time.sleep(0.2)
    peaks = mem.stop()
    assert peaks["tree"] > 300 and 200 < peaks["root"] < 300


def test_admin_answer_times_are_summarised_in_milliseconds():
    assert latency_summary([0.010, 0.030, 0.020, 0.500]) == {"calls": 4, "failed": 0, "median": 25.0, "max": 500.0}
    assert latency_summary([]) == {"calls": 0, "failed": 0, "median": None, "max": None}
    # a question without an answer is counted apart, never as a (fast) answer time
    assert latency_summary([0.010, 0.030], failed=3) == {"calls": 5, "failed": 3, "median": 20.0, "max": 30.0}
    assert latency_summary([], failed=2) == {"calls": 2, "failed": 2, "median": None, "max": None}


def test_the_table_has_a_row_per_deployment_and_count_in_order():
    rows = [{"mode": "simulator", "sites": 5, "completed": True, "first_round_s": 30.5, "round_s": 4.0,
             "round_s_per_site": 0.8,
             "server_peak_mb": 1234.4, "sites_peak_mb": 2000.0, "admin_ms": latency_summary([])},
            {"mode": "provisioned", "sites": 2, "completed": False, "round_s": None, "round_s_per_site": None,
             "server_peak_mb": 600.0, "sites_peak_mb": 900.0, "admin_ms": latency_summary([0.04, 0.06]),
             "startup_s": 12.5}]
    rows.append({"mode": "provisioned", "sites": 20, "completed": True, "round_s": 9.0, "round_s_per_site": 0.45,
                 "server_peak_mb": 700.0, "sites_peak_mb": 9000.0, "admin_ms": latency_summary([0.04], failed=2),
                 "startup_s": 30.0, "first_round_s": 20.0})
    lines = table({"rows": rows}).splitlines()
    assert lines[3] == "| provisioned | 20 | yes | 20.0 | 9.0 | 0.45 | 700 | 9000 | 40 / 40 (3, 2 unanswered) | 30.0 |"
    lines.pop(3)
    assert lines[2] == "| provisioned | 2 | no | None | None | None | 600 | 900 | 50 / 60 (2) | 12.5 |"
    assert lines[3] == "| simulator | 5 | yes | 30.5 | 4.0 | 0.8 | 1234 | 2000 | - | - |"


def test_each_rounds_seconds_are_read_from_the_server_log(tmp_path):
    log = tmp_path / "log.txt"
    log.write_text(
        "2026-11-29 09:52:36,420 - ScatterAndGather - INFO - [identity=s] Round 0 started.\n"
        "2026-11-29 09:53:52,635 - ScatterAndGather - INFO - [identity=s] Round 0 finished.\n"
        "2026-11-29 09:53:53,456 - ScatterAndGather - INFO - [identity=s] Round 1 started.\n"
        "2026-11-29 09:54:04,846 - ScatterAndGather - INFO - [identity=s] Round 1 finished.\n"
        "2026-11-29 09:54:05,000 - ScatterAndGather - INFO - [identity=s] Round 2 started.\n")
    assert round_seconds(str(log)) == [76.22, 11.39]  # round 2 never finished: left out
    row = {"sites": 5}
    _per_round(row, str(log))
    assert row == {"sites": 5, "rounds_s": [76.22, 11.39], "first_round_s": 76.22, "round_s": 11.39,
                   "round_s_per_site": 2.278}
    assert round_seconds(str(tmp_path / "none.txt")) == []


def test_bad_counts_and_modes_are_refused_and_another_configuration_needs_another_folder(tmp_path):
    with pytest.raises(ValueError, match="site counts of at least 1"):
        run_site_scaling(str(tmp_path), sites=[0])
    with pytest.raises(ValueError, match=r"\['poc'\] unknown"):
        run_site_scaling(str(tmp_path), modes=["poc"])
    (tmp_path / "site_scaling.json").write_text(json.dumps({"config": {"profile": "paper"}, "rows": []}))
    with pytest.raises(ValueError, match="use another --out"):
        run_site_scaling(str(tmp_path), sites=[1])


def test_the_plot_gives_each_deployment_its_colour_in_every_panel(tmp_path):
    import matplotlib.pyplot as plt

    rows = [{"mode": m, "sites": n, "round_s": 1.0 + n, "server_peak_mb": 100.0 * n,
             "admin_ms": latency_summary([0.01 * n] if m == "provisioned" else [])}
            for m in ("simulator", "provisioned") for n in (2, 5)]
    captured = {}
    real_savefig = plt.Figure.savefig

    def keep(fig, path, **kw):
        captured["colours"] = [[(line.get_label(), line.get_color()) for line in ax.get_lines()] for ax in fig.axes]
        return real_savefig(fig, path, **kw)

    plt.Figure.savefig = keep
    try:
        assert plot({"rows": rows}, str(tmp_path / "s.png")).endswith("s.png")
    finally:
        plt.Figure.savefig = real_savefig
    assert captured["colours"][0] == [("simulator", "C0"), ("provisioned", "C1")]
    assert captured["colours"][2] == [("provisioned", "C1")]  # the admin panel: provisioned only, still orange
    assert (tmp_path / "s.png").stat().st_size > 1000
