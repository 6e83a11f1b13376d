"""The ViT fine-tuning model and its checkpoints: used as a FLARE model component and by the client executor.

- :class:`FineTuneViT`: ``fedssl.models.vit.ViTClassifier`` (pre-trained encoder + average-pooled patch tokens +
  linear head, SSL-FL sec. III-D) with a ``head_steps`` buffer counting optimiser steps on the head, built from a
  pre-trained MIM global model (``pretrained_path``), local ImageNet weights (``imagenet_path``) or from scratch.
  It is the server's model component of the fine-tuning jobs and the clients' model.

ImageNet initialisation (SSL-FL sec. IV-B "ViT ImageNet" baseline, Table VIII "Init. w/ ImageNet weights"; issue 13
item 2): ``imagenet_path`` is a local timm ViT state dict, e.g. ``vit_base_patch16_224`` saved on a machine with
internet access by ``torch.save(timm.create_model("vit_base_patch16_224", pretrained=True).state_dict(), path)``
(timm key names; a ``.safetensors`` file works too).  The server's model component loads it; the sites get the
same weights in the round-0 broadcast, which carries the whole initial model.  The model records what it was
initialised from in ``initial_weights`` (``{"init": "imagenet" | "random" | "checkpoint", "path", "sha256"}``), which
the server's WeightsOnlyPersistor publishes for the run summary; a random start names the argument to set
(``init_fix``).
- :func:`read_checkpoint` / :func:`load_into`: a FLARE model file or state dict into the model, shapes checked.
- :func:`export_encoder`: the ``encoder.*`` tensors of a pre-training ``FL_global_model.pt`` (the decoder / BEiT
  head are dropped after pre-training) as a small state-dict file.

The local (per-site) fine-tuning protocol and checkpoint evaluation are in :mod:`fedssl.experiments.sslfl_local`.
"""

from __future__ import annotations

import logging
import os
from typing import Mapping

import numpy as np
import torch

from fedssl.core.safe_load import safe_load
from fedssl.core.checks import require, require_int
from fedssl.core.classification import HEAD_STEPS
from fedssl.core.digest import file_sha256
from fedssl.models.vit import (
    REL_POS_BIAS,
    ViTClassifier,
    encoder_state,
    load_imagenet_weights,
    load_pretrained_encoder,
)

logger = logging.getLogger(__name__)

#: what to set for SSL-FL's "ViT ImageNet" rows; the server's log line of a random start names it
IMAGENET_FIX = ('set "imagenet_path" in the args of the server\'s "model" component to a local timm '
                "vit_base_patch16_224 state dict (torch.save(model.state_dict()) of timm's pretrained model) for the "
                'ImageNet-init rows, or "pretrained_path" to a Fed-MAE / Fed-BEiT global model')


def check_vit_args(component: str, image_size, patch_size, embed_dim, depth, num_heads, drop_path_rate,
                   layer_scale=None, rel_pos_bias="none") -> None:
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
    require(isinstance(rel_pos_bias, str) and rel_pos_bias in REL_POS_BIAS, component, "rel_pos_bias", rel_pos_bias,
            f"use one of {list(REL_POS_BIAS)}: \"none\" for a Fed-MAE / ImageNet / scratch encoder, \"per_layer\" "
            "to fine-tune a Fed-BEiT encoder (SSL-FL's run_class_finetune_FedAvg.py), \"shared\" as Fed-BEiT "
            "pre-trains")


