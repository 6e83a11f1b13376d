"""``fedssl --help`` answers at once, and every group's and verb's ``--help`` works (issue 43, item 6).

- Building the parser and printing the top-level help import no heavy library (torch, MONAI, FLARE, transformers,
  timm, ...): checked on ``sys.modules`` of a fresh interpreter, a proxy for the time that does not depend on the
  machine's load.  A generous wall-clock bound (median of three runs under 2 s; about 0.2 s measured, against about
  10 s when the parser imported an experiment module and MONAI through it) backs it up.
- The parser tree is walked: ``fedssl <path> --help`` for every group and verb at every depth exits 0 with a
  non-empty help that shows a percent sign as ``%`` (a bare ``%`` in an argument's help crashes argparse; a ``%%``
  shown to the user is one escaped where it is not %-formatted).
- The option choices of :mod:`fedssl.cli.choices` are those of the modules that use them.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import subprocess
import sys
import textwrap
import time

import pytest

from fedssl.cli import Verb, add_family, build_parser, main

#: libraries that take seconds to import: building the parser must not import any of them
HEAVY = ("torch", "torchvision", "monai", "nvflare", "transformers", "timm", "scipy", "matplotlib")

PROBE = textwrap.dedent("""
    import contextlib, io, json, runpy, sys
    sys.argv = ["fedssl", "--help"]
    out = io.StringIO()
    try:  # python3 -m fedssl.cli --help, in this interpreter
        with contextlib.redirect_stdout(out):
            runpy.run_module("fedssl.cli", run_name="__main__", alter_sys=True)
        code = "returned"
    except SystemExit as e:
        code = e.code
    from fedssl.cli import build_parser
    build_parser()
    print(json.dumps({"code": code, "help": out.getvalue(),
                      "modules": sorted({m.split(".")[0] for m in sys.modules})}))
""")


def test_help_imports_no_heavy_library():
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["code"] in (0, None) and got["help"].startswith("usage: fedssl"), got
    heavy = sorted(set(HEAVY) & set(got["modules"]))
    assert heavy == [], (f"building the fedssl parser imports {heavy}: import them inside the verb that needs them "
                         "(choices lists: fedssl.cli.choices)")


def test_python_dash_m_help_exits_0_quickly():
    times = []
    for _ in range(3):
        start = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "fedssl.cli", "--help"], capture_output=True, text=True,
                           timeout=120)
        times.append(time.perf_counter() - start)
        assert r.returncode == 0 and r.stdout.startswith("usage: fedssl"), r.stderr
    assert statistics.median(times) < 2.0, f"fedssl --help took {times} s"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def command_paths(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """``path`` and the path of every group and verb below it, depth first."""
    paths = [path]
    for name, child in _subcommands(parser).items():
        paths += command_paths(child, (*path, name))
    return paths


PATHS = command_paths(build_parser())


def help_of(path: tuple[str, ...]) -> str:
    """``fedssl <path> --help`` through :func:`fedssl.cli.main`: the help it prints (a failure raises)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as stop:
        main([*path, "--help"])
    assert stop.value.code in (0, None), f"fedssl {' '.join(path)} --help exits {stop.value.code}"
    return out.getvalue()


def test_the_walk_reaches_every_depth():
    assert () in PATHS and ("fedclf",) in PATHS and ("fedclf", "demo") in PATHS and ("job",) in PATHS
    assert len([p for p in PATHS if len(p) == 2]) >= 30  # the families' verbs


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "fedssl")
def test_every_group_and_verb_takes_help(path):
    text = help_of(path)
    assert text.startswith(f"usage: {' '.join(('fedssl', *path))}"), text[:200]
    assert "%%" not in text, "a doubled percent sign reaches the user: escape it only where argparse %-formats"


def test_percent_signs_in_verb_lines_read_as_percent():
    assert "L = 10 / 80 % (quick" in " ".join(help_of(("fedclf", "demo")).split())
    listing = " ".join(help_of(("fedclf",)).split())
    assert "at 80 % labels" in listing and "L = 10 / 80 % (quick" in listing


def test_a_verb_or_family_line_is_plain_text():
    """add_verb / add_family show a line as written, in the listing (argparse %-formats help=) and as the
    description (%-formatted only when it holds %(prog))."""
    p = argparse.ArgumentParser(prog="t")
    sub = p.add_subparsers(dest="cmd")
    add_family(sub, "fam", "100 % of %(prog)s", [Verb("v", "50 % done", lambda s: None, lambda a: None)])
    for argv, shown in ((["--help"], "100 % of %(prog)s"), (["fam", "--help"], "100 % of %(prog)s"),
                        (["fam", "--help"], "50 % done"), (["fam", "v", "--help"], "50 % done")):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
            p.parse_args(argv)
        assert shown in out.getvalue(), (argv, out.getvalue())


def test_choices_mirror_the_modules_that_use_them():
    from fedssl.cli import choices
    from fedssl.data.images import SSLFL_DATASETS
    from fedssl.experiments import fedclf_tables, feddra_demo, fedmae_table3, sslfl_control, sslfl_tables

    assert choices.SSLFL_DATASETS == tuple(SSLFL_DATASETS)
    assert choices.SSLFL_TABLE_SPLITS == tuple(sorted(sslfl_tables.SPLIT_ALPHA))
    assert choices.SSLFL_TABLE_METHODS == tuple(sslfl_tables.METHODS)
    assert choices.SSLFL_CONTROL_ARMS == sslfl_control.ARMS
    assert choices.FEDCLF_TABLES == tuple(fedclf_tables.TABLES)
    assert choices.FEDCLF_METHODS == tuple(fedclf_tables.METHODS)
    assert choices.FEDCLF_FRACTIONS == tuple(fedclf_tables.FRACTIONS)
    assert choices.TABLE3_METHODS == tuple(fedmae_table3.METHODS)
    assert choices.FEDDRA_VARIANTS == tuple(feddra_demo.VARIANTS)
