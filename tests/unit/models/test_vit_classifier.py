"""FineTuneViT initialisation, checkpoint reading / loading and encoder export (tiny ViT)."""

import hashlib

import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

from fedssl.models.vit import TINY_DECODER, TINY_VIT, MAEViT
from fedssl.models.vit_classifier import FineTuneViT, export_encoder, load_into, read_checkpoint

torch.set_num_threads(1)

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


def timm_stand_in(path, embed_dim=48):
    """A hand-made stand-in for timm's ``vit_base_patch16_224`` state dict at the tiny shape: timm's key names
    (cls_token, blocks.*, norm.*, head.*), tensor number i filled with the constant (i + 1) / 100."""
    keys = VisionTransformer(img_size=32, patch_size=4, embed_dim=embed_dim, depth=2, num_heads=3,
                             num_classes=1000).state_dict()
    state = {k: torch.full_like(v, (i + 1) / 100) for i, (k, v) in enumerate(keys.items())}
    torch.save(state, path)
    return state


def test_imagenet_weights_load_by_timm_name_and_are_recorded_with_their_digest(tmp_path):
    """Issue 13 item 2 (SSL-FL "ViT ImageNet" rows): every timm encoder tensor lands on encoder.<name>; timm's
    ImageNet head and final norm are not used (fc_norm / head stay fresh); the record names file and SHA-256."""
    path = str(tmp_path / "vit_base_patch16_224.pth")
    state = timm_stand_in(path)
    m = FineTuneViT(num_classes=2, **TINY, imagenet_path=path)
    own = m.state_dict()
    for k, v in state.items():
        if k.startswith(("head.", "norm.")):
            continue
        assert torch.equal(own["encoder." + k], v), k
    assert torch.equal(own["encoder.cls_token"], torch.full((1, 1, 48), 0.01))  # key 0: 1 / 100
    assert (torch.equal(own["fc_norm.weight"], torch.ones(48))
            and not torch.equal(own["head.weight"], state["head.weight"][:2]))
    digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
    assert m.initial_weights == {"init": "imagenet", "path": path, "sha256": digest} and m.init_fix == ""
    scratch = FineTuneViT(num_classes=2, **TINY)
    assert scratch.initial_weights == {"init": "random", "path": "", "sha256": ""}
    assert '"imagenet_path"' in scratch.init_fix


def test_a_missing_or_ill_fitting_imagenet_file_is_an_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match="imagenet_path='/nope/vit.pth' is invalid; the file does not exist"):
        FineTuneViT(num_classes=2, **TINY, imagenet_path="/nope/vit.pth")
    wrong = str(tmp_path / "vit_small.pth")
    timm_stand_in(wrong, embed_dim=24)  # another ViT width
    with pytest.raises(ValueError, match=wrong.replace(".", r"\.") + r": 'encoder\.cls_token' has shape \(1, 1, 24\)"):
        FineTuneViT(num_classes=2, **TINY, imagenet_path=wrong)


def test_a_pretrained_encoder_is_recorded_as_a_checkpoint(pretrained):
    m = FineTuneViT(num_classes=2, **TINY, pretrained_path=pretrained)
    digest = hashlib.sha256(open(pretrained, "rb").read()).hexdigest()
    assert m.initial_weights == {"init": "checkpoint", "path": pretrained, "sha256": digest}


def test_export_encoder_drops_the_decoder(pretrained, tmp_path):
    report = export_encoder(pretrained, str(tmp_path / "enc.pt"))
    enc = torch.load(tmp_path / "enc.pt")
    assert enc and all(k.startswith("encoder.") for k in enc) and report["dropped"] > 0
    assert (FineTuneViT(num_classes=2, **TINY, pretrained_path=str(tmp_path / "enc.pt")).init_report["loaded"]
            == report["tensors"] - 2)  # encoder.norm.* ignored


def test_load_into_keeps_missing_keys_and_refuses_unknown_ones():
    m = FineTuneViT(num_classes=2, **TINY)
    own_head = m.head.weight.detach().clone()
    state = {k: v for k, v in FineTuneViT(num_classes=2, **TINY, seed=5).state_dict().items()
             if not k.startswith("head.")}
    assert load_into(m, state, "x") == ["head.bias", "head.weight"] and torch.equal(m.head.weight, own_head)
    with pytest.raises(ValueError, match="decoder.x"):
        load_into(m, {"decoder.x": torch.zeros(1)}, "x")
