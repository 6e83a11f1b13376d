"""How far a pre-trained network's kernels are from a reference initialisation: scale and direction.

* Scale, ``||W|| / ||W_ref||``: with a normalisation after every convolution (the U-Net's instance norm),
  multiplying a kernel by ``r > 0`` leaves the network's function unchanged, but Adam moves every weight by about
  ``lr`` per step whatever its size, so a kernel ``r`` times larger changes ``r`` times more slowly, relative to its
  size, in fine-tuning.
* Direction, ``cos(W, W_ref)`` and ``||W - W_ref|| / ||W_ref||``: when the reference is the pre-training's own
  initial weights, how much pre-training changed the encoder at all (cosine 1, change 0: it is still its random
  initialisation).

:func:`compare_kernels` measures both per kernel; :func:`summarise` gives what the diagnostics print.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F


def compare_kernels(state: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor]) -> dict[str, dict]:
    """Per kernel (rank >= 2) that both state dicts hold with one shape: ``ratio`` (norm over the reference's),
    ``cosine`` (of the flattened kernels) and ``change`` (``||W - W_ref|| / ||W_ref||``)."""
    out = {}
    for name, w in state.items():
        ref = reference.get(name)
        if not isinstance(w, torch.Tensor) or w.dim() < 2 or ref is None or tuple(ref.shape) != tuple(w.shape):
            continue
        w, ref = w.detach().double().flatten(), ref.detach().double().flatten()
        ref_norm = float(ref.norm())
        if ref_norm == 0.0:
            raise ValueError(f"weight {name!r} of the reference is all zeros: no scale to compare against")
        out[name] = {"ratio": float(w.norm()) / ref_norm, "cosine": float(F.cosine_similarity(w, ref, dim=0)),
                     "change": float((w - ref).norm()) / ref_norm}
    if not out:
        raise ValueError("the two state dicts share no kernel (rank >= 2, same name and shape) to compare")
    return out


def summarise(kernels: Mapping[str, Mapping[str, float]]) -> dict:
    """Geometric mean, min and max of the norm ratios; mean cosine and mean relative change; the kernel count."""
    ratios = [k["ratio"] for k in kernels.values()]
    geo = math.exp(sum(math.log(v) for v in ratios) / len(ratios)) if all(v > 0 for v in ratios) else 0.0
    return {"geomean": geo, "min": min(ratios), "max": max(ratios), "n": len(ratios),
            "cosine": sum(k["cosine"] for k in kernels.values()) / len(ratios),
            "change": sum(k["change"] for k in kernels.values()) / len(ratios)}
