"""ScatterAndGather for FedBYOL / FCLOpt / FCLOpt-PTNU / FCLOpt-PTNU-DP (FCL (Wu et al., MedIA 2022) section 4).

The mode decides what each round's broadcast carries; the sites read the mode from the task, so the
server configuration is the single switch:

| mode      | download                                   | upload                                |
|-----------|--------------------------------------------|---------------------------------------|
| fedbyol   | online + predictor                         | online + predictor                    |
| fclopt    | online + predictor + target                | online + predictor + target           |
| ptnu      | online + predictor + scalar d (eq. 10)     | online + predictor + target           |
| ptnu_dp   | task 1: online + predictor -> scalar d_pc; | online + predictor (+ target on       |
|           | task 2: scalar d~ = alpha mean d_pc        |   calibration rounds, every R rounds) |

DP needs a second exchange inside a round (before training): the shareable generator of this controller
runs it when ScatterAndGather asks for the round's task data, so the round structure, aggregation,
persistence and events stay ScatterAndGather's own.
"""

from __future__ import annotations

from nvflare.apis.controller_spec import ClientTask, Task
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.apis.signal import Signal
from nvflare.app_common.abstract.model import ModelLearnable, ModelLearnableKey
from nvflare.app_common.abstract.shareable_generator import ShareableGenerator
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.workflows.scatter_and_gather import ScatterAndGather

from fedssl.core.checks import require, require_choice
from fedssl.core.ptnu import (TARGET, PTNUError, calibrate_alpha, global_distance, predicted_distance, uploads_target,
                              valid_distances)
from fedssl.flare.constants import (DISTANCE_KEY, DISTANCE_TASK, MODE_KEY, MODES, PROXY_KEY, ROUND_PLAN_PROP,
                                    UPLOAD_TARGET_KEY)


class _RoundData(ShareableGenerator):
    """Wraps the job's shareable generator: tailors each round's broadcast to the mode (and runs DP)."""

    def __init__(self, ctrl: "FCLOptController", inner: ShareableGenerator):
        super().__init__()
        self.ctrl, self.inner = ctrl, inner

    def shareable_to_learnable(self, shareable: Shareable, fl_ctx: FLContext) -> ModelLearnable:
        return self.inner.shareable_to_learnable(shareable, fl_ctx)

    def learnable_to_shareable(self, model: ModelLearnable, fl_ctx: FLContext) -> Shareable:
        return self.ctrl.round_data(model, fl_ctx)


