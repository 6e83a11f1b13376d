"""``fedssl cells list|forget``: FIELD=VALUE parsing, a dry run changes nothing, forget moves cells aside."""

import argparse
import json

import pytest
import torch

from fedssl.cli import main
from fedssl.cli.cells import field_value
from fedssl.experiments.table_runner import CellStore

torch.set_num_threads(1)

KEYS = [{"stage": "pretrain", "method": "FCL"}, {"stage": "diagnostics", "method": "FCL"},
        {"stage": "diagnostics", "method": "Local CL", "seed": 1}]


def test_field_value_reads_json_scalars_else_text():
    assert field_value("n_labelled=1") == ("n_labelled", 1)
    assert field_value("federated=true") == ("federated", True)
    assert field_value("method=Local CL") == ("method", "Local CL")
    assert field_value("x=[1]") == ("x", "[1]")  # not a scalar: the text
    assert field_value("note=a=b") == ("note", "a=b")
    for bad in ("stage", "=1"):
        with pytest.raises(argparse.ArgumentTypeError, match="FIELD=VALUE"):
            field_value(bad)


def _store(tmp_path):
    store = CellStore(tmp_path / "cells.jsonl")
    for i, key in enumerate(KEYS):
        store.put(key, i, 2.0)
    return tmp_path / "cells.jsonl"


def test_list_and_a_dry_run_change_nothing(tmp_path, capsys):
    path = _store(tmp_path)
    before = path.read_bytes()
    assert main(["cells", "list", str(tmp_path), "stage=diagnostics"]) == 0
    out = capsys.readouterr().out
    assert "stage=diagnostics method=Local CL seed=1  (2.0 s)" in out and "2 of 3 cells" in out
    assert main(["cells", "forget", str(tmp_path), "method=Local CL", "--dry-run"]) == 0
    assert "would forget 1 of 3" in capsys.readouterr().out
    assert path.read_bytes() == before and not (tmp_path / "cells.forgotten.jsonl").exists()


def test_forget_moves_the_matching_cells_to_the_forgotten_file(tmp_path, capsys):
    path = _store(tmp_path)
    assert main(["cells", "forget", str(path), "stage=diagnostics", "method=FCL"]) == 0
    assert "forgot 1 cells; 2 remain" in capsys.readouterr().out
    assert [r["key"] for r in CellStore(path).results()] == [KEYS[0], KEYS[2]]
    assert ([json.loads(line)["key"] for line in (tmp_path / "cells.forgotten.jsonl").read_text().splitlines()]
            == [KEYS[1]])


def test_a_missing_store_or_field_is_refused_by_name(tmp_path, capsys):
    assert main(["cells", "list", str(tmp_path / "none")]) == 2
    assert f"{tmp_path / 'none'} does not exist" in capsys.readouterr().err  # not a folder: named as given
    assert main(["cells", "list", str(tmp_path)]) == 2
    assert f"{tmp_path}/cells.jsonl does not exist" in capsys.readouterr().err
    _store(tmp_path)
    with pytest.raises(SystemExit):
        main(["cells", "forget", str(tmp_path)])  # forgetting needs a FIELD=VALUE: argparse refuses
    assert "FIELD=VALUE" in capsys.readouterr().err
