"""FedRotationTrainer and FedSimCLRTrainer (FCL (Wu et al., MedIA 2022) sec. 5 "Baselines") on a tiny U-Net and 4
synthetic 32 px volumes: the rotated slices and their labels by hand, NT-Xent of a known two-pair batch by hand, the
round statistics and chance levels, seeds, the settings' checks and the encoder fine-tuning loads."""

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedssl.data.transforms import augment_rotation_view
from fedssl.data.volume import Volume
from fedssl.models.unet import (MoCoUNetEncoder, RotationNet, build_unet, encoder_state_from_global,
                                load_encoder_into_unet)
from fedssl.train.fcl import FCLLocalTrainer, FCLSettings
from fedssl.train.fcl_baselines import TRAINERS, FedRotationTrainer, FedSimCLRTrainer, trainer_class

torch.set_num_threads(1)
TINY = dict(n_partitions=2, features=[4, 4, 8, 8, 16, 4], proj_dim=4, batch_size=4, lr=0.05, seed=0, image_size=32,
            feature_exchange=False)
CLASSES = {"rotation": FedRotationTrainer, "simclr": FedSimCLRTrainer}


def volumes(n=4, slices=4, size=32):
    rng = np.random.default_rng(0)
    return [Volume(f"patient{i:03d}", "ED", rng.random((slices, size, size), dtype=np.float32), site="site-1")
            for i in range(n)]


def settings(objective, **kw):
    return FCLSettings(**{**TINY, "objective": objective, **kw})


def trainer(objective, site="site-1", augment=None, **kw):
    return CLASSES[objective](volumes(), settings(objective, **kw), num_rounds=2, site=site, augment=augment)


def identity(x, generator):
    return x.clone()


def test_rotation_step_rotates_every_slice_four_times_with_its_label_by_hand():
    """One bright pixel per slice: slice 0 at (row 0, col 1), slice 1 at (2, 5) of 32 x 32.  Rotating by 90 degrees
    (counter-clockwise, torch.rot90) sends (i, j) to (31 - j, i), 180 to (31 - i, 31 - j), 270 to (j, 31 - i); the
    batch holds block r = every slice rotated by r x 90 degrees, label r."""
    t = trainer("rotation", augment=identity)
    x = torch.zeros(2, 1, 32, 32)
    x[0, 0, 0, 1] = 1.0
    x[1, 0, 2, 5] = 1.0
    seen = []
    t.model.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach().clone()))
    loss, chance, extra = t.step(x)
    (views,) = seen
    assert views.shape == (8, 1, 32, 32)
    bright = [tuple(torch.nonzero(v[0]).flatten().tolist()) for v in views]
    assert bright == [(0, 1), (2, 5), (30, 0), (26, 2), (31, 30), (29, 26), (1, 31), (5, 29)]
    labels = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    with torch.no_grad():
        logits = t.model(views)
    assert loss.item() == pytest.approx(F.cross_entropy(logits, labels).item(), rel=1e-5)
    assert chance == pytest.approx(math.log(4))
    assert extra["rotation_accuracy"] == pytest.approx(float((logits.argmax(1) == labels).float().mean()))


def test_rotation_views_are_never_flipped_vertically():
    """The default augmentation of FedRotation keeps the top of a slice on top (a vertical and a horizontal flip
    together would be a 180 degree rotation, under another label): slices bright in the top half only, unrotated
    block, every view still brighter on top."""
    t = trainer("rotation")
    x = torch.zeros(16, 1, 32, 32)
    x[:, :, :16] = 1.0
    seen = []
    t.model.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach().clone()))
    t.step(x)
    unrotated = seen[0][:16, 0]
    assert bool((unrotated[:, :16].mean(dim=(1, 2)) > unrotated[:, 16:].mean(dim=(1, 2))).all())


class FixedProjections(nn.Module):
    """A stand-in network: the given normalised projections whatever the input, and the input it saw."""

    def __init__(self, z):
        super().__init__()
        self.z, self.inputs = z, []

    def forward(self, x):
        self.inputs.append(x.detach().clone())
        return self.z


