"""Local memory bank of momentum features with partition ids, and FCL negative sampling.

FCL (Wu et al., MedIA 2022) section 3.2: each client keeps a size-K FIFO bank Q_{l,c} of momentum features
("progressively updated by replacing the oldest features with the latest ones"); with feature exchange (FE) it also
holds the banks of the other clients, Q = Q_{l,c} U {Q_{l,i}, i != c} (1); negative sampling (NS) draws a
size-K subset Q' of Q uniformly (2).
"""

from __future__ import annotations

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

    def state_dict(self) -> dict:
        return {"features": self.features.clone(), "partitions": self.partitions.clone(), "ptr": self.ptr,
                "filled": self.filled}

    def load_state_dict(self, state: dict) -> None:
        feats, parts = torch.as_tensor(state["features"]), torch.as_tensor(state["partitions"])
        if tuple(feats.shape) != tuple(self.features.shape):
            raise ValueError(f"bank checkpoint has shape {tuple(feats.shape)}, expected {tuple(self.features.shape)}")
        self.features = feats.float().clone()
        self.partitions = parts.long().clone()
        self.ptr, self.filled = int(state["ptr"]), int(state["filled"])

    def export(self) -> tuple[np.ndarray, np.ndarray]:
        """What a client uploads for feature exchange: float32 ``[K, D]`` features and int64 ``[K]`` partitions."""
        return self.features.numpy().astype(np.float32, copy=True), self.partitions.numpy().astype(np.int64, copy=True)


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
    job's K), finite, every row of unit norm within ``UNIT_NORM_TOL``, partition ids in ``[-1, n_partitions)``
    (-1 marks a bank slot not yet filled), and, with 4 or more filled rows, not degenerate: at least half of them
    distinct and a feature spread of at least :data:`MIN_BANK_SPREAD`.  ContributionError names the site otherwise.
    """
    f = cast_array(features, np.float32, "its feature bank", site)
    if f.ndim != 2 or f.shape[1] != dim or not 0 < f.shape[0] <= max_rows:
        raise ContributionError(f"{site} sent a feature bank of shape {f.shape}; expected [K, {dim}] with 1 <= K <= "
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


def remote_bank_for(
    banks: dict[str, tuple[np.ndarray, np.ndarray]], site: str, rows: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """The remote bank a site receives (equation (1) without Q_{l,c}): exactly ``rows`` features, new arrays,
    no site names, whatever the number of other sites and however full their banks are.

    The filled entries (partition id >= 0) of every *other* site are pooled; ``rows`` of them are drawn without
    replacement in a random order; while the pool is smaller than ``rows`` the rest is random unit vectors
    with partition id -1, exactly what an unfilled bank slot holds (negatives, never positives).  ``rng``
    must come from a secret the receiving site does not hold, so that it cannot undo the order.

    A site receives at most ``N - 1`` real rows for every filled row it shared itself this round (the rest is
    padding): honest sites, which fill alike, are not limited; a site that marks its bank unfilled receives
    nothing real (issue 45: it received twice as many real rows as the honest ones).
    """
    dim = next(iter(banks.values()))[0].shape[1]
    pooled = [banks[name] for name in sorted(banks) if name != site]
    f = np.concatenate([b[0] for b in pooled], axis=0) if pooled else np.zeros((0, dim), np.float32)
    p = np.concatenate([b[1] for b in pooled], axis=0) if pooled else np.zeros((0,), np.int64)
    filled = p >= 0
    f, p = f[filled], p[filled]
    own = int(np.sum(banks[site][1] >= 0)) if site in banks else 0
    rows_real = min(rows, own * len(pooled))
    take = rng.permutation(f.shape[0])[:rows_real]
    f, p = f[take], p[take]
    pad = rows - f.shape[0]
    if pad > 0:
        noise = rng.standard_normal((pad, dim))
        noise /= np.maximum(np.linalg.norm(noise, axis=1, keepdims=True), 1e-12)
        f = np.concatenate([f, noise.astype(np.float32)], axis=0)
        p = np.concatenate([p, np.full(pad, -1, np.int64)], axis=0)
        order = rng.permutation(rows)
        f, p = f[order], p[order]
    return f.astype(np.float32, copy=False), p.astype(np.int64, copy=False)
