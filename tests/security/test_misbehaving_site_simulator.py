"""End to end in the FLARE simulator: FCL pre-training (quick profile, 2 rounds) with one poisoned site.

site-3 runs a test-only executor that sends float64 weights of 1e300 (inf once cast to float32) in round 0 and an
error return code in round 1 (FLARE's ScatterAndGather used to stop the run on it: min_clients is every site);
site-1 and site-2 are honest and record what they upload.  The job completes, the global model equals the
weighted average of the two honest uploads bit for bit, and the run summary lists site-3's refused contribution.
Marked slow; CI runs it (the README's test command runs everything).
"""

import json
import os
import shutil

import numpy as np
import pytest
import torch

from fedssl.core.safe_load import safe_load
from fedssl.core.state_dict import weighted_average
from fedssl.data.acdc_synthetic import write_synthetic_acdc
from fedssl.ops.jobs import REPO_ROOT, build_job
from fedssl.ops.policy import write_allow_list
from fedssl.ops.simulate import simulate

pytestmark = pytest.mark.slow
SITES = 3
POISONED = "site-3"


def edit_client_executor(app_dir: str, path: str) -> None:
    config = os.path.join(app_dir, "config", "config_fed_client.json")
    with open(config) as f:
        spec = json.load(f)
    spec["executors"][0]["executor"]["path"] = path
    with open(config, "w") as f:
        json.dump(spec, f, indent=2)


def test_a_poisoned_site_is_refused_and_the_global_model_is_the_honest_average(tmp_path):
    data = tmp_path / "acdc"
    write_synthetic_acdc(data, n_patients=4 * SITES, n_sites=SITES, seed=0, shape=(96, 96), n_frames=6)
    job = build_job(os.path.join(REPO_ROOT, "jobs", "fcl_acdc"), str(tmp_path / "job"), profile="quick", n_sites=SITES)
    # site-3 gets its own app: the same configuration with the poisoned executor (FLARE's per-site deploy map)
    shutil.copytree(os.path.join(job, "app"), os.path.join(job, "app_poisoned"))
    edit_client_executor(os.path.join(job, "app"), "tests.security.poisoned_site.RecordingFCLExecutor")
    edit_client_executor(os.path.join(job, "app_poisoned"), "tests.security.poisoned_site.PoisonedFCLExecutor")
    meta_path = os.path.join(job, "meta.json")
    meta = json.load(open(meta_path))
    meta["deploy_map"] = {"app": ["server", "site-1", "site-2"], "app_poisoned": [POISONED]}
    json.dump(meta, open(meta_path, "w"))

    ws = tmp_path / "ws"
    # the sites' allow-list (the simulator enforces <workspace>/local/resources.json): the bundle's classes and,
    # for this test only, the two test executors
    resources = write_allow_list(str(ws / "local"))
    spec = json.load(open(resources))
    spec["class_allow_list"] += [f"tests.security.poisoned_site.{c}" for c in ("RecordingFCLExecutor",
                                                                               "PoisonedFCLExecutor")]
    json.dump(spec, open(resources, "w"))
    env = dict(os.environ, FEDSSL_DATA_ROOT=str(data / "{site}"), PYTHONPATH=REPO_ROOT, OMP_NUM_THREADS="1")
    rc, _, log_path, _ = simulate(job, str(ws), n_sites=SITES, env=env, timeout_s=900, echo=False)
    log = open(log_path).read()
    assert rc == 0, log[-3000:]

    run = ws / "server" / "simulate_job"
    summary = json.load(open(run / "summary.json"))
    assert [r["aggregated_sites"] for r in summary["rounds"]] == [2, 2]  # the round went on without site-3
    refused = summary["rounds"][0]["refused_contributions"]
    assert [x["site"] for x in refused] == [POISONED] and "non-finite" in refused[0]["reason"], refused
    assert "EXECUTION_EXCEPTION" in log  # round 1: FLARE left the error out and the round went on
    assert "site-1" not in json.dumps({k: v for k, v in summary.items() if k != "rounds"}.get("site_records", {}))

    # the global model is the num_samples-weighted average of the honest uploads of the last round, bit for bit
    uploads = [np.load(ws / site / "simulate_job" / "upload_round1.npz") for site in ("site-1", "site-2")]
    weights = [float(u["__num_samples__"]) for u in uploads]
    expected = weighted_average([{k: u[k] for k in u.files if k != "__num_samples__"} for u in uploads], weights)
    model = safe_load(str(run / "app_server" / "FL_global_model.pt"))["model"]
    assert set(model) == set(expected)
    for k, v in expected.items():
        got = model[k].numpy() if isinstance(model[k], torch.Tensor) else np.asarray(model[k])
        assert got.dtype == v.dtype and got.tobytes() == v.tobytes(), k
    assert all(np.isfinite(np.asarray(v, np.float64)).all() for v in expected.values() if v.dtype.kind == "f")
