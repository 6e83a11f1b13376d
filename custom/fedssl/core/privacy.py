"""Perturbation of shared representations before they leave a site (FCL (Wu et al., MedIA 2022) section 3.4).

FCL shares momentum features.  Section 3.4 points to representation perturbation (Sun et al. 2021) as a
protection: here each shared feature gets isotropic Gaussian noise and is projected back to the unit
sphere, so it keeps the form the receiving sites expect (an L2-normalised vector).
"""

from __future__ import annotations

import numpy as np


def perturb_features(features: np.ndarray, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """normalise(f + N(0, sigma^2 I)) for every row of ``features [K, D]``; a new array."""
    if not sigma > 0:
        raise ValueError(f"sigma={sigma!r}: must be > 0 (no perturbation would let the features through unchanged)")
    f = np.asarray(features, dtype=np.float32)
    noisy = f + rng.normal(0.0, sigma, size=f.shape).astype(np.float32)
    norms = np.linalg.norm(noisy, axis=1, keepdims=True)
    return noisy / np.maximum(norms, 1e-12)
