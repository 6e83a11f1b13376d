"""ClassifierExecutor on tiny synthetic retina data: argument checks, train / test tasks, model selection metadata."""

import logging
import math
import os
from collections import Counter

import numpy as np
import pytest
import torch
from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.signal import Signal

from fedssl.data.image_synthetic import write_synthetic_images
from fedssl.data.images import load_image_records
from fedssl.flare.classifier_executor import ClassifierExecutor
from fedssl.models.vit import TINY_VIT
from fedssl.models.vit_classifier import FineTuneViT
from tests.unit.flare.fakes import CountingSignal, FakeEngine, context

TINY = dict(image_size=TINY_VIT["image_size"], patch_size=TINY_VIT["patch_size"], embed_dim=TINY_VIT["embed_dim"],
            depth=TINY_VIT["depth"], num_heads=TINY_VIT["num_heads"], drop_path_rate=0.0)
ARGS = dict(dataset="retina", batch_size=16, lr=1e-3, warmup_rounds=1, val_fraction=0.2, eval_batch_size=64,
            device="cpu", **TINY)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("retina")
    write_synthetic_images(root / "site-1", "retina", n_images=60, seed=0, image_size=32)
    write_synthetic_images(root / "test", "retina", n_images=24, seed=1, image_size=32)
    return str(root)


def initial_weights(num_classes=2):
    model = FineTuneViT(num_classes=num_classes, image_size=32, patch_size=4, embed_dim=48, depth=2, num_heads=3,
                        drop_path_rate=0.0)
    return {k: v.numpy() for k, v in model.state_dict().items()}


def task(weights, round_idx=0, num_rounds=3):
    s = DXO(DataKind.WEIGHTS, data=weights).to_shareable()
    s.set_header("current_round", round_idx)
    s.set_header("num_rounds", num_rounds)
    return s


def run(executor, tmp_path, shareable, name="train", site="site-1"):
    return executor.execute(name, shareable, context(site=site, engine=FakeEngine(tmp_path)), Signal())


def round_half_up(x):
    return int(math.floor(x + 0.5))


