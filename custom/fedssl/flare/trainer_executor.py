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
5. checkpoint atomically, append the round's record to the site's metrics file and stream its scalars through
   FLARE's analytics path (:class:`fedssl.flare.analytics_stream.AnalyticsStream`);
6. pack the result: ``global_state()`` (minus what the method keeps local) with ``num_samples``,
   ``NUM_STEPS_CURRENT_ROUND`` and ``loss`` in the meta, plus the method's extra meta.

A method executor = its settings (one dataclass, :meth:`TrainerExecutor.configure`) + ``build_trainer`` + hooks
for its extra tasks.
"""

from __future__ import annotations

import math
import time
from abc import abstractmethod
from collections.abc import Mapping
from typing import Any

from nvflare.apis.dxo import DXO, DataKind, MetaKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.apis.signal import Signal
from nvflare.app_common.app_constant import AppConstants

from fedssl.core.checks import settings_from, settings_values
from fedssl.core.trainer import LocalTrainer, RoundStats
from fedssl.flare.analytics_stream import AnalyticsStream
from fedssl.flare.constants import EXCLUDED_META
from fedssl.flare.site_executor import TRAINER_CLASS_KEY, SiteExecutor


def round_headers(shareable: Shareable) -> tuple[int, int]:
    """(round index, number of rounds) from the task headers (0 and 1 when the workflow sets none)."""
    return (int(shareable.get_header(AppConstants.CURRENT_ROUND, 0)),
            int(shareable.get_header(AppConstants.NUM_ROUNDS, 1)))


class TrainerExecutor(AnalyticsStream, SiteExecutor):
    def __init__(self):
        super().__init__()
        self.trainer: LocalTrainer | None = None
        self.last_round = -1  # the last round trained (restored from the checkpoint)
        self.settings: Any = None

    def configure(self, settings_class: type, args: Mapping[str, Any]) -> None:
        """The method's settings (one dataclass, :func:`fedssl.core.checks.settings_from`) from the executor's
        keyword arguments, checked at once; every argument is also stored verbatim as an attribute."""
        self.settings = settings_from(type(self).__name__, settings_class, args)
        vars(self).update(settings_values(self.settings))

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
        # after the result is built: what it exported (a feature bank's new rows) is not pending in the checkpoint,
        # so a restarted site never sends a feature twice
        self.save_checkpoint(fl_ctx, {"round": round_idx, "trainer": trainer.state_dict(),
                                      TRAINER_CLASS_KEY: type(trainer).__name__, **self.checkpoint_extra()})
        reply = DXO(data_kind=DataKind.WEIGHTS, data=state, meta=meta).to_shareable()
        for key, value in self.result_headers(stats, dxo, fl_ctx).items():
            reply.set_header(key, value)
        return reply
