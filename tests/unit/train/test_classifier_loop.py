"""FedProx gradient; the fine-tuning trainer (schedule, FedProx, restart, head counter, layer-wise lr decay,
bfloat16 forward, mixup / CutMix / random erasing with soft targets)."""

import copy
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from fedssl.core.classification import UntrainedHeadError, evaluate, head_steps, require_trained_head
from fedssl.core.seeds import derived_seed
from fedssl.core.soft_targets import mixed_targets, soft_target_cross_entropy
from fedssl.core.trainer import MixedPrecision
from fedssl.data.mixup import BatchAugment
from fedssl.train.classifier_loop import ClassifierTrainer, fedprox_term

from tests.unit.core.test_mixed_precision import BF16, float32, layer_dtypes


def test_fedprox_gradient_is_mu_times_distance():
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    w_g = {k: torch.randn_like(v) for k, v in lin.named_parameters()}
    mu = 0.01
    term = fedprox_term(lin, w_g, mu)
    term.backward()
    for k, p in lin.named_parameters():
        assert torch.allclose(p.grad, mu * (p.detach() - w_g[k]), atol=1e-7)
    expected = 0.5 * mu * sum(((p.detach() - w_g[k]) ** 2).sum() for k, p in lin.named_parameters())
    assert float(term.detach()) == pytest.approx(float(expected))


