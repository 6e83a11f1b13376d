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
    assert all(torch.equal(a, b) for a, b in zip(m.main.state_dict().values(), m.momentum.state_dict().values()))
    z = m(torch.rand(3, 1, 32, 32))  # training mode: the main network's BatchNorm running statistics move
    assert z.shape == (3, 8) and torch.allclose(z.norm(dim=1), torch.ones(3), atol=1e-5)


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
    net = ContrastiveNet(TINY_FEATURES, 8, norm="instance", head="grid").eval()
    x = torch.zeros(2, 1, 32, 32)
    x[0, 0, 2:10, 2:10] = 1.0
    x[1, 0, 22:30, 22:30] = 1.0
    with torch.no_grad():
        h = net.encoder(x)
        z = net(x)
    assert F.cosine_similarity(h.mean(dim=(2, 3))[:1], h.mean(dim=(2, 3))[1:]).item() > 0.99
    assert F.cosine_similarity(z[:1], z[1:]).item() < 0.95
    assert pool_bottleneck(h).shape == (2, 16 * 4) and net.head[0].in_features == 16 * 4


# ---------------------------------------------------------------- issue 44: the reference code's network
# Chaitanya et al. 2020, krishnabits001/domain_specific_cl: BatchNorm after every encoder convolution (models.py 98-129,
# layers_bn.py 58-65, 177) and the projection head flatten -> 1024 -> 128 without biases (models.py 155-158).

def _convolutions(module):
    from monai.networks.blocks import Convolution

    return [m for m in module.modules() if isinstance(m, Convolution)]


@pytest.mark.parametrize("build", ["encoder", "moco_main", "moco_momentum", "byol_online", "byol_target"])
def test_batch_norm_follows_every_encoder_convolution(build):
    from monai.networks.blocks import ADN

    from fedssl.models.unet import BN_EPS, BN_MOMENTUM, BYOLUNetEncoder, MoCoUNetEncoder, UNetEncoder

    encoder = {"encoder": lambda: UNetEncoder(TINY_FEATURES),
               "moco_main": lambda: MoCoUNetEncoder(TINY_FEATURES, 8, image_size=32).main.encoder,
               "moco_momentum": lambda: MoCoUNetEncoder(TINY_FEATURES, 8, image_size=32).momentum.encoder,
               "byol_online": lambda: BYOLUNetEncoder(TINY_FEATURES, 8, 16, image_size=32).online.encoder,
               "byol_target": lambda: BYOLUNetEncoder(TINY_FEATURES, 8, 16, image_size=32).target.encoder}[build]()
    convs = _convolutions(encoder)
    assert len(convs) == 10 == sum(isinstance(m, torch.nn.Conv2d) for m in encoder.modules())  # 5 levels x 2
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in encoder.modules()) == 10
    assert not any(isinstance(m, torch.nn.InstanceNorm2d) for m in encoder.modules())
    for block in convs:  # conv, then norm (then dropout, activation): the bias, BN, activation order of layers_bn.py
        conv, adn = list(block.children())
        assert isinstance(conv, torch.nn.Conv2d) and isinstance(adn, ADN)
        bn = list(adn.children())[0]
        assert isinstance(bn, torch.nn.BatchNorm2d) and bn.num_features == conv.out_channels
        assert bn.eps == BN_EPS == 1e-3 and bn.momentum == BN_MOMENTUM and bn.affine and bn.track_running_stats


def test_batch_norm_unet_normalises_decoder_too_and_is_the_default():
    from fedssl.models.unet import UNet2D, build_unet, unet_norm

    for unet in (build_unet(TINY_FEATURES), UNet2D(TINY_FEATURES)):
        assert unet_norm(unet) == "batch"
        # 9 TwoConv blocks (5 encoder levels, 4 decoder levels) x 2 convolutions, each normalised; final 1x1 conv not
        assert len(_convolutions(unet)) == 18 == sum(isinstance(m, torch.nn.BatchNorm2d) for m in unet.modules())


def test_instance_norm_keeps_the_monai_default_unet():
    from monai.networks.nets import BasicUNet

    from fedssl.models.unet import UNet2D, UNetEncoder, build_unet

    monai_default = BasicUNet(spatial_dims=2, in_channels=1, out_channels=4, features=TINY_FEATURES)
    assert repr(build_unet(TINY_FEATURES, norm="instance")) == repr(monai_default)
    assert repr(UNet2D(TINY_FEATURES, norm="instance")).replace("UNet2D(", "BasicUNet(", 1) == repr(monai_default)
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in UNetEncoder(TINY_FEATURES, norm="instance").modules())
    enc = UNetEncoder(TINY_FEATURES, norm="instance")
    assert [repr(getattr(enc, n)) for n in ("conv_0", "down_4")] == [repr(monai_default.conv_0),
                                                                       repr(monai_default.down_4)]


