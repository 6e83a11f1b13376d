"""A site's checkpoint that cannot be resumed (truncated, empty, not a client state, a pickle payload, another
method's or model's state): the task fails on that site every round with one line naming the file and what to
do; the file stays byte for byte; once a person deletes it, the site starts again from the global model."""

import os
import shutil

import numpy as np
import pytest
import torch
from nvflare.apis.dxo import DXO, DataKind
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.signal import Signal
from nvflare.app_common.app_constant import AppConstants

from fedssl.core.trainer import RoundStats
from fedssl.data.acdc_synthetic import write_synthetic_acdc
from fedssl.flare.byol_executor import BYOLExecutor
from fedssl.flare.constants import MODE_KEY
from fedssl.flare.fcl_executor import FCLExecutor
from fedssl.flare.trainer_executor import TRAINER_CLASS_KEY, TrainerExecutor
from fedssl.models.unet import TINY_FEATURES, BYOLUNetEncoder, MoCoUNetEncoder
from tests.unit.flare.fakes import FakeEngine, context


class CountingTrainer:
    """A LocalTrainer whose restart state is the number of rounds it trained and a weight vector."""

    def __init__(self):
        self.rounds_done, self.w = 0, torch.zeros(2)

    def train_round(self, round_idx, should_stop):
        self.rounds_done += 1
        return RoundStats(loss=1.0, steps=1, samples=4)

    def evaluate(self, split="val"):
        return {}

    def state_dict(self):
        return {"rounds_done": self.rounds_done, "w": self.w.clone()}

    def load_state_dict(self, state):
        if tuple(state["w"].shape) != (2,):
            raise RuntimeError(f"w has shape {tuple(state['w'].shape)}, expected (2,)")
        self.rounds_done, self.w = int(state["rounds_done"]), state["w"].clone()

    def global_state(self):
        return {"w": self.w}

    def load_global(self, state, keep_local=()):
        return []


class CountingExecutor(TrainerExecutor):
    checkpoint_name = "counting_client_state.pt"
    metrics_name = "counting_metrics.jsonl"

    def build_trainer(self, fl_ctx, num_rounds):
        self.builds = getattr(self, "builds", 0) + 1
        return CountingTrainer()


class Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def task(round_idx, n_rounds=5):
    t = DXO(DataKind.WEIGHTS, data={"w": np.ones(2, np.float32)}).to_shareable()
    t.set_header(AppConstants.CURRENT_ROUND, round_idx)
    t.set_header(AppConstants.NUM_ROUNDS, n_rounds)
    return t


def errors(caplog):
    return [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]


