"""ScatterAndGather for FedDRA: two-stage communication turns and DRO client weights.

"Distributionally Robust Alignment for Medical Federated Vision-Language Pre-training Under Data Heterogeneity"
(Shuai, Wu, Tang and Shen, TMLR), Algorithm 1.  One FLARE round is one communication turn:

1. (``dro``) the client weights lambda are updated from the losses v_i the sites reported with the last turn's
   stage-2 results (``fedssl.core.dro.dro_update``: exponentiated step, chi^2-ball projection; a site without a
   valid v_i keeps its weight and is logged) and published, privately, for the ``DROWeightFilter``, which
   gives each site its own lambda_i only;
2. (``two_stage``) stage 1: task ``train_alignment`` with the global model; the sites train the alignment modules
   and projections with frozen encoders and upload only those; the ``align_aggregator`` (a plain mean, as the
   paper and its code) checks and averages them, and the result is merged into the global model;
3. stage 2 (ScatterAndGather's own ``train`` task): the download is the aggregated alignment part only (the
   encoders did not move in stage 1); the sites train everything and upload the whole model with v_i; the job's
   aggregator averages them, ScatterAndGather persists.  Without ``two_stage`` the round is one plain FedAvg task
   with the whole model.

The weights lambda are written, per turn, to ``dro_weights.json`` in the server's run folder (the trajectory the
paper plots); the per-site losses are not written anywhere.  The round structure, aggregation, persistence and
events stay ScatterAndGather's own: stage 1 runs when ScatterAndGather asks for the round's task data.
"""

from __future__ import annotations

import json
import os

from nvflare.apis.controller_spec import ClientTask, Task
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.apis.signal import Signal
from nvflare.app_common.abstract.aggregator import Aggregator
from nvflare.app_common.abstract.model import ModelLearnable, ModelLearnableKey
from nvflare.app_common.abstract.shareable_generator import ShareableGenerator
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.workflows.scatter_and_gather import ScatterAndGather

from fedssl.core.checks import require, require_int
from fedssl.core.dro import MIN_SHARE, check_dro_args, dro_update, uniform_weights
from fedssl.core.untrusted import as_finite_float
from fedssl.flare.constants import (ALIGN_TASK, DRO_LOSS_KEY, DRO_ON_KEY, DRO_WEIGHTS_PROP, STAGE_KEY)

TRAJECTORY_FILE = "dro_weights.json"


class _TurnData(ShareableGenerator):
    """Wraps the job's shareable generator: runs stage 1 and builds stage 2's download."""

    def __init__(self, ctrl: "FedDRAController", inner: ShareableGenerator):
        super().__init__()
        self.ctrl, self.inner = ctrl, inner

    def shareable_to_learnable(self, shareable: Shareable, fl_ctx: FLContext) -> ModelLearnable:
        return self.inner.shareable_to_learnable(shareable, fl_ctx)

    def learnable_to_shareable(self, model: ModelLearnable, fl_ctx: FLContext) -> Shareable:
        return self.ctrl.turn_data(model, fl_ctx)


