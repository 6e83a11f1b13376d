"""Multi-label DenseNet-121 for chest X-ray (Surgical aggregation, surgical aggregation (Kulkarni et al., ML4H 2024)),
and its tiny twin.

The network is ``torchvision.models.DenseNet`` (``densenet121``: growth 32, blocks (6, 12, 24, 16), 64
initial features), so every backbone key is torchvision's (``features.conv0.weight``,
``features.denseblock1.denselayer1.norm1.weight`` ...) and an ImageNet checkpoint of torchvision's
``densenet121`` loads from a local path.

ImageNet initialisation (paper sec. 2.5: "ImageNet-pretrained DenseNet121"; no download here): ``imagenet_path`` is a
local torchvision state dict, e.g. ``densenet121-a639ec97.pth`` as torchvision publishes it
(``https://download.pytorch.org/models/densenet121-a639ec97.pth``, fetched once where there is internet, copied to
the server and every site).  The same path goes in the server's ``model`` component and the sites'
``cxr_trainer.imagenet_path``; the server's round-0 broadcast (batch-norm included) makes every site start from
the server's copy.  An empty path (``""`` or null) means random initialisation, which the run states in its
first log line; a path that does not exist, is not a state dict, or does not fit the backbone (a shape differs,
a backbone tensor is missing) raises an error naming the file.  :func:`load_imagenet_weights` reports the
file's SHA-256 so the run summary records exactly which weights the run started from.  The classification head is
``classifier`` (``nn.Linear``) with one output (logit, BCE-with-logits) per class of ``classes``: row ``i`` of
``classifier.weight`` belongs to ``classes[i]``, so the label-name -> column mapping is explicit and travels with the
model arguments.

As in the public code (``create_model`` in ``src/utils.py``), global average pooling is followed by a
fully connected layer (256 units, ReLU, dropout 0.3) before the class layer; that layer
(``pre_classifier.*``) belongs to the shared feature extractor, only ``classifier.*`` is the head that
surgical aggregation merges per class.  ``hidden_features=0`` drops it (pooled features go straight into
``classifier``).

``TinyDenseNet`` (growth 8, blocks (2, 2, 2, 2), 16 initial features, 32 hidden units) has exactly the
same key structure, for unit tests and CPU quick runs.
"""

from __future__ import annotations

import os
import re
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fedssl.core.digest import file_sha256
from fedssl.core.safe_load import safe_load
from fedssl.models.seeding import seeded
from torchvision.models.densenet import DenseNet

#: what to set for ImageNet initialisation (the server's random-init warning names it)
IMAGENET_FIX = ('set "imagenet_path" to a local torchvision densenet121 state dict (e.g. densenet121-a639ec97.pth) '
                "in the args of the server's \"model\" component and of the sites' \"cxr_trainer\"; the paper's "
                "DenseNet-121 is ImageNet-pretrained")

__all__ = [
    "MultiLabelDenseNet",
    "DenseNet121",
    "TinyDenseNet",
    "is_bn_key",
    "bn_keys",
    "freeze_batchnorm",
    "set_features_trainable",
    "load_imagenet_weights",
]

#: torchvision densenet121 / the tiny twin: (growth_rate, block_config, num_init_features).
DENSENET121 = (32, (6, 12, 24, 16), 64)
TINY = (8, (2, 2, 2, 2), 16)

_BN_TENSORS = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")
_BN_KEY = re.compile(r"(^|\.)(norm\d*|bn\d*|batchnorm\d*)\.(" + "|".join(_BN_TENSORS) + r")$")
# Old torchvision checkpoints name dense-layer modules 'norm.1', 'conv.2' ... (as torchvision's own loader fixes).
_OLD_DENSE_KEY = re.compile(r"^(.*denselayer\d+\.(?:norm|relu|conv))\."
                            r"((?:[12])\.(?:weight|bias|running_mean|running_var))$")


def is_bn_key(name: str) -> bool:
    """A batch-norm tensor of this bundle's DenseNets: ``...norm0.weight``, ``...norm2.running_var``,
    ``...transition1.norm.num_batches_tracked`` (also ``bn1.*`` / ``batchnorm.*`` names)."""
    return bool(_BN_KEY.search(name))


