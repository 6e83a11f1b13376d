"""State-dict math shared by every aggregator: validation of a contribution and weighted averaging.

Pure numpy/torch; FLARE glue unwraps DXOs, calls these, and wraps the result.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Iterable, Mapping, Sequence

import numpy as np
import torch

from fedssl.core.untrusted import ContributionError, cast_array  # ContributionError re-exported: every aggregator raises it


def to_numpy(v) -> np.ndarray:
    if isinstance(v, torch.Tensor):
        return v.detach().cpu().numpy()
    return np.asarray(v)


def check_contribution(
    reference: Mapping[str, object], contribution: Mapping[str, object], site: str, keys: Iterable[str] | None = None,
    max_update_ratio: float | None = None,
) -> dict[str, np.ndarray]:
    """The contribution's tensors cast to the reference's dtypes, or ContributionError naming the site.

    ``reference`` is the current global model; ``keys`` (decided by the server, never by what a site
    sends) is the exact key set expected (default: every reference key).  Each tensor is cast to the
    reference dtype *before* any value check (``fedssl.core.untrusted.cast_array``: bool / complex /
    object arrays are refused, a float64 1e300 that overflows float32 is refused as non-finite), must have
    the reference shape, and, with ``max_update_ratio``, the update over all float tensors must satisfy
    ``||x - g|| <= max_update_ratio * max(||g||, 1)`` so that a site cannot push 1e38 weights.
    """
    expected = set(reference if keys is None else keys)
    got = set(contribution)
    if got != expected:
        missing, extra = sorted(expected - got)[:5], sorted(map(str, got - expected))[:5]
        raise ContributionError(
            f"{site} sent a model with the wrong keys (missing {missing}, unexpected {extra}); "
            "the site must run the same model configuration as the server"
        )
    cast: dict[str, np.ndarray] = {}
    for k in sorted(expected):
        ref = to_numpy(reference[k])
        cast[k] = cast_array(contribution[k], ref.dtype, repr(k), site, shape=ref.shape)
    if max_update_ratio is not None:
        ratio = update_ratio(reference, cast)
        if not ratio <= max_update_ratio:
            raise ContributionError(
                f"{site} sent an update of norm {ratio:.3g} x the global model's (bound {max_update_ratio:g}); "
                "contribution rejected (raise the aggregator's max_update_ratio only if such updates are expected)")
    return cast


def update_ratio(reference: Mapping[str, object], contribution: Mapping[str, np.ndarray]) -> float:
    """``||x - g|| / max(||g||, 1)`` over the float tensors of ``contribution`` (in float64, no overflow)."""
    diff, base = 0.0, 0.0
    for k, x in contribution.items():
        if x.dtype.kind != "f":
            continue
        g = to_numpy(reference[k]).astype(np.float64)
        diff += float(np.sum((x.astype(np.float64) - g) ** 2))
        base += float(np.sum(g**2))
    return float(np.sqrt(diff) / max(np.sqrt(base), 1.0))


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


def round_key_set(
    keys: Iterable[str], exclude_patterns: Sequence[str] = (), optional_prefixes: Sequence[str] = (),
    with_excluded: bool = False, with_optional: bool = False,
) -> set[str]:
    """The keys every contribution of a round must carry, as the *server* decides it.

    Keys matching ``exclude_patterns`` (kept on the sites) are expected only ``with_excluded`` (e.g. the last
    round of a knowledge split); keys starting with one of ``optional_prefixes`` only ``with_optional`` (e.g.
    the rounds in which FCLOpt sites upload their target network).  Everything else is always expected.
    """
    full = set(keys)
    excluded = set(match_keys(full, exclude_patterns))
    optional = {k for k in full if optional_prefixes and k.startswith(tuple(optional_prefixes))} - excluded
    expected = full - excluded - optional
    if with_excluded:
        expected |= excluded
    if with_optional:
        expected |= optional
    return expected
