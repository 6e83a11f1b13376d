"""WeightsOnlyPersistor: no job can switch the unsafe load on, and at START_RUN it publishes and logs which
initial weights the run starts from (INIT_PROP)."""

import hashlib
import logging

import pytest
import torch
from nvflare.apis.event_type import EventType
from nvflare.apis.fl_constant import FLContextKey
from nvflare.app_opt.pt.file_model_persistor import PTFileModelPersistor

from fedssl.flare.constants import INIT_PROP
from fedssl.flare.weights_only_persistor import WeightsOnlyPersistor
from fedssl.models.vit import TINY_DECODER, TINY_VIT, MAEViT
from fedssl.models.vit_classifier import FineTuneViT
from fedssl.ops.policy import class_allow_list
from tests.unit.flare.fakes import FakeEngine, context
from tests.unit.models.test_vit_classifier import TINY, timm_stand_in

torch.set_num_threads(1)


def test_a_job_cannot_switch_the_unsafe_load_on():
    p = WeightsOnlyPersistor(model="model", source_ckpt_file_full_name="/x/init.pt")
    assert isinstance(p, PTFileModelPersistor) and p.load_weights_only is True
    for value in (False, True):
        with pytest.raises(ValueError, match="load_weights_only=.*not accepted"):
            WeightsOnlyPersistor(model="model", load_weights_only=value)


def test_sites_allow_the_safe_persistor_not_flares():
    allowed = class_allow_list()
    assert "fedssl.flare.weights_only_persistor.WeightsOnlyPersistor" in allowed
    assert "nvflare.app_opt.pt.file_model_persistor.PTFileModelPersistor" not in allowed


# ------------------------------------------------------------------ the record of the initial weights (issue 13 item 2)
def start_run(model, tmp_path, **kw):
    """A persistor over the model component ``model`` at START_RUN; returns (the FL context, the persistor)."""
    ctx = context(engine=FakeEngine(tmp_path, components={"model": model}),
                  props={FLContextKey.APP_ROOT: str(tmp_path)})
    persistor = WeightsOnlyPersistor(model="model", **kw)
    persistor.handle_event(EventType.START_RUN, ctx)
    return ctx, persistor


def test_imagenet_init_is_published_with_path_and_digest(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    path = str(tmp_path / "vit_base_patch16_224.pth")
    timm_stand_in(path)
    ctx, _ = start_run(FineTuneViT(num_classes=2, **TINY, imagenet_path=path), tmp_path)
    digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
    assert ctx.get_prop(INIT_PROP) == {"init": "imagenet", "path": path, "sha256": digest}
    assert f"initial weights: imagenet from {path} (sha256 {digest})" in caplog.text


def test_random_init_is_published_and_the_warning_names_the_argument_to_set(tmp_path, caplog):
    ctx, _ = start_run(FineTuneViT(num_classes=2, **TINY), tmp_path)
    assert ctx.get_prop(INIT_PROP) == {"init": "random", "path": "", "sha256": ""}
    (line,) = [r for r in caplog.records if "initial weights" in r.getMessage()]
    assert line.levelname == "WARNING" and 'RANDOM initialisation of FineTuneViT' in line.getMessage()
    assert 'set "imagenet_path"' in line.getMessage()
    ctx, _ = start_run(MAEViT(**TINY_VIT, **TINY_DECODER), tmp_path)  # pre-training starts from random weights
    assert ctx.get_prop(INIT_PROP) == {"init": "random", "path": "", "sha256": ""}


def test_a_source_checkpoint_wins_and_a_missing_one_is_named(tmp_path):
    ckpt = tmp_path / "custom" / "init.pt"
    ckpt.parent.mkdir()
    torch.save({"w": torch.ones(2)}, ckpt)
    ctx, _ = start_run(FineTuneViT(num_classes=2, **TINY), tmp_path, source_ckpt_file_full_name="init.pt")
    digest = hashlib.sha256(ckpt.read_bytes()).hexdigest()
    assert ctx.get_prop(INIT_PROP) == {"init": "checkpoint", "path": str(ckpt), "sha256": digest}
    with pytest.raises(ValueError, match=r"source checkpoint /nope/init\.pt does not exist"):
        start_run(FineTuneViT(num_classes=2, **TINY), tmp_path, source_ckpt_file_full_name="/nope/init.pt")


def test_a_model_with_a_malformed_record_is_refused(tmp_path):
    model = FineTuneViT(num_classes=2, **TINY)
    model.initial_weights = {"init": "imagenet"}
    with pytest.raises(ValueError, match=r"FineTuneViT\.initial_weights=.* is not a record"):
        start_run(model, tmp_path)
