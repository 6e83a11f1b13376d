"""BYOLExecutor on tiny synthetic ACDC: what each mode uploads, the DP distance task, restart, abort, bad tasks."""

import json
import os

import numpy as np
import pytest
import torch
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.signal import Signal

from fedssl.data.acdc_synthetic import write_synthetic_acdc
from fedssl.core.seeds import site_seed
from fedssl.flare.byol_executor import BYOLExecutor
from fedssl.flare.constants import (DISTANCE_KEY, DISTANCE_TASK, MODE_KEY, MODES, PROXY_KEY, SITE_RECORD_META,
                                    UPLOAD_TARGET_KEY)
from fedssl.models.unet import TINY_FEATURES, BYOLUNetEncoder
from fedssl.train.byol import BYOL_MODES
from tests.unit.flare.fakes import CountingSignal, FakeEngine, context

ARGS = dict(image_size=32, target_spacing=4.0, features=list(TINY_FEATURES), proj_dim=8, pred_hidden=16, batch_size=8,
            max_steps_per_round=2, device="cpu")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("acdc")
    write_synthetic_acdc(root, n_patients=4, n_sites=1, seed=0, shape=(48, 48), n_frames=4, slices_range=(5, 6))
    return str(root / "site-1")


def global_weights(with_target=True):
    torch.manual_seed(1)
    state = {k: v.numpy() for k, v in BYOLUNetEncoder(TINY_FEATURES, 8, 16, image_size=32).state_dict().items()}
    return {k: v for k, v in state.items() if with_target or not k.startswith("target.")}


def task(mode, round_idx=0, weights=None, **meta):
    weights = global_weights(mode == "fclopt") if weights is None else weights
    s = DXO(DataKind.WEIGHTS, data=weights, meta={MODE_KEY: mode, **meta}).to_shareable()
    s.set_header("current_round", round_idx)
    s.set_header("num_rounds", 3)
    return s


def run(executor, tmp_path, shareable, name="train", signal=None):
    return executor.execute(name, shareable, context(site="site-1", engine=FakeEngine(tmp_path)), signal or Signal())


def has_target(dxo):
    return any(k.startswith("target.") for k in dxo.data)


def test_modes_agree_with_the_controller():
    assert BYOL_MODES == MODES


def test_fclopt_uploads_everything_and_a_restarted_site_keeps_its_local_target(data, tmp_path):
    out = from_shareable(run(BYOLExecutor(data_root=data, **ARGS), tmp_path, task("fclopt")))
    # issue 14 item 4: the summary record carries the round's feature spread, as the trainer measured it
    (logged,) = [json.loads(line) for line in open(tmp_path / "byol_metrics.jsonl")]
    assert out.get_meta_prop(SITE_RECORD_META) == {"feature_std": logged["feature_std"]}
    assert 0 < logged["feature_std"] < 1
    # num_samples: 4 patients x 4 cine frames (frames "all", the default)
    assert out.data_kind == DataKind.WEIGHTS and has_target(out) and out.get_meta_prop("num_samples") == 16
    assert np.isfinite(out.get_meta_prop("loss")) and os.path.isfile(tmp_path / "byol_client_state.pt")
    ex = BYOLExecutor(data_root=data, **ARGS)  # client restart
    ex.ensure_trainer(task("fedbyol", 1), context(site="site-1", engine=FakeEngine(tmp_path)))
    assert ex.trainer.has_local_target and ex.last_round == 0
    mine = ex.trainer.local_target()
    np.testing.assert_array_equal(mine["target.encoder.conv_0.conv_0.conv.weight"],
                                  out.data["target.encoder.conv_0.conv_0.conv.weight"])
    reply = from_shareable(run(ex, tmp_path, task("fedbyol", 1)))  # FedBYOL: the local target, not uploaded
    assert not has_target(reply) and set(reply.data) == set(global_weights(False))


