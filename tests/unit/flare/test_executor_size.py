"""Every executor of ``fedssl.flare`` fits a screen (issue 43 item 7): at most :data:`LIMIT` lines per
``*_executor.py``.  An executor is FLARE glue (its settings dataclass, ``build_trainer``, the hooks of its extra
tasks); a method's maths and its loop live in its trainer under ``fedssl.train``, its settings in one dataclass."""

from __future__ import annotations

from pathlib import Path

FLARE = Path(__file__).resolve().parents[3] / "custom" / "fedssl" / "flare"
LIMIT = 150


def too_long(folder: Path, limit: int = LIMIT) -> list[str]:
    """``name: N lines`` of every ``*_executor.py`` in ``folder`` longer than ``limit`` lines."""
    lengths = {p.name: len(p.read_text().splitlines()) for p in sorted(folder.glob("*_executor.py"))}
    return [f"{name}: {n} lines" for name, n in lengths.items() if n > limit]


def test_every_executor_fits_a_screen():
    assert len(list(FLARE.glob("*_executor.py"))) >= 10, "no executor found: the scan is broken"
    problems = too_long(FLARE)
    assert not problems, (f"executors over {LIMIT} lines (move the method's maths and loop into its trainer in "
                          f"fedssl.train, its settings into its dataclass): {problems}")


def test_the_check_catches_an_executor_over_the_limit(tmp_path):
    (tmp_path / "ok_executor.py").write_text("x = 1\n" * LIMIT)
    (tmp_path / "long_executor.py").write_text("x = 1\n" * (LIMIT + 1))
    (tmp_path / "long_helper.py").write_text("x = 1\n" * (LIMIT + 50))  # not an executor
    assert too_long(tmp_path) == [f"long_executor.py: {LIMIT + 1} lines"]