def bn_keys(model: nn.Module) -> list[str]:
    """State-dict keys that belong to ``nn.BatchNorm*`` modules (by module type, to cross-check ``is_bn_key``)."""
    out = []
    for mname, mod in model.named_modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm):
            out += [f"{mname}.{t}" for t, _ in list(mod.named_parameters(recurse=False))
                    + list(mod.named_buffers(recurse=False))]
    return out


def freeze_batchnorm(model: nn.Module) -> int:
    """FedBN+: every BatchNorm layer gets no gradient and runs in inference mode (pre-trained running stats,
    never updated).  ``model.train()`` switches BN back to training mode, so call this after every
    ``model.train()``.  Returns the number of BN layers frozen."""
    n = 0
    for mod in model.modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm):
            mod.eval()
            for p in mod.parameters(recurse=False):
                p.requires_grad_(False)
            n += 1
    return n


def set_features_trainable(model: nn.Module, trainable: bool) -> None:
    """Head warm-up (paper 2.5): freeze / unfreeze the convolutional ``features`` (requires_grad).  While
    frozen, also keep ``model.features`` in eval mode so its BN statistics stay as they are.  Unfreezing
    re-enables the BN parameters too: under FedBN+ call :func:`freeze_batchnorm` afterwards."""
    for p in model.features.parameters():
        p.requires_grad_(trainable)


def _check_classes(classes: object) -> list[str]:
    from fedssl.core.surgical import check_class_list

    return check_class_list(classes, "<model>")


class MultiLabelDenseNet(DenseNet):
    """torchvision DenseNet with a class-name-bound multi-label head; ``forward`` returns logits [B, C].

    Every argument is a JSON value stored verbatim (FLARE component); ``imagenet_path``: a local torchvision
    densenet121 checkpoint loaded into ``features`` after the seeded init (only for densenet121's shape); ``""`` or
    None: random initialisation."""

    def __init__(self, classes: Sequence[str], growth_rate: int, block_config: Sequence[int], num_init_features: int,
                 hidden_features: int = 0, dropout: float = 0.3, drop_rate: float = 0.0, seed: int | None = 0,
                 imagenet_path: str | None = None):
        cl = _check_classes(classes)
        if len(tuple(block_config)) != 4:
            raise ValueError(f"block_config={list(block_config)!r}: DenseNet needs 4 dense blocks")
        if not isinstance(hidden_features, int) or hidden_features < 0:
            raise ValueError(f"hidden_features={hidden_features!r}: use 0 (no hidden layer) or a positive int")
        if not 0.0 <= float(dropout) < 1.0:
            raise ValueError(f"dropout={dropout!r}: use a probability in [0, 1)")
        with seeded(seed):
            super().__init__(growth_rate=growth_rate, block_config=tuple(block_config),
                             num_init_features=num_init_features, drop_rate=drop_rate, num_classes=len(cl))
            n_feat = self.classifier.in_features
            if hidden_features:
                self.pre_classifier = nn.Sequential(nn.Linear(n_feat, hidden_features), nn.ReLU(inplace=True),
                                                    nn.Dropout(float(dropout)))
                self.classifier = nn.Linear(hidden_features, len(cl))
                nn.init.constant_(self.classifier.bias, 0)
            else:
                self.pre_classifier = nn.Identity()
        self.classes = classes
        self.growth_rate = growth_rate
        self.block_config = block_config
        self.num_init_features = num_init_features
        self.hidden_features = hidden_features
        self.dropout = dropout
        self.drop_rate = drop_rate
        self.seed = seed
        self.imagenet_path = imagenet_path
        #: what load_imagenet_weights reported (None: random init)
        if imagenet_path is not None and not isinstance(imagenet_path, str):
            raise ValueError(f"imagenet_path={imagenet_path!r}: use a path string to a torchvision densenet121 "
                             'state dict, or "" for random initialisation')
        self.imagenet_report = load_imagenet_weights(self, imagenet_path) if imagenet_path else None

    @property
    def initial_weights(self) -> dict:
        """What the model starts from, as the server persistor's ``INIT_PROP`` record."""
        if self.imagenet_report:
            return {"init": "imagenet", "path": self.imagenet_report["path"], "sha256": self.imagenet_report["sha256"]}
        return {"init": "random", "path": "", "sha256": ""}

    @property
    def init_fix(self) -> str:
        """What to set for ImageNet weights when the model starts from random weights ("" otherwise)."""
        return IMAGENET_FIX if not self.imagenet_report else ""

    @property
    def num_features(self) -> int:
        """Input width of the class layer (F of ``classifier.weight [C, F]``)."""
        return self.classifier.in_features

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.features(x), inplace=True)
        out = torch.flatten(F.adaptive_avg_pool2d(out, (1, 1)), 1)
        return self.pre_classifier(out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.embed(x))


