"""Few-shot classification with a frozen vision-language image encoder (FedDRA sec. 5.1 (1), appendix A.1.2).

FedDRA (Shuai, Wu, Tang & Shen, TMLR): "We fine-tune our pre-trained model with an additional linear layer on 1%,
10% percentage of the training dataset, and evaluate the classification accuracy" (RSNA Pneumonia, 2 classes;
COVIDx, 3 classes).  Here the encoder is **frozen** and the head is a logistic-regression probe
(multinomial, :func:`fedssl.train.probe.fit_logistic`: full-batch Adam, seeded) on the encoder's standardised image
features: cheap, and it measures what pre-training put in the features.  The paper's own protocol (the MGCA
fine-tuner it follows: a linear layer on the frozen encoder, mini-batch AdamW lr 5e-4, batch 48, 50 epochs) is
:func:`fedssl.train.vlp_finetune.few_shot_finetune`, on the same labelled subsets (:func:`few_shot_subset`).

- :func:`few_shot_subset`: the labelled fraction, stratified per class (at least one image of every class);
  subsets of one seed are nested (the 1 % subset lies inside the 10 % one).
- :func:`extract_features`: ``feature_fn`` over batches, under ``torch.no_grad`` (an ``nn.Module`` is put in eval
  mode for it and restored afterwards).
- :func:`linear_probe`: accuracy, balanced accuracy and AUROC (binary; macro one-vs-rest for > 2 classes, via
  :func:`fedssl.eval.auroc.auroc`) on the test features.
- :func:`few_shot_probe`: features of the training and test images once, then a probe per fraction (``"1%"``, ...).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch
from torch import nn

from fedssl.core.checks import require, require_int
from fedssl.eval.auroc import auroc
from fedssl.train.probe import fit_logistic

__all__ = ["few_shot_subset", "extract_features", "linear_probe", "few_shot_probe", "fraction_key",
           "classification_scores"]


def _labels_1d(component: str, arg: str, labels) -> np.ndarray:
    y = np.asarray(labels.detach().cpu() if torch.is_tensor(labels) else labels)
    require(y.ndim == 1, component, arg, f"shape {y.shape}", "pass one integer class label per image")
    require(y.size == 0 or np.issubdtype(y.dtype, np.integer), component, arg, f"dtype {y.dtype}",
            "class labels must be integers (class indices)")
    return y.astype(np.int64)


def _check_fraction(component: str, fraction) -> float:
    ok = isinstance(fraction, (int, float)) and not isinstance(fraction, bool) and 0.0 < float(fraction) <= 1.0
    require(ok, component, "fraction", fraction, "use a fraction of the training set in (0, 1], e.g. 0.01 for 1 %")
    return float(fraction)


def few_shot_subset(labels, fraction: float, seed: int) -> list[int]:
    """Indices (sorted) of a stratified ``fraction`` of ``labels``: from each class with n images,
    ``max(1, round_half_up(fraction * n))`` of them, drawn without replacement from ``seed``.  Every class present
    keeps at least one image, so a 1 % subset of a small split can exceed 1 %.  The per-class draw is a prefix of one
    seeded permutation per class (classes in ascending order), so for one seed a smaller fraction's subset lies
    inside a larger one's."""
    component = "few_shot_subset"
    y = _labels_1d(component, "labels", labels)
    require(y.size > 0, component, "labels", "[]", "pass the training set's labels (at least one)")
    fraction = _check_fraction(component, fraction)
    require_int(component, "seed", seed, 0, "use a non-negative int seed")
    rng = np.random.default_rng(seed)
    chosen: list[int] = []
    for c in np.unique(y):
        members = np.flatnonzero(y == c)
        order = members[rng.permutation(members.size)]
        m = max(1, int(math.floor(fraction * members.size + 0.5)))
        chosen.extend(int(i) for i in order[:m])
    return sorted(chosen)


