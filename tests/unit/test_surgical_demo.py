"""The demo switches the backbone strategy by --set alone: the job's batch-norm filters follow the strategy."""

import os

import pytest

from fedssl.jobtools import component_specs, job_configs
from fedssl.surgical_demo import JOB, comparison_table, run_surgical_demo


def test_job_batchnorm_filters_follow_the_strategy():
    paths = [c["path"] for _, cfg in job_configs(JOB) for c in component_specs(cfg)]
    assert "fedssl.flare.partial_exclusion.PartialModelExclusion" not in paths
    assert paths.count("fedssl.flare.backbone_exclusion.BackboneBNExclusion") == 3  # train + test download, upload


def test_demo_rejects_an_unknown_backbone_before_doing_anything(tmp_path):
    with pytest.raises(ValueError, match="backbone"):
        run_surgical_demo(str(tmp_path), backbone="fedprox")
    assert not os.listdir(tmp_path)


def test_comparison_table_prints_every_method():
    row = {"mean_auroc": 0.7, "shared_auroc": 0.6, "unique_auroc": None, "external_auroc": 0.65, "external_shared": 0.6,
           "external_unique": 0.7, "external_min_class": 0.55, "rounds": 3, "wall_time_s": 10.0, "kb_per_site_round": 1.5}
    text = comparison_table([{"method": "surgical", **row}, {"method": "vanilla", **row}])
    assert "surgical" in text and "vanilla" in text and "n/a" in text and "0.700" in text
