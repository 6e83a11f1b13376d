"""The metrics every classifier fine-tuning job (SSL-FL (Yan et al., IEEE TMI 2023) sec. III-D) reports, and the guard
against evaluating an untrained classification head.

Pure torch / numpy (no FLARE, no scikit-learn): the FLARE executor, the local fine-tuning protocol and the
tests all call these.

Head guard: a classifier carries a ``head_steps`` buffer (``HEAD_STEPS``) in which the fine-tuning loop
(:class:`fedssl.train.classifier_loop.ClassifierTrainer`) counts every optimiser step that updated the classification
head, so a checkpoint tells whether its head was ever trained (``require_trained_head``) and evaluation of an untrained
head is refused.

``classification_metrics``: from the confusion matrix ``M[t, p]`` (rows true class, columns predicted) with
``tp_c = M[c, c]``, ``fn_c = sum_p M[c, p] - tp_c``, ``fp_c = sum_t M[t, c] - tp_c``, ``tn_c = N - tp_c - fn_c - fp_c``:

- accuracy = sum_c tp_c / N
- recall_c = tp_c / (tp_c + fn_c); undefined (None) when class c has no sample
- precision_c = tp_c / (tp_c + fp_c); 0.0 when class c is never predicted (the prediction set is empty)
- specificity_c = tn_c / (tn_c + fp_c); undefined (None) when every sample belongs to class c
- f1_c = 2 tp_c / (2 tp_c + fp_c + fn_c); undefined (None) when class c is neither present nor predicted
- balanced_accuracy = macro recall = mean of the defined recall_c (classes present in the labels)
- macro_precision, macro_f1 = means over the classes present in the labels or in the predictions
  (scikit-learn's default label set); macro_specificity = mean of the defined specificity_c
- auc: 2 classes: ROC AUC of p(class 1) (Mann-Whitney U with average ranks for ties);
  more classes: macro mean of the one-vs-rest ROC AUCs of the classes that have both positives and negatives.
  None when it is undefined (a single class in the labels).
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

#: name of the buffer that counts optimiser steps on the classification head
HEAD_STEPS = "head_steps"


class UntrainedHeadError(ValueError):
    """A checkpoint whose classification head was never trained was about to be evaluated."""


# ----------------------------------------------------------------------------------------------- head guard
def head_steps(model_or_state: nn.Module | Mapping[str, object]) -> int:
    """Optimiser steps recorded on the classification head (0 when the model or state has no counter)."""
    if isinstance(model_or_state, nn.Module):
        buf = getattr(model_or_state, HEAD_STEPS, None)
        return int(buf.item()) if isinstance(buf, torch.Tensor) else 0
    value = model_or_state.get(HEAD_STEPS)
    if value is None:
        return 0
    return int(np.asarray(value.detach().cpu() if isinstance(value, torch.Tensor) else value).reshape(-1)[0])


def require_trained_head(model_or_state: nn.Module | Mapping[str, object], source: str) -> int:
    """Raise UntrainedHeadError unless the head was trained; returns the step count."""
    steps = head_steps(model_or_state)
    if steps <= 0:
        raise UntrainedHeadError(
            f"checkpoint {source} has no trained classification head; fine-tune it first (federated: "
            "jobs/sslfl_retina_finetune; local: fedssl sslfl finetune) and evaluate the fine-tuned model, not a "
            f"pre-trained encoder or a fresh initialisation ({HEAD_STEPS} counter is 0 or missing)"
        )
    return steps


# ----------------------------------------------------------------------------------------------- metrics
def confusion_matrix(pred: Sequence[int], labels: Sequence[int], n_classes: int) -> np.ndarray:
    """``M[t, p]`` = number of samples of true class t predicted as p; int64 [C, C]."""
    pred, labels = np.asarray(pred, dtype=np.int64).reshape(-1), np.asarray(labels, dtype=np.int64).reshape(-1)
    if pred.shape != labels.shape:
        raise ValueError(f"{pred.size} predictions for {labels.size} labels")
    for name, arr in (("label", labels), ("prediction", pred)):
        if arr.size and (arr.min() < 0 or arr.max() >= n_classes):
            raise ValueError(f"{name} values must lie in 0..{n_classes - 1}; got {sorted(set(arr.tolist()))[:10]}")
    m = np.zeros((n_classes, n_classes), dtype=np.int64)
    np.add.at(m, (labels, pred), 1)
    return m


def _average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks of ``x``, ties sharing the mean of their ranks."""
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    ranks = np.empty(len(x), dtype=np.float64)
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return ranks


def binary_roc_auc(scores: Sequence[float], positive: Sequence[bool]) -> float | None:
    """P(score of a random positive > score of a random negative), ties counting 1/2; None without both classes."""
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    positive = np.asarray(positive, dtype=bool).reshape(-1)
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        return None
    ranks = _average_ranks(scores)
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def _mean(values: Iterable[float | None]) -> float | None:
    v = [x for x in values if x is not None]
    return float(sum(v) / len(v)) if v else None


