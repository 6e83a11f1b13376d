"""Feature spread: how far apart a batch of representations lies on the unit sphere (issue 14 item 4).

The spread of ``z [B, D]`` is the standard deviation over the batch of each dimension of the L2-normalised rows,
averaged over the dimensions (Chen & He, SimSiam, 2021, sec. 4.1: the std of the l2-normalised output,
"collapse" when it is 0).  A collapsed encoder, mapping every input to one direction, gives 0; features spread
uniformly on the sphere give about ``1 / sqrt(D)`` (each coordinate then has variance 1 / D).  The population
std (divide by B) is used, so a single row or identical rows give exactly 0.

Here (core) because the pre-training trainers report it per round; :mod:`fedssl.eval.features` adds the
``1 / sqrt(D)`` reference and the helpers that measure an encoder on a site's data.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def normalised_spread(z: torch.Tensor) -> float:
    """Mean over dimensions of the batch std of the L2-normalised rows of ``z [B, D]`` (0 = collapsed)."""
    if z.dim() != 2 or z.shape[0] < 1 or z.shape[1] < 1:
        raise ValueError(f"feature spread needs a batch of feature vectors [B, D], got shape {tuple(z.shape)}")
    u = F.normalize(z.detach().float(), dim=1)
    return float(u.std(dim=0, unbiased=False).mean())


def uniform_reference(dim: int) -> float:
    """``1 / sqrt(D)``: the spread of features spread uniformly on the unit sphere of dimension ``D``."""
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise ValueError(f"dim={dim!r}: a feature dimension must be a positive integer")
    return 1.0 / math.sqrt(dim)


class SpreadMeter:
    """The mean spread over a round's steps: ``add(z)`` per step, ``mean`` at the end (None before any step)."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def add(self, z: torch.Tensor) -> None:
        self.values.append(normalised_spread(z))

    @property
    def mean(self) -> float | None:
        return sum(self.values) / len(self.values) if self.values else None