@torch.no_grad()
def extract_features(feature_fn: Callable[[torch.Tensor], torch.Tensor],
                     loader_or_batches: Iterable) -> tuple[torch.Tensor, torch.Tensor]:
    """``(features [N, D] float32 on the CPU, labels [N] int64)`` of every ``(images, labels)`` batch of
    ``loader_or_batches`` (a DataLoader or any iterable of such pairs), in order.  ``feature_fn`` maps an image
    batch to ``(B, D)`` features; it runs under ``torch.no_grad``, and if it is an ``nn.Module`` in eval mode (its
    mode restored afterwards).  For anything else (e.g. a lambda around a model), put the model in eval mode first."""
    component = "extract_features"
    was_training = feature_fn.training if isinstance(feature_fn, nn.Module) else None
    if was_training is not None:
        feature_fn.eval()
    feats, labels = [], []
    try:
        for i, batch in enumerate(loader_or_batches):
            require(isinstance(batch, (tuple, list)) and len(batch) == 2, component, "loader_or_batches",
                    f"batch {i} of type {type(batch).__name__}", "yield (images, labels) pairs")
            x, y = batch
            f = torch.as_tensor(feature_fn(x))
            y = torch.as_tensor(y).reshape(-1)
            require(f.dim() == 2 and f.shape[0] == y.shape[0], component, "feature_fn",
                    f"features {tuple(f.shape)} for {y.shape[0]} labels in batch {i}", "return (B, D) features")
            require(bool(torch.isfinite(f).all()), component, "feature_fn", f"non-finite features in batch {i}",
                    "check the encoder's output (NaN/Inf)")
            feats.append(f.detach().float().cpu())
            labels.append(y.detach().long().cpu())
    finally:
        if was_training is not None:
            feature_fn.train(was_training)
    require(bool(feats), component, "loader_or_batches", "no batches", "pass at least one (images, labels) batch")
    return torch.cat(feats), torch.cat(labels)


