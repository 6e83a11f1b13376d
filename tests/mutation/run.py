"""Run the semantic mutants of :mod:`tests.mutation.mutants` (issue 47) and report which ones the tests kill.

    python -m tests.mutation.run [--method M] [--ids ID ...] [--out FILE] [--timeout S] [--baseline] [--keep]

The working tree's files (tracked ones and untracked ones git does not ignore, as they are on disk) are copied once
to ``/tmp/mutrun_<pid>/tree``; the real tree is never written.  For each mutant the copy's file gets the mutant's
replacement, the mutant's tests run in the copy (``python -m pytest -x -q -p no:cacheprovider``, one at a time,
``OMP_NUM_THREADS=1``, ``PYTHONPATH`` = the copy's ``custom`` so that ``fedssl`` is imported from the copy), and
the file is restored (its cached bytecode is deleted before and after, so no run sees another's).  A mutant is

- ``killed``: pytest failed (exit 1) or could not run its tests because of the mutation (exit 2),
- ``timeout``: the tests ran past ``--timeout`` seconds (counted as killed),
- ``survived``: every test passed,
- ``error``: the mutant could not be applied (its snippet does not occur exactly once any more) or pytest was used
  wrongly (exit 3-5, e.g. a test path that does not exist).  Errors are printed loudly and make the exit status 1.

``--baseline`` first runs every distinct test set on the unmutated copy; a mutant whose tests fail unmutated is
reported as ``error`` (a kill would mean nothing).  Results go to ``--out`` (JSON, default
``/tmp/mutation_results.json``) and a markdown table beside it (same name, ``.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from tests.mutation.mutants import METHODS, MUTANTS, Mutant

REPO = Path(__file__).resolve().parents[2]
PYTEST = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"]
FAILED_LINE = re.compile(r"^(FAILED|ERROR) (\S+)", re.MULTILINE)


def select(method: str | None, ids: list[str] | None) -> list[Mutant]:
    """The mutants of ``method`` (a page of METHODS) and/or ``ids``; ValueError naming an unknown one."""
    if method is not None and method not in METHODS:
        raise ValueError(f"--method {method!r} is not one of {list(METHODS)}")
    known = {m.id for m in MUTANTS}
    unknown = sorted(set(ids or ()) - known)
    if unknown:
        raise ValueError(f"--ids {unknown} are not mutant ids; see tests/mutation/mutants.py")
    return [m for m in MUTANTS if (method is None or m.method == method) and (not ids or m.id in ids)]


def copy_tree(dest: Path) -> int:
    """Copy the working tree's files (tracked + untracked not ignored) to ``dest``; returns the file count."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         check=True, capture_output=True).stdout.decode()
    n = 0
    for rel in sorted(set(filter(None, out.split("\0")))):
        src = REPO / rel
        if not (src.is_file() or src.is_symlink()):  # deleted in the working tree, or a submodule
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target, follow_symlinks=False)
        n += 1
    return n


def environment(tree: Path) -> dict:
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(tree / "custom"), str(tree)]))
    return env


def check_import_root(tree: Path, env: dict) -> None:
    """RuntimeError unless ``fedssl`` imports from the copy (an editable install must not win over it)."""
    out = subprocess.run([sys.executable, "-c", "import fedssl; print(fedssl.__file__)"], cwd=tree, env=env,
                         capture_output=True, text=True)
    path = Path(out.stdout.strip() or "?").resolve()
    if out.returncode or tree.resolve() not in path.parents:
        raise RuntimeError(f"fedssl imports from {path} instead of the copy {tree} ({out.stderr.strip()[-300:]}); "
                           "the mutants would be tested against the real tree")


def drop_bytecode(path: Path) -> None:
    """Delete the cached bytecode of ``path`` (a mutated and a restored source may share size and mtime second)."""
    for pyc in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
        pyc.unlink()


