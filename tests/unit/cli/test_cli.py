"""``fedssl <family> <verb>``, the generic top-level verbs, and the deprecated flat aliases (same arguments)."""

import argparse
import subprocess
import sys

import pytest

import fedssl.cli
from fedssl.cli import COMMAND_MODULES, main

#: every pre-family flat name and the command it now stands for
ALIASES = {
    "synth": "fcl synth", "link-sites": "fcl link-sites", "finetune": "fcl finetune", "export-unet": "fcl export-unet",
    "table7": "fcl table7", "demo": "fcl demo",
    "synth-images": "sslfl synth", "partition": "sslfl partition", "demo-sslfl": "sslfl demo",
    "finetune-vit": "sslfl finetune", "export-vit-encoder": "sslfl export-encoder", "evaluate-vit": "sslfl evaluate",
    "bench-vit": "sslfl bench",
    "demo-surgical": "surgical demo", "surgical-central": "surgical central",
}
TOP_LEVEL = ("job", "simulate", "site-local", "deploy-local", "submit")


def _parser() -> tuple[argparse.ArgumentParser, dict]:
    import importlib

    p = argparse.ArgumentParser(prog="fedssl")
    sub = p.add_subparsers(dest="cmd", required=True)
    for module in COMMAND_MODULES:
        importlib.import_module(module).register(sub)
    return p, sub.choices


def _options(parser: argparse.ArgumentParser) -> list[tuple]:
    return [(tuple(a.option_strings), a.dest, a.default, a.nargs, a.type, tuple(a.choices or ()), a.required)
            for a in parser._actions]


def test_every_flat_name_is_an_alias_with_the_arguments_of_its_new_verb():
    _, top = _parser()
    for old, new in ALIASES.items():
        family, verb = new.split()
        new_parser = top[family]._subparsers._group_actions[0].choices[verb]
        assert _options(top[old]) == _options(new_parser), old
        assert top[old].get_default("fn") is new_parser.get_default("fn"), old
        assert top[old].get_default("alias_of") == f"fedssl {new}"
    for name in TOP_LEVEL:
        assert name in top and not top[name].get_default("alias_of")


def test_alias_warns_once_on_stderr_and_runs_the_new_verb(tmp_path, capsys):
    assert main(["synth", "acdc", str(tmp_path / "old"), "--patients", "2", "--sites", "1", "--size", "32"]) == 0
    out, err = capsys.readouterr()
    assert err == "fedssl synth: deprecated alias of 'fedssl fcl synth', kept for one release\n"
    assert main(["fcl", "synth", "acdc", str(tmp_path / "new"), "--patients", "2", "--sites", "1", "--size", "32"]) == 0
    out2, err2 = capsys.readouterr()
    assert err2 == "" and out2.replace("new", "old") == out
    assert sorted(p.name for p in (tmp_path / "new").rglob("*")) == sorted(p.name for p in (tmp_path / "old").rglob("*"))


def test_errors_name_the_command_as_typed(tmp_path, capsys):
    assert main(["sslfl", "finetune", "--data-root", str(tmp_path / "none"), "--init", "x=scratch"]) == 2
    assert capsys.readouterr().err.startswith("fedssl sslfl finetune: error: data root")
    assert main(["finetune-vit", "--data-root", str(tmp_path / "none"), "--init", "x=scratch"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("fedssl finetune-vit: deprecated alias of 'fedssl sslfl finetune'")
    assert err[1].startswith("fedssl finetune-vit: error: data root")


def test_help_lists_families_and_generic_verbs_not_aliases(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    listed = [line.split()[0] for line in out.split("positional arguments:")[1].split("options:")[0].splitlines()
              if line.startswith("    ") and not line.startswith("     ")]
    assert listed == ["fcl", "sslfl", "surgical", "site-local", "job", "simulate", "deploy-local", "submit"]
    assert "demo-sslfl = fedssl sslfl demo" in " ".join(out.split())
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
