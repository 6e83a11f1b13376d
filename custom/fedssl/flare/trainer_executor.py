"""The one client executor round protocol, run for every :class:`fedssl.core.trainer.LocalTrainer`.

Task ``train`` (every method):

1. read the round headers (``current_round``, ``num_rounds``);
2. build the trainer once (``build_trainer``) and resume it from the site's checkpoint in the run folder
   (a restarted client goes on where it stopped); a checkpoint that is there but unreadable, not a client
   state, or written by another trainer / model fails the task on this site with one line naming the file,
   every round, and is never overwritten: the trainer is kept only once it resumed;
3. unwrap the received DXO (must be WEIGHTS) and hand it to ``receive`` (default: the trainer's checked
   ``load_global``, keeping local exactly the keys a server-side exclusion filter declared in the meta);
4. ``trainer.train_round(round_idx, should_stop)`` with ``should_stop`` = FLARE's abort signal, checked
   between optimiser steps (an abort returns TASK_ABORTED within one step);
5. checkpoint atomically, append the round's record to the site's metrics file and stream its scalars
   (loss and its terms, lr, throughput, validation metrics) through FLARE's analytics path
   (client ``TBWriter`` -> ``ConvertToFedEvent`` -> server ``TBAnalyticsReceiver``), so one TensorBoard
   on the server's run folder shows every site;
6. pack the result: ``global_state()`` (minus what the method keeps local) with ``num_samples``,
   ``NUM_STEPS_CURRENT_ROUND`` and ``loss`` in the meta, plus the method's extra meta.

A method executor = argument checks + ``build_trainer`` + hooks for its extra tasks.
"""

from __future__ import annotations

import math
import time
from abc import abstractmethod
from typing import Any

from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.apis.signal import Signal
from nvflare.app_common.app_constant import AppConstants

from fedssl.core.trainer import LocalTrainer, RoundStats
from fedssl.flare.constants import EXCLUDED_META
from fedssl.flare.site_executor import CheckpointError, SiteExecutor


#: checkpoint key: the class name of the trainer that wrote it (a file of another method is named as such)
TRAINER_CLASS_KEY = "trainer_class"


def round_headers(shareable: Shareable) -> tuple[int, int]:
    """(round index, number of rounds) from the task headers (0 and 1 when the workflow sets none)."""
    return (int(shareable.get_header(AppConstants.CURRENT_ROUND, 0)),
            int(shareable.get_header(AppConstants.NUM_ROUNDS, 1)))