class FCLOptController(ScatterAndGather):
    def __init__(self, mode: str = "fclopt", calibration_every: int = 10, distance_timeout: int = 0, **sag_args):
        """
        Args:
            mode: "fedbyol", "fclopt", "ptnu" or "ptnu_dp" (see the module docstring).
            calibration_every: R, rounds between DP calibrations (paper: 10); round 0 is one.
            distance_timeout: seconds to wait for the distance task (0 = no limit).
            sag_args: ScatterAndGather's arguments (min_clients, num_rounds, aggregator_id, ...).
        """
        super().__init__(**sag_args)
        name = type(self).__name__
        require_choice(name, "mode", mode, MODES)
        require(isinstance(calibration_every, int) and calibration_every >= 1, name, "calibration_every",
                calibration_every, "use a positive number of rounds (paper: 10)")
        self.mode = mode
        self.calibration_every = calibration_every
        self.distance_timeout = distance_timeout
        self.alpha = 1.0
        self._fresh_target = False  # the global target was aggregated from uploads in the last round
        self._abort: Signal | None = None
        self.dp_log: list[dict] = []

    def start_controller(self, fl_ctx: FLContext) -> None:
        super().start_controller(fl_ctx)
        self.shareable_gen = _RoundData(self, self.shareable_gen)

    def control_flow(self, abort_signal: Signal, fl_ctx: FLContext) -> None:
        self._abort = abort_signal
        super().control_flow(abort_signal, fl_ctx)

    # ------------------------------------------------------------------ per-round data
    def _without_target(self, weights: dict) -> dict:
        return {k: v for k, v in weights.items() if not k.startswith(TARGET)}

    def round_data(self, model: ModelLearnable, fl_ctx: FLContext) -> Shareable:
        weights, meta = model[ModelLearnableKey.WEIGHTS], dict(model[ModelLearnableKey.META] or {})
        meta[MODE_KEY] = self.mode
        round_idx = fl_ctx.get_prop(AppConstants.CURRENT_ROUND) or 0
        if self.mode == "fclopt":
            data = weights
        elif self.mode == "fedbyol":
            data = self._without_target(weights)
        elif self.mode == "ptnu":
            data = self._without_target(weights)
            meta[DISTANCE_KEY] = global_distance(weights)
        else:
            meta[DISTANCE_KEY] = self._distance_prediction(weights, round_idx, fl_ctx)
            meta[UPLOAD_TARGET_KEY] = round_idx % self.calibration_every == 0
            self._fresh_target = meta[UPLOAD_TARGET_KEY]
            data = {}  # the online network went out with the distance task
        # the aggregator (optional_prefixes ["target."]) expects the target network in this round iff the server says so
        plan = {"round": round_idx, "optional": uploads_target(self.mode, meta.get(UPLOAD_TARGET_KEY, False))}
        fl_ctx.set_prop(ROUND_PLAN_PROP, plan, private=True, sticky=True)
        return DXO(data_kind=DataKind.WEIGHTS, data=data, meta=meta).to_shareable()

    def _distance_prediction(self, weights: dict, round_idx: int, fl_ctx: FLContext) -> float:
        """DP's extra exchange: send the global online net, collect d_pc (eq. 12), return d~ (eqs. 13-15)."""
        dxo = DXO(data_kind=DataKind.WEIGHTS, data=self._without_target(weights), meta={MODE_KEY: self.mode})
        data = dxo.to_shareable()
        data.set_header(AppConstants.CURRENT_ROUND, round_idx)
        data.set_header(AppConstants.NUM_ROUNDS, self._num_rounds)
        data.add_cookie(AppConstants.CONTRIBUTION_ROUND, round_idx)
        task = Task(name=DISTANCE_TASK, data=data, props={}, timeout=self.distance_timeout)
        self.broadcast_and_wait(task=task, min_responses=self._min_clients,
                                wait_time_after_min_received=self._wait_time_after_min_received,
                                fl_ctx=fl_ctx, abort_signal=self._abort)
        reported = {ct.client.name: self._proxy_of(ct) for ct in task.client_tasks}
        good, bad = valid_distances(reported)
        for site, value in bad.items():
            self.log_warning(fl_ctx, f"round {round_idx}: {site} reported d_pc={value!r} (missing or not finite); "
                                     "left out of the distance prediction")
        if not good:
            raise PTNUError(f"round {round_idx}: no site reported a valid distance d_pc; cannot predict the target "
                            "distance")
        d_pcs = list(good.values())
        record = {"round": round_idx, "d_pc": good, "alpha_before": self.alpha}
        if self._fresh_target:
            d_exact = global_distance(weights)
            self.alpha = calibrate_alpha(d_exact, d_pcs, self.alpha)
            record["d_exact"] = d_exact
        d_pred = predicted_distance(self.alpha, d_pcs)
        record.update(alpha=self.alpha, d_predicted=d_pred)
        self.dp_log.append(record)
        self.log_info(fl_ctx, f"round {round_idx}: DP d~ = {self.alpha:.4f} x mean d_pc {sum(d_pcs) / len(d_pcs):.5g} "
                              f"= {d_pred:.5g} from {len(d_pcs)} sites"
                              + (" (alpha recalibrated)" if self._fresh_target else ""))
        return d_pred

    @staticmethod
    def _proxy_of(ct: ClientTask):
        if ct.result is None:
            return None
        try:
            return from_shareable(ct.result).get_meta_prop(PROXY_KEY)
        except (ValueError, TypeError):
            return None

    def process_result_of_unknown_task(self, client, task_name, client_task_id, result, fl_ctx) -> None:
        if task_name == DISTANCE_TASK:
            self.log_warning(fl_ctx, f"late distance report from {client.name} ignored")
            return
        super().process_result_of_unknown_task(client, task_name, client_task_id, result, fl_ctx)
