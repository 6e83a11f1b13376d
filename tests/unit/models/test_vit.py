import numpy as np
import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

from fedssl.core.patches import patchify
from fedssl.core.state_dict import match_keys
from fedssl.models import TINY_VIT, build_model, encoder_state, load_imagenet_weights, load_pretrained_encoder
from fedssl.models.vit import sincos_pos_embed


@pytest.fixture(scope="module")
def tiny_mae():
    return build_model("tiny_vit_mae")


def test_mae_parameter_names_follow_the_contract(tiny_mae):
    keys = list(tiny_mae.state_dict())
    assert {k.split(".")[0] for k in keys} == {"encoder", "decoder"}
    for k in ["encoder.cls_token", "encoder.pos_embed", "encoder.patch_embed.proj.weight",
              "encoder.patch_embed.proj.bias",
              "encoder.blocks.1.attn.qkv.weight", "encoder.norm.weight", "decoder.embed.weight", "decoder.mask_token",
              "decoder.pos_embed", "decoder.blocks.0.mlp.fc1.weight", "decoder.norm.weight", "decoder.pred.weight"]:
        assert k in keys
    sd = tiny_mae.state_dict()
    d, dd, p = TINY_VIT["embed_dim"], 32, TINY_VIT["patch_size"]
    # Table V of Wu et al., "Federated Self-Supervised Learning for Dermatological Disease Diagnosis": "patch
    # projection" = the encoder's input projection (pixels -> embed_dim) ...
    assert match_keys(keys, ["encoder.patch_embed.*"]) == ["encoder.patch_embed.proj.weight",
                                                           "encoder.patch_embed.proj.bias"]
    assert tuple(sd["encoder.patch_embed.proj.weight"].shape) == (d, 3, p, p)
    # ... "decoder projection" = the decoder's input projection (embed_dim -> decoder width)
    assert match_keys(keys, ["decoder.embed.*"]) == ["decoder.embed.weight", "decoder.embed.bias"]
    assert tuple(sd["decoder.embed.weight"].shape) == (dd, d)
    assert match_keys(keys, ["encoder.cls_token"]) == ["encoder.cls_token"]
    assert tuple(sd["decoder.pred.weight"].shape) == (p * p * 3, dd)


def test_beit_and_classifier_parameter_names():
    beit = build_model("tiny_vit_beit", vocab_size=10)
    keys = set(beit.state_dict())
    assert {"mask_token", "lm_head.weight", "lm_head.bias", "encoder.cls_token", "encoder.blocks.0.ls1.gamma"} <= keys
    assert tuple(beit.state_dict()["lm_head.weight"].shape) == (10, TINY_VIT["embed_dim"])
    cls = build_model("tiny_vit_cls", num_classes=3)
    ckeys = set(cls.state_dict())
    assert {"fc_norm.weight", "head.weight", "head.bias", "encoder.pos_embed"} <= ckeys
    assert not any(k.startswith("encoder.norm.") for k in ckeys)  # mean pooling: fc_norm replaces the final norm


def test_mae_encoder_loads_one_to_one_into_the_classifier(tmp_path):
    tiny_mae = build_model("tiny_vit_mae", seed=9)
    torch.manual_seed(3)
    with torch.no_grad():  # make every tensor distinct from a fresh init
        for v in tiny_mae.parameters():
            v.add_(torch.randn_like(v))
    state = tiny_mae.state_dict()
    cls = build_model("tiny_vit_cls", num_classes=2, seed=5)
    report = load_pretrained_encoder(cls, state)
    own = cls.state_dict()
    enc = encoder_state(state)
    loaded = [k for k in own if k.startswith("encoder.")]
    assert report["loaded"] == len(loaded) and all(torch.equal(own[k], enc[k]) for k in loaded)
    assert report["missing"] == ["fc_norm.bias", "fc_norm.weight", "head.bias", "head.weight"]
    assert set(report["ignored"]) == {k for k in state if k.startswith("decoder.")} | {"encoder.norm.weight",
                                                                                       "encoder.norm.bias"}
    # FLARE's FL_global_model.pt (PTFileModelPersistor: {"model": numpy arrays, ...}) and a plain state-dict file
    flare = tmp_path / "FL_global_model.pt"
    torch.save({"model": {k: v.numpy() for k, v in state.items()}, "train_conf": {"x": 1}}, flare)
    plain = tmp_path / "plain.pt"
    torch.save(state, plain)
    for path in (flare, plain):
        other = build_model("tiny_vit_cls", num_classes=2, seed=7)
        assert load_pretrained_encoder(other, str(path))["loaded"] == len(loaded)
        assert torch.equal(other.state_dict()["encoder.cls_token"], state["encoder.cls_token"])
    assert cls(torch.randn(2, 3, 32, 32)).shape == (2, 2)


