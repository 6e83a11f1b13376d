"""State-dict math shared by every aggregator: validation of a contribution and weighted averaging.

Pure numpy/torch; FLARE glue unwraps DXOs, calls these, and wraps the result.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from fnmatch import fnmatchcase
from typing import Iterable, Mapping, Sequence

import numpy as np
import torch

# ContributionError re-exported: every aggregator raises it
from fedssl.core.untrusted import ContributionError, cast_array, refuse_non_finite


#: values in a scratch chunk (512 KB of float64, within a core's L2 cache): the update norm and the running sum
#: stream through it instead of a temporary the size of a tensor
SCRATCH = 1 << 16
#: threads that share the running sum of a contribution (elementwise, so the bits do not depend on the split)
SUM_THREADS = max(1, min(4, os.cpu_count() or 1))
#: a contribution smaller than this many values is summed on the calling thread alone
PARALLEL_MIN = 1 << 20
#: the triangle-inequality shortcut accepts only below this fraction of the bound (float32 dot products round)
SHORTCUT_MARGIN = 0.999


def to_numpy(v) -> np.ndarray:
    if isinstance(v, torch.Tensor):
        return v.detach().cpu().numpy()
    return np.asarray(v)


def check_contribution(
    reference: Mapping[str, object], contribution: Mapping[str, object], site: str, keys: Iterable[str] | None = None,
    max_update_ratio: float | None = None, base_sq: float | None = None,
) -> dict[str, np.ndarray]:
    """The contribution's tensors cast to the reference's dtypes, or ContributionError naming the site.

    ``reference`` is the current global model; ``keys`` (decided by the server, never by what a site
    sends) is the exact key set expected (default: every reference key).  Each tensor is cast to the
    reference dtype *before* any value check (``fedssl.core.untrusted.cast_array``: bool / complex /
    object arrays are refused, a float64 1e300 that overflows float32 is refused as non-finite), must have
    the reference shape, and, with ``max_update_ratio``, the update over all float tensors must satisfy
    ``||x - g|| <= max_update_ratio * max(||g||, 1)`` so that a site cannot push 1e38 weights.  With the bound,
    finiteness is read off the update's norm (a NaN or an infinity makes it non-finite; only then is the tensor
    that holds it looked for), which saves a pass over the model; ``base_sq`` is ``||g||^2`` over the checked
    keys when the caller has it (an aggregator computes it once a round, :func:`squared_norm`).
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
    bounded = max_update_ratio is not None
    for k in sorted(expected):
        ref = to_numpy(reference[k])
        cast[k] = cast_array(contribution[k], ref.dtype, repr(k), site, shape=ref.shape, check_finite=not bounded)
    if bounded:
        base_sq = squared_norm(reference, cast) if base_sq is None else base_sq
        if within_bound_by_norms(cast, base_sq, max_update_ratio):
            return cast
        ratio = update_ratio(reference, cast, base_sq)
        if not np.isfinite(ratio):
            for k, x in cast.items():  # which tensor: the usual message (an overflowing square is not one of them)
                refuse_non_finite(x, repr(k), site)
        if not ratio <= max_update_ratio:
            raise ContributionError(
                f"{site} sent an update of norm {ratio:.3g} x the global model's (bound {max_update_ratio:g}); "
                "contribution rejected (raise the aggregator's max_update_ratio only if such updates are expected)")
    return cast


def squared_norm(reference: Mapping[str, object], keys: Iterable[str]) -> float:
    """``||g||^2`` over the float tensors among ``keys`` of ``reference``, summed in float64."""
    total = 0.0
    for k in keys:
        g = to_numpy(reference[k])
        if g.dtype.kind == "f":
            g = g.ravel()
            total += float(np.dot(g, g))
    return total


