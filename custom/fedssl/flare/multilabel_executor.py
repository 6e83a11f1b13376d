"""Client executor for class-heterogeneous multi-label chest X-ray classification (seed 002).

Tasks:
- ``declare_classes``: answer the server's registration with this site's ordered class list ``C_k`` (from
  the executor argument ``classes`` or ``classes`` in ``local/fedssl_site.json``; a plain list or an
  object keyed by site name) and its training-set size; remember the run's switches (method, backbone).
- ``train``: load the received model (head cut to ``C_k`` under surgical; over ``C`` for vanilla /
  partial loss; none for personalised; only the initial model for individual training), report its
  validation BCE / AUROC on the site's validation patients (``initial_metrics``, for the server's
  model selection: paper sec. 2.5, "mean of local validation BCE loss"), warm the head up once (frozen
  backbone, Adam lr ``warmup_lr``, ``warmup_epochs``), then train every weight for ``local_epochs``
  (Adam lr ``lr``; under FedBN+ batch-norm frozen at its initial statistics) and upload.
- ``test``: per-class AUROC with bootstrap 95 % CI on the site's test patients (its own classes; for the
  global-model methods the final global model, for personalised / individual the site's own model) and,
  with ``external_test_root`` (MIMIC-CXR-JPG layout), on the external set with every class of the model.

Losses (``fedssl.core.multilabel``): surgical / personalised / individual: BCE over ``C_k``; vanilla: BCE
over ``C``, classes the site lacks are negatives; partial_loss: BCE over the ``C_k`` columns only (eq. 4).
The site splits its data by patient (70/10/20 as the paper; seeded), so no patient is in two splits.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch
from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.apis.signal import Signal
from nvflare.app_common.app_constant import AppConstants

from fedssl.core.multilabel import column_index, expand_targets, labelled, masked_bce
from fedssl.core.surgical import HEAD_WEIGHT, check_class_list, is_head_key, local_keys
from fedssl.data.cxr import CXRDataset, batches, dataset_classes, load_cxr_site, patient_split
from fedssl.data.site_config import resolve_site_setting
from fedssl.eval.auroc import labelled_bce, labelled_mean_auroc
from fedssl.eval.surgical_report import auroc_table
from fedssl.flare.backbone_exclusion import BACKBONE_HEADER
from fedssl.flare.site_executor import SiteExecutor, TaskAborted, pick_device
from fedssl.flare.surgical_registration import (
    BACKBONE_KEY,
    BACKBONES,
    CLASSES_KEY,
    DECLARE_TASK,
    GLOBAL_CLASSES_KEY,
    METHOD_KEY,
    METHODS,
    classes_from_meta,
    classes_to_meta,
)
from fedssl.flare.validation import require, require_int
from fedssl.models.densenet import MultiLabelDenseNet, freeze_batchnorm, is_bn_key, set_features_trainable

DATASETS = ("nih", "chexpert")
GLOBAL_HEAD_METHODS = ("surgical", "vanilla", "partial_loss")


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


class MultiLabelExecutor(SiteExecutor):
    task_handlers = {DECLARE_TASK: "declare", "train": "train", "test": "test"}
    checkpoint_name = "multilabel_client_state.pt"
    metrics_name = "multilabel_metrics.jsonl"

    def __init__(
        self,
        data_root: str = "",
        dataset="",
        classes=(),
        external_test_root: str = "",
        growth_rate: int = 32,
        block_config: list = (6, 12, 24, 16),
        num_init_features: int = 64,
        hidden_features: int = 256,
        dropout: float = 0.3,
        image_size: int = 224,
        batch_size: int = 64,
        warmup_epochs: int = 15,
        warmup_lr: float = 5e-3,
        lr: float = 5e-5,
        local_epochs: int = 1,
        max_steps_per_epoch: int = 0,
        rotation: float = 0.2,
        zoom: float = 0.5,
        contrast: float = 0.75,
        flip: bool = True,
        split: list = (0.7, 0.1, 0.2),
        n_bootstrap: int = 1000,
        seed: int = 0,
        device: str = "auto",
    ):
        """
        Args (paper settings as defaults, seed 002 sec. 2.5):
            data_root: the site's dataset folder (real NIH / CheXpert layout); "" = site config / FEDSSL_DATA_ROOT;
                ``{site}`` is replaced by the site name.
            dataset: "nih" or "chexpert", or an object keyed by site name; "" = ``dataset`` in the site config.
            classes: the site's ordered class list ``C_k`` (a list, or an object keyed by site name);
                [] = ``classes`` in the site config.  Names must match the dataset's (CheXpert spellings).
            external_test_root: a MIMIC-CXR-JPG folder; when set, the test task also evaluates there.
            growth_rate, block_config, num_init_features, hidden_features, dropout: DenseNet-121 = 32,
                [6, 12, 24, 16], 64, 256 with dropout 0.3 (the public code's 256-unit layer before the class layer);
                must match the server's model (whose imagenet_path gives the sites the ImageNet backbone in round 0).
            batch_size 64; warmup_epochs 15 at warmup_lr 5e-3 (head only, frozen backbone); lr 5e-5 for all
                weights; local_epochs per round (paper: 1); max_steps_per_epoch caps an epoch (0 = full).
            rotation, zoom, contrast, flip: training augmentation (public code's Keras layers: rotation 0.2 of a
                turn, zoom +-50 %, contrast 0.75, horizontal flip; ``fedssl.data.cxr.CXRDataset``).
            split: train / validation / test fractions of the site's patients (paper: 70/10/20).
            n_bootstrap: resamples for the AUROC 95 % confidence intervals.
        """
        super().__init__()
        name = type(self).__name__
        require(isinstance(data_root, str), name, "data_root", data_root, 'use a path string or ""')
        require(dataset in ("",) + DATASETS or (isinstance(dataset, dict) and all(v in DATASETS for v in dataset.values())),
                name, "dataset", dataset, f'use one of {list(DATASETS)}, an object {{"site-1": "nih", ...}}, or "" (site config)')
        if isinstance(classes, dict):
            for site, cl in classes.items():
                check_class_list(cl, site)
        elif classes:
            check_class_list(list(classes), "<executor argument classes>")
        require(isinstance(external_test_root, str), name, "external_test_root", external_test_root, 'use a path or ""')
        for arg, value in (("growth_rate", growth_rate), ("num_init_features", num_init_features)):
            require_int(name, arg, value, 1, "DenseNet-121: growth_rate 32, num_init_features 64")
        require(isinstance(block_config, (list, tuple)) and len(block_config) == 4 and all(isinstance(b, int) and b >= 1 for b in block_config),
                name, "block_config", block_config, "use 4 positive layer counts, DenseNet-121: [6, 12, 24, 16]")
        require_int(name, "hidden_features", hidden_features, 0, "use 0 or a positive width (public code: 256)")
        require(isinstance(dropout, (int, float)) and not isinstance(dropout, bool) and 0 <= dropout < 1, name,
                "dropout", dropout, "use a probability in [0, 1) (public code: 0.3)")
        require_int(name, "image_size", image_size, 16, "use at least 16 pixels (paper: 224)")
        require_int(name, "batch_size", batch_size, 2, "paper: 64")
        require_int(name, "warmup_epochs", warmup_epochs, 0, "paper: 15 (0 = no warm-up)")
        require(_positive(warmup_lr), name, "warmup_lr", warmup_lr, "paper: 5e-3")
        require(_positive(lr), name, "lr", lr, "paper: 5e-5")
        require_int(name, "local_epochs", local_epochs, 1, "paper: 1")
        require_int(name, "max_steps_per_epoch", max_steps_per_epoch, 0, "use 0 (full epoch) or a positive step count")
        for arg, value, hi in (("rotation", rotation, 0.5), ("zoom", zoom, 0.9), ("contrast", contrast, 1.0)):
            require(isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= hi, name, arg,
                    value, f"use a value in [0, {hi}] (public code: rotation 0.2, zoom 0.5, contrast 0.75)")
        require(isinstance(flip, bool), name, "flip", flip, "use true or false")
        require(isinstance(split, (list, tuple)) and len(split) == 3 and all(_positive(f) for f in split)
                and abs(sum(split) - 1.0) < 1e-6, name, "split", split, "use three positive fractions summing to 1, paper: [0.7, 0.1, 0.2]")
        require_int(name, "n_bootstrap", n_bootstrap, 0, "paper-style CIs: 1000 (0 = no CI)")
        require(isinstance(seed, int) and not isinstance(seed, bool), name, "seed", seed, "use an integer")
        self.data_root = data_root
        self.dataset = dataset
        self.classes = classes if isinstance(classes, dict) else list(classes)
        self.external_test_root = external_test_root
        self.growth_rate = growth_rate
        self.block_config = list(block_config)
        self.num_init_features = num_init_features
        self.hidden_features = hidden_features
        self.dropout = dropout
        self.image_size = image_size
        self.batch_size = batch_size
        self.warmup_epochs = warmup_epochs
        self.warmup_lr = warmup_lr
        self.lr = lr
        self.local_epochs = local_epochs
        self.max_steps_per_epoch = max_steps_per_epoch
        self.rotation = rotation
        self.zoom = zoom
        self.contrast = contrast
        self.flip = flip
        self.split = list(split)
        self.n_bootstrap = n_bootstrap
        self.seed = seed
        self.device = device
        self._site_classes: list[str] | None = None
        self._splits: dict | None = None
        self._switches: dict | None = None  # method, backbone
        self._head_classes: list[str] | None = None
        self._model: MultiLabelDenseNet | None = None
        self._opt: torch.optim.Optimizer | None = None
        self._warmed_up = False
        self._epoch = 0

    # ------------------------------------------------------------------ configuration and data
    def site_classes(self, fl_ctx: FLContext) -> list[str]:
        site = self.site_name(fl_ctx)
        value, source = resolve_site_setting(self.classes, "classes", site,
                                             fl_ctx.get_engine().get_workspace().get_site_config_dir())
        try:
            return check_class_list(value, site)
        except ValueError as e:
            raise ValueError(f"{e} (from {source})") from None

    def _load_data(self, fl_ctx: FLContext) -> dict:
        site = self.site_name(fl_ctx)
        root = self.resolve_root(self.data_root, fl_ctx)
        dataset, _ = resolve_site_setting(self.dataset, "dataset", site,
                                          fl_ctx.get_engine().get_workspace().get_site_config_dir())
        if dataset not in DATASETS:
            raise ValueError(f"{site}: dataset {dataset!r} is not one of {list(DATASETS)}")
        return self.load_splits(root, dataset, site)

    def load_splits(self, root: str, dataset: str, site: str) -> dict:
        """The site's patient-level train / validation / test datasets over its classes (``_site_classes``)."""
        records = load_cxr_site(root, dataset, site=site)
        train, val, test = patient_split(records, fractions=tuple(self.split), seed=self.seed)
        if not train or not val or not test:
            raise ValueError(f"{site}: {len(records)} images split into {len(train)}/{len(val)}/{len(test)} "
                             "train/validation/test; every split needs images")
        aug = {"rotation": self.rotation, "zoom": self.zoom, "contrast": self.contrast, "flip": self.flip}
        return {"dataset": dataset, "n_train": len(train), "n_val": len(val), "n_test": len(test),
                "train": CXRDataset(train, self._site_classes, self.image_size, train=True, site=site, seed=self.seed, **aug),
                "val": CXRDataset(val, self._site_classes, self.image_size, train=False, site=site),
                "test": CXRDataset(test, self._site_classes, self.image_size, train=False, site=site)}

    def _build_model(self, classes: list[str], imagenet_path: str | None = None) -> MultiLabelDenseNet:
        return MultiLabelDenseNet(classes, self.growth_rate, tuple(self.block_config), self.num_init_features,
                                  hidden_features=self.hidden_features, dropout=self.dropout, seed=self.seed,
                                  imagenet_path=imagenet_path)

    # ------------------------------------------------------------------ set-up / state
    def _switches_from(self, meta: dict, site: str) -> dict:
        method, backbone = meta.get(METHOD_KEY), meta.get(BACKBONE_KEY)
        if method not in METHODS or backbone not in BACKBONES:
            raise ValueError(f"{site}: the task carries method={method!r}, backbone={backbone!r}; the server must run "
                             "ClassRegistration and the HeadSlicer filter")
        return {"method": method, "backbone": backbone}

    def _setup(self, fl_ctx: FLContext, meta: dict) -> None:
        site = self.site_name(fl_ctx)
        if self._site_classes is None:
            self._site_classes = self.site_classes(fl_ctx)
        switches = self._switches_from(meta, site)
        if self._switches is not None and switches != self._switches:
            raise ValueError(f"{site}: the server switched from {self._switches} to {switches} mid-run")
        self._switches = switches
        registered = classes_from_meta(meta.get(CLASSES_KEY), "server") if meta.get(CLASSES_KEY) is not None else None
        if registered is not None and registered != self._site_classes:
            raise ValueError(f"{site}: the server registered this site's classes as {registered} but its configuration "
                             f"now declares {self._site_classes}; a site's classes are fixed for a run")
        if self._model is not None:
            return
        if self._splits is None:
            self._splits = self._load_data(fl_ctx)
        method = switches["method"]
        if method in ("vanilla", "partial_loss"):
            if meta.get(GLOBAL_CLASSES_KEY) is None:
                raise ValueError(f"{site}: method {method} needs the network's classes (meta {GLOBAL_CLASSES_KEY!r})")
            head = classes_from_meta(meta[GLOBAL_CLASSES_KEY], "server")
            column_index(self._site_classes, head, site)
        else:
            head = list(self._site_classes)
        self._head_classes = head
        self._model = self._build_model(head).to(pick_device(self.device))
        if switches["backbone"] == "fedbn_plus":
            freeze_batchnorm(self._model)
        self._opt = torch.optim.Adam([p for p in self._model.parameters() if p.requires_grad], lr=self.lr)
        state = self.load_checkpoint(fl_ctx)
        if state is not None:
            if state.get("head_classes") != head or state.get("switches") != switches:
                raise ValueError(f"{site}: the checkpoint {self.checkpoint_name} was written for head {state.get('head_classes')} "
                                 f"and {state.get('switches')}; this run has {head} and {switches}")
            self._model.load_state_dict(state["model"])
            self._opt.load_state_dict(state["optimizer"])
            self._warmed_up, self._epoch = bool(state["warmed_up"]), int(state["epoch"])
        s = self._splits
        self.log_info(fl_ctx, f"{site}: {s['dataset']} layout, {len(self._site_classes)} classes, "
                              f"{s['n_train']}/{s['n_val']}/{s['n_test']} train/val/test images; "
                              f"{method}, backbone {switches['backbone']}, head over {len(head)} classes")

    def _save(self, fl_ctx: FLContext, round_idx: int) -> None:
        self.save_checkpoint(fl_ctx, {"round": round_idx, "model": self._model.state_dict(),
                                      "optimizer": self._opt.state_dict(), "warmed_up": self._warmed_up,
                                      "epoch": self._epoch, "head_classes": self._head_classes,
                                      "switches": self._switches})

    def _local_keys(self, keys) -> set:
        """Keys that stay on the site under the run's switches (a broadcast may lack them)."""
        method, backbone = self._switches["method"], self._switches["backbone"]
        local = set(local_keys(keys, backbone, is_bn_key))
        if method in ("personalised", "individual"):
            local |= {k for k in keys if is_head_key(k)}
        if method == "individual":
            local = set(keys)
        return local

    def load_received(self, model: torch.nn.Module, data: dict, site: str) -> int:
        """Load a broadcast into ``model``: unexpected keys or wrong shapes raise; keys the site keeps may be absent."""
        own = model.state_dict()
        unexpected = sorted(set(data) - set(own))
        if unexpected:
            raise ValueError(f"{site}: the received model has keys this model lacks, e.g. {unexpected[:3]}; "
                             "the site must run the server's model configuration")
        missing = sorted(set(own) - set(data) - self._local_keys(own))
        if data and missing:
            raise ValueError(f"{site}: the received model lacks {len(missing)} tensors the site must take from the "
                             f"server, e.g. {missing[:3]} (method {self._switches['method']}, backbone {self._switches['backbone']})")
        load = {}
        for k, v in data.items():
            t = torch.as_tensor(np.asarray(v))
            if tuple(t.shape) != tuple(own[k].shape):
                raise ValueError(f"{site}: received {k} of shape {tuple(t.shape)}, the site's model has "
                                 f"{tuple(own[k].shape)} (head over {len(model.classes)} classes)")
            load[k] = t
        model.load_state_dict(load, strict=False)
        return len(load)

    # ------------------------------------------------------------------ training
    def _loss(self, logits: torch.Tensor, targets: torch.Tensor, site: str) -> torch.Tensor:
        method = self._switches["method"]
        if method in ("vanilla", "partial_loss"):
            full, mask = expand_targets(targets, self._site_classes, self._head_classes,
                                        missing="negative" if method == "vanilla" else "ignore", site=site)
            return masked_bce(logits, full, mask)
        return masked_bce(logits, *labelled(targets))  # NaN: a class the image's source does not label (pooled data)

    def _epoch_batches(self, dataset, train: bool, epoch: int):
        return batches(dataset, self.batch_size, seed=self.seed, epoch=epoch, shuffle=train,
                       max_batches=self.max_steps_per_epoch if train else 0)

    def _run_epoch(self, opt, dataset, site: str, abort_signal: Signal, frozen_features: bool) -> tuple[float, int]:
        model, device = self._model, next(self._model.parameters()).device
        model.train()
        if frozen_features:
            model.features.eval()  # warm-up: frozen backbone, BN statistics kept (Keras frozen base)
        if self._switches["backbone"] == "fedbn_plus":
            freeze_batchnorm(model)
        total, steps = 0.0, 0
        for x, y in self._epoch_batches(dataset, True, self._epoch):
            if abort_signal is not None and abort_signal.triggered:
                raise TaskAborted()
            loss = self._loss(model(x.to(device)), y.to(device).float(), site)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"{site}: non-finite training loss at epoch {self._epoch}")
            opt.zero_grad()
            loss.backward()
            opt.step()
            total, steps = total + float(loss.detach()), steps + 1
        self._epoch += 1
        return total / max(steps, 1), steps

    def _warm_up(self, site: str, abort_signal: Signal) -> float:
        """Paper 2.5: the head (and the layer before it) trained with the feature extractor frozen."""
        set_features_trainable(self._model, False)
        opt = torch.optim.Adam([p for p in self._model.parameters() if p.requires_grad], lr=self.warmup_lr)
        train = self._splits["train"]
        loss = float("nan")
        try:
            for _ in range(self.warmup_epochs):
                loss, _ = self._run_epoch(opt, train, site, abort_signal, frozen_features=True)
        finally:
            set_features_trainable(self._model, True)
            if self._switches["backbone"] == "fedbn_plus":
                freeze_batchnorm(self._model)
        self._warmed_up = True
        return loss

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def _scores(self, model: torch.nn.Module, ds) -> tuple[np.ndarray, np.ndarray]:
        """(probabilities [N, |model head|], targets [N, |dataset classes|]) on dataset ``ds`` (no augmentation)."""
        model.eval()
        device = next(model.parameters()).device
        probs, targets = [], []
        for x, y in self._epoch_batches(ds, False, 0):
            probs.append(torch.sigmoid(model(x.to(device))).cpu().numpy())
            targets.append(np.asarray(y, dtype=np.float32))
        return np.concatenate(probs), np.concatenate(targets)

    def _validate(self, site: str) -> dict:
        probs, targets = self._scores(self._model, self._splits["val"])
        cols = column_index(self._site_classes, self._head_classes, site)
        # pooled (centralised) data: entries of a class the image's source does not label are NaN and left out
        return {"val_loss": labelled_bce(probs[:, cols], targets), "val_auroc": labelled_mean_auroc(probs[:, cols], targets)}

    # ------------------------------------------------------------------ tasks
    def declare(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        site = self.site_name(fl_ctx)
        self._site_classes = self.site_classes(fl_ctx)
        meta = from_shareable(shareable).get_meta_props()
        self._switches_from(meta, site)
        if self._splits is None:
            self._splits = self._load_data(fl_ctx)
        self.log_info(fl_ctx, f"{site}: declaring {len(self._site_classes)} classes ({meta.get(METHOD_KEY)}, "
                              f"backbone {meta.get(BACKBONE_KEY)})")
        return DXO(data_kind=DataKind.METRICS, data={"num_classes": len(self._site_classes)},
                   meta={CLASSES_KEY: classes_to_meta(self._site_classes),
                         "num_samples": self._splits["n_train"]}).to_shareable()

    def train(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        site = self.site_name(fl_ctx)
        round_idx = int(shareable.get_header(AppConstants.CURRENT_ROUND, 0))
        num_rounds = int(shareable.get_header(AppConstants.NUM_ROUNDS, 1))
        dxo = from_shareable(shareable)
        self._setup(fl_ctx, dxo.get_meta_props())
        t0 = time.time()
        n_loaded = self.load_received(self._model, dxo.data or {}, site)
        method = self._switches["method"]
        val = self._validate(site) if round_idx > 0 and method != "individual" else None
        warm = self._warm_up(site, abort_signal) if not self._warmed_up and self.warmup_epochs else None
        self._warmed_up = True
        train = self._splits["train"]
        losses, steps = [], 0
        for _ in range(self.local_epochs):
            loss, n = self._run_epoch(self._opt, train, site, abort_signal, frozen_features=False)
            losses.append(loss)
            steps += n
        loss = sum(losses) / len(losses)
        self._save(fl_ctx, round_idx)
        record = {"round": round_idx, "loss": loss, "received_tensors": n_loaded, "time_s": round(time.time() - t0, 2)}
        if warm is not None:
            record["warmup_loss"] = warm
        if val:
            record.update(val)
        if dxo.data and HEAD_WEIGHT in dxo.data:
            record["received_head_shape"] = list(np.asarray(dxo.data[HEAD_WEIGHT]).shape)
        self.append_metrics(fl_ctx, record)
        self.log_info(fl_ctx, f"round {round_idx + 1}/{num_rounds}: loss {loss:.4f}" +
                      (f", warm-up loss {warm:.4f}" if warm is not None else "") +
                      (f", global model validation BCE {val['val_loss']:.4f} AUROC {val['val_auroc']:.3f}" if val else ""))
        # batch-norm tensors go out with the rest: under FedBN / FedBN+ the job's BackboneBNExclusion upload
        # filter (following the backbone header set below) holds them back on the site; personalised heads and
        # individual models never leave the site
        weights = {} if method == "individual" else {
            k: v.detach().cpu().numpy() for k, v in self._model.state_dict().items()
            if not (method == "personalised" and is_head_key(k))}
        meta = {CLASSES_KEY: classes_to_meta(self._site_classes), "num_samples": self._splits["n_train"],
                MetaKey.NUM_STEPS_CURRENT_ROUND: steps, "loss": loss}
        if val:
            meta[MetaKey.INITIAL_METRICS] = val
        reply = DXO(data_kind=DataKind.WEIGHTS, data=weights, meta=meta).to_shareable()
        reply.set_header(BACKBONE_HEADER, self._switches["backbone"])  # read by the BackboneBNExclusion upload filter
        return reply

    def test(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        site = self.site_name(fl_ctx)
        dxo = from_shareable(shareable)
        meta = dxo.get_meta_props()
        self._setup(fl_ctx, meta)
        method = self._switches["method"]
        if method in GLOBAL_HEAD_METHODS:
            if meta.get(GLOBAL_CLASSES_KEY) is None:
                raise ValueError(f"{site}: the test task carries no {GLOBAL_CLASSES_KEY!r}; put HeadSlicer(full_head=true) "
                                 "in the server's task-data filters of the test task")
            head = classes_from_meta(meta[GLOBAL_CLASSES_KEY], "server")
            model = self._build_model(head).to(next(self._model.parameters()).device)
            own = self._model.state_dict()
            model.load_state_dict({k: v for k, v in own.items() if not is_head_key(k)}, strict=False)  # local BN
            self.load_received(model, dxo.data or {}, site)
            source = "global model"
        else:
            model = self._model
            self.load_received(model, dxo.data or {}, site)
            head = list(self._head_classes)
            source = "personalised model" if method == "personalised" else "local model"
        t0 = time.time()
        external = self.resolve_root(self.external_test_root, fl_ctx) if self.external_test_root else ""
        result = self.evaluate(model, head, site, source, external)
        self.append_metrics(fl_ctx, {"task": "test", "time_s": round(time.time() - t0, 2), **_flat_means(result)})
        self.log_info(fl_ctx, f"test ({source}): mean AUROC {result['test']['mean_auroc']:.3f} "
                              f"over {len(self._site_classes)} classes"
                      + (f"; external {result['external']['mean_auroc']:.3f} over {result['external']['n_classes']} classes"
                         if "external" in result else ""))
        return DXO(data_kind=DataKind.METRICS, data=result, meta={CLASSES_KEY: classes_to_meta(self._site_classes)}).to_shareable()

    def evaluate(self, model: torch.nn.Module, head: list[str], site: str, source: str, external_root: str = "") -> dict:
        """The test reply: per-class AUROC (bootstrap CIs) of ``model`` (head over ``head``) on this site's test
        patients, its classes; with ``external_root`` also on the external set (every annotated class of the head)."""
        probs, targets = self._scores(model, self._splits["test"])
        cols = column_index(self._site_classes, head, site)
        result = {"model": source, "n_test": int(len(targets)),
                  "test": auroc_table(probs[:, cols], targets, self._site_classes, n_bootstrap=self.n_bootstrap, seed=self.seed)}
        result["mean_auroc"] = result["test"]["mean_auroc"]
        if external_root:
            result["external"] = self._external(model, head, site, external_root)
            result["external_mean_auroc"] = result["external"]["mean_auroc"]
        return result

    def _external(self, model, head: list[str], site: str, root: str) -> dict:
        records = load_cxr_site(root, "mimic", site=site, split="all")  # all of it is external to the federation
        annotated = set(dataset_classes("mimic", root, site))
        classes = [c for c in head if c in annotated]  # a class the external set does not annotate has no truth
        if not classes:
            raise ValueError(f"{site}: the external test set at {root} annotates none of the model's classes {head}")
        probs, targets = self._scores(model, CXRDataset(records, classes, self.image_size, train=False, site=site))
        cols = column_index(classes, head, site)
        table = auroc_table(probs[:, cols], targets, classes, n_bootstrap=self.n_bootstrap, seed=self.seed)
        table["n_images"] = len(records)
        table["not_annotated"] = [c for c in head if c not in annotated]
        return table


def _flat_means(result: dict) -> dict:
    out = {"test_mean_auroc": result["test"]["mean_auroc"]}
    if "external" in result:
        out["external_mean_auroc"] = result["external"]["mean_auroc"]
    return {k: (None if v is None or (isinstance(v, float) and math.isnan(v)) else v) for k, v in out.items()}
