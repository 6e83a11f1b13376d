"""``fedssl cells list|forget``: look into a table run's finished cells and drop some so the next run recomputes them.

Every table runner (``fedssl fcl tables``, ``fedssl sslfl tables``, ``fedssl fedclf tables``, ``fedssl feddra demo``,
...) keeps its finished cells in ``<out>/cells.jsonl`` and skips them when run again.  After a fix to one stage
(say the diagnostics), ``fedssl cells forget <out> stage=diagnostics`` moves those cells to
``<out>/cells.forgotten.jsonl`` and the same tables command then runs them again, and only them.
"""

from __future__ import annotations

import argparse
import json
import os

from fedssl.cli import Verb, add_family


def field_value(text: str) -> tuple[str, object]:
    """argparse ``type`` of ``FIELD=VALUE``: the value as JSON when it reads as a JSON scalar (``n_labelled=1`` is
    the number 1, ``federated=true`` the boolean), else the text itself (``method=Local CL``)."""
    field, sep, raw = text.partition("=")
    if not sep or not field:
        raise argparse.ArgumentTypeError(f"{text!r} is not FIELD=VALUE (e.g. stage=diagnostics or n_labelled=1)")
    try:
        value = json.loads(raw)
    except ValueError:
        return field, raw
    return field, value if isinstance(value, (str, int, float, bool, type(None))) else raw


def _store(out: str):
    from fedssl.experiments.table_runner import CellStore

    path = os.path.join(out, "cells.jsonl") if os.path.isdir(out) else out
    if not os.path.isfile(path):
        raise ValueError(f"{path} does not exist; give a table run's --out folder (it holds cells.jsonl) or the "
                         "cells.jsonl file itself")
    return CellStore(path)


def _lines(records) -> list[str]:
    from fedssl.experiments.table_runner import key_summary

    return [f"  {key_summary(r['key'])}  ({r['seconds']:.1f} s)" for r in records]


def _args(s: argparse.ArgumentParser, *, required: bool) -> None:
    s.add_argument("out", help="a table run's output folder (or its cells.jsonl)")
    s.add_argument("match", nargs="+" if required else "*", type=field_value, metavar="FIELD=VALUE",
                   help="cells whose key has this field with this value (all given must hold); e.g. "
                        "stage=diagnostics method=FCL, or n_labelled=1 seed=2")


def _list_args(s: argparse.ArgumentParser) -> None:
    _args(s, required=False)


def _list(a) -> None:
    store = _store(a.out)
    records = store.matching(dict(a.match)) if a.match else store.results()
    print("\n".join([*_lines(records), f"{len(records)} of {len(store.results())} cells in {store.path}"]))


def _forget_args(s: argparse.ArgumentParser) -> None:
    _args(s, required=True)
    s.add_argument("--dry-run", action="store_true", help="only list the cells that would be forgotten")


def _forget(a) -> None:
    store = _store(a.out)
    match = dict(a.match)
    if a.dry_run:
        records = store.matching(match)
        print("\n".join([*_lines(records), f"would forget {len(records)} of {len(store.results())} cells in "
                                           f"{store.path} (dry run: nothing changed)"]))
        return
    records = store.forget(match)
    where = os.path.splitext(store.path)[0] + ".forgotten.jsonl"
    print("\n".join([*_lines(records), f"forgot {len(records)} cells; {len(store.results())} remain in "
                                       f"{store.path}" + (f"; the forgotten ones are kept in {where}, and the "
                                                          "next run of the same command computes them again"
                                                          if records else "")]))


VERBS = (
    Verb("list", "the finished cells of a table run (all, or those matching FIELD=VALUE)", _list_args, _list),
    Verb("forget", "move the finished cells matching FIELD=VALUE out of a table run's cells.jsonl (kept in "
                   "cells.forgotten.jsonl), so the next run computes them again", _forget_args, _forget),
)


def register(sub) -> None:
    add_family(sub, "cells", "a table run's finished cells: list them, or forget some so the next run recomputes "
                             "them (e.g. after a fix to one stage)", VERBS)
