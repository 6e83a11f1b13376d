"""The FCL demo's record and note (fedssl.experiments.fcl_demo): simulator, data and training faked; what is checked
is ``run_config.json`` (settings, thread count, environment) and that its one-seed comparison says it is not a
finding, in the printed and the written table."""

import json
import os

import torch

from fedssl.cli import main
from fedssl.experiments import fcl_demo as fd


def _rows(method: str, mode: str, n_labelled, fold: int) -> list[dict]:
    return [{"method": method, "mode": mode, "n_labelled": n, "fold": fold, "site": s,
             "dice": 0.3 + 0.1 * n + (0.05 if method == "FCL" else 0.0)}
            for n in n_labelled for s in ("site-1", "site-2")]


def test_demo_records_its_threads_and_says_its_one_seed_comparison_is_not_a_finding(tmp_path, monkeypatch, capsys):
    run = {"global_model": "g.pt", "simulator_wall_time_s": 1.0, "rounds": [{"mean_loss": 1.0}],
           "bytes_per_site_per_round": {"upload": 1e6, "download": 1e6}}
    monkeypatch.setattr(fd, "write_synthetic_acdc", lambda data, **kw: os.makedirs(data))
    monkeypatch.setattr(fd, "run_simulation", lambda *a, **kw: run)
    monkeypatch.setattr(fd, "load_labelled_sites", lambda data, settings: {})
    monkeypatch.setattr(fd, "encoder_init", lambda path: "encoder")
    monkeypatch.setattr(fd, "export_unet_init", lambda *a, **kw: "unet.pt")
    monkeypatch.setattr(fd, "run_protocols", lambda sites, inits, *, n_labelled, folds, **kw: [
        r for m in inits for r in _rows(m, "local", n_labelled, folds[0])])
    monkeypatch.setattr(fd, "evaluate_federated", lambda model, sites, *, method, n_labelled, fold, settings:
                        _rows(method, "federated", [n_labelled], fold))
    try:
        extra = fd.run_demo(str(tmp_path), rounds=1, ft_rounds=1, n_labelled=[1], epochs=1, threads=2)
    finally:
        torch.set_num_threads(1)
    note = "one seed (0): not a finding; run fedssl fcl tables --seeds 0 1 2"
    assert extra["seeds_note"].startswith(note) and note in capsys.readouterr().out
    assert note in open(tmp_path / "report" / "dice_table.txt").read()
    config = json.load(open(tmp_path / "run_config.json"))
    assert config["threads"] == 2 and config["n_labelled"] == [1] and config["seeds"] == [0]
    assert config["environments"][0]["threads"] == 2


def test_cli_demo_passes_the_thread_count(monkeypatch):
    seen = {}
    monkeypatch.setattr(fd, "run_demo", lambda out, **kw: seen.update(kw))
    assert main(["fcl", "demo", "--out", "o"]) == 0 and seen["threads"] == 1
    assert main(["fcl", "demo", "--out", "o", "--threads", "2"]) == 0 and seen["threads"] == 2
