"""ResNet-18 backbones of FedCLF: the paper's ResNet-18 layout, the pre-training models' keys, seeding, and the
encoder picked out of every pre-training state."""

from __future__ import annotations

import pytest
import torch
import torchvision

from fedssl.models.resnet import PretrainingResNet, ResNetClassifier, ResNetEncoder, encoder_state_from

torch.set_num_threads(1)


def test_width_64_is_torchvisions_resnet18_without_its_classifier():
    ours = ResNetEncoder(64)
    theirs = torchvision.models.resnet18()
    expected = {k: tuple(v.shape) for k, v in theirs.state_dict().items() if not k.startswith("fc.")}
    assert {k[len("net."):]: tuple(v.shape) for k, v in ours.state_dict().items()} == expected
    assert ours(torch.zeros(1, 3, 64, 64)).shape == (1, 512)


def test_narrow_resnet_keeps_the_layout_with_narrower_stages():
    enc = ResNetEncoder(8)
    assert enc.out_dim == 64 and enc(torch.zeros(2, 3, 32, 32)).shape == (2, 64)
    assert enc.net.layer3[0].conv1.weight.shape == (32, 16, 3, 3)  # 4 x width from 2 x width
    with pytest.raises(ValueError, match="width=2"):
        ResNetEncoder(2)


def test_depth_50_is_torchvisions_resnet50_without_its_classifier():
    """FedMAE-KS sec. V-B: the CNN baselines of Tables III / IV use ResNet-50."""
    ours = ResNetEncoder(64, depth=50)
    theirs = torchvision.models.resnet50()
    expected = {k: tuple(v.shape) for k, v in theirs.state_dict().items() if not k.startswith("fc.")}
    assert {k[len("net."):]: tuple(v.shape) for k, v in ours.state_dict().items()} == expected
    assert ours.out_dim == 2048


def test_narrow_resnet50_keeps_the_bottleneck_layout_and_every_model_takes_the_depth():
    enc = ResNetEncoder(8, depth=50)
    assert enc.out_dim == 256 and enc(torch.zeros(2, 3, 32, 32)).shape == (2, 256)
    assert len(enc.net.layer3) == 6 and enc.net.layer3[0].conv3.weight.shape == (128, 32, 1, 1)  # 4 x (4 x width)
    moco = PretrainingResNet("moco", width=8, proj_dim=16, depth=50)
    assert moco.main.head[0].in_features == 256 and moco(torch.zeros(2, 3, 32, 32)).shape == (2, 16)
    rot = PretrainingResNet("rotation", width=8, proj_dim=16, depth=50)
    assert rot.rotation_head.in_features == 256
    cls = ResNetClassifier(8, width=8, depth=50)
    cls.load_encoder(moco.state_dict(), "moco")
    assert cls.fc.in_features == 256
    with pytest.raises(ValueError, match="depth 50"):  # a ResNet-18 encoder does not fit
        cls.load_encoder(PretrainingResNet("moco", width=8, proj_dim=16).state_dict(), "moco-18")
    with pytest.raises(ValueError, match="depth=34.*18, 50"):
        ResNetEncoder(8, depth=34)


@pytest.mark.parametrize("width", [8, 64])
def test_resnet50_blocks_start_as_the_identity_and_resnet18_keeps_torchvisions_init(width):
    """zero_init_residual at depth 50 (a plain ResNet-50's running variances blew up within 3 MoCo steps)."""
    deep = ResNetEncoder(width, depth=50)
    assert all(float(b.bn3.weight.detach().abs().max()) == 0.0 for layer in (deep.net.layer1, deep.net.layer4)
               for b in layer)
    assert float(deep.net.layer1[0].bn1.weight.detach().min()) == 1.0  # the other BatchNorms as torchvision sets them
    block = deep.net.layer2[1].eval()
    x = torch.randn(2, block.conv1.in_channels, 4, 4).relu()
    assert torch.allclose(block(x), x)  # identity block (ReLU of a non-negative input)
    shallow = ResNetEncoder(width)
    assert float(shallow.net.layer1[0].bn2.weight.detach().min()) == 1.0


def test_pretraining_models_keys_and_outputs():
    moco = PretrainingResNet("moco", width=8, proj_dim=16)
    keys = set(moco.state_dict())
    assert {k.split(".")[0] for k in keys} == {"main", "momentum"}
    assert all(torch.equal(v, moco.state_dict()["momentum." + k[5:]]) for k, v in moco.state_dict().items()
               if k.startswith("main."))  # the momentum network starts as a copy
    assert not any(p.requires_grad for p in moco.momentum.parameters())
    z = moco(torch.randn(3, 3, 32, 32))
    assert z.shape == (3, 16) and torch.allclose(z.norm(dim=1), torch.ones(3), atol=1e-5)
    assert {k.split(".")[0] for k in PretrainingResNet("simclr", width=8, proj_dim=16).state_dict()} == {"main"}
    rot = PretrainingResNet("rotation", width=8)
    assert {k.split(".")[0] for k in rot.state_dict()} == {"main", "rotation_head"}
    assert rot(torch.randn(2, 3, 32, 32)).shape == (2, 4)
    with pytest.raises(ValueError, match="method='byol'"):
        PretrainingResNet("byol")


def test_initial_weights_come_from_the_seed_and_leave_the_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = PretrainingResNet("moco", width=8, proj_dim=16, seed=3)
    assert torch.equal(torch.rand(1), before)  # construction did not draw from the global RNG
    b = PretrainingResNet("moco", width=8, proj_dim=16, seed=3)
    c = PretrainingResNet("moco", width=8, proj_dim=16, seed=4)
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    assert not torch.equal(a.main.head[0].weight, c.main.head[0].weight)


@pytest.mark.parametrize("method", ["moco", "simclr", "rotation"])
def test_encoder_of_any_pretraining_state_loads_into_the_classifier(method):
    pre = PretrainingResNet(method, width=8, proj_dim=16, seed=1)
    clf = ResNetClassifier(5, width=8, seed=2)
    clf.encoder.load_state_dict(encoder_state_from(pre.state_dict()))
    assert torch.equal(clf.encoder.net.conv1.weight, pre.main.encoder.net.conv1.weight)
    assert encoder_state_from(clf.state_dict()).keys() == clf.encoder.state_dict().keys()
    with pytest.raises(ValueError, match="no ResNet encoder"):
        encoder_state_from({"fc.weight": torch.zeros(1)})


def test_classifier_loads_the_encoder_of_a_pretraining_file_and_records_it(tmp_path):
    pre = PretrainingResNet("moco", width=8, proj_dim=16, seed=7)
    path = tmp_path / "FL_global_model.pt"
    torch.save({"model": pre.state_dict()}, path)  # PTFileModelPersistor's format
    clf = ResNetClassifier(5, width=8, pretrained_path=str(path), seed=0)
    assert torch.equal(clf.encoder.net.layer4[1].conv2.weight, pre.main.encoder.net.layer4[1].conv2.weight)
    assert clf.initial_weights["init"] == "checkpoint" and len(clf.initial_weights["sha256"]) == 64
    assert int(clf.head_steps) == 0 and ResNetClassifier(5, width=8).initial_weights["init"] == "random"
    with pytest.raises(ValueError, match="does not fit this ResNet"):
        ResNetClassifier(5, width=16, pretrained_path=str(path))
    with pytest.raises(ValueError, match="pretrained_path="):
        ResNetClassifier(5, width=8, pretrained_path=str(tmp_path / "missing.pt"))
