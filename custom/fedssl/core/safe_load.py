"""Loading checkpoint files without executing code: ``torch.load(..., weights_only=True)``, with numpy arrays
allowed (FLARE model files and older state dicts hold them) and nothing else beyond torch's own allow-list."""

from __future__ import annotations

import numpy as np
import torch


def _numpy_globals() -> list:
    names = [np.ndarray, np.dtype, np._core.multiarray._reconstruct]
    names += [type(np.dtype(t)) for t in ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8",
                                          "bool")]
    names += [np._core.multiarray.scalar]
    return names


def safe_load(path: str, map_location: str | torch.device = "cpu"):
    """``torch.load`` with ``weights_only=True`` (tensors, containers, numpy arrays); any other pickled object is an
    ``UnpicklingError`` instead of code run on this machine."""
    with torch.serialization.safe_globals(_numpy_globals()):
        return torch.load(path, map_location=map_location, weights_only=True)
