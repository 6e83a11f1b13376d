"""``fedssl fedclf synth`` and ``fedssl fedclf devices``: the synthetic sources, then the 10 device folders."""

import json

import pytest

from fedssl.cli import main


def test_synth_then_devices(tmp_path, capsys):
    assert main(["fedclf", "synth", str(tmp_path / "raw"), "--isic-images", "70", "--size", "24"]) == 0
    raw = tmp_path / "raw"
    assert main(["fedclf", "devices", str(tmp_path / "dev"), "--isic", str(raw / "isic2019"), "--atlasderm",
                 str(raw / "atlasderm"), "--dermnet", str(raw / "dermnet"), "--darkderm", str(raw / "darkderm"),
                 "--short-edge", "16"]) == 0
    out = capsys.readouterr().out
    assert "site-10: DarkDerm" in out and "skipped_categories" in out
    report = json.loads((tmp_path / "dev" / "devices.json").read_text())
    assert len(report["devices"]) == 10 and report["settings"]["short_edge"] == 16


def test_devices_needs_every_source(tmp_path):
    with pytest.raises(SystemExit):
        main(["fedclf", "devices", str(tmp_path / "dev"), "--isic", str(tmp_path)])


def test_tables_verb_passes_the_settings(tmp_path, monkeypatch):
    from fedssl.experiments import fedclf_tables as ft

    seen = {}
    monkeypatch.setattr(ft, "run_fedclf_tables", lambda out, settings, **kw: seen.update(out=out, s=settings, **kw))
    assert main(["fedclf", "tables", "--out", str(tmp_path), "--tables", "2", "--methods", "random", "fedclf",
                 "--fractions", "0.1", "--workers", "2"]) == 0
    assert seen["s"]["tables"] == [2] and seen["s"]["methods"] == ["random", "fedclf"] and seen["workers"] == 2
    assert seen["threads"] == 1  # one torch thread per process unless told otherwise
    assert main(["fedclf", "tables", "--out", str(tmp_path), "--threads", "2"]) == 0 and seen["threads"] == 2
    with pytest.raises(SystemExit):
        main(["fedclf", "tables", "--out", str(tmp_path), "--fractions", "0.3"])


def test_tables_run_three_training_seeds_by_default_on_one_split_seed(tmp_path, monkeypatch):
    from fedssl.experiments import fedclf_tables as ft

    seen = {}
    monkeypatch.setattr(ft, "run_fedclf_tables", lambda out, settings, **kw: seen.update(s=settings))
    assert main(["fedclf", "tables", "--out", str(tmp_path)]) == 0
    assert seen["s"]["seeds"] == [0, 1, 2] and seen["s"]["split_seed"] == 0
    assert main(["fedclf", "tables", "--out", str(tmp_path), "--seeds", "0", "--split-seed", "3"]) == 0
    assert seen["s"]["seeds"] == [0] and seen["s"]["split_seed"] == 3
