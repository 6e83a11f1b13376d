"""``fedssl <family> <verb>`` and the generic top-level verbs: the command line's structure, its checks and errors."""

import argparse
import os
import subprocess
import sys

import pytest

import fedssl.cli
from fedssl.cli import COMMAND_MODULES, build_parser, main
from fedssl.ops.jobs import REPO_ROOT

#: the flat names of the verbs before they were grouped by family (0.1.0 development); none is a command
FORMER_FLAT_NAMES = ("synth", "link-sites", "finetune", "export-unet", "table7", "demo", "synth-images", "partition",
                     "demo-sslfl", "finetune-vit", "export-vit-encoder", "evaluate-vit", "bench-vit", "demo-surgical",
                     "surgical-central")


def _parser() -> tuple[argparse.ArgumentParser, dict]:
    p = build_parser()
    (sub,) = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    return p, sub.choices


def test_the_former_flat_names_are_no_commands(capsys):
    _, top = _parser()
    assert not set(FORMER_FLAT_NAMES) & set(top)
    with pytest.raises(SystemExit) as stop:
        main(["synth", "acdc", "out"])
    assert stop.value.code == 2 and "invalid choice: 'synth'" in capsys.readouterr().err


def test_errors_name_the_command_as_typed(tmp_path, capsys):
    assert main(["sslfl", "finetune", "--data-root", str(tmp_path / "none"), "--init", "x=scratch"]) == 2
    assert capsys.readouterr().err.startswith("fedssl sslfl finetune: error: data root")


