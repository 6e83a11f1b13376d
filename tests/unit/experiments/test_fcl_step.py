"""``fedssl bench fcl-step`` (fedssl.experiments.fcl_step) at the tiny size on the CPU: every measurement present,
positive and written."""

import json
import math

import pytest

from fedssl.cli import main
from fedssl.experiments.fcl_step import fcl_step_breakdown


def test_breakdown_times_every_part(tmp_path):
    result = fcl_step_breakdown(str(tmp_path), size="tiny", device="cpu", steps=1,
                                variants=({"workers": 0, "amp": False},), say=lambda m: None)
    assert json.load(open(tmp_path / "fcl_step.json")) == result
    assert [r["workers"] for r in result["trainer"]] == [0]
    assert [r["workers"] for r in result["data"]] == [0, 4]
    assert [(r["channels_last"], r["amp"]) for r in result["compute"]] == [(False, False), (False, False),
                                                                          (True, False), (True, False)]
    assert len(result["finetune"]) == 4
    rows = result["trainer"] + result["data"] + result["compute"] + result["finetune"] + [result["finetune_real"]]
    assert all(math.isfinite(r["s_per_step"]) and r["s_per_step"] > 0 for r in rows)
    # two volumes of 4-5 slices at batch 10: one step an epoch, 3 epochs
    assert result["finetune_real"]["steps"] == 3


def test_cli_help_lists_the_evidence_and_step_commands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "evidence" in out and "fcl-step" in out