def test_load_pretrained_encoder_errors_name_the_file(tmp_path, tiny_mae):
    wide = build_model("tiny_vit_mae", embed_dim=24)
    path = tmp_path / "wide.pt"
    torch.save({"model": wide.state_dict()}, path)
    with pytest.raises(ValueError, match="wide.pt.*shape"):
        load_pretrained_encoder(build_model("tiny_vit_cls", num_classes=2), str(path))
    other = tmp_path / "unet.pt"
    torch.save({"model": {"conv_0.weight": torch.zeros(1)}}, other)
    with pytest.raises(ValueError, match="unet.pt.*no 'encoder"):
        load_pretrained_encoder(build_model("tiny_vit_cls", num_classes=2), str(other))
    with pytest.raises(ValueError, match="missing.pt.*does not exist"):
        load_pretrained_encoder(build_model("tiny_vit_cls", num_classes=2), str(tmp_path / "missing.pt"))
    deep = build_model("tiny_vit_mae", depth=3)
    with pytest.raises(ValueError, match="does not match.*depth"):
        load_pretrained_encoder(build_model("tiny_vit_cls", num_classes=2), deep.state_dict())
    beit = build_model("tiny_vit_beit")
    with pytest.raises(ValueError, match="layer_scale"):
        load_pretrained_encoder(build_model("tiny_vit_cls", num_classes=2), beit.state_dict())
    report = load_pretrained_encoder(build_model("tiny_vit_cls", num_classes=2, layer_scale=0.1), beit.state_dict())
    assert "mask_token" in report["ignored"] and "lm_head.weight" in report["ignored"]


def test_pos_embed_is_resampled_when_only_the_grid_differs(tiny_mae):
    cls = build_model("tiny_vit_cls", num_classes=2, image_size=48)  # 12 x 12 grid instead of 8 x 8
    report = load_pretrained_encoder(cls, tiny_mae.state_dict())
    assert report["loaded"] > 0 and cls.state_dict()["encoder.pos_embed"].shape == (1, 145, TINY_VIT["embed_dim"])
    assert cls(torch.randn(1, 3, 48, 48)).shape == (1, 2)


def test_imagenet_weights_from_a_timm_checkpoint(tmp_path):
    vit = VisionTransformer(img_size=TINY_VIT["image_size"], **{k: v for k, v in TINY_VIT.items() if k != "image_size"},
                            num_classes=1000)
    path = tmp_path / "vit_tiny.pth"
    torch.save(vit.state_dict(), path)
    cls = build_model("tiny_vit_cls", num_classes=2)
    report = load_imagenet_weights(cls, str(path))
    assert torch.equal(cls.state_dict()["encoder.blocks.1.mlp.fc2.weight"], vit.state_dict()["blocks.1.mlp.fc2.weight"])
    assert {"imagenet.head.weight", "encoder.norm.weight"} <= set(report["ignored"])


def test_models_are_seeded_and_leave_the_global_rng_alone():
    torch.manual_seed(0)
    before = torch.rand(1)
    torch.manual_seed(0)
    a, b = build_model("tiny_vit_mae", seed=1), build_model("tiny_vit_mae", seed=1)
    after = torch.rand(1)
    assert torch.equal(before, after)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    c = build_model("tiny_vit_mae", seed=2)
    assert not torch.equal(a.state_dict()["encoder.blocks.0.attn.qkv.weight"],
                           c.state_dict()["encoder.blocks.0.attn.qkv.weight"])
    for name in ("tiny_vit_beit", "tiny_vit_cls"):
        kw = {"num_classes": 2} if name == "tiny_vit_cls" else {}
        x, y = build_model(name, seed=4, **kw), build_model(name, seed=4, **kw)
        assert all(torch.equal(u, v) for u, v in zip(x.state_dict().values(), y.state_dict().values()))


def test_mae_forward_shapes_and_loss_on_masked_patches(tiny_mae):
    imgs = torch.randn(3, 3, 32, 32)
    g = torch.Generator().manual_seed(0)
    loss, pred, mask = tiny_mae(imgs, 0.75, generator=g)
    assert pred.shape == (3, 64, 48) and mask.shape == (3, 64) and mask.dtype == torch.bool
    assert mask.sum(dim=1).tolist() == [48, 48, 48]
    err = ((pred - patchify(imgs, 4)) ** 2).mean(-1)
    assert torch.allclose(loss, err[mask].mean())
    same = tiny_mae(imgs, 0.75, generator=torch.Generator().manual_seed(0))
    assert torch.equal(same[2], mask) and torch.allclose(same[0], loss)


