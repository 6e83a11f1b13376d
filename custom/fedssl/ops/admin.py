"""The admin's side through the FLARE API: submit a job, monitor it with progress, download its result.

The same steps as the admin console (``submit_job``, ``list_jobs``, ``download_job``), scripted:
``new_secure_session`` -> ``submit_job`` -> ``monitor_job`` -> ``get_job_meta`` -> ``download_job_result``.
"""

from __future__ import annotations

import os
import tempfile
import time

from fedssl.ops.jobs import build_job


def run_job_in_session(sess, job_dir: str, *, timeout_s: float = 0, download_to: str | None = None,
                       echo: bool = True) -> dict:
    """Submit ``job_dir``, monitor until it ends (or ``timeout_s``), download the result."""
    from nvflare.fuel.flare_api.api_spec import MonitorReturnCode

    t0 = time.time()
    job_id = sess.submit_job(os.path.abspath(job_dir))
    if echo:
        print(f"submitted {os.path.basename(job_dir)} as job {job_id}", flush=True)
    seen = {"status": None}

    def progress(session, jid, meta):
        status = meta.get("status")
        if echo and status != seen["status"]:
            print(f"  [{time.time() - t0:6.1f}s] job {jid}: {status}", flush=True)
        seen["status"] = status
        return True

    rc = sess.monitor_job(job_id, timeout=int(timeout_s), poll_interval=2.0, cb=progress)
    meta = sess.get_job_meta(job_id)
    result_dir = None
    if rc == MonitorReturnCode.JOB_FINISHED:
        if download_to:
            os.makedirs(download_to, exist_ok=True)
        result_dir = sess.download_job_result(job_id, download_to)
    return {"job_id": job_id, "status": meta.get("status") if rc == MonitorReturnCode.JOB_FINISHED
            else f"MONITOR_{rc.name}", "result_dir": result_dir, "job_s": round(time.time() - t0, 1)}


def submit_and_download(startup_kit: str, username: str, job_dir: str, *, profile: str | None = None,
                        sets: list[str] = (), n_sites: int | None = None, timeout_s: float = 0,
                        download_to: str | None = None) -> dict:
    """Log in with the admin's startup kit and run one job (optionally with a profile / overrides)."""
    from nvflare.fuel.flare_api.flare_api import new_secure_session

    if not os.path.isdir(os.path.join(startup_kit, "startup")):
        raise ValueError(f"{startup_kit} is not an admin startup kit (no startup/ folder); pass prod_NN/<admin name>")
    with tempfile.TemporaryDirectory() as tmp:
        if profile or sets or n_sites:
            job_dir = build_job(job_dir, os.path.join(tmp, os.path.basename(os.path.abspath(job_dir))),
                                profile=profile, sets=list(sets), n_sites=n_sites)
        sess = new_secure_session(username, startup_kit)
        try:
            return run_job_in_session(sess, job_dir, timeout_s=timeout_s, download_to=download_to)
        finally:
            sess.close()
