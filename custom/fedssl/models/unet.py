"""2D U-Net (MONAI ``BasicUNet``) and its encoder, shared by FCL pre-training and fine-tuning.

FCL (FCL (Wu et al., MedIA 2022), section 3.1) pre-trains the *encoder* of a standard 2D U-Net (first level 48 channels)
and then loads it 1:1 into the U-Net for segmentation.  ``UNetEncoder`` owns exactly the encoder
modules of ``monai.networks.nets.BasicUNet`` under the same attribute names (``conv_0``,
``down_1`` ... ``down_4``), so ``UNetEncoder.state_dict()`` loads into a ``BasicUNet`` with every
encoder key matched and nothing renamed.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.nn.functional as F
from monai.networks.nets import BasicUNet
from torch import nn

from fedssl.core.checks import require
from fedssl.models.seeding import seeded

#: Paper setting: standard U-Net, first level 48 channels, doubling per level (Ronneberger et al.).
PAPER_FEATURES: tuple[int, ...] = (48, 96, 192, 384, 768, 48)
#: Tiny twin for unit tests.
TINY_FEATURES: tuple[int, ...] = (4, 4, 8, 8, 16, 4)

ENCODER_MODULES: tuple[str, ...] = ("conv_0", "down_1", "down_2", "down_3", "down_4")


def check_features(features: Sequence[int]) -> tuple[int, ...]:
    feats = tuple(int(f) for f in features)
    if len(feats) != 6 or any(f <= 0 for f in feats):
        raise ValueError(
            f"features={list(features)!r}: a U-Net needs 6 positive channel counts "
            f"(5 encoder levels + last decoder level), e.g. {list(PAPER_FEATURES)}"
        )
    return feats


def require_unet_args(component: str, features: object, image_size: object) -> None:
    """The U-Net arguments every ACDC executor shares: 6 channel counts and a size the 4 poolings divide."""
    try:
        check_features(features)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{component}: {e}") from None
    require(isinstance(image_size, int) and image_size >= 16 and image_size % 16 == 0, component, "image_size",
            image_size, "use a multiple of 16 (the U-Net pools 4 times), paper: 192")


def build_unet(
    features: Sequence[int] = PAPER_FEATURES, in_channels: int = 1, out_channels: int = 4, dropout: float = 0.0
) -> BasicUNet:
    """The segmentation network: MONAI BasicUNet in 2D (4 classes for ACDC: bg, RV, MYO, LV)."""
    return BasicUNet(
        spatial_dims=2,
        in_channels=in_channels,
        out_channels=out_channels,
        features=check_features(features),
        dropout=dropout,
    )


class UNet2D(BasicUNet):
    """``BasicUNet`` in 2D with JSON-friendly arguments, as a FLARE persistor model component."""

    def __init__(self, features: Sequence[int] = PAPER_FEATURES, in_channels: int = 1, out_channels: int = 4,
                 seed: int | None = 0):
        with seeded(seed):
            super().__init__(spatial_dims=2, in_channels=in_channels, out_channels=out_channels,
                             features=check_features(features))
        self.seed = seed
        self.features = list(features)
        self.in_channels = in_channels
        self.out_channels = out_channels


class UNetEncoder(nn.Module):
    """The contracting path of ``BasicUNet``; returns the deepest feature map ``[B, C4, H/16, W/16]``."""

    def __init__(self, features: Sequence[int] = PAPER_FEATURES, in_channels: int = 1):
        super().__init__()
        unet = build_unet(features, in_channels=in_channels, out_channels=1)
        for name in ENCODER_MODULES:
            setattr(self, name, getattr(unet, name))
        self.out_channels = check_features(features)[4]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_0(x)
        for name in ENCODER_MODULES[1:]:
            x = getattr(self, name)(x)
        return x


#: side of the grid the projection head pools the bottleneck to (see :class:`ContrastiveNet`)
POOL_GRID = 2


def pool_bottleneck(h: torch.Tensor) -> torch.Tensor:
    """``[B, C, h, w]`` bottleneck -> ``[B, C * POOL_GRID^2]``: average-pooled to a ``POOL_GRID x POOL_GRID`` grid
    and flattened (the layout survives instance normalisation; a global average does not)."""
    return F.adaptive_avg_pool2d(h, POOL_GRID).flatten(1)


class ContrastiveNet(nn.Module):
    """Encoder + projection head -> L2-normalised feature vector (the MoCo query/key network).

    Head as in MoCo v2 / Chaitanya et al. 2020 (pool, Linear-ReLU-Linear), with the bottleneck pooled to a
    ``POOL_GRID x POOL_GRID`` grid (:func:`pool_bottleneck`) instead of one global average: MONAI's U-Net ends every
    block with instance normalisation, so each channel of the bottleneck has zero mean and unit variance per image
    and its global average hardly depends on the input.  Measured on synthetic ACDC slices at the quick profile,
    random init: the spread of L2-normalised globally pooled features was 0.005 (0.06 of the 1/sqrt(D) reference:
    near collapse before any training); pooled on a 2 x 2 grid, 0.017 (0.39 of its reference).
    """

    def __init__(self, features: Sequence[int] = PAPER_FEATURES, proj_dim: int = 128, in_channels: int = 1,
                 normalize: bool = True):
        super().__init__()
        if int(proj_dim) <= 0:
            raise ValueError(f"proj_dim={proj_dim!r}: must be a positive integer (paper: 128)")
        self.encoder = UNetEncoder(features, in_channels)
        c = self.encoder.out_channels
        self.head = nn.Sequential(nn.Linear(c * POOL_GRID**2, c), nn.ReLU(inplace=True), nn.Linear(c, int(proj_dim)))
        self.normalize = normalize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = pool_bottleneck(self.encoder(x))  # [B, C4 * POOL_GRID^2]
        z = self.head(h)  # [B, proj_dim]
        return F.normalize(z, dim=1) if self.normalize else z


class MoCoUNetEncoder(nn.Module):
    """The FCL global model: MoCo main network and momentum network (FCL (Wu et al., MedIA 2022), Fig. 2).

    Both are federated (FedAvg by sample count of main *and* momentum encoders, SPEC "FCL"), so the
    FLARE persistor holds this whole module: keys ``main.*`` and ``momentum.*``.
    """

    def __init__(self, features: Sequence[int] = PAPER_FEATURES, proj_dim: int = 128, in_channels: int = 1,
                 seed: int | None = 0):
        super().__init__()
        self.features = list(features)
        self.proj_dim = proj_dim
        self.in_channels = in_channels
        self.seed = seed
        with seeded(seed):
            self.main = ContrastiveNet(features, proj_dim, in_channels)
            self.momentum = ContrastiveNet(features, proj_dim, in_channels)
        self.momentum.load_state_dict(self.main.state_dict())
        for p in self.momentum.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x)


class BYOLUNetEncoder(nn.Module):
    """The FCLOpt / FedBYOL global model (FCL (Wu et al., MedIA 2022) section 4.3): online network (U-Net encoder +
    projector), predictor, and target network (encoder + projector, EMA of the online one).  Keys ``online.*``,
    ``predictor.*`` and ``target.*``; ``target.X`` pairs with ``online.X`` (PTNU / DP distances)."""

    def __init__(self, features: Sequence[int] = PAPER_FEATURES, proj_dim: int = 128, pred_hidden: int = 512,
                 in_channels: int = 1, seed: int | None = 0):
        super().__init__()
        self.features = list(features)
        self.proj_dim = proj_dim
        self.pred_hidden = pred_hidden
        self.in_channels = in_channels
        self.seed = seed
        with seeded(seed):
            self.online = ContrastiveNet(features, proj_dim, in_channels, normalize=False)
            self.predictor = nn.Sequential(nn.Linear(proj_dim, pred_hidden), nn.BatchNorm1d(pred_hidden),
                                           nn.ReLU(inplace=True), nn.Linear(pred_hidden, proj_dim))
            self.target = ContrastiveNet(features, proj_dim, in_channels, normalize=False)
        self.target.load_state_dict(self.online.state_dict())
        for p in self.target.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.predictor(self.online(x))


ENCODER_PREFIXES = ("main.encoder.", "online.encoder.")


def encoder_state_from_global(global_state: Mapping[str, object], prefix: str | None = None) -> dict:
    """Cut the learned encoder out of a pre-training global state dict (keys without the prefix): the MoCo
    main encoder (FCL, FedMoCo) or the BYOL online encoder (FCLOpt, FedBYOL)."""
    if prefix is None:
        prefix = next((p for p in ENCODER_PREFIXES if any(k.startswith(p) for k in global_state)), ENCODER_PREFIXES[0])
    enc = {k[len(prefix) :]: v for k, v in global_state.items() if k.startswith(prefix)}
    if not enc:
        sample = sorted(global_state)[:3]
        raise ValueError(
            f"no key starts with {prefix!r} in the pre-trained model (first keys: {sample}); "
            "pass the global model of an FCL/FedMoCo pre-training run (FL_global_model.pt)"
        )
    return enc


def load_encoder_into_unet(unet: BasicUNet, encoder_state: Mapping[str, object]) -> None:
    """Load a pre-trained encoder 1:1 into a U-Net; every encoder key must match by name and shape."""
    own = unet.state_dict()
    expected = {k for k in own if k.split(".", 1)[0] in ENCODER_MODULES}
    given = set(encoder_state)
    if given != expected:
        missing, extra = sorted(expected - given)[:5], sorted(given - expected)[:5]
        raise ValueError(
            f"pre-trained encoder does not match the U-Net: missing {missing}, unexpected {extra}; "
            "use the same `features` for pre-training and fine-tuning"
        )
    for k in expected:
        v = torch.as_tensor(encoder_state[k])
        if tuple(v.shape) != tuple(own[k].shape):
            raise ValueError(
                f"pre-trained encoder key {k!r} has shape {tuple(v.shape)} but the U-Net expects "
                f"{tuple(own[k].shape)}; use the same `features` for pre-training and fine-tuning"
            )
        own[k] = v.to(own[k].dtype)
    unet.load_state_dict(own)
