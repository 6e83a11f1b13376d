"""Checks for values that arrive from a site (tensors, counts, scores) before they touch shared state.

Every site is treated as possibly faulty or malicious: what it sends is cast to the type the server
expects, checked (finite, in range, bounded) and refused with a :class:`ContributionError` naming the site
and the value otherwise.  Callers catch the error, log it and leave that site out; no check here raises
anything else on any input (a dict, a string, a huge int, a complex number, an object array).
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch


class ContributionError(ValueError):
    """A contribution that must not touch shared state (wrong keys, shapes, types, non-finite or unbounded values)."""


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def as_finite_float(value: object, what: str, site: str, bound: float = 1e12) -> float:
    """``value`` as a Python float when it is a real number (bool excluded) with ``|value| <= bound``."""
    if isinstance(value, np.ndarray) and value.shape == ():
        value = value.item()
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ContributionError(f"{site} sent {what}={_short(value)}; a real number is required")
    try:
        out = float(value)
    except (OverflowError, ValueError) as e:
        raise ContributionError(f"{site} sent {what}={_short(value)}; not representable as a float ({e})") from None
    if not math.isfinite(out) or abs(out) > bound:
        raise ContributionError(f"{site} sent {what}={_short(value)}; a finite number of magnitude <= {bound:g} is "
                                "required")
    return out


def as_count(value: object, what: str, site: str, cap: float, minimum: int = 1) -> int:
    """``value`` as an int count in ``[minimum, cap]``: integral (5 or 5.0, not 5.5), finite, bool excluded."""
    number = as_finite_float(value, what, site, bound=float("inf") if math.isinf(cap) else max(cap, 1.0) * 1e6)
    if number != math.floor(number):
        raise ContributionError(f"{site} sent {what}={_short(value)}; a whole number is required")
    if number < minimum or number > cap:
        raise ContributionError(f"{site} sent {what}={_short(value)}; it must lie in [{minimum}, {cap:g}]")
    return int(number)


def cast_array(value: object, dtype: np.dtype, what: str, site: str, shape: tuple | None = None,
               check_finite: bool = True) -> np.ndarray:
    """``value`` (numpy array, torch tensor or nested list) cast to ``dtype``, refused unless the cast is safe.

    Float targets accept float and integer sources (bool, complex, object and strings are refused) and the
    result must be finite: a float64 1e300 cast to float32 becomes inf and is refused here, after the cast.
    Integer targets accept integers only (a float 0.5 would be truncated silently).  ``shape`` (if given)
    must match exactly.  An array already of ``dtype`` is returned as it is (no copy: an 86.6 M-parameter model
    arriving at the server costs no second copy, issue 46); callers never write into what they are given.
    ``check_finite=False`` leaves the finiteness of a float result to the caller (one that computes a norm of it
    anyway, e.g. :func:`fedssl.core.state_dict.check_contribution`, and calls :func:`refuse_non_finite`).
    """
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError) as e:
        raise ContributionError(f"{site} sent {what} that is not an array ({e})") from None
    dtype = np.dtype(dtype)
    kind = arr.dtype.kind
    if dtype.kind == "f":
        if kind not in "fiu":
            raise ContributionError(f"{site} sent {what} with dtype {arr.dtype}; expected real numbers ({dtype})")
    elif dtype.kind in "iu":
        if kind not in "iu":
            raise ContributionError(f"{site} sent {what} with dtype {arr.dtype}; expected integers ({dtype})")
        info = np.iinfo(dtype)
        if arr.size and (arr.min() < info.min or arr.max() > info.max):
            raise ContributionError(f"{site} sent {what} with values outside the range of {dtype}")
    elif dtype.kind == "b":
        if kind != "b":
            raise ContributionError(f"{site} sent {what} with dtype {arr.dtype}; expected booleans")
    else:
        raise ValueError(f"cast_array: unsupported target dtype {dtype}")
    if shape is not None and tuple(arr.shape) != tuple(shape):
        raise ContributionError(f"{site} sent {what} with shape {tuple(arr.shape)}, expected {tuple(shape)}")
    with np.errstate(over="ignore", invalid="ignore"):
        out = arr.astype(dtype, copy=False)
    if check_finite:
        refuse_non_finite(out, what, site)
    return out


def refuse_non_finite(arr: np.ndarray, what: str, site: str) -> None:
    """ContributionError naming the site unless every value of a float ``arr`` is finite."""
    # NaN propagates through min and max, and an infinity is one of them: two reductions, no mask of the array
    if arr.dtype.kind == "f" and arr.size and not (np.isfinite(arr.min()) and np.isfinite(arr.max())):
        raise ContributionError(f"{site} sent non-finite values in {what} (NaN/Inf, or overflow when cast to "
                                f"{arr.dtype})")


def bounded_json(value: object, what: str, site: str, max_items: int = 4096, max_depth: int = 6,
                 max_str: int = 256) -> object:
    """A JSON-safe copy of a small report a site sends (e.g. its test metrics), or ContributionError.

    Allowed: dicts with string keys, lists, strings of at most ``max_str`` characters, bools, None and real
    numbers (numpy scalars too; NaN becomes None, as JSON has no NaN; other non-finite values and magnitudes
    above 1e12 are refused), nested at most ``max_depth`` deep (a surgical test reply is 5), ``max_items`` values in
    all.
    """
    count = 0

    def copy(v: object, depth: int) -> object:
        nonlocal count
        count += 1
        if count > max_items or depth > max_depth:
            raise ContributionError(f"{site} sent {what} larger than {max_items} values or deeper than {max_depth}")
        if v is None or isinstance(v, (bool, np.bool_)):
            return None if v is None else bool(v)
        if isinstance(v, str):
            if len(v) > max_str:
                raise ContributionError(f"{site} sent {what} with a string of {len(v)} characters (at most {max_str})")
            return v
        if isinstance(v, numbers.Real) or (isinstance(v, np.ndarray) and v.shape == () and v.dtype.kind in "fiu"):
            x = float(v)
            if math.isnan(x):
                return None
            if isinstance(v, (int, np.integer)) and abs(x) <= 1e12:
                return int(v)
            return as_finite_float(x, what, site)
        if isinstance(v, dict):
            if not all(isinstance(k, str) and len(k) <= max_str for k in v):
                raise ContributionError(f"{site} sent {what} with a key that is not a short string")
            return {k: copy(x, depth + 1) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [copy(x, depth + 1) for x in v]
        raise ContributionError(f"{site} sent {what} holding a {type(v).__name__}; only JSON values are accepted")

    return copy(value, 0)