def _probe_inputs(component: str, x, y, name: str, n_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.as_tensor(x).detach().float().cpu()
    yy = torch.as_tensor(_labels_1d(component, f"{name}_y", y))
    require(x.dim() == 2 and x.shape[0] >= 1, component, f"{name}_x", tuple(x.shape), "pass (N, D) features, N >= 1")
    require(yy.shape[0] == x.shape[0], component, f"{name}_y", f"{yy.shape[0]} labels",
            f"pass one label per row of {name}_x ({x.shape[0]})")
    require(bool(torch.isfinite(x).all()), component, f"{name}_x", "non-finite values", "features must be finite")
    bad = yy[(yy < 0) | (yy >= n_classes)].unique().tolist()
    require(not bad, component, f"{name}_y", f"labels {bad}", f"labels must lie in [0, n_classes={n_classes})")
    return x, yy


def _macro_auroc(probs: np.ndarray, y: np.ndarray, n_classes: int) -> float:
    """Binary AUROC of class 1 for 2 classes; otherwise the mean one-vs-rest AUROC over the classes with both
    positives and negatives in ``y`` (NaN when none has)."""
    if n_classes == 2:
        return auroc(probs[:, 1], (y == 1).astype(int))
    values = [auroc(probs[:, c], (y == c).astype(int)) for c in range(n_classes)]
    values = [v for v in values if not math.isnan(v)]
    return float(np.mean(values)) if values else float("nan")


def linear_probe(train_x, train_y, test_x, test_y, n_classes: int, epochs: int = 100, lr: float = 1e-2,
                 weight_decay: float = 1e-4, seed: int = 0) -> dict:
    """A linear layer (softmax cross-entropy) on the features standardised with the training features' mean and std
    (std floored at 1e-6), trained full-batch with Adam for ``epochs`` steps from ``seed``
    (:func:`fedssl.train.probe.fit_logistic`; deterministic on the CPU).  Returns ``{"accuracy",
    "balanced_accuracy" (mean recall over the classes present in the test labels), "auroc" (see
    :func:`_macro_auroc`), "n_train", "n_test"}``; fractions in [0, 1]."""
    component = "linear_probe"
    require_int(component, "n_classes", n_classes, 2, "a classifier needs at least 2 classes")
    require_int(component, "epochs", epochs, 1, "use a positive number of full-batch steps, e.g. 100")
    for arg, v in (("lr", lr), ("weight_decay", weight_decay)):
        ok = isinstance(v, (int, float)) and math.isfinite(v) and (v > 0 if arg == "lr" else v >= 0)
        require(ok, component, arg, v, "use a finite learning rate > 0 / weight decay >= 0")
    xs, ys = _probe_inputs(component, train_x, train_y, "train", n_classes)
    xt, yt = _probe_inputs(component, test_x, test_y, "test", n_classes)
    require(xt.shape[1] == xs.shape[1], component, "test_x", tuple(xt.shape),
            f"test features need the training features' dimension {xs.shape[1]}")
    mean, std = xs.mean(dim=0), xs.std(dim=0, unbiased=False).clamp(min=1e-6)
    head = fit_logistic((xs - mean) / std, ys, n_classes, steps=epochs, lr=lr, weight_decay=weight_decay, seed=seed)
    with torch.no_grad():
        probs = torch.softmax(head((xt - mean) / std).double(), dim=1).numpy()
    return {**classification_scores(probs, yt.numpy(), n_classes), "n_train": int(xs.shape[0]),
            "n_test": int(xt.shape[0])}


def classification_scores(probs: np.ndarray, y: np.ndarray, n_classes: int) -> dict:
    """``{"accuracy", "balanced_accuracy" (mean recall over the classes present in ``y``), "auroc" (see
    :func:`_macro_auroc`)}`` of class probabilities ``probs [N, n_classes]`` (prediction: the arg max) against the
    labels ``y [N]``; shared by the probe and :func:`fedssl.train.vlp_finetune.few_shot_finetune`."""
    pred = probs.argmax(axis=1)
    recalls = [float((pred[y == c] == c).mean()) for c in np.unique(y)]
    return {"accuracy": float((pred == y).mean()), "balanced_accuracy": float(np.mean(recalls)),
            "auroc": _macro_auroc(probs, y, n_classes)}


def fraction_key(fraction: float) -> str:
    """``0.01 -> "1%"``, ``0.1 -> "10%"``, ``0.005 -> "0.5%"``."""
    return f"{round(float(fraction) * 100, 6):g}%"


def _batches(items, indices: Sequence[int], batch_size: int):
    """``(images [B, ...], labels [B])`` of ``items[i]`` for ``indices`` in order (no shuffling, no workers)."""
    for s in range(0, len(indices), batch_size):
        pairs = [items[i] for i in indices[s:s + batch_size]]
        yield torch.stack([torch.as_tensor(x) for x, _ in pairs]), torch.as_tensor([int(y) for _, y in pairs])


def few_shot_probe(feature_fn: Callable[[torch.Tensor], torch.Tensor], train_items, test_items,
                   fractions: Sequence[float] = (0.01, 0.1), seed: int = 0, batch_size: int = 64, *,
                   n_classes: int | None = None, train_labels: Sequence[int] | None = None, epochs: int = 100,
                   lr: float = 1e-2, weight_decay: float = 1e-4) -> dict[str, dict]:
    """Few-shot linear probes of a frozen encoder: ``{"1%": {...}, "10%": {...}}``, each :func:`linear_probe`'s dict
    plus ``"fraction"``.  ``train_items`` / ``test_items``: datasets whose ``items[i]`` is ``(image tensor, int
    label)``.  Features are extracted once (test set: all of it); each fraction's labelled images are
    :func:`few_shot_subset` of the training labels with ``seed``, and its probe starts from ``seed`` too.

    ``train_labels`` (the training set's labels, if known without loading the images): then only the images of the
    largest fraction's subset (which contains the others) go through the encoder.  ``n_classes``: default one more
    than the largest label seen."""
    component = "few_shot_probe"
    fractions = tuple(_check_fraction(component, f) for f in fractions)
    require(len(fractions) > 0 and len({fraction_key(f) for f in fractions}) == len(fractions), component,
            "fractions", fractions, "pass distinct fractions, e.g. (0.01, 0.1)")
    require_int(component, "batch_size", batch_size, 1, "use a positive batch size")
    require(len(train_items) > 0 and len(test_items) > 0, component, "train_items",
            f"{len(train_items)} training / {len(test_items)} test items", "both sets need at least one image")
    if train_labels is not None:
        y_all = _labels_1d(component, "train_labels", train_labels)
        require(y_all.size == len(train_items), component, "train_labels", f"{y_all.size} labels",
                f"pass one label per training item ({len(train_items)})")
        subsets = {f: few_shot_subset(y_all, f, seed) for f in fractions}
        needed = sorted(set().union(*subsets.values()))
        xs, ys = extract_features(feature_fn, _batches(train_items, needed, batch_size))
        require(torch.equal(ys, torch.as_tensor(y_all[needed])), component, "train_labels", "labels differ from items'",
                "pass the labels train_items returns, in item order")
        row = {i: r for r, i in enumerate(needed)}
        subsets = {f: [row[i] for i in s] for f, s in subsets.items()}
    else:
        xs, ys = extract_features(feature_fn, _batches(train_items, list(range(len(train_items))), batch_size))
        subsets = {f: few_shot_subset(ys, f, seed) for f in fractions}
    xt, yt = extract_features(feature_fn, _batches(test_items, list(range(len(test_items))), batch_size))
    if n_classes is None:
        n_classes = max(int(ys.max()), int(yt.max())) + 1
    out = {}
    for f in fractions:
        idx = torch.as_tensor(subsets[f], dtype=torch.long)
        result = linear_probe(xs[idx], ys[idx], xt, yt, n_classes, epochs=epochs, lr=lr, weight_decay=weight_decay,
                              seed=seed)
        out[fraction_key(f)] = {**result, "fraction": f}
    return out
