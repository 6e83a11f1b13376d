"""The mutant list of the mutation run is well formed (fast: nothing is mutated or run here).

Each check is a function of a mutant list that returns its problems, so that the checks themselves are tested on
broken entries below.  A snippet that stops matching means the code moved on: update it in ``mutants.py``, keeping
the semantic change it describes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.mutation.mutants import METHODS, MUTANTS, Mutant
from tests.mutation.run import select

REPO = Path(__file__).resolve().parents[2]


def snippet_problems(mutants) -> list[str]:
    out = []
    for m in mutants:
        path = REPO / m.file
        if not path.is_file():
            out.append(f"{m.id}: file {m.file} does not exist")
            continue
        n = path.read_text().count(m.original)
        if n != 1:
            out.append(f"{m.id}: snippet occurs {n} times in {m.file} (expected exactly once)")
        if m.replacement == m.original:
            out.append(f"{m.id}: replacement equals the snippet")
    return out


def listed_test_problems(mutants) -> list[str]:
    out = []
    for m in mutants:
        if not m.tests:
            out.append(f"{m.id}: no tests listed")
        for t in m.tests:
            if not (REPO / t.split("::")[0]).is_file():
                out.append(f"{m.id}: test {t} does not exist")
    return out


def id_problems(mutants) -> list[str]:
    seen: set[str] = set()
    out = []
    for m in mutants:
        if not m.id or m.id in seen:
            out.append(f"duplicate or empty id {m.id!r}")
        seen.add(m.id)
    return out


def method_problems(mutants) -> list[str]:
    return [f"{m.id}: method {m.method!r} is not one of {list(METHODS)}" for m in mutants if m.method not in METHODS]


def description_problems(mutants) -> list[str]:
    return [f"{m.id}: description must be one non-empty line" for m in mutants
            if not m.description.strip() or "\n" in m.description]


CHECKS = (snippet_problems, listed_test_problems, id_problems, method_problems, description_problems)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_the_mutant_list_passes(check):
    assert check(MUTANTS) == []


def test_every_paper_page_has_mutants():
    counts = {method: sum(m.method == method for m in MUTANTS) for method in METHODS}
    assert all(n >= 5 for n in counts.values()), counts


def test_mutants_touch_only_the_package():
    assert all(m.file.startswith("custom/fedssl/") and m.file.endswith(".py") for m in MUTANTS)


GOOD = MUTANTS[0]
BROKEN = [
    (snippet_problems, dataclasses.replace(GOOD, original=GOOD.original + "  # not in the file")),
    (snippet_problems, dataclasses.replace(GOOD, original="import")),  # many times
    (snippet_problems, dataclasses.replace(GOOD, replacement=GOOD.original)),
    (snippet_problems, dataclasses.replace(GOOD, file="custom/fedssl/core/no_such_module.py")),
    (listed_test_problems, dataclasses.replace(GOOD, tests=("tests/unit/core/test_no_such_file.py",))),
    (listed_test_problems, dataclasses.replace(GOOD, tests=())),
    (method_problems, dataclasses.replace(GOOD, method="FedAvg")),
    (description_problems, dataclasses.replace(GOOD, description="two\nlines")),
]


@pytest.mark.parametrize("check, bad", BROKEN, ids=[f"{c.__name__}-{i}" for i, (c, _) in enumerate(BROKEN)])
def test_each_check_catches_a_broken_entry(check, bad: Mutant):
    assert check([bad]) != []
    assert check([GOOD]) == []


def test_duplicate_ids_are_caught():
    assert id_problems([GOOD, dataclasses.replace(GOOD)]) != []
    assert id_problems([GOOD, dataclasses.replace(GOOD, id=GOOD.id + "-2")]) == []


def test_runner_selects_by_method_and_id():
    assert {m.method for m in select("FedDRA", None)} == {"FedDRA"}
    assert [m.id for m in select(None, [GOOD.id])] == [GOOD.id]
    with pytest.raises(ValueError, match="not mutant ids"):
        select(None, ["no-such-mutant"])
    with pytest.raises(ValueError, match="not one of"):
        select("FedAvg", None)
