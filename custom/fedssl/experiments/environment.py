"""The thread count a run computes with and the environment it computes in, for ``run_config.json`` (issue 42).

The same cell can give other numbers with another torch thread count (the order of floating-point sums changes:
1 against 2 threads moved an FCL cell by 0.06 Dice), so the table runners and demos set it explicitly
(:func:`set_threads`: one thread per process computing cells unless the user says otherwise) and record it as a
*setting*.  What else can move the last digits (library versions, the CPU and its vector units, the BLAS, the
math libraries' thread variables) is recorded as a *fact* by :func:`environment`, so a table can say where its
numbers were computed; a resumed folder lists every environment its cells were computed in.

Light at import (no torch): worker processes of :func:`fedssl.experiments.table_runner.run_cells` import it first.
"""

from __future__ import annotations

import os
import platform
import re
import sys
from collections.abc import Mapping
from importlib import metadata
from typing import Any

#: the packages whose versions are recorded (None where one is not installed)
PACKAGES = ("torch", "nvflare", "monai", "numpy")
#: environment variables of the math libraries' threads (OpenMP, MKL, OpenBLAS) recorded when set
THREAD_VARIABLE_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_")
#: the thread count of a run when the user names none: one torch thread per process computing cells, so the numbers
#: do not depend on the machine's core count or on how many cells run side by side
DEFAULT_THREADS = 1


def check_threads(threads: object, name: str = "threads") -> int:
    """``threads`` is an int >= 1 (a bool is not); returns it."""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"{name}={threads!r} is invalid; use an int >= 1 (torch threads per process, e.g. --threads "
                         "1)")
    return threads


def set_threads(threads: int) -> int:
    """``torch.set_num_threads(threads)`` in this process, checked first; returns ``threads``."""
    import torch

    torch.set_num_threads(check_threads(threads))
    return threads


def package_version(name: str) -> str | None:
    """The installed version of ``name`` (torch's and numpy's as the modules report them, e.g. ``2.4.1+cpu``);
    None when it is not installed."""
    if name in ("torch", "numpy") and name in sys.modules:
        return str(sys.modules[name].__version__)
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's ``model name`` from ``/proc/cpuinfo``, else :func:`platform.processor`, else ``"unknown"``."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:  # no /proc/cpuinfo (not Linux): the platform's own name below
        pass
    return platform.processor() or platform.machine() or "unknown"


def blas(config: str | None = None) -> str:
    """A short line naming torch's BLAS / LAPACK and its CPU capability, from ``torch.__config__.show()`` (e.g.
    ``"BLAS mkl, LAPACK mkl (Intel(R) oneAPI Math Kernel Library Version 2024.2-Product Build 20240605), CPU
    capability AVX512"``); ``"unknown"`` when torch does not say."""
    if config is None:
        try:
            import torch

            config = torch.__config__.show()
        except Exception:  # noqa: BLE001 - a record, never a reason to stop a run
            return "unknown"
    found = dict(re.findall(r"\b(BLAS_INFO|LAPACK_INFO)=([^,\s]+)", config))
    parts = [f"BLAS {found['BLAS_INFO']}" if "BLAS_INFO" in found else "",
             f"LAPACK {found['LAPACK_INFO']}" if "LAPACK_INFO" in found else ""]
    text = ", ".join(p for p in parts if p)
    library = re.search(r"^\s*-\s*((?:Intel\(R\) (?:oneAPI )?Math Kernel Library|OpenBLAS)[^\n]*)$", config, re.M)
    if library:
        text += f" ({library.group(1).strip()})" if text else library.group(1).strip()
    capability = re.search(r"CPU capability usage:\s*(\S+)", config)
    if capability:
        text += (", " if text else "") + f"CPU capability {capability.group(1)}"
    return text or "unknown"


def thread_variables(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The OpenMP / MKL / OpenBLAS variables set in ``environ`` (default: this process's), sorted by name."""
    environ = os.environ if environ is None else environ
    return {k: environ[k] for k in sorted(environ) if k.startswith(THREAD_VARIABLE_PREFIXES)}


def environment() -> dict[str, Any]:
    """The environment this process computes in: ``threads`` (torch's thread count now), the versions of
    :data:`PACKAGES`, ``python``, ``cpu`` (model), ``cpu_count``, ``blas`` (:func:`blas`) and ``env`` (the thread
    variables that are set).  JSON-ready."""
    import torch

    return {"threads": int(torch.get_num_threads()), **{name: package_version(name) for name in PACKAGES},
            "python": platform.python_version(), "cpu": cpu_model(), "cpu_count": os.cpu_count(), "blas": blas(),
            "env": thread_variables()}


def environment_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    """What differs between two :func:`environment` records, e.g. ``"torch 2.3.0 -> 2.4.1, cpu A -> B"``."""
    return ", ".join(f"{k} {old.get(k)} -> {new.get(k)}" for k in sorted(set(old) | set(new), key=str)
                     if old.get(k) != new.get(k))
