"""Base class of the bundle's client executors: per-task dispatch, site paths, checkpoints, metrics, errors.

Subclasses implement ``train(shareable, fl_ctx, abort_signal) -> Shareable`` (and optionally other tasks
listed in ``task_handlers``).  Everything a site must keep across a client restart (banks, momentum
encoder, optimiser) is checkpointed in the job's run folder of the site workspace, so a simulator
restart (``-t`` < ``-n``) or a real one resumes where it left off.

A checkpoint that is there but cannot be resumed (empty, truncated, not a client state, a pickle payload, or
written by another method / model) is a :class:`CheckpointError`: the task fails on that site with one line
naming the file and what to do, every time, and the file is never read past, replaced or deleted: losing a
site's bank or optimiser silently would change the run without anyone knowing.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.executor import Executor
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable, make_reply
from nvflare.apis.signal import Signal
from nvflare.app_common.app_constant import AppConstants

from fedssl.core.safe_load import UnreadableFile, safe_load
from fedssl.core.trainer import StopRequested
from fedssl.data.site_config import resolve_data_root


class TaskAborted(Exception):
    """Raised from a training loop when FLARE's abort signal fires."""


class CheckpointError(ValueError):
    """A site's checkpoint that exists but cannot be resumed; the message names the site, the file, why, and what
    to do.  A ValueError, so :meth:`SiteExecutor.execute` fails the task with that one line."""

    def __init__(self, site: str, path: str, problem: str):
        self.site, self.path, self.problem = site, path, problem
        super().__init__(f"{site}: checkpoint {path} {problem}; delete it to start {site} from the global model, or "
                         "restore it from a backup (it was left as it is)")


#: checkpoint key: the class name of the trainer that wrote it (a file of another method is named as such)
TRAINER_CLASS_KEY = "trainer_class"


def _is_round(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class SiteExecutor(Executor):
    #: task name -> method name
    task_handlers: dict[str, str] = {"train": "train"}
    checkpoint_name = "client_state.pt"
    metrics_name = "client_metrics.jsonl"

    def site_name(self, fl_ctx: FLContext) -> str:
        return fl_ctx.get_identity_name()

    def run_dir(self, fl_ctx: FLContext) -> str:
        return fl_ctx.get_engine().get_workspace().get_run_dir(fl_ctx.get_job_id())

    def resolve_root(self, arg: str, fl_ctx: FLContext) -> str:
        ws = fl_ctx.get_engine().get_workspace()
        return resolve_data_root(arg, self.site_name(fl_ctx), ws.get_site_config_dir())

    def checkpoint_path(self, fl_ctx: FLContext) -> str:
        return os.path.join(self.run_dir(fl_ctx), self.checkpoint_name)

    def save_checkpoint(self, fl_ctx: FLContext, state: dict) -> None:
        path = self.checkpoint_path(fl_ctx)
        tmp = path + ".tmp"
        torch.save(state, tmp)
        os.replace(tmp, path)  # atomic: a crash mid-save never leaves a half-written checkpoint

    def load_checkpoint(self, fl_ctx: FLContext) -> dict | None:
        """The site's client state ``{"round": int, "trainer": dict, ...}``, or None when there is no file (a
        fresh start); :class:`CheckpointError` for a file that is there but unreadable or not a client state."""
        path = self.checkpoint_path(fl_ctx)
        if not os.path.lexists(path):
            return None
        try:
            state = safe_load(path)
        except UnreadableFile as e:
            raise CheckpointError(self.site_name(fl_ctx), path, e.problem) from None
        if not (isinstance(state, dict) and _is_round(state.get("round")) and isinstance(state.get("trainer"), dict)):
            found = sorted(map(str, state))[:5] if isinstance(state, dict) else type(state).__name__
            raise CheckpointError(self.site_name(fl_ctx), path, "is not a client state of this bundle (expected "
                                  f"{{'round': int >= 0, 'trainer': {{...}}}}, found {found})")
        return state

    def resume(self, trainer: Any, state: dict, fl_ctx: FLContext) -> None:
        """Load a checkpoint into a freshly built trainer; anything that does not fit (keys, shapes, another
        trainer's state) is a CheckpointError naming the file."""
        path, writer = self.checkpoint_path(fl_ctx), state.get(TRAINER_CLASS_KEY, type(trainer).__name__)
        try:
            if writer != type(trainer).__name__:
                raise ValueError(f"it was written by a {writer}")
            trainer.load_state_dict(state["trainer"])
        except Exception as e:  # noqa: BLE001 - KeyError, RuntimeError, ValueError ...: all mean "foreign"
            reason = " ".join(f"{type(e).__name__}: {e}".split())[:300]
            raise CheckpointError(self.site_name(fl_ctx), path, f"does not fit this site's {type(trainer).__name__} "
                                  f"({reason}); it was written by another method or model configuration") from None
        self.last_round = int(state["round"])
        self.log_info(fl_ctx, f"resumed client state from round {self.last_round} ({path})")

    def received_weights(self, shareable: Shareable, fl_ctx: FLContext, task: str = "train") -> DXO:
        dxo = from_shareable(shareable)
        if dxo.data_kind != DataKind.WEIGHTS:
            raise ValueError(f"{self.site_name(fl_ctx)}: the {task} task carries {dxo.data_kind}, expected "
                             f"{DataKind.WEIGHTS}")
        return dxo

    def append_metrics(self, fl_ctx: FLContext, record: dict) -> None:
        record = {"time": time.time(), "site": self.site_name(fl_ctx), **record}
        with open(os.path.join(self.run_dir(fl_ctx), self.metrics_name), "a") as f:
            f.write(json.dumps(record) + "\n")

    def execute(self, task_name: str, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        handler = self.task_handlers.get(task_name)
        if handler is None:
            self.log_error(fl_ctx, f"{type(self).__name__}: no task {task_name!r}; runs {sorted(self.task_handlers)}")
            return make_reply(ReturnCode.TASK_UNKNOWN)
        try:
            reply = getattr(self, handler)(shareable, fl_ctx, abort_signal)
        except (TaskAborted, StopRequested):  # FLARE's abort signal, seen inside a training loop
            self.log_info(fl_ctx, f"task {task_name} aborted")
            return make_reply(ReturnCode.TASK_ABORTED)
        except (ValueError, OSError, FloatingPointError) as e:
            # data, configuration and numerical problems: one clear line naming site and cause
            self.log_error(fl_ctx, f"{self.site_name(fl_ctx)}: task {task_name} failed: {e}")
            return make_reply(ReturnCode.EXECUTION_EXCEPTION)
        # the round travels with the result, so task-result filters on this site (which run before FLARE
        # copies the task's cookies over) know which round it is and whether it is the last one
        for key in (AppConstants.CURRENT_ROUND, AppConstants.NUM_ROUNDS):
            if shareable.get_header(key) is not None and reply.get_header(key) is None:
                reply.set_header(key, shareable.get_header(key))
        return reply
