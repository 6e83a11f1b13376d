"""ResNet-18 (and ResNet-50) backbones for FedCLF ("Federated Self-Supervised Learning for Dermatological Disease
Diagnosis", FedCLF / FedMAE-KS, section V-A: "ResNet-18 as the backbone model, and ... a 2-layer MLP projection head to
project the representations to 128-dimensional features").

* :class:`ResNetEncoder`: torchvision's ResNet-18 without its classifier: images ``[B, 3, H, W]`` -> pooled
  representations ``[B, 512]`` (``width`` scales every stage for CPU profiles: 64 = the paper's ResNet-18);
* :class:`ProjectionNet`: encoder + 2-layer MLP head (Linear-ReLU-Linear, MoCo v2's) to ``proj_dim``, L2-normalised;
* :class:`PretrainingResNet`: the global model of each pre-training method: MoCo's main and momentum networks
  (FedCLF, FedMoCo, Local CL), SimCLR's network (FedSimCLR) or an encoder with a 4-way rotation head (FedRotation,
  Gidaris et al., ICLR 2018);
* :class:`ResNetClassifier`: the fine-tuning model, encoder + linear classifier; :func:`encoder_state_from` picks
  the encoder out of any of the pre-training states above.

Every model draws its initial weights from its own ``seed`` (:func:`fedssl.models.seeding.seeded`), so the server's
initial global model and every site's are the same.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet

from fedssl.core.checks import require, require_choice, require_int
from fedssl.core.classification import HEAD_STEPS
from fedssl.core.digest import file_sha256
from fedssl.models.seeding import seeded
from fedssl.models.vit_classifier import read_checkpoint

#: ResNet-18's stage widths are width x (1, 2, 4, 8); 64 is torchvision's ResNet-18
PAPER_WIDTH = 64
#: ResNet depth -> torchvision's block and stage layout: 18 (FedCLF sec. V-A), 50 (the CNN baselines of FedMAE-KS's
#: Tables III / IV, sec. V-B: "ResNet-50 is used as the backbone")
DEPTHS = {18: (BasicBlock, (2, 2, 2, 2)), 50: (Bottleneck, (3, 4, 6, 3))}
PAPER_DEPTH = 18
#: depths whose residual blocks start as the identity (torchvision's ``zero_init_residual``, Goyal et al., "Accurate,
#: Large Minibatch SGD", 2017).  Without it a ResNet-50's BatchNorm running variances grew to ~1,800 within 3 MoCo
#: steps at lr 0.03 (one synthetic ISIC client, width 8), an update 17x the global model's norm that the
#: aggregator's bound (10x) rejects; with it the update was 0.18x.  ResNet-18 keeps torchvision's default.
ZERO_INIT_RESIDUAL = (50,)
#: MoCo v2's projection head: hidden width = the representation width
PAPER_PROJ_DIM = 128
#: the pre-training global-state prefixes whose ``encoder.*`` entries are the backbone fine-tuning starts from
ENCODER_PREFIXES = ("main.encoder.", "encoder.")


def require_resnet_args(component: str, width: object, proj_dim: object | None = None,
                        depth: object = PAPER_DEPTH) -> None:
    """ValueError naming ``component``, the argument and the fix for a bad width / projection width / depth."""
    require_int(component, "width", width, 4, f"use a positive stage width (paper: ResNet-18 = {PAPER_WIDTH})")
    require(isinstance(depth, int) and not isinstance(depth, bool) and depth in DEPTHS, component, "depth", depth,
            f"use one of {sorted(DEPTHS)} (FedCLF: 18; FedMAE-KS's CNN baselines: 50)")
    if proj_dim is not None:
        require_int(component, "proj_dim", proj_dim, 1, f"use the projection width (paper: {PAPER_PROJ_DIM})")


class ResNetEncoder(nn.Module):
    """torchvision's ResNet-18 (BasicBlock [2, 2, 2, 2]) or ResNet-50 (Bottleneck [3, 4, 6, 3], ``depth=50``) up to
    the global average pool: ``[B, 8 * width * expansion]`` (512 / 2048 at the paper's width 64)."""

    def __init__(self, width: int = PAPER_WIDTH, depth: int = PAPER_DEPTH):
        super().__init__()
        require_resnet_args(type(self).__name__, width, depth=depth)
        block, layers = DEPTHS[depth]
        zero_init = depth in ZERO_INIT_RESIDUAL
        net = ResNet(block, list(layers), zero_init_residual=zero_init) if width == PAPER_WIDTH else \
            _narrow_resnet(width, block, layers, zero_init)
        net.fc = nn.Identity()
        self.net = net
        self.width, self.depth = width, depth
        self.out_dim = 8 * width * block.expansion

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _narrow_resnet(width: int, block=BasicBlock, layers=(2, 2, 2, 2), zero_init_residual: bool = False) -> ResNet:
    """torchvision's ResNet with stage widths width x (1, 2, 4, 8) (its constructor fixes 64)."""
    net = ResNet(block, list(layers))
    net.inplanes = width
    net.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
    net.bn1 = nn.BatchNorm2d(width)
    net.layer1 = net._make_layer(block, width, layers[0])
    net.layer2 = net._make_layer(block, 2 * width, layers[1], stride=2)
    net.layer3 = net._make_layer(block, 4 * width, layers[2], stride=2)
    net.layer4 = net._make_layer(block, 8 * width, layers[3], stride=2)
    for m in net.modules():  # torchvision's initialisation
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.constant_(m.weight, 1)
            nn.init.constant_(m.bias, 0)
    if zero_init_residual:  # torchvision's zero_init_residual: each Bottleneck starts as the identity
        for m in net.modules():
            if isinstance(m, Bottleneck):
                nn.init.constant_(m.bn3.weight, 0)
    return net


class ProjectionNet(nn.Module):
    """Encoder + 2-layer MLP projection head -> L2-normalised ``[B, proj_dim]`` features."""

    def __init__(self, width: int = PAPER_WIDTH, proj_dim: int = PAPER_PROJ_DIM, depth: int = PAPER_DEPTH):
        super().__init__()
        self.encoder = ResNetEncoder(width, depth)
        d = self.encoder.out_dim
        self.head = nn.Sequential(nn.Linear(d, d), nn.ReLU(inplace=True), nn.Linear(d, proj_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.head(self.encoder(x)), dim=1)


class RotationEncoder(nn.Module):
    """Holds the encoder under ``encoder.*`` (as :class:`ProjectionNet` does), so every pre-training model's
    backbone is ``main.encoder.*``."""

    def __init__(self, width: int, depth: int = PAPER_DEPTH):
        super().__init__()
        self.encoder = ResNetEncoder(width, depth)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)


#: pre-training networks: "moco" (FedCLF, FedMoCo, Local CL), "simclr" (FedSimCLR), "rotation" (FedRotation)
PRETRAINING_METHODS = ("moco", "simclr", "rotation")


class PretrainingResNet(nn.Module):
    """The global model of a pre-training method, one class so that a variant is an argument of the job:

    * ``"moco"``: MoCo's main and momentum networks (FedCLF Fig. 3; keys ``main.*``, ``momentum.*``; both federated;
      the momentum network starts as a copy of the main one and is never trained by gradients);
    * ``"simclr"``: encoder + projection head (``main.*``);
    * ``"rotation"``: encoder (``main.encoder.*``) + linear 4-way rotation classifier (``rotation_head.*``).

    ``forward``: MoCo / SimCLR the main network's normalised features, Rotation the rotation logits."""

    def __init__(self, method: str = "moco", width: int = PAPER_WIDTH, proj_dim: int = PAPER_PROJ_DIM,
                 seed: int | None = 0, depth: int = PAPER_DEPTH):
        super().__init__()
        name = type(self).__name__
        require_choice(name, "method", method, PRETRAINING_METHODS)
        require_resnet_args(name, width, proj_dim, depth)
        self.method, self.width, self.proj_dim, self.seed, self.depth = method, width, proj_dim, seed, depth
        with seeded(seed):
            if method == "rotation":
                self.main = RotationEncoder(width, depth)
                self.rotation_head = nn.Linear(self.main.encoder.out_dim, 4)
            else:
                self.main = ProjectionNet(width, proj_dim, depth)
            if method == "moco":
                self.momentum = ProjectionNet(width, proj_dim, depth)
        if method == "moco":
            self.momentum.load_state_dict(self.main.state_dict())
            for p in self.momentum.parameters():
                p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rotation_head(self.main(x)) if self.method == "rotation" else self.main(x)


class ResNetClassifier(nn.Module):
    """Fine-tuning model: ResNet-18 encoder + linear classifier (``encoder.*``, ``fc.*``), with the ``head_steps``
    buffer that counts optimiser steps on the classifier (a model whose head was never trained is not evaluated).

    ``pretrained_path``: a pre-training global model (``FL_global_model.pt`` of jobs/fedclf_derm and its variants),
    or a classifier / encoder state; its encoder is loaded, the classifier stays freshly initialised; "" = random
    init.  What the model starts from is recorded in ``initial_weights`` for the server's persistor."""

    def __init__(self, num_classes: int = 5, width: int = PAPER_WIDTH, pretrained_path: str = "", seed: int | None = 0,
                 depth: int = PAPER_DEPTH):
        super().__init__()
        name = type(self).__name__
        require_int(name, "num_classes", num_classes, 2, "use the number of classes (FedCLF: 5)")
        require_resnet_args(name, width, depth=depth)
        require(isinstance(pretrained_path, str) and (not pretrained_path or os.path.isfile(pretrained_path)), name,
                "pretrained_path", pretrained_path,
                'give an existing pre-training global model file, or "" (random init)')
        self.num_classes, self.width, self.pretrained_path, self.seed = num_classes, width, pretrained_path, seed
        self.depth = depth
        with seeded(seed):
            self.encoder = ResNetEncoder(width, depth)
            self.fc = nn.Linear(self.encoder.out_dim, num_classes)
        self.register_buffer(HEAD_STEPS, torch.zeros((), dtype=torch.long))
        self.initial_weights: dict = {"init": "random", "path": "", "sha256": ""}
        if pretrained_path:
            self.load_encoder(read_checkpoint(pretrained_path), pretrained_path)
            self.initial_weights = {"init": "checkpoint", "path": pretrained_path,
                                    "sha256": file_sha256(pretrained_path)}

    def load_encoder(self, state: Mapping[str, object], source: str) -> None:
        """The encoder of a pre-training / classifier state (:func:`encoder_state_from`), shapes checked."""
        try:
            self.encoder.load_state_dict(encoder_state_from(state))
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"{source}: its encoder does not fit this ResNet (width {self.width}, depth "
                             f"{self.depth}): {e}") from None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.encoder(x))


def encoder_state_from(state: Mapping[str, object]) -> dict[str, torch.Tensor]:
    """The backbone (``ResNetEncoder`` keys ``net.*``) of a pre-training global state (MoCo / SimCLR / Rotation:
    ``main.encoder.*``) or of a classifier / encoder state (``encoder.*``); ValueError if it holds none."""
    for prefix in ENCODER_PREFIXES:
        found = {k[len(prefix):]: torch.as_tensor(v) for k, v in state.items() if k.startswith(prefix)}
        if found:
            return found
    raise ValueError(f"the state has no ResNet encoder (keys starting with {list(ENCODER_PREFIXES)}; it has e.g. "
                     f"{sorted(state)[:3]}); pass a FedCLF / FedMoCo / FedSimCLR / FedRotation global model")
