"""Supervised fine-tuning of a classifier (SSL-FL (Yan et al., IEEE TMI 2023) sec. III-D) and the metrics every
fine-tuning job reports.

Pure torch / numpy (no FLARE, no scikit-learn): the FLARE executor, the local fine-tuning protocol and the
tests all call these.

``ClassifierTrainer``: AdamW (beta 0.9, 0.999), weight decay 0.05, learning rate warmed up then cosine-decayed,
indexed by (fractional) round as in SSL-FL; cross-entropy with optional label smoothing; optional FedProx
proximal term (Li et al., MLSys 2020; SSL-FL (Yan et al., IEEE TMI 2023) sec. IV-F) ``mu/2 ||w - w_t||^2`` against the
weights received this round (``set_global``).  The model must carry a ``head_steps`` buffer: the trainer counts every
optimiser step that updated the classification head in it, so a checkpoint tells whether its head was ever trained
(``require_trained_head``) and evaluation of an untrained head is refused.

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
from torch.nn import functional as F

from fedssl.core.rng import owned_global_rng
from fedssl.core.schedule import warmup_cosine
from fedssl.core.seeds import derived_seed
from fedssl.core.trainer import MixedPrecision

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


# ----------------------------------------------------------------------------------------------- training
def fedprox_term(model: nn.Module, global_params: Mapping[str, torch.Tensor], mu: float) -> torch.Tensor:
    """``mu/2 * sum ||w - w_global||^2`` over the trainable parameters that have a global counterpart."""
    total = None
    for name, w in model.named_parameters():
        if not w.requires_grad or name not in global_params:
            continue
        d = (w - global_params[name]).pow(2).sum()
        total = d if total is None else total + d
    if total is None:
        return torch.zeros((), device=next(model.parameters()).device)
    return 0.5 * mu * total


def vit_depth(model: nn.Module) -> int:
    """Number of ``encoder.blocks.<i>`` of a ViT (0 for other models)."""
    ids = {int(n.split(".")[2]) for n, _ in model.named_parameters()
           if n.startswith("encoder.blocks.") and n.split(".")[2].isdigit()}
    return max(ids) + 1 if ids else 0


def vit_layer_id(name: str, n_layers: int) -> int:
    """Layer index for layer-wise lr decay (MAE's ``get_layer_id_for_vit``): stem 0, block i -> i + 1, rest n_layers."""
    if name.startswith(("encoder.cls_token", "encoder.pos_embed", "encoder.patch_embed")):
        return 0
    if name.startswith("encoder.blocks.") and name.split(".")[2].isdigit():
        return int(name.split(".")[2]) + 1
    return n_layers


class ClassifierTrainer:
    def __init__(
        self,
        model: nn.Module,
        *,
        lr: float,
        total_rounds: int,
        warmup_rounds: float = 5,
        min_lr: float = 1e-6,
        weight_decay: float = 0.05,
        betas: tuple[float, float] = (0.9, 0.999),
        fedprox_mu: float = 0.0,
        label_smoothing: float = 0.0,
        layer_decay: float = 1.0,
        head_prefix: str = "head.",
        milestones: Sequence[float] = (),
        gamma: float = 0.1,
        device: torch.device | str = "cpu",
        seed: int = 0,
        amp: bool = False,
    ):
        """
        Args:
            model: a classifier returning logits [B, C], with a ``head_steps`` buffer and its head's parameters
                named ``<head_prefix>*``.
            lr: peak learning rate after warm-up (SSL-FL fine-tuning: 3e-3 at batch 256).
            total_rounds, warmup_rounds: the schedule, in rounds (local fine-tuning: epochs).
            min_lr: floor of the cosine decay.
            weight_decay: AdamW decoupled decay (0.05); biases, norms and 1-d tokens are not decayed.
            fedprox_mu: 0 = FedAvg; > 0 adds ``mu/2 ||w - w_t||^2`` (SSL-FL's FedProx baseline: 0.001).
            label_smoothing: cross-entropy label smoothing (0 = plain cross-entropy).
            layer_decay: layer-wise learning-rate decay of ViT fine-tuning (BEiT / MAE recipe; SSL-FL's fine-tuning
                scripts use 0.65): parameter group of layer ``l`` gets ``lr * layer_decay ** (L + 1 - l)`` with
                ``l`` = 0 for the stem (``encoder.cls_token``, ``encoder.pos_embed``, ``encoder.patch_embed.*``),
                ``i + 1`` for ``encoder.blocks.<i>.*`` and ``L + 1`` (full lr) for everything else (``fc_norm``,
                ``head``); 1.0 = one learning rate for all.
            milestones, gamma: a step schedule instead of warm-up + cosine when ``milestones`` is not empty: ``lr``
                times ``gamma`` for every milestone (in rounds / epochs) passed (FedCLF's local fine-tuning: x0.2 at
                epochs 12 and 16).  A constant lr is ``milestones=[total_rounds]``.
            amp: the forward pass in bfloat16 autocast on GPUs that support it
                (:class:`fedssl.core.trainer.MixedPrecision`; nothing on a CPU); the loss is float32.
            seed: the site's data seed; with the step count it seeds each round's owned global RNG (drop path,
                dropout; :func:`fedssl.core.rng.owned_global_rng`).
        """
        if not isinstance(getattr(model, HEAD_STEPS, None), torch.Tensor):
            raise ValueError(f"{type(model).__name__} has no {HEAD_STEPS!r} buffer; register one "
                             f"(model.register_buffer('{HEAD_STEPS}', torch.zeros((), dtype=torch.long)))")
        head = [n for n, _ in model.named_parameters() if n.startswith(head_prefix)]
        if not head:
            raise ValueError(f"{type(model).__name__} has no parameters named {head_prefix}*; set head_prefix")
        if (lr <= 0 or total_rounds < 1 or warmup_rounds < 0 or fedprox_mu < 0 or not 0 <= label_smoothing < 1
                or not 0 < layer_decay <= 1 or not 0 < gamma <= 1 or any(m <= 0 for m in milestones)):
            raise ValueError(f"invalid trainer settings: lr={lr}, total_rounds={total_rounds}, "
                             f"warmup_rounds={warmup_rounds}, fedprox_mu={fedprox_mu}, "
                             f"label_smoothing={label_smoothing}, layer_decay={layer_decay}, "
                             f"milestones={list(milestones)}, gamma={gamma}")
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.precision = MixedPrecision(self.device, amp)
        self.lr, self.total_rounds, self.warmup_rounds, self.min_lr = lr, total_rounds, warmup_rounds, min_lr
        self.fedprox_mu, self.label_smoothing, self.head_prefix = fedprox_mu, label_smoothing, head_prefix
        self.seed = int(seed)
        self.layer_decay = layer_decay
        self.milestones, self.gamma = sorted(float(m) for m in milestones), float(gamma)
        groups: dict[tuple[int, bool], dict] = {}
        n_layers = vit_depth(model) + 1
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            no_decay = p.ndim <= 1 or name.endswith((".bias", "token", "pos_embed"))
            layer = vit_layer_id(name, n_layers)
            g = groups.setdefault((layer, no_decay), {"params": [], "weight_decay": 0.0 if no_decay else weight_decay,
                                                      "lr_scale": layer_decay ** (n_layers - layer)})
            g["params"].append(p)
        self.optimizer = torch.optim.AdamW([groups[k] for k in sorted(groups)], lr=lr, betas=tuple(betas))
        self.step = 0
        self._global: dict[str, torch.Tensor] | None = None

    def set_global(self, params: Mapping[str, object] | None = None) -> None:
        """Remember w_t, the weights received this round, for the FedProx term (default: the model's current ones)."""
        if params is None:
            params = dict(self.model.named_parameters())
        self._global = {k: torch.as_tensor(np.asarray(v) if not isinstance(v, torch.Tensor) else v.detach())
                        .to(self.device, torch.float32).clone()
                        for k, v in params.items() if k in dict(self.model.named_parameters())}

    def lr_at(self, progress: float) -> float:
        if self.milestones:
            return self.lr * self.gamma ** sum(progress >= m for m in self.milestones)
        return warmup_cosine(progress, self.lr, self.warmup_rounds, self.total_rounds, self.min_lr)

    def train_round(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], round_idx: int, n_steps: int,
                    max_steps: int | None = None, abort=None) -> float:
        """One round (or epoch) over ``batches`` (``n_steps`` of them, for the schedule); returns the mean loss.

        ``abort``: optional callable checked between steps; when it returns True the round stops early.  Runs in the
        owned global RNG (:func:`fedssl.core.rng.owned_global_rng`: drop path, dropout) of (seed, the step count at
        its start), which the restart state holds.
        """
        with owned_global_rng(derived_seed(self.seed, "classifier_round", self.step), self.device):
            return self._train_round(batches, round_idx, n_steps, max_steps, abort)

    def _train_round(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], round_idx: float, n_steps: int,
                     max_steps: int | None, abort) -> float:
        if n_steps < 1:
            raise ValueError("a round needs at least one batch; the site has no labelled images to train on")
        if self.fedprox_mu > 0 and self._global is None:
            raise ValueError("FedProx needs the round's global weights: call set_global() before train_round()")
        model = self.model.train()
        losses = []
        for i, (x, y) in enumerate(batches):
            if (max_steps and i >= max_steps) or (abort is not None and abort()):
                break
            lr = self.lr_at(round_idx + i / n_steps)
            for g in self.optimizer.param_groups:
                g["lr"] = lr * g["lr_scale"]
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with self.precision.autocast():
                logits = model(x)
            loss = F.cross_entropy(logits.float(), y, label_smoothing=self.label_smoothing)
            if self.fedprox_mu > 0:
                loss = loss + fedprox_term(model, self._global, self.fedprox_mu)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"non-finite loss at round {round_idx}, step {i}; lower the learning rate")
            self.precision.step(loss, self.optimizer)
            getattr(model, HEAD_STEPS).add_(1)
            self.step += 1
            losses.append(float(loss.detach()))
        if not losses:
            raise ValueError("no batch was trained this round")
        self.last_losses = losses
        return sum(losses) / len(losses)

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "step": self.step}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])


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
