"""``fedssl`` command line: ``fedssl <family> <verb>`` for the method families (fcl, sslfl, fedclf, surgical: synthetic
data, demos, fine-tuning, reports) and the generic job verbs (job, simulate, site-local, deploy-local, submit)."""

from __future__ import annotations

import argparse
import importlib
import math
import os
import shutil
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

#: modules that add their own subcommands: each defines ``register(sub)`` (sub = argparse subparsers); a method
#: family registers ``fedssl <family> <verb>`` with :func:`add_family`.  Building the parser imports these modules
#: only: they import torch, MONAI, FLARE or an experiment module inside the verb that runs, never at the top or in
#: the function adding a verb's arguments (the choices such a module lists are in :mod:`fedssl.cli.choices`), so
#: ``fedssl --help`` answers at once (tests/unit/cli/test_cli_help.py)
COMMAND_MODULES: tuple[str, ...] = ("fedssl.cli.fcl", "fedssl.cli.sslfl", "fedssl.cli.fedclf", "fedssl.cli.feddra",
                                     "fedssl.cli.surgical", "fedssl.cli.bench", "fedssl.cli.cells",
                                     "fedssl.cli.ops")


@dataclass(frozen=True)
class Verb:
    """One subcommand: name, help line (plain text: a ``%`` is a percent sign), the function adding its arguments
    and the one running it."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], None]


@dataclass(frozen=True)
class Number:
    """argparse ``type``: an int (``kind=int``) or a finite float in ``[minimum, maximum]`` (``above``: minimum
    itself excluded), so ``--sites -3`` or ``--lr nan`` stop at the command line with the flag named, before
    anything runs or is written.  Frozen: the verbs share the same instances (and they compare equal)."""

    kind: type
    minimum: float
    maximum: float | None = None
    above: bool = False

    def __call__(self, text: str) -> int | float:
        try:
            value = self.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {self.describe()}") from None
        low = value > self.minimum if self.above else value >= self.minimum
        if not (math.isfinite(value) and low and (self.maximum is None or value <= self.maximum)):
            raise argparse.ArgumentTypeError(f"{text!r} is out of range: expected {self.describe()}")
        return value

    def describe(self) -> str:
        what = "a whole number" if self.kind is int else "a number"
        low = f"{'>' if self.above else '>='} {self.minimum:g}"
        return f"{what} {low}" + (f" and <= {self.maximum:g}" if self.maximum is not None else "")


#: shared argparse types: counts (sites, rounds, images, epochs, sizes), indices / step caps where 0 means "none"
#: or "all", seeds (numpy's range), positive reals (learning rates, alpha, timeouts), fractions in (0, 1] and
#: probabilities in [0, 1]
COUNT = Number(int, 1)
NON_NEGATIVE = Number(int, 0)
SEED = Number(int, 0, 2**32 - 1)
POSITIVE = Number(float, 0, above=True)
NON_NEGATIVE_REAL = Number(float, 0)
FRACTION = Number(float, 0, 1, above=True)
PROBABILITY = Number(float, 0, 1)


def add_threads_argument(s: argparse.ArgumentParser) -> None:
    """``--threads N``: the torch threads of every process a verb computes in (itself and each worker process),
    default :data:`fedssl.experiments.environment.DEFAULT_THREADS` (one); recorded in the run's run_config.json."""
    from fedssl.experiments.environment import DEFAULT_THREADS  # light: no torch

    s.add_argument("--threads", type=COUNT, default=DEFAULT_THREADS,
                   help=f"torch threads of every process that computes (this one and each worker process; default "
                        f"{DEFAULT_THREADS}): a setting recorded in run_config.json with the environment, since "
                        "another count can change the numbers")


def os_error_line(e: OSError) -> str:
    """One line for an OSError that names the path(s): ``out/job: Permission denied``; shutil's copy errors list
    (source, destination, reason) triples: the first is named."""
    if isinstance(e, shutil.Error) and e.args and isinstance(e.args[0], list) and e.args[0]:
        src, dst, why = e.args[0][0]
        more = len(e.args[0]) - 1
        return f"copying {src} to {dst}: {why}" + (f" (and {more} more)" if more else "")
    paths = " -> ".join(str(p) for p in (e.filename, e.filename2) if p is not None)
    reason = e.strerror or str(e)
    return f"{paths}: {reason}" if paths else reason


def _as_help(text: str) -> str:
    """A plain-text line as an argparse ``help=``: argparse %-formats every help string (for ``%(default)s``)."""
    return text.replace("%", "%%")


def _as_description(text: str) -> str:
    """A plain-text line as an argparse ``description=``: argparse %-formats one only when it holds ``%(prog)``."""
    return _as_help(text) if "%(prog)" in text else text


def add_verb(sub, verb: Verb, command: str | None = None) -> argparse.ArgumentParser:
    """Add ``verb`` to the subparsers ``sub``; ``command`` is how messages name it (default: its name)."""
    s = sub.add_parser(verb.name, help=_as_help(verb.help), description=_as_description(verb.help))
    verb.add_arguments(s)
    s.set_defaults(fn=verb.run, command=command or verb.name)
    return s


def add_family(sub, family: str, help: str, verbs: Sequence[Verb]) -> None:
    """``fedssl <family> <verb>`` for every verb (``help``: plain text, as a :class:`Verb`'s)."""
    f = sub.add_parser(family, help=_as_help(help), description=_as_description(help))
    fsub = f.add_subparsers(dest="verb", required=True, metavar="VERB")
    for verb in verbs:
        add_verb(fsub, verb, f"{family} {verb.name}")


def build_parser() -> argparse.ArgumentParser:
    """The ``fedssl`` parser: every family and verb of :data:`COMMAND_MODULES`, nothing run, nothing heavy imported."""
    p = argparse.ArgumentParser(prog="fedssl", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    for module in COMMAND_MODULES:
        importlib.import_module(module).register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)  # --help and bad arguments stop here, before torch is imported
    command = getattr(a, "command", a.cmd)
    import torch

    torch.set_num_threads(max(1, min(torch.get_num_threads(), os.cpu_count() or 1)))
    try:
        a.fn(a)
    except KeyboardInterrupt:
        print(f"fedssl {command}: interrupted", file=sys.stderr)
        return 130
    except (ValueError, RuntimeError) as e:
        print(f"fedssl {command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # unwritable or missing folder, a file in the way: the path, not a traceback
        print(f"fedssl {command}: error: {os_error_line(e)}", file=sys.stderr)
        return 1
    return 0
