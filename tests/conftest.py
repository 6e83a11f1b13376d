"""Shared pytest configuration: keep unit tests single-threaded so they are fast and reproducible."""

import torch

torch.set_num_threads(1)


import pytest  # noqa: E402


@pytest.fixture
def loader_workers(monkeypatch):
    """The ``num_workers`` of every DataLoader that :func:`fedssl.data.loading.load_batches` builds (a list that
    grows as they are built), so a test can see that a trainer's ``workers`` reached its batches."""
    from fedssl.data import loading

    seen: list[int] = []
    real = loading.DataLoader

    def spy(*args, **kwargs):
        seen.append(kwargs["num_workers"])
        return real(*args, **kwargs)

    monkeypatch.setattr(loading, "DataLoader", spy)
    return seen
