"""A resumable runner for the papers' tables: cells, a crash-safe store of finished cells, progress, output files.

A paper table is a grid of *cells* (one pre-training run, one fine-tuning run of a method at N annotated
patients, fold and site, ...), each identified by a small dict of JSON scalars, its *key*.  A full table takes
hours on a CPU, so:

- :class:`CellStore` keeps every finished cell's result in a JSON-lines file, appended and fsync'ed cell by cell:
  an interrupted run loses at most the cell that was running, and a re-run of :func:`run_cells` skips the
  finished ones (resume).
- :func:`run_cells` prints one progress line per cell (cells done / total, seconds of the cell, ETA) and can run
  cells in worker processes (``workers``) for throughput on a few CPU cores.
- :func:`write_table` writes the summary rows as JSON, CSV, a text table (the paper's numbers beside the bundle's,
  in a block labelled as the paper's) and a PNG (score vs column per method, error bars; the paper's dashed).
- :func:`begin_run` / :func:`start_run`: the torch thread count of the run's processes (a setting: a cell gives
  other numbers with another one) and the environment it computes in (:mod:`fedssl.experiments.environment`: a
  fact, listed per folder) in ``run_config.json`` beside the other settings (:func:`check_run_config`).
- :func:`few_seeds_note`: the line a table prints where its rows rest on fewer than :data:`MIN_SEEDS` seeds.
"""

from __future__ import annotations

import csv
import json
import math
import multiprocessing
import os
import textwrap
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any

from fedssl.experiments.environment import (
    DEFAULT_THREADS,
    check_threads,
    environment,
    environment_changes,
    set_threads,
)

SCALARS = (str, int, float, bool, type(None))


def key_id(key: Mapping[str, Any]) -> str:
    """A cell's identity: its key as canonical JSON (sorted keys), so ``{"a": 1, "b": 2}`` and
    ``{"b": 2, "a": 1}`` are the same cell."""
    if not isinstance(key, Mapping) or not key:
        raise ValueError(f"cell key {key!r} is invalid; use a non-empty dict of JSON scalars, e.g. "
                         "{'method': 'FCL', 'n_labelled': 1}")
    bad = {k: v for k, v in key.items() if not isinstance(k, str) or not isinstance(v, SCALARS)}
    if bad:
        raise ValueError(f"cell key {dict(key)!r} is invalid: {bad!r} are not str -> JSON scalar "
                         "(str, int, float, bool, None); use scalars only")
    return json.dumps(dict(key), sort_keys=True, separators=(",", ":"))


def key_summary(key: Mapping[str, Any]) -> str:
    """``method=FCL n_labelled=1 fold=0``: the key in its own order, for progress lines."""
    return " ".join(f"{k}={v}" for k, v in key.items())


