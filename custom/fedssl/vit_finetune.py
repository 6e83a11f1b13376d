"""ViT fine-tuning outside FLARE: the fine-tuning model, local (per-site) fine-tuning, encoder export, evaluation.

- :class:`FineTuneViT`: ``fedssl.models.vit.ViTClassifier`` (pre-trained encoder + average-pooled patch tokens +
  linear head, SSL-FL sec. III-D) with a ``head_steps`` buffer counting optimiser steps on the head, built from a
  pre-trained MIM global model (``pretrained_path``), local ImageNet weights (``imagenet_path``) or from scratch.
  It is the server's model component of the fine-tuning jobs and the clients' model.
- :func:`finetune_local`: the paper's "local" rows: every site fine-tunes alone on its labelled images, the epoch
  is chosen on the site's validation split, and the chosen model is tested on the test folder.
- :func:`export_encoder`: the ``encoder.*`` tensors of a pre-training ``FL_global_model.pt`` (the decoder / BEiT
  head are dropped after pre-training) as a small state-dict file.
- :func:`evaluate_checkpoint`: test metrics of a fine-tuned checkpoint; refuses one whose head was never trained.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from typing import Callable, Mapping

import numpy as np
import torch

from fedssl.core.classification import (
    HEAD_STEPS,
    ClassifierTrainer,
    classification_metrics,
    predict,
    require_trained_head,
)
from fedssl.data.images import ImageDataset, batches, class_names, load_image_records, select_labelled, train_val_split
from fedssl.flare.validation import require, require_int
from fedssl.models.vit import ViTClassifier, encoder_state, load_imagenet_weights, load_pretrained_encoder

logger = logging.getLogger(__name__)


def check_vit_args(component: str, image_size, patch_size, embed_dim, depth, num_heads, drop_path_rate,
                   layer_scale=None) -> None:
    """The ViT shape arguments every fine-tuning component shares (message names argument, value and fix)."""
    require_int(component, "patch_size", patch_size, 1, "use a positive patch size (paper: 16)")
    require(isinstance(image_size, int) and not isinstance(image_size, bool) and image_size >= patch_size
            and image_size % patch_size == 0, component, "image_size", image_size,
            f"use a multiple of patch_size={patch_size} (paper: 224)")
    require_int(component, "num_heads", num_heads, 1, "use a positive number of heads (paper: 12)")
    require(isinstance(embed_dim, int) and not isinstance(embed_dim, bool) and embed_dim >= 1
            and embed_dim % num_heads == 0, component, "embed_dim", embed_dim,
            f"use a multiple of num_heads={num_heads} (paper: 768)")
    require_int(component, "depth", depth, 1, "use a positive number of blocks (paper: 12)")
    require(isinstance(drop_path_rate, (int, float)) and 0 <= drop_path_rate < 1, component, "drop_path_rate",
            drop_path_rate, "use a rate in [0, 1) (paper: 0.1)")
    require(layer_scale is None or (isinstance(layer_scale, (int, float)) and not isinstance(layer_scale, bool)
                                    and layer_scale > 0), component, "layer_scale", layer_scale,
            "use null (Fed-MAE encoder) or the pre-training layer scale (Fed-BEiT: 0.1)")


class FineTuneViT(ViTClassifier):
    def __init__(self, num_classes: int = 2, img_size: int = 224, patch_size: int = 16, embed_dim: int = 768,
                 depth: int = 12, num_heads: int = 12, drop_path_rate: float = 0.1, layer_scale: float | None = None,
                 pretrained_path: str = "", imagenet_path: str = "", seed: int = 0):
        """
        Args:
            num_classes: classes of the task (retina 2, derm 8, covidfl 3).
            img_size, patch_size, embed_dim, depth, num_heads, drop_path_rate: the ViT (paper: ViT-B/16 at 224).
            layer_scale: null for a Fed-MAE encoder, 0.1 for a Fed-BEiT encoder (BEiTViT's layer scale).
            pretrained_path: a pre-training global model (``FL_global_model.pt`` of jobs/sslfl_mae_retina,
                jobs/sslfl_beit_retina, jobs/fedmae_derm), or an exported encoder; "" = no MIM pre-training.
            imagenet_path: a local timm ViT checkpoint (ImageNet weights, optional; loaded first, so a
                ``pretrained_path`` encoder replaces it); "" = none.  Both "" = ViT from scratch.
            seed: initial weights (the head is always freshly initialised).
        """
        name = type(self).__name__
        require_int(name, "num_classes", num_classes, 2, "use the number of classes of the task (retina: 2)")
        check_vit_args(name, img_size, patch_size, embed_dim, depth, num_heads, drop_path_rate, layer_scale)
        require(isinstance(pretrained_path, str), name, "pretrained_path", pretrained_path, 'use a path or ""')
        require(isinstance(imagenet_path, str), name, "imagenet_path", imagenet_path, 'use a path or ""')
        for arg, path in (("pretrained_path", pretrained_path), ("imagenet_path", imagenet_path)):
            require(not path or os.path.isfile(path), name, arg, path,
                    "the file does not exist on this machine; give the path of the checkpoint here, or \"\"")
        super().__init__(num_classes, img_size=img_size, patch_size=patch_size, embed_dim=embed_dim, depth=depth,
                         num_heads=num_heads, drop_path_rate=drop_path_rate, seed=seed, layer_scale=layer_scale)
        self.register_buffer(HEAD_STEPS, torch.zeros((), dtype=torch.long))
        self.num_classes = num_classes
        self.img_size = img_size
        self.patch_size = patch_size
        self.embed_dim = embed_dim
        self.depth = depth
        self.num_heads = num_heads
        self.drop_path_rate = drop_path_rate
        self.layer_scale = layer_scale
        self.pretrained_path = pretrained_path
        self.imagenet_path = imagenet_path
        self.seed = seed
        self.init_report: dict = {"init": "scratch"}
        if imagenet_path:
            self.init_report = {"init": "imagenet", "path": imagenet_path, **load_imagenet_weights(self, imagenet_path)}
        if pretrained_path:
            self.init_report = {"init": "pretrained", "path": pretrained_path,
                                **load_pretrained_encoder(self, pretrained_path)}
        if self.init_report["init"] != "scratch":
            logger.info(f"FineTuneViT: encoder initialised from {self.init_report['init']} weights {self.init_report['path']}: "
                        f"{self.init_report['loaded']} encoder tensors loaded, {len(self.init_report['ignored'])} ignored "
                        f"(decoder / MIM head), head freshly initialised")


def init_name(pretrained_path: str = "", imagenet_path: str = "") -> str:
    return "pretrained" if pretrained_path else "imagenet" if imagenet_path else "scratch"


def read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """State dict of a FLARE model file (PTFileModelPersistor ``{"model": ...}``) or of a plain state-dict file."""
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint {path} does not exist")
    try:
        data = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # torch raises many types for a corrupt file
        raise ValueError(f"checkpoint {path} cannot be read ({type(e).__name__}: {e})") from e
    state = data.get("model", data) if isinstance(data, dict) else None
    if not isinstance(state, dict) or not state:
        raise ValueError(f"checkpoint {path} holds no state dict")
    return {k: torch.as_tensor(np.asarray(v)) if not isinstance(v, torch.Tensor) else v for k, v in state.items()}


def load_into(model: torch.nn.Module, state: Mapping[str, object], source: str) -> list[str]:
    """Load ``state`` (tensors or numpy arrays) into ``model``; returns the model keys ``state`` lacked.

    Keys the state lacks keep the model's own values (tensors a PartialModelExclusion filter kept on this
    site); a key the model does not have or a shape mismatch is a ValueError naming ``source``.
    """
    own = model.state_dict()
    unexpected = sorted(set(state) - set(own))
    if unexpected:
        raise ValueError(f"{source} has keys this model does not have: {unexpected[:5]}; the site and the server must "
                         "run the same model configuration")
    tensors = {}
    for k, v in state.items():
        t = v if isinstance(v, torch.Tensor) else torch.as_tensor(np.asarray(v))
        if tuple(t.shape) != tuple(own[k].shape):
            raise ValueError(f"{source}: {k} has shape {tuple(t.shape)}, this model expects {tuple(own[k].shape)}; "
                             "check num_classes / image_size / the ViT size of the site and the server")
        tensors[k] = t.to(own[k].dtype)
    model.load_state_dict(tensors, strict=False)
    return sorted(set(own) - set(state))


def export_encoder(pretrained_path: str, out: str) -> dict:
    """Save the encoder of a pre-training global model (decoder / MIM head dropped); returns a small report."""
    state = read_checkpoint(pretrained_path)
    enc = encoder_state(state)
    if not enc:
        raise ValueError(f"{pretrained_path} has no encoder.* tensors; pass the FL_global_model.pt of a pre-training run")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    torch.save({k: v.clone() for k, v in enc.items()}, out)
    n = sum(int(v.numel()) for v in enc.values())
    return {"out": out, "tensors": len(enc), "parameters": n, "dropped": len(state) - len(enc)}


# ---------------------------------------------------------------------------------------------- local protocol
#: settings of local fine-tuning (paper: the federated fine-tuning recipe with epochs for rounds)
PAPER_LOCAL = {"image_size": 224, "patch_size": 16, "embed_dim": 768, "depth": 12, "num_heads": 12,
               "drop_path_rate": 0.1, "layer_scale": None, "lr": 3e-3, "batch_size": 256, "epochs": 100, "warmup": 5, "min_lr": 1e-6,
               "weight_decay": 0.05, "layer_decay": 0.65, "label_fraction": 1.0, "val_fraction": 0.1, "eval_batch_size": 256,
               "select_metric": "accuracy", "seed": 0, "device": "cpu"}


def site_folders(data_root: str) -> dict[str, str]:
    """``data_root/site-*`` folders in site order (as ``fedssl partition`` writes them)."""
    if not os.path.isdir(data_root):
        raise ValueError(f"data root {data_root} is not a directory")
    names = [d for d in os.listdir(data_root) if d.startswith("site-") and os.path.isdir(os.path.join(data_root, d))]
    if not names:
        raise ValueError(f"no site-* folder under {data_root}; run `fedssl partition` first")
    key = lambda d: (0, int(d[5:])) if d[5:].isdigit() else (1, d)  # noqa: E731
    return {d: os.path.join(data_root, d) for d in sorted(names, key=key)}


def _model_for(settings: Mapping, n_classes: int, pretrained_path: str, imagenet_path: str) -> FineTuneViT:
    return FineTuneViT(num_classes=n_classes, img_size=settings["image_size"], patch_size=settings["patch_size"],
                       embed_dim=settings["embed_dim"], depth=settings["depth"], num_heads=settings["num_heads"],
                       drop_path_rate=settings["drop_path_rate"], layer_scale=settings["layer_scale"],
                       pretrained_path=pretrained_path,
                       imagenet_path=imagenet_path, seed=settings["seed"])


def finetune_site(site: str, root: str, test_root: str, dataset: str, settings: Mapping, pretrained_path: str = "",
                  imagenet_path: str = "", progress: Callable[[str], None] | None = None) -> dict:
    """Fine-tune one site alone; the epoch is chosen on the site's validation split; returns test metrics of it."""
    classes = class_names(dataset)
    s = settings
    records = load_image_records(root, dataset, site=site)
    train, val = train_val_split(records, s["val_fraction"], seed=s["seed"])
    if not val:
        raise ValueError(f"{site}: no validation image with val_fraction={s['val_fraction']}")
    labelled = select_labelled(train, s["label_fraction"], seed=s["seed"])
    train_set = ImageDataset(labelled, s["image_size"], "finetune", dataset, site=site, seed=s["seed"])
    val_set = ImageDataset(val, s["image_size"], "eval", dataset, site=site)
    test_set = ImageDataset(load_image_records(test_root, dataset, site="test"), s["image_size"], "eval", dataset, site="test")
    model = _model_for(s, len(classes), pretrained_path, imagenet_path)
    device = torch.device(s["device"])
    trainer = ClassifierTrainer(model, lr=s["lr"], total_rounds=s["epochs"], warmup_rounds=min(s["warmup"], s["epochs"]),
                                min_lr=s["min_lr"], weight_decay=s["weight_decay"], layer_decay=s["layer_decay"], device=device, seed=s["seed"])
    n_steps = math.ceil(len(train_set) / s["batch_size"])
    best, best_state, best_epoch = -math.inf, None, -1
    for epoch in range(s["epochs"]):
        loss = trainer.train_round(batches(train_set, s["batch_size"], seed=s["seed"], epoch=epoch), epoch, n_steps)
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
    return {"site": site, "mode": "local", "init": init_name(pretrained_path, imagenet_path), "n_labelled": len(labelled),
            "n_val": len(val), "best_epoch": best_epoch, f"val_{s['select_metric']}": best, "test": test}