def test_mae_encoder_sees_only_the_visible_patches(tiny_mae):
    """MAE's encoder takes the visible patches only (He et al. sec. 3; issue 47 mutation run): with 75 % masked on
    the tiny 8 x 8 grid, the latent is the class token and 64 - 48 = 16 patches of width 48, and changing the pixels
    of a masked patch changes nothing the encoder computes."""
    tiny_mae.eval()
    imgs = torch.randn(3, 3, 32, 32)
    latent, mask, _ = tiny_mae.forward_encoder(imgs, 0.75, generator=torch.Generator().manual_seed(0))
    assert latent.shape == (3, 17, 48)
    j = int(mask[0].nonzero()[0])
    r, c = divmod(j, 8)
    changed = imgs.clone()
    changed[0, :, 4 * r:4 * r + 4, 4 * c:4 * c + 4] += 5.0
    again, mask2, _ = tiny_mae.forward_encoder(changed, 0.75, generator=torch.Generator().manual_seed(0))
    assert torch.equal(mask2, mask) and torch.allclose(again, latent)


def test_sincos_pos_embed_is_fixed_and_mae_shaped(tiny_mae):
    pe = sincos_pos_embed(8, 2, 3)
    assert pe.shape == (1, 7, 8) and torch.equal(pe[0, 0], torch.zeros(8))
    cols = pe[0, 1:, :4].reshape(2, 3, 4)  # first half encodes the column: equal along a column
    assert torch.allclose(cols[0], cols[1])
    assert not tiny_mae.encoder.pos_embed.requires_grad and not tiny_mae.decoder.pos_embed.requires_grad
    assert torch.allclose(tiny_mae.encoder.pos_embed, sincos_pos_embed(TINY_VIT["embed_dim"], 8, 8))
    learned = build_model("tiny_vit_mae", pos_embed_type="learned")
    assert learned.encoder.pos_embed.requires_grad and learned.decoder.pos_embed.requires_grad


def test_tiny_models_forward_backward():
    imgs = torch.randn(4, 3, 32, 32)
    mae = build_model("tiny_vit_mae")
    mae(imgs, 0.6)[0].backward()
    assert mae.encoder.patch_embed.proj.weight.grad is not None and mae.decoder.embed.weight.grad is not None
    beit = build_model("tiny_vit_beit", vocab_size=16)
    masked = torch.zeros(4, 64, dtype=torch.bool)
    masked[:, :10] = True
    logits = beit(imgs, masked)
    assert logits.shape == (40, 16)
    torch.nn.functional.cross_entropy(logits, torch.zeros(40, dtype=torch.long)).backward()
    assert beit.mask_token.grad is not None and beit.mask_token.grad.abs().sum() > 0
    cls = build_model("tiny_vit_cls", num_classes=3)
    cls(imgs).sum().backward()
    assert cls.head.weight.grad is not None and cls.encoder.cls_token.grad is not None


def test_beit_masked_patches_do_not_see_their_pixels():
    beit = build_model("tiny_vit_beit", vocab_size=16, drop_path_rate=0.0).eval()
    imgs = torch.randn(1, 3, 32, 32)
    masked = torch.zeros(1, 64, dtype=torch.bool)
    masked[0, :8] = True  # the first patch row (8 patches of 4 x 4 px)
    changed = imgs.clone()
    changed[:, :, :4, :] = torch.randn(1, 3, 4, 32)  # pixels of the masked row only
    with torch.no_grad():
        assert torch.allclose(beit(imgs, masked), beit(changed, masked), atol=1e-6)
        assert not torch.allclose(beit(imgs, ~masked), beit(changed, ~masked))


def test_bad_geometry_is_rejected():
    with pytest.raises(ValueError, match="multiple of patch_size"):
        build_model("tiny_vit_mae", image_size=30)
    with pytest.raises(ValueError, match="num_heads"):
        build_model("tiny_vit_cls", num_classes=2, num_heads=5)
    with pytest.raises(ValueError, match="pos_embed_type"):
        build_model("tiny_vit_mae", pos_embed_type="rope")
    assert np.isclose(build_model("tiny_vit_mae", norm_pix_loss=True)(torch.randn(2, 3, 32, 32), 0.5)[0].item() > 0,
                      True)


def test_paper_sized_models_match_the_reported_parameter_counts():
    """SSL-FL (Yan et al., IEEE TMI 2023) section IV-D: Fed-MAE communicates 111.7M parameters, Fed-BEiT 92M,
    fine-tuning 85.8M."""
    with torch.device("meta"):  # shapes only, no memory or init time
        mae = build_model("vit_b16_mae")
        beit = build_model("vit_b16_beit")
        cls = build_model("vit_b16_cls", num_classes=2)
    trainable = sum(p.numel() for p in mae.parameters() if p.requires_grad)  # sin-cos position embeddings are fixed
    assert round(trainable / 1e6, 1) == 111.7
    assert round(sum(p.numel() for p in beit.parameters()) / 1e6) == 92
    assert round(sum(p.numel() for p in cls.parameters()) / 1e6, 1) == 85.8
    assert mae.num_patches == 196 and tuple(mae.decoder.pos_embed.shape) == (1, 197, 512)
