"""The SSL-FL "local" fine-tuning protocol outside FLARE: per-site fine-tuning and checkpoint evaluation.

- :func:`finetune_local`: the paper's "local" rows: every site fine-tunes alone on its labelled images, the epoch
  is chosen on the site's validation split, and the chosen model is tested on the test folder.
- :func:`evaluate_checkpoint`: test metrics of a fine-tuned checkpoint; refuses one whose head was never trained.

The model (:class:`~fedssl.models.vit_classifier.FineTuneViT`) and the checkpoint helpers are in
:mod:`fedssl.models.vit_classifier`.
"""

from __future__ import annotations

import copy
import json
import math
import os
from typing import Callable, Mapping

import torch

from fedssl.core.classification import classification_metrics, predict, require_trained_head
from fedssl.core.seeds import site_seed
from fedssl.data.images import ImageDataset, batches, class_names, load_image_records, select_labelled, train_val_split
from fedssl.data.site_config import site_folders as _site_folders
from fedssl.models.vit import TINY_VIT, read_state_dict
from fedssl.models.vit_classifier import FineTuneViT, init_name, load_into, read_checkpoint
from fedssl.train.classifier_loop import ClassifierTrainer

#: settings of local fine-tuning (paper: the federated fine-tuning recipe with epochs for rounds)
PAPER_LOCAL = {"image_size": 224, "patch_size": 16, "embed_dim": 768, "depth": 12, "num_heads": 12,
               "drop_path_rate": 0.1, "layer_scale": None, "rel_pos_bias": "none", "lr": 3e-3, "batch_size": 256,
               "epochs": 100, "warmup": 5,
               "min_lr": 1e-6, "weight_decay": 0.05, "layer_decay": 0.65, "label_fraction": 1.0, "val_fraction": 0.1,
               "eval_batch_size": 256, "select_metric": "accuracy", "seed": 0, "device": "cpu"}


def local_settings(tiny: bool = False, **overrides) -> dict:
    """Settings over :data:`PAPER_LOCAL` from the command line: ``tiny`` = the tiny ViT (32 px, patch 4, width 48,
    depth 2, batch 32) for CPU runs; ``overrides`` = settings (``epochs``, ``lr``, ``layer_scale`` ...), None =
    unset."""
    s = {}
    if tiny:
        s.update(image_size=TINY_VIT["image_size"], patch_size=TINY_VIT["patch_size"], embed_dim=TINY_VIT["embed_dim"],
                 depth=TINY_VIT["depth"], num_heads=TINY_VIT["num_heads"], drop_path_rate=0.0, batch_size=32)
    s.update({k: v for k, v in overrides.items() if v is not None})
    return s


def site_folders(data_root: str) -> dict[str, str]:
    """``data_root/site-*`` folders in site order (as ``fedssl sslfl partition`` writes them)."""
    return _site_folders(data_root, "run `fedssl sslfl partition` first")


def _model_for(settings: Mapping, n_classes: int, pretrained_path: str, imagenet_path: str) -> FineTuneViT:
    return FineTuneViT(num_classes=n_classes, image_size=settings["image_size"], patch_size=settings["patch_size"],
                       embed_dim=settings["embed_dim"], depth=settings["depth"], num_heads=settings["num_heads"],
                       drop_path_rate=settings["drop_path_rate"], layer_scale=settings["layer_scale"],
                       rel_pos_bias=settings.get("rel_pos_bias", "none"), pretrained_path=pretrained_path,
                       imagenet_path=imagenet_path, seed=settings["seed"])


