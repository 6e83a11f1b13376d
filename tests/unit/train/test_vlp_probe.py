"""fedssl.train.vlp_probe: stratified few-shot subsets, feature extraction and the frozen-feature linear probe."""

from collections import Counter

import pytest
import torch
from torch import nn

from fedssl.train.vlp_probe import extract_features, few_shot_probe, few_shot_subset, fraction_key, linear_probe

# classes interleaved: 25 of class 0, 15 of class 2, 3 of class 5
LABELS = [0] * 25 + [2] * 15 + [5] * 3
LABELS = LABELS[::2] + LABELS[1::2]


def test_few_shot_subset_is_stratified_with_one_per_class():
    idx = few_shot_subset(LABELS, 0.1, seed=0)
    counts = Counter(LABELS[i] for i in idx)
    # round half up per class: 2.5 -> 3, 1.5 -> 2, 0.3 -> 0 but at least one
    assert counts == {0: 3, 2: 2, 5: 1}
    assert idx == sorted(set(idx))
    assert Counter(LABELS[i] for i in few_shot_subset(LABELS, 0.01, seed=0)) == {0: 1, 2: 1, 5: 1}
    assert len(few_shot_subset(LABELS, 1.0, seed=3)) == len(LABELS)


def test_few_shot_subset_deterministic_seeded_and_nested():
    a = few_shot_subset(LABELS, 0.2, seed=7)
    assert a == few_shot_subset(torch.tensor(LABELS), 0.2, seed=7)
    assert a != few_shot_subset(LABELS, 0.2, seed=8)
    assert set(few_shot_subset(LABELS, 0.1, seed=7)) <= set(a)


class _Recorder(nn.Module):
    def __init__(self):
        super().__init__()
        self.seen = []
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        self.seen.append((self.training, torch.is_grad_enabled(), x.shape[0]))
        return self.drop(x.flatten(1))


def test_extract_features_no_grad_eval_mode_restored():
    fn = _Recorder().train()
    batches = [(torch.ones(2, 1, 2), torch.tensor([0, 1])), (2 * torch.ones(1, 1, 2), [1])]
    x, y = extract_features(fn, batches)
    assert fn.seen == [(False, False, 2), (False, False, 1)] and fn.training
    assert torch.equal(x, torch.tensor([[1.0, 1.0], [1.0, 1.0], [2.0, 2.0]]))  # dropout off
    assert y.tolist() == [0, 1, 1] and y.dtype == torch.int64


def _clusters(n_per, seed):
    g = torch.Generator().manual_seed(seed)
    centres = torch.tensor([[5.0, 0.0, 0.0], [0.0, 5.0, 0.0], [0.0, 0.0, 5.0]])
    x = torch.cat([c + 0.3 * torch.randn(n_per, 3, generator=g) for c in centres])
    return x, torch.arange(3).repeat_interleave(n_per)


def test_linear_probe_separable_features_score_one():
    (xs, ys), (xt, yt) = _clusters(4, 0), _clusters(20, 1)
    r = linear_probe(xs, ys, xt, yt, n_classes=3)
    assert r == {"accuracy": 1.0, "balanced_accuracy": 1.0, "auroc": 1.0, "n_train": 12, "n_test": 60}
    assert r == linear_probe(xs, ys, xt, yt, n_classes=3)  # deterministic


def test_linear_probe_random_labels_near_chance():
    g = torch.Generator().manual_seed(0)
    xs, xt = torch.randn(200, 8, generator=g), torch.randn(400, 8, generator=g)
    ys, yt = torch.randint(0, 2, (200,), generator=g), torch.randint(0, 2, (400,), generator=g)
    r = linear_probe(xs, ys, xt, yt, n_classes=2)
    assert 0.4 < r["accuracy"] < 0.6 and 0.4 < r["auroc"] < 0.6


def test_linear_probe_balanced_accuracy_and_auroc_by_hand():
    xs, ys = torch.tensor([[-1.0]] * 5 + [[1.0]] * 5), torch.tensor([0] * 5 + [1] * 5)
    # test predictions: x=-1 -> 0, x=+1 -> 1  => preds [0, 0, 1, 0] for labels [0, 0, 0, 1]
    xt, yt = torch.tensor([[-1.0], [-1.0], [1.0], [-1.0]]), torch.tensor([0, 0, 0, 1])
    r = linear_probe(xs, ys, xt, yt, n_classes=2)
    assert r["accuracy"] == 0.5
    assert r["balanced_accuracy"] == pytest.approx((2 / 3 + 0) / 2)
    # the positive ties two negatives (1/2 each) and is below the third: (0.5 + 0.5 + 0) / 3
    assert r["auroc"] == pytest.approx(1 / 3)


class _Items(torch.utils.data.Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i].reshape(1, 3), int(self.y[i])


def test_few_shot_probe_per_fraction_and_label_shortcut():
    (xs, ys), (xt, yt) = _clusters(20, 0), _clusters(10, 1)
    train, test = _Items(xs, ys), _Items(xt, yt)
    fn = _Recorder()
    out = few_shot_probe(fn, train, test, fractions=(0.1, 0.5), batch_size=16)
    assert list(out) == ["10%", "50%"]
    assert out["10%"]["n_train"] == 6 and out["50%"]["n_train"] == 30 and out["10%"]["n_test"] == 30
    assert out["10%"]["fraction"] == 0.1 and out["50%"]["accuracy"] == 1.0
    assert sum(n for _, _, n in fn.seen) == 60 + 30  # every image once
    fn2 = _Recorder()
    out2 = few_shot_probe(fn2, train, test, fractions=(0.1, 0.5), batch_size=16, train_labels=ys.tolist())
    assert out2 == out
    assert sum(n for _, _, n in fn2.seen) == 30 + 30  # only the 50 % subset of the training images


def test_fraction_key():
    assert [fraction_key(f) for f in (0.01, 0.1, 0.005, 1.0)] == ["1%", "10%", "0.5%", "100%"]


@pytest.mark.parametrize("call, arg", [
    (lambda: few_shot_subset(LABELS, 0.0, 0), "fraction"),
    (lambda: few_shot_subset(LABELS, 1.5, 0), "fraction"),
    (lambda: few_shot_subset([0.5, 1.0], 0.1, 0), "labels"),
    (lambda: few_shot_subset([], 0.1, 0), "labels"),
    (lambda: linear_probe(torch.ones(2, 3), [0, 1], torch.ones(2, 3), [0, 2], n_classes=2), "test_y"),
    (lambda: linear_probe(torch.ones(2, 3), [0, 1], torch.ones(2, 4), [0, 1], n_classes=2), "test_x"),
    (lambda: linear_probe(torch.ones(2, 3), [0], torch.ones(2, 3), [0, 1], n_classes=2), "train_y"),
    (lambda: linear_probe(torch.ones(2, 3), [0, 1], torch.ones(2, 3), [0, 1], n_classes=1), "n_classes"),
    (lambda: extract_features(lambda x: x, []), "loader_or_batches"),
    (lambda: extract_features(lambda x: x.sum(), [(torch.ones(2, 3), [0, 1])]), "feature_fn"),
])
def test_argument_errors_name_the_argument(call, arg):
    with pytest.raises(ValueError, match=f"argument {arg}="):
        call()
