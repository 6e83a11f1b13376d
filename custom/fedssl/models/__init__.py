"""Model registry: ``build_model(name, **kw)`` over MONAI / timm / transformers, each with a tiny_* twin."""

from __future__ import annotations

from typing import Callable

from torch import nn

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

_REGISTRY: dict[str, Callable[..., nn.Module]] = {
    "unet2d": lambda **kw: build_unet(**{"features": PAPER_FEATURES, **kw}),
    "tiny_unet2d": lambda **kw: build_unet(**{"features": TINY_FEATURES, **kw}),
    "moco_unet2d": lambda **kw: MoCoUNetEncoder(**{"features": PAPER_FEATURES, **kw}),
    "tiny_moco_unet2d": lambda **kw: MoCoUNetEncoder(**{"features": TINY_FEATURES, **kw}),
    "byol_unet2d": lambda **kw: BYOLUNetEncoder(**{"features": PAPER_FEATURES, **kw}),
    "tiny_byol_unet2d": lambda **kw: BYOLUNetEncoder(**{"features": TINY_FEATURES, "pred_hidden": 16, **kw}),
}


def build_model(name: str, **kwargs) -> nn.Module:
    if name not in _REGISTRY:
        raise ValueError(f"model name {name!r} is unknown; choose one of {sorted(_REGISTRY)}")
    return _REGISTRY[name](**kwargs)


__all__ = [
    "PAPER_FEATURES",
    "TINY_FEATURES",
    "BYOLUNetEncoder",
    "ContrastiveNet",
    "MoCoUNetEncoder",
    "UNetEncoder",
    "build_model",
    "build_unet",
    "encoder_state_from_global",
    "load_encoder_into_unet",
]