def within_bound_by_norms(contribution: Mapping[str, np.ndarray], base_sq: float, max_update_ratio: float) -> bool:
    """True when ``||x - g|| <= max_update_ratio * max(||g||, 1)`` follows from the norms alone, by the triangle
    inequality ``||x - g|| <= ||x|| + ||g||``: ``||x||`` is one BLAS pass over the contribution's float tensors,
    where the exact ``||x - g||`` (:func:`update_ratio`) reads the global model as well and subtracts (issue 46: an
    honest update, ``||x|| ~ ||g||`` against a bound of ten times ``||g||``, is accepted at a quarter of the cost).
    False means "not shown": a NaN, an infinity or an overflowing square, or a norm near the bound, goes to the
    exact check, which decides and names the fault.  ``SHORTCUT_MARGIN`` keeps float32 rounding of the dot products
    from accepting anything the exact check would refuse."""
    with np.errstate(over="ignore", invalid="ignore"):
        own = parallel_squared_norm(contribution)
    g = float(np.sqrt(base_sq))
    return bool(np.isfinite(own) and np.sqrt(own) + g <= SHORTCUT_MARGIN * max_update_ratio * max(g, 1.0))


def update_ratio(reference: Mapping[str, object], contribution: Mapping[str, np.ndarray],
                 base_sq: float | None = None) -> float:
    """``||x - g|| / max(||g||, 1)`` over the float tensors of ``contribution`` (``base_sq``: ``||g||^2`` over them,
    computed here when not given).

    ``x - g`` is formed one cache-sized chunk at a time (no temporary of a tensor) and each chunk's squared norm is
    a BLAS dot product in the tensor's own precision, summed in float64; a NaN or infinity in ``x``, or an update
    so large that its square overflows, gives ``inf``."""
    diff = 0.0
    scratch: np.ndarray | None = None
    with np.errstate(over="ignore", invalid="ignore"):
        for k, x in contribution.items():
            if x.dtype.kind != "f":
                continue
            g = to_numpy(reference[k]).astype(x.dtype, copy=False).ravel()
            xf = x.ravel()
            if scratch is None or scratch.dtype != x.dtype:
                scratch = np.empty(SCRATCH, x.dtype)
            for i in range(0, xf.size, SCRATCH):
                n = min(SCRATCH, xf.size - i)
                d = np.subtract(xf[i:i + n], g[i:i + n], out=scratch[:n])
                diff += float(np.dot(d, d))
    base = squared_norm(reference, [k for k, x in contribution.items() if x.dtype.kind == "f"]) \
        if base_sq is None else base_sq
    return float(np.sqrt(diff) / max(np.sqrt(base), 1.0)) if np.isfinite(diff) else float("inf")


_POOL: ThreadPoolExecutor | None = None
_LOCAL = threading.local()


def _scratch() -> np.ndarray:
    """This thread's float64 scratch buffer of ``SCRATCH`` values (made on first use)."""
    buf = getattr(_LOCAL, "scratch", None)
    if buf is None or buf.size != SCRATCH:
        buf = _LOCAL.scratch = np.empty(SCRATCH, np.float64)
    return buf


def _axpy(dst: np.ndarray, src: np.ndarray, scale: np.float64) -> None:
    """``dst += src * scale`` in float64, chunk by chunk through this thread's scratch buffer, which stays in the
    CPU cache: no float64 temporary of a tensor."""
    buf = _scratch()
    for i in range(0, src.size, SCRATCH):
        n = min(SCRATCH, src.size - i)
        b = buf[:n]
        np.copyto(b, src[i:i + n])  # the cast first: a mixed-dtype multiply runs numpy's slower buffered loop
        np.multiply(b, scale, out=b)
        np.add(dst[i:i + n], b, out=dst[i:i + n])


def _scaled(dst: np.ndarray, src: np.ndarray, scale: np.float64) -> None:
    """``dst = src * scale`` in float64 (the first contribution of a sum), cast first as :func:`_axpy` does, chunk
    by chunk through the scratch buffer: ``dst`` is written once, not written, read and written again."""
    buf = _scratch()
    for i in range(0, src.size, SCRATCH):
        n = min(SCRATCH, src.size - i)
        b = buf[:n]
        np.copyto(b, src[i:i + n])
        np.multiply(b, scale, out=dst[i:i + n])


def _divide(dst: np.ndarray, src: np.ndarray, scale: np.float64) -> None:
    """``dst = src / scale``, written straight into ``dst``'s dtype (the model's): no float64 temporary."""
    np.divide(src, scale, out=dst, casting="same_kind")


def _run_part(kernel, pairs: list, scale: np.float64, lo: int, hi: int) -> None:
    """``kernel(dst, src, scale)`` on the values ``lo:hi`` of the ``(dst, src)`` pairs laid end to end (flat views)."""
    start = 0
    for dst, src in pairs:
        end = start + src.size
        if end > lo and start < hi:
            a, b = max(lo, start) - start, min(hi, end) - start
            kernel(dst.reshape(-1)[a:b], src.reshape(-1)[a:b], scale)
        start = end