def spoil(path, case, marker):
    """Turn the good checkpoint at ``path`` into a bad one of kind ``case``."""
    good = path.read_bytes()
    if case == "truncated":
        path.write_bytes(good[: len(good) // 2])
    elif case == "empty":
        path.write_bytes(b"")
    elif case == "payload":
        torch.save({"round": 0, "trainer": {"rounds_done": 1, "w": Payload(marker)}}, path)
    elif case == "not_a_client_state":
        torch.save({"w": torch.ones(2)}, path)  # e.g. a model file copied over the checkpoint
    elif case == "other_model":
        torch.save({"round": 0, "trainer": {"rounds_done": 1, "w": torch.ones(5)}}, path)
    elif case == "other_method":
        torch.save({"round": 0, "trainer": {"queue": torch.zeros(3)}, TRAINER_CLASS_KEY: "FCLLocalTrainer"}, path)


@pytest.mark.parametrize("case, problem", [
    ("truncated", "is truncated or not a weight file"), ("empty", "is empty (0 bytes)"),
    ("payload", "holds a Python object that is not weight data"), ("not_a_client_state", "is not a client state"),
    ("other_model", "does not fit this site's CountingTrainer (RuntimeError: w has shape (5,)"),
    ("other_method", "does not fit this site's CountingTrainer (ValueError: it was written by a FCLLocalTrainer)"),
])
def test_a_bad_checkpoint_fails_the_site_every_round_and_is_left_untouched(tmp_path, caplog, case, problem):
    ctx = context(engine=FakeEngine(tmp_path), site="site-2")
    assert CountingExecutor().execute("train", task(0), ctx, Signal()).get_return_code() == ReturnCode.OK
    path, marker = tmp_path / "counting_client_state.pt", tmp_path / "ran"
    spoil(path, case, marker)
    before = path.read_bytes()
    restarted = CountingExecutor()  # the client restarts and finds the spoiled file
    for round_idx in (1, 2, 3):
        caplog.clear()
        reply = restarted.execute("train", task(round_idx), ctx, Signal())
        assert reply.get_return_code() == ReturnCode.EXECUTION_EXCEPTION
        assert path.read_bytes() == before and not os.path.exists(str(path) + ".tmp")  # never replaced
        (line,) = errors(caplog)
        assert f"site-2: checkpoint {path} {problem}" in line, line
        assert "delete it to start site-2 from the global model, or restore it from a backup" in line
        assert restarted.trainer is None and restarted.last_round == -1  # no fresh trainer is kept
    assert not marker.exists()
    # a person deletes the file: the site starts again from the global model and checkpoints round 4
    path.unlink()
    assert restarted.execute("train", task(4), ctx, Signal()).get_return_code() == ReturnCode.OK
    assert restarted.trainer.rounds_done == 1 and torch.load(path, weights_only=True)["round"] == 4


def test_a_broken_checkpoint_fails_before_the_trainer_is_built(tmp_path, caplog):
    ctx = context(engine=FakeEngine(tmp_path), site="site-1")
    (tmp_path / "counting_client_state.pt").write_bytes(b"")
    ex = CountingExecutor()
    assert ex.execute("train", task(1), ctx, Signal()).get_return_code() == ReturnCode.EXECUTION_EXCEPTION
    assert getattr(ex, "builds", 0) == 0  # the site's data were not even loaded


def test_a_good_checkpoint_resumes_and_names_its_trainer(tmp_path):
    ctx = context(engine=FakeEngine(tmp_path), site="site-1")
    ex = CountingExecutor()
    for r in (0, 1):
        ex.execute("train", task(r), ctx, Signal())
    saved = torch.load(tmp_path / "counting_client_state.pt", weights_only=True)
    assert saved["round"] == 1 and saved[TRAINER_CLASS_KEY] == "CountingTrainer"
    restarted = CountingExecutor()
    assert restarted.execute("train", task(2), ctx, Signal()).get_return_code() == ReturnCode.OK
    assert restarted.trainer.rounds_done == 3 and restarted.last_round == 2
    del saved[TRAINER_CLASS_KEY]  # a checkpoint written before the tag existed still resumes
    torch.save(saved, tmp_path / "counting_client_state.pt")
    again = CountingExecutor()
    again.ensure_trainer(task(2), ctx)
    assert again.trainer.rounds_done == 2 and again.last_round == 1


# --------------------------------------------------------------------------- the case: FCL state, BYOL site

ARGS = dict(image_size=32, target_spacing=4.0, features=list(TINY_FEATURES), proj_dim=8, batch_size=8,
            max_steps_per_round=1, device="cpu")


@pytest.fixture(scope="module")
def acdc(tmp_path_factory):
    root = tmp_path_factory.mktemp("acdc")
    write_synthetic_acdc(root, n_patients=4, n_sites=1, seed=0, shape=(48, 48), n_frames=4, slices_range=(5, 6))
    return str(root / "site-1")


def weights(model, round_idx, **meta):
    torch.manual_seed(0)
    s = DXO(DataKind.WEIGHTS, data={k: v.numpy() for k, v in model.state_dict().items()}, meta=meta).to_shareable()
    s.set_header("current_round", round_idx)
    s.set_header("num_rounds", 3)
    return s


@pytest.mark.parametrize("tagged", [True, False])
def test_an_fcl_state_in_a_byol_site_is_named_and_kept(acdc, tmp_path, caplog, tagged):
    fcl_dir, byol_dir = tmp_path / "fcl", tmp_path / "byol"
    fcl_dir.mkdir(), byol_dir.mkdir()
    fcl_ctx = context(site="site-1", engine=FakeEngine(fcl_dir))
    moco = MoCoUNetEncoder(TINY_FEATURES, 8, image_size=32)
    FCLExecutor(data_root=acdc, bank_size=32, **ARGS).execute("train", weights(moco, 0), fcl_ctx, Signal())
    state = torch.load(fcl_dir / "fcl_client_state.pt", weights_only=True)
    assert state[TRAINER_CLASS_KEY] == "FCLLocalTrainer"
    path = byol_dir / "byol_client_state.pt"
    if tagged:
        shutil.copy(fcl_dir / "fcl_client_state.pt", path)
    else:  # without the tag the BYOL trainer's own load refuses the MoCo keys
        del state[TRAINER_CLASS_KEY]
        torch.save(state, path)
    before = path.read_bytes()
    byol = BYOLExecutor(data_root=acdc, pred_hidden=16, **ARGS)
    task_ = weights(BYOLUNetEncoder(TINY_FEATURES, 8, 16, image_size=32), 1, **{MODE_KEY: "fclopt"})
    for _ in range(2):
        caplog.clear()
        reply = byol.execute("train", task_, context(site="site-1", engine=FakeEngine(byol_dir)), Signal())
        assert reply.get_return_code() == ReturnCode.EXECUTION_EXCEPTION and path.read_bytes() == before
        (line,) = errors(caplog)
        assert f"site-1: checkpoint {path} does not fit this site's BYOLLocalTrainer" in line
        assert ("written by a FCLLocalTrainer" if tagged else "Error(s) in loading state_dict") in line
        assert "delete it to start site-1 from the global model" in line
