"""Synthetic data for every job: each job has a writer, and each writer gives the sites' folders."""

from __future__ import annotations

import os

import pytest

from fedssl.experiments.job_data import JOB_DATA, write_job_data
from fedssl.ops.jobs import REPO_ROOT

JOBS_DIR = os.path.join(REPO_ROOT, "jobs")


def test_every_job_has_a_data_writer_and_unknown_jobs_are_refused(tmp_path):
    jobs = {d for d in os.listdir(JOBS_DIR) if os.path.isfile(os.path.join(JOBS_DIR, d, "meta.json"))}
    assert set(JOB_DATA) == jobs
    with pytest.raises(ValueError, match="job 'fcl_acdx' has no synthetic data writer"):
        write_job_data("fcl_acdx", str(tmp_path))
    with pytest.raises(ValueError, match="n_sites=0"):
        write_job_data("fcl_acdc", str(tmp_path), n_sites=0)


@pytest.mark.slow
@pytest.mark.parametrize("job", sorted({kind: job for job, kind in JOB_DATA.items()}.values()))
def test_each_kind_writes_the_site_folders_once(job, tmp_path):
    n_sites = 2
    root = write_job_data(job, str(tmp_path), n_sites=n_sites)
    assert root.endswith("{site}")
    for k in range(1, n_sites + 1):
        site = root.replace("{site}", f"site-{k}")
        assert os.path.isdir(site) and os.listdir(site), f"{job}: {site} is empty"
    marker = os.path.join(os.path.dirname(os.path.dirname(root)), ".complete")
    stamp = os.path.getmtime(marker)
    assert write_job_data(job, str(tmp_path), n_sites=n_sites) == root and os.path.getmtime(marker) == stamp
