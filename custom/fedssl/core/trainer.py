"""The local-trainer seam: what every site-side training method offers the FLARE glue (torch only).

A :class:`LocalTrainer` is built from a site's data and the method's settings and holds everything that
trains on the site (model, optimiser, banks, generators).  The one FLARE executor
(``fedssl.flare.trainer_executor.TrainerExecutor``) runs the round protocol around it:

    load_global(received)  ->  train_round(round_idx, should_stop)  ->  state_dict() to the checkpoint
                           ->  global_state() + RoundStats to the server

This is the seam MONAI's ``ClientAlgo`` (``train`` / ``get_weights`` / ``evaluate``) and NVFlare's
``Learner`` draw; a method that fits it needs no FLARE code beyond building its trainer.

- ``train_round`` calls ``should_stop()`` between optimiser steps and raises :class:`StopRequested` when it
  returns True (FLARE's abort signal), so an abort stops within one step;
- ``state_dict`` / ``load_state_dict``: the local state that must survive a restart (optimiser, banks, RNG,
  tensors kept local); ``global_state`` / ``load_global``: what is exchanged with the server;
- :func:`load_checked` is the one loader of received tensors: it names missing and unexpected keys and
  shape mismatches, casts to the model's dtypes, and keeps local exactly the keys it is told to;
- :func:`check_optimizer_state`: a saved optimiser state fits the optimiser (torch checks only the number of
  parameters per group, so another model's state would load and fail at the first step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np
import torch


class StopRequested(Exception):
    """Raised from inside a training loop when ``should_stop()`` says so (FLARE's abort signal)."""


def check_stop(should_stop: Callable[[], bool] | None) -> None:
    if should_stop is not None and should_stop():
        raise StopRequested()


def stoppable(items: Iterable, should_stop: Callable[[], bool] | None) -> Iterator:
    """Yield from ``items``, checking ``should_stop`` before each item (i.e. before each optimiser step)."""
    for item in items:
        check_stop(should_stop)
        yield item


@dataclass
class RoundStats:
    """What one local round produced: the mean loss, optimiser steps, the sample count the server weights by,
    and named metrics (loss terms, learning rate, validation metrics, throughput, ...)."""

    loss: float
    steps: int
    samples: int
    metrics: dict[str, Any] = field(default_factory=dict)
    #: optional per-step records (e.g. ``{"loss": .., "lr": ..}``), streamed as curves with a global step
    curve: list[dict[str, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.loss = float(self.loss)
        self.steps = int(self.steps)
        self.samples = int(self.samples)

    def record(self) -> dict[str, Any]:
        """A flat JSON-able record: loss, steps, num_samples and every named metric."""
        return {"loss": self.loss, "steps": self.steps, "num_samples": self.samples, **self.metrics}

    def scalars(self) -> dict[str, float]:
        """The finite numeric entries of :meth:`record` (what goes to TensorBoard)."""
        out = {}
        for k, v in self.record().items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                out[k] = float(v)
        return out


@runtime_checkable
class LocalTrainer(Protocol):
    """What a site-side method offers the round protocol (see the module docstring)."""

    def train_round(self, round_idx: int, should_stop: Callable[[], bool]) -> RoundStats: ...

    def evaluate(self, split: str = "val") -> dict[str, Any]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...

    def global_state(self) -> dict[str, torch.Tensor]: ...

    def load_global(self, state: Mapping[str, Any], keep_local: Sequence[str] = ()) -> list[str]: ...


def amp_dtype(device: torch.device, amp: bool) -> torch.dtype | None:
    """The autocast dtype of a trainer's ``amp`` switch on ``device``: bfloat16 on GPUs that support it, float16
    (with a gradient scaler) on older GPUs, None (float32) on a CPU or with ``amp`` off."""
    if not amp or torch.device(device).type != "cuda":
        return None
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


class MixedPrecision:
    """A trainer's ``amp`` switch as one object: the autocast context of its forward passes and the optimiser step
    that goes with it (a gradient scaler for float16; bfloat16 needs none).

    ``dtype`` None (a CPU, or ``amp`` off) makes both plain float32: :meth:`autocast` is disabled and :meth:`step`
    is ``backward`` + ``optimizer.step``.  ``force`` sets the autocast dtype whatever the device (tests run the
    bfloat16 path on a CPU with it).  Losses and anything kept across steps (banks, EMA targets, metrics) should be
    taken out of the context in float32: ``.float()``.
    """

    def __init__(self, device: torch.device | str, amp: bool, force: torch.dtype | None = None) -> None:
        self.device = torch.device(device)
        self.dtype = force if force is not None else amp_dtype(self.device, amp)
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.dtype == torch.float16 and self.device.type == "cuda")

    @property
    def enabled(self) -> bool:
        return self.dtype is not None

    def autocast(self):
        return torch.autocast(device_type=self.device.type, dtype=self.dtype or torch.bfloat16, enabled=self.enabled)

    def step(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer, clip_grad: float | None = None,
             parameters: Iterable[torch.nn.Parameter] | None = None) -> None:
        """zero_grad, backward, optional gradient-norm clipping of ``parameters`` (after unscaling), step."""
        optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        if clip_grad is not None:
            self.scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(list(parameters) if parameters is not None else
                                           [p for g in optimizer.param_groups for p in g["params"]], clip_grad)
        self.scaler.step(optimizer)
        self.scaler.update()


def as_tensor(value: object) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))