class FineTuneViT(ViTClassifier):
    def __init__(self, num_classes: int = 2, image_size: int = 224, patch_size: int = 16, embed_dim: int = 768,
                 depth: int = 12, num_heads: int = 12, drop_path_rate: float = 0.1, layer_scale: float | None = None,
                 pretrained_path: str = "", imagenet_path: str = "", seed: int = 0, rel_pos_bias: str = "none"):
        """
        Args:
            num_classes: classes of the task (retina 2, derm 8, covidfl 3).
            image_size, patch_size, embed_dim, depth, num_heads, drop_path_rate: the ViT (paper: ViT-B/16 at 224).
            layer_scale: null for a Fed-MAE encoder, 0.1 for a Fed-BEiT encoder (BEiTViT's layer scale).
            rel_pos_bias: BEiT's relative position bias: "none" for a Fed-MAE / ImageNet / scratch encoder,
                "per_layer" for a Fed-BEiT encoder (SSL-FL's fine-tuning: one table per block, each a copy of the
                pre-training's shared table), see ``fedssl.models.vit.ViTEncoder``.
            pretrained_path: a pre-training global model (``FL_global_model.pt`` of jobs/sslfl_mae_retina,
                jobs/sslfl_beit_retina, jobs/fedmae_derm), or an exported encoder; "" = no MIM pre-training.
            imagenet_path: a local timm ViT state dict (ImageNet weights, e.g. ``vit_base_patch16_224``; optional,
                loaded first, so a ``pretrained_path`` encoder replaces it); "" = none.  Both "" = ViT from
                scratch (random init; the server's persistor logs it and names this argument).
            seed: initial weights (the head is always freshly initialised).
        """
        name = type(self).__name__
        require_int(name, "num_classes", num_classes, 2, "use the number of classes of the task (retina: 2)")
        check_vit_args(name, image_size, patch_size, embed_dim, depth, num_heads, drop_path_rate, layer_scale,
                       rel_pos_bias)
        require(isinstance(pretrained_path, str), name, "pretrained_path", pretrained_path, 'use a path or ""')
        require(isinstance(imagenet_path, str), name, "imagenet_path", imagenet_path, 'use a path or ""')
        for arg, path in (("pretrained_path", pretrained_path), ("imagenet_path", imagenet_path)):
            require(not path or os.path.isfile(path), name, arg, path,
                    "the file does not exist on this machine; give the path of the checkpoint here, or \"\"")
        super().__init__(num_classes, image_size=image_size, patch_size=patch_size, embed_dim=embed_dim, depth=depth,
                         num_heads=num_heads, drop_path_rate=drop_path_rate, seed=seed, layer_scale=layer_scale,
                         rel_pos_bias=rel_pos_bias)
        self.register_buffer(HEAD_STEPS, torch.zeros((), dtype=torch.long))
        self.num_classes = num_classes
        self.image_size = image_size
        self.patch_size = patch_size
        self.embed_dim = embed_dim
        self.depth = depth
        self.num_heads = num_heads
        self.drop_path_rate = drop_path_rate
        self.layer_scale = layer_scale
        self.rel_pos_bias = rel_pos_bias
        self.pretrained_path = pretrained_path
        self.imagenet_path = imagenet_path
        self.seed = seed
        self.init_report: dict = {"init": "scratch"}
        #: what the run starts from, for the server persistor's INIT_PROP (issue 13 item 2)
        self.initial_weights: dict = {"init": "random", "path": "", "sha256": ""}
        if imagenet_path:
            self.init_report = {"init": "imagenet", "path": imagenet_path, **load_imagenet_weights(self, imagenet_path)}
        if pretrained_path:
            self.init_report = {"init": "pretrained", "path": pretrained_path,
                                **load_pretrained_encoder(self, pretrained_path)}
        if self.init_report["init"] != "scratch":
            kind = "imagenet" if self.init_report["init"] == "imagenet" else "checkpoint"
            self.initial_weights = {"init": kind, "path": self.init_report["path"],
                                    "sha256": file_sha256(self.init_report["path"])}
            logger.info(f"FineTuneViT: encoder initialised from {self.init_report['init']} weights "
                        f"{self.init_report['path']}: {self.init_report['loaded']} encoder tensors loaded, "
                        f"{len(self.init_report['ignored'])} ignored (decoder / MIM head), head freshly initialised")

    @property
    def init_fix(self) -> str:
        """What to set for ImageNet weights when the model starts from random weights ("" otherwise)."""
        return IMAGENET_FIX if self.initial_weights["init"] == "random" else ""


def init_name(pretrained_path: str = "", imagenet_path: str = "") -> str:
    return "pretrained" if pretrained_path else "imagenet" if imagenet_path else "scratch"


def read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """State dict of a FLARE model file (PTFileModelPersistor ``{"model": ...}``) or of a plain state-dict file."""
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint {path} does not exist")
    data = safe_load(path)  # UnreadableFile (a ValueError) naming the file: truncated, not weights, a pickle payload
    state = data.get("model", data) if isinstance(data, dict) else None
    if not isinstance(state, dict) or not state:
        raise ValueError(f"checkpoint {path} holds no state dict")
    try:
        return {k: torch.as_tensor(np.asarray(v)) if not isinstance(v, torch.Tensor) else v for k, v in state.items()}
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"checkpoint {path} is not a state dict of tensors ({type(e).__name__}: {e})") from None


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
        raise ValueError(f"{pretrained_path} has no encoder.* tensors; pass the FL_global_model.pt of a pre-training "
                         "run")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    torch.save({k: v.clone() for k, v in enc.items()}, out)
    n = sum(int(v.numel()) for v in enc.values())
    return {"out": out, "tensors": len(enc), "parameters": n, "dropped": len(state) - len(enc)}
