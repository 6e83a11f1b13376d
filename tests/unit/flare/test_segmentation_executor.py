"""SegmentationExecutor on tiny synthetic ACDC: one real train task, resume, and abort within one step."""

import os

import numpy as np
import pytest
import torch
from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.signal import Signal

from fedssl.core.seeds import site_seed
from fedssl.data.acdc import load_site
from fedssl.data.acdc_synthetic import write_synthetic_acdc
from fedssl.eval.segmentation import dice_per_volume, mean_dice
from fedssl.flare.segmentation_executor import SegmentationExecutor
from fedssl.models.unet import TINY_FEATURES, build_unet
from fedssl.train.protocol import site_split
from tests.unit.flare.fakes import CountingSignal, FakeEngine, context

torch.set_num_threads(1)
ARGS = dict(image_size=32, target_spacing=4.0, features=list(TINY_FEATURES), n_labelled=1, n_folds=2, fold=0,
            batch_size=4, max_steps_per_epoch=2, device="cpu")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("acdc_seg")
    write_synthetic_acdc(root, n_patients=4, n_sites=1, seed=0, shape=(48, 48), n_frames=2, slices_range=(4, 5))
    return str(root / "site-1")


def task(round_idx=0):
    torch.manual_seed(0)
    s = DXO(DataKind.WEIGHTS,
            data={k: v.numpy() for k, v in build_unet(TINY_FEATURES).state_dict().items()}).to_shareable()
    s.set_header("current_round", round_idx)
    s.set_header("num_rounds", 3)
    return s


def test_train_task_reports_validation_dice_and_resumes(data, tmp_path):
    c = context(site="site-1", engine=FakeEngine(tmp_path))
    ex = SegmentationExecutor(data_root=data, **ARGS)
    out = from_shareable(ex.execute("train", task(0), c, Signal()))
    assert out.data_kind == DataKind.WEIGHTS
    n_slices = sum(v.n_slices for v in ex.trainer.train_volumes)
    assert out.get_meta_prop("num_samples") == n_slices and out.get_meta_prop(MetaKey.NUM_STEPS_CURRENT_ROUND) == 2
    torch.manual_seed(0)  # the received global model, evaluated before local training
    received = build_unet(TINY_FEATURES)
    received.load_state_dict({k: torch.as_tensor(v) for k, v in from_shareable(task(0)).data.items()})
    expected = mean_dice(dice_per_volume(received, ex.trainer.val_volumes))["mean"]
    assert out.get_meta_prop("val_dice") == pytest.approx(expected) and np.isfinite(out.get_meta_prop("loss"))
    assert os.path.isfile(tmp_path / "seg_client_state.pt")
    ex2 = SegmentationExecutor(data_root=data, **ARGS)  # a restarted client continues the schedule
    ex2.execute("train", task(1), c, Signal())
    assert ex2.last_round == 1 and ex2.trainer.trainer.step == 4


def test_abort_during_a_round_stops_within_one_step(data, tmp_path):
    c = context(site="site-1", engine=FakeEngine(tmp_path))
    ex = SegmentationExecutor(data_root=data, **dict(ARGS, max_steps_per_epoch=0))
    signal = CountingSignal(after=2)  # read before the first step (no), before the second (yes)
    reply = ex.execute("train", task(0), c, signal)
    assert reply.get_return_code() == ReturnCode.TASK_ABORTED
    assert ex.trainer.trainer.step == 1 and signal.reads == 2
    assert not os.path.isfile(tmp_path / "seg_client_state.pt") and ex.last_round == -1


def test_renamed_epoch_cap_is_checked():
    with pytest.raises(ValueError, match="max_steps_per_epoch=-1"):
        SegmentationExecutor(**dict(ARGS, max_steps_per_epoch=-1))
    with pytest.raises(TypeError):
        SegmentationExecutor(max_steps_per_round=2)


@pytest.mark.parametrize("split_seed", [0, 3])
def test_patients_from_the_site_split_and_batches_from_the_site_seed(data, tmp_path, split_seed):
    """Issue 13 item 9: the labelled / validation patients are the local protocol's (site_split seeded by
    site_seed(split_seed, site)); batches and augmentations use site_seed(seed, site)."""
    ex = SegmentationExecutor(data_root=data, seed=2, split_seed=split_seed, **ARGS)
    ex.ensure_trainer(task(0), context(site="site-1", engine=FakeEngine(tmp_path)))
    volumes = load_site(data, with_labels=True, target_spacing=4.0, image_size=32, site="site-1")
    split = site_split({"site-1": volumes}, 0, 1, n_folds=2, split_seed=split_seed)["site-1"]
    assert sorted({v.patient_id for v in ex.trainer.train_volumes}) == split["train_patients"]
    assert sorted({v.patient_id for v in ex.trainer.val_volumes}) == split["val_patients"]
    assert ex.trainer.trainer.seed == ex.trainer.trainer.generator.initial_seed() == site_seed(2, "site-1")
    with pytest.raises(ValueError, match="split_seed=-1"):
        SegmentationExecutor(split_seed=-1)
