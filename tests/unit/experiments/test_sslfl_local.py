"""Local (per-site) ViT fine-tuning and checkpoint evaluation on tiny synthetic retina."""

import os

import pytest
import torch

from fedssl.core.classification import UntrainedHeadError
from fedssl.data.image_sites import write_site_folders
from fedssl.data.image_synthetic import write_synthetic_images
from fedssl.experiments.sslfl_local import evaluate_checkpoint, finetune_local
from fedssl.models.vit import TINY_DECODER, TINY_VIT, MAEViT
from fedssl.models.vit_classifier import FineTuneViT

TINY = dict(image_size=32, patch_size=4, embed_dim=48, depth=2, num_heads=3, drop_path_rate=0.0)
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


def test_evaluate_checkpoint_refuses_an_untrained_head(pretrained, parts):
    with pytest.raises(UntrainedHeadError, match=f"checkpoint {pretrained} has no trained classification head; "
                                                 "fine-tune it first"):
        evaluate_checkpoint(pretrained, os.path.join(parts, "test"), "retina", SETTINGS)


def test_local_finetuning_selects_on_validation_and_tests(pretrained, parts, tmp_path):
    rows = finetune_local(parts, "retina", {"Fed-MAE": (pretrained, ""), "scratch": ("", "")}, SETTINGS)
    assert [(r["method"], r["site"]) for r in rows] == [("Fed-MAE", "site-1"), ("Fed-MAE", "site-2"),
                                                        ("scratch", "site-1"), ("scratch", "site-2")]
    for r in rows:
        assert (r["best_epoch"] in (0, 1) and r["test"]["n"] == 24
                and r["test"]["accuracy"] * 24 == pytest.approx(round(r["test"]["accuracy"] * 24)))
    # a fine-tuned checkpoint evaluates
    m = FineTuneViT(num_classes=2, **TINY)
    m.head_steps.fill_(3)
    torch.save({"model": m.state_dict()}, tmp_path / "ft.pt")
    assert evaluate_checkpoint(str(tmp_path / "ft.pt"), os.path.join(parts, "test"), "retina", SETTINGS)["n"] == 24
