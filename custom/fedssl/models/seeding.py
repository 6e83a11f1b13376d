"""Seeded initial weights for every model of the registry."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def seeded(seed: int | None):
    """Initial weights drawn from ``seed`` (None: the global RNG), leaving the global RNG untouched, so the
    server's initial global model is the same in every run."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        yield
