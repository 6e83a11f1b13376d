"""Server workflow run after ScatterAndGather: test the model selected on validation data at every site.

The model under test is, with ``model="best"``, the best global model that FLARE's IntimeModelSelector chose on
the sites' VALIDATION metrics (``MetaKey.INITIAL_METRICS`` of the train results): when it fires
``GLOBAL_BEST_MODEL_AVAILABLE``, PTFileModelPersistor saves the current global model as
``best_FL_global_model.pt``.  If no best model exists (selection never fired: one round, no validation metrics),
or with ``model="last"``, the last global model is tested; the report says which one was used.  The test split
never chooses a checkpoint.

One task ``task_name`` is broadcast to the sites with the weights (DXO WEIGHTS, meta ``model_source``); each site
replies with a ``DataKind.METRICS`` DXO (a dict; nested values are kept as they are).  The workflow writes, in the
server's run folder, ``test_metrics.json`` (per site, mean over sites, which model, the selection info),
``test_metrics.md`` (a table) and ``test_metrics.png`` (grouped bars), adds ``test_evaluation`` to RunSummary's
``summary.json``, and logs one summary line.  Subclasses may override :meth:`write_report` to write their own
tables from the same report dict.
"""

from __future__ import annotations

import json
import math
import os

from nvflare.apis.controller_spec import Task
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.event_type import EventType
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.impl.controller import Controller
from nvflare.apis.signal import Signal
from nvflare.app_common.abstract.model import ModelLearnableKey
from nvflare.app_common.abstract.model_persistor import ModelPersistor
from nvflare.app_common.app_constant import AppConstants, DefaultCheckpointFileName
from nvflare.app_common.app_event_type import AppEventType

from fedssl.core.checks import require, require_choice, require_int
from fedssl.core.untrusted import ContributionError, bounded_json
from fedssl.flare.run_summary import record_in_summary

REPORT_JSON = "test_metrics.json"
REPORT_MD = "test_metrics.md"
REPORT_PNG = "test_metrics.png"


