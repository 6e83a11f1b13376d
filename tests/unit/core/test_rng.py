"""owned_global_rng (fedssl.core.rng): the block draws from its seed on torch's, numpy's and Python's global generators,
and each is put back as it was on exit, also after an exception and around a nested block."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from fedssl.core import rng
from fedssl.core.rng import owned_global_rng


def draws() -> tuple:
    return torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]


def states() -> tuple:
    t, (kind, keys, pos, gauss, cached), p = torch.get_rng_state(), np.random.get_state(), random.getstate()
    return t.tolist(), (kind, keys.tolist(), pos, gauss, cached), p


def scramble(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def test_the_block_draws_from_its_seed_whatever_the_global_state_and_leaves_it_as_it_was():
    scramble(1)
    before = states()
    with owned_global_rng(7):
        first = draws()
    assert states() == before
    scramble(2)
    with owned_global_rng(7):
        assert draws() == first  # the same seed: the same draws on all three generators
    with owned_global_rng(8):
        other = draws()
    assert all(a != b for a, b in zip(first, other))


def test_the_state_is_put_back_after_an_exception():
    scramble(3)
    before = states()
    with pytest.raises(KeyError):
        with owned_global_rng(7):
            draws()
            raise KeyError("inside the block")
    assert states() == before


def test_a_nested_block_leaves_the_outer_blocks_sequence_alone():
    with owned_global_rng(5):
        alone = [draws(), draws()]
    with owned_global_rng(5):
        nested = [draws()]
        with owned_global_rng(6):
            draws()
        nested.append(draws())
    assert nested == alone


@pytest.mark.parametrize("seed", [-1, 2 ** 32, True, 1.5, "7"])
def test_a_seed_outside_what_all_three_accept_is_refused(seed):
    with pytest.raises(ValueError, match="owned_global_rng: seed="):
        with owned_global_rng(seed):
            pass


def test_cuda_generators_are_forked_only_when_cuda_is_in_use(monkeypatch):
    """A CPU trainer does not start CUDA; a CUDA trainer, or a process that already uses CUDA, forks every device."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert rng._cuda_devices("cuda:0") == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert rng._cuda_devices("cpu") == [] and rng._cuda_devices(None) == []
    assert rng._cuda_devices("cuda:1") == [0, 1] and rng._cuda_devices(torch.device("cuda")) == [0, 1]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert rng._cuda_devices("cpu") == [0, 1]


def test_the_forked_cuda_devices_are_seeded_and_restored(monkeypatch):
    """With CUDA in use the block forks the devices' generators (torch.random.fork_rng) and seeds them all."""
    forked, seeded = [], []
    monkeypatch.setattr(rng, "_cuda_devices", lambda device: [0, 1])

    class Fork:
        def __init__(self, devices):
            forked.append(list(devices))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.random, "fork_rng", lambda devices: Fork(devices))
    monkeypatch.setattr(torch.cuda, "manual_seed_all", seeded.append)
    monkeypatch.setattr(torch, "default_generator", torch.Generator())  # the fake fork restores nothing
    with owned_global_rng(11, "cuda"):
        pass
    assert forked == [[0, 1]] and seeded == [11]