@pytest.mark.parametrize("kw, needle", [
    ({"dataset": "cifar"}, "dataset='cifar'"),
    ({"image_size": 30}, "image_size=30"),
    ({"embed_dim": 50}, "embed_dim=50"),
    ({"lr": 0}, "lr=0"),
    ({"batch_size": 0}, "batch_size=0"),
    ({"label_fraction": 0}, "label_fraction=0"),
    ({"label_fraction": 1.5}, "label_fraction=1.5"),
    ({"val_fraction": 0}, "val_fraction=0"),
    ({"fedprox_mu": -1}, "fedprox_mu=-1"),
    ({"layer_scale": 0}, "layer_scale=0"),
    ({"max_steps_per_epoch": -1}, "max_steps_per_epoch=-1"),
    ({"device": "tpu"}, "device='tpu'"),
])
def test_rejects_bad_args_naming_them(kw, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        ClassifierExecutor(**{**ARGS, **kw})


def test_args_stored_verbatim():
    ex = ClassifierExecutor(**{**ARGS, "fedprox_mu": 0.001, "label_fraction": 0.3})
    assert ex.fedprox_mu == 0.001 and ex.label_fraction == 0.3 and ex.image_size == 32 and ex.layer_scale is None


@pytest.mark.parametrize("fraction", [0.1, 0.3, 0.7, 1.0])
def test_train_uploads_weights_with_the_labelled_count(data, tmp_path, fraction):
    site = os.path.join(data, "site-1")
    counts = Counter(r.label for r in load_image_records(site, "retina"))
    expected = 0
    for n in counts.values():  # stratified: validation first (20 %), then the labelled fraction of the rest
        n_train = n - min(n - 1, round_half_up(0.2 * n))
        expected += n_train if fraction == 1.0 else min(n_train, max(1, round_half_up(fraction * n_train)))
    ex = ClassifierExecutor(data_root=site, label_fraction=fraction, max_steps_per_epoch=1, **{
        k: v for k, v in ARGS.items()})
    out = from_shareable(run(ex, tmp_path, task(initial_weights())))
    assert out.data_kind == DataKind.WEIGHTS
    assert out.get_meta_prop("num_samples") == expected
    assert out.get_meta_prop(MetaKey.NUM_STEPS_CURRENT_ROUND) == 1
    assert int(out.data["head_steps"]) == 1


def test_validation_metrics_of_the_received_model_go_to_initial_metrics(data, tmp_path):
    site = os.path.join(data, "site-1")
    ex = ClassifierExecutor(data_root=site, **ARGS)
    first = from_shareable(run(ex, tmp_path, task(initial_weights(), 0)))
    assert first.get_meta_prop(MetaKey.INITIAL_METRICS) is None  # round 0: the head was never trained
    second = from_shareable(run(ex, tmp_path, task(first.data, 1)))
    val = second.get_meta_prop(MetaKey.INITIAL_METRICS)
    n_val = sum(min(n - 1, round_half_up(0.2 * n))
                for n in Counter(r.label for r in load_image_records(site, "retina")).values())
    correct = val["val_accuracy"] * n_val  # accuracy of n_val images: a whole number of them right
    assert correct == pytest.approx(round(correct)) and n_val == 12
    assert {"val_auc", "val_macro_f1", "val_recall_dr", "val_specificity_no_dr"} <= set(val)
    # the metrics are those of the RECEIVED model (before local training): recompute them
    ex2 = ClassifierExecutor(data_root=site, **ARGS)
    trainer = ex2.build_trainer(context(site="site-1", engine=FakeEngine(tmp_path / "other")), 3)
    trainer.load_global(first.data)
    again = trainer.evaluate("val", "check")
    assert again["n"] == n_val and again["accuracy"] == pytest.approx(val["val_accuracy"])
    lines = open(tmp_path / "cls_metrics.jsonl").read().splitlines()
    assert len(lines) == 2 and '"val_accuracy"' in lines[1]


def test_test_task_returns_metrics_on_the_partition_test_folder(data, tmp_path):
    ex = ClassifierExecutor(data_root=os.path.join(data, "site-1"), max_steps_per_epoch=2, **ARGS)
    trained = from_shareable(run(ex, tmp_path, task(initial_weights()))).data
    s = DXO(DataKind.WEIGHTS, data=trained, meta={"model_source": "best global model"}).to_shareable()
    out = from_shareable(run(ClassifierExecutor(data_root=os.path.join(data, "site-1"), **ARGS), tmp_path, s, "test"))
    assert out.data_kind == DataKind.METRICS
    assert out.data["n"] == 24 == out.get_meta_prop("n_test")  # data/test, beside the site folder
    correct = out.data["accuracy"] * 24  # a whole number of the 24 test images right
    assert set(out.data["per_class"]) == {"no_dr", "dr"} and correct == pytest.approx(round(correct))


def test_evaluation_refuses_an_untrained_head(data, tmp_path, caplog):
    s = DXO(DataKind.WEIGHTS, data=initial_weights(),
            meta={"model_source": "/runs/x/FL_global_model.pt"}).to_shareable()
    ex = ClassifierExecutor(data_root=os.path.join(data, "site-1"), **ARGS)
    with caplog.at_level(logging.ERROR):
        reply = run(ex, tmp_path, s, "test")
    assert reply.get_return_code() == ReturnCode.EXECUTION_EXCEPTION
    assert "checkpoint /runs/x/FL_global_model.pt has no trained classification head; fine-tune it first" in caplog.text


def test_missing_test_folder_is_a_clear_error(tmp_path, data, caplog):
    import shutil

    shutil.copytree(os.path.join(data, "site-1"), tmp_path / "alone" / "site-1")
    ex = ClassifierExecutor(data_root=str(tmp_path / "alone" / "site-1"), **ARGS)
    trained = initial_weights()
    trained["head_steps"] = np.array(5)
    with caplog.at_level(logging.ERROR):
        reply = run(ex, tmp_path, task(trained), "test")
    assert reply.get_return_code() == ReturnCode.EXECUTION_EXCEPTION
    assert "set test_root" in caplog.text and str(tmp_path / "alone" / "test") in caplog.text


def test_wrong_model_configuration_is_refused(data, tmp_path, caplog):
    ex = ClassifierExecutor(data_root=os.path.join(data, "site-1"), **ARGS)
    with caplog.at_level(logging.ERROR):
        reply = run(ex, tmp_path, task(initial_weights(num_classes=3)))
    assert reply.get_return_code() == ReturnCode.EXECUTION_EXCEPTION
    assert "head.weight has shape (3, 48)" in caplog.text
    extra = {**initial_weights(), "decoder.pred.weight": np.zeros((2, 2), dtype=np.float32)}
    with caplog.at_level(logging.ERROR):
        reply = run(ex, tmp_path, task(extra))
    assert reply.get_return_code() == ReturnCode.EXECUTION_EXCEPTION and "decoder.pred.weight" in caplog.text


def test_optimiser_state_survives_a_client_restart(data, tmp_path):
    site = os.path.join(data, "site-1")
    ex = ClassifierExecutor(data_root=site, max_steps_per_epoch=2, fedprox_mu=0.001, **ARGS)
    out = from_shareable(run(ex, tmp_path, task(initial_weights(), 0)))
    assert ex.trainer.trainer.fedprox_mu == 0.001
    state = torch.load(tmp_path / "cls_client_state.pt", weights_only=True)
    assert state["round"] == 0 and state["trainer"]["step"] == 2
    restarted = ClassifierExecutor(data_root=site, max_steps_per_epoch=2, fedprox_mu=0.001, **ARGS)
    run(restarted, tmp_path, task(out.data, 1))
    assert restarted.trainer.trainer.step == 4  # resumed the step count (and AdamW moments) from the checkpoint


def test_an_abort_during_the_round_stops_within_one_step(data, tmp_path):
    ex = ClassifierExecutor(data_root=os.path.join(data, "site-1"), **ARGS)
    reply = ex.execute("train", task(initial_weights()), context(site="site-1", engine=FakeEngine(tmp_path)),
                       CountingSignal(after=2))
    assert reply.get_return_code() == ReturnCode.TASK_ABORTED
    assert ex.trainer.trainer.step == 1  # one step, then the abort
    assert not os.path.exists(tmp_path / "cls_client_state.pt") and not os.path.exists(tmp_path / "cls_metrics.jsonl")



def test_loader_workers_reach_the_trainer(data, tmp_path, loader_workers):
    ex = ClassifierExecutor(data_root=os.path.join(data, "site-1"), max_steps_per_epoch=1, workers=1, **ARGS)
    out = from_shareable(run(ex, tmp_path, task(initial_weights())))
    assert np.isfinite(out.get_meta_prop("loss")) and loader_workers and set(loader_workers) == {1}
