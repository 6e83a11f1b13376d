"""FedDRA's few-shot classification as the paper runs it: a linear layer fine-tuned on the frozen image encoder.

FedDRA (Shuai, Wu, Tang & Shen, TMLR), sec. 5.1.1 (1): "Following (Wang et al., 2022) [...] We fine-tune our
pre-trained model with an additional linear layer on 1%, 10% percentage of the training dataset, and evaluate the
classification accuracy"; appendix A.1.2: RSNA Pneumonia ("predict whether an image shows pneumonia") and COVIDx
("three categories: COVID-19, non-COVID pneumonia, and normal").  The paper states nothing else (no optimiser,
learning rate, epochs, batch size, nor whether the encoder is updated).

Whether the encoder is updated: **frozen**.  The paper's word "fine-tune" does not decide it (sec. 5.1.1 (2) uses it
for a frozen encoder: "We freeze the encoder and fine-tune a U-Net decoder"); the protocol it follows, MGCA
(Wang et al., NeurIPS 2022; the authors' README: "We built our repository based on MGCA"), is linear
classification on a frozen encoder: its README calls it "Linear classification", and ``mgca/models/ssl_finetuner.py``
sets ``param.requires_grad = False`` for every backbone parameter, keeps the backbone in eval mode
(``on_train_batch_start``) and computes its features under ``torch.no_grad()``.  ``train_encoder=True`` updates the
encoder too (the other reading of "fine-tune"; its optimiser settings are not from the paper or the code).

The settings the paper omits are MGCA's fine-tuner (``mgca_finetuner.py``, ``ssl_finetuner.py``,
``datasets/transforms.py``; :class:`FewShotFinetuneSettings`): AdamW (lr 5e-4, betas (0.9, 0.999), weight decay
1e-6) on the linear layer only, batch 48, 50 epochs, dropout 0, shuffled batches with the last partial one dropped,
training images resized to 256 and randomly cropped to 224 (evaluation: centre crop).  RSNA is one logit with a
binary cross-entropy (MGCA: ``num_classes = 1``, ``multilabel = True``), COVIDx three with a cross-entropy.  MGCA
stops early on a validation split's loss (patience 10) and tests the epoch of lowest validation loss: here only
when ``val_items`` are given; without them the last epoch is tested.

Deviations, all for small data: a labelled subset smaller than one batch trains as one batch (MGCA's
``drop_last=True`` would leave it none); the crop is at the encoder's input size ``S`` (resize to
``round(S * 256 / 224)``, crop ``S``), since the items come at ``S``.

- :func:`finetune_linear`: one labelled subset; returns :func:`fedssl.train.vlp_probe.linear_probe`'s metrics.
- :func:`few_shot_finetune`: one run per fraction on :func:`fedssl.train.vlp_probe.few_shot_subset`'s subset (the
  probe's, for the same seed; a trained encoder on its own copy per fraction), every random draw (head
  initialisation, batch order, crops, dropout) from a ``torch.Generator`` seeded from ``(seed, dataset, fraction)``;
  the encoder's own hidden draws (dropout inside a trained encoder) from the owned global RNG of the same seed.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedssl.core.checks import require, require_int, settings_from, settings_values
from fedssl.core.rng import owned_global_rng
from fedssl.core.seeds import derived_seed
from fedssl.train.vlp_probe import (_batches, _labels_1d, classification_scores, few_shot_subset,
                                    fraction_key)

__all__ = ["FewShotFinetuneSettings", "FEDDRA_FINETUNE", "finetune_seed", "finetune_linear",
           "few_shot_finetune", "settings_dict"]


@dataclass(frozen=True)
class FewShotFinetuneSettings:
    """The fine-tuning protocol.  Paper (FedDRA sec. 5.1.1 (1), A.1.2): ``fractions`` and the linear layer.  MGCA's
    fine-tuner (the protocol the paper follows; HKU-MedAI/MGCA ``mgca/models/mgca/mgca_finetuner.py``,
    ``mgca/models/ssl_finetuner.py``, ``mgca/datasets/transforms.py`` / ``data_module.py``): everything else.

    - ``fractions``: labelled fractions of the training set (paper: "1%, 10%").
    - ``train_encoder``: update the encoder as well (default False: MGCA freezes it; see the module docstring).
    - ``epochs``: MGCA ``args.max_epochs = 50``.
    - ``batch_size``: MGCA ``--batch_size`` default 48.
    - ``lr``, ``betas``, ``weight_decay``: MGCA ``torch.optim.AdamW(linear_layer.parameters(), lr=5e-4,
      betas=(0.9, 0.999), weight_decay=1e-6)``, no schedule.
    - ``dropout``: before the linear layer (MGCA ``SSLEvaluator``'s ``p``: 0.0, ``SSLFineTuner``'s default).
    - ``patience``: early stopping on the validation loss (MGCA ``EarlyStopping(monitor="val_loss", patience=10)``);
      used only when validation items are given.
    - ``crop_scale``: training images resized by this factor and randomly cropped back, evaluation images centre
      cropped (MGCA ``DataTransforms``: images at 256, ``RandomCrop(224)`` / ``CenterCrop(224)``); 1.0: no crop.
    - ``drop_last``: drop the last partial training batch (MGCA's train loader ``drop_last=True``)."""

    fractions: tuple[float, ...] = (0.01, 0.1)
    train_encoder: bool = False
    epochs: int = 50
    batch_size: int = 48
    lr: float = 5e-4
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 1e-6
    dropout: float = 0.0
    patience: int = 10
    crop_scale: float = 256 / 224
    drop_last: bool = True

    def check(self, component: str) -> None:
        fr = self.fractions
        require(isinstance(fr, (tuple, list)) and len(fr) > 0, component, "fractions", fr,
                "pass a non-empty list of fractions in (0, 1], e.g. [0.01, 0.1]")
        require(all(_finite(f) and 0 < f <= 1 for f in fr), component, "fractions", fr,
                "use fractions of the training set in (0, 1], e.g. [0.01, 0.1] for 1 % and 10 %")
        keys = [fraction_key(f) for f in fr]
        require(len(set(keys)) == len(keys), component, "fractions", fr, "pass distinct fractions, e.g. [0.01, 0.1]")
        require(isinstance(self.train_encoder, bool), component, "train_encoder", self.train_encoder,
                "use false (linear layer on the frozen encoder, the paper's protocol) or true (encoder trained too)")
        require_int(component, "epochs", self.epochs, 1, "use a positive number of epochs, e.g. 50")
        require_int(component, "batch_size", self.batch_size, 1, "use a positive batch size, e.g. 48")
        require_int(component, "patience", self.patience, 1, "use a positive number of epochs, e.g. 10")
        require(_finite(self.lr) and self.lr > 0, component, "lr", self.lr, "use a finite learning rate > 0, e.g. 5e-4")
        require(_finite(self.weight_decay) and self.weight_decay >= 0, component, "weight_decay", self.weight_decay,
                "use a finite weight decay >= 0, e.g. 1e-6")
        b = self.betas
        require(isinstance(b, (tuple, list)) and len(b) == 2 and all(_finite(v) and 0 <= v < 1 for v in b),
                component, "betas", b, "use two AdamW betas in [0, 1), e.g. [0.9, 0.999]")
        require(_finite(self.dropout) and 0 <= self.dropout < 1, component, "dropout", self.dropout,
                "use a dropout probability in [0, 1), e.g. 0.0")
        require(_finite(self.crop_scale) and self.crop_scale >= 1, component, "crop_scale", self.crop_scale,
                "use a resize factor >= 1 (256 / 224 as MGCA; 1.0 for no crop)")
        require(isinstance(self.drop_last, bool), component, "drop_last", self.drop_last, "use true or false")


#: the settings of the paper's protocol (FedDRA sec. 5.1.1 (1) with MGCA's fine-tuner for what the paper omits)
FEDDRA_FINETUNE = FewShotFinetuneSettings()


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def finetune_seed(seed: int, dataset: str, fraction: float) -> int:
    """The seed of one fine-tuning run: ``derived_seed(seed, "few_shot_finetune", dataset, fraction_key(fraction))``
    (e.g. ``(0, "rsna", 0.01)``), so every (seed, dataset, fraction) draws its own head, batch order and crops."""
    require(isinstance(dataset, str) and dataset != "", "finetune_seed", "dataset", dataset,
            "name the downstream set, e.g. 'rsna' or 'covidx'")
    return derived_seed(seed, "few_shot_finetune", dataset, fraction_key(fraction))


def _resize_crop(x: torch.Tensor, scale: float, generator: torch.Generator | None) -> torch.Tensor:
    """``x [B, C, S, S']`` resized (bilinear) by ``scale`` and cropped back to ``S x S'``: at offsets drawn from
    ``generator`` per image (training; torchvision ``RandomCrop``), or centred when it is None (torchvision
    ``CenterCrop``: ``round((R - S) / 2)``).  ``scale`` 1.0 returns ``x``."""
    if scale == 1.0:
        return x
    h, w = x.shape[-2:]
    rh, rw = int(round(h * scale)), int(round(w * scale))
    big = F.interpolate(x.float(), size=(rh, rw), mode="bilinear", align_corners=False)
    if generator is None:
        top, left = int(round((rh - h) / 2.0)), int(round((rw - w) / 2.0))
        return big[..., top:top + h, left:left + w]
    tops = torch.randint(0, rh - h + 1, (x.shape[0],), generator=generator).tolist()
    lefts = torch.randint(0, rw - w + 1, (x.shape[0],), generator=generator).tolist()
    return torch.stack([big[i, :, t:t + h, s:s + w] for i, (t, s) in enumerate(zip(tops, lefts))])


class _Run:
    """One fine-tuning run: the encoder's feature function, the head and the generator."""

    def __init__(self, component: str, encoder: nn.Module, features: str | None, n_classes: int,
                 settings: FewShotFinetuneSettings, generator: torch.Generator, device: torch.device):
        self.component, self.encoder, self.s, self.g, self.device = component, encoder, settings, generator, device
        self.n_classes, self.n_out = n_classes, 1 if n_classes == 2 else n_classes
        self.feature_fn: Callable[[torch.Tensor], torch.Tensor] = getattr(encoder, features) if features else encoder
        self.head: nn.Linear | None = None

    def images(self, x: torch.Tensor, train: bool) -> torch.Tensor:
        if self.s.crop_scale != 1.0:
            require(x.dim() == 4, self.component, "train_items", f"images of shape {tuple(x.shape[1:])}",
                    "items must be (C, H, W) images to crop; pass crop_scale=1.0 to feed them unchanged")
        return _resize_crop(x, self.s.crop_scale, self.g if train else None).to(self.device)

    def features(self, x: torch.Tensor, train: bool) -> torch.Tensor:
        if train and self.s.train_encoder:
            self.encoder.train()
            f = self.feature_fn(x)
        else:
            self.encoder.eval()
            with torch.no_grad():
                f = self.feature_fn(x)
        require(torch.is_tensor(f) and f.dim() == 2 and f.shape[0] == x.shape[0], self.component, "features",
                f"output {tuple(f.shape) if torch.is_tensor(f) else type(f).__name__} for {x.shape[0]} images",
                "the encoder (or its method named by features) must return (B, D) features")
        return f.float()

    def make_head(self, dim: int) -> nn.Linear:
        """nn.Linear's default initialisation (weight and bias uniform in +-1/sqrt(dim)), drawn from the generator."""
        bound = 1.0 / math.sqrt(dim)
        head = nn.utils.skip_init(nn.Linear, dim, self.n_out)  # no draw from the global generator
        with torch.no_grad():
            head.weight.copy_((torch.rand(self.n_out, dim, generator=self.g) * 2 - 1) * bound)
            head.bias.copy_((torch.rand(self.n_out, generator=self.g) * 2 - 1) * bound)
        return head.to(self.device)

    def logits(self, f: torch.Tensor, train: bool) -> torch.Tensor:
        if train and self.s.dropout > 0:
            keep = (torch.rand(f.shape, generator=self.g) >= self.s.dropout).to(f.device)
            f = f * keep / (1.0 - self.s.dropout)
        return self.head(f)

    def loss(self, logits: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        y = y.to(logits.device)
        if self.n_out == 1:
            return F.binary_cross_entropy_with_logits(logits[:, 0], y.float(), reduction=reduction)
        return F.cross_entropy(logits, y, reduction=reduction)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.double()
        if self.n_out == 1:
            p = torch.sigmoid(logits[:, 0])
            return torch.stack([1 - p, p], dim=1)
        return torch.softmax(logits, dim=1)

    def check_labels(self, y: torch.Tensor, arg: str) -> None:
        bad = y[(y < 0) | (y >= self.n_classes)].unique().tolist()
        require(not bad, self.component, arg, f"labels {bad}", f"labels must lie in [0, n_classes={self.n_classes})")

    def evaluate(self, items, batch_size: int, arg: str) -> tuple[np.ndarray, np.ndarray, float]:
        """(class probabilities, labels, mean loss) of every item, centre-cropped, encoder in eval mode."""
        probs, labels, total = [], [], 0.0
        for x, y in _batches(items, list(range(len(items))), batch_size):
            self.check_labels(y, arg)
            with torch.no_grad():
                z = self.logits(self.features(self.images(x, train=False), train=False), train=False)
                total += float(self.loss(z, y, reduction="sum"))
            probs.append(self.probs(z).cpu().numpy())
            labels.append(y.numpy())
        y_all = np.concatenate(labels)
        return np.concatenate(probs), y_all, total / max(1, y_all.size)

    def state(self) -> dict:
        keep = {"head": copy.deepcopy(self.head.state_dict())}
        if self.s.train_encoder:
            keep["encoder"] = copy.deepcopy(self.encoder.state_dict())
        return keep

    def restore(self, state: dict) -> None:
        self.head.load_state_dict(state["head"])
        if "encoder" in state:
            self.encoder.load_state_dict(state["encoder"])


def _epoch_batches(indices: Sequence[int], settings: FewShotFinetuneSettings,
                   generator: torch.Generator) -> list[list[int]]:
    """One epoch's batches: ``indices`` shuffled (from ``generator``) and cut into ``batch_size`` chunks, the last
    partial one dropped when ``drop_last`` and at least one full batch exists (else all of them as one batch)."""
    order = [indices[i] for i in torch.randperm(len(indices), generator=generator).tolist()]
    b = settings.batch_size
    chunks = [order[s:s + b] for s in range(0, len(order), b)]
    if settings.drop_last and len(chunks) > 1 and len(chunks[-1]) < b:
        chunks = chunks[:-1]
    return chunks


def finetune_linear(encoder: nn.Module, train_items, train_indices: Sequence[int], test_items, n_classes: int, *,
                    seed: int, settings: FewShotFinetuneSettings = FEDDRA_FINETUNE, features: str | None = None,
                    val_items=None, device: str | torch.device | None = None,
                    train_labels: Sequence[int] | None = None) -> dict:
    """Fine-tune a linear layer on ``encoder``'s features of ``train_items[i]`` for ``i`` in ``train_indices``,
    then score it on every test item.  Returns ``{"accuracy", "balanced_accuracy", "auroc"`` (as
    :func:`fedssl.train.vlp_probe.linear_probe`), ``"test_loss"`` (mean cross-entropy), ``"n_train", "n_test",
    "epochs_run", "selected_epoch"`` (1-based; the last epoch without ``val_items``, the lowest validation loss with
    them: the head, and a trained encoder, of that epoch are the ones tested)``}``.

    ``encoder``: an ``nn.Module`` whose ``forward`` (or method named ``features``, e.g. ``"image_features"`` of
    :class:`fedssl.models.vlp.VisionLanguageModel`) maps ``(B, C, H, W)`` images to ``(B, D)`` features.  It is
    used **in place**: with ``settings.train_encoder`` it is trained (pass a copy; :func:`few_shot_finetune` does),
    without it its parameters are left alone (not in the optimiser, features under ``torch.no_grad``, eval mode).
    Its train/eval mode is restored on return.  ``device``: where batches and the head go (default: the encoder's
    parameters' device; the encoder is not moved).  ``seed``: every random draw of the run comes from
    ``torch.Generator().manual_seed(seed)`` (use :func:`finetune_seed`); the encoder's hidden draws from the owned
    global RNG of ``seed``.  ``train_labels``: the labels the caller drew the subset from; each training batch's
    labels must equal them."""
    component = "finetune_linear"
    require(isinstance(encoder, nn.Module), component, "encoder", type(encoder).__name__,
            "pass the image encoder as an nn.Module (e.g. the VisionLanguageModel, with features='image_features')")
    require(isinstance(settings, FewShotFinetuneSettings), component, "settings", type(settings).__name__,
            "pass a FewShotFinetuneSettings (e.g. FEDDRA_FINETUNE)")
    settings.check(component)
    require(features is None or (isinstance(features, str) and callable(getattr(encoder, features, None))),
            component, "features", features, f"name a method of {type(encoder).__name__} that returns (B, D) features "
            "(e.g. 'image_features'), or None for its forward")
    require_int(component, "n_classes", n_classes, 2, "a classifier needs at least 2 classes")
    require_int(component, "seed", seed, 0, "use a non-negative int seed (fedssl.train.vlp_finetune.finetune_seed)")
    idx = [int(i) for i in train_indices]
    require(len(idx) > 0 and len(set(idx)) == len(idx) and all(0 <= i < len(train_items) for i in idx), component,
            "train_indices", f"{len(idx)} indices", f"pass distinct indices of train_items (0..{len(train_items) - 1})")
    require(len(test_items) > 0, component, "test_items", "0 items", "pass at least one test image")
    require(val_items is None or len(val_items) > 0, component, "val_items", "0 items",
            "pass at least one validation image, or None to test the last epoch")
    params = list(encoder.parameters())
    if device is None:
        device = params[0].device if params else torch.device("cpu")
    device = torch.device(device)
    require(not params or params[0].device == device, component, "device", str(device),
            f"put the encoder on it first (its parameters are on {params[0].device if params else None})")

    g = torch.Generator().manual_seed(seed)
    run = _Run(component, encoder, features, n_classes, settings, g, device)
    was_training, requires = encoder.training, [p.requires_grad for p in params]
    best, best_loss, wait, epochs_run, selected = None, math.inf, 0, 0, settings.epochs
    try:
        if not settings.train_encoder:
            for p in params:
                p.requires_grad_(False)
        with owned_global_rng(seed, device):
            opt = None
            for epoch in range(settings.epochs):
                for chunk in _epoch_batches(idx, settings, g):
                    x, y = next(_batches(train_items, chunk, len(chunk)))
                    run.check_labels(y, "train_items")
                    require(train_labels is None or y.tolist() == [int(train_labels[i]) for i in chunk], component,
                            "train_labels", "labels differ from items'", "pass the labels train_items returns, in "
                            "item order")
                    f = run.features(run.images(x, train=True), train=True)
                    if run.head is None:
                        run.head = run.make_head(f.shape[1])
                        trained = list(run.head.parameters())
                        if settings.train_encoder:
                            trained = [p for p in params if p.requires_grad] + trained
                        opt = torch.optim.AdamW(trained, lr=settings.lr, betas=tuple(settings.betas),
                                                weight_decay=settings.weight_decay)
                    loss = run.loss(run.logits(f, train=True), y)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                epochs_run = epoch + 1
                if val_items is not None:
                    _, _, val_loss = run.evaluate(val_items, settings.batch_size, "val_items")
                    if val_loss < best_loss:
                        best, best_loss, wait, selected = run.state(), val_loss, 0, epoch + 1
                    else:
                        wait += 1
                        if wait >= settings.patience:
                            break
            if best is not None:
                run.restore(best)
            probs, y, test_loss = run.evaluate(test_items, settings.batch_size, "test_items")
    finally:
        for p, r in zip(params, requires):
            p.requires_grad_(r)
        encoder.train(was_training)
    return {**classification_scores(probs, y, n_classes), "test_loss": test_loss, "n_train": len(idx),
            "n_test": int(y.size),
            "epochs_run": epochs_run, "selected_epoch": selected if val_items is not None else epochs_run}


def few_shot_finetune(encoder: nn.Module, train_items, test_items, *, dataset: str, seed: int = 0,
                      settings: FewShotFinetuneSettings | None = None, n_classes: int | None = None,
                      train_labels: Sequence[int] | None = None, val_items=None, features: str | None = None,
                      device: str | torch.device | None = None, **overrides) -> dict[str, dict]:
    """FedDRA's few-shot classification: ``{"1%": {...}, "10%": {...}}``, each :func:`finetune_linear`'s dict plus
    ``"fraction"`` and ``"train_encoder"``, in the shape of :func:`fedssl.train.vlp_probe.few_shot_probe`'s.

    Each fraction's labelled images are ``few_shot_subset(train labels, fraction, seed)`` -- the probe's subset for
    the same seed -- and its run draws from ``finetune_seed(seed, dataset, fraction)``.  Each run starts from a fresh
    copy of ``encoder`` when the encoder is trained (the caller's is never changed); a frozen encoder is used as is.
    ``settings``: default :data:`FEDDRA_FINETUNE`; ``overrides``: any of its fields by name (e.g. ``epochs=5``).
    ``n_classes``: default one more than the largest training label (RSNA: 2; COVIDx: 3, or 2 for the binary CXR-3
    labels).  ``train_labels``: the training items' labels, if known without loading the images."""
    component = "few_shot_finetune"
    base = FEDDRA_FINETUNE if settings is None else settings
    require(isinstance(base, FewShotFinetuneSettings), component, "settings", type(base).__name__,
            "pass a FewShotFinetuneSettings (e.g. FEDDRA_FINETUNE), or None")
    s = settings_from(component, FewShotFinetuneSettings, {**settings_values(base), **overrides})
    require(isinstance(dataset, str) and dataset != "", component, "dataset", dataset,
            "name the downstream set, e.g. 'rsna' or 'covidx' (it seeds the run)")
    require_int(component, "seed", seed, 0, "use a non-negative int seed")
    require(len(train_items) > 0, component, "train_items", "0 items", "pass at least one training image")
    if train_labels is None:
        train_labels = [int(train_items[i][1]) for i in range(len(train_items))]
    y_all = _labels_1d(component, "train_labels", train_labels)
    require(y_all.size == len(train_items), component, "train_labels", f"{y_all.size} labels",
            f"pass one label per training item ({len(train_items)})")
    if n_classes is None:
        n_classes = max(2, int(y_all.max()) + 1)
    out = {}
    for f in s.fractions:
        subset = few_shot_subset(y_all, f, seed)
        net = copy.deepcopy(encoder) if s.train_encoder else encoder
        res = finetune_linear(net, train_items, subset, test_items, n_classes, seed=finetune_seed(seed, dataset, f),
                              settings=s, features=features, val_items=val_items, device=device, train_labels=y_all)
        out[fraction_key(f)] = {**res, "fraction": float(f), "train_encoder": s.train_encoder}
    return out


def settings_dict(settings: FewShotFinetuneSettings = FEDDRA_FINETUNE) -> dict:
    """The settings as a JSON-ready dict (tuples as lists), for a run's record."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(settings).items()}
