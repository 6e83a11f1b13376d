"""Class-heterogeneous multi-label chest X-ray classification on one site (surgical aggregation (Kulkarni et al., ML4H
2024)) and its LocalTrainer.

:class:`MultiLabelLocalTrainer` trains a :class:`fedssl.models.densenet.MultiLabelDenseNet` on one site's data
(or, for the centralised baseline, on the pooled data of every site) the way the paper does (sec. 2.5):

- once, before the first round: the head (and the layer before it) warmed up with the feature extractor frozen
  (Adam, ``warmup_lr``, ``warmup_epochs``; the frozen base keeps its batch-norm statistics);
- every round: every weight trained for ``local_epochs`` (Adam, ``lr``; under FedBN+ batch-norm frozen at its
  initial statistics), the loss by method (``fedssl.core.multilabel``): surgical / personalised / individual /
  centralised: BCE over the head's classes (NaN targets, a class the image's source does not label, left out);
  vanilla: BCE over ``C``, classes the site lacks are negatives; partial_loss: BCE over the ``C_k`` columns only
  (eq. 4);
- validation: NaN-aware BCE and mean AUROC on the validation split (the server's model selection: "mean of local
  validation BCE loss"); test: per-class AUROC with bootstrap 95 % CIs on the site's test split over its own
  classes and, with an external root (MIMIC-CXR-JPG layout), on the external set with every class of the model.

What is exchanged depends on the method: the whole model (surgical: head over ``C_k``; vanilla / partial_loss:
head over ``C``), no head (personalised) or nothing (individual).  A site's data is split by patient
(70/10/20 as the paper; seeded), so no patient is in two splits (:func:`load_splits`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch
from torch import nn

from fedssl.core.checks import require, require_amp, require_int, require_workers
from fedssl.core.rng import owned_global_rng
from fedssl.core.seeds import derived_seed, site_seed
from fedssl.core.multilabel import column_index, expand_targets, labelled, masked_bce
from fedssl.core.surgical import check_class_list, is_head_key, local_keys
from fedssl.core.trainer import MixedPrecision, RoundStats, check_stop, detached, load_checked
from fedssl.data.cxr import CXRDataset, batches, dataset_classes, external_dataset, load_cxr_site, patient_split
from fedssl.data.loading import loader_options
from fedssl.eval.auroc import labelled_bce, labelled_mean_auroc
from fedssl.eval.surgical_report import auroc_table
from fedssl.models.densenet import MultiLabelDenseNet, freeze_batchnorm, is_bn_key, set_features_trainable

DATASETS = ("nih", "chexpert")
#: methods whose model (head included) is the federation's product; the test task scores the global model
GLOBAL_HEAD_METHODS = ("surgical", "vanilla", "partial_loss")
#: methods whose head covers the network's classes C (the site's C_k are some of its columns)
FULL_HEAD_METHODS = ("vanilla", "partial_loss")


def check_run_switches(switches: Mapping[str, Any], previous: Mapping[str, Any] | None, methods: Sequence[str],
                       backbones: Sequence[str], own: Sequence[str], registered: Sequence[str] | None,
                       site: str) -> dict:
    """The task's switches (method, backbone): known, fixed for a run; the classes the server registered for this
    site must be the ones it declares.  Returns the switches; raises ValueError naming the site."""
    switches = {"method": switches.get("method"), "backbone": switches.get("backbone")}
    if switches["method"] not in methods or switches["backbone"] not in backbones:
        raise ValueError(f"{site}: the task carries method={switches['method']!r}, backbone={switches['backbone']!r}; "
                         "the server must run ClassRegistration and the HeadSlicer filter")
    if previous is not None and switches != dict(previous):
        raise ValueError(f"{site}: the server switched from {dict(previous)} to {switches} mid-run")
    if registered is not None and list(registered) != list(own):
        raise ValueError(f"{site}: the server registered this site's classes as {list(registered)} but its "
                         f"configuration now declares {list(own)}; a site's classes are fixed for a run")
    return switches


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


@dataclass(frozen=True)
class MultiLabelSettings:
    """Every setting of a site (paper settings as defaults, surgical aggregation (Kulkarni et al., ML4H 2024) sec. 2.5),
    declared once: the job arguments of ``MultiLabelExecutor`` and what :class:`MultiLabelLocalTrainer` reads.

    data_root: the site's dataset folder ("" = site config / FEDSSL_DATA_ROOT; ``{site}`` = site name); dataset:
    "nih" / "chexpert" or an object keyed by site name ("" = site config); classes: ``C_k`` (a list or an object
    keyed by site name; [] = site config); external_test_root: a MIMIC-CXR-JPG (or NIH-layout held-out) folder for
    the test task ("" = none).  device: "auto" (CUDA when available), "cpu", "cuda:1" ...; imagenet_path: the same
    local torchvision densenet121 state dict as the server's ``model`` component ("" = random init; the round-0
    broadcast carries the server's initial model, batch-norm included, in any case); amp: bfloat16 autocast on GPUs
    that support it.

    growth_rate, block_config, num_init_features, hidden_features, dropout: DenseNet-121 = 32, [6, 12, 24, 16],
    64, 256 with dropout 0.3 (the public code's 256-unit layer before the class layer); must match the server's
    model.  batch_size 64; warmup_epochs 15 at warmup_lr 5e-3 (head only, frozen backbone); lr 5e-5 for all
    weights; local_epochs per round (paper: 1); max_steps_per_epoch caps an epoch (0 = full).  rotation, zoom,
    contrast, flip: training augmentation (public code's Keras layers: rotation 0.2 of a turn, zoom +-50 %,
    contrast 0.75, horizontal flip; ``fedssl.data.cxr.CXRDataset``).  split: train / validation / test fractions
    of the site's patients (paper: 70/10/20).  n_bootstrap: resamples for the AUROC 95 % confidence intervals.
    seed: the job seed.  The initial weights are drawn from it (every site builds the same model); the data side
    of a site (patient split, batch order, augmentation) from ``fedssl.core.seeds.site_seed(seed, site)``, so sites
    are independent samples (issue 13 item 9) and a site's split is the same in every run of the job (the
    centralised baseline pools exactly the patients the sites train on).  workers: DataLoader worker processes
    that load and augment the next batches (0 = in the training process; the batches are the same either way);
    batches are pinned on a CUDA device.
    """

    data_root: str = ""
    dataset: Any = ""
    classes: Any = ()
    external_test_root: str = ""
    growth_rate: int = 32
    block_config: Sequence[int] = (6, 12, 24, 16)
    num_init_features: int = 64
    hidden_features: int = 256
    dropout: float = 0.3
    image_size: int = 224
    batch_size: int = 64
    warmup_epochs: int = 15
    warmup_lr: float = 5e-3
    lr: float = 5e-5
    local_epochs: int = 1
    max_steps_per_epoch: int = 0
    rotation: float = 0.2
    zoom: float = 0.5
    contrast: float = 0.75
    flip: bool = True
    split: Sequence[float] = (0.7, 0.1, 0.2)
    n_bootstrap: int = 1000
    seed: int = 0
    workers: int = 0
    device: str = "auto"
    imagenet_path: str = ""
    amp: bool = False

    @classmethod
    def of(cls, args: Mapping[str, Any]) -> MultiLabelSettings:
        """The settings among ``args`` (e.g. the executor's arguments); other keys are ignored."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in args.items() if k in names})

    def check(self, name: str) -> None:
        """Every setting checked; a ValueError names component ``name``, the argument, its value and the fix."""
        data_root, dataset, classes = self.data_root, self.dataset, self.classes
        require(isinstance(data_root, str), name, "data_root", data_root, 'use a path string or ""')
        require(dataset in ("",) + DATASETS
                or (isinstance(dataset, dict) and all(v in DATASETS for v in dataset.values())), name, "dataset",
                dataset, f'use one of {list(DATASETS)}, an object {{"site-1": "nih", ...}}, or "" (site config)')
        if isinstance(classes, dict):
            for site, cl in classes.items():
                check_class_list(cl, site)
        elif classes:
            check_class_list(list(classes), "<executor argument classes>")
        ext = self.external_test_root
        require(isinstance(ext, str), name, "external_test_root", ext, 'use a path or ""')
        for arg in ("growth_rate", "num_init_features"):
            require_int(name, arg, getattr(self, arg), 1, "DenseNet-121: growth_rate 32, num_init_features 64")
        bc = self.block_config
        require(isinstance(bc, (list, tuple)) and len(bc) == 4 and all(isinstance(b, int) and b >= 1 for b in bc),
                name, "block_config", bc, "use 4 positive layer counts, DenseNet-121: [6, 12, 24, 16]")
        require_int(name, "hidden_features", self.hidden_features, 0, "use 0 or a positive width (public code: 256)")
        dropout = self.dropout
        require(isinstance(dropout, (int, float)) and not isinstance(dropout, bool) and 0 <= dropout < 1, name,
                "dropout", dropout, "use a probability in [0, 1) (public code: 0.3)")
        require_int(name, "image_size", self.image_size, 16, "use at least 16 pixels (paper: 224)")
        require_int(name, "batch_size", self.batch_size, 2, "paper: 64")
        require_int(name, "warmup_epochs", self.warmup_epochs, 0, "paper: 15 (0 = no warm-up)")
        require(_positive(self.warmup_lr), name, "warmup_lr", self.warmup_lr, "paper: 5e-3")
        require(_positive(self.lr), name, "lr", self.lr, "paper: 5e-5")
        require_int(name, "local_epochs", self.local_epochs, 1, "paper: 1")
        require_int(name, "max_steps_per_epoch", self.max_steps_per_epoch, 0,
                    "use 0 (full epoch) or a positive step count")
        for arg, hi in (("rotation", 0.5), ("zoom", 0.9), ("contrast", 1.0)):
            value = getattr(self, arg)
            require(isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= hi, name, arg,
                    value, f"use a value in [0, {hi}] (public code: rotation 0.2, zoom 0.5, contrast 0.75)")
        require(isinstance(self.flip, bool), name, "flip", self.flip, "use true or false")
        split = self.split
        require(isinstance(split, (list, tuple)) and len(split) == 3 and all(_positive(f) for f in split)
                and abs(sum(split) - 1.0) < 1e-6, name, "split", split,
                "use three positive fractions summing to 1, paper: [0.7, 0.1, 0.2]")
        require_int(name, "n_bootstrap", self.n_bootstrap, 0, "paper-style CIs: 1000 (0 = no CI)")
        require(isinstance(self.seed, int) and not isinstance(self.seed, bool), name, "seed", self.seed,
                "use an integer")
        require_workers(name, self.workers)
        require_amp(name, self.amp)
        require(isinstance(self.imagenet_path, str), name, "imagenet_path", self.imagenet_path,
                'use the server model\'s path to a torchvision densenet121 state dict, or "" for random init')


def check_multilabel_args(name: str, args: Mapping[str, Any]) -> None:
    """Check the :class:`MultiLabelSettings` among ``args`` (other keys are ignored); a ValueError names component
    ``name``, argument, value and fix."""
    MultiLabelSettings.of(args).check(name)


def load_splits(root: str, dataset: str, site: str, classes: Sequence[str], settings: MultiLabelSettings) -> dict:
    """The site's patient-level train / validation / test datasets over its ``classes`` (+ their sizes)."""
    if dataset not in DATASETS:
        raise ValueError(f"{site}: dataset {dataset!r} is not one of {list(DATASETS)}")
    s, seed = settings, site_seed(settings.seed, site)  # data side: the site's own seed
    records = load_cxr_site(root, dataset, site=site)
    train, val, test = patient_split(records, fractions=tuple(s.split), seed=seed)
    if not train or not val or not test:
        raise ValueError(f"{site}: {len(records)} images split into {len(train)}/{len(val)}/{len(test)} "
                         "train/validation/test; every split needs images")
    aug = {"rotation": s.rotation, "zoom": s.zoom, "contrast": s.contrast, "flip": s.flip}
    return {"dataset": dataset, "n_train": len(train), "n_val": len(val), "n_test": len(test),
            "train": CXRDataset(train, classes, s.image_size, train=True, site=site, seed=seed, **aug),
            "val": CXRDataset(val, classes, s.image_size, train=False, site=site),
            "test": CXRDataset(test, classes, s.image_size, train=False, site=site)}


def build_model(classes: Sequence[str], settings: MultiLabelSettings,
                imagenet_path: str | None = None) -> MultiLabelDenseNet:
    """The DenseNet with a head over ``classes`` (seeded: building it leaves the global RNG untouched)."""
    s = settings
    return MultiLabelDenseNet(list(classes), s.growth_rate, tuple(s.block_config), s.num_init_features,
                              hidden_features=s.hidden_features, dropout=s.dropout, seed=s.seed,
                              imagenet_path=imagenet_path)


@torch.no_grad()
def scores(model: nn.Module, dataset, settings: MultiLabelSettings) -> tuple[np.ndarray, np.ndarray]:
    """(probabilities [N, |model head|], targets [N, |dataset classes|]) on ``dataset`` (no augmentation)."""
    model.eval()
    device = next(model.parameters()).device
    probs, targets = [], []
    for x, y in batches(dataset, settings.batch_size, seed=settings.seed, epoch=0, shuffle=False, max_batches=0,
                        **loader_options(settings.workers, device)):
        probs.append(torch.sigmoid(model(x.to(device))).cpu().numpy())
        targets.append(np.asarray(y, dtype=np.float32))
    return np.concatenate(probs), np.concatenate(targets)


def auroc_report(model: MultiLabelDenseNet, dataset, classes: Sequence[str], site: str, source: str,
                settings: MultiLabelSettings, external_root: str = "") -> dict:
    """The test reply: per-class AUROC (bootstrap CIs) of ``model`` on ``dataset`` (a site's test patients, targets
    over its ``classes``); with ``external_root`` also on the external set (every annotated class of the head)."""
    head, classes = list(model.classes), list(classes)
    probs, targets = scores(model, dataset, settings)
    cols = column_index(classes, head, site)
    result = {"model": source, "n_test": int(len(targets)),
              "test": auroc_table(probs[:, cols], targets, classes, n_bootstrap=settings.n_bootstrap,
                                  seed=settings.seed)}
    result["mean_auroc"] = result["test"]["mean_auroc"]
    if external_root:
        result["external"] = external_report(model, site, external_root, settings)
        result["external_mean_auroc"] = result["external"]["mean_auroc"]
    return result


def external_report(model: MultiLabelDenseNet, site: str, root: str, settings: MultiLabelSettings) -> dict:
    """Per-class AUROC of ``model`` on the external set at ``root`` (all of it), every class of the head the set
    annotates: MIMIC-CXR-JPG, or an NIH-layout folder (the ablation's held-out NIH test set, paper sec. 2.4.1)."""
    head, dataset = list(model.classes), external_dataset(root)
    records = load_cxr_site(root, dataset, site=site, split="all")  # all of it is external to the federation
    annotated = set(dataset_classes(dataset, root, site))
    classes = [c for c in head if c in annotated]  # a class the external set does not annotate has no truth
    if not classes:
        raise ValueError(f"{site}: the external test set at {root} annotates none of the model's classes {head}")
    probs, targets = scores(model, CXRDataset(records, classes, settings.image_size, train=False, site=site), settings)
    cols = column_index(classes, head, site)
    table = auroc_table(probs[:, cols], targets, classes, n_bootstrap=settings.n_bootstrap, seed=settings.seed)
    table["n_images"] = len(records)
    table["not_annotated"] = [c for c in head if c not in annotated]
    return table


class MultiLabelLocalTrainer:
    """One site's (or the pooled data's) multi-label training under a method (a ``LocalTrainer``).

    ``splits``: datasets ``train`` and ``val`` (``test`` for ``evaluate("test")``) with targets over ``classes``
    (the site's C_k, in its order; NaN = not labelled); ``head``: the model's classes (C_k, or C for vanilla /
    partial loss; the centralised baseline: C for both); ``method`` picks the loss and what is exchanged,
    ``backbone`` ("fedavg" / "fedbn" / "fedbn_plus") what stays local and whether batch-norm is frozen.
    ``imagenet_path``: a torchvision densenet121 checkpoint for the features (the server's initial model).
    The initial weights come from the job seed (``settings.seed``), the batch order from ``site_seed(seed, site)``;
    every epoch (warm-up included) runs in the owned global RNG of (site seed, epoch count), every evaluation in that
    of (site seed, split) (:func:`fedssl.core.rng.owned_global_rng`), so the head's dropout draws are reproducible
    and the global generators are left as they were.
    The restart state (``state_dict``) holds the model, the optimiser, the warm-up flag and the epoch counter.
    """

    def __init__(self, splits: Mapping[str, Any], classes: Sequence[str], head: Sequence[str], *, method: str,
                 backbone: str = "fedavg", site: str = "?", settings: MultiLabelSettings = MultiLabelSettings(),
                 imagenet_path: str | None = None, device: str | torch.device = "cpu", amp: bool = False):
        self.splits, self.site, self.settings = splits, site, settings
        self.classes, self.head = list(classes), list(head)
        column_index(self.classes, self.head, site)  # every class of the site is a column of the head
        self.switches = {"method": method, "backbone": backbone}
        self.data_seed = site_seed(settings.seed, site)  # batch order; the model is built from the job seed
        self.model = build_model(self.head, settings, imagenet_path).to(torch.device(device))
        self.precision = MixedPrecision(torch.device(device), amp)  # bfloat16 autocast on GPUs that support it
        if backbone == "fedbn_plus":
            freeze_batchnorm(self.model)
        self.optimizer = torch.optim.Adam([p for p in self.model.parameters() if p.requires_grad], lr=settings.lr)
        self.warmed_up = False
        self.epoch = 0  # epochs run (warm-up included): the batch order and augmentation of the next one
        self.step_losses: list[float] = []  # the per-step losses of the current round (for the curve)

    @property
    def method(self) -> str:
        return self.switches["method"]

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ------------------------------------------------------------------ training
    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The method's loss of head ``logits`` [B, |head|] on targets [B, |classes|]."""
        if self.method in FULL_HEAD_METHODS:
            full, mask = expand_targets(targets, self.classes, self.head,
                                        missing="negative" if self.method == "vanilla" else "ignore", site=self.site)
            return masked_bce(logits, full, mask)
        return masked_bce(logits, *labelled(targets))  # NaN: a class the image's source does not label (pooled data)

    def _run_epoch(self, opt: torch.optim.Optimizer, should_stop: Callable[[], bool] | None,
                   frozen_features: bool) -> tuple[float, int]:
        with owned_global_rng(derived_seed(self.data_seed, "multilabel_epoch", self.epoch), self.device):
            return self._epoch(opt, should_stop, frozen_features)

    def _epoch(self, opt: torch.optim.Optimizer, should_stop: Callable[[], bool] | None,
               frozen_features: bool) -> tuple[float, int]:
        model, device, s = self.model, self.device, self.settings
        model.train()
        if frozen_features:
            model.features.eval()  # warm-up: frozen backbone, BN statistics kept (Keras frozen base)
        if self.switches["backbone"] == "fedbn_plus":
            freeze_batchnorm(model)
        total, steps = 0.0, 0
        for x, y in batches(self.splits["train"], s.batch_size, seed=self.data_seed, epoch=self.epoch, shuffle=True,
                            max_batches=s.max_steps_per_epoch, **loader_options(s.workers, device)):
            check_stop(should_stop)
            with self.precision.autocast():
                logits = model(x.to(device, non_blocking=True))
            loss = self.loss(logits.float(), y.to(device, non_blocking=True).float())
            if not torch.isfinite(loss):
                raise FloatingPointError(f"{self.site}: non-finite training loss at epoch {self.epoch}")
            self.precision.step(loss, opt)
            total, steps = total + float(loss.detach()), steps + 1
            self.step_losses.append(float(loss.detach()))
        self.epoch += 1
        return total / max(steps, 1), steps

    def warm_up(self, should_stop: Callable[[], bool] | None = None) -> float:
        """Paper 2.5: the head (and the layer before it) trained with the feature extractor frozen, with its own
        Adam at ``warmup_lr`` for ``warmup_epochs``; returns the last epoch's mean loss."""
        set_features_trainable(self.model, False)
        opt = torch.optim.Adam([p for p in self.model.parameters() if p.requires_grad], lr=self.settings.warmup_lr)
        loss = float("nan")
        try:
            for _ in range(self.settings.warmup_epochs):
                loss, _ = self._run_epoch(opt, should_stop, frozen_features=True)
        finally:
            set_features_trainable(self.model, True)
            if self.switches["backbone"] == "fedbn_plus":
                freeze_batchnorm(self.model)
        self.warmed_up = True
        return loss

    def train_round(self, round_idx: int, should_stop: Callable[[], bool] | None = None) -> RoundStats:
        """The warm-up (once, before the first round) then ``local_epochs`` epochs over the training split."""
        s = self.settings
        warm = self.warm_up(should_stop) if not self.warmed_up and s.warmup_epochs else None
        self.warmed_up = True
        losses, steps, self.step_losses = [], 0, []
        for _ in range(s.local_epochs):
            loss, n = self._run_epoch(self.optimizer, should_stop, frozen_features=False)
            losses.append(loss)
            steps += n
        metrics = {"lr": s.lr} if warm is None else {"warmup_loss": warm, "lr": s.lr}
        return RoundStats(loss=sum(losses) / len(losses), steps=steps, samples=len(self.splits["train"]),
                          metrics=metrics, curve=[{"loss": x} for x in self.step_losses])

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, split: str = "val", model: MultiLabelDenseNet | None = None, source: str = "",
                 external_root: str = "") -> dict[str, Any]:
        """``"val"``: ``val_loss`` (NaN-aware BCE) and ``val_auroc`` (mean AUROC) of the model on the validation
        split; ``"test"``: the test reply (:func:`auroc_report`) of ``model`` (default: this trainer's model; e.g.
        :meth:`global_model`), named ``source``, with the external set at ``external_root`` when given."""
        with owned_global_rng(derived_seed(self.data_seed, "evaluate", split), self.device):
            return self._evaluate(split, self.model if model is None else model, source, external_root)

    def _evaluate(self, split: str, model: MultiLabelDenseNet, source: str, external_root: str) -> dict[str, Any]:
        if split == "val":
            probs, targets = scores(model, self.splits["val"], self.settings)
            cols = column_index(self.classes, list(model.classes), self.site)
            # pooled (centralised) data: entries of a class the image's source does not label are NaN and left out
            return {"val_loss": labelled_bce(probs[:, cols], targets),
                    "val_auroc": labelled_mean_auroc(probs[:, cols], targets)}
        if split == "test":
            source = source or ("personalised model" if self.method == "personalised" else "local model")
            return auroc_report(model, self.splits["test"], self.classes, self.site, source, self.settings,
                                external_root)
        raise ValueError(f"split={split!r}: use 'val' or 'test'")

    def global_model(self, state: Mapping[str, Any], head: Sequence[str]) -> MultiLabelDenseNet:
        """A model with a head over ``head`` (the network's classes), this site's local tensors (its batch-norm
        under FedBN) and the received ``state`` loaded (checked): the final global model the test task scores."""
        model = build_model(head, self.settings).to(self.device)
        model.load_state_dict({k: v for k, v in self.model.state_dict().items() if not is_head_key(k)}, strict=False)
        self._load_checked(model, state, ())
        return model

    # ------------------------------------------------------------------ state
    def local_keys(self, keys: Sequence[str]) -> set[str]:
        """Keys that stay on the site under the switches (a broadcast may lack them)."""
        local = set(local_keys(keys, self.switches["backbone"], is_bn_key))
        if self.method in ("personalised", "individual"):
            local |= {k for k in keys if is_head_key(k)}
        if self.method == "individual":
            local = set(keys)
        return local

    def _load_checked(self, model: MultiLabelDenseNet, state: Mapping[str, Any],
                      keep_local: Sequence[str]) -> list[str]:
        if not state:  # nothing received (individual training after round 0): the model stays as it is
            return []
        own = list(model.state_dict())
        source = (f"{self.site}: the received model (method {self.method}, backbone {self.switches['backbone']}, "
                  f"head over {len(model.classes)} classes)")
        return load_checked(model, state, source, sorted(self.local_keys(own) | set(keep_local)))

    def global_state(self) -> dict[str, torch.Tensor]:
        """What the method uploads: nothing (individual), no head (personalised), else the whole model (batch-norm
        included: under FedBN the job's upload filter holds it back)."""
        if self.method == "individual":
            return {}
        state = self.model.state_dict()
        return detached(state, [k for k in state if not (self.method == "personalised" and is_head_key(k))])

    def load_global(self, state: Mapping[str, Any], keep_local: Sequence[str] = ()) -> list[str]:
        """Load a broadcast (checked: unknown keys, wrong shapes and missing keys the site must take from the server
        raise); the keys the switches keep local (and ``keep_local``) may be absent.  Returns the keys kept."""
        return self._load_checked(self.model, state, keep_local)

    def state_dict(self) -> dict:
        return {"model": detached(self.model.state_dict()), "optimizer": copy.deepcopy(self.optimizer.state_dict()),
                "warmed_up": self.warmed_up, "epoch": self.epoch, "head_classes": list(self.head),
                "switches": dict(self.switches)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("head_classes") != self.head or state.get("switches") != self.switches:
            raise ValueError(f"{self.site}: the saved state was written for head {state.get('head_classes')} and "
                             f"{state.get('switches')}; this run has {self.head} and {self.switches}")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.warmed_up, self.epoch = bool(state["warmed_up"]), int(state["epoch"])
