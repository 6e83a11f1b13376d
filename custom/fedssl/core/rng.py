"""Owned global randomness: a trainer's hidden random draws come from its own seed and leave the process's state alone.

Explicit draws in the bundle take a generator the trainer owns (``torch.Generator``, ``np.random.Generator``).  Some
draws cannot: dropout (BERT in FedDRA, the DenseNet's head layer), drop path (timm's ViT blocks), the base seed a
DataLoader draws for its workers, and whatever a library draws from torch's, numpy's or Python's global generator.
Left on the global generators, these draws made two FedDRA runs of one seed end at a worst-client R@1 of 2.0 and 3.8
(issue 42), and they moved with anything else the process happened to draw.

:func:`owned_global_rng` runs a block with the three global generators seeded from one integer: torch's CPU
generator (and every CUDA device's once CUDA is in use), numpy's legacy global state and Python's ``random``.  On
exit, also when the block raises, it puts back what they held before.  A trainer runs each round, each epoch or each
evaluation inside it, with a seed from :func:`fedssl.core.seeds.derived_seed` of its own data seed (the site's) and
a key its state already holds (round index, epoch, step or task count).  So:

- the hidden draws of a round depend on (seed, site, key) only: two runs of one seed give bit-identical weights,
  and a client restarted from its checkpoint draws what the uninterrupted one would have;
- a round leaves the global generators as it found them, so neither the code around a trainer nor another trainer
  in the same process shifts, or is shifted by, its draws.

The global generators belong to the process: two trainers must not train in two threads of one process at once
(FLARE runs one client per process).
"""

from __future__ import annotations

import contextlib
import random
from typing import Iterator

import numpy as np
import torch


def _cuda_devices(device: torch.device | str | None) -> list[int]:
    """The CUDA devices whose generators a block may draw from: all of them when CUDA is in use in this process or
    ``device`` is a CUDA device, else none (forking them would start CUDA for a CPU trainer)."""
    if not torch.cuda.is_available():
        return []
    if torch.cuda.is_initialized() or (device is not None and torch.device(device).type == "cuda"):
        return list(range(torch.cuda.device_count()))
    return []


@contextlib.contextmanager
def owned_global_rng(seed: int, device: torch.device | str | None = None) -> Iterator[None]:
    """Run the block with torch's, numpy's and Python's global generators seeded from ``seed`` (an integer in
    [0, 2**32)), and restore their previous states on exit, even when the block raises.

    ``device``: the trainer's device.  A CUDA device (or CUDA already initialised in this process) forks and seeds
    every CUDA device's generator as well, since dropout on the GPU draws from it."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 32:
        raise ValueError(f"owned_global_rng: seed={seed!r} is not an integer in [0, 2**32); use "
                         "fedssl.core.seeds.derived_seed")
    cuda = _cuda_devices(device)
    numpy_state, python_state = np.random.get_state(), random.getstate()
    try:
        with torch.random.fork_rng(devices=cuda):
            torch.default_generator.manual_seed(seed)
            if cuda:
                torch.cuda.manual_seed_all(seed)
            np.random.seed(seed)
            random.seed(seed)
            yield
    finally:
        np.random.set_state(numpy_state)
        random.setstate(python_state)
