"""End to end in the FLARE simulator: federated 3D segmentation (acdc_seg3d, quick profile), 2 sites, 2 rounds,
tiny volumes; then the last global model on each site's held-out patients (FinalEvaluation)."""

import json
import math
import os

import pytest
import torch

from fedssl.data.acdc_synthetic import write_synthetic_acdc
from fedssl.models.dynunet3d import DynUNet3D
from fedssl.ops.jobs import REPO_ROOT
from fedssl.ops.simulate import run_simulation

pytestmark = pytest.mark.slow


def test_acdc_seg3d_runs_and_reports_dice_and_hd95(tmp_path):
    data = tmp_path / "acdc"
    write_synthetic_acdc(data, n_patients=6, n_sites=2, seed=0, shape=(64, 64), n_frames=4)
    run = run_simulation(os.path.join(REPO_ROOT, "jobs", "acdc_seg3d"), str(tmp_path / "ws"), n_sites=2,
                         data_root=str(data / "{site}"), profile="quick", echo=False,
                         sets=["server.scatter_and_gather.num_rounds=2", "client.seg3d_trainer.local_epochs=1"])
    assert [r["aggregated_sites"] for r in run["rounds"]] == [2, 2]
    state = torch.load(run["global_model"], weights_only=True)["model"]
    net = DynUNet3D(filters=[8, 16, 32, 64], pixdim=[2.5, 2.5, 10.0], roi_size=[48, 48, 8], num_classes=3)
    net.load_state_dict(state)  # strict: the persisted model is the job's network, without DynUNet's aliases
    # bytes: each tensor once (DynUNet registers its blocks twice; the aliases do not travel)
    params = sum(p.numel() for p in net.parameters())
    assert run["bytes_per_site_per_round"]["upload"] < 1.1 * 4 * params
    with open(os.path.join(run["workspace"], "server", "simulate_job", "test_metrics.json")) as f:
        report = json.load(f)
    assert sorted(report["sites"]) == ["site-1", "site-2"]
    for site, m in report["sites"].items():
        assert m["n"] == 2 and 0 <= m["dice"] <= 1  # one held-out patient = its ED and ES volumes
        assert all(0 <= m[f"dice_{c}"] <= 1 for c in ("RV", "MYO", "LV"))
        assert m["hd95"] is None or (math.isfinite(m["hd95"]) and m["hd95"] >= 0)