def load_checked(model: torch.nn.Module, state: Mapping[str, object], source: str,
                 keep_local: Sequence[str] | bool = ()) -> list[str]:
    """Load ``state`` (tensors or arrays) into ``model``; return the model keys kept local (sorted).

    ``keep_local``: the keys ``state`` may lack (they keep the model's values); ``True`` = any key may be
    missing (a partial update).  A key the model lacks, a missing key not in ``keep_local`` or a shape
    mismatch is a ValueError naming ``source``, the keys and the fix.  Values are cast to the dtype of the
    model's tensor.
    """
    own = model.state_dict()
    unexpected = sorted(set(state) - set(own))
    if unexpected:
        raise ValueError(f"{source} has {len(unexpected)} keys this model does not have (e.g. {unexpected[:3]}); "
                         "the site and the server must run the same model configuration")
    missing = sorted(set(own) - set(state))
    if keep_local is not True:
        undeclared = sorted(set(missing) - set(keep_local or ()))
        if undeclared:
            raise ValueError(f"{source} lacks {len(undeclared)} keys of this model (e.g. {undeclared[:3]}) that no "
                             "exclusion filter held back; the site and the server must run the same model "
                             "configuration")
    tensors = {}
    for k, v in state.items():
        t = as_tensor(v)
        if tuple(t.shape) != tuple(own[k].shape):
            raise ValueError(f"{source}: {k} has shape {tuple(t.shape)}, this model expects {tuple(own[k].shape)}; "
                             "the site and the server must run the same model configuration")
        tensors[k] = t.to(own[k].dtype)
    model.load_state_dict(tensors, strict=False)
    return missing


def check_optimizer_state(optimizer: torch.optim.Optimizer, state: object, source: str) -> None:
    """ValueError naming ``source`` unless ``state`` is an optimiser state dict for ``optimizer``: as many groups
    and parameters per group, and every per-parameter tensor (momentum, Adam moments) of its parameter's shape."""
    groups = state.get("param_groups") if isinstance(state, Mapping) else None
    per_param = state.get("state") if isinstance(state, Mapping) else None
    if not isinstance(groups, list) or not isinstance(per_param, Mapping):
        raise ValueError(f"{source}: the optimiser state is not an optimiser state dict")
    own = [len(g["params"]) for g in optimizer.param_groups]
    saved = [len(g.get("params", ())) if isinstance(g, Mapping) else -1 for g in groups]
    if saved != own:
        raise ValueError(f"{source}: the optimiser state has parameter groups of sizes {saved}, this model {own}")
    for group, mine in zip(groups, optimizer.param_groups):
        for pid, param in zip(group["params"], mine["params"]):
            entry = per_param.get(pid, {})
            for name, value in (entry.items() if isinstance(entry, Mapping) else ()):
                if isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) != tuple(param.shape):
                    raise ValueError(f"{source}: the optimiser's {name} of parameter {pid} has shape "
                                     f"{tuple(value.shape)}, this model's parameter {tuple(param.shape)}")


def detached(state: Mapping[str, torch.Tensor], keys: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """CPU copies of ``state``'s tensors (of ``keys`` only when given): no alias of live parameters."""
    names = list(state) if keys is None else list(keys)
    return {k: state[k].detach().cpu().clone() for k in names}