class TrainerExecutor(SiteExecutor):
    #: the component id of the client's analytics writer (``nvflare.app_opt.tracking.tb.tb_writer.TBWriter``)
    analytics_writer_id = "log_writer"

    def __init__(self):
        super().__init__()
        self.trainer: LocalTrainer | None = None
        self.last_round = -1  # the last round trained (restored from the checkpoint)
        self._writer_checked = False
        self._writer = None

    # ------------------------------------------------------------------ what a method provides
    @abstractmethod
    def build_trainer(self, fl_ctx: FLContext, num_rounds: int) -> LocalTrainer:
        """The site's trainer for a run of ``num_rounds`` rounds (every method executor defines it)."""

    def receive(self, dxo: DXO, fl_ctx: FLContext, round_idx: int) -> dict:
        """Apply the received global state; return extra fields for the round's record."""
        kept = self.trainer.load_global(dxo.data or {}, keep_local=self.declared_local(dxo))
        return {"kept_local": kept} if kept else {}

    def declared_local(self, dxo: DXO) -> list[str]:
        """Keys a server-side exclusion filter held back (and declared in the meta)."""
        return list(dxo.get_meta_prop(EXCLUDED_META) or [])

    def result_state(self, stats: RoundStats, dxo: DXO) -> dict:
        return self.trainer.global_state()

    def result_meta(self, stats: RoundStats, dxo: DXO, fl_ctx: FLContext) -> dict:
        return {}

    def result_headers(self, stats: RoundStats, dxo: DXO, fl_ctx: FLContext) -> dict:
        """Headers set on the reply (e.g. for the site's task-result filters)."""
        return {}

    def checkpoint_extra(self) -> dict:
        return {}

    def describe_round(self, stats: RoundStats) -> str:
        return f"loss {stats.loss:.4f} ({stats.steps} steps, {stats.samples} samples)"

    # ------------------------------------------------------------------ the protocol
    def ensure_trainer(self, shareable: Shareable, fl_ctx: FLContext) -> LocalTrainer:
        """The site's trainer, built on first use and resumed from the checkpoint when there is one.  It is kept
        only once that succeeded: after a CheckpointError the next task tries again (and fails again) rather
        than training a fresh trainer whose first checkpoint would replace the site's state."""
        if self.trainer is None:
            _, num_rounds = round_headers(shareable)
            state = self.load_checkpoint(fl_ctx)  # the file first: a broken one fails before any data is read
            trainer = self.build_trainer(fl_ctx, num_rounds)
            if state is not None:
                self.resume(trainer, state, fl_ctx)
            self.trainer = trainer
        return self.trainer

    def resume(self, trainer: LocalTrainer, state: dict, fl_ctx: FLContext) -> None:
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

    def train(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        site = self.site_name(fl_ctx)
        round_idx, num_rounds = round_headers(shareable)
        trainer = self.ensure_trainer(shareable, fl_ctx)
        dxo = self.received_weights(shareable, fl_ctx)
        extra = self.receive(dxo, fl_ctx, round_idx) or {}
        t0 = time.time()
        stats = trainer.train_round(round_idx, lambda: abort_signal.triggered)
        seconds = time.time() - t0
        if not math.isfinite(stats.loss):
            raise FloatingPointError(f"{site}: the training loss became {stats.loss} in round {round_idx}; lower the "
                                     "learning rate or check the data")
        self.last_round = round_idx
        self.save_checkpoint(fl_ctx, {"round": round_idx, "trainer": trainer.state_dict(),
                                      TRAINER_CLASS_KEY: type(trainer).__name__, **self.checkpoint_extra()})
        stats.metrics.setdefault("time_s", round(seconds, 3))
        if seconds > 0 and stats.samples:
            stats.metrics.setdefault("steps_per_s", round(stats.steps / seconds, 3))
        self.append_metrics(fl_ctx, {"round": round_idx, **stats.record(), **extra})
        self.stream(fl_ctx, stats, round_idx)
        self.stream_scalars(fl_ctx, extra, round_idx)  # e.g. validation metrics of the received global model
        self.log_info(fl_ctx, f"round {round_idx + 1}/{num_rounds}: {self.describe_round(stats)}")
        state = {k: v.detach().cpu().numpy() for k, v in self.result_state(stats, dxo).items()}
        meta = {"num_samples": stats.samples, MetaKey.NUM_STEPS_CURRENT_ROUND: stats.steps, "loss": stats.loss,
                **self.result_meta(stats, dxo, fl_ctx)}
        reply = DXO(data_kind=DataKind.WEIGHTS, data=state, meta=meta).to_shareable()
        for key, value in self.result_headers(stats, dxo, fl_ctx).items():
            reply.set_header(key, value)
        return reply

    # ------------------------------------------------------------------ analytics
    def analytics_writer(self, fl_ctx: FLContext):
        if not self._writer_checked:
            self._writer_checked = True
            self._writer = fl_ctx.get_engine().get_component(self.analytics_writer_id)
            if self._writer is None:
                self.log_info(fl_ctx, f"no '{self.analytics_writer_id}' component in the client config: training "
                                      "curves go to the metrics file only, not to TensorBoard")
        return self._writer

    def stream(self, fl_ctx: FLContext, stats: RoundStats, round_idx: int) -> None:
        """Per-round scalars (step = round) and per-step curves (step = global step) to FLARE's analytics."""
        writer = self.analytics_writer(fl_ctx)
        if writer is None:
            return
        for tag, value in stats.scalars().items():
            writer.add_scalar(tag, value, global_step=round_idx)
        base = round_idx * max(len(stats.curve), 1)
        for i, point in enumerate(stats.curve):
            for tag, value in point.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    writer.add_scalar(f"step/{tag}", float(value), global_step=base + i)

    def stream_scalars(self, fl_ctx: FLContext, values: dict[str, Any], step: int) -> None:
        """Scalars of another task (e.g. test metrics) to FLARE's analytics."""
        writer = self.analytics_writer(fl_ctx)
        if writer is None:
            return
        for tag, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                writer.add_scalar(tag, float(value), global_step=step)
