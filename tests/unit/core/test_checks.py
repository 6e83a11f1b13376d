"""The constructor-argument checks and a method's settings (one dataclass whose fields are a component's keyword
arguments): built and checked at once, unknown names refused naming them, the signature FLARE and the job checks see."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import pytest

from fedssl.core.checks import require, require_int, settings_from, settings_values, takes_settings


@dataclass(frozen=True)
class Toy:
    data_root: str = ""
    features: Sequence[int] = (4, 8)
    lr: float = 0.1
    seed: int = 0
    momentum: ClassVar[float] = 0.9  # a fixed constant: no argument

    def check(self, name: str) -> None:
        require(self.lr > 0, name, "lr", self.lr, "use a positive rate")
        require_int(name, "seed", self.seed, 0, "use a non-negative integer")


class Component:
    @takes_settings(Toy)
    def __init__(self, **args):
        self.settings = settings_from(type(self).__name__, Toy, args)


def test_settings_are_built_verbatim_and_checked_at_once():
    s = settings_from("Comp", Toy, {"lr": 0.5, "features": [1, 2]})
    assert s == Toy(lr=0.5, features=[1, 2]) and settings_values(s) == {"data_root": "", "features": [1, 2],
                                                                         "lr": 0.5, "seed": 0}
    assert settings_values(s)["features"] is s.features  # stored verbatim, not copied
    with pytest.raises(ValueError, match=r"^Comp: argument lr=0 is invalid; use a positive rate$"):
        settings_from("Comp", Toy, {"lr": 0})
    with pytest.raises(ValueError, match=r"^Component: argument seed=-1 is invalid"):
        Component(seed=-1)


def test_unknown_names_are_refused_naming_them_and_the_accepted_ones():
    with pytest.raises(TypeError, match=r"^Comp: unknown argument lrr; it accepts data_root, features, lr, seed$"):
        settings_from("Comp", Toy, {"lrr": 1})
    with pytest.raises(TypeError, match=r"^Component: unknown arguments momentum, sead; it accepts"):
        Component(sead=1, momentum=0.5)  # a class constant is no argument either


def test_the_signature_is_the_fields_with_defaults_and_types():
    params = inspect.signature(Component).parameters
    assert list(params) == ["data_root", "features", "lr", "seed"]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params.values())
    assert {k: p.default for k, p in params.items()} == {"data_root": "", "features": (4, 8), "lr": 0.1, "seed": 0}
    assert typing.get_type_hints(Component.__init__) == {"data_root": str, "features": Sequence[int], "lr": float,
                                                         "seed": int}
    inspect.signature(Component).bind(lr=0.2, seed=1)  # what the job checks do with a job's args
    with pytest.raises(TypeError):
        inspect.signature(Component).bind(lrr=0.2)
    assert Component(lr=0.2).settings.lr == 0.2