@pytest.mark.parametrize("image_size", [32, 64])
def test_flatten_head_takes_the_whole_bottleneck(image_size):
    from fedssl.models.unet import FLATTEN_HIDDEN, ContrastiveNet

    net = ContrastiveNet(TINY_FEATURES, 8, image_size=image_size)  # the default head: flatten
    c4, side = TINY_FEATURES[4], image_size // 16
    first, act, last = net.head
    assert first.in_features == c4 * side**2 and first.out_features == FLATTEN_HIDDEN == 1024
    assert isinstance(act, torch.nn.ReLU) and (last.in_features, last.out_features) == (1024, 8)
    assert first.bias is None and last.bias is None  # use_bias=False in the reference
    seen = []
    net.head[0].register_forward_hook(lambda m, inp, out: seen.append(inp[0]))
    x = torch.rand(3, 1, image_size, image_size)
    z = net(x)
    assert z.shape == (3, 8) and torch.allclose(z.norm(dim=1), torch.ones(3), atol=1e-5)
    assert torch.equal(seen[0], net.encoder(x).flatten(1))  # every bottleneck value, unpooled (eval: same stats)
    with pytest.raises(ValueError, match="built for"):
        net(torch.rand(2, 1, image_size + 16, image_size + 16))


def test_grid_head_is_the_former_head():
    from fedssl.models.unet import POOL_GRID, ContrastiveNet

    net = ContrastiveNet(TINY_FEATURES, 8, head="grid", image_size=64)
    c4 = TINY_FEATURES[4]
    assert (net.head[0].in_features, net.head[0].out_features, net.head[2].out_features) == (c4 * POOL_GRID**2, c4, 8)
    assert net.head[0].bias is not None and net(torch.rand(2, 1, 64, 64)).shape == (2, 8)


@pytest.mark.parametrize("cls", ["build_unet", "UNet2D", "UNetEncoder", "ContrastiveNet", "MoCoUNetEncoder",
                                 "BYOLUNetEncoder"])
def test_bad_norm_and_head_name_the_argument(cls):
    import fedssl.models.unet as unet

    build = getattr(unet, cls)
    with pytest.raises(ValueError, match=r"argument norm='layer' is invalid; use \"batch\""):
        build(TINY_FEATURES, norm="layer")
    if cls in ("ContrastiveNet", "MoCoUNetEncoder", "BYOLUNetEncoder"):
        with pytest.raises(ValueError, match=r"argument head='pool' is invalid; use \"flatten\""):
            build(TINY_FEATURES, head="pool", image_size=32)
        with pytest.raises(ValueError, match=r"argument image_size=40 is invalid; use a multiple of 16"):
            build(TINY_FEATURES, image_size=40)


def test_settings_refuse_bad_norm_and_head():
    from fedssl.train.byol import BYOLSettings
    from fedssl.train.fcl import FCLSettings
    from fedssl.train.segmentation import SegmentationSettings

    for settings in (FCLSettings, BYOLSettings, SegmentationSettings):
        with pytest.raises(ValueError, match="X: argument norm='group'"):
            settings(norm="group").check("X")
    for settings in (FCLSettings, BYOLSettings):
        with pytest.raises(ValueError, match="X: argument head='mean'"):
            settings(head="mean").check("X")
        assert (settings().norm, settings().head) == ("batch", "flatten")
    assert SegmentationSettings().norm == "batch"


def _trained_moco():
    """A MoCo global model whose BatchNorm running statistics have moved (3 training-mode batches)."""
    from fedssl.models.unet import MoCoUNetEncoder

    torch.manual_seed(0)
    moco = MoCoUNetEncoder(TINY_FEATURES, 8, image_size=32, seed=3)
    for _ in range(3):
        moco.main(torch.rand(4, 1, 32, 32) * 3 + 1)
    return moco


def test_encoder_with_running_statistics_loads_exactly_into_the_finetuning_unet():
    from fedssl.models.unet import UNet2D
    from fedssl.train.segmentation import init_unet

    enc = encoder_state_from_global(_trained_moco().state_dict())
    stats = [k for k in enc if k.endswith(("running_mean", "running_var", "num_batches_tracked"))]
    assert len(stats) == 30  # 10 BatchNorm layers x 3 buffers
    assert int(enc["down_4.convs.conv_1.adn.N.num_batches_tracked"]) == 3
    assert not torch.equal(enc["down_4.convs.conv_1.adn.N.running_var"], torch.ones(16))  # moved from the start
    for unet in (UNet2D(TINY_FEATURES, seed=1), init_unet(enc, features=TINY_FEATURES, seed=1, norm="batch")):
        if isinstance(unet, UNet2D):
            load_encoder_into_unet(unet, enc)
        own = unet.state_dict()
        assert all(torch.equal(own[k], v) and own[k].dtype == v.dtype for k, v in enc.items())
    with pytest.raises(ValueError, match="pre-trained encoder has norm 'batch' but the U-Net norm 'instance'"):
        init_unet(enc, features=TINY_FEATURES, norm="instance")


def test_contrastive_net_is_rebuilt_from_its_state():
    from fedssl.models.unet import ContrastiveNet, contrastive_net_like

    main = _trained_moco().main
    net = contrastive_net_like(main.state_dict())
    assert (net.norm, net.head_kind, net.image_size) == ("batch", "flatten", 32)
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), main.state_dict().values()))
    grid = contrastive_net_like(ContrastiveNet(TINY_FEATURES, 8, norm="instance", head="grid").state_dict())
    assert (grid.norm, grid.head_kind) == ("instance", "grid")
