"""Model registry: ``build_model(name, **kw)`` over MONAI / timm / torchvision, each with a tiny_* twin.

Each model family lives in its own module: ``unet`` (MONAI), ``vit`` (timm), ``densenet`` (torchvision). This
package imports none of them until one of their names is used, so a process that builds a ViT never imports MONAI
(which also imports transformers and torchvision's detection ops): that saves seconds in every FLARE client and
server process of a job that does not use it. ``from fedssl.models import build_unet`` and
``fedssl.models.MAEViT`` work as before.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Callable

from torch import nn

# public name -> the module of this package that defines it
_EXPORTS = {
    **dict.fromkeys(["DenseNet121", "TinyDenseNet"], "densenet"),
    **dict.fromkeys(["PAPER_FEATURES", "TINY_FEATURES", "BYOLUNetEncoder", "ContrastiveNet", "MoCoUNetEncoder",
                     "UNetEncoder", "build_unet", "encoder_state_from_global", "load_encoder_into_unet"], "unet"),
    **dict.fromkeys(["TINY_DECODER", "TINY_VIT", "TINY_VOCAB", "BEiTViT", "MAEViT", "ViTClassifier", "encoder_state",
                     "load_imagenet_weights", "load_pretrained_encoder"], "vit"),
}


def _module(name: str) -> ModuleType:
    return importlib.import_module(f"{__name__}.{name}")


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


def _unet(factory: str, features: str, **defaults) -> Callable[..., nn.Module]:
    def build(**kw) -> nn.Module:
        m = _module("unet")
        return getattr(m, factory)(**{"features": getattr(m, features), **defaults, **kw})
    return build


def _vit(cls: str, *presets: str, **defaults) -> Callable[..., nn.Module]:
    def build(**kw) -> nn.Module:
        m = _module("vit")
        preset = {k: v for name in presets for k, v in getattr(m, name).items()}
        return getattr(m, cls)(**{**preset, **{k: getattr(m, v) for k, v in defaults.items()}, **kw})
    return build


def _densenet(cls: str) -> Callable[..., nn.Module]:
    return lambda **kw: getattr(_module("densenet"), cls)(**kw)


_REGISTRY: dict[str, Callable[..., nn.Module]] = {
    "unet2d": _unet("build_unet", "PAPER_FEATURES"),
    "tiny_unet2d": _unet("build_unet", "TINY_FEATURES"),
    "moco_unet2d": _unet("MoCoUNetEncoder", "PAPER_FEATURES"),
    "tiny_moco_unet2d": _unet("MoCoUNetEncoder", "TINY_FEATURES", image_size=32),
    "byol_unet2d": _unet("BYOLUNetEncoder", "PAPER_FEATURES"),
    "tiny_byol_unet2d": _unet("BYOLUNetEncoder", "TINY_FEATURES", pred_hidden=16, image_size=32),
    "densenet121": _densenet("DenseNet121"),  # kw: classes=[...] (required), imagenet_path, ...
    "tiny_densenet": _densenet("TinyDenseNet"),
    "vit_b16_mae": _vit("MAEViT"),
    "tiny_vit_mae": _vit("MAEViT", "TINY_VIT", "TINY_DECODER"),
    "vit_b16_beit": _vit("BEiTViT"),
    "tiny_vit_beit": _vit("BEiTViT", "TINY_VIT", vocab_size="TINY_VOCAB"),
    "vit_b16_cls": _vit("ViTClassifier"),  # kw: num_classes (required)
    "tiny_vit_cls": _vit("ViTClassifier", "TINY_VIT"),
}


def build_model(name: str, **kwargs) -> nn.Module:
    if name not in _REGISTRY:
        raise ValueError(f"model name {name!r} is unknown; choose one of {sorted(_REGISTRY)}")
    return _REGISTRY[name](**kwargs)


__all__ = sorted(_EXPORTS) + ["build_model"]
