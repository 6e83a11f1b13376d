"""Server component that leaves a machine-readable summary and plots in the job's run folder.

Listens to FLARE events: after each aggregation it records the round's per-site losses (meta
``site_losses`` of the aggregate); at the end of the run it reads the communication records of
``CommunicationMeter`` and writes ``summary.json``, ``loss.png`` and ``bytes_per_round.png``.
"""

from __future__ import annotations

import os
import time

from nvflare.apis.dxo import from_shareable
from nvflare.apis.event_type import EventType
from nvflare.apis.fl_component import FLComponent
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.app_event_type import AppEventType

from fedssl.eval.run_report import read_jsonl, write_run_report
from fedssl.flare.communication_meter import COMM_FILE
from fedssl.flare.validation import require


class RunSummary(FLComponent):
    def __init__(self, title: str = "federated run"):
        super().__init__()
        require(isinstance(title, str) and bool(title), type(self).__name__, "title", title, "use a non-empty string")
        self.title = title
        self._rounds: list[dict] = []
        self._t0 = time.time()

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        if event_type == EventType.START_RUN:
            self._rounds, self._t0 = [], time.time()
        elif event_type == AppEventType.AFTER_AGGREGATION:
            result = fl_ctx.get_prop(AppConstants.AGGREGATION_RESULT)
            try:
                meta = from_shareable(result).get_meta_props()
            except (ValueError, TypeError, AttributeError):
                meta = {}
            losses = {k: float(v) for k, v in (meta.get("site_losses") or {}).items()}
            rnd = fl_ctx.get_prop(AppConstants.CURRENT_ROUND)
            self._rounds.append({
                "round": rnd,
                "time_s": round(time.time() - self._t0, 2),
                "aggregated_sites": meta.get("aggregated_sites"),
                "site_losses": losses,
                "mean_loss": sum(losses.values()) / len(losses) if losses else None,
            })
            if losses:
                self.log_info(fl_ctx, f"round {rnd}: mean loss {self._rounds[-1]['mean_loss']:.4f} over {len(losses)} sites")
        elif event_type == EventType.END_RUN:
            run_dir = fl_ctx.get_engine().get_workspace().get_run_dir(fl_ctx.get_job_id())
            summary = write_run_report(
                run_dir,
                title=self.title,
                rounds=self._rounds,
                comm_records=read_jsonl(os.path.join(run_dir, COMM_FILE)),
                extra={"wall_time_s": round(time.time() - self._t0, 2)},
            )
            b = summary["bytes_per_site_per_round"]
            self.log_info(fl_ctx, f"summary written to {run_dir}/summary.json; bytes per site per round: "
                                  f"up {b['upload']:.0f}, down {b['download']:.0f}")
