"""Server component: resume a job's ScatterAndGather after the server was restarted (issue 46).

FLARE 2.9 no longer resumes a running job after a server restart (``ServerEngine.persist_components`` is a no-op,
nothing calls ``JobRunner.restore_running_job``): the job stays RUNNING in the job store and nothing runs it. The
admin aborts it and submits the same job again; with this component in the job (opt-in: the jobs do not name it
by default), the new run starts at the round
after the last one the old run finished, from that round's global model, instead of from round 0.

- After every round (``ROUND_DONE``) the global model and the round are written, atomically, to
  ``<folder>/<job digest>/<workflow id>.pt``: tensors only, loaded back with ``weights_only=True``.  ``folder`` is
  inside the server's workspace (its own disk, outside every job's run folder; default ``resume``; a job cannot
  point it elsewhere).  The job
  digest is the SHA-256 of the server app's configuration files, so only the same job, with the same settings and
  seed, resumes from it; a changed job starts afresh.  Nothing identifying a site is written.
- When the workflow starts (``START_WORKFLOW``, after its persistor loaded the initial model) and a checkpoint of
  this job exists, the workflow is restored with FLARE's own ``ScatterAndGather.restore``: ``current_round`` is the
  next round and the global model is the checkpoint's.  The checkpoint must hold exactly the global model's keys and
  shapes; otherwise one line says why and the run starts afresh.  ``summary.json`` of the resumed run says
  ``resumed_after_round`` (its rounds are those after it; the earlier ones are in the aborted run's summary).  A
  finished workflow (its last round done) resumes past its rounds, so the workflows after it (a final evaluation)
  run on its final model.
- With a model selector (FLARE's ``IntimeModelSelector``, id ``model_selector``), each new best global model is kept
  too (``<workflow id>.best.pt``, with the selector's record); a resumed run sets the selector's best metric and
  hands the best model on as the selector does (``GLOBAL_BEST_MODEL_AVAILABLE``: the persistor saves it in the new
  run folder, the final evaluation notes its round), so selection goes on over all the job's rounds.
- When the run ends normally (``ABOUT_TO_END_RUN`` after the workflow's last round, without an abort: FLARE
  triggers the abort signal itself after that event, before ``END_RUN``) the checkpoint is removed, so running the
  job again starts from round 0; an aborted or killed run keeps it.

Only workflows whose whole state is the round and the global model resume (:data:`RESUMABLE`, FLARE's
``ScatterAndGather``); a controller with more state (FCLOpt's round plan, FedDRA's client weights) is named in one
warning line and starts afresh.  The sites' own state (optimiser, feature banks, random generators) is the sites'
business: a resumed run is a continuation, not a bit-identical copy of an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

import numpy as np
import torch
from nvflare.apis.event_type import EventType
from nvflare.apis.fl_component import FLComponent
from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.abstract.model import ModelLearnableKey, make_model_learnable
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.app_event_type import AppEventType
from nvflare.app_common.workflows.scatter_and_gather import ScatterAndGather

from fedssl.core.checks import require
from fedssl.flare.run_summary import record_in_summary

#: controller classes whose whole state is (round, global model): restored with ScatterAndGather.restore
RESUMABLE = (ScatterAndGather,)
#: subclasses of a resumable class that keep more state than that (named here so that a resume is refused)
NOT_RESUMABLE = ("FCLOptController", "FedDRAController")


def job_digest(config_dir: str) -> str:
    """SHA-256 over the names and bytes of the files in the server app's config folder (sorted), hidden files left
    out: FLARE adds its submission signature there (``.__nvfl_sig.json``, ``.__nvfl_submitter.crt``), which differs
    between two submissions of the same job."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(config_dir)):
        path = os.path.join(config_dir, name)
        if os.path.isfile(path) and not name.startswith("."):
            h.update(name.encode() + b"\0")
            with open(path, "rb") as f:
                h.update(f.read())
            h.update(b"\0")
    return h.hexdigest()


