"""Reading weight files without executing anything in them: the package's one way to open a checkpoint.

- :func:`safe_load`: a torch file through ``torch.load(..., weights_only=True)`` (tensors, numbers, strings,
  containers, and numpy arrays, which FLARE model files hold; nothing else), or a ``.safetensors`` file.
- :func:`load_export_program`: a ``torch.export`` program (``.pt2``, a Fed-BEiT tokenizer), after checking that
  loading it can run nothing: ``torch.export.load`` itself unpickles without the weights-only restriction, resolves
  graph targets by attribute lookup on ``torch`` (``torch.os.system`` is one) and parses symbolic shapes with
  ``sympy.sympify`` (``eval``), so an archive is refused unless it holds only tensor payloads, ``torch.ops`` /
  arithmetic operators and shape expressions over shape symbols.

Every failure is one :class:`UnreadableFile` (a ValueError) naming the file and what is wrong with it: missing,
empty, truncated / not a weight file, or holding a Python object (a pickle payload is refused before anything in
it runs).  Never re-load a refused file with the weights-only restriction off: convert it where it was written.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import re
import warnings

import numpy as np
import torch

#: a torch unpickling error about a Python object (rather than about damaged bytes)
_FOREIGN_OBJECT = re.compile(r"GLOBAL|Can only build|Unsupported class|unsupported global", re.IGNORECASE)
#: the lines of torch's weights-only message that advise turning the restriction off, or an issue report
_TORCH_ADVICE = ("Weights only load failed", "weights_only", "Please file an issue", "Check the documentation")


class UnreadableFile(ValueError):
    """A file that cannot be read as weights; ``problem`` says why without the path (``str`` has both)."""

    def __init__(self, path: str | os.PathLike, problem: str):
        self.path, self.problem = str(path), problem
        super().__init__(f"{self.path} {problem}")


def _numpy_globals() -> list:
    names = [np.ndarray, np.dtype, np._core.multiarray._reconstruct]
    names += [type(np.dtype(t)) for t in ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8",
                                          "bool")]
    names += [np._core.multiarray.scalar]
    return names


def _reason(error: BaseException) -> str:
    """``Type: message`` of a loader's exception, without torch's advice to turn the weights-only restriction off."""
    lines = [line.strip() for line in str(error).splitlines()]
    kept = [line for line in lines if line and not any(advice in line for advice in _TORCH_ADVICE)]
    text = " ".join(kept)
    end = text.find(". ", 40)  # the first sentence is the diagnosis; torch's further ones are advice
    text = text[: end + 1] if end > 0 else text
    return f"{type(error).__name__}: {text[:300]}" if text else type(error).__name__


def _problem(error: BaseException) -> str:
    """What a failed ``torch.load`` says about the file."""
    if isinstance(error, pickle.UnpicklingError) and _FOREIGN_OBJECT.search(str(error)):
        return (f"holds a Python object that is not weight data ({_reason(error)}); it was refused before anything "
                "in it ran: load only files of tensors (a state dict or .safetensors)")
    if isinstance(error, PermissionError):
        return f"cannot be read ({_reason(error)})"
    return f"is truncated or not a weight file ({_reason(error)})"


def _check_file(path: str | os.PathLike) -> None:
    if not os.path.lexists(path):
        raise UnreadableFile(path, "does not exist")
    if not os.path.isfile(path):
        raise UnreadableFile(path, "is not a regular file")
    if os.path.getsize(path) == 0:
        raise UnreadableFile(path, "is empty (0 bytes)")


def _torch_load(source, name: str | os.PathLike, map_location):
    try:
        with warnings.catch_warnings(), torch.serialization.safe_globals(_numpy_globals()):
            warnings.filterwarnings("ignore", message="Detected pickle protocol")  # a raw pickle: refused below
            return torch.load(source, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many types for a damaged or foreign file
        raise UnreadableFile(name, _problem(e)) from None


def _safetensors_load(path: str | os.PathLike, map_location) -> dict:
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device=str(map_location))
    except Exception as e:  # noqa: BLE001 - SafetensorError, OSError ...
        raise UnreadableFile(path, f"is truncated or not a safetensors file ({_reason(e)})") from None


def safe_load(path: str | os.PathLike, map_location: str | torch.device = "cpu"):
    """The content of a torch file (``torch.load`` with ``weights_only=True``, numpy arrays allowed) or of a
    ``.safetensors`` file; :class:`UnreadableFile` naming the file for anything else."""
    _check_file(path)
    if str(path).endswith(".safetensors"):
        return _safetensors_load(path, map_location)
    return _torch_load(path, path, map_location)


# --------------------------------------------------------------------------- torch.export programs

#: the ``_operator`` functions an exported graph may call (arithmetic and indexing; no call/attrgetter)
_OPERATOR_TARGETS = frozenset({
    "getitem", "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos", "abs", "invert", "eq", "ne",
    "lt", "le", "gt", "ge", "and_", "or_", "xor", "not_", "lshift", "rshift"})
_TORCH_OP_TARGET = re.compile(r"^torch\.ops\.\w+\.\w+(\.\w+)?$")
#: the symbolic-size helpers of ``torch`` a graph with dynamic shapes calls
_TORCH_SYM_TARGETS = frozenset({"torch.sym_float", "torch.sym_int", "torch.sym_max", "torch.sym_min", "torch.sym_not",
                                "torch.sym_ite", "torch.sym_sum"})
_WEIGHTS_DIR, _CONSTANTS_DIR = "data/weights/", "data/constants/"


def _allowed_target(target: str) -> bool:
    module, _, name = target.partition(".")
    if module == "_operator":
        return name in _OPERATOR_TARGETS
    if module == "math":
        return "." not in name and callable(getattr(math, name, None))
    return target in _TORCH_SYM_TARGETS or bool(_TORCH_OP_TARGET.match(target))


#: names a symbolic-shape expression may use (``sympy.sympify`` evaluates it as Python): sympy / torch shape
#: functions and Symbol keywords; anything else (``__import__``, attributes, calls of other names) is refused
_SYM_NAMES = frozenset({
    "Symbol", "Integer", "Rational", "Float", "Add", "Mul", "Pow", "Max", "Min", "Mod", "Abs", "Eq", "Ne", "Lt", "Le",
    "Gt", "Ge", "And", "Or", "Not", "floor", "ceiling", "sqrt", "Piecewise", "True", "False", "oo", "positive",
    "negative", "nonnegative", "integer", "real", "finite", "FloorDiv", "ModularIndexing", "Where", "PythonMod",
    "CleanDiv", "CeilToInt", "FloorToInt", "CeilDiv", "LShift", "RShift", "IsNonOverlappingAndDenseIndicator",
    "TruncToFloat", "TruncToInt", "RoundToInt", "RoundDecimal", "ToFloat", "FloatPow", "PowByNatural", "IntTrueDiv",
    "FloatTrueDiv", "Identity"})
_SYM_SYMBOL = re.compile(r"^[a-z]{1,4}\d+$")
_SYM_QUOTED_SYMBOL = re.compile(r"(['\"])[a-z]{1,4}\d+\1")


def _safe_expression(expr: object) -> bool:
    """True when ``expr`` is arithmetic over shape symbols and the names of :data:`_SYM_NAMES` only."""
    if not isinstance(expr, str) or len(expr) > 500:
        return False
    text = _SYM_QUOTED_SYMBOL.sub("s0", expr)  # Symbol('s77', ...): the one string literal allowed
    if (re.search(r"[^\w\s+\-*/%().,<>=!&|~]", text) or "__" in text or re.search(r"(?<!\d)\.|\.(?!\d)", text)
            or re.search(r"(?<![A-Za-z\d])\d+\s*\*\*", text)):  # quotes, attributes, a number to a power
        return False
    return all(name in _SYM_NAMES or _SYM_SYMBOL.match(name) for name in re.findall(r"[A-Za-z_]\w*", text))


def _graph_problems(node: object) -> list[str]:
    """What in a serialized program (``models/*.json``) would run code when loaded or called."""
    found: list[str] = []
    if isinstance(node, dict):
        target = node.get("target")
        if isinstance(target, str) and "inputs" in node and not _allowed_target(target):
            found.append(f"calls {target!r}, which is not a torch operator")
        if "expr_str" in node and not _safe_expression(node["expr_str"]):
            found.append(f"has a shape expression that is not arithmetic ({str(node['expr_str'])[:80]!r}; sympy "
                         "evaluates it as Python)")
        for name in node.get("range_constraints") or {}:
            if not _SYM_SYMBOL.match(str(name)):
                found.append(f"has a shape range for {str(name)[:80]!r}, which is not a shape symbol")
        for value in node.values():
            found += _graph_problems(value)
    elif isinstance(node, list):
        for value in node:
            found += _graph_problems(value)
    return found


def _raw_payloads(reader, names: list[str]) -> set[str]:
    """Archive entries the weight / constant configs declare as raw tensor bytes (never unpickled); raises for a
    constant that is a pickled Python object."""
    raw = set()
    for name in names:
        if not (name.startswith((_WEIGHTS_DIR, _CONSTANTS_DIR)) and name.endswith("_config.json")):
            continue
        folder = _WEIGHTS_DIR if name.startswith(_WEIGHTS_DIR) else _CONSTANTS_DIR
        for fqn, meta in json.loads(reader.read_string(name)).get("config", {}).items():
            file_name = str(meta.get("path_name", ""))
            if folder == _CONSTANTS_DIR and not file_name.startswith("tensor_"):
                raise ValueError(f"constant {fqn!r} is a pickled Python object ({file_name})")
            if not meta.get("use_pickle"):
                raw.add(folder + file_name)
    return raw


def _check_pickled_entry(reader, name: str, path: str) -> None:
    """An archive entry torch unpickles: it must load with ``weights_only=True`` (tensors only)."""
    try:
        _torch_load(io.BytesIO(reader.read_bytes(name)), name, "cpu")
    except UnreadableFile as e:
        raise UnreadableFile(path, f"has an entry {name} that {e.problem}") from None


def _check_export_archive(data: bytes, path: str) -> None:
    from torch.export.pt2_archive import PT2ArchiveReader

    try:
        with PT2ArchiveReader(io.BytesIO(data)) as reader:
            names = reader.get_file_names()
            if any(name.startswith(("data/aotinductor/", "data/executorch/", "data/mtia")) for name in names):
                raise UnreadableFile(path, "holds compiled native code (AOTInductor / ExecuTorch); it was not loaded")
            raw = _raw_payloads(reader, names)
            for name in names:
                if name.startswith("models/") and name.endswith(".json"):
                    problems = _graph_problems(json.loads(reader.read_string(name)))
                    if problems:
                        raise UnreadableFile(path, f"is a torch.export program that {problems[0]}; it was not loaded")
                elif name.startswith("data/") and not name.endswith(".json") and name not in raw:
                    _check_pickled_entry(reader, name, path)
    except UnreadableFile:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged archive or config, a pickled constant
        problem = f"is not a loadable torch.export program ({_reason(e)}); it was not loaded"
        raise UnreadableFile(path, problem) from None


def load_export_program(path: str | os.PathLike) -> torch.export.ExportedProgram:
    """A ``torch.export`` program (``.pt2``) whose loading runs nothing from the file (see the module docstring):
    tensor payloads, ``torch.ops`` / arithmetic graph nodes, arithmetic shape expressions.  The bytes are read
    once, so the file checked is the file loaded."""
    _check_file(path)
    with open(path, "rb") as f:
        data = f.read()
    _check_export_archive(data, str(path))
    return torch.export.load(io.BytesIO(data))


__all__ = ["UnreadableFile", "load_export_program", "safe_load"]