def release_threads() -> None:
    """Stop the summing threads (a server calls it at the end of a run: FLARE's process manager warns about every
    thread still running at exit); the next :func:`over_threads` starts them again."""
    global _POOL
    pool, _POOL = _POOL, None
    if pool is not None:
        pool.shutdown(wait=True)


def over_parts(part, total: int) -> list:
    """``part(lo, hi)`` over ``0:total`` cut evenly into up to ``SUM_THREADS`` pieces, one per thread (numpy
    releases the GIL); the results in the pieces' order.  Fewer than ``PARALLEL_MIN`` values per piece run on the
    calling thread alone."""
    global _POOL
    parts = min(SUM_THREADS, max(1, total // PARALLEL_MIN))
    if parts == 1:
        return [part(0, total)]
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=SUM_THREADS - 1, thread_name_prefix="fedssl-sum")
    cuts = [total * p // parts for p in range(parts + 1)]
    futures = [_POOL.submit(part, cuts[p], cuts[p + 1]) for p in range(1, parts)]
    return [part(cuts[0], cuts[1])] + [f.result() for f in futures]


def over_threads(kernel, pairs: list, scale: np.float64) -> None:
    """``kernel(dst, src, scale)`` over every ``(dst, src)`` of ``pairs``, the values split evenly over
    ``SUM_THREADS`` threads (:func:`over_parts`).  Each value is computed exactly as on one thread, so the bits
    do not depend on the split (issue 46: the running sum and the mean of a ViT-B on every core of the server)."""
    over_parts(lambda lo, hi: _run_part(kernel, pairs, scale, lo, hi), sum(src.size for _, src in pairs))


def _squares_part(arrays: list, lo: int, hi: int) -> float:
    """The sum of squares of the values ``lo:hi`` of ``arrays`` laid end to end (flat views), one BLAS dot product
    per tensor piece, summed in float64."""
    total, start = 0.0, 0
    with np.errstate(over="ignore", invalid="ignore"):  # per thread: an overflowing square is an inf, decided later
        for a in arrays:
            end = start + a.size
            if end > lo and start < hi:
                v = a.reshape(-1)[max(lo, start) - start:min(hi, end) - start]
                total += float(np.dot(v, v))
            start = end
    return total


def parallel_squared_norm(state: Mapping[str, object]) -> float:
    """``||x||^2`` over the float tensors of ``state``, split over the summing threads as the running sum is
    (:func:`over_parts`); each piece's dot products are summed in float64, then the pieces in order.  How the
    values are split moves the last bits, so it serves a decision with a margin (:func:`within_bound_by_norms`),
    never a value that is reported or compared."""
    arrays = [a for a in (to_numpy(v) for v in state.values()) if a.dtype.kind == "f"]
    return sum(over_parts(lambda lo, hi: _squares_part(arrays, lo, hi), sum(a.size for a in arrays)))


class RunningAverage:
    """``sum_i w_i x_i / sum_i w_i`` accumulated one contribution at a time, as contributions arrive.

    Only the float64 running sum is held (two bytes of state per byte of a float32 model), never a site's
    tensors, so the server's memory does not grow with the number of sites (FLARE's in-time accumulating
    aggregator does the same).  The float64 sum makes the result independent of the arrival order up to the
    final rounding to the model's dtype.  Integer buffers (e.g. BatchNorm ``num_batches_tracked``) are averaged
    in float64 and rounded back.  The first contribution fixes the key set and shapes; a later one that differs
    is refused (ValueError) before anything is added.
    """

    def __init__(self) -> None:
        self._sum: dict[str, np.ndarray] = {}
        self._dtype: dict[str, np.dtype] = {}
        self._spare: dict[str, np.ndarray] = {}  # last round's float64 buffers, reused by the next round
        self.total_weight = 0.0
        self.count = 0
        self._broken = ""  # why this sum holds part of a contribution (then it has no mean)

    def clear(self) -> None:
        """Start a new average, keeping the float64 buffers for the next one (a server aggregates the same
        model every round: allocating ~2 bytes per parameter afresh each round costs more than the sums)."""
        self._spare.update(self._sum)
        self._sum, self._dtype, self.total_weight, self.count = {}, {}, 0.0, 0
        self._broken = ""

    def add(self, state: Mapping[str, object], weight: float) -> None:
        arrays = {k: to_numpy(v) for k, v in state.items()}
        shapes, dtypes = {k: a.shape for k, a in arrays.items()}, {k: a.dtype for k, a in arrays.items()}
        scale = self._start_add(weight, shapes, dtypes)
        over_threads(_scaled if not self.count else _axpy, [(self._sum[k], a) for k, a in arrays.items()], scale)
        self._end_add(scale)

    def add_held(self, held, weight: float) -> None:
        """:meth:`add` of a state held aside (``fedssl.core.spill``: ``shapes``, ``dtypes`` and ``pieces(key)``),
        read back a piece at a time: each value is summed exactly as :meth:`add` sums it, so the bits are the same."""
        scale = self._start_add(weight, held.shapes, held.dtypes)
        kernel = _scaled if not self.count else _axpy
        try:
            for k in held.shapes:
                dst = self._sum[k].reshape(-1)
                for start, piece in held.pieces(k):
                    over_threads(kernel, [(dst[start:start + piece.size], piece)], scale)
        except Exception as e:  # part of it is in the sum and cannot be taken out: no mean of this sum is returned
            self._broken = f"a held contribution could not be read back whole ({type(e).__name__}: {e})"
            raise ValueError(self._broken) from e
        self._end_add(scale)

    def _start_add(self, weight: float, shapes: Mapping[str, tuple], dtypes: Mapping[str, np.dtype]) -> np.float64:
        """The checked weight as a float64 scalar; a contribution whose keys or shapes differ from the first one's
        is refused (ValueError) before anything is added; the first one's float64 buffers are made ready."""
        w = float(weight)
        if not (np.isfinite(w) and w >= 0):
            raise ValueError(f"weight {weight!r} must be a finite number >= 0")
        if self.count and set(shapes) != set(self._sum):
            missing, extra = sorted(set(self._sum) - set(shapes))[:3], sorted(set(shapes) - set(self._sum))[:3]
            raise ValueError(f"contribution keys differ from the first one's (missing {missing}, unexpected {extra})")
        for k, shape in shapes.items():
            if self.count and shape != self._sum[k].shape:
                raise ValueError(f"{k!r} has shape {shape}, the first contribution's is {self._sum[k].shape}")
        if not self.count:
            for k, shape in shapes.items():
                spare = self._spare.pop(k, None)
                out = spare if spare is not None and spare.shape == shape else np.empty(shape, np.float64)
                self._sum[k], self._dtype[k] = out, np.dtype(dtypes[k])  # 0-d stays an array
        return np.float64(w)  # a numpy float64 scalar promotes a float32 tensor to float64 (a Python float would not)

    def _end_add(self, scale: np.float64) -> None:
        self.total_weight += float(scale)
        self.count += 1

    def result(self) -> dict[str, np.ndarray]:
        """The weighted mean of every key, in the first contribution's dtypes."""
        if self._broken:
            raise ValueError(f"the running sum is incomplete: {self._broken}; this round has no mean")
        if self.count == 0 or self.total_weight <= 0:
            raise ValueError(f"weights must not all be zero and at least one state is needed (got {self.count} states, "
                             f"total weight {self.total_weight:g})")
        out: dict[str, np.ndarray] = {}
        floats = []
        for k, acc in self._sum.items():
            dtype = self._dtype[k]
            if dtype.kind in "iub":
                out[k] = np.rint(acc / self.total_weight).astype(dtype)
            else:  # divided straight into the model's dtype: no float64 temporary of the whole model
                out[k] = np.empty(acc.shape, dtype)
                floats.append((out[k], acc))
        over_threads(_divide, floats, np.float64(self.total_weight))
        return out


def weighted_average(states: Sequence[Mapping[str, object]], weights: Sequence[float]) -> dict[str, np.ndarray]:
    """sum_i w_i x_i / sum_i w_i for every key (buffers included), through :class:`RunningAverage`; inputs are
    never modified."""
    if len(states) == 0 or len(states) != len(weights):
        raise ValueError(f"need one weight per state, got {len(states)} states and {len(weights)} weights")
    running = RunningAverage()
    for state, w in zip(states, weights):
        running.add(state, w)
    return running.result()


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
