"""The demo's backbone variants of jobs/surgical_cxr are valid jobs (FedAvg: no batch-norm exclusion filters)."""

import json
import os

import pytest

from fedssl.jobtools import component_specs, job_configs
from fedssl.surgical_demo import comparison_table, job_variant
from tests.jobs.test_job_configs import check_job


@pytest.mark.parametrize("backbone", ["fedavg", "fedbn_plus"])
def test_job_variant(tmp_path, backbone):
    job = job_variant(str(tmp_path), backbone)
    assert os.path.basename(job) == "surgical_cxr" and check_job(job) >= 3
    paths = [c["path"] for _, cfg in job_configs(job) for c in component_specs(cfg)]
    assert ("fedssl.flare.partial_exclusion.PartialModelExclusion" in paths) == (backbone != "fedavg")
    for _, cfg in job_configs(job):
        assert all(g["filters"] for k in ("task_data_filters", "task_result_filters") for g in cfg.get(k, []))
    with open(os.path.join(job, "app", "config", "config_fed_server.json")) as f:
        reg = [c for c in component_specs(json.load(f)) if c["id"] == "class_registration"][0]
    assert reg["args"]["backbone"] == backbone
    with pytest.raises(ValueError, match="backbone"):
        job_variant(str(tmp_path), "fedprox")


def test_comparison_table_prints_every_method():
    row = {"mean_auroc": 0.7, "shared_auroc": 0.6, "unique_auroc": None, "external_auroc": 0.65, "external_shared": 0.6,
           "external_unique": 0.7, "external_min_class": 0.55, "rounds": 3, "wall_time_s": 10.0, "kb_per_site_round": 1.5}
    text = comparison_table([{"method": "surgical", **row}, {"method": "vanilla", **row}])
    assert "surgical" in text and "vanilla" in text and "n/a" in text and "0.700" in text
