import pytest
import torch

from fedssl.models.dynunet3d import ENCODER_PREFIXES, DynUNet3D, build_dynunet, load_encoder, plan_dynunet

TINY = dict(filters=[4, 8, 16], pixdim=[2.5, 2.5, 10.0], roi_size=[16, 16, 8], num_classes=3)


def test_plan_follows_the_anisotropic_rule_by_hand():
    # 1.25 x 1.25 x 10 mm: in-plane pooling until in-plane spacing (5 mm) reaches half the slice spacing
    kernels, strides = plan_dynunet([1.25, 1.25, 10.0], [160, 160, 16], 5)
    assert strides == [[1, 1, 1], [2, 2, 1], [2, 2, 1], [2, 2, 2], [2, 2, 2]]
    # kernels are 3 wide along z only once the in-plane spacing is within 2x of 10 mm (5 mm, level 2)
    assert kernels == [[3, 3, 1], [3, 3, 1], [3, 3, 3], [3, 3, 3], [3, 3, 3]]
    # z is never pooled below 4 voxels: 8 -> 4, then no further pooling along z
    _, strides = plan_dynunet([1.0, 1.0, 1.0], [32, 32, 8], 4)
    assert strides == [[1, 1, 1], [2, 2, 2], [2, 2, 1], [2, 2, 1]]


def test_the_network_maps_a_patch_to_class_logits_of_its_size():
    net = build_dynunet(**{k: TINY[k] for k in ("filters", "pixdim", "roi_size", "num_classes")})
    out = net(torch.randn(2, 1, 16, 16, 8))
    assert tuple(out.shape) == (2, 4, 16, 16, 8)  # background + 3 classes


def test_a_patch_size_the_strides_cannot_divide_is_refused():
    with pytest.raises(ValueError, match=r"roi_size.*make its patch size a multiple of 4"):
        DynUNet3D(filters=[4, 8, 16], pixdim=[1.0, 1.0, 1.0], roi_size=[16, 18, 8], num_classes=3)
    with pytest.raises(ValueError, match="pixdim"):
        DynUNet3D(filters=[4, 8], pixdim=[1.0, 1.0], roi_size=[16, 16, 8], num_classes=3)


def test_encoder_initialisation_copies_the_encoder_only(tmp_path):
    source = DynUNet3D(**TINY, seed=1)
    path = tmp_path / "enc.pt"
    torch.save(source.state_dict(), path)
    fresh = DynUNet3D(**TINY, seed=2)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    model = DynUNet3D(**TINY, seed=2, encoder_path=str(path))
    state = model.state_dict()
    enc = [k for k in state if k.startswith(ENCODER_PREFIXES)]
    dec = [k for k in state if not k.startswith(ENCODER_PREFIXES) and state[k].is_floating_point()]
    assert enc and dec
    assert all(torch.equal(state[k], source.state_dict()[k]) for k in enc)
    assert all(torch.equal(state[k], before[k]) for k in dec)  # the decoder keeps its own random start
    assert model.initial_weights["init"] == "checkpoint" and len(model.initial_weights["sha256"]) == 64
    assert DynUNet3D(**TINY).initial_weights["init"] == "random"


def test_an_encoder_of_another_shape_is_named():
    other = DynUNet3D(filters=[4, 8, 32], pixdim=[2.5, 2.5, 10.0], roi_size=[16, 16, 8], num_classes=3)
    with pytest.raises(ValueError, match=r"enc\.pt: .* has shape"):
        load_encoder(DynUNet3D(**TINY), other.state_dict(), "enc.pt")
    with pytest.raises(ValueError, match="lacks .* encoder tensors"):
        load_encoder(DynUNet3D(**TINY), {}, "enc.pt")


def test_the_state_dict_carries_each_tensor_once_and_loads_strictly():
    net = DynUNet3D(**TINY)
    state = net.state_dict()
    assert not [k for k in state if k.startswith("skip_layers.")]  # DynUNet registers its blocks twice
    assert sum(v.numel() for v in state.values()) == sum(p.numel() for p in net.parameters())
    other = DynUNet3D(**TINY, seed=9)
    other.load_state_dict(state)  # strict
    x = torch.randn(1, 1, 16, 16, 8)
    assert torch.equal(net(x), other(x))