def test_simclr_step_is_nt_xent_of_the_two_views_by_hand():
    """Two slices, views z1 = (a, b), z2 = (c, d): a = (1, 0), b = (0, 1), c = (0.6, 0.8), d = (0, 1), tau 0.5.
    Each view's positive is its other view, the other two views its negatives:
    a: pos a.c = 0.6, negs b 0, d 0 -> log(1 + 2 e^-1.2); b: pos b.d = 1, negs a 0, c 0.8 -> log(1 + e^-2 + e^-0.4);
    c: pos 0.6, negs b 0.8, d 0.8 -> log(1 + 2 e^0.4); d: as b.  Chance: ln(2B - 1) = ln 3."""
    calls = []

    def marked(x, generator):  # view 1 = x, view 2 = x + 10
        calls.append(1)
        return x + 10.0 * (len(calls) - 1)

    t = trainer("simclr", augment=marked, tau=0.5)
    z = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8], [0.0, 1.0]])
    t.model = FixedProjections(z)
    x = torch.rand(2, 1, 32, 32)
    loss, chance, extra = t.step(x)
    (seen,) = t.model.inputs  # both views in one batch: view 1 of every slice, then view 2
    assert torch.equal(seen[:2], x) and torch.equal(seen[2:], x + 10.0)
    by_hand = (math.log(1 + 2 * math.exp(-1.2)) + 2 * math.log(1 + math.exp(-2) + math.exp(-0.4))
               + math.log(1 + 2 * math.exp(0.4))) / 4
    assert loss.item() == pytest.approx(by_hand, rel=1e-6)
    assert chance == pytest.approx(math.log(3))
    assert extra["feature_std"] == pytest.approx(0.5)  # a, b: each dimension's population std 0.5


@pytest.mark.parametrize("objective, chance", [("rotation", math.log(4)), ("simclr", math.log(7))])
def test_round_statistics_and_the_chance_level(objective, chance):
    """4 volumes, 2 per batch: 2 steps of 4 slices (2 volumes x 2 partitions); cosine lr over 2 rounds x 2 steps;
    chance_loss ln 4 (rotation) or ln(2 x 4 - 1) (SimCLR over 4 slices)."""
    t = trainer(objective)
    stats = t.train_round(0)
    assert (stats.steps, stats.samples) == (2, 4)
    lrs = [0.05 * 0.5 * (1 + math.cos(math.pi * s / 4)) for s in range(2)]
    assert [p["lr"] for p in stats.curve] == pytest.approx(lrs) and stats.metrics["lr"] == pytest.approx(lrs[-1])
    assert stats.loss == pytest.approx(np.mean([p["loss"] for p in stats.curve]))
    assert stats.metrics["chance_loss"] == pytest.approx(chance)
    key = "rotation_accuracy" if objective == "rotation" else "feature_std"
    assert 0 <= stats.metrics[key] <= 1 and not {"bank_filled", "loss_local"} & set(stats.metrics)


@pytest.mark.parametrize("objective", ["rotation", "simclr"])
def test_same_seed_same_numbers_and_sites_draw_apart(objective):
    a, b, other = trainer(objective), trainer(objective), trainer(objective, site="site-2")
    ra, rb, ro = a.train_round(0), b.train_round(0), other.train_round(0)
    assert [p["loss"] for p in ra.curve] == [p["loss"] for p in rb.curve]
    assert all(torch.equal(v, b.model.state_dict()[k]) for k, v in a.model.state_dict().items())
    assert [p["loss"] for p in ra.curve] != [p["loss"] for p in ro.curve]
    state = torch.get_rng_state()
    trainer(objective).train_round(0)
    assert torch.equal(torch.get_rng_state(), state)  # the global generator is left as it was


@pytest.mark.parametrize("objective", ["rotation", "simclr"])
def test_a_restarted_site_goes_on_as_if_it_never_stopped(objective):
    ran = trainer(objective)
    ran.train_round(0)
    saved = copy.deepcopy(ran.state_dict())  # as the checkpoint file holds it
    expected = ran.train_round(1)
    resumed = trainer(objective)
    resumed.load_state_dict(saved)
    assert [p["loss"] for p in resumed.train_round(1).curve] == [p["loss"] for p in expected.curve]


