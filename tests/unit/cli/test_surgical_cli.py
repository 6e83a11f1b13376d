"""``fedssl surgical compare`` / ``partition`` / ``central --missing-classes``: the CLI hooks of issue 13 items 10,
15."""

import json

import pytest

from fedssl.cli import main


def write(path, per_class):
    path.write_text(json.dumps({"sites": {"site-1": {"test": {"per_class": {c: {"auroc": v}
                                                                            for c, v in per_class.items()}}}},
                                "table": {"mean": {"mean_auroc": 0.5}, "external": []}}))
    return str(path)


def test_compare_prints_both_tests_and_writes_json(tmp_path, capsys):
    a = write(tmp_path / "a.json", {"A": 0.75, "B": 0.5, "C": 0.875, "D": 1.0})
    b = write(tmp_path / "b.json", {"A": 0.5, "B": 0.25, "C": 0.625, "D": 0.5})
    assert main(["surgical", "compare", "--a", a, "--b", b, "--out", str(tmp_path / "cmp.json")]) in (0, None)
    line = capsys.readouterr().out
    assert "4 class-level pairs (test): mean difference A - B +0.3125" in line
    assert "Wilcoxon signed-rank W+ = 10, W- = 0, p = 0.125" in line
    assert json.loads((tmp_path / "cmp.json").read_text())["wilcoxon"]["p"] == 0.125


def test_partition_prints_the_sites_and_the_simulate_command(tmp_path, capsys):
    out = tmp_path / "abl"
    main(["surgical", "partition", "--out", str(out), "--synthetic", "20", "--clients", "2", "--shared", "14"])
    text = capsys.readouterr().out
    assert "site-1:" in text and "site-2:" in text and "14 classes" in text
    assert f"fedssl simulate jobs/surgical_cxr -w WORKSPACE --sites 2 --data-root {out}/{{site}}" in text
    assert json.loads((out / "partition.json").read_text())["n_shared"] == 14


def test_central_takes_the_missing_classes_switch(capsys):
    with pytest.raises(SystemExit) as stop:  # argparse exits 0 after printing the help
        main(["surgical", "central", "--help"])
    assert stop.value.code == 0
    assert "--missing-classes {negative,ignore}" in capsys.readouterr().out