class TinyClassifier(nn.Module):
    def __init__(self, d=2, c=2):
        super().__init__()
        self.encoder = nn.Linear(d, 8)
        self.head = nn.Linear(8, c)
        self.register_buffer("head_steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        return self.head(torch.relu(self.encoder(x)))


def separable(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=g)
    y = (x[:, 0] > 0).long()
    x[:, 0] += torch.where(y == 1, 1.0, -1.0)  # margin
    return x, y


def batches(x, y, bs=16):
    return [(x[i:i + bs], y[i:i + bs]) for i in range(0, len(x), bs)]


def make_trainer(model, **kw):
    return ClassifierTrainer(model, **{"lr": 0.05, "total_rounds": 10, "warmup_rounds": 1, **kw})


def test_trainer_reduces_loss_on_separable_data_and_counts_head_steps():
    torch.manual_seed(0)
    model = TinyClassifier()
    x, y = separable()
    trainer = make_trainer(model)
    with pytest.raises(UntrainedHeadError, match="checkpoint fresh.pt has no trained classification head; fine-tune it "
                                                 "first"):
        evaluate(model, batches(x, y), ["neg", "pos"], source="fresh.pt")
    losses = [trainer.train_round(batches(x, y), r, n_steps=4) for r in range(10)]
    assert losses[-1] < 0.5 * losses[0]
    assert head_steps(model) == 40 == trainer.step
    assert head_steps(model.state_dict()) == 40
    m = evaluate(model, batches(x, y), ["neg", "pos"], source="trained.pt")
    assert m["accuracy"] == 1.0 and m["auc"] == 1.0


def test_warmup_then_cosine_schedule_by_round():
    trainer = make_trainer(TinyClassifier(), warmup_rounds=2, min_lr=0.0)
    assert trainer.lr_at(0.0) < trainer.lr_at(1.0) < trainer.lr_at(2.0) == pytest.approx(0.05)
    assert trainer.lr_at(6.0) < trainer.lr_at(4.0) < 0.05
    assert trainer.lr_at(10.0) == pytest.approx(0.0, abs=1e-9)


def test_fedprox_pulls_towards_the_global_weights():
    x, y = separable()
    distances = {}
    for mu in (0.0, 10.0):
        torch.manual_seed(0)
        model = TinyClassifier()
        w_g = {k: v.detach().clone() for k, v in model.named_parameters()}
        trainer = make_trainer(model, fedprox_mu=mu, warmup_rounds=0)
        trainer.set_global(w_g)
        for r in range(3):
            trainer.train_round(batches(x, y), r, n_steps=4)
        distances[mu] = sum(float(((p.detach() - w_g[k]) ** 2).sum()) for k, p in model.named_parameters())
    assert distances[10.0] < distances[0.0]
    with pytest.raises(ValueError, match="set_global"):
        make_trainer(TinyClassifier(), fedprox_mu=0.001).train_round(batches(x, y), 0, n_steps=4)


def test_trainer_state_round_trip_resumes_identically():
    x, y = separable()

    def run(resume: bool):
        torch.manual_seed(0)
        model = TinyClassifier()
        trainer = make_trainer(model)
        trainer.train_round(batches(x, y), 0, n_steps=4)
        if resume:  # a client restart: new objects, weights from the server, optimiser from the checkpoint
            state, weights = trainer.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
            model = TinyClassifier()
            model.load_state_dict(weights)
            trainer = make_trainer(model)
            trainer.load_state_dict(state)
        trainer.train_round(batches(x, y), 1, n_steps=4)
        return model.state_dict(), trainer.step

    (a, sa), (b, sb) = run(False), run(True)
    assert sa == sb == 8
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_trainer_requires_a_head_counter():
    class NoCounter(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(2, 2)

    with pytest.raises(ValueError, match="head_steps"):
        make_trainer(NoCounter())
    with pytest.raises(UntrainedHeadError, match="ckpt.pt"):
        require_trained_head({"head.weight": torch.zeros(2, 2)}, "ckpt.pt")


def test_layer_decay_scales_the_lr_by_depth():
    class TinyViTLike(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = nn.Module()
            self.encoder.cls_token = nn.Parameter(torch.zeros(1, 1, 4))
            self.encoder.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
            self.head = nn.Linear(4, 2)
            self.register_buffer("head_steps", torch.zeros((), dtype=torch.long))

    model = TinyViTLike()
    trainer = make_trainer(model, layer_decay=0.5, warmup_rounds=0)
    lr_of = {}
    for g in trainer.optimizer.param_groups:
        for p in g["params"]:
            lr_of[id(p)] = g["lr_scale"]
    # 2 blocks -> L + 1 = 3: stem 0.5^3, block 0 0.5^2, block 1 0.5^1, head 1
    assert lr_of[id(model.encoder.cls_token)] == 0.125
    assert lr_of[id(model.encoder.blocks[0].weight)] == 0.25 and lr_of[id(model.encoder.blocks[1].bias)] == 0.5
    assert lr_of[id(model.head.weight)] == 1.0
    with pytest.raises(ValueError, match="layer_decay=0"):
        make_trainer(TinyClassifier(), layer_decay=0)


def forced(trainer):
    trainer.precision = MixedPrecision("cpu", True, force=BF16)
    return trainer


def test_classifier_forward_runs_in_bfloat16_with_a_float32_loss():
    torch.manual_seed(0)
    model = TinyClassifier()
    tr = forced(make_trainer(model))
    seen = layer_dtypes(model)
    x, y = torch.randn(8, 2), torch.randint(0, 2, (8,))
    loss = tr.train_round([(x, y)], 0, 1)
    assert seen and set(seen) == {BF16} and math.isfinite(loss) and float32(model)


# ---------------------------------------------------------------- mixup / CutMix / random erasing (issue 47)
#: rui-yan/SSL-FL's Fed-MAE fine-tuning recipe (mixup 0.8, CutMix 1.0, per batch), random erasing on to exercise it
RECIPE = BatchAugment(mixup_alpha=0.8, cutmix_alpha=1.0, cutmix_minmax=None, mixup_prob=1.0, mixup_switch_prob=0.5,
                      mixup_mode="batch", erasing_prob=0.25, erasing_mode="pixel", erasing_count=1)
OFF = BatchAugment(mixup_alpha=0.0, cutmix_alpha=0.0, cutmix_minmax=None, mixup_prob=1.0, mixup_switch_prob=0.5,
                   mixup_mode="batch", erasing_prob=0.0, erasing_mode="pixel", erasing_count=1)


class TinyImageClassifier(nn.Module):
    def __init__(self, c=3):
        super().__init__()
        self.encoder = nn.Linear(3 * 8 * 8, 8)
        self.head = nn.Linear(8, c)
        self.register_buffer("head_steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        return self.head(torch.relu(self.encoder(x.flatten(1))))


def images(n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


def test_off_is_the_old_training_step_bit_for_bit():
    """With every augmentation off, a round is the loop as it was before issue 47, written out here by hand:
    F.cross_entropy with label smoothing, AdamW, the head counter."""
    x, y = separable()

    def trained(**kw):
        torch.manual_seed(0)
        model = TinyClassifier()
        trainer = make_trainer(model, label_smoothing=0.1, seed=3, **kw)
        losses = [trainer.train_round(batches(x, y), r, n_steps=4) for r in range(2)]
        return model.state_dict(), losses

    torch.manual_seed(0)
    model = TinyClassifier()
    trainer = make_trainer(model, label_smoothing=0.1, seed=3)
    old_losses = []
    for r in range(2):
        step_losses = []
        for i, (xb, yb) in enumerate(batches(x, y)):
            for g in trainer.optimizer.param_groups:
                g["lr"] = trainer.lr_at(r + i / 4) * g["lr_scale"]
            loss = F.cross_entropy(model(xb).float(), yb, label_smoothing=0.1)
            trainer.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            trainer.optimizer.step()
            model.head_steps.add_(1)
            step_losses.append(float(loss.detach()))
        old_losses.append(sum(step_losses) / len(step_losses))
    by_hand = model.state_dict()
    for kw in ({}, {"batch_augment": None}, {"batch_augment": OFF}):
        weights, losses = trained(**kw)
        assert losses == old_losses, kw
        assert all(torch.equal(weights[k], by_hand[k]) for k in by_hand), kw
    assert make_trainer(TinyClassifier(), batch_augment=OFF).batch_augment is None


def test_the_loss_is_the_soft_target_cross_entropy_of_the_augmented_batch():
    """The first step by hand: the trainer's generator is seeded from (seed, "batch_augment", step 0); the batch is
    erased then mixed; the targets are mixed and label-smoothed (0.1 over 3 classes)."""
    x, y = images()
    for seed in range(4):
        torch.manual_seed(0)
        model = TinyImageClassifier()
        before = copy.deepcopy(model)
        trainer = make_trainer(model, label_smoothing=0.1, seed=seed, batch_augment=RECIPE)
        trainer.train_round([(x, y)], 0, n_steps=1)
        g = torch.Generator().manual_seed(derived_seed(seed, "batch_augment", 0))
        xa, lam = RECIPE(x, g)
        assert lam is not None and not torch.equal(xa, x)
        expected = soft_target_cross_entropy(before(xa).float(), mixed_targets(y, 3, lam, 0.1))
        assert trainer.last_losses == [float(expected.detach())]
        plain = F.cross_entropy(before(x), y, label_smoothing=0.1)
        assert float(plain.detach()) != trainer.last_losses[0]


def test_augmented_runs_repeat_and_restart_identically_and_sites_draw_apart():
    x, y = images()

    def run(resume: bool, seed: int = 0):
        torch.manual_seed(0)
        model = TinyImageClassifier()
        trainer = make_trainer(model, label_smoothing=0.1, seed=seed, batch_augment=RECIPE)
        trainer.train_round(batches(x, y, bs=8), 0, n_steps=4)
        if resume:
            state, weights = trainer.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
            model = TinyImageClassifier()
            model.load_state_dict(weights)
            trainer = make_trainer(model, label_smoothing=0.1, seed=seed, batch_augment=RECIPE)
            trainer.load_state_dict(state)
        trainer.train_round(batches(x, y, bs=8), 1, n_steps=4)
        return model.state_dict()

    a, b, c, other = run(False), run(False), run(True), run(False, seed=1)
    assert all(torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]) for k in a)
    assert not all(torch.equal(a[k], other[k]) for k in a)


def test_the_trainer_checks_its_augmentation_at_construction():
    bad = BatchAugment(**{**RECIPE.__dict__, "mixup_alpha": -1.0})
    with pytest.raises(ValueError, match=r"^ClassifierTrainer: argument mixup_alpha=-1.0 is invalid; use 0 \(off\)"):
        make_trainer(TinyImageClassifier(), batch_augment=bad)
