"""Module-level cells for the worker-process tests of fedssl.experiments.table_runner: a light module (no torch),
so spawned workers start fast."""

import time


def sleep_or_fail(key: dict) -> int:
    """Sleep ``key["sleep"]`` seconds and return ``key["n"]``; raise when ``key["fail"]`` is set."""
    if key.get("fail"):
        raise KeyError(f"cell n={key['n']} fails on purpose")
    time.sleep(key.get("sleep", 0.0))
    return key["n"]


def torch_threads(key: dict) -> int:
    """The torch thread count of the process computing the cell (torch is imported by the worker's start already)."""
    import torch

    return torch.get_num_threads()
