"""State-dict math shared by every aggregator: validation of a contribution and weighted averaging.

Pure numpy/torch; FLARE glue unwraps DXOs, calls these, and wraps the result.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Iterable, Mapping, Sequence

import numpy as np
import torch

from fedssl.core.untrusted import ContributionError  # noqa: F401  (re-exported: the error every aggregator raises)


def to_numpy(v) -> np.ndarray:
    if isinstance(v, torch.Tensor):
        return v.detach().cpu().numpy()
    return np.asarray(v)


def check_contribution(
    reference: Mapping[str, object], contribution: Mapping[str, object], site: str, keys: Iterable[str] | None = None
) -> None:
    """Raise ContributionError unless ``contribution`` has exactly the expected keys, their shapes and finite values.

    ``reference`` is the current global model (or the first accepted contribution of the round);
    ``keys`` restricts the expected key set (e.g. when some keys are excluded by pattern).
    """
    expected = set(reference if keys is None else keys)
    got = set(contribution)
    if got != expected:
        missing, extra = sorted(expected - got)[:5], sorted(got - expected)[:5]
        raise ContributionError(
            f"{site} sent a model with the wrong keys (missing {missing}, unexpected {extra}); "
            "the site must run the same model configuration as the server"
        )
    for k in sorted(expected):
        ref, val = to_numpy(reference[k]), to_numpy(contribution[k])
        if ref.shape != val.shape:
            raise ContributionError(
                f"{site} sent {k!r} with shape {val.shape}, expected {ref.shape}; "
                "the site must run the same model configuration as the server"
            )
        if val.dtype.kind not in "fiub":
            raise ContributionError(f"{site} sent {k!r} with non-numeric dtype {val.dtype}")
        if val.dtype.kind == "f" and not np.all(np.isfinite(val)):
            raise ContributionError(f"{site} sent non-finite values (NaN/Inf) in {k!r}; contribution rejected")


def weighted_average(states: Sequence[Mapping[str, object]], weights: Sequence[float]) -> dict[str, np.ndarray]:
    """sum_i w_i x_i / sum_i w_i for every key (buffers included); inputs are never modified.

    Integer buffers (e.g. BatchNorm ``num_batches_tracked``) are averaged in float64 and rounded back.
    """
    if len(states) == 0 or len(states) != len(weights):
        raise ValueError(f"need one weight per state, got {len(states)} states and {len(weights)} weights")
    w = np.asarray(weights, dtype=np.float64)
    if np.any(~np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"weights {w.tolist()} must be finite, non-negative and not all zero")
    w = w / w.sum()
    out: dict[str, np.ndarray] = {}
    for k in states[0]:
        arrays = [to_numpy(s[k]) for s in states]
        acc = sum(wi * a.astype(np.float64) for wi, a in zip(w, arrays))
        dtype = arrays[0].dtype
        out[k] = np.rint(acc).astype(dtype) if dtype.kind in "iub" else acc.astype(dtype)
    return out


def match_keys(keys: Iterable[str], patterns: Sequence[str]) -> list[str]:
    """The keys (in their order) that match any of the shell-style ``patterns`` (case-sensitive fnmatch).

    ``"encoder.cls_token"`` matches that key only, ``"decoder.*"`` every decoder tensor,
    ``"*.running_mean"`` every batch-norm running mean.
    """
    return [k for k in keys if any(fnmatchcase(k, p) for p in patterns)]


def merge_into(base: Mapping[str, object], update: Mapping[str, object]) -> dict[str, object]:
    """A new dict: every key of ``base``, with the keys of ``update`` replaced (the global model never loses a key)."""
    merged = dict(base)
    merged.update(update)
    return merged


@torch.no_grad()
def ema_update(target: torch.nn.Module, online: torch.nn.Module, m: float) -> None:
    """xi <- m xi + (1 - m) theta for parameters; buffers are copied (MoCo / BYOL momentum update)."""
    for pt, po in zip(target.parameters(), online.parameters()):
        pt.mul_(m).add_(po.detach(), alpha=1.0 - m)
    for bt, bo in zip(target.buffers(), online.buffers()):
        bt.copy_(bo)