def test_help_lists_families_and_generic_verbs(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    listed = [line.split()[0] for line in out.split("positional arguments:")[1].split("options:")[0].splitlines()
              if line.startswith("    ") and not line.startswith("     ")]
    assert listed == ["fcl", "sslfl", "fedclf", "feddra", "surgical", "bench", "cells", "site-local", "job", "simulate",
                      "deploy-local", "submit"]
    assert "deprecated" not in out.lower()
    with pytest.raises(SystemExit):
        main(["sslfl"])  # a family needs a verb
    assert "required: VERB" in capsys.readouterr().err


def test_command_modules_hook_adds_subcommands(monkeypatch, capsys):
    import types

    mod = types.ModuleType("fedssl_test_ext")

    def register(sub):
        s = sub.add_parser("hello")
        s.set_defaults(fn=lambda a: print("hi"))

    mod.register = register
    monkeypatch.setitem(sys.modules, "fedssl_test_ext", mod)
    monkeypatch.setattr(fedssl.cli, "COMMAND_MODULES", COMMAND_MODULES + ("fedssl_test_ext",))
    assert main(["hello"]) == 0 and capsys.readouterr().out == "hi\n"


def test_python_dash_m():
    r = subprocess.run([sys.executable, "-m", "fedssl.cli", "surgical", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "central" in r.stdout


FCL_JOB = os.path.join(REPO_ROOT, "jobs", "fcl_acdc")
#: the ranges the messages state
WHOLE, POSITIVE = "expected a whole number >= 1", "expected a number > 0"


@pytest.mark.parametrize("argv, message", [
    (["job", FCL_JOB, "OUT", "--sites", "-3"], "--sites: '-3' is out of range: " + WHOLE),
    (["job", FCL_JOB, "OUT", "--sites", "0"], "--sites: '0' is out of range: " + WHOLE),
    (["job", FCL_JOB, "OUT", "--sites", "3.5"], "--sites: '3.5' is not a whole number >= 1"),
    (["simulate", FCL_JOB, "-w", "OUT", "--data-root", "d", "--sites", "-3"],
     "--sites: '-3' is out of range: " + WHOLE),
    (["simulate", FCL_JOB, "-w", "OUT", "--data-root", "d", "--sites", "2", "--retries", "-1"],
     "--retries: '-1' is out of range: expected a whole number >= 0"),
    (["deploy-local", FCL_JOB, "-w", "OUT", "--data-root", "d", "--sites", "2", "--timeout", "0"],
     "--timeout: '0' is out of range: " + POSITIVE),
    (["fcl", "demo", "--out", "OUT", "--rounds", "0"], "--rounds: '0' is out of range: " + WHOLE),
    (["fcl", "table7", "--out", "OUT", "--sites", "0"], "--sites: '0' is out of range: " + WHOLE),
    (["sslfl", "partition", "retina", "src", "OUT", "--alpha", "0"], "--alpha: '0' is out of range: " + POSITIVE),
    (["sslfl", "demo", "--out", "OUT", "--ft-lr", "nan"], "--ft-lr: 'nan' is out of range: " + POSITIVE),
    (["surgical", "demo", "--out", "OUT", "--patients", "-1"], "--patients: '-1' is out of range: " + WHOLE),
])
def test_numeric_flags_out_of_range_stop_at_the_command_line(tmp_path, capsys, argv, message):
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.split(": error: argument ", 1)[1] == message  # the value, and the range it had to be in
    assert os.listdir(tmp_path) == []


def test_every_numeric_flag_has_a_range():
    """No bare ``type=int`` / ``type=float`` left: every numeric flag states its range (fedssl.cli.Number)."""
    _, top = _parser()
    parsers = list(top.values())
    bare = []
    while parsers:
        parser = parsers.pop()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers += action.choices.values()
            elif action.type in (int, float):
                bare.append(f"{parser.prog} {action.option_strings or action.dest}")
    assert bare == []


def test_bad_override_value_is_one_error_before_the_simulator_or_a_workspace(tmp_path, capsys, monkeypatch):
    import fedssl.ops.simulate

    ran = []
    monkeypatch.setattr(fedssl.ops.simulate, "run_simulation", lambda *a, **k: ran.append(a))
    ws = tmp_path / "ws"
    rc = main(["simulate", FCL_JOB, "-w", str(ws), "--data-root", "d", "--sites", "2",
               "--set", "server.scatter_and_gather.num_rounds=five"])
    err = capsys.readouterr().err
    assert rc == 2 and ran == [] and os.listdir(tmp_path) == []
    assert err.count("\n") == 1 and "component 'scatter_and_gather'" in err and "num_rounds='five'" in err


@pytest.mark.parametrize("flags, timeout_s, retries", [([], None, 2), (["--timeout", "90", "--retries", "0"], 90, 0)])
def test_simulate_passes_its_timeout_and_retries_on(tmp_path, capsys, monkeypatch, flags, timeout_s, retries):
    import fedssl.ops.simulate

    ran = []

    def fake(*a, **k):
        ran.append(k)
        return {"simulator_wall_time_s": 1.0, "global_model": "m", "bytes_per_site_per_round": {"upload": 1,
                                                                                                "download": 2}}

    monkeypatch.setattr(fedssl.ops.simulate, "run_simulation", fake)
    assert main(["simulate", FCL_JOB, "-w", str(tmp_path / "ws"), "--data-root", "d", "--sites", "2", *flags]) == 0
    assert (ran[0]["timeout_s"], ran[0]["retries"]) == (timeout_s, retries)
    assert "done in 1.0 s" in capsys.readouterr().out


def test_os_errors_are_one_line_naming_the_path(tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("")
    assert main(["job", FCL_JOB, str(tmp_path / "file" / "job")]) == 1
    assert capsys.readouterr().err == f"fedssl job: error: {tmp_path / 'file'}: is not a folder, so the output " \
                                      "cannot go inside it\n"
    assert main(["fcl", "synth", "acdc", str(tmp_path / "file" / "data"), "--patients", "1", "--sites", "1"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(tmp_path / "file") in err and "Traceback" not in err

    import tempfile

    def denied(prefix, dir):
        raise PermissionError(13, "Permission denied", dir)

    monkeypatch.setattr(tempfile, "mkdtemp", denied)  # an output folder this user may not write
    assert main(["job", FCL_JOB, str(tmp_path / "ro" / "job")]) == 1
    assert capsys.readouterr().err == f"fedssl job: error: {tmp_path / 'ro'}: Permission denied\n"
    assert main(["job", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"fedssl job: error: {tmp_path / 'missing'} is not a job folder (no meta.json)\n"


def test_fcl_volumes_prints_the_group_table_over_site_folders(tmp_path, capsys):
    """Two synthetic sites: every patient is counted once, under its group, and --json keeps the per-patient rows
    with their site."""
    import json

    assert main(["fcl", "synth", "acdc", str(tmp_path / "d"), "--patients", "5", "--sites", "2", "--size", "32"]) == 0
    capsys.readouterr()
    assert main(["fcl", "volumes", str(tmp_path / "d"), "--json", str(tmp_path / "v.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| group | n | RV ml (ED / ES)")
    assert sum(int(line.split("|")[2]) for line in lines[2:]) == 5  # --patients counts all sites
    data = json.loads((tmp_path / "v.json").read_text())
    assert len(data["patients"]) == 5 and {r["site"] for r in data["patients"]} == {"site-1", "site-2"}
    n_site1 = sum(r["site"] == "site-1" for r in data["patients"])
    assert main(["fcl", "volumes", str(tmp_path / "d" / "site-1")]) == 0  # one site's folder: its patients only
    lines = capsys.readouterr().out.splitlines()
    assert sum(int(line.split("|")[2]) for line in lines[2:]) == n_site1
    assert [g["group"] for g in data["groups"]] == ["NOR", "MINF", "DCM", "HCM", "RV"]


#: the verbs that compute (demos and table runners): argv, and the function (module, name) it hands its settings to
COMPUTING_VERBS = (
    (["fcl", "tables", "--out", "o"], ("fcl_tables", "run_fcl_tables")), (["fcl", "demo"], ("fcl_demo", "run_demo")),
    (["sslfl", "tables", "--out", "o"], ("sslfl_tables", "run_sslfl_table")),
    (["sslfl", "demo"], ("sslfl_demo", "run_sslfl_demo")),
    (["fedclf", "tables", "--out", "o"], ("fedclf_tables", "run_fedclf_tables")),
    (["fedclf", "table3", "--out", "o"], ("fedmae_table3", "run_table3")),
    (["fedclf", "demo"], ("fedclf_tables", "run_fedclf_demo")), (["feddra", "demo"], ("feddra_demo", "run")),
    (["feddra", "table", "--out", "o"], ("feddra_demo", "run")),
    (["surgical", "demo"], ("surgical_demo", "run_surgical_demo")))


@pytest.mark.parametrize("argv, target", COMPUTING_VERBS, ids=lambda v: " ".join(v[:2]) if isinstance(v, list) else "")
def test_every_computing_verb_takes_threads_default_one_and_hands_it_on(argv, target, monkeypatch):
    import importlib

    p, _ = _parser()
    assert p.parse_args(argv).threads == 1  # one torch thread per process unless told otherwise
    with pytest.raises(SystemExit):
        p.parse_args([*argv, "--threads", "0"])
    seen = {}
    monkeypatch.setattr(importlib.import_module(f"fedssl.experiments.{target[0]}"), target[1],
                        lambda *a, **kw: seen.update(kw))
    assert main([*argv, "--threads", "3"]) == 0 and seen["threads"] == 3


def test_bench_control_can_leave_the_centralised_arm_out(monkeypatch):
    """``--multipliers`` with no value: random init and the federated arms only (more seeds of one arm)."""
    from fedssl.experiments import control

    seen = {}
    monkeypatch.setattr(control, "fcl_control", lambda *a, **kw: seen.update(kw))
    assert main(["bench", "control", "--out", "o", "--multipliers", "--federated-multipliers", "4"]) == 0
    assert seen["multipliers"] == [] and seen["federated_multipliers"] == [4]


def test_bench_control_can_leave_the_federated_arm_out(monkeypatch):
    """``--federated-multipliers`` with no value: random init and the centralised arm only (a long multiplier's seeds
    as separate processes, without re-running the federated 1x)."""
    from fedssl.experiments import control

    seen = {}
    monkeypatch.setattr(control, "fcl_control", lambda *a, **kw: seen.update(kw))
    assert main(["bench", "control", "--out", "o", "--multipliers", "16", "--federated-multipliers"]) == 0
    assert seen["multipliers"] == [16] and seen["federated_multipliers"] == []


def test_feddra_table_hands_turns_and_patients_to_the_runner_as_demo_settings(monkeypatch):
    from fedssl.experiments import feddra_demo

    seen = []
    monkeypatch.setattr(feddra_demo, "run", lambda *a, **kw: seen.append(kw["settings"]))
    assert main(["feddra", "table", "--out", "o", "--patients", "5000", "--turns", "25"]) == 0
    assert main(["feddra", "table", "--out", "o"]) == 0
    assert main(["feddra", "table", "--out", "o", "--style-coupling", "1"]) == 0
    assert main(["feddra", "table", "--out", "o", "--device-rate", "0.3"]) == 0
    assert seen == [{"turns": 25, "n_patients": 5000}, None, {"style_coupling": 1.0},
                    {"device_rate": 0.3}]  # None: the demo's own
    p, _ = _parser()
    with pytest.raises(SystemExit):
        p.parse_args(["feddra", "table", "--out", "o", "--patients", "0"])
    with pytest.raises(SystemExit):
        p.parse_args(["feddra", "table", "--out", "o", "--style-coupling", "1.5"])
    with pytest.raises(SystemExit):
        p.parse_args(["feddra", "table", "--out", "o", "--device-rate", "-0.1"])


def test_bench_control_merge_merges_and_computes_nothing(monkeypatch):
    from fedssl.experiments import control

    seen = {}
    monkeypatch.setattr(control, "merge_controls", lambda out, sources, **kw: seen.update(out=out, sources=sources))
    monkeypatch.setattr(control, "fcl_control", lambda *a, **kw: pytest.fail("computed"))
    assert main(["bench", "control", "--out", "all", "--merge", "s0", "s1", "s2"]) == 0
    assert seen == {"out": "all", "sources": ["s0", "s1", "s2"]}


def test_bench_loss_trace_hands_its_settings_on(monkeypatch):
    from fedssl.experiments import control

    seen = {}
    monkeypatch.setattr(control, "loss_trace", lambda out, **kw: seen.update(out=out, **kw))
    assert main(["bench", "loss-trace", "--out", "t", "--seed", "2", "--multiplier", "4",
                 "--no-structural-matching"]) == 0
    assert seen["out"] == "t" and seen["seed"] == 2 and seen["multiplier"] == 4
    assert seen["structural_matching"] is False and seen["size"] == "bench" and seen["probe_slices"] == 400
    assert seen["fresh_bank"] is True
    assert main(["bench", "loss-trace", "--out", "t", "--no-fresh-bank"]) == 0 and seen["fresh_bank"] is False
