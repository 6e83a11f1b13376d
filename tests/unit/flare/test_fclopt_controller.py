"""FCLOptController's per-round data and DP distance exchange, with FLARE's broadcast faked."""

import numpy as np
import pytest
from nvflare.apis.client import Client
from nvflare.apis.controller_spec import ClientTask
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.app_common.abstract.model import make_model_learnable
from nvflare.app_common.app_constant import AppConstants

from fedssl.core.ptnu import PTNUError
from fedssl.flare.constants import DISTANCE_KEY, DISTANCE_TASK, UPLOAD_TARGET_KEY
from fedssl.flare.fclopt_controller import FCLOptController
from tests.unit.flare.fakes import context

# online vs target differ by 0.5 on every element: d = 0.5
WEIGHTS = {"online.w": np.ones(4, np.float32), "predictor.w": np.ones(2, np.float32),
           "target.w": np.full(4, 0.5, np.float32)}


def controller(mode, reports=None, **kw):
    ctrl = FCLOptController(mode=mode, min_clients=3, num_rounds=20, **kw)
    sent = []

    def fake_broadcast(task, min_responses, wait_time_after_min_received, fl_ctx, abort_signal):
        sent.append(task)
        assert task.name == DISTANCE_TASK
        assert not any(k.startswith("target.") for k in from_shareable(task.data).data)  # never downloaded
        for site, value in (reports or {}).items():
            ct = ClientTask(Client(site, None), task)
            ct.result = (None if value == "missing" else DXO(DataKind.METRICS, data={},
                                                             meta={"d_pc": value}).to_shareable())
            task.client_tasks.append(ct)

    ctrl.broadcast_and_wait = fake_broadcast
    return ctrl, sent


def data_for(ctrl, round_idx):
    return from_shareable(ctrl.round_data(make_model_learnable(dict(WEIGHTS), {}),
                                          context(props={AppConstants.CURRENT_ROUND: round_idx})))


def test_what_each_mode_downloads():
    assert set(data_for(controller("fclopt")[0], 0).data) == set(WEIGHTS)
    assert set(data_for(controller("fedbyol")[0], 0).data) == {"online.w", "predictor.w"}
    ptnu = data_for(controller("ptnu")[0], 0)
    assert set(ptnu.data) == {"online.w", "predictor.w"} and ptnu.get_meta_prop(DISTANCE_KEY) == pytest.approx(0.5)


def test_dp_calibrates_alpha_after_a_target_upload_round_and_predicts_in_between():
    ctrl, sent = controller("ptnu_dp", {"site-1": 0.4, "site-2": 0.6, "site-3": 0.5}, calibration_every=10)
    r0 = data_for(ctrl, 0)  # round 0 is a calibration round: sites will upload targets
    assert r0.data == {} and r0.get_meta_prop(UPLOAD_TARGET_KEY) is True
    assert r0.get_meta_prop(DISTANCE_KEY) == pytest.approx(0.5)  # alpha 1 x mean(0.4, 0.6, 0.5)
    r1 = data_for(ctrl, 1)  # exact d = 0.5 from the freshly aggregated target; DP = 0.5 -> alpha = 1.0
    assert ctrl.alpha == pytest.approx(1.0) and r1.get_meta_prop(UPLOAD_TARGET_KEY) is False
    ctrl2, _ = controller("ptnu_dp", {"site-1": 0.5, "site-2": 0.7, "site-3": 0.6}, calibration_every=10)
    data_for(ctrl2, 0)
    data_for(ctrl2, 1)  # alpha = 0.5 / 0.6
    assert ctrl2.alpha == pytest.approx(0.5 / 0.6)
    r2 = data_for(ctrl2, 2)  # not fresh: alpha kept, d~ = alpha * 0.6 = 0.5
    assert r2.get_meta_prop(DISTANCE_KEY) == pytest.approx(0.5) and ctrl2.alpha == pytest.approx(0.5 / 0.6)
    assert len(sent) == 2 and len(ctrl2.dp_log) == 3  # one distance exchange per round


def test_dp_leaves_out_bad_reports_and_stops_when_none_is_valid():
    ctrl, _ = controller("ptnu_dp", {"site-1": 0.4, "site-2": float("nan"), "site-3": "missing"})
    d = data_for(ctrl, 0).get_meta_prop(DISTANCE_KEY)
    assert d == pytest.approx(0.4) and ctrl.dp_log[0]["d_pc"] == {"site-1": 0.4}
    bad, _ = controller("ptnu_dp", {"site-1": float("inf"), "site-2": "missing"})
    with pytest.raises(PTNUError, match="no site reported a valid distance"):
        data_for(bad, 0)


def test_bad_mode_is_refused():
    with pytest.raises(ValueError, match="mode='byol'"):
        FCLOptController(mode="byol")
