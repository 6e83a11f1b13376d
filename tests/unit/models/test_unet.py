import pytest
import torch

from fedssl.models import TINY_FEATURES, build_model, encoder_state_from_global, load_encoder_into_unet


def test_encoder_loads_one_to_one_into_unet():
    torch.manual_seed(0)
    moco = build_model("tiny_moco_unet2d", proj_dim=8)
    unet = build_model("tiny_unet2d")
    enc = encoder_state_from_global(moco.state_dict())
    load_encoder_into_unet(unet, enc)
    own = unet.state_dict()
    assert all(torch.equal(own[k], v) for k, v in enc.items())
    assert set(enc) == {k for k in own if k.split(".")[0] in ("conv_0", "down_1", "down_2", "down_3", "down_4")}


def test_moco_outputs_unit_vectors_and_momentum_starts_equal():
    m = build_model("tiny_moco_unet2d", proj_dim=8)
    z = m(torch.rand(3, 1, 32, 32))
    assert z.shape == (3, 8) and torch.allclose(z.norm(dim=1), torch.ones(3), atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(m.main.state_dict().values(), m.momentum.state_dict().values()))


def test_mismatched_encoder_is_rejected():
    moco = build_model("moco_unet2d", features=[8, 8, 16, 16, 32, 8], proj_dim=4)
    with pytest.raises(ValueError, match="same `features`"):
        load_encoder_into_unet(build_model("tiny_unet2d"), encoder_state_from_global(moco.state_dict()))
    with pytest.raises(ValueError, match="main.encoder"):
        encoder_state_from_global({"x": torch.zeros(1)})


def test_registry_and_feature_errors():
    with pytest.raises(ValueError, match="unknown"):
        build_model("resnet")
    with pytest.raises(ValueError, match="6 positive"):
        build_model("unet2d", features=[4, 4])
    assert build_model("tiny_unet2d")(torch.rand(1, 1, 32, 32)).shape == (1, 4, 32, 32)
    assert TINY_FEATURES[0] == 4


def test_server_models_are_seeded():
    from fedssl.models.unet import BYOLUNetEncoder, MoCoUNetEncoder, UNet2D

    for cls in (MoCoUNetEncoder, BYOLUNetEncoder, UNet2D):
        a, b, c = cls(TINY_FEATURES, seed=3), cls(TINY_FEATURES, seed=3), cls(TINY_FEATURES, seed=4)
        sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
        assert any(not torch.equal(sa[k], sc[k]) for k in sa if sa[k].is_floating_point())


def test_projection_head_keeps_the_layout_that_instance_norm_leaves():
    """The bottleneck is instance-normalised per image, so a global average hardly tells a square in one corner from
    the same square in the opposite corner; the head pools a 2 x 2 grid and does (values measured at this seed:
    cosine of the globally pooled features 0.993, of the projections 0.926)."""
    import torch.nn.functional as F

    from fedssl.models.unet import ContrastiveNet, pool_bottleneck

    torch.manual_seed(0)
    net = ContrastiveNet(TINY_FEATURES, 8).eval()
    x = torch.zeros(2, 1, 32, 32)
    x[0, 0, 2:10, 2:10] = 1.0
    x[1, 0, 22:30, 22:30] = 1.0
    with torch.no_grad():
        h = net.encoder(x)
        z = net(x)
    assert F.cosine_similarity(h.mean(dim=(2, 3))[:1], h.mean(dim=(2, 3))[1:]).item() > 0.99
    assert F.cosine_similarity(z[:1], z[1:]).item() < 0.95
    assert pool_bottleneck(h).shape == (2, 16 * 4) and net.head[0].in_features == 16 * 4
