"""The ablation tooling (paper sec. 2.4.1 / 2.6): the partitioner's run record and the paired comparison of two
methods from their results.json files."""

import json

import pytest

from fedssl.data.cxr import NIH_CLASSES, shared_class_lists
from fedssl.experiments.surgical_ablation import compare_runs, partition


def test_partition_records_the_sites_and_the_job_overrides(tmp_path):
    rec = partition(str(tmp_path / "abl"), 2, 4, synthetic_patients=20, seed=1, image_size=16)
    lists = shared_class_lists(NIH_CLASSES, 2, 4, seed=1)
    with open(tmp_path / "abl" / "partition.json") as f:
        assert json.load(f) == rec
    assert rec["n_sites"] == 2 and rec["data_root"] == str(tmp_path / "abl" / "{site}")
    assert [len(s["classes"]) for s in rec["sites"].values()] == [4 + 5, 4 + 5]  # 4 shared + 10 unique dealt to 2
    assert rec["sets"] == ["client.cxr_trainer.dataset=nih",
                           "client.cxr_trainer.classes=" + json.dumps({"site-1": lists[0], "site-2": lists[1]}),
                           f"client.cxr_trainer.external_test_root={tmp_path / 'abl' / 'nih_test'}",
                           "server.class_registration.backbone=fedbn_plus"]  # paper: FedBN+ for all FL approaches
    with pytest.raises(ValueError, match="either nih_root"):
        partition(str(tmp_path / "x"), 2, 4)


def results(path, per_class, mean):
    payload = {"sites": {"site-1": {"test": {"per_class": {c: {"auroc": v} for c, v in per_class.items()}}}},
               "table": {"mean": {"mean_auroc": mean}, "external": []}}
    path.write_text(json.dumps(payload))
    return str(path)


def test_one_run_each_is_compared_class_by_class(tmp_path):
    a = results(tmp_path / "a.json", {"A": 0.75, "B": 0.5, "C": 0.875, "D": 1.0}, 0.78)
    b = results(tmp_path / "b.json", {"A": 0.5, "B": 0.25, "C": 0.625, "D": 0.5}, 0.47)
    res = compare_runs([a], [b])
    assert res["unit"] == "class" and [p["label"] for p in res["pairs"]] == ["site-1/A", "site-1/B", "site-1/C",
                                                                            "site-1/D"]
    assert res["wilcoxon"]["p"] == 0.125  # 4 positive differences: 2 * 1/16
    assert res["t_test"]["mean_diff"] == pytest.approx(0.3125)


def test_several_runs_each_are_compared_run_by_run(tmp_path):
    a = [results(tmp_path / f"a{i}.json", {"A": 0.9}, m) for i, m in enumerate((0.75, 0.875, 0.5))]
    b = [results(tmp_path / f"b{i}.json", {"A": 0.9}, m) for i, m in enumerate((0.5, 0.625, 0.25))]
    res = compare_runs(a, b)
    assert (res["unit"] == "run" and [(p["a"], p["b"]) for p in res["pairs"]]
            == [(0.75, 0.5), (0.875, 0.625), (0.5, 0.25)])
    assert res["t_test"]["p"] == 0.0 and res["wilcoxon"]["p"] == 0.25  # three identical +0.25 differences
    with pytest.raises(ValueError, match="not a readable results.json"):
        compare_runs([str(tmp_path / "none.json")], [b[0]])