def _tensor(value) -> torch.Tensor:
    """A CPU tensor of ``value`` (numpy array or tensor; the global model holds either), without a copy when it can."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().contiguous()
    arr = np.asarray(value)
    return torch.from_numpy(arr if arr.flags.c_contiguous else arr.copy())  # ascontiguousarray would make 0-d 1-d


def save_checkpoint(path: str, weights: dict, round_done: int, end_round: int, info: str = "") -> None:
    """``{"round": round_done, "end_round": end_round, "weights": {name: tensor}, "info": info}`` to ``path``,
    atomically (``info``: a JSON text, e.g. the model selector's record of a best model)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    state = {"round": torch.tensor(int(round_done)), "end_round": torch.tensor(int(end_round)),
             "weights": {k: _tensor(v) for k, v in weights.items()}, "info": str(info)}
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str, reference: dict, end_round: int) -> tuple[int, dict, str]:
    """(round done, weights of the reference's dtypes, numpy arrays or tensors like the reference's, info) from
    ``path``, or ValueError saying what does not fit the current job (keys, shapes, dtypes, rounds)."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not (isinstance(state, dict) and {"round", "end_round", "weights"} <= set(state)
            and isinstance(state["weights"], dict)):
        raise ValueError("not a round checkpoint of this component")
    done, end = int(state["round"]), int(state["end_round"])
    if end != end_round or not 0 <= done < end:
        raise ValueError(f"it ends at round {end} and finished round {done}; this run ends at round {end_round}")
    got = state["weights"]
    if set(got) != set(reference):
        missing, extra = sorted(set(reference) - set(got))[:3], sorted(set(got) - set(reference))[:3]
        raise ValueError(f"its keys differ from the global model's (missing {missing}, unexpected {extra})")
    out = {}
    for k, value in reference.items():
        ref = _tensor(value)
        t = got[k]
        if not isinstance(t, torch.Tensor) or t.shape != ref.shape or t.dtype != ref.dtype:
            raise ValueError(f"{k!r} is not a {ref.dtype} tensor of shape {tuple(ref.shape)}")
        out[k] = t if isinstance(value, torch.Tensor) else t.numpy()  # the global model's own kind
    info = state.get("info", "")
    return done, out, info if isinstance(info, str) else ""


class RoundCheckpoint(FLComponent):
    def __init__(self, folder: str = "resume", model_selector: str = "model_selector"):
        """
        Args:
            folder: where the checkpoints live, inside the server's workspace (a relative path without ".."): the
                server's own disk, outside the job's run folder, which a resubmitted job does not share.
            model_selector: id of the job's IntimeModelSelector, if it has one (FLARE's usual id): its best
                validation metric and the best global model so far are kept too, so that a resumed run selects
                among all its rounds and its final evaluation tests the same best model; a job without that
                component has nothing to keep.
        """
        super().__init__()
        require(isinstance(model_selector, str), type(self).__name__, "model_selector", model_selector,
                'use the id of the IntimeModelSelector component, e.g. "model_selector" ("" for none)')
        self.model_selector = model_selector
        require(isinstance(folder, str) and folder.strip() != "" and "\0" not in folder and not os.path.isabs(folder)
                and ".." not in folder.replace("\\", "/").split("/"), type(self).__name__, "folder", folder,
                'use a folder inside the server workspace, e.g. "resume": a job may not write the server\'s files '
                "elsewhere")
        self.folder = folder
        self._path: str | None = None  # the running workflow's checkpoint (None: not a resumable workflow)
        self._refiring = False  # True while a resumed run hands its saved best model on
        self._workflow = None
        self._finished = False

    def _checkpoint_path(self, fl_ctx: FLContext) -> str:
        engine = fl_ctx.get_engine()
        ws = engine.get_workspace()
        digest = job_digest(ws.get_app_config_dir(fl_ctx.get_job_id()))
        wf = fl_ctx.get_prop(FLContextKey.WORKFLOW)
        if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", str(wf)):
            raise ValueError(f"workflow id {str(wf)[:60]!r} is no file name")
        return os.path.join(ws.get_root_dir(), self.folder, digest, f"{wf}.pt")

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        if event_type == EventType.START_WORKFLOW:
            self._resume(fl_ctx)
        elif event_type == AppEventType.ROUND_DONE and self._path:
            self._save(fl_ctx)
        elif event_type == AppEventType.GLOBAL_BEST_MODEL_AVAILABLE and self._path and not self._refiring:
            self._save_best(fl_ctx)
        elif event_type == EventType.ABOUT_TO_END_RUN and self._path and self._finished:
            signal = fl_ctx.get_run_abort_signal()
            if not (signal is not None and signal.triggered) and os.path.isfile(self._path):
                for path in (self._path, self._best_path()):
                    if os.path.isfile(path):
                        os.remove(path)
                self.log_info(fl_ctx, "run ended normally: round checkpoint removed (a new run starts at round 0)")

    def _resume(self, fl_ctx: FLContext) -> None:
        wf, engine = fl_ctx.get_prop(FLContextKey.WORKFLOW), fl_ctx.get_engine()
        controller = engine.get_component(wf) if engine is not None and isinstance(wf, str) else None
        if not isinstance(controller, RESUMABLE):
            return  # another workflow (k-means, registration, evaluation): nothing to resume
        name = type(controller).__name__
        if name in NOT_RESUMABLE:
            self.log_warning(fl_ctx, f"{name} keeps state beyond the round and the global model; a restarted job "
                                     "starts it from round 0 (no round checkpoint)")
            return
        try:
            path = self._checkpoint_path(fl_ctx)
        except ValueError as e:
            self.log_warning(fl_ctx, f"no round checkpoint: {e}")
            return
        self._path, self._workflow, self._finished = path, controller, False
        if not os.path.isfile(self._path):
            return
        state = controller.get_persist_state(fl_ctx)
        start, n = int(state["start_round"]), int(state["num_rounds"])
        learnable = state["global_weights"]
        try:
            reference = learnable[ModelLearnableKey.WEIGHTS]
            done, weights, _ = load_checkpoint(self._path, reference, start + n)
        except Exception as e:  # noqa: BLE001 -- a bad file never stops the run: it starts afresh and says why
            self.log_warning(fl_ctx, f"round checkpoint {self._path} not used: {str(e)[:300]}; starting at round "
                                     f"{start}")
            return
        resumed = make_model_learnable(weights, dict(learnable.get(ModelLearnableKey.META) or {}))
        controller.restore({**state, "current_round": done + 1, "global_weights": resumed}, fl_ctx)
        fl_ctx.set_prop(AppConstants.GLOBAL_MODEL, resumed, private=True, sticky=True)
        self._finished = done + 1 >= start + n
        record_in_summary(self, fl_ctx, {"resumed_after_round": done})  # summary.json holds the rounds from here
        self._restore_best(fl_ctx, reference, start + n, resumed)
        self.log_info(fl_ctx, f"RESUMED from the round checkpoint: round {done} was the last one finished, the run "
                              f"goes on at round {done + 1} of {start + n}")

    def _save(self, fl_ctx: FLContext) -> None:
        current = fl_ctx.get_prop(AppConstants.CURRENT_ROUND)
        learnable = fl_ctx.get_prop(AppConstants.GLOBAL_MODEL)
        if not isinstance(current, int) or not learnable:
            return
        state = self._workflow.get_persist_state(fl_ctx)
        end = int(state["start_round"]) + int(state["num_rounds"])
        save_checkpoint(self._path, learnable[ModelLearnableKey.WEIGHTS], current, end)
        self._finished = current + 1 >= end

    def _best_path(self) -> str:
        return self._path[:-len(".pt")] + ".best.pt"

    def _selector(self, fl_ctx: FLContext):
        """The job's model selector (FLARE's IntimeModelSelector keeps ``best_val_metric``), or None."""
        engine = fl_ctx.get_engine()
        comp = engine.get_component(self.model_selector) if self.model_selector and engine is not None else None
        return comp if comp is not None and hasattr(comp, "best_val_metric") else None

    def _save_best(self, fl_ctx: FLContext) -> None:
        """The selector found a new best global model (the one sent this round): keep it with its record."""
        selector, learnable = self._selector(fl_ctx), fl_ctx.get_prop(AppConstants.GLOBAL_MODEL)
        current = fl_ctx.get_prop(AppConstants.CURRENT_ROUND)
        if selector is None or not learnable or not isinstance(current, int):
            return
        state = self._workflow.get_persist_state(fl_ctx)
        record = {"best_val_metric": float(selector.best_val_metric),
                  "best_raw_val_metric": selector.best_raw_val_metric,
                  "validation_result": fl_ctx.get_prop(AppConstants.VALIDATION_RESULT),
                  "selection": fl_ctx.get_prop(AppConstants.METRICS_SELECTION_INFO)}
        info = json.dumps(record, default=lambda v: float(v) if isinstance(v, (np.floating, np.integer)) else str(v))
        save_checkpoint(self._best_path(), learnable[ModelLearnableKey.WEIGHTS], current,
                        int(state["start_round"]) + int(state["num_rounds"]), info)

    def _restore_best(self, fl_ctx: FLContext, reference: dict, end_round: int, resumed) -> None:
        """A resumed run: the selector's best metric so far, and the best model handed on as the selector hands it
        (``GLOBAL_BEST_MODEL_AVAILABLE``: the persistor saves it in the new run, the final evaluation notes it)."""
        selector, path = self._selector(fl_ctx), self._best_path()
        if selector is None or not os.path.isfile(path):
            return
        try:
            best_round, weights, info = load_checkpoint(path, reference, end_round)
            record = json.loads(info)
            metric = float(record["best_val_metric"])
        except Exception as e:  # noqa: BLE001 -- selection then starts afresh, and says so
            self.log_warning(fl_ctx, f"best-model checkpoint {path} not used: {str(e)[:300]}; model selection "
                                     "starts afresh at the resumed round")
            return
        selector.best_val_metric, selector.best_raw_val_metric = metric, record.get("best_raw_val_metric")
        fl_ctx.set_prop(AppConstants.GLOBAL_MODEL, make_model_learnable(weights, {}), private=True, sticky=True)
        fl_ctx.set_prop(AppConstants.CURRENT_ROUND, best_round, private=True, sticky=False)
        fl_ctx.set_prop(AppConstants.VALIDATION_RESULT, record.get("validation_result"), private=True, sticky=False)
        fl_ctx.set_prop(AppConstants.METRICS_SELECTION_INFO, record.get("selection"), private=True, sticky=False)
        self._refiring = True
        try:
            self.fire_event(AppEventType.GLOBAL_BEST_MODEL_AVAILABLE, fl_ctx)
        finally:
            self._refiring = False
            fl_ctx.set_prop(AppConstants.GLOBAL_MODEL, resumed, private=True, sticky=True)
        self.log_info(fl_ctx, f"model selection goes on from the best of round {best_round} (validation {metric:.4g})")
