"""Model registry: ``build_model(name, **kw)`` over MONAI / timm, each with a tiny_* twin."""

from __future__ import annotations

from typing import Callable

from torch import nn

from fedssl.models.densenet import DenseNet121, TinyDenseNet
from fedssl.models.unet import (
    PAPER_FEATURES,
    TINY_FEATURES,
    BYOLUNetEncoder,
    ContrastiveNet,
    MoCoUNetEncoder,
    UNetEncoder,
    build_unet,
    encoder_state_from_global,
    load_encoder_into_unet,
)
from fedssl.models.vit import (
    TINY_DECODER,
    TINY_VIT,
    TINY_VOCAB,
    BEiTViT,
    MAEViT,
    ViTClassifier,
    encoder_state,
    load_imagenet_weights,
    load_pretrained_encoder,
)

_REGISTRY: dict[str, Callable[..., nn.Module]] = {
    "unet2d": lambda **kw: build_unet(**{"features": PAPER_FEATURES, **kw}),
    "tiny_unet2d": lambda **kw: build_unet(**{"features": TINY_FEATURES, **kw}),
    "moco_unet2d": lambda **kw: MoCoUNetEncoder(**{"features": PAPER_FEATURES, **kw}),
    "tiny_moco_unet2d": lambda **kw: MoCoUNetEncoder(**{"features": TINY_FEATURES, **kw}),
    "byol_unet2d": lambda **kw: BYOLUNetEncoder(**{"features": PAPER_FEATURES, **kw}),
    "tiny_byol_unet2d": lambda **kw: BYOLUNetEncoder(**{"features": TINY_FEATURES, "pred_hidden": 16, **kw}),
    "densenet121": lambda **kw: DenseNet121(**kw),  # kw: classes=[...] (required), imagenet_path, ...
    "tiny_densenet": lambda **kw: TinyDenseNet(**kw),
    "vit_b16_mae": lambda **kw: MAEViT(**kw),
    "tiny_vit_mae": lambda **kw: MAEViT(**{**TINY_VIT, **TINY_DECODER, **kw}),
    "vit_b16_beit": lambda **kw: BEiTViT(**kw),
    "tiny_vit_beit": lambda **kw: BEiTViT(**{**TINY_VIT, "vocab_size": TINY_VOCAB, **kw}),
    "vit_b16_cls": lambda **kw: ViTClassifier(**kw),  # kw: num_classes (required)
    "tiny_vit_cls": lambda **kw: ViTClassifier(**{**TINY_VIT, **kw}),
}


def build_model(name: str, **kwargs) -> nn.Module:
    if name not in _REGISTRY:
        raise ValueError(f"model name {name!r} is unknown; choose one of {sorted(_REGISTRY)}")
    return _REGISTRY[name](**kwargs)


__all__ = [
    "PAPER_FEATURES",
    "TINY_DECODER",
    "TINY_FEATURES",
    "TINY_VIT",
    "TINY_VOCAB",
    "BEiTViT",
    "MAEViT",
    "ViTClassifier",
    "encoder_state",
    "load_imagenet_weights",
    "load_pretrained_encoder",
    "BYOLUNetEncoder",
    "ContrastiveNet",
    "DenseNet121",
    "MoCoUNetEncoder",
    "TinyDenseNet",
    "UNetEncoder",
    "build_model",
    "build_unet",
    "encoder_state_from_global",
    "load_encoder_into_unet",
]
