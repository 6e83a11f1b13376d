"""FineTuneViT initialisation, encoder export, checkpoint evaluation and local fine-tuning on tiny synthetic retina."""

import os

import pytest
import torch

from fedssl.core.classification import UntrainedHeadError
from fedssl.data.image_sites import write_site_folders
from fedssl.data.image_synthetic import write_synthetic_images
from fedssl.models.vit import TINY_DECODER, TINY_VIT, MAEViT
from fedssl.vit_finetune import FineTuneViT, evaluate_checkpoint, export_encoder, finetune_local, load_into, read_checkpoint

TINY = dict(img_size=32, patch_size=4, embed_dim=48, depth=2, num_heads=3, drop_path_rate=0.0)
SETTINGS = dict(image_size=32, patch_size=4, embed_dim=48, depth=2, num_heads=3, drop_path_rate=0.0, batch_size=16,
                epochs=2, warmup=1, lr=1e-3, val_fraction=0.2)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    path = tmp_path_factory.mktemp("pre") / "FL_global_model.pt"
    torch.save({"model": MAEViT(**TINY_VIT, **TINY_DECODER, seed=3).state_dict()}, path)
    return str(path)


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    root = tmp_path_factory.mktemp("retina")
    write_synthetic_images(root / "full", "retina", n_images=120, seed=0, image_size=32)
    write_site_folders(root / "full", "retina", root / "parts", n_sites=2, alpha=100.0, seed=0)
    return str(root / "parts")


def test_pretrained_encoder_is_loaded_and_head_is_fresh(pretrained):
    mae = read_checkpoint(pretrained)
    m = FineTuneViT(num_classes=2, **TINY, pretrained_path=pretrained)
    assert m.init_report["init"] == "pretrained" and m.init_report["loaded"] > 0
    assert torch.equal(m.state_dict()["encoder.blocks.0.attn.qkv.weight"], mae["encoder.blocks.0.attn.qkv.weight"])
    assert int(m.head_steps) == 0 and FineTuneViT(num_classes=2, **TINY).init_report == {"init": "scratch"}
    with pytest.raises(ValueError, match="pretrained_path='/nope.pt'"):
        FineTuneViT(num_classes=2, **TINY, pretrained_path="/nope.pt")


def test_export_encoder_drops_the_decoder(pretrained, tmp_path):
    report = export_encoder(pretrained, str(tmp_path / "enc.pt"))
    enc = torch.load(tmp_path / "enc.pt")
    assert enc and all(k.startswith("encoder.") for k in enc) and report["dropped"] > 0
    assert FineTuneViT(num_classes=2, **TINY, pretrained_path=str(tmp_path / "enc.pt")).init_report["loaded"] == report["tensors"] - 2  # encoder.norm.* ignored


def test_load_into_keeps_missing_keys_and_refuses_unknown_ones():
    m = FineTuneViT(num_classes=2, **TINY)
    own_head = m.head.weight.detach().clone()
    state = {k: v for k, v in FineTuneViT(num_classes=2, **TINY, seed=5).state_dict().items() if not k.startswith("head.")}
    assert load_into(m, state, "x") == ["head.bias", "head.weight"] and torch.equal(m.head.weight, own_head)
    with pytest.raises(ValueError, match="decoder.x"):
        load_into(m, {"decoder.x": torch.zeros(1)}, "x")


def test_evaluate_checkpoint_refuses_an_untrained_head(pretrained, parts):
    with pytest.raises(UntrainedHeadError, match=f"checkpoint {pretrained} has no trained classification head; fine-tune it first"):
        evaluate_checkpoint(pretrained, os.path.join(parts, "test"), "retina", SETTINGS)


def test_local_finetuning_selects_on_validation_and_tests(pretrained, parts, tmp_path):
    rows = finetune_local(parts, "retina", {"Fed-MAE": (pretrained, ""), "scratch": ("", "")}, SETTINGS)
    assert [(r["method"], r["site"]) for r in rows] == [("Fed-MAE", "site-1"), ("Fed-MAE", "site-2"),
                                                        ("scratch", "site-1"), ("scratch", "site-2")]
    for r in rows:
        assert r["best_epoch"] in (0, 1) and r["test"]["n"] == 24 and 0 <= r["test"]["accuracy"] <= 1
    # a fine-tuned checkpoint evaluates
    m = FineTuneViT(num_classes=2, **TINY)
    m.head_steps.fill_(3)
    torch.save({"model": m.state_dict()}, tmp_path / "ft.pt")
    assert evaluate_checkpoint(str(tmp_path / "ft.pt"), os.path.join(parts, "test"), "retina", SETTINGS)["n"] == 24
