"""A real provisioned FLARE system on loopback: mTLS, separate server and site processes, FLARE API.

Marked slow; CI runs it (the README's test command runs everything).
"""

import glob
import json
import math
import os
import shutil
import time

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from fedssl.core.safe_load import safe_load
from fedssl.data.acdc_synthetic import write_synthetic_acdc
from fedssl.ops.deploy import SERVER, LoopbackDeployment
from fedssl.ops.jobs import REPO_ROOT, build_job

pytestmark = pytest.mark.slow
JOB = os.path.join(REPO_ROOT, "jobs", "fcl_acdc")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("acdc")
    write_synthetic_acdc(root, n_patients=20, n_sites=2, seed=0, shape=(96, 96), n_frames=6)
    return str(root / "{site}")


def start_impostor(d: LoopbackDeployment, kit_of: str, claims: str, folder: str) -> str:
    """A malicious client over the real mTLS: a copy of ``kit_of``'s startup kit (its certificate and key) started
    as ``claims``; returns the server log line that refuses it."""
    shutil.copytree(d.kits[kit_of], folder)
    d.kits["impostor"], d.orgs["impostor"] = folder, d.orgs[kit_of]  # d.stop() stops it with the rest
    d._launch("impostor", "nvflare.private.fed.app.client.client_train", ["fed_client.json", f"uid={claims}"])
    expected = f"authenticated as '{kit_of}' but claimed endpoint '{claims}'"
    deadline = time.time() + 60
    while time.time() < deadline:
        with open(os.path.join(d.kits[SERVER], "log.txt"), errors="replace") as f:
            hit = [line for line in f if expected in line]
        if hit:
            return hit[0]
        time.sleep(1)
    raise AssertionError(f"the server never refused the impostor ({expected!r})")


def test_provisioned_fcl_job_runs_downloads_and_tears_down(data, tmp_path):
    job = build_job(JOB, str(tmp_path / "jobs" / "fcl_acdc"), profile="quick", n_sites=2)
    with LoopbackDeployment(str(tmp_path / "ws"), n_sites=2, data_root=data) as d:
        assert d.timings["startup_s"] < 120
        # each site found its data through its own local/fedssl_site.json, not through the job
        with open(os.path.join(d.kits["site-2"], "local", "fedssl_site.json")) as f:
            assert json.load(f)["data_root"].endswith("site-2")
        # issue 45: site-2's kit started as site-1 is refused at the connection (its certificate names site-2),
        # keeps retrying while the job runs, and never receives a task or replaces site-1
        refusal = start_impostor(d, "site-2", "site-1", str(tmp_path / "impostor"))
        assert "requires identity 'site-1'" in refusal
        r = d.run_job(job, timeout_s=300)
        assert r["status"] == "FINISHED:COMPLETED", r
        ws = os.path.join(r["result_dir"], "workspace")
        model = safe_load(os.path.join(ws, "app_server", "FL_global_model.pt"))
        assert any(k.startswith("main.encoder.") for k in model["model"])
        with open(os.path.join(ws, "summary.json")) as f:
            summary = json.load(f)
        assert [x["aggregated_sites"] for x in summary["rounds"]] == [2, 2]
        sess = d.session()
        try:
            assert sorted(c.name for c in sess.get_connected_client_list()) == ["site-1", "site-2"]
        finally:
            sess.close()
        with open(os.path.join(ws, "log.txt"), errors="replace") as f:
            assert "already contributed" not in f.read()  # no second site-1 in any round
        assert all(math.isfinite(x["mean_loss"]) for x in summary["rounds"])
        assert summary["communication_per_round"][1]["download"]["features"] > 0
        # the sites' training curves reached the server's TensorBoard folder through FLARE's analytics path
        for site in ("site-1", "site-2"):
            acc = EventAccumulator(os.path.join(ws, "tb_events", site), size_guidance={"scalars": 0})
            acc.Reload()
            for tag in ("loss", "loss_local", "loss_remote", "lr"):
                assert [e.step for e in acc.Scalars(tag)] == [0, 1], (site, tag)
    assert d.leftover_processes() == [] and not d.port_in_use()


def test_site_killed_mid_round_job_finishes_and_server_serves_next_job(data, tmp_path):
    sets = ["rounds.missing_sites=1",  # the switch (issue 46): rounds go on without one of the 2 sites
            "server.scatter_and_gather.num_rounds=3", "server.scatter_and_gather.wait_time_after_min_received=5"]
    job = build_job(JOB, str(tmp_path / "jobs" / "fcl_acdc"), profile="quick", n_sites=2, sets=sets)
    with LoopbackDeployment(str(tmp_path / "ws"), n_sites=2, data_root=data) as d:
        sess = d.session()
        try:
            job_id = sess.submit_job(job)
            # wait until site-2 has finished round 1 (its metrics exist), then kill it mid-job
            deadline = time.time() + 120
            while not glob.glob(os.path.join(d.kits["site-2"], job_id, "fcl_metrics.jsonl")) and time.time() < deadline:
                time.sleep(0.5)
            assert time.time() < deadline, "site-2 never started training"
            d.kill_site("site-2")
            meta = sess.wait_for_job(job_id, timeout=300)
            result = sess.download_job_result(job_id, str(tmp_path / "results"))
            with open(os.path.join(result, "workspace", "log.txt")) as f:
                log = f.read()
            # the rounds after the crash went on with the remaining site (min_clients=1)
            assert "aggregated 1/2 sites" in log
            # FLARE 2.9 either completes, or (if the site died while streaming its update) fails the job
            # at the end with a status and a log line that name the cause
            assert meta["status"] in ("FINISHED:COMPLETED", "FINISHED:EXECUTION_EXCEPTION"), meta["status"]
            if meta["status"] != "FINISHED:COMPLETED":
                assert "failed to download from site-2" in log
            # the server is healthy: it answers and runs the next job with the remaining site
            assert "site-1" in [c.name for c in sess.get_connected_client_list()]
        finally:
            sess.close()
        job2 = build_job(JOB, str(tmp_path / "jobs2" / "fcl_acdc"), profile="quick", n_sites=1,
                         sets=["server.scatter_and_gather.num_rounds=1"])
        r = d.run_job(job2, timeout_s=300)
        assert r["status"] == "FINISHED:COMPLETED", r
    assert d.leftover_processes() == [] and not d.port_in_use()


def test_ctrl_c_stops_everything(data, tmp_path):
    import signal
    import subprocess
    import sys

    import psutil

    ws = str(tmp_path / "ws")
    proc = subprocess.Popen([sys.executable, "-m", "fedssl.cli", "deploy-local", "-w", ws, "--sites", "1",
                             "--data-root", data, "--hold"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    for line in proc.stdout:
        if "holding the system up" in line:
            break
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if any(ws in a for a in (p.info["cmdline"] or []))]
    assert left == []
