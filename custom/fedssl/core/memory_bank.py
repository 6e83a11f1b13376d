"""Local memory bank of momentum features with partition ids, and FCL negative sampling.

FCL (Wu et al., MedIA 2022) section 3.2: each client keeps a size-K FIFO bank Q_{l,c} of momentum features
("progressively updated by replacing the oldest features with the latest ones"); with feature exchange (FE) it also
holds the banks of the other clients, Q = Q_{l,c} U {Q_{l,i}, i != c} (1); negative sampling (NS) draws a
size-K subset Q' of Q uniformly (2).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
import torch.nn.functional as F

from fedssl.core.untrusted import ContributionError, cast_array


class FeatureBank:
    """FIFO bank of ``capacity`` L2-normalised features ``[K, D]`` with partition ids ``[K]``.

    Starts like MoCo's queue with random unit vectors; their partition id is -1, so they are never
    remote positives (equation (4)) until they have been replaced by real features.
    """

    def __init__(self, capacity: int, dim: int, seed: int = 0):
        if capacity <= 0 or dim <= 0:
            raise ValueError(f"capacity={capacity}, dim={dim}: both must be positive (paper: K=4096, D=128)")
        g = torch.Generator().manual_seed(seed)
        self.features = F.normalize(torch.randn(capacity, dim, generator=g), dim=1)  # [K, D]
        self.partitions = torch.full((capacity,), -1, dtype=torch.long)  # [K]
        self.ptr = 0
        self.filled = 0
        #: rows enqueued since the last :meth:`export_fresh` (at most K): what the next upload shares
        self.fresh = 0

    @property
    def capacity(self) -> int:
        return int(self.features.shape[0])

    @property
    def dim(self) -> int:
        return int(self.features.shape[1])

    @torch.no_grad()
    def enqueue(self, feats: torch.Tensor, parts: torch.Tensor) -> None:
        """Replace the oldest entries by ``feats [n, D]`` (n <= K), wrapping around."""
        n = int(feats.shape[0])
        if feats.ndim != 2 or feats.shape[1] != self.dim or parts.shape != (n,):
            raise ValueError(f"enqueue expects feats [n, {self.dim}] and parts [n]; got {tuple(feats.shape)}, "
                             f"{tuple(parts.shape)}")
        if n > self.capacity:
            feats, parts, n = feats[-self.capacity :], parts[-self.capacity :], self.capacity
        idx = (self.ptr + torch.arange(n)) % self.capacity
        self.features[idx] = feats.detach().to(self.features)
        self.partitions[idx] = parts.detach().to(self.partitions)
        self.ptr = int((self.ptr + n) % self.capacity)
        self.filled = min(self.capacity, self.filled + n)
        self.fresh = min(self.capacity, self.fresh + n)

    def state_dict(self) -> dict:
        return {"features": self.features.clone(), "partitions": self.partitions.clone(), "ptr": self.ptr,
                "filled": self.filled, "fresh": self.fresh}

    def load_state_dict(self, state: dict) -> None:
        feats, parts = torch.as_tensor(state["features"]), torch.as_tensor(state["partitions"])
        if tuple(feats.shape) != tuple(self.features.shape):
            raise ValueError(f"bank checkpoint has shape {tuple(feats.shape)}, expected {tuple(self.features.shape)}")
        self.features = feats.float().clone()
        self.partitions = parts.long().clone()
        self.ptr, self.filled = int(state["ptr"]), int(state["filled"])
        self.fresh = int(state.get("fresh", 0))  # checkpoints before the fresh-only exchange: nothing pending

    def export(self) -> tuple[np.ndarray, np.ndarray]:
        """The whole bank: float32 ``[K, D]`` features and int64 ``[K]`` partitions (copies)."""
        return self.features.numpy().astype(np.float32, copy=True), self.partitions.numpy().astype(np.int64, copy=True)

    def export_fresh(self) -> tuple[np.ndarray, np.ndarray]:
        """What a client uploads for feature exchange: the ``fresh`` rows enqueued since the last call, oldest first
        (float32 ``[n, D]``, int64 ``[n]``, n <= K), and none of them again.  Each feature leaves the site once:
        a bank that is re-sent every round lets a receiver link a feature across rounds by its value or by how long
        it stays, and average its independently perturbed copies (issue 45)."""
        idx = (self.ptr - self.fresh + torch.arange(self.fresh)) % self.capacity
        self.fresh = 0
        return (self.features[idx].numpy().astype(np.float32, copy=True),
                self.partitions[idx].numpy().astype(np.int64, copy=True))

    def filled_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the filled entries, oldest first: ``[filled, D]`` features and ``[filled]`` partition ids."""
        idx = (self.ptr - self.filled + torch.arange(self.filled)) % self.capacity
        return self.features[idx].clone(), self.partitions[idx].clone()

    def receive(self, features: object, partitions: object) -> int:
        """Enqueue the filled rows (partition id >= 0) of a delivered remote bank: a receiver keeps the other sites'
        features in a FIFO of its own, because each of them is delivered once.  Returns how many were enqueued.
        Raises ValueError on a shape other than ``[M, D]`` / ``[M]`` (M may be 0)."""
        f = torch.as_tensor(np.asarray(features, dtype=np.float32))  # float16 when banks travel in half precision
        p = torch.as_tensor(np.asarray(partitions, dtype=np.int64))
        if f.ndim != 2 or f.shape[1] != self.dim or tuple(p.shape) != (f.shape[0],):
            raise ValueError(f"the remote bank has features {tuple(f.shape)} and partitions {tuple(p.shape)}; "
                             f"expected [M, {self.dim}] and [M]")
        keep = p >= 0
        n = int(keep.sum())
        if n:
            self.enqueue(f[keep], p[keep])
        self.fresh = 0  # a remote bank is never uploaded
        return n


