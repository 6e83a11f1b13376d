"""Multi-label DenseNet: head bound to class names, torchvision key layout, BN helpers, ImageNet checkpoint loading."""

import hashlib

import pytest
import torch
from torchvision.models import densenet121

from fedssl.models import build_model
from fedssl.models.densenet import (
    DenseNet121,
    MultiLabelDenseNet,
    TinyDenseNet,
    bn_keys,
    freeze_batchnorm,
    is_bn_key,
    load_imagenet_weights,
    set_features_trainable,
)

CLASSES = ["Atelectasis", "Cardiomegaly", "Pleural Effusion"]


def test_tiny_forward_shape_and_head():
    m = build_model("tiny_densenet", classes=CLASSES)
    assert isinstance(m, TinyDenseNet) and m.classes == CLASSES
    out = m(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 3)
    sd = m.state_dict()
    assert sd["classifier.weight"].shape == (3, m.num_features) and sd["classifier.bias"].shape == (3,)
    assert m.num_features == 32 and "pre_classifier.0.weight" in sd


def test_seeded_init_reproducible():
    a, b, c = TinyDenseNet(CLASSES, seed=3), TinyDenseNet(CLASSES, seed=3), TinyDenseNet(CLASSES, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["features.conv0.weight"], sc["features.conv0.weight"])


def test_densenet121_keys_match_torchvision_and_tiny():
    ref = densenet121(weights=None).state_dict()
    m = DenseNet121(CLASSES, hidden_features=0)
    sd = m.state_dict()
    assert set(sd) == set(ref)
    assert sd["classifier.weight"].shape == (3, 1024)
    # tiny twin: same module naming pattern (blocks, transitions, norms), fewer layers
    tiny = set(TinyDenseNet(CLASSES, hidden_features=0).state_dict())
    assert tiny <= set(ref)
    assert {k.split(".")[1] for k in tiny if k.startswith("features.")} == {k.split(".")[1] for k in ref
                                                                            if k.startswith("features.")}


def test_is_bn_key_matches_module_types():
    for m in (TinyDenseNet(CLASSES), DenseNet121(CLASSES)):
        sd = m.state_dict()
        assert {k for k in sd if is_bn_key(k)} == set(bn_keys(m))
    assert is_bn_key("features.transition1.norm.num_batches_tracked")
    assert not is_bn_key("features.conv0.weight") and not is_bn_key("classifier.bias")
    assert not is_bn_key("features.normal_thing.weight")


def test_freeze_batchnorm_keeps_statistics_and_affine():
    m = TinyDenseNet(CLASSES, seed=0)
    m.train()
    n = freeze_batchnorm(m)
    assert n == len([k for k in bn_keys(m) if k.endswith("running_mean")])
    before = {k: v.clone() for k, v in m.state_dict().items()}
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(m(torch.randn(4, 3, 32, 32)), torch.ones(4, 3))
    loss.backward()
    opt.step()
    after = m.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in bn_keys(m))
    assert not torch.equal(before["features.conv0.weight"], after["features.conv0.weight"])


def test_features_frozen_for_head_warmup():
    m = TinyDenseNet(CLASSES)
    set_features_trainable(m, False)
    trainable = {n for n, p in m.named_parameters() if p.requires_grad}
    assert trainable == {"classifier.weight", "classifier.bias", "pre_classifier.0.weight", "pre_classifier.0.bias"}
    set_features_trainable(m, True)
    assert all(p.requires_grad for p in m.parameters())


def test_imagenet_checkpoint_loads_backbone_only(tmp_path):
    # a checkpoint in torchvision's old published format (dotted 'norm.1' names) with a 1000-class head
    tv = TinyDenseNet(["x"] * 1 + [f"c{i}" for i in range(999)], hidden_features=0, seed=7).state_dict()
    old = {}
    for k, v in tv.items():
        if k.endswith("num_batches_tracked"):  # pre-0.4 checkpoints have none
            continue
        k2 = k.replace(".norm1.", ".norm.1.").replace(".conv2.", ".conv.2.") if "denselayer" in k else k
        old[k2] = v
    path = tmp_path / "densenet.pth"
    torch.save(old, path)
    m = TinyDenseNet(CLASSES, hidden_features=0, seed=0)
    head_before = m.classifier.weight.clone()
    rep = load_imagenet_weights(m, str(path))
    assert rep["loaded"] == len([k for k in old if k.startswith("features.")])
    assert rep["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest() and rep["path"] == str(path)
    assert "classifier.weight" in rep["skipped"]
    sd = m.state_dict()
    assert all(torch.equal(sd[k], tv[k]) for k in tv if k.startswith("features.") and "num_batches" not in k)
    assert torch.equal(m.classifier.weight, head_before)
    # the same through the JSON-configurable component (server model: carries the weights to the sites)
    args = {"classes": CLASSES, "growth_rate": 8, "block_config": [2, 2, 2, 2], "num_init_features": 16,
            "hidden_features": 0, "seed": 0, "imagenet_path": str(path)}
    comp = MultiLabelDenseNet(**args)
    assert all(getattr(comp, k) == v for k, v in args.items()) and comp.imagenet_report["sha256"] == rep["sha256"]
    assert torch.equal(comp.state_dict()["features.conv0.weight"], tv["features.conv0.weight"])
    with pytest.raises(FileNotFoundError, match="imagenet_path"):
        load_imagenet_weights(m, str(tmp_path / "nope.pth"))
    torch.save({"something": torch.zeros(1)}, tmp_path / "bad.pth")
    with pytest.raises(ValueError, match="not a torchvision densenet121"):
        load_imagenet_weights(m, str(tmp_path / "bad.pth"))


def test_an_imagenet_checkpoint_that_does_not_fit_is_an_error_naming_the_file(tmp_path):
    """Issue 13 item 2: a truncated checkpoint (a backbone tensor missing) or one of another shape is refused, naming
    the file; an empty path is random initialisation (no report)."""
    full = {k: v for k, v in TinyDenseNet(CLASSES, hidden_features=0, seed=7).state_dict().items()
            if k.startswith("features.")}
    truncated = dict(full)
    del truncated["features.denseblock4.denselayer2.conv2.weight"]
    torch.save(truncated, tmp_path / "truncated.pth")
    with pytest.raises(ValueError, match=r"truncated\.pth.*lacks 1 backbone tensors.*denselayer2\.conv2"):
        load_imagenet_weights(TinyDenseNet(CLASSES, hidden_features=0), str(tmp_path / "truncated.pth"))
    wrong = dict(full, **{"features.conv0.weight": torch.zeros(16, 3, 3, 3)})
    torch.save(wrong, tmp_path / "wrong.pth")
    with pytest.raises(ValueError, match=r"wrong\.pth.*features\.conv0\.weight has shape \(16, 3, 3, 3\)"):
        load_imagenet_weights(TinyDenseNet(CLASSES, hidden_features=0), str(tmp_path / "wrong.pth"))
    for empty in ("", None):
        assert MultiLabelDenseNet(CLASSES, 8, [2, 2, 2, 2], 16, imagenet_path=empty).imagenet_report is None
    with pytest.raises(ValueError, match="imagenet_path=3"):
        MultiLabelDenseNet(CLASSES, 8, [2, 2, 2, 2], 16, imagenet_path=3)


def test_bad_arguments():
    with pytest.raises(ValueError, match="twice"):
        TinyDenseNet(["a", "a"])
    with pytest.raises(ValueError, match="empty"):
        TinyDenseNet([])
    with pytest.raises(ValueError, match="hidden_features"):
        TinyDenseNet(["a"], hidden_features=-1)
