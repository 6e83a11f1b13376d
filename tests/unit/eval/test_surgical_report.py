"""Per-class AUROC tables and the shared / unique means of surgical-aggregation runs, by hand."""

import os

import numpy as np

from fedssl.eval.surgical_report import auroc_table, results_table, write_results


def reply(per_class, ext=None):
    r = {"model": "global model", "n_test": 10,
         "test": {"per_class": {c: {"auroc": v, "ci95": None, "n_pos": 1, "n": 10} for c, v in per_class.items()}}}
    if ext:
        r["external"] = {"per_class": {c: {"auroc": v, "ci95": [v - 0.1, v + 0.1], "n_pos": 1, "n": 10}
                                       for c, v in ext.items()},
                         "mean_auroc": float(np.mean(list(ext.values()))), "n_classes": len(ext), "n_images": 10}
    return r


def test_auroc_table_per_class_and_undefined_classes():
    probs = np.array([[0.9, 0.5], [0.1, 0.5], [0.8, 0.5], [0.2, 0.5]])
    targets = np.array([[1, 0], [0, 0], [1, 0], [0, 0]])
    t = auroc_table(probs, targets, ["A", "B"], n_bootstrap=50, seed=0)
    assert t["per_class"]["A"]["auroc"] == 1.0 and t["per_class"]["A"]["n_pos"] == 2
    assert t["per_class"]["B"]["auroc"] is None  # no positives: undefined, not 0.5
    assert t["mean_auroc"] == 1.0 and t["n_classes"] == 1


def test_shared_and_unique_means_by_hand(tmp_path):
    site_classes = {"site-1": ["A", "B"], "site-2": ["B", "C"]}
    sites = {"site-1": reply({"A": 0.6, "B": 0.8}, ext={"A": 0.5, "B": 0.7, "C": 0.9}),
             "site-2": reply({"B": 0.9, "C": 0.7})}
    t = results_table(sites, site_classes, ["A", "B", "C"])
    assert t["shared_classes"] == ["B"] and t["unique_classes"] == ["A", "C"]
    r1, r2 = t["sites"]
    assert (r1["mean_auroc"], r1["shared_auroc"], r1["unique_auroc"]) == (0.7, 0.8, 0.6)
    assert (r2["shared_auroc"], r2["unique_auroc"]) == (0.9, 0.7)
    assert abs(t["mean"]["unique_auroc"] - 0.65) < 1e-12
    ext = t["external"][0]
    assert ext["shared_auroc"] == 0.7 and abs(ext["unique_auroc"] - 0.7) < 1e-12
    assert ext["classes_of"] == {"site-1": 0.6, "site-2": 0.8}
    reg = {"method": "surgical", "backbone": "fedavg", "global_classes": ["A", "B", "C"], "site_classes": site_classes}
    write_results(str(tmp_path), sites, reg, "t", "last global model")
    for name in ("results.json", "results.md", "auroc.png"):
        assert os.path.getsize(tmp_path / name) > 0
    assert "| site-1 | global model | 10 | 2 | 0.700 | 0.800 | 0.600 |" in (tmp_path / "results.md").read_text()


def test_auroc_plot_draws_an_interval_that_misses_its_point_estimate(tmp_path):
    """A percentile bootstrap interval need not contain the AUROC (10 resamples, two positives): the plot used to
    raise (matplotlib refuses a negative error bar) and took the centralised run's results with it."""
    from fedssl.eval.surgical_report import auroc_plot

    per_class = {"A": {"auroc": 0.9, "ci95": [0.92, 0.97]}, "B": {"auroc": 0.4, "ci95": [0.1, 0.35]},
                 "C": {"auroc": None, "ci95": None}}
    auroc_plot({"site-1": {"test": {"per_class": per_class}}}, str(tmp_path / "auroc.png"), "t")
    assert (tmp_path / "auroc.png").stat().st_size > 0