@pytest.mark.parametrize("objective", ["rotation", "simclr"])
def test_the_encoder_loads_into_the_unet_as_fcls_does(objective):
    t = trainer(objective)
    t.train_round(0)
    unet = build_unet(TINY["features"])
    load_encoder_into_unet(unet, encoder_state_from_global(t.global_state()))
    own = t.model.main.encoder.state_dict()
    assert all(torch.equal(unet.state_dict()[k], v) for k, v in own.items())


def test_the_networks_hold_what_each_objective_trains_and_start_from_one_encoder():
    """FedRotation: encoder + linear 4-way classifier on the pooled bottleneck (RotNet's head); FedSimCLR: encoder +
    the job's projection head; both start from FCL's encoder at the same seed."""
    fcl, rot, simclr = (MoCoUNetEncoder(TINY["features"], 4, image_size=32, objective=o)
                        for o in ("fcl", "rotation", "simclr"))
    assert isinstance(rot.main, RotationNet) and not hasattr(rot, "momentum") and not hasattr(simclr, "momentum")
    assert rot.main.classifier.weight.shape == (4, 16)  # C4 = 16 pooled channels -> 4 rotations
    assert {k for k in rot.state_dict() if not k.startswith("main.encoder.")} == {"main.classifier.weight",
                                                                                 "main.classifier.bias"}
    assert {k for k in simclr.state_dict() if not k.startswith("main.encoder.")} == {"main.head.0.weight",
                                                                                    "main.head.2.weight"}
    start = fcl.main.encoder.state_dict()
    for net in (rot, simclr):
        assert all(torch.equal(v, start[k]) for k, v in net.main.encoder.state_dict().items())
    x = torch.rand(3, 1, 32, 32)
    rot.eval()
    with torch.no_grad():  # logits = W . (the bottleneck averaged over its 2 x 2 positions) + b
        h = rot.main.encoder(x)
        pooled = (h[:, :, 0, 0] + h[:, :, 0, 1] + h[:, :, 1, 0] + h[:, :, 1, 1]) / 4
        expected = pooled @ rot.main.classifier.weight.t() + rot.main.classifier.bias
        assert h.shape == (3, 16, 2, 2) and torch.allclose(rot(x), expected, atol=1e-6)


def test_an_invalid_objective_is_one_line_naming_the_argument_value_and_fix():
    with pytest.raises(ValueError) as e:
        FCLSettings(objective="rot").check("FCLExecutor")
    message = str(e.value)
    assert "\n" not in message and message.startswith("FCLExecutor: argument objective='rot' is invalid")
    assert "['fcl', 'rotation', 'simclr']" in message and "shape.objective" in message


@pytest.mark.parametrize("objective", ["rotation", "simclr"])
def test_a_baseline_with_feature_exchange_is_refused_naming_the_fix(objective):
    with pytest.raises(ValueError) as e:
        FCLSettings(objective=objective).check("FCLExecutor")
    message = str(e.value)
    assert "\n" not in message and "argument feature_exchange=True is invalid" in message
    assert f"objective={objective!r} exchanges no feature" in message and "set feature_exchange=false" in message


def test_each_trainer_trains_its_own_objective_only():
    assert trainer_class("fcl") is FCLLocalTrainer and TRAINERS == {"fcl": FCLLocalTrainer, **CLASSES}
    with pytest.raises(ValueError, match="objective='simclr' is invalid; FCLLocalTrainer trains objective 'fcl'"):
        FCLLocalTrainer(volumes(), settings("simclr"), num_rounds=2)
    with pytest.raises(ValueError, match="FedRotationTrainer trains objective 'rotation'"):
        FedRotationTrainer(volumes(), settings("simclr"), num_rounds=2)
    with pytest.raises(ValueError, match=r"objective='rot': use one of \['fcl', 'rotation', 'simclr'\]"):
        trainer_class("rot")


@pytest.mark.parametrize("objective", ["rotation", "simclr"])
def test_the_servers_moco_model_is_refused_naming_the_fix(objective):
    t = trainer(objective)
    server = MoCoUNetEncoder(TINY["features"], 4, image_size=32).state_dict()  # the server left at objective "fcl"
    with pytest.raises(ValueError, match=f"must have objective '{objective}': shape.objective={objective}"):
        t.load_global(server)


def test_rotation_augmentation_is_the_default():
    assert FedRotationTrainer.default_augment is augment_rotation_view
