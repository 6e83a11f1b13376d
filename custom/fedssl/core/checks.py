"""Constructor-argument checks shared by every component (FLARE or not): one message naming argument, value and fix;
and a method's settings, one dataclass whose fields are a component's keyword arguments (:func:`settings_from`,
:func:`takes_settings`)."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import Any, Callable, Mapping


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


# ---------------------------------------------------------------------------------------------- a method's settings
def settings_values(settings: object) -> dict[str, Any]:
    """Field name -> value of a settings dataclass, the values themselves (no copy: stored verbatim)."""
    return {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}


def settings_from(component: str, settings_class: type, args: Mapping[str, Any]) -> Any:
    """The settings dataclass of a method built from a component's keyword arguments and checked at once: a name
    that is not one of its fields (a typo in the job's JSON) is a TypeError, as Python's for an unexpected keyword
    argument, with one message naming it and listing the accepted ones; then ``settings.check(component)`` refuses a
    bad value (ValueError) naming argument, value and fix."""
    names = [f.name for f in dataclasses.fields(settings_class)]
    unknown = sorted(set(args) - set(names))
    if unknown:
        raise TypeError(f"{component}: unknown argument{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(unknown)}; it accepts {', '.join(sorted(names))}")
    settings = settings_class(**args)
    settings.check(component)
    return settings


def takes_settings(settings_class: type) -> Callable[[Callable], Callable]:
    """Decorator of a component's ``__init__(self, **args)`` whose arguments are the fields of ``settings_class``:
    the signature (and the annotations) it shows are the fields as keyword arguments with their defaults and types,
    so FLARE's JSON, ``inspect.signature`` and the job and profile checks see the argument names as if written out
    while the settings are declared once, in the dataclass."""
    hints = typing.get_type_hints(settings_class)
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for f in dataclasses.fields(settings_class):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                        annotation=hints[f.name]))

    def decorate(init: Callable) -> Callable:
        init.__signature__ = inspect.Signature(params)
        init.__annotations__ = {p.name: p.annotation for p in params[1:]}
        return init

    return decorate