class DenseNet121(MultiLabelDenseNet):
    """Paper model: DenseNet-121 (torchvision layout), optional local ImageNet checkpoint (``imagenet_path``)."""

    def __init__(self, classes: Sequence[str], imagenet_path: str | None = None, hidden_features: int = 256,
                 dropout: float = 0.3, drop_rate: float = 0.0, seed: int | None = 0):
        growth, blocks, init = DENSENET121
        super().__init__(classes, growth, blocks, init, hidden_features=hidden_features, dropout=dropout,
                         drop_rate=drop_rate, seed=seed, imagenet_path=imagenet_path)


class TinyDenseNet(MultiLabelDenseNet):
    """Tiny twin (growth 8, blocks (2, 2, 2, 2), 16 initial features, 32 hidden units, no dropout: dropout on so
    few units slows learning on CPU-sized synthetic data): same key structure."""

    def __init__(self, classes: Sequence[str], hidden_features: int = 32, dropout: float = 0.0,
                 drop_rate: float = 0.0, seed: int | None = 0):
        growth, blocks, init = TINY
        super().__init__(classes, growth, blocks, init, hidden_features=hidden_features, dropout=dropout,
                         drop_rate=drop_rate, seed=seed)


def load_imagenet_weights(model: MultiLabelDenseNet, path: str) -> dict:
    """Load a local torchvision ``densenet121`` ImageNet checkpoint into the backbone (``features.*``).

    Accepts a plain state dict or one wrapped under ``state_dict`` / ``model``; old dotted dense-layer names
    (``norm.1``) are renamed.  The 1000-class ``classifier`` is skipped (the head is per class name).
    Returns ``{"path": path, "sha256": hex digest of the file, "loaded": n, "skipped": [...]}``; raises
    (naming the file) if no backbone tensor matched, a shape differs or a backbone tensor is missing: the checkpoint
    is for another architecture or truncated, and a partly pre-trained backbone would go unnoticed.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"imagenet_path={path!r}: no such file; give a local torchvision densenet121 "
                                "checkpoint (e.g. densenet121-a639ec97.pth) or leave it empty for random init")
    sd = safe_load(path)
    for wrap in ("state_dict", "model"):
        if isinstance(sd, dict) and wrap in sd and isinstance(sd[wrap], dict):
            sd = sd[wrap]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ValueError(f"imagenet_path={path!r} holds no state dict of tensors (got {type(sd).__name__}); not a "
                         "torchvision densenet121 checkpoint")
    fixed = {}
    for k, v in sd.items():
        k = k[len("module."):] if k.startswith("module.") else k
        m = _OLD_DENSE_KEY.match(k)
        fixed[m.group(1) + m.group(2) if m else k] = v
    own = model.state_dict()
    load, skipped = {}, []
    for k, v in fixed.items():
        if not k.startswith("features."):
            skipped.append(k)
            continue
        if k not in own:
            skipped.append(k)
            continue
        if tuple(v.shape) != tuple(own[k].shape):
            raise ValueError(f"imagenet_path={path!r}: {k} has shape {tuple(v.shape)}, the model "
                             f"{tuple(own[k].shape)}; "
                             "the checkpoint is not a densenet121")
        load[k] = v
    if not load:
        raise ValueError(f"imagenet_path={path!r}: no 'features.*' tensor matches the DenseNet; not a torchvision "
                         "densenet121 checkpoint")
    model.load_state_dict(load, strict=False)
    # pre-0.4 checkpoints (torchvision's published densenet121) carry no num_batches_tracked: not missing
    missing = [k for k in own if k.startswith("features.") and k not in load and not k.endswith("num_batches_tracked")]
    if missing:
        raise ValueError(f"imagenet_path={path!r} lacks {len(missing)} backbone tensors of the DenseNet (e.g. "
                         f"{missing[:3]}); the checkpoint does not fit (truncated, or another architecture)")
    return {"path": path, "sha256": file_sha256(path), "loaded": len(load), "skipped": skipped}
