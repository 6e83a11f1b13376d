"""Per-round training curves through FLARE's analytics path: client ``TBWriter`` -> ``ConvertToFedEvent`` -> server
``TBAnalyticsReceiver``, so one TensorBoard on the server's run folder shows every site (a mixin of
:class:`fedssl.flare.trainer_executor.TrainerExecutor`)."""

from __future__ import annotations

import math
from typing import Any

from nvflare.apis.fl_context import FLContext

from fedssl.core.trainer import RoundStats


class AnalyticsStream:
    #: the component id of the client's analytics writer (``nvflare.app_opt.tracking.tb.tb_writer.TBWriter``)
    analytics_writer_id = "log_writer"

    def __init__(self):
        super().__init__()
        self._writer_checked = False
        self._writer = None

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