def classification_metrics(probs: np.ndarray | torch.Tensor, labels: Sequence[int], class_names: Sequence[str]) -> dict:
    """Metrics of class probabilities ``probs`` [N, C] against integer ``labels`` [N] (see the module docstring).

    Returns ``{"n", "accuracy", "balanced_accuracy", "macro_precision", "macro_recall", "macro_f1",
    "macro_specificity", "auc", "per_class": {name: {"support", "recall", "precision", "f1", "specificity",
    "auc"}}, "confusion_matrix": [[...]]}``; undefined values are None.
    """
    p = probs.detach().cpu().numpy() if isinstance(probs, torch.Tensor) else np.asarray(probs)
    p = p.astype(np.float64)
    y = np.asarray(labels, dtype=np.int64).reshape(-1)
    n_classes = len(class_names)
    if p.ndim != 2 or p.shape[1] != n_classes:
        raise ValueError(f"probabilities must have shape [N, {n_classes}] for classes {list(class_names)}; got "
                         f"{p.shape}")
    if p.shape[0] != y.size:
        raise ValueError(f"{p.shape[0]} probability rows for {y.size} labels")
    if y.size == 0:
        raise ValueError("no samples to evaluate")
    if not np.all(np.isfinite(p)):
        raise FloatingPointError("model produced non-finite class probabilities")
    m = confusion_matrix(p.argmax(axis=1), y, n_classes)
    n = int(m.sum())
    tp = np.diag(m)
    support = m.sum(axis=1)  # true samples per class
    predicted = m.sum(axis=0)  # predictions per class
    fn, fp = support - tp, predicted - tp
    tn = n - tp - fn - fp
    per_class = {}
    for c, name in enumerate(class_names):
        recall = float(tp[c] / support[c]) if support[c] > 0 else None
        precision = float(tp[c] / predicted[c]) if predicted[c] > 0 else 0.0
        specificity = float(tn[c] / (tn[c] + fp[c])) if tn[c] + fp[c] > 0 else None
        denom = 2 * tp[c] + fp[c] + fn[c]
        f1 = float(2 * tp[c] / denom) if denom > 0 else None
        per_class[str(name)] = {"support": int(support[c]), "recall": recall, "precision": precision, "f1": f1,
                                "specificity": specificity,
                                "auc": binary_roc_auc(p[:, c], y == c) if n_classes > 2 else None}
    # the label set of the macro means: classes present in the labels or in the predictions
    seen = [c for c in range(n_classes) if support[c] > 0 or predicted[c] > 0]
    names = [str(class_names[c]) for c in seen]
    if n_classes == 2:
        auc = binary_roc_auc(p[:, 1], y == 1)
    else:
        auc = _mean(per_class[str(name)]["auc"] for name in class_names)
    balanced = _mean(per_class[str(name)]["recall"] for name in class_names)
    return {
        "n": n,
        "accuracy": float(tp.sum() / n),
        "balanced_accuracy": balanced,
        "macro_recall": balanced,
        "macro_precision": _mean(per_class[k]["precision"] for k in names),
        "macro_f1": _mean(per_class[k]["f1"] for k in names),
        "macro_specificity": _mean(per_class[str(name)]["specificity"] for name in class_names),
        "auc": auc,
        "per_class": per_class,
        "confusion_matrix": m.tolist(),
    }


#: the scalar metrics every job reports, in table order
SCALAR_METRICS = ("accuracy", "balanced_accuracy", "macro_precision", "macro_recall", "macro_f1", "macro_specificity",
                  "auc")


def flat_metrics(metrics: Mapping[str, object], prefix: str = "") -> dict[str, float | None]:
    """The scalar metrics plus ``<metric>_<class>`` per-class entries, as one flat dict (for logs and meta)."""
    out: dict[str, float | None] = {f"{prefix}{k}": metrics[k] for k in SCALAR_METRICS}
    for name, values in metrics["per_class"].items():
        for k in ("recall", "precision", "f1", "specificity"):
            out[f"{prefix}{k}_{name}"] = values[k]
    return out


@torch.no_grad()
def predict(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
            device: torch.device | str = "cpu") -> tuple[np.ndarray, np.ndarray]:
    """Softmax probabilities [N, C] and labels [N] of ``model`` over ``batches`` (eval mode)."""
    model = model.eval()
    probs, labels = [], []
    for x, y in batches:
        probs.append(torch.softmax(model(x.to(device)).float(), dim=1).cpu())
        labels.append(torch.as_tensor(y).cpu())
    if not probs:
        raise ValueError("no images to evaluate")
    return torch.cat(probs).numpy(), torch.cat(labels).numpy()


def evaluate(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], class_names: Sequence[str],
             source: str, device: torch.device | str = "cpu") -> dict:
    """``classification_metrics`` of ``model``; refuses (UntrainedHeadError) a model whose head was never trained."""
    require_trained_head(model, source)
    probs, labels = predict(model, batches, device)
    return classification_metrics(probs, labels, class_names)


def format_metric(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"
