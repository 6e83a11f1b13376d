"""Classification metrics against hand-computed confusion matrices; FedProx gradient; the fine-tuning trainer."""

import itertools

import numpy as np
import pytest
import torch
from torch import nn

from fedssl.core.classification import (
    ClassifierTrainer,
    UntrainedHeadError,
    binary_roc_auc,
    classification_metrics,
    confusion_matrix,
    evaluate,
    fedprox_term,
    flat_metrics,
    head_steps,
    require_trained_head,
)

NAMES3 = ["a", "b", "c"]


def one_hot_probs(pred, n_classes, confidence=0.8):
    p = np.full((len(pred), n_classes), (1 - confidence) / (n_classes - 1))
    p[np.arange(len(pred)), pred] = confidence
    return p


def test_confusion_matrix_rows_are_true_classes():
    m = confusion_matrix([0, 1, 1, 2], [0, 0, 1, 2], 3)
    assert m.tolist() == [[1, 1, 0], [0, 1, 0], [0, 0, 1]]
    with pytest.raises(ValueError, match="0..2"):
        confusion_matrix([0, 3], [0, 1], 3)


def test_metrics_with_a_class_never_predicted():
    labels = [0, 0, 0, 1, 1, 2, 2, 2]
    pred = [0, 0, 1, 1, 1, 0, 0, 1]  # class c never predicted
    # M = [[2,1,0],[0,2,0],[2,1,0]]; tp = [2,2,0]; fn = [1,0,3]; fp = [2,2,0]; tn = [3,4,5]
    m = classification_metrics(one_hot_probs(pred, 3), labels, NAMES3)
    assert m["confusion_matrix"] == [[2, 1, 0], [0, 2, 0], [2, 1, 0]]
    assert m["n"] == 8 and m["accuracy"] == pytest.approx(4 / 8)
    pc = m["per_class"]
    assert [pc[c]["recall"] for c in NAMES3] == pytest.approx([2 / 3, 1.0, 0.0])
    assert [pc[c]["precision"] for c in NAMES3] == pytest.approx([2 / 4, 2 / 4, 0.0])  # never predicted -> 0
    assert [pc[c]["specificity"] for c in NAMES3] == pytest.approx([3 / 5, 4 / 6, 5 / 5])
    assert [pc[c]["f1"] for c in NAMES3] == pytest.approx([4 / 7, 4 / 6, 0.0])
    assert [pc[c]["support"] for c in NAMES3] == [3, 2, 3]
    assert m["balanced_accuracy"] == pytest.approx((2 / 3 + 1 + 0) / 3) == m["macro_recall"]
    assert m["macro_precision"] == pytest.approx(1 / 3)
    assert m["macro_f1"] == pytest.approx((4 / 7 + 2 / 3) / 3)
    assert m["macro_specificity"] == pytest.approx((3 / 5 + 2 / 3 + 1) / 3)


def test_metrics_with_a_class_absent_from_labels_and_predictions():
    labels, pred = [0, 0, 1, 1], [0, 1, 1, 1]
    m = classification_metrics(one_hot_probs(pred, 3), labels, NAMES3)
    c = m["per_class"]["c"]
    assert c["support"] == 0 and c["recall"] is None and c["f1"] is None and c["precision"] == 0.0
    assert c["specificity"] == pytest.approx(1.0)
    # macro means over the classes present (a, b): recall [1/2, 1], precision [1, 2/3], f1 [2/3, 4/5]
    assert m["balanced_accuracy"] == pytest.approx(0.75)
    assert m["macro_precision"] == pytest.approx((1 + 2 / 3) / 2)
    assert m["macro_f1"] == pytest.approx((2 / 3 + 4 / 5) / 2)
    assert m["auc"] is not None and m["per_class"]["c"]["auc"] is None  # no positives for c: left out of the mean


def test_binary_auc_hand_computed_with_ties():
    assert binary_roc_auc([0.1, 0.4, 0.35, 0.8], [False, False, True, True]) == pytest.approx(0.75)
    # positives {0.5, 0.9} vs negatives {0.5, 0.2}: pairs 0.5 (tie), 1, 1, 1 -> 3.5 / 4
    assert binary_roc_auc([0.5, 0.5, 0.2, 0.9], [True, False, False, True]) == pytest.approx(0.875)
    assert binary_roc_auc([0.1, 0.2], [True, True]) is None


def test_binary_metrics_use_p_class1_for_auc():
    probs = np.array([[0.9, 0.1], [0.6, 0.4], [0.65, 0.35], [0.2, 0.8]])
    m = classification_metrics(probs, [0, 0, 1, 1], ["no_dr", "dr"])
    assert m["auc"] == pytest.approx(0.75)
    assert m["accuracy"] == pytest.approx(0.75)  # predictions 0, 0, 0, 1
    assert (m["per_class"]["dr"]["recall"] == pytest.approx(0.5)
            and m["per_class"]["dr"]["specificity"] == pytest.approx(1.0))
    assert m["per_class"]["no_dr"]["auc"] is None
    assert classification_metrics(probs[:2], [0, 0], ["no_dr", "dr"])["auc"] is None  # one class only: undefined


def pair_auc(scores, positive):
    pos = [s for s, t in zip(scores, positive) if t]
    neg = [s for s, t in zip(scores, positive) if not t]
    return sum(1.0 if p > q else 0.5 if p == q else 0.0 for p, q in itertools.product(pos, neg)) / (len(pos) * len(neg))


def test_multiclass_auc_is_macro_one_vs_rest():
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(3), size=30)
    labels = rng.integers(0, 3, size=30)
    m = classification_metrics(probs, labels, NAMES3)
    per = [pair_auc(probs[:, c], labels == c) for c in range(3)]
    assert [m["per_class"][c]["auc"] for c in NAMES3] == pytest.approx(per)
    assert m["auc"] == pytest.approx(sum(per) / 3)


def test_metrics_reject_bad_input():
    with pytest.raises(ValueError, match=r"shape \[N, 3\]"):
        classification_metrics(np.ones((2, 2)), [0, 1], NAMES3)
    with pytest.raises(ValueError, match="2 probability rows for 3 labels"):
        classification_metrics(np.ones((2, 3)) / 3, [0, 1, 2], NAMES3)
    with pytest.raises(FloatingPointError):
        classification_metrics(np.array([[np.nan, 0.5, 0.5]]), [0], NAMES3)


def test_flat_metrics_has_scalars_and_per_class_entries():
    m = classification_metrics(one_hot_probs([0, 1], 2), [0, 1], ["x", "y"])
    flat = flat_metrics(m, prefix="val_")
    assert flat["val_accuracy"] == 1.0 and flat["val_recall_y"] == 1.0 and flat["val_auc"] == 1.0


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
