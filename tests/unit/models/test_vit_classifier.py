"""FineTuneViT initialisation, checkpoint reading / loading and encoder export (tiny ViT)."""

import pytest
import torch

from fedssl.models.vit import TINY_DECODER, TINY_VIT, MAEViT
from fedssl.models.vit_classifier import FineTuneViT, export_encoder, load_into, read_checkpoint

TINY = dict(image_size=32, patch_size=4, embed_dim=48, depth=2, num_heads=3, drop_path_rate=0.0)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    path = tmp_path_factory.mktemp("pre") / "FL_global_model.pt"
    torch.save({"model": MAEViT(**TINY_VIT, **TINY_DECODER, seed=3).state_dict()}, path)
    return str(path)


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
