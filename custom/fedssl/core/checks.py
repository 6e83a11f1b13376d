"""Constructor-argument checks shared by every component (FLARE or not): one message naming argument, value and fix."""

from __future__ import annotations


def require(ok: bool, component: str, arg: str, value: object, fix: str) -> None:
    if not ok:
        raise ValueError(f"{component}: argument {arg}={value!r} is invalid; {fix}")


def require_choice(component: str, arg: str, value: object, choices: tuple) -> None:
    require(value in choices, component, arg, value, f"use one of {list(choices)}")


def require_int(component: str, arg: str, value: object, minimum: int, fix: str) -> None:
    require(isinstance(value, int) and not isinstance(value, bool) and value >= minimum, component, arg, value, fix)



def require_amp(name: str, amp: object) -> None:
    """A trainer's ``amp`` switch (:class:`fedssl.core.trainer.MixedPrecision`) is true or false."""
    require(isinstance(amp, bool), name, "amp", amp, "use true or false (true: bfloat16 autocast on GPUs that "
            "support it, float16 with a gradient scaler on older ones, no effect on a CPU; false: float32)")


WORKERS_FIX = ("use 0 (build the batches in the training process) or a positive number of DataLoader worker "
               "processes (the batches are the same either way; on a GPU site e.g. 4)")


def require_workers(name: str, workers: object) -> None:
    """A trainer's ``workers`` switch (:func:`fedssl.data.loading.load_batches`) is an int >= 0."""
    require_int(name, "workers", workers, 0, WORKERS_FIX)
