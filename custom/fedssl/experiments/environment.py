"""The thread count a run computes with and the environment it computes in, for ``run_config.json`` (issue 42).

The same cell can give other numbers with another torch thread count (the order of floating-point sums changes:
1 against 2 threads moved an FCL cell by 0.06 Dice), so the table runners and demos set it explicitly
(:func:`set_threads`: one thread per process computing cells unless the user says otherwise) and record it as a
*setting*.  What else can move the last digits is recorded as a *fact* by :func:`environment`, so a table can say
where its numbers were computed; a resumed folder lists every environment its cells were computed in.  That is
the library versions, the BLAS, the math libraries' variables, and the CPU, named closely enough to tell two
machines apart.  The name of the model alone can be a hypervisor's "AMD EPYC" for several generations.  What
counts is the instruction set oneDNN's convolutions use: the same FCL fine-tuning cell capped at AVX2
(``ONEDNN_MAX_CPU_ISA=AVX2``) on an AVX-512 machine moved one site's Dice by 0.005 (N = 1) and 0.022 (N = 2), while
every run on one machine repeated bit for bit.  So the record holds the CPU's family, model and stepping
(:func:`cpu_id`), its vector extensions (:func:`vector_extensions`) and oneDNN's own line about the instruction set
it dispatches to (:func:`onednn_isa`).

Light at import (no torch): worker processes of :func:`fedssl.experiments.table_runner.run_cells` import it first.
"""

from __future__ import annotations

import functools
import os
import platform
import re
import subprocess
import sys
from collections.abc import Mapping
from importlib import metadata
from typing import Any

#: the packages whose versions are recorded (None where one is not installed)
PACKAGES = ("torch", "nvflare", "monai", "numpy")
#: environment variables recorded when set: the math libraries' threads (OpenMP, MKL, OpenBLAS) and the caps on the
#: instruction sets oneDNN and ATen dispatch to (``ONEDNN_MAX_CPU_ISA``, ``ATEN_CPU_CAPABILITY``), which change the
#: numbers as a thread count does
THREAD_VARIABLE_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "ONEDNN_", "DNNL_", "ATEN_")
#: the vector extensions (``/proc/cpuinfo`` flags) that decide which kernels the math libraries pick
VECTOR_FLAGS = ("avx", "avx2", "fma", "avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "sve2")
#: how long the one-off probe of oneDNN's instruction set may take (it imports torch in a child process)
ONEDNN_PROBE_TIMEOUT_S = 120
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


def _cpuinfo_fields(cpuinfo: str) -> dict[str, str]:
    """The first processor's ``key: value`` lines of ``cpuinfo``; {} when it cannot be read."""
    fields: dict[str, str] = {}
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break  # the first processor's block is enough: the others repeat it
                    continue
                key, sep, value = line.partition(":")
                if sep:
                    fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def cpu_id(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's vendor, family, model and stepping from ``/proc/cpuinfo`` (e.g. ``"AuthenticAMD family 26 model 2
    stepping 0"``; ARM's implementer, part and revision), which tell two machines apart where the model name does
    not; ``"unknown"`` when the file says none of them."""
    fields = _cpuinfo_fields(cpuinfo)
    names = (("vendor_id", ""), ("cpu family", "family"), ("model", "model"), ("stepping", "stepping"),
             ("CPU implementer", "implementer"), ("CPU part", "part"), ("CPU revision", "revision"))
    parts = [f"{label} {fields[key]}".strip() for key, label in names if fields.get(key)]
    return " ".join(parts) or "unknown"


def vector_extensions(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    """Which of :data:`VECTOR_FLAGS` the CPU has (its ``flags`` or ARM's ``Features``), in that order; [] when the
    file cannot be read."""
    fields = _cpuinfo_fields(cpuinfo)
    have = set((fields.get("flags") or fields.get("Features") or "").split())
    return [f for f in VECTOR_FLAGS if f in have]


def parse_onednn_isa(verbose: str) -> str:
    """The instruction set oneDNN names in its verbose header (``onednn_verbose,...,info,cpu,isa:<text>``), e.g.
    ``"Intel AVX-512 with Intel DL Boost and bfloat16 support"``; ``"unknown"`` when there is no such line."""
    found = re.search(r"^(?:onednn|dnnl)_verbose,.*?info,cpu,isa:(.+)$", verbose, re.M)
    return found.group(1).strip() if found else "unknown"


@functools.lru_cache(maxsize=None)
def _onednn_isa(caps: tuple[tuple[str, str], ...]) -> str:
    code = ("import torch; torch.nn.functional.conv2d(torch.ones(2, 16, 32, 32), torch.ones(16, 16, 3, 3))")
    env = {**os.environ, "ONEDNN_VERBOSE": "1", "DNNL_VERBOSE": "1"}
    try:
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              timeout=ONEDNN_PROBE_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):  # a record, never a reason to stop a run
        return "unknown"
    return parse_onednn_isa(done.stdout)


def onednn_isa() -> str:
    """The instruction set oneDNN dispatches torch's CPU convolutions to on this machine, under this process's caps
    (``ONEDNN_MAX_CPU_ISA``): oneDNN says it only in its verbose output, which it reads from the environment when
    it starts, so a child process runs one convolution with ``ONEDNN_VERBOSE=1`` (once per process and caps, a few
    seconds) and :func:`parse_onednn_isa` reads its line.  ``"unknown"`` when that fails."""
    caps = tuple((k, v) for k, v in sorted(os.environ.items()) if k.startswith(("ONEDNN_", "DNNL_")))
    return _onednn_isa(caps)


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
    :data:`PACKAGES`, ``python``, ``cpu`` (model), ``cpu_id`` (:func:`cpu_id`), ``vector`` (:func:`vector_extensions`),
    ``onednn_isa`` (:func:`onednn_isa`), ``cpu_count``, ``blas`` (:func:`blas`) and ``env`` (the variables of
    :data:`THREAD_VARIABLE_PREFIXES` that are set).  JSON-ready."""
    import torch

    return {"threads": int(torch.get_num_threads()), **{name: package_version(name) for name in PACKAGES},
            "python": platform.python_version(), "cpu": cpu_model(), "cpu_id": cpu_id(),
            "vector": vector_extensions(), "onednn_isa": onednn_isa(), "cpu_count": os.cpu_count(), "blas": blas(),
            "env": thread_variables()}


def environment_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    """What differs between two :func:`environment` records, e.g. ``"torch 2.3.0 -> 2.4.1, cpu A -> B"``."""
    return ", ".join(f"{k} {old.get(k)} -> {new.get(k)}" for k in sorted(set(old) | set(new), key=str)
                     if old.get(k) != new.get(k))