def test_ptnu_dp_reports_a_distance_then_trains_on_the_kept_online_network(data, tmp_path):
    ex = BYOLExecutor(data_root=data, **ARGS)
    online = global_weights(False)
    dist = from_shareable(run(ex, tmp_path, task("ptnu_dp", weights=online), name=DISTANCE_TASK))
    assert dist.data_kind == DataKind.METRICS and dist.get_meta_prop(PROXY_KEY) == 0.0  # round 0: target = online
    out = from_shareable(run(ex, tmp_path, task("ptnu_dp", weights={}, **{DISTANCE_KEY: 0.0, UPLOAD_TARGET_KEY: True})))
    assert has_target(out) and ex.global_online is None
    records = open(tmp_path / "byol_metrics.jsonl").read()
    assert '"mode": "ptnu_dp"' in records and '"ptnu_iterations": 0' in records
    run(ex, tmp_path, task("ptnu_dp", 1, weights=online), name=DISTANCE_TASK)
    out = from_shareable(run(ex, tmp_path, task("ptnu_dp", 1, weights={},
                                                **{DISTANCE_KEY: 0.01, UPLOAD_TARGET_KEY: False})))
    assert not has_target(out)


@pytest.mark.parametrize("bad, needle", [({"mode": "byol"}, "byol_mode='byol'"),
                                         ({"mode": "ptnu_dp"}, "without a preceding report_distance"),
                                         ({"mode": "ptnu"}, "needs the server's target distance")])
def test_bad_tasks_fail_this_site_with_a_clear_message(data, tmp_path, bad, needle, caplog):
    reply = run(BYOLExecutor(data_root=data, **ARGS), tmp_path, task(bad["mode"], weights=global_weights(False)))
    assert reply.get_return_code() == ReturnCode.EXECUTION_EXCEPTION
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "site-1" in errors[0] and needle in errors[0]


def test_abort_during_a_round_stops_within_one_step(data, tmp_path):
    ex = BYOLExecutor(data_root=data, **dict(ARGS, max_steps_per_round=3, batch_size=4))
    c = context(site="site-1", engine=FakeEngine(tmp_path))
    ex.ensure_trainer(task("fclopt"), c)
    steps = []
    step = ex.trainer.optimizer.step
    ex.trainer.optimizer.step = lambda *a, **k: (steps.append(1), step(*a, **k))[1]
    signal = CountingSignal(after=2)  # read before the round (no), then after the first step (yes)
    reply = ex.execute("train", task("fclopt"), c, signal)
    assert reply.get_return_code() == ReturnCode.TASK_ABORTED
    assert len(steps) == 1 and signal.reads == 2
    assert not os.path.isfile(tmp_path / "byol_client_state.pt") and ex.last_round == -1


def test_site_seed_and_loss_switch_reach_the_trainer(data, tmp_path):
    """The FLARE client name picks the data seed (issue 13 item 9); ``symmetric`` reaches the loss (item 8)."""
    ex = BYOLExecutor(data_root=data, symmetric=True, seed=5, **ARGS)
    ex.ensure_trainer(task("fclopt"), context(site="site-1", engine=FakeEngine(tmp_path)))
    assert ex.trainer.data_seed == site_seed(5, "site-1") and ex.trainer.settings.symmetric is True
    assert BYOLExecutor().symmetric is False  # FCL eq. 6


@pytest.mark.parametrize("bad, needle", [({"symmetric": 1}, "symmetric=1"), ({"seed": -1}, "seed=-1")])
def test_bad_arguments_are_named(bad, needle):
    with pytest.raises(ValueError, match=needle):
        BYOLExecutor(**bad)


def test_loader_workers_reach_the_trainer(data, tmp_path, loader_workers):
    out = from_shareable(run(BYOLExecutor(data_root=data, workers=1, **ARGS), tmp_path, task("fclopt")))
    assert np.isfinite(out.get_meta_prop("loss")) and loader_workers == [1]