def finetune_local(data_root: str, dataset: str, inits: Mapping[str, tuple[str, str]], settings: Mapping | None = None,
                   test_root: str = "", progress: Callable[[str], None] | None = None) -> list[dict]:
    """Local fine-tuning of every ``site-*`` folder of ``data_root`` for every init ``name -> (pretrained, imagenet)``.

    ``test_root`` defaults to ``data_root/test`` (the partition's held-out test folder).
    """
    s = {**PAPER_LOCAL, **(settings or {})}
    test_root = test_root or os.path.join(data_root, "test")
    rows = []
    for method, (pretrained_path, imagenet_path) in inits.items():
        for site, root in site_folders(data_root).items():
            row = finetune_site(site, root, test_root, dataset, s, pretrained_path, imagenet_path, progress)
            rows.append({"method": method, **row})
    return rows


def evaluate_checkpoint(checkpoint: str, test_root: str, dataset: str, settings: Mapping | None = None) -> dict:
    """Test metrics of a fine-tuned checkpoint (e.g. a fine-tuning run's best_FL_global_model.pt)."""
    s = {**PAPER_LOCAL, **(settings or {})}
    state = read_checkpoint(checkpoint)
    require_trained_head(state, checkpoint)
    model = _model_for(s, len(class_names(dataset)), "", "")
    load_into(model, state, source=checkpoint)
    test_set = ImageDataset(load_image_records(test_root, dataset, site="test"), s["image_size"], "eval", dataset, site="test")
    device = torch.device(s["device"])
    model.to(device)
    probs, labels = predict(model, batches(test_set, s["eval_batch_size"], seed=0, epoch=0), device)
    return classification_metrics(probs, labels, class_names(dataset))
