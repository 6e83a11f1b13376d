"""Federated fine-tuning of the ViT classifier on one site (SSL-FL (Yan et al., IEEE TMI 2023) sec. III-D; FedMAE-KS, Wu
et al., "Federated Self-Supervised Learning for Dermatological Disease Diagnosis") as a
:class:`fedssl.core.trainer.LocalTrainer`.

The site's images are split (stratified) into a training pool and a VALIDATION split (``train_val_split``,
never the test data); the labelled subset of the pool (``select_labelled(train, label_fraction)``) is
fine-tuned for ``local_epochs`` epochs per round (AdamW, warm-up + cosine by round, layer-wise lr decay,
optional FedProx against the received weights); ``samples`` = labelled images |D_l^k| (SSL-FL weights
fine-tuning aggregation by labelled images).  ``evaluate("val" | "test")`` = classification metrics of the
current model; a model whose head was never trained is refused.

Data-side randomness (validation split, labelled subset, augmentation, batch order; mixup / CutMix / random erasing
from the trainer's own generator of (site seed, step count)) uses the site's seed
``fedssl.core.seeds.site_seed(seed, site)``, so sites draw independently; the model's initial weights use the job
seed (every site builds the same model, and the server's broadcast replaces it anyway).  Drop path draws from the
global generators: each epoch runs in the owned global RNG of (site seed, step count) (in
:meth:`fedssl.train.classifier_loop.ClassifierTrainer.train_round`) and each evaluation in that of (site seed, split)
(:func:`fedssl.core.rng.owned_global_rng`), so a round is reproducible and leaves the global generators alone.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from fedssl.core.checks import require, require_amp, require_choice, require_int, require_workers
from fedssl.core.classification import classification_metrics, predict, require_trained_head
from fedssl.core.rng import owned_global_rng
from fedssl.core.seeds import derived_seed, site_seed
from fedssl.core.trainer import RoundStats, check_optimizer_state, check_stop, detached, load_checked
from fedssl.data.images import (
    DATASETS,
    ImageDataset,
    ImageRecord,
    batch_bounds,
    batches,
    class_histogram,
    class_names,
    select_labelled,
    train_val_split,
)
from fedssl.data.loading import loader_options
from fedssl.data.mixup import BatchAugment
from fedssl.models.vit_classifier import FineTuneViT, check_vit_args
from fedssl.train.classifier_loop import ClassifierTrainer


@dataclass(frozen=True)
class ClassifierSettings:
    """Every setting of a site's ViT fine-tuning, declared once: the job arguments of ``ClassifierExecutor`` and what
    :class:`ClassifierLocalTrainer` reads (paper settings as defaults: SSL-FL fine-tuning, 100 rounds, lr 3e-3,
    batch 256, 64 for COVID-FL).

    dataset: "retina", "derm" or "covidfl" (the class list).
    data_root: the site's data folder ("" = the site's fedssl_site.json or FEDSSL_DATA_ROOT); ``{site}`` is replaced
        by the site name.  test_root: the test data folder ("" = ``<data_root>/../test``, the partition's held-out
        test set).
    image_size, patch_size, embed_dim, depth, num_heads, drop_path_rate, layer_scale: the ViT (must match the
        server's model component; layer_scale null for Fed-MAE / scratch, 0.1 for a Fed-BEiT encoder).
    rel_pos_bias: BEiT's relative position bias of the ViT, as the server's model component: "none" (Fed-MAE /
        ImageNet / scratch encoder) or "per_layer" (a Fed-BEiT encoder: SSL-FL's fine-tuning, one table per block).
    lr, min_lr, warmup_rounds, weight_decay: AdamW with warm-up then cosine, indexed by round.
    batch_size, local_epochs: local training per round (SSL-FL: 1 epoch).
    label_fraction: labelled fraction of the training pool, per class (SSL-FL: 0.1, 0.3, 0.7, 1.0).
    val_fraction: fraction of the site's pool held out (stratified) for validation / model selection.
    fedprox_mu: 0 = FedAvg; SSL-FL's FedProx baseline uses 0.001.
    label_smoothing: label smoothing s of the training targets: ``1 - s + s / K`` on the true class, ``s / K`` on the
        others (0 = none; SSL-FL's fine-tuning scripts: 0.1, ``--smoothing`` default).
    mixup_alpha, cutmix_alpha, cutmix_minmax, mixup_prob, mixup_switch_prob, mixup_mode: mixup / CutMix of every
        training batch with itself reversed (:mod:`fedssl.data.mixup`): per batch, mixed with probability
        ``mixup_prob``; CutMix instead of mixup with probability ``mixup_switch_prob`` when both alphas are > 0;
        ``lam ~ Beta(alpha, alpha)``; CutMix's lam corrected to the pasted box's area; ``cutmix_minmax`` [min, max]
        draws the box's sides instead (null = from lam); ``mixup_mode`` "batch" only.  The loss is then the
        soft-target cross-entropy against the mixed, label-smoothed targets.  0 / 0 / null = off (the defaults).
        SSL-FL's Fed-MAE fine-tuning scripts: 0.8, 1.0, null, 1.0, 0.5, "batch"; its Fed-BEiT scripts: mixing off.
    erasing_prob, erasing_mode, erasing_count: random erasing of each training image on the normalised tensor
        (timm's RandomErasing: probability, fill "pixel" / "rand" / "const", boxes per image); 0 = off (the default
        and SSL-FL's jobs: the reference parses ``--reprob 0.25`` but its fine-tuning transform never applies it).
        Every draw of these augmentations comes from the trainer's own generator, seeded from the site's seed and
        the step count (:class:`fedssl.train.classifier_loop.ClassifierTrainer`).  Evaluation never augments.
    layer_decay: layer-wise lr decay (SSL-FL's fine-tuning scripts: 0.65; 1.0 = one lr for all layers).
    max_steps_per_epoch: cap on optimiser steps per local epoch (0 = full epoch).
    eval_batch_size: batch size of validation and test passes.
    seed: the job seed: initial weights; the site's data seed ``site_seed(seed, site)`` draws the data split,
        labelled subset, batches and augmentation.
    device: "auto" (CUDA when available), "cpu", "cuda", "cuda:1" ...
    amp: bfloat16 autocast of the forward pass on GPUs that support it (float16 + gradient scaler on older ones);
        no effect on a CPU.
    workers: DataLoader worker processes that decode and augment the next batches (0 = in this process; the batches
        are the same either way); batches are pinned on a CUDA device.
    """

    dataset: str = "retina"
    data_root: str = ""
    test_root: str = ""
    image_size: int = 224
    patch_size: int = 16
    embed_dim: int = 768
    depth: int = 12
    num_heads: int = 12
    drop_path_rate: float = 0.1
    layer_scale: float | None = None
    rel_pos_bias: str = "none"
    lr: float = 3e-3
    batch_size: int = 256
    local_epochs: int = 1
    warmup_rounds: int = 5
    min_lr: float = 1e-6
    weight_decay: float = 0.05
    label_fraction: float = 1.0
    val_fraction: float = 0.1
    fedprox_mu: float = 0.0
    label_smoothing: float = 0.0
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    cutmix_minmax: list[float] | None = None
    mixup_prob: float = 1.0
    mixup_switch_prob: float = 0.5
    mixup_mode: str = "batch"
    erasing_prob: float = 0.0
    erasing_mode: str = "pixel"
    erasing_count: int = 1
    layer_decay: float = 0.65
    max_steps_per_epoch: int = 0
    eval_batch_size: int = 256
    seed: int = 0
    device: str = "auto"
    amp: bool = False
    workers: int = 0

    def check(self, name: str) -> None:
        """Every argument checked; the message names component ``name``, the argument, its value and the fix."""
        require_choice(name, "dataset", self.dataset, DATASETS)
        for arg in ("data_root", "test_root"):
            require(isinstance(getattr(self, arg), str), name, arg, getattr(self, arg),
                    "use a path string ({site} allowed) or \"\"")
        check_vit_args(name, self.image_size, self.patch_size, self.embed_dim, self.depth, self.num_heads,
                       self.drop_path_rate, self.layer_scale, self.rel_pos_bias)
        lr, min_lr = self.lr, self.min_lr
        require(isinstance(lr, (int, float)) and lr > 0, name, "lr", lr, "use a positive learning rate (paper: 3e-3)")
        require(isinstance(min_lr, (int, float)) and 0 <= min_lr < lr, name, "min_lr", min_lr, "use 0 <= min_lr < lr")
        require_int(name, "batch_size", self.batch_size, 1, "use a positive batch size (paper: 256; COVID-FL 64)")
        require_int(name, "local_epochs", self.local_epochs, 1, "use a positive number of epochs per round (paper: 1)")
        warmup = self.warmup_rounds
        require(isinstance(warmup, (int, float)) and not isinstance(warmup, bool) and warmup >= 0,
                name, "warmup_rounds", warmup, "use a number of rounds >= 0 (paper: 5)")
        wd = self.weight_decay
        require(isinstance(wd, (int, float)) and wd >= 0, name, "weight_decay", wd, "paper: 0.05")
        frac = self.label_fraction
        require(isinstance(frac, (int, float)) and 0 < frac <= 1, name, "label_fraction", frac,
                "use a fraction in (0, 1]; paper: 0.1, 0.3, 0.7 or 1.0")
        val = self.val_fraction
        require(isinstance(val, (int, float)) and 0 < val < 1, name, "val_fraction", val,
                "use a fraction in (0, 1): model selection needs validation images, e.g. 0.1")
        mu = self.fedprox_mu
        require(isinstance(mu, (int, float)) and mu >= 0, name, "fedprox_mu", mu,
                "use 0 (FedAvg) or a positive mu (paper's FedProx: 0.001)")
        ls = self.label_smoothing
        require(isinstance(ls, (int, float)) and not isinstance(ls, bool) and 0 <= ls < 1, name, "label_smoothing", ls,
                "use a value in [0, 1) (0 = none; SSL-FL's fine-tuning scripts: 0.1)")
        self.batch_augment().check(name)
        decay = self.layer_decay
        require(isinstance(decay, (int, float)) and not isinstance(decay, bool) and 0 < decay <= 1, name,
                "layer_decay", decay, "use a factor in (0, 1] (paper: 0.65; 1.0 = no decay)")
        require_int(name, "max_steps_per_epoch", self.max_steps_per_epoch, 0,
                    "use 0 (full epoch) or a positive step count per local epoch")
        require_int(name, "eval_batch_size", self.eval_batch_size, 1, "use a positive batch size")
        require_amp(name, self.amp)
        require_workers(name, self.workers)
        require_int(name, "seed", self.seed, 0, "use a non-negative integer")
        device = self.device
        require(isinstance(device, str) and device.split(":")[0] in ("auto", "cpu", "cuda"), name, "device", device,
                'use "auto", "cpu" or "cuda[:N]"')

    def batch_augment(self) -> BatchAugment:
        """The mixup / CutMix / random-erasing settings as the trainer's :class:`BatchAugment` (``.active`` False when
        all are off)."""
        return BatchAugment(
            mixup_alpha=self.mixup_alpha, cutmix_alpha=self.cutmix_alpha, cutmix_minmax=self.cutmix_minmax,
            mixup_prob=self.mixup_prob,
            mixup_switch_prob=self.mixup_switch_prob, mixup_mode=self.mixup_mode, erasing_prob=self.erasing_prob,
            erasing_mode=self.erasing_mode, erasing_count=self.erasing_count)


class ClassifierLocalTrainer:
    """One site's federated fine-tuning of :class:`~fedssl.models.vit_classifier.FineTuneViT` (a ``LocalTrainer``)
    with the settings of a :class:`ClassifierSettings`.

    records: the site's labelled images; site: its name in messages; num_rounds: the schedule's length; device: a
    torch device (the executor resolves the settings' "auto").
    """

    def __init__(self, records: Sequence[ImageRecord], settings: ClassifierSettings, *, num_rounds: int,
                 site: str = "?", device: str | torch.device = "cpu"):
        s = settings
        s.check(type(self).__name__)
        self.settings, self.workers = s, int(s.workers)
        self.site, self.dataset, self.image_size, self.seed = site, s.dataset, s.image_size, s.seed
        self.data_seed = data_seed = site_seed(s.seed, site)
        self.batch_size, self.local_epochs, self.eval_batch_size = s.batch_size, s.local_epochs, s.eval_batch_size
        self.max_steps_per_epoch = s.max_steps_per_epoch
        self.classes = class_names(s.dataset)
        train, val = train_val_split(records, s.val_fraction, seed=data_seed)
        if not val:
            raise ValueError(f"{site}: val_fraction={s.val_fraction} of {len(records)} images leaves no validation "
                             "image; raise val_fraction or add images")
        labelled = select_labelled(train, s.label_fraction, seed=data_seed)
        self.train_set = ImageDataset(labelled, s.image_size, "finetune", s.dataset, site=site, seed=data_seed)
        self.val_set = ImageDataset(val, s.image_size, "eval", s.dataset, site=site)
        self.test_set: ImageDataset | None = None
        model = FineTuneViT(num_classes=len(self.classes), image_size=s.image_size, patch_size=s.patch_size,
                            embed_dim=s.embed_dim, depth=s.depth, num_heads=s.num_heads,
                            drop_path_rate=s.drop_path_rate, layer_scale=s.layer_scale, seed=s.seed,
                            rel_pos_bias=s.rel_pos_bias).to(device)
        augment = s.batch_augment()
        self.trainer = ClassifierTrainer(
            model, lr=s.lr, total_rounds=num_rounds, warmup_rounds=min(s.warmup_rounds, num_rounds), min_lr=s.min_lr,
            weight_decay=s.weight_decay, fedprox_mu=s.fedprox_mu, label_smoothing=s.label_smoothing,
            layer_decay=s.layer_decay, device=device, seed=data_seed, amp=s.amp, batch_augment=augment)
        regularisation = ", ".join(
            [f"label smoothing {s.label_smoothing:g}"] * (s.label_smoothing > 0)
            + [f"mixup {s.mixup_alpha:g} / CutMix {s.cutmix_alpha:g} (p {s.mixup_prob:g}, switch "
               f"{s.mixup_switch_prob:g})"] * augment.mixing
            + [f"random erasing {s.erasing_prob:g} ({s.erasing_mode} x {s.erasing_count})"] * (s.erasing_prob > 0))
        #: one line for the site's log
        self.summary = (f"{len(records)} images -> {len(train)} training pool, {len(val)} validation; "
                        f"{len(labelled)} labelled ({s.label_fraction:g}) per class "
                        f"{class_histogram(labelled, len(self.classes))}; device {self.trainer.device}"
                        + (f"; {regularisation}" if regularisation else ""))

    @property
    def model(self) -> FineTuneViT:
        return self.trainer.model

    @property
    def head_trained(self) -> bool:
        """Whether the head of the current model was ever trained (round 0's initial model: no)."""
        return int(self.model.head_steps) > 0

    def steps_per_epoch(self) -> int:
        n = len(batch_bounds(len(self.train_set), self.batch_size, fold_single=True))
        return min(n, self.max_steps_per_epoch) if self.max_steps_per_epoch else n

    def train_round(self, round_idx: int, should_stop: Callable[[], bool] | None = None) -> RoundStats:
        """``local_epochs`` epochs over the labelled images; FedProx is taken against the weights held now
        (the received global model)."""
        trainer = self.trainer
        trainer.set_global(dict(trainer.model.named_parameters()))
        n_steps = self.steps_per_epoch()
        step0, losses, curve = trainer.step, [], []

        def stop() -> bool:
            check_stop(should_stop)
            return False

        for epoch in range(self.local_epochs):
            progress = round_idx + epoch / self.local_epochs
            data = batches(self.train_set, self.batch_size, seed=self.data_seed,
                           epoch=round_idx * self.local_epochs + epoch,
                           fold_single=True, **loader_options(self.workers, self.trainer.device))
            losses.append(trainer.train_round(data, progress, n_steps=n_steps * self.local_epochs,
                                              max_steps=self.max_steps_per_epoch or None, abort=stop))
            curve += [{"loss": x} for x in trainer.last_losses]
        lr = max(g["lr"] for g in trainer.optimizer.param_groups)  # the head's group: lr_scale 1
        return RoundStats(loss=sum(losses) / len(losses), steps=trainer.step - step0, samples=len(self.train_set),
                          metrics={"lr": lr}, curve=curve)

    def set_test_records(self, records: Sequence[ImageRecord]) -> None:
        self.test_set = ImageDataset(records, self.image_size, "eval", self.dataset, site=self.site)

    def evaluate(self, split: str = "val", source: str = "") -> dict[str, Any]:
        """Classification metrics of the current model on ``split`` ("val", or "test" after
        :meth:`set_test_records`); ``source`` names the model in the refusal of an untrained head."""
        if split not in ("val", "test"):
            raise ValueError(f"split={split!r}: use 'val' or 'test'")
        dataset = self.val_set if split == "val" else self.test_set
        if dataset is None:
            raise ValueError(f"{self.site}: no test data was given to this trainer (set_test_records)")
        require_trained_head(self.model, source or f"the {split} model of {self.site}")
        device = next(self.model.parameters()).device
        with owned_global_rng(derived_seed(self.data_seed, "evaluate", split), device):
            probs, labels = predict(self.model, batches(dataset, self.eval_batch_size, seed=self.data_seed, epoch=0,
                                                        **loader_options(self.workers, self.trainer.device)), device)
        return classification_metrics(probs, labels, self.classes)

    def state_dict(self) -> dict:
        """AdamW and the step count (the weights come from the server every round)."""
        return self.trainer.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The saved AdamW (checked against this model's parameters: the state holds no weights to check) and step."""
        source = f"{self.site}: the saved classifier state"
        check_optimizer_state(self.trainer.optimizer, state.get("optimizer"), source)
        self.trainer.load_state_dict(copy.deepcopy(dict(state)))  # never alias the source's AdamW moments

    def global_state(self) -> dict[str, torch.Tensor]:
        return detached(self.model.state_dict())

    def load_global(self, state: Mapping[str, Any], keep_local: Sequence[str] = ()) -> list[str]:
        return load_checked(self.model, state, f"the global model sent to {self.site}", keep_local)
