"""Local memory bank of momentum features with partition ids, and FCL negative sampling.

FCL (Wu et al., MedIA 2022) section 3.2: each client keeps a size-K FIFO bank Q_{l,c} of momentum features ("progressively
updated by replacing the oldest features with the latest ones"); with feature exchange (FE) it also holds
the banks of the other clients, Q = Q_{l,c} U {Q_{l,i}, i != c} (1); negative sampling (NS) draws a
size-K subset Q' of Q uniformly (2).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


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
            raise ValueError(f"enqueue expects feats [n, {self.dim}] and parts [n]; got {tuple(feats.shape)}, {tuple(parts.shape)}")
        if n > self.capacity:
            feats, parts, n = feats[-self.capacity :], parts[-self.capacity :], self.capacity
        idx = (self.ptr + torch.arange(n)) % self.capacity
        self.features[idx] = feats.detach().to(self.features)
        self.partitions[idx] = parts.detach().to(self.partitions)
        self.ptr = int((self.ptr + n) % self.capacity)
        self.filled = min(self.capacity, self.filled + n)

    def state_dict(self) -> dict:
        return {"features": self.features.clone(), "partitions": self.partitions.clone(), "ptr": self.ptr, "filled": self.filled}

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


def check_bank(features: object, partitions: object, site: str, dim: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Validate an uploaded bank before it is shuttled to other sites; returns float32/int64 arrays."""
    f, p = np.asarray(features), np.asarray(partitions)
    if f.ndim != 2 or f.dtype.kind != "f" or (dim is not None and f.shape[1] != dim):
        raise ValueError(f"{site} sent a feature bank of shape {f.shape} dtype {f.dtype}; expected float [K, {dim or 'D'}]")
    if p.shape != (f.shape[0],) or p.dtype.kind not in "iu":
        raise ValueError(f"{site} sent bank partitions of shape {p.shape} dtype {p.dtype}; expected int [{f.shape[0]}]")
    if not np.all(np.isfinite(f)):
        raise ValueError(f"{site} sent non-finite values in its feature bank; contribution rejected")
    return f.astype(np.float32, copy=False), p.astype(np.int64, copy=False)


def remote_bank_for(
    banks: dict[str, tuple[np.ndarray, np.ndarray]], site: str, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """The remote bank a site receives: the banks of all *other* sites, concatenated and shuffled
    (equation (1) without Q_{l,c}); new arrays, no site names.  Empty ``[0, D]`` if there is no other site."""
    others = [banks[name] for name in sorted(banks) if name != site]
    if not others:
        dim = next(iter(banks.values()))[0].shape[1] if banks else 0
        return np.zeros((0, dim), np.float32), np.zeros((0,), np.int64)
    f = np.concatenate([b[0] for b in others], axis=0)
    p = np.concatenate([b[1] for b in others], axis=0)
    order = rng.permutation(f.shape[0])
    return f[order], p[order]
