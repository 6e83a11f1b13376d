"""The model package imports a family's library only when that family is used."""

import json
import subprocess
import sys

import pytest
import torch

import fedssl.models as models


def test_a_vit_site_never_imports_monai_and_the_package_alone_imports_no_family():
    # a fresh interpreter: the package first (nothing heavy), then what a Fed-MAE site builds and runs
    code = """import json, sys
heavy = lambda: sorted(x for x in ("monai", "timm", "transformers", "torchvision") if x in sys.modules)
import fedssl.models as m
seen = {"package": heavy()}
m.build_model("tiny_vit_mae")
import fedssl.flare.mim_executor
seen["vit_site"] = heavy()
print(json.dumps(seen))"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"package": [], "vit_site": ["timm", "torchvision"]}


def test_lazy_names_resolve_to_their_modules_and_unknown_names_fail():
    from fedssl.models import vit
    assert models.MAEViT is vit.MAEViT and models.TINY_FEATURES == models.unet.TINY_FEATURES
    assert set(models.__all__) <= set(dir(models))
    with pytest.raises(AttributeError, match="no attribute 'NoSuchNet'"):
        models.NoSuchNet  # noqa: B018


def test_tiny_presets_reach_the_constructors():
    mae = models.build_model("tiny_vit_mae")
    assert mae.encoder.embed_dim == models.TINY_VIT["embed_dim"] == 48
    assert mae.decoder.embed.out_features == models.TINY_DECODER["decoder_embed_dim"] == 32
    assert models.build_model("tiny_vit_beit").lm_head.out_features == models.TINY_VOCAB == 64
    assert models.build_model("tiny_byol_unet2d").predictor[0].out_features == 16
    unet = models.build_model("tiny_unet2d", out_channels=3)
    # BasicUNet's first block has features[0] output channels: the tiny preset's first width, 4 (the paper's is 48)
    assert unet.conv_0.conv_0.conv.out_channels == models.TINY_FEATURES[0] == 4
    assert unet(torch.zeros(1, 1, 32, 32)).shape == (1, 3, 32, 32)  # a keyword argument reaches the constructor