class CellStore:
    """Finished cells in a JSON-lines file, one ``{"key": {...}, "result": {...}, "seconds": float}`` per line.

    Every :meth:`put` appends one line and flushes it to disk (``os.fsync``) before returning, so a finished cell
    survives a crash.  Reading: a torn last line (a write interrupted before its newline) is dropped with a
    warning naming the file (it is cut off before the next append); any other unreadable line is an error naming
    the file and the line, never skipped: that would throw away finished work silently.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._cells: dict[str, dict] = {}
        self._torn_at: int | None = None  # byte offset where a torn last line starts
        if os.path.isfile(self.path):
            self._load()

    def _load(self) -> None:
        with open(self.path, "rb") as f:
            data = f.read()
        offset = 0
        lines = data.split(b"\n")
        for number, raw in enumerate(lines, start=1):
            is_last = number == len(lines)
            start, offset = offset, offset + len(raw) + 1
            if not raw.strip():
                continue
            try:
                record = self._record(raw)
            except ValueError as e:
                if is_last:  # no newline after it: its write was interrupted
                    warnings.warn(f"{self.path}: line {number} is incomplete (an interrupted write); ignored, "
                                  "its cell will run again", stacklevel=3)
                    self._torn_at = start
                    return
                raise ValueError(f"{self.path}, line {number}: not a finished cell ({e}); repair or remove that "
                                 "line by hand (the other lines are finished work)") from None
            ident = key_id(record["key"])
            if ident in self._cells:
                warnings.warn(f"{self.path}: line {number} repeats cell {key_summary(record['key'])}; the first "
                              "result is kept", stacklevel=3)
                continue
            self._cells[ident] = record

    @staticmethod
    def _record(raw: bytes) -> dict:
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{type(e).__name__}: {e}") from None
        if not isinstance(record, dict) or set(record) != {"key", "result", "seconds"}:
            raise ValueError("expected an object with exactly 'key', 'result' and 'seconds'")
        if not isinstance(record["seconds"], (int, float)) or isinstance(record["seconds"], bool):
            raise ValueError(f"'seconds' is {record['seconds']!r}, not a number")
        key_id(record["key"])
        return record

    def done(self, key: Mapping[str, Any]) -> bool:
        return key_id(key) in self._cells

    def get(self, key: Mapping[str, Any]) -> Any:
        """The stored result of ``key``; KeyError naming the cell and the file when it has not run."""
        ident = key_id(key)
        if ident not in self._cells:
            raise KeyError(f"cell {key_summary(key)} is not in {self.path}")
        return self._cells[ident]["result"]

    def seconds(self, key: Mapping[str, Any]) -> float:
        return float(self._cells[key_id(key)]["seconds"])

    def put(self, key: Mapping[str, Any], result: Any, seconds: float) -> Any:
        """Append one finished cell and fsync it; returns the result as it reads back (JSON round trip), so a
        fresh result and a resumed one are the same value.  A key already stored is an error."""
        ident = key_id(key)
        if ident in self._cells:
            raise ValueError(f"cell {key_summary(key)} is already in {self.path}; a cell runs once")
        try:
            line = json.dumps({"key": dict(key), "result": result, "seconds": round(float(seconds), 3)},
                              allow_nan=True)
        except (TypeError, ValueError) as e:
            raise ValueError(f"cell {key_summary(key)}: its result is not JSON ({e}); return plain "
                             "dicts / lists / numbers / strings") from None
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        if self._torn_at is not None:  # cut the torn line off, or the next record would be glued onto it
            os.truncate(self.path, self._torn_at)
            self._torn_at = None
        with open(self.path, "a+b") as f:
            if f.tell() > 0:  # a last record written without its newline: end it, or the next would be glued on
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")
            f.write((line + "\n").encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        record = json.loads(line)
        self._cells[ident] = record
        return record["result"]

    def results(self) -> list[dict]:
        """Every stored cell ``{"key", "result", "seconds"}`` in file order."""
        return list(self._cells.values())

    def matching(self, match: Mapping[str, Any]) -> list[dict]:
        """The stored cells whose key has every field of ``match`` with that value (a field the key lacks matches
        no value), in file order.  ``match`` must name at least one field."""
        if not isinstance(match, Mapping) or not match:
            raise ValueError(f"match={match!r} is invalid; name at least one key field, e.g. "
                             "{'stage': 'diagnostics'}")
        key_id(match)  # the same scalar rules as a key
        return [r for r in self._cells.values()
                if all(k in r["key"] and r["key"][k] == v and type(r["key"][k]) is type(v) for k, v in match.items())]

    def forget(self, match: Mapping[str, Any]) -> list[dict]:
        """Take the cells :meth:`matching` ``match`` out of the store so that the next run computes them again
        (e.g. after a fix to one stage); returns them.  Nothing is lost: they are first appended (fsync'ed) to
        ``<name>.forgotten.jsonl`` beside the store, then the store is rewritten without them through a temporary
        file and an atomic rename.  A crash in between leaves them in both files, never in neither.  Not while
        a run is writing to the same store: its next cell would be appended to the replaced file."""
        gone = self.matching(match)
        if not gone:
            return []
        gone_ids = {key_id(r["key"]) for r in gone}
        # from the file's own lines, so that a repeated line (the store kept its first) goes with its cell, into
        # the forgotten file, and every other line stays as it was; a torn or unreadable line is dropped, as before
        moved, kept = [], []
        with open(self.path, "rb") as f:
            for raw in f.read().split(b"\n"):
                try:
                    record = self._record(raw)
                except ValueError:
                    continue
                (moved if key_id(record["key"]) in gone_ids else kept).append(raw.rstrip(b"\r"))
        root, _ = os.path.splitext(self.path)
        tmp = self.path + ".tmp"
        if os.path.lexists(tmp):  # never write through a link left there (it could point at any file)
            os.unlink(tmp)
        for path, lines, flags in ((root + ".forgotten.jsonl", moved, os.O_APPEND),
                                   (tmp, kept, os.O_TRUNC | os.O_EXCL)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags | getattr(os, "O_NOFOLLOW", 0), 0o644)
            with os.fdopen(fd, "wb") as f:
                for line in lines:
                    f.write(line + b"\n")
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self._torn_at = None  # the rewrite dropped a torn last line too
        for ident in gone_ids:
            del self._cells[ident]
        return gone


def plain_json(value: Any) -> Any:
    """Numpy / torch scalars -> Python numbers, recursively, so a cell's result is JSON for the cell store."""
    if isinstance(value, dict):
        return {k: plain_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_json(v) for v in value]
    return value.item() if hasattr(value, "item") and not isinstance(value, (str, bytes)) else value


def start_run(out: str, settings: Mapping[str, Any], selectors: Sequence[str], data_root: str | None,
              prepare: Callable[[str], str], *, threads: int = DEFAULT_THREADS, collected: Sequence[str] = (),
              say: Callable[[str], None] = print) -> tuple[str, str, CellStore]:
    """The common start of a table run: ``out`` made absolute and created, this process set to ``threads`` torch
    threads and the run_config checked (:func:`begin_run`: ``settings`` less the cell ``selectors``, plus
    ``data_root`` and ``threads``; the selectors named in ``collected``, e.g. the training seeds, recorded as the
    union over the folder's runs), the data folder (``data_root``, or ``prepare(out)`` that writes synthetic data
    under ``out``) and the run's cell store.  Returns ``(out, data folder, store)``."""
    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    begin_run(out, {**{k: v for k, v in settings.items() if k not in selectors or k in collected},
                    "data_root": data_root}, threads=threads, collected=collected, say=say)
    root = os.path.abspath(data_root) if data_root else prepare(out)
    return out, root, CellStore(os.path.join(out, "cells.jsonl"))


def begin_run(out: str, config: Mapping[str, Any], *, threads: int = DEFAULT_THREADS, collected: Sequence[str] = (),
              say: Callable[[str], None] = print) -> dict:
    """Set this process's torch thread count to ``threads`` (the cells computed here, and :func:`run_cells`'
    workers when it is passed on), then :func:`check_run_config` of ``config`` plus ``threads`` with this
    process's :func:`~fedssl.experiments.environment.environment` (``collected``: its keys recorded, not
    checked).  Returns the config with ``threads``."""
    set_threads(check_threads(threads))
    config = {**config, "threads": threads}
    check_run_config(out, config, env=environment(), collected=collected, say=say)
    return config


def read_run_config(out: str, fix: str) -> dict | None:
    """``out/run_config.json`` as :func:`check_run_config` wrote it; None when there is none; a ValueError naming
    the file and ``fix`` when it is unreadable."""
    path = os.path.join(out, "run_config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is unreadable ({e}); {fix}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} is unreadable (a JSON {type(config).__name__}, not an object of settings); {fix}")
    return config


#: the key of ``run_config.json`` that lists the environments a folder's cells were computed in (facts, not settings)
ENVIRONMENTS = "environments"
#: settings recorded only since a later version, each with the value every older run had (ANY_VALUE: none in
#: particular, as for the thread count): a run_config written before lacks them and still resumes when the setting
#: is that value (it is recorded from then on, with a line saying so), and is refused with any other; one that has
#: them must match like any setting
ANY_VALUE = object()
LATER_SETTINGS: dict[str, Any] = {"threads": ANY_VALUE, "device_rate": 0.0}


def check_run_config(out: str, config: Mapping[str, Any], *, env: Mapping[str, Any] | None = None,
                     collected: Sequence[str] = (), say: Callable[[str], None] = print) -> None:
    """The settings a table run's cells are computed with, recorded in ``out/run_config.json`` on the first run; a
    re-run into the same folder must use the same ones (cells of other settings would otherwise be mixed into one
    table): a ValueError names the file and every setting that changed (the thread count among them: another one
    gives other numbers).  A setting of :data:`LATER_SETTINGS` that an older run_config lacks is recorded now.

    ``env`` (:func:`~fedssl.experiments.environment.environment`) is a fact, not a setting: it is appended to the
    file's :data:`ENVIRONMENTS` list when it is not there yet, and a folder whose earlier cells were computed in
    another environment resumes with a warning line naming what differs (versions, CPU, BLAS, thread variables).

    ``collected``: keys of ``config`` whose values are lists of cell selectors (the training seeds: every cell's
    key holds its own, so a re-run may add some): recorded as the sorted union of every run's lists, never
    refused."""
    path = os.path.join(out, "run_config.json")
    if ENVIRONMENTS in config:
        raise ValueError(f"check_run_config: {ENVIRONMENTS!r} is the record of environments, not a setting")
    grown = {k: sorted(set(config[k])) for k in collected if k in config}
    config = {k: v for k, v in config.items() if k not in grown}
    old = read_run_config(out, f"remove it only if {out} holds no cells of other settings, or use another --out")
    seen: list = []
    added: list[str] = []
    before: dict = {}
    if old is not None:
        seen = old.pop(ENVIRONMENTS, [])
        seen = seen if isinstance(seen, list) else []
        before = {k: old.pop(k) for k in grown if k in old}
        grown = {k: sorted(set(v) | set(before.get(k) if isinstance(before.get(k), list) else [])) for k, v in
                 grown.items()}
        added = [k for k, was in LATER_SETTINGS.items() if k in config and k not in old
                 and (was is ANY_VALUE or config[k] == was)]
        changed = sorted(k for k in set(old) | set(config) if old.get(k) != config.get(k) and k not in added)
        if changed:
            fix = ("re-run with the same settings to resume, or use another --out"
                   + (f" (threads: pass --threads {old['threads']} to resume this folder)" if "threads" in changed
                      and "threads" in old else ""))
            raise ValueError(f"{path}: the cells in {out} were computed with other settings: "
                             + ", ".join(f"{k}={old.get(k)!r} (now {config.get(k)!r})" for k in changed) + "; " + fix)
        if added:
            say(f"{path}: " + ", ".join(f"{k}={config[k]!r}" for k in added) + " recorded from now on (the cells "
                "already there were computed before it was recorded)")
    new_env = env is not None and dict(env) not in seen
    if new_env and seen:
        say(f"warning: {path}: this run's environment differs from the one its cells were last computed in ("
            + environment_changes(seen[-1], env) + "); resuming, and adding it to the record: cells of the two may "
            "differ in the last digits")
    if old is None or added or new_env or any(before.get(k) != v for k, v in grown.items()):
        os.makedirs(out, exist_ok=True)
        record = {**config, **grown, ENVIRONMENTS: seen + ([dict(env)] if new_env else [])}
        with open(path + ".tmp", "w") as f:
            json.dump(record, f, indent=2)
        os.replace(path + ".tmp", path)


def write_run_config(out: str, config: Mapping[str, Any], *, threads: int) -> str:
    """A demo's ``out/run_config.json``: its settings, ``threads`` and the environment of this process (a list of
    one, as a table run's).  A demo runs all of its steps again, so the file is written anew every time.  Returns
    its path."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "run_config.json")
    with open(path, "w") as f:
        json.dump({**config, "threads": check_threads(threads), ENVIRONMENTS: [environment()]}, f, indent=2)
    return path


#: a table's rows and paired differences are findings only over at least this many training seeds
MIN_SEEDS = 3


def _seeds_text(seeds: Sequence[int]) -> str:
    words = {1: "one seed", 2: "two seeds"}
    return f"{words.get(len(seeds), f'{len(seeds)} seeds')} ({', '.join(str(s) for s in seeds)})"


def few_seeds_note(covered: Mapping[str, Sequence[int]], rerun: str = "--seeds 0 1 2") -> str | None:
    """The line a table prints where a row (a method, and so its paired difference) rests on fewer than
    :data:`MIN_SEEDS` training seeds: ``"one seed (0): not a finding; run --seeds 0 1 2"`` when every row has the
    same few seeds, else the rows named, ``"FedMoCo: one seed (0): not a finding; ..."``.  ``covered``: row label ->
    the seeds it averages (a row of none is not shown, so not counted); ``rerun``: how to get more seeds.  None
    when every row has enough."""
    shown = {m: sorted(set(int(s) for s in v)) for m, v in covered.items() if v}
    few = {m: v for m, v in shown.items() if len(v) < MIN_SEEDS}
    if not few:
        return None
    spread = "a method's sign can change from one seed to the next"
    if len(few) == len(shown) and len({tuple(v) for v in few.values()}) == 1:
        return f"{_seeds_text(next(iter(few.values())))}: not a finding; run {rerun} ({spread})"
    return ("; ".join(f"{m}: {_seeds_text(v)}" for m, v in few.items())
            + f": not a finding; run {rerun} ({spread})")


def format_duration(seconds: float) -> str:
    """``12 s``, ``4 min 10 s``, ``1 h 05 min``."""
    s = int(round(max(seconds, 0.0)))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {(s % 3600) // 60:02d} min"


class _Progress:
    """Progress lines of one :func:`run_cells` call: ETA = remaining cost x (seconds per cost unit of the cells
    run in this invocation) / workers busy."""

    def __init__(self, cells: Sequence[Mapping], store: CellStore, say, cost, workers: int, label: str,
                 worker_threads: int = DEFAULT_THREADS):
        self.total = len(cells)
        self.say, self.cost, self.workers = say, cost or (lambda key: 1.0), workers
        self.todo = [k for k in cells if not store.done(k)]
        self.done = self.total - len(self.todo)
        self.remaining_cost = sum(float(self.cost(k)) for k in self.todo)
        self.spent_s = self.spent_cost = 0.0
        head = f"{label}: " if label else ""
        self.say(f"{head}{self.total} cells, {self.done} already done in {store.path} (resumed: skipped), "
                 f"{len(self.todo)} to run" + (f" on {workers} worker processes ({worker_threads} torch thread"
                                              f"{'s' if worker_threads > 1 else ''} each)" if workers > 1 else ""))

    def finished(self, key: Mapping, seconds: float) -> None:
        c = float(self.cost(key))
        self.done += 1
        self.spent_s += seconds
        self.spent_cost += c
        self.remaining_cost -= c
        left = self.total - self.done
        per_cost = self.spent_s / self.spent_cost if self.spent_cost > 0 else 0.0
        eta = max(self.remaining_cost, 0.0) * per_cost / max(1, min(self.workers, left))
        self.say(f"[{self.done}/{self.total}] {key_summary(key)} took {seconds:.1f} s | "
                 + (f"ETA {format_duration(eta)}" if left else "all done"))

    def failed(self, key: Mapping, error: BaseException) -> None:
        self.say(f"[{self.done}/{self.total}] {key_summary(key)} FAILED ({type(error).__name__}: {error}); "
                 "nothing recorded for it: a re-run resumes at this cell")


def _start_worker(threads: int, initializer: Callable[..., None] | None, initargs: tuple) -> None:
    """A worker process's start: its torch thread count first, then the caller's ``initializer``."""
    set_threads(threads)
    if initializer is not None:
        initializer(*initargs)


def _timed(fn: Callable[[dict], Any], key: dict) -> tuple[Any, float]:
    """Run one cell in a worker process and time it there (the parent's clock would count queueing)."""
    t0 = time.perf_counter()
    result = fn(key)
    return result, time.perf_counter() - t0


def run_cells(
    cells: Sequence[Mapping[str, Any]],
    fn: Callable[[dict], Any],
    store: CellStore,
    *,
    say: Callable[[str], None] = print,
    cost: Callable[[dict], float] | None = None,
    workers: int = 1,
    initializer: Callable[..., None] | None = None,
    initargs: tuple = (),
    label: str = "",
    clock: Callable[[], float] = time.perf_counter,
    threads: int | None = None,
) -> list[Any]:
    """Run ``fn(key)`` for every cell not yet in ``store``, in order, storing each result as it finishes; returns
    the results of all ``cells`` in cell order (resumed and fresh alike).

    ``cost(key)``: relative cost of a cell for the ETA (e.g. N for fine-tuning on N patients); default 1.
    ``workers`` > 1 runs cells in a process pool (spawn start method; ``fn``, ``initializer`` and keys must be
    picklable, i.e. module-level functions or ``functools.partial`` of them): ``initializer(*initargs)`` runs once
    per worker (load what every cell needs there); the parent stores results as they complete, so resume works
    the same.  A cell that raises is not recorded: its failure is printed and the exception re-raised (with
    workers, after the cells already running have finished and been stored; cells not started are cancelled).
    ``threads``: torch threads of the processes computing cells: set in this process before its cells, and in every
    worker before ``initializer``; None leaves this process as it is and gives each worker
    :data:`~fedssl.experiments.environment.DEFAULT_THREADS` (one).
    """
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"run_cells: argument workers={workers!r} is invalid; use an int >= 1 (1 = in this process)")
    if threads is not None:
        check_threads(threads, "run_cells: argument threads")
    ids = [key_id(k) for k in cells]
    if len(set(ids)) != len(ids):
        dup = next(k for k, i in zip(cells, ids) if ids.count(i) > 1)
        raise ValueError(f"run_cells: cell {key_summary(dup)} is listed twice; every cell must be unique")
    worker_threads = DEFAULT_THREADS if threads is None else threads
    progress = _Progress(cells, store, say, cost, workers, label, worker_threads)
    if progress.todo and workers > 1:
        _run_pool(progress.todo, fn, store, progress, workers, _start_worker,
                  (worker_threads, initializer, tuple(initargs)))
    elif progress.todo:
        if threads is not None:
            set_threads(threads)
        if initializer is not None:
            initializer(*initargs)
        for key in progress.todo:
            t0 = clock()
            try:
                result = fn(dict(key))
            except BaseException as e:
                progress.failed(key, e)
                raise
            seconds = clock() - t0
            store.put(key, result, seconds)
            progress.finished(key, seconds)
    return [store.get(k) for k in cells]


def _run_pool(todo, fn, store: CellStore, progress: _Progress, workers: int, initializer, initargs) -> None:
    ctx = multiprocessing.get_context("spawn")
    error: BaseException | None = None
    with ProcessPoolExecutor(max_workers=min(workers, len(todo)), mp_context=ctx, initializer=initializer,
                             initargs=initargs) as pool:
        futures = {pool.submit(_timed, fn, dict(k)): k for k in todo}
        for future in as_completed(futures):
            key = futures[future]
            if future.cancelled():
                continue
            try:
                result, seconds = future.result()
            except BaseException as e:
                progress.failed(key, e)
                if error is None:
                    error = e
                    for other in futures:
                        other.cancel()
                continue
            store.put(key, result, seconds)
            progress.finished(key, seconds)
    if error is not None:
        raise error


# ---------------------------------------------------------------- output files

ROW_FIELDS = ("table", "method", "column", "mean", "std", "n")


def _cell_text(mean: float | None, std: float | None, digits: int) -> str:
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return "-"
    return f"{mean:.{digits}f}" + ("" if std is None else f" +- {std:.{digits}f}")


def _ordered(rows: Sequence[Mapping], field: str) -> list:
    out: list = []
    for r in rows:
        if r[field] not in out:
            out.append(r[field])
    return out


def _marks(rows: Sequence[Mapping]) -> dict[str, str]:
    """method -> the mark its rows carry (``row["mark"]``, e.g. ``" [failed pre-training]"``), shown after its label
    in the bundle's block and the plot's legend; the paper's block matches rows by the unmarked label."""
    return {r["method"]: r["mark"] for r in rows if r.get("mark")}


def _text_block(rows: Sequence[Mapping], methods: Sequence[str], columns: Sequence[str], digits: int,
                marks: Mapping[str, str] | None = None) -> list[str]:
    cells = {(r["method"], r["column"]): _cell_text(r["mean"], r.get("std"), digits) for r in rows}
    header = ["Method"] + list(columns)
    body = [[m + (marks or {}).get(m, "")] + [cells.get((m, c), "-") for c in columns] for m in methods]
    widths = [max(len(row[i]) for row in [header] + body) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()

    return [line(header), "  ".join("-" * w for w in widths)] + [line(r) for r in body]


def format_paper_table(rows: Sequence[Mapping], *, title: str, paper: Sequence[Mapping] | None = None,
                       paper_source: str = "", notes: Sequence[str] = (), digits: int = 3,
                       footer: Sequence[str] = ()) -> str:
    """The title and ``notes``, the bundle's table (``mean +- std`` per method and column), then, when given, the
    paper's numbers for the same methods and columns in a separate block labelled ``paper (<paper_source>)``, then
    the ``footer`` lines (what reads against the table, e.g. paired differences)."""
    methods, columns = _ordered(rows, "method"), _ordered(rows, "column")
    lines = [title, *notes, "", "bundle (measured here)"] + _text_block(rows, methods, columns, digits, _marks(rows))
    if paper:
        lines += ["", f"paper ({paper_source})"] + _text_block(paper, methods, columns, digits)
    if footer:
        lines += ["", *footer]
    return "\n".join(lines) + "\n"


def _check_rows(rows: Sequence[Mapping], what: str) -> None:
    for r in rows:
        missing = [f for f in ("method", "column", "mean") if f not in r]
        if missing:
            raise ValueError(f"write_table: a {what} row lacks {missing}: {dict(r)!r}; rows are "
                             f"{{{', '.join(ROW_FIELDS)}}}")


def seed_values(row: Mapping) -> list[float]:
    """The row's per-seed values (its ``by_seed``: seed -> the seed's mean over sites / devices / folds), seeds
    ascending; [] when the row has none."""
    by_seed = row.get("by_seed") or {}
    return [float(by_seed[k]) for k in sorted(by_seed, key=int) if by_seed[k] is not None]


def error_bar(row: Mapping) -> tuple[float, str]:
    """(half-length, what it is) of a row's error bar: the sample std over its seeds' values when it has two or
    more (the run-to-run spread a reader needs to judge a difference), else the row's std (over sites, devices
    or folds)."""
    values = seed_values(row)
    if len(values) >= 2:
        m = sum(values) / len(values)
        return (sum((v - m) ** 2 for v in values) / (len(values) - 1)) ** 0.5, "seeds"
    return float(row.get("std") or 0.0), "units"


def plot_table(rows: Sequence[Mapping], path: str, *, title: str, paper: Sequence[Mapping] | None = None,
               score: str = "dice") -> str:
    """Score vs column per method; error bars: std over seeds where a row has per-seed values (``by_seed``, each
    seed's value drawn as a dot), else the row's std; the paper's values dashed in the method's colour.  Methods
    are set a little apart so that their bars do not hide each other.  Agg canvas, no pyplot state.  matplotlib is
    imported here, so that worker processes of :func:`run_cells` start light."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    methods, columns, marks = _ordered(rows, "method"), _ordered(rows, "column"), _marks(rows)
    colours = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    fig = Figure(figsize=(6.5, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    xs = {c: i for i, c in enumerate(columns)}
    kinds = set()
    for i, method in enumerate(methods):
        colour, dx = colours[i % len(colours)], 0.08 * (i - (len(methods) - 1) / 2)
        pts = [r for r in rows if r["method"] == method and r["mean"] is not None]
        bars = [error_bar(r) for r in pts]
        kinds.update(kind for _, kind in bars)
        ax.errorbar([xs[r["column"]] + dx for r in pts], [r["mean"] for r in pts], yerr=[b for b, _ in bars],
                    marker="o", capsize=3, color=colour, label=method + marks.get(method, ""))
        for r in pts:
            values = seed_values(r)
            if len(values) >= 2:
                ax.plot([xs[r["column"]] + dx] * len(values), values, linestyle="none", marker=".", color=colour,
                        alpha=0.45)
        ref = [r for r in paper or () if r["method"] == method and r["column"] in xs and r["mean"] is not None]
        if ref:
            ax.plot([xs[r["column"]] + dx for r in ref], [r["mean"] for r in ref], linestyle="--", marker="x",
                    color=colour, alpha=0.7, label=f"{method} (paper)")
    ax.set_xticks(range(len(columns)))
    ax.set_xticklabels([str(c) for c in columns])
    if score == "dice":
        ax.set_ylim(0.0, 1.0)
    bar_text = {frozenset({"seeds"}): "error bars: std over seeds, dots: each seed",
                frozenset({"units"}): "error bars: std"}.get(frozenset(kinds), "error bars: std over seeds where "
                                                                              "a point has several, else std")
    ax.set_ylabel(f"{score} ({bar_text})", fontsize="small")
    ax.set_title("\n".join(textwrap.wrap(title, 75)), fontsize="small")  # long titles wrap, not clip
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="x-small", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def write_table(out_dir: str | os.PathLike, name: str, rows: Sequence[Mapping[str, Any]], *, title: str,
                paper: Sequence[Mapping[str, Any]] | None = None, paper_source: str = "", score: str = "dice",
                notes: Sequence[str] = (), extra: Mapping[str, Any] | None = None, digits: int = 3,
                footer: Sequence[str] = ()) -> dict[str, str]:
    """Write ``{name}.json``, ``{name}.csv``, ``{name}.txt`` and ``{name}.png`` into ``out_dir``.

    ``rows``: summary rows ``{"table", "method", "column", "mean", "std", "n"}`` (``column`` e.g. ``"N=1"`` or
    ``"Split-3"``; ``n`` = how many sites / folds the mean and std are over).  ``paper``: the paper's rows in the
    same form (``std`` None where the paper gives none), labelled ``paper (<paper_source>)`` in the text and
    marked ``source = "paper"`` in the CSV.  A row's ``mark`` (e.g. ``" [failed pre-training]"``) follows its
    method's label in the bundle's block and the plot's legend.  ``notes`` print under the title, ``footer``
    under the tables.  Returns ``{"json", "csv", "txt", "png"}`` paths."""
    if not rows:
        raise ValueError(f"write_table {name}: no rows to write")
    if paper and not paper_source:
        raise ValueError(f"write_table {name}: paper rows need paper_source (e.g. 'FCL, Wu et al., MedIA 2022, Table "
                         "1')")
    _check_rows(rows, "bundle")
    _check_rows(paper or (), "paper")
    out = os.fspath(out_dir)
    os.makedirs(out, exist_ok=True)
    paths = {ext: os.path.join(out, f"{name}.{ext}") for ext in ("json", "csv", "txt", "png")}
    with open(paths["json"], "w") as f:
        json.dump({"title": title, "score": score, "notes": list(notes), "footer": list(footer),
                   "rows": [dict(r) for r in rows],
                   "paper": {"source": paper_source, "rows": [dict(r) for r in paper or ()]},
                   "extra": dict(extra or {})}, f, indent=2)
    with open(paths["csv"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=("source",) + ROW_FIELDS, extrasaction="ignore")
        w.writeheader()
        for source, group in (("bundle", rows), ("paper", paper or ())):
            for r in group:
                w.writerow({"source": source, **{k: r.get(k) for k in ROW_FIELDS}})
    text = format_paper_table(rows, title=title, paper=paper, paper_source=paper_source, notes=notes, digits=digits,
                              footer=footer)
    with open(paths["txt"], "w") as f:
        f.write(text)
    plot_table(rows, paths["png"], title=title, paper=paper, score=score)
    return paths