def sample_negatives(
    local_feats: torch.Tensor,  # [K, D]
    local_parts: torch.Tensor,  # [K]
    remote_feats: torch.Tensor | None,  # [M, D] or None (no feature exchange)
    remote_parts: torch.Tensor | None,  # [M]
    k: int,
    generator: torch.Generator,
    sample: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Q' of equation (2): ``k`` features drawn uniformly without replacement from Q (equation (1)).

    With ``sample`` False (the NS ablation switched off) all of Q is returned.  The draw is made once
    per mini-batch and shared by its queries (the per-query draw of the paper costs B x K x D memory;
    the expectation over the draw is the same).
    """
    if remote_feats is not None and remote_feats.shape[0] > 0:
        q_feats = torch.cat([local_feats, remote_feats.to(local_feats)], dim=0)
        q_parts = torch.cat([local_parts, remote_parts.to(local_parts)], dim=0)
    else:
        q_feats, q_parts = local_feats, local_parts
    if not sample or q_feats.shape[0] <= k:
        return q_feats, q_parts
    idx = torch.randperm(q_feats.shape[0], generator=generator)[:k].to(q_feats.device)
    return q_feats[idx], q_parts[idx]


#: |norm - 1| tolerated on an uploaded feature (FCL features are L2-normalised; float32 rounding is ~1e-7)
UNIT_NORM_TOL = 1e-3


#: the least feature spread (mean over dimensions of the std over filled rows) an uploaded bank may have: a
#: collapsed honest encoder stays above 1e-3 (feature spread 0.001-0.006 measured), a bank of copies is 0
MIN_BANK_SPREAD = 1e-5


def check_bank(features: object, partitions: object, site: str, dim: int, max_rows: int,
               n_partitions: int) -> tuple[np.ndarray, np.ndarray]:
    """Validate an uploaded bank before it is shuttled to other sites; float32 ``[K, dim]`` / int64 ``[K]`` copies.

    Checked after the cast (``fedssl.core.untrusted.cast_array``): width ``dim``, at most ``max_rows`` rows (the
    job's K; 0 rows is a site that shares nothing this round), finite, every row of unit norm within
    ``UNIT_NORM_TOL``, partition ids in ``[-1, n_partitions)``
    (-1 marks a bank slot not yet filled), and, with 4 or more filled rows, not degenerate: at least half of them
    distinct and a feature spread of at least :data:`MIN_BANK_SPREAD`.  ContributionError names the site otherwise.
    """
    f = cast_array(features, np.float32, "its feature bank", site)
    if f.ndim != 2 or f.shape[1] != dim or not 0 <= f.shape[0] <= max_rows:
        raise ContributionError(f"{site} sent a feature bank of shape {f.shape}; expected [n, {dim}] with 0 <= n <= "
                                f"{max_rows}")
    p = cast_array(partitions, np.int64, "its bank partition ids", site, shape=(f.shape[0],))
    norms = np.linalg.norm(f.astype(np.float64), axis=1)
    if np.any(np.abs(norms - 1.0) > UNIT_NORM_TOL):
        raise ContributionError(f"{site} sent bank features that are not unit vectors (norms {norms.min():.4g} to "
                                f"{norms.max():.4g}); FCL shares L2-normalised features")
    if p.size and (p.min() < -1 or p.max() >= n_partitions):
        raise ContributionError(f"{site} sent bank partition ids in [{p.min()}, {p.max()}]; expected -1 (unfilled) "
                                f"or 0..{n_partitions - 1}")
    filled = f[p >= 0]
    if filled.shape[0] >= 4:  # a degenerate bank poisons the others' negatives (issue 45)
        distinct = np.unique(filled, axis=0).shape[0]
        if distinct * 2 < filled.shape[0]:
            raise ContributionError(f"{site} sent a bank of {filled.shape[0]} filled features with only {distinct} "
                                    "distinct ones; a bank holds one feature per sampled slice")
        spread = float(filled.astype(np.float64).std(axis=0).mean())
        if spread < MIN_BANK_SPREAD:
            raise ContributionError(f"{site} sent a near-constant bank (feature spread {spread:.2g} < "
                                    f"{MIN_BANK_SPREAD:g}); its features carry no information")
    return f, p


class FreshRows:
    """The server's memory of the rows each site has shared, so that a row is forwarded once (issue 45).

    A receiver that gets the same row in two rounds links them (by value, or by how long a row stays), groups the
    rows of one sender by their lifetime, and averages independently perturbed copies.  The bundle's clients upload
    only the rows enqueued since their last upload (:meth:`FeatureBank.export_fresh`); this is the server's own
    check, for a client that re-sends its bank: a filled row whose value the site sent within its last ``history``
    rows is dropped.  Digests live in memory only, keyed by the site's name, and are forgotten with the run.
    """

    def __init__(self, history: int):
        self.history = int(history)
        self._seen: dict[str, dict[bytes, None]] = {}  # per site: digests in the order sent (an ordered set)

    def reset(self) -> None:
        self._seen.clear()

    def keep(self, site: str, features: np.ndarray, partitions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The filled rows of ``site``'s upload that it has not sent before (nor twice in this upload)."""
        seen = self._seen.setdefault(site, {})
        take = []
        for i in np.flatnonzero(partitions >= 0):
            key = hashlib.blake2b(features[i].tobytes(), digest_size=16).digest()
            if key not in seen:
                seen[key] = None
                take.append(i)
        for key in list(seen)[: max(0, len(seen) - self.history)]:
            del seen[key]
        take = np.asarray(take, dtype=np.int64)
        return features[take], partitions[take]


def remote_bank_for(
    banks: dict[str, tuple[np.ndarray, np.ndarray]], site: str, rows: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """The remote rows a site receives this round (equation (1) without Q_{l,c}): new arrays, no site names, each
    row a filled row (partition id >= 0) that another site shared this round, in a random order.

    As many as the site shared itself (its filled rows in ``banks``), at most ``rows`` (the job's K), and at
    most what the others shared together: a site gets back what it gives.  Sites that share alike therefore each
    receive exactly their own count, which tells them neither the number of sites nor how many rows the others
    shared; only when the others together shared fewer does the count show their total.  A site that shares
    nothing receives nothing (issue 45: free riding earned rows).  There is no padding: a padding row is known to
    be one (its partition id is -1), so padding would show the same totals.  ``rng`` must come from a secret the
    receiving site does not hold, so that it cannot undo the order.  The receiver keeps what it gets in a FIFO of
    its own (:meth:`FeatureBank.receive`).
    """
    dim = next(iter(banks.values()))[0].shape[1]
    pooled = [banks[name] for name in sorted(banks) if name != site]
    f = np.concatenate([b[0] for b in pooled], axis=0) if pooled else np.zeros((0, dim), np.float32)
    p = np.concatenate([b[1] for b in pooled], axis=0) if pooled else np.zeros((0,), np.int64)
    filled = p >= 0
    f, p = f[filled], p[filled]
    own = int(np.sum(banks[site][1] >= 0)) if site in banks else 0
    take = rng.permutation(f.shape[0])[: min(rows, own)]
    return f[take].astype(np.float32, copy=False), p[take].astype(np.int64, copy=False)