def run_tests(tree: Path, env: dict, tests: tuple[str, ...], timeout: float) -> tuple[int | None, str, float]:
    """(pytest's exit status or None on timeout, its output, seconds)."""
    start = time.monotonic()
    try:
        p = subprocess.run(PYTEST + list(tests), cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
        return p.returncode, p.stdout + p.stderr, time.monotonic() - start
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return None, text, time.monotonic() - start


def classify(rc: int | None) -> str:
    if rc is None:
        return "timeout"
    if rc == 0:
        return "survived"
    if rc in (1, 2):
        return "killed"
    return "error"


def run_mutant(m: Mutant, tree: Path, env: dict, timeout: float) -> dict:
    path = tree / m.file
    row = {**asdict(m), "tests": list(m.tests)}
    del row["original"], row["replacement"]
    text = path.read_text() if path.is_file() else None
    count = 0 if text is None else text.count(m.original)
    if count != 1 or m.original == m.replacement:
        why = ("its file does not exist" if text is None else f"its snippet occurs {count} times (expected once)"
               if count != 1 else "its replacement equals the snippet")
        return {**row, "status": "error", "rc": None, "seconds": 0.0, "killed_by": "", "note": f"not applied: {why}"}
    drop_bytecode(path)
    path.write_text(text.replace(m.original, m.replacement))
    try:
        rc, output, seconds = run_tests(tree, env, m.tests, timeout)
    finally:
        path.write_text(text)
        drop_bytecode(path)
    status = classify(rc)
    failed = FAILED_LINE.findall(output)
    killed_by = failed[0][1] if failed else ""
    note = ""
    if status == "timeout":
        note = f"tests ran past {timeout:g} s"
    elif status == "error":
        note = f"pytest exit {rc}: " + " ".join(output.strip().splitlines()[-2:])[:300]
    elif status == "killed" and not killed_by:
        note = " ".join(output.strip().splitlines()[-1:])[:200]
    return {**row, "status": status, "rc": rc, "seconds": round(seconds, 1), "killed_by": killed_by, "note": note}


def markdown(rows: list[dict], minutes: float) -> str:
    lines = ["# Mutation run", "", f"{len(rows)} mutants, {minutes:.1f} min.", "",
             "| method | mutants | killed | timeout | survived | error |", "|---|---|---|---|---|---|"]
    for method in METHODS:
        mine = [r for r in rows if r["method"] == method]
        if mine:
            counts = [sum(r["status"] == s for r in mine) for s in ("killed", "timeout", "survived", "error")]
            lines.append(f"| {method} | {len(mine)} | " + " | ".join(map(str, counts)) + " |")
    lines += ["", "| id | method | status | killed by / note | s | semantic change |", "|---|---|---|---|---|---|"]
    for r in rows:
        detail = (r["killed_by"] or r["note"]).replace("|", "\\|")
        lines.append(f"| `{r['id']}` | {r['method']} | {r['status']} | {detail} | {r['seconds']} | "
                     f"{r['description']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.mutation.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", choices=METHODS, help="only the mutants of this paper page")
    ap.add_argument("--ids", nargs="+", help="only these mutant ids")
    ap.add_argument("--out", default="/tmp/mutation_results.json", help="JSON results (markdown beside it, .md)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per mutant's tests (default 600)")
    ap.add_argument("--baseline", action="store_true", help="first run every test set on the unmutated copy")
    ap.add_argument("--keep", action="store_true", help="keep the copy in /tmp/mutrun_<pid>")
    args = ap.parse_args(argv)
    try:
        mutants = select(args.method, args.ids)
    except ValueError as e:
        ap.error(str(e))
    out = Path(args.out).resolve()
    if REPO in out.parents:
        ap.error(f"--out {out} is inside the repository; write the results outside it (e.g. /tmp)")
    work = Path(tempfile.gettempdir()) / f"mutrun_{os.getpid()}"
    tree = work / "tree"
    if REPO.resolve() in tree.resolve().parents or tree.resolve() == REPO.resolve():
        raise RuntimeError(f"the copy {tree} would lie inside the repository {REPO}")
    start = time.monotonic()
    rows: list[dict] = []
    try:
        n = copy_tree(tree)
        env = environment(tree)
        check_import_root(tree, env)
        print(f"copied {n} files to {tree}; {len(mutants)} mutants", flush=True)
        broken: set[tuple[str, ...]] = set()
        if args.baseline:
            for tests in dict.fromkeys(m.tests for m in mutants):
                rc, output, seconds = run_tests(tree, env, tests, args.timeout)
                print(f"baseline {' '.join(tests)}: exit {rc} ({seconds:.0f} s)", flush=True)
                if rc != 0:
                    broken.add(tests)
        for i, m in enumerate(mutants, 1):
            if m.tests in broken:
                row = {**asdict(m), "tests": list(m.tests), "status": "error", "rc": None, "seconds": 0.0,
                       "killed_by": "", "note": "its tests fail on the unmutated tree"}
                del row["original"], row["replacement"]
            else:
                row = run_mutant(m, tree, env, args.timeout)
            rows.append(row)
            print(f"[{i}/{len(mutants)}] {m.id}: {row['status'].upper()} ({row['seconds']} s) "
                  f"{row['killed_by'] or row['note']}", flush=True)
            if row["status"] == "error":
                print(f"ERROR: mutant {m.id} ({m.file}): {row['note']}", file=sys.stderr, flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    minutes = (time.monotonic() - start) / 60
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"minutes": round(minutes, 1), "results": rows}, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(rows, minutes))
    errors = [r["id"] for r in rows if r["status"] == "error"]
    survivors = [r["id"] for r in rows if r["status"] == "survived"]
    print(f"{len(rows)} mutants in {minutes:.1f} min: {len(rows) - len(errors) - len(survivors)} killed, "
          f"{len(survivors)} survived {survivors}, {len(errors)} errors; results {out}", flush=True)
    if errors:
        print(f"ERROR: {len(errors)} mutants could not be run: {errors}", file=sys.stderr, flush=True)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