class FedDRAController(ScatterAndGather):
    def __init__(self, two_stage: bool = True, dro: bool = True, rho: float = 0.1, gamma: float = 0.5,
                 min_share: float = MIN_SHARE,
                 alignment_prefixes: list = ("image_align.", "text_align.", "image_proj.", "text_proj."),
                 align_aggregator_id: str = "align_aggregator", align_timeout: int = 0, **sag_args):
        """
        Args:
            two_stage: stage 1 (alignment only) then stage 2 (everything) per turn; false = one FedAvg task.
            dro: reweight the sites' step sizes by lambda (needs the DROWeightFilter on the server's task data).
            rho: the chi^2 uncertainty radius (paper: 0.1 MIMIC-CXR, 0.5 retina); checked even with dro off.
            gamma: the exponentiated-gradient step on v_i (the authors' code: 0.01 x the 50 steps of a turn = 0.5).
            min_share: every site keeps at least min_share / N of the weight (default 0.5: with two sites one that
                lies about its loss gets at most 0.75); 0 = the paper's weights, which can reach 0.
            alignment_prefixes: the parameter-name prefixes of stage 1 (the model's alignment part).
            align_aggregator_id: the server component that averages stage 1 (a FedAvgAggregator with uniform weights
                that excludes the encoders).
            align_timeout: seconds stage 1 may take (0 = no limit).
            sag_args: ScatterAndGather's arguments (min_clients, num_rounds, aggregator_id, ...).
        """
        super().__init__(**sag_args)
        name = type(self).__name__
        require(isinstance(two_stage, bool), name, "two_stage", two_stage, "use true (FedDRA) or false (no stage 1)")
        require(isinstance(dro, bool), name, "dro", dro, "use true (DRO client weights) or false (uniform)")
        check_dro_args(name, rho, gamma, min_share)
        require(isinstance(alignment_prefixes, (list, tuple)) and alignment_prefixes
                and all(isinstance(p, str) and p for p in alignment_prefixes), name, "alignment_prefixes",
                alignment_prefixes, 'use the model\'s alignment prefixes, e.g. ["image_align.", "text_align.", ...]')
        require(isinstance(align_aggregator_id, str) and bool(align_aggregator_id), name, "align_aggregator_id",
                align_aggregator_id, "use the id of the stage-1 aggregator component")
        require_int(name, "align_timeout", align_timeout, 0, "use 0 (no limit) or a positive number of seconds")
        self.two_stage, self.dro, self.rho, self.gamma = two_stage, dro, float(rho), float(gamma)
        self.min_share = float(min_share)
        self.alignment_prefixes = tuple(alignment_prefixes)
        self.align_aggregator_id, self.align_timeout = align_aggregator_id, align_timeout
        self.align_aggregator: Aggregator | None = None
        self.weights: dict[str, float] = {}
        self.losses: dict[str, object] = {}
        self.trajectory: list[dict] = []
        self._abort: Signal | None = None

    def start_controller(self, fl_ctx: FLContext) -> None:
        super().start_controller(fl_ctx)
        self.shareable_gen = _TurnData(self, self.shareable_gen)
        if self.two_stage:
            agg = self._engine.get_component(self.align_aggregator_id)
            if not isinstance(agg, Aggregator):
                self.system_panic(f"{type(self).__name__}: align_aggregator_id {self.align_aggregator_id!r} is "
                                  f"{type(agg).__name__}, not an Aggregator; add a FedAvgAggregator with that id",
                                  fl_ctx)
                return
            self.align_aggregator = agg
        self.weights = uniform_weights(c.name for c in self._engine.get_clients())

    def control_flow(self, abort_signal: Signal, fl_ctx: FLContext) -> None:
        self._abort = abort_signal
        super().control_flow(abort_signal, fl_ctx)

    # ------------------------------------------------------------------ one turn
    def turn_data(self, model: ModelLearnable, fl_ctx: FLContext) -> Shareable:
        weights, meta = model[ModelLearnableKey.WEIGHTS], dict(model[ModelLearnableKey.META] or {})
        round_idx = fl_ctx.get_prop(AppConstants.CURRENT_ROUND) or 0
        if self.dro:
            self._update_weights(round_idx, fl_ctx)
            fl_ctx.set_prop(DRO_WEIGHTS_PROP, {"round": round_idx, "weights": dict(self.weights)}, private=True,
                            sticky=True)
            fl_ctx.sync_sticky()
        meta[DRO_ON_KEY] = self.dro
        if not self.two_stage:
            meta[STAGE_KEY] = "fedavg"
            return DXO(data_kind=DataKind.WEIGHTS, data=weights, meta=meta).to_shareable()
        aligned = self._stage_one(weights, dict(meta), round_idx, fl_ctx)
        weights.update(aligned)  # the global model of this turn now carries the averaged alignment part
        meta[STAGE_KEY] = "full_model"
        data = {k: v for k, v in weights.items() if k.startswith(self.alignment_prefixes)}
        return DXO(data_kind=DataKind.WEIGHTS, data=data, meta=meta).to_shareable()

    def _update_weights(self, round_idx: int, fl_ctx: FLContext) -> None:
        if self.losses:
            self.weights, kept = dro_update(self.weights, self.losses, self.gamma, self.rho, self.min_share)
            for site in kept:
                self.log_warning(fl_ctx, f"turn {round_idx}: {site} reported no finite loss v_i; it keeps its weight")
        self.losses = {}
        self.trajectory.append({"turn": round_idx, "lambda": dict(self.weights)})
        self.log_info(fl_ctx, f"turn {round_idx}: DRO weights " + ", ".join(f"{s} {w:.4f}"
                                                                            for s, w in self.weights.items()))
        run_dir = self._engine.get_workspace().get_run_dir(fl_ctx.get_job_id())
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, TRAJECTORY_FILE), "w") as f:
            json.dump({"rho": self.rho, "gamma": self.gamma, "min_share": self.min_share,
                       "trajectory": self.trajectory}, f, indent=1)

    def _stage_one(self, weights: dict, meta: dict, round_idx: int, fl_ctx: FLContext) -> dict:
        """Broadcast stage 1, average the returned alignment parts; {} when no site contributed."""
        meta[STAGE_KEY] = "align"
        data = DXO(data_kind=DataKind.WEIGHTS, data=weights, meta=meta).to_shareable()
        data.set_header(AppConstants.CURRENT_ROUND, round_idx)
        data.set_header(AppConstants.NUM_ROUNDS, self._num_rounds)
        data.add_cookie(AppConstants.CONTRIBUTION_ROUND, round_idx)
        self.align_aggregator.reset(fl_ctx)
        task = Task(name=ALIGN_TASK, data=data, props={}, timeout=self.align_timeout,
                    result_received_cb=self._accept_alignment)
        self.broadcast_and_wait(task=task, min_responses=self._min_clients,
                                wait_time_after_min_received=self._wait_time_after_min_received,
                                fl_ctx=fl_ctx, abort_signal=self._abort)
        result = self.align_aggregator.aggregate(fl_ctx)
        try:
            aligned = from_shareable(result).data or {}
        except (ValueError, TypeError):
            aligned = {}
        if not aligned:
            self.log_warning(fl_ctx, f"turn {round_idx}: no site contributed to stage 1; the alignment part is "
                                     "unchanged")
        return aligned

    def _accept_alignment(self, client_task: ClientTask, fl_ctx: FLContext) -> None:
        result = client_task.result
        if result is not None:
            self.align_aggregator.accept(result, fl_ctx)
        client_task.result = None  # the weights are in the aggregator; free the memory

    def _accept_train_result(self, client_name: str, result: Shareable, fl_ctx: FLContext,
                             is_unknown_task: bool = False) -> bool:
        accepted = super()._accept_train_result(client_name=client_name, result=result, fl_ctx=fl_ctx,
                                                is_unknown_task=is_unknown_task)
        if accepted and self.dro and not is_unknown_task:
            try:
                value = as_finite_float(from_shareable(result).get_meta_prop(DRO_LOSS_KEY), "v_i", client_name)
            except (ValueError, TypeError):
                value = None
            if value is not None and not 0.0 <= value <= 1e6:
                value = None
            self.losses[client_name] = value
        return accepted

    def process_result_of_unknown_task(self, client, task_name, client_task_id, result, fl_ctx) -> None:
        if task_name == ALIGN_TASK:
            self.log_warning(fl_ctx, f"late stage-1 result from {client.name} ignored")
            return
        super().process_result_of_unknown_task(client, task_name, client_task_id, result, fl_ctx)