def finetune_site(site: str, root: str, test_root: str, dataset: str, settings: Mapping, pretrained_path: str = "",
                  imagenet_path: str = "", progress: Callable[[str], None] | None = None) -> dict:
    """Fine-tune one site alone; the epoch is chosen on the site's validation split; returns test metrics of it.
    The site's split, labelled subset, augmentation and batches use ``site_seed(seed, site)`` (each site draws its
    own, as in the federated jobs); the initial weights use ``seed``."""
    classes = class_names(dataset)
    s = settings
    data_seed = site_seed(s["seed"], site)
    records = load_image_records(root, dataset, site=site)
    train, val = train_val_split(records, s["val_fraction"], seed=data_seed)
    if not val:
        raise ValueError(f"{site}: no validation image with val_fraction={s['val_fraction']}")
    labelled = select_labelled(train, s["label_fraction"], seed=data_seed)
    train_set = ImageDataset(labelled, s["image_size"], "finetune", dataset, site=site, seed=data_seed)
    val_set = ImageDataset(val, s["image_size"], "eval", dataset, site=site)
    test_set = ImageDataset(load_image_records(test_root, dataset, site="test"), s["image_size"], "eval", dataset,
                            site="test")
    model = _model_for(s, len(classes), pretrained_path, imagenet_path)
    device = torch.device(s["device"])
    trainer = ClassifierTrainer(model, lr=s["lr"], total_rounds=s["epochs"],
                                warmup_rounds=min(s["warmup"], s["epochs"]),
                                min_lr=s["min_lr"], weight_decay=s["weight_decay"], layer_decay=s["layer_decay"],
                                device=device, seed=data_seed)
    n_steps = math.ceil(len(train_set) / s["batch_size"])
    best, best_state, best_epoch = -math.inf, None, -1
    for epoch in range(s["epochs"]):
        loss = trainer.train_round(batches(train_set, s["batch_size"], seed=data_seed, epoch=epoch), epoch, n_steps)
        probs, labels = predict(model, batches(val_set, s["eval_batch_size"], seed=0, epoch=0), device)
        val_metrics = classification_metrics(probs, labels, classes)
        score = val_metrics[s["select_metric"]]
        if score is not None and score > best:
            best, best_state, best_epoch = score, copy.deepcopy(model.state_dict()), epoch
        if progress:
            progress(f"{site} epoch {epoch + 1}/{s['epochs']}: loss {loss:.4f}, validation {s['select_metric']} "
                     f"{'n/a' if score is None else f'{score:.3f}'}")
    model.load_state_dict(best_state if best_state is not None else model.state_dict())
    require_trained_head(model, f"{site} local model")
    probs, labels = predict(model, batches(test_set, s["eval_batch_size"], seed=0, epoch=0), device)
    test = classification_metrics(probs, labels, classes)
    return {"site": site, "mode": "local", "init": init_name(pretrained_path, imagenet_path),
            "n_labelled": len(labelled),
            "n_val": len(val), "best_epoch": best_epoch, f"val_{s['select_metric']}": best, "test": test}


def finetune_local(data_root: str, dataset: str, inits: Mapping[str, tuple[str, str]], settings: Mapping | None = None,
                   test_root: str = "", progress: Callable[[str], None] | None = None) -> list[dict]:
    """Local fine-tuning of every ``site-*`` folder of ``data_root`` for every init ``name -> (pretrained, imagenet)``.

    ``test_root`` defaults to ``data_root/test`` (the partition's held-out test folder).
    """
    s = {**PAPER_LOCAL, **(settings or {})}
    test_root = test_root or os.path.join(data_root, "test")
    for path in (p for pair in inits.values() for p in pair if p):
        read_state_dict(path)  # every init file readable before the first site trains (names the file otherwise)
    rows = []
    for method, (pretrained_path, imagenet_path) in inits.items():
        for site, root in site_folders(data_root).items():
            row = finetune_site(site, root, test_root, dataset, s, pretrained_path, imagenet_path, progress)
            rows.append({"method": method, **row})
    return rows


def run_finetune_local(data_root: str, dataset: str, inits: Mapping[str, tuple[str, str]], out: str,
                       settings: Mapping | None = None, test_root: str = "",
                       progress: Callable[[str], None] | None = None) -> list[dict]:
    """``fedssl sslfl finetune``: :func:`finetune_local`, its rows written as JSON to ``out``; returns the rows."""
    rows = finetune_local(data_root, dataset, inits, settings=settings, test_root=test_root, progress=progress)
    with open(out, "w") as f:
        json.dump(rows, f, indent=2)
    return rows


def evaluate_checkpoint(checkpoint: str, test_root: str, dataset: str, settings: Mapping | None = None) -> dict:
    """Test metrics of a fine-tuned checkpoint (e.g. a fine-tuning run's best_FL_global_model.pt)."""
    s = {**PAPER_LOCAL, **(settings or {})}
    state = read_checkpoint(checkpoint)
    require_trained_head(state, checkpoint)
    model = _model_for(s, len(class_names(dataset)), "", "")
    load_into(model, state, source=checkpoint)
    test_set = ImageDataset(load_image_records(test_root, dataset, site="test"), s["image_size"], "eval", dataset,
                            site="test")
    device = torch.device(s["device"])
    model.to(device)
    probs, labels = predict(model, batches(test_set, s["eval_batch_size"], seed=0, epoch=0), device)
    return classification_metrics(probs, labels, class_names(dataset))