def numeric(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(float(value))


def site_means(sites: dict[str, dict]) -> dict[str, float]:
    """Mean over sites of every top-level numeric value (a site lacking a value or holding None is skipped)."""
    keys: list[str] = []
    for data in sites.values():
        keys += [k for k, v in data.items() if numeric(v) and k not in keys]
    out = {}
    for k in keys:
        values = [float(d[k]) for d in sites.values() if numeric(d.get(k))]
        if values:
            out[k] = sum(values) / len(values)
    return out


def markdown_table(report: dict, columns: list[str]) -> str:
    def cell(v):
        return f"{v:.4f}" if isinstance(v, float) else ("n/a" if v is None else str(v))

    lines = [f"# {report['title']}", "", f"Model: {report['model_source']}", "",
             "| site | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for site, data in report["sites"].items():
        lines.append(f"| {site} | " + " | ".join(cell(data.get(c)) for c in columns) + " |")
    lines.append("| **mean** | " + " | ".join(cell(report["mean"].get(c)) for c in columns) + " |")
    if report["failed_sites"]:
        lines += ["", "Failed sites: " + ", ".join(report["failed_sites"])]
    return "\n".join(lines) + "\n"


def bar_plot(report: dict, columns: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sites = list(report["sites"])
    cols = [c for c in columns if c != "n"] or columns
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * len(cols) + 2), 4))
    width = 0.8 / max(1, len(sites))
    for i, site in enumerate(sites):
        vals = [report["sites"][site].get(c) for c in cols]
        ax.bar([j + i * width for j in range(len(cols))], [v if numeric(v) else 0.0 for v in vals], width, label=site)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cols))])
    ax.set_xticklabels(cols, rotation=30, ha="right", fontsize=8)
    ax.set(title=f"{report['title']} ({report['model']} model)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


class FinalEvaluation(Controller):
    def __init__(self, persistor_id: str = "persistor", task_name: str = "test", model: str = "best",
                 min_responses: int = 0, timeout: int = 0, table_metrics: list = (), title: str = "test evaluation"):
        """
        Args:
            persistor_id: the PTFileModelPersistor (or any ModelPersistor) that saved the global / best models.
            task_name: the task the sites run on their test data (ClassifierExecutor: "test").
            model: "best" (validation-selected; falls back to the last model when none was saved) or "last".
            min_responses: replies to wait for; 0 = every client connected to the job.
            timeout: seconds the task may take (0 = no limit).
            table_metrics: top-level numeric reply keys for the table and plot ([] = all of them).
            title: heading of the table and plot.
        """
        super().__init__()
        name = type(self).__name__
        require(isinstance(persistor_id, str) and bool(persistor_id), name, "persistor_id", persistor_id,
                "use the id of the job's model persistor component")
        require(isinstance(task_name, str) and bool(task_name), name, "task_name", task_name, 'use e.g. "test"')
        require_choice(name, "model", model, ("best", "last"))
        require_int(name, "min_responses", min_responses, 0, "use 0 (every site) or a positive number of sites")
        require_int(name, "timeout", timeout, 0, "use 0 (no limit) or a positive number of seconds")
        require(isinstance(table_metrics, (list, tuple)) and all(isinstance(m, str) for m in table_metrics), name,
                "table_metrics", table_metrics, 'use a list of metric names, e.g. ["accuracy", "auc"], or []')
        require(isinstance(title, str) and bool(title), name, "title", title, "use a non-empty string")
        self.persistor_id = persistor_id
        self.task_name = task_name
        self.model = model
        self.min_responses = min_responses
        self.timeout = timeout
        self.table_metrics = list(table_metrics)
        self.title = title
        self._persistor: ModelPersistor | None = None
        self._selection: dict | None = None

    # ------------------------------------------------------------------ FLARE hooks
    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        super().handle_event(event_type, fl_ctx)
        if event_type == EventType.START_RUN:
            self._selection = None
        elif event_type == AppEventType.GLOBAL_BEST_MODEL_AVAILABLE:
            info = fl_ctx.get_prop(AppConstants.METRICS_SELECTION_INFO)
            self._selection = (dict(info) if isinstance(info, dict)
                               else {"best_round": fl_ctx.get_prop(AppConstants.CURRENT_ROUND)})

    def start_controller(self, fl_ctx: FLContext) -> None:
        persistor = self._engine.get_component(self.persistor_id)
        if not isinstance(persistor, ModelPersistor):
            self.system_panic(f"{type(self).__name__}: component {self.persistor_id!r} is {type(persistor).__name__}, "
                              "not a ModelPersistor; set persistor_id to the job's persistor", fl_ctx)
            return
        self._persistor = persistor

    def stop_controller(self, fl_ctx: FLContext) -> None:
        pass

    def process_result_of_unknown_task(self, client, task_name, client_task_id, result, fl_ctx) -> None:
        self.log_warning(fl_ctx, f"late or unknown result for task {task_name} from {client.name} ignored")

    # ------------------------------------------------------------------ model choice
    def _pick_model(self, fl_ctx: FLContext) -> tuple[dict, str, str]:
        """(weights, "best"|"last", human-readable source) of the model to test."""
        best_name = getattr(self._persistor, "best_global_model_file_name", DefaultCheckpointFileName.BEST_GLOBAL_MODEL)
        last_name = getattr(self._persistor, "global_model_file_name", DefaultCheckpointFileName.GLOBAL_MODEL)
        inventory = self._persistor.get_model_inventory(fl_ctx) or {}
        if self.model == "best":
            if best_name in inventory:
                learnable = self._persistor.get_model(best_name, fl_ctx)
                if learnable is not None:
                    sel = self._selection or {}
                    key = (sel.get("key_metric") or {}).get("name")
                    value = (sel.get("best_metrics") or {}).get(key) if key else None
                    detail = (f"round {sel.get('best_round')}, mean site {key} {value:.4f}" if key
                              and numeric(value) else "saved by the model selector")
                    return learnable[ModelLearnableKey.WEIGHTS], "best", f"best global model on validation ({detail})"
            self.log_warning(fl_ctx, "no validation-selected best model was saved (no round reported validation "
                                     "metrics); testing the last global model instead")
        learnable = fl_ctx.get_prop(AppConstants.GLOBAL_MODEL)
        if learnable is None and last_name in inventory:
            learnable = self._persistor.get_model(last_name, fl_ctx)
        if learnable is None:
            raise ValueError("no global model to test: the training workflow produced none")
        return learnable[ModelLearnableKey.WEIGHTS], "last", "last global model (not selected on validation)"

    # ------------------------------------------------------------------ control flow
    def control_flow(self, abort_signal: Signal, fl_ctx: FLContext) -> None:
        if self._persistor is None:
            return
        try:
            weights, which, source = self._pick_model(fl_ctx)
        except ValueError as e:
            self.system_panic(str(e), fl_ctx)
            return
        n_clients = len(self._engine.get_clients())
        min_responses = self.min_responses or n_clients
        self.log_info(fl_ctx, f"testing the {source} on {n_clients} sites (task {self.task_name!r})")
        data = DXO(data_kind=DataKind.WEIGHTS, data=weights, meta={"model_source": source}).to_shareable()
        task = Task(name=self.task_name, data=data, props={}, timeout=self.timeout)
        self.broadcast_and_wait(task=task, fl_ctx=fl_ctx, min_responses=min_responses, abort_signal=abort_signal)
        if abort_signal.triggered:
            return
        sites, failed = {}, []
        for ct in task.client_tasks:
            name = ct.client.name
            result = ct.result
            rc = result.get_return_code() if result is not None else "no reply"
            if result is None or (rc and rc != ReturnCode.OK):
                failed.append(name)
                self.log_warning(fl_ctx, f"{name} returned {rc} for task {self.task_name}; left out of the test report")
                continue
            try:
                dxo = from_shareable(result)
            except (ValueError, TypeError) as e:
                failed.append(name)
                self.log_warning(fl_ctx, f"{name} sent an invalid test result ({e}); left out of the test report")
                continue
            if dxo.data_kind != DataKind.METRICS or not isinstance(dxo.data, dict):
                failed.append(name)
                self.log_warning(fl_ctx, f"{name} sent {dxo.data_kind}, expected a {DataKind.METRICS} dict; left out")
                continue
            try:  # a site's report is small JSON (the surgical per-class table with CIs is 5 deep)
                sites[name] = bounded_json(dxo.data, "its test metrics", name)
            except ContributionError as e:
                failed.append(name)
                self.log_warning(fl_ctx, f"{e}; left out of the test report")
        sites = dict(sorted(sites.items()))
        report = {
            "title": self.title,
            "model": which,
            "model_source": source,
            "selection": self._selection if which == "best" else None,
            "sites": sites,
            "mean": site_means(sites),
            "failed_sites": sorted(failed),
        }
        run_dir = self._engine.get_workspace().get_run_dir(fl_ctx.get_job_id())
        self.write_report(report, run_dir, fl_ctx)
        record_in_summary(self, fl_ctx, {"test_evaluation": {k: report[k]
                                                             for k in ("model", "model_source", "selection",
                                                                                    "mean", "failed_sites")}})
        cols = self._columns(report)
        means = ", ".join(f"{c} {report['mean'][c]:.4f}" for c in cols if c in report["mean"] and c != "n")
        self.log_info(fl_ctx, f"test evaluation ({source}): {means} (mean over {len(sites)} sites"
                              + (f"; failed: {', '.join(report['failed_sites'])}" if failed else "") + ")")

    def _columns(self, report: dict) -> list[str]:
        if self.table_metrics:
            return list(self.table_metrics)
        cols: list[str] = []
        for data in report["sites"].values():
            cols += [k for k, v in data.items() if numeric(v) and k not in cols]
        return cols

    def write_report(self, report: dict, run_dir: str, fl_ctx: FLContext) -> None:
        """Write test_metrics.json / .md / .png into the server run folder (override for other tables)."""
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, REPORT_JSON), "w") as f:
            json.dump(report, f, indent=2, default=lambda o: o.tolist() if hasattr(o, "tolist") else float(o))
        cols = self._columns(report)
        with open(os.path.join(run_dir, REPORT_MD), "w") as f:
            f.write(markdown_table(report, cols))
        if report["sites"] and cols:
            bar_plot(report, cols, os.path.join(run_dir, REPORT_PNG))
        self.log_info(fl_ctx, f"test report written to {os.path.join(run_dir, REPORT_JSON)} (+ .md, .png)")
