"""2D U-Net (MONAI ``BasicUNet``) and its encoder, shared by FCL pre-training and fine-tuning.

FCL (FCL (Wu et al., MedIA 2022), section 3.1) pre-trains the *encoder* of a standard 2D U-Net (first level 48 channels)
and then loads it 1:1 into the U-Net for segmentation.  ``UNetEncoder`` owns exactly the encoder
modules of ``monai.networks.nets.BasicUNet`` under the same attribute names (``conv_0``,
``down_1`` ... ``down_4``), so ``UNetEncoder.state_dict()`` loads into a ``BasicUNet`` with every
encoder key matched and nothing renamed (BatchNorm running statistics included).

The network of the reference code (issue 44, hypothesis 1).  FCL builds on Chaitanya et al., "Contrastive learning
of global and local features for medical image segmentation with limited annotations" (NeurIPS 2020), whose public
code is krishnabits001/domain_specific_cl (files ``models.py`` and ``layers_bn.py`` at commit e5aae80; line numbers
below are of that commit).  Two of its choices are switches here, the reference's being the default:

* ``norm`` (:data:`NORMS`): ``"batch"`` puts batch normalisation after every convolution, between the bias and the
  activation, as the reference does in every encoder (and decoder) convolution (``models.py`` 98-129:
  ``conv2d_layer(..., use_batch_norm=True)``; ``layers_bn.py`` 58-65: bias, then ``batch_norm_layer``, then the
  activation; MONAI's ``Convolution`` orders norm, dropout, activation the same way).  ``"instance"`` is MONAI's
  default ``("instance", {"affine": True})``, the bundle's network before issue 44.  See :func:`norm_spec` for
  the batch-norm constants.
* ``head`` (:data:`HEADS`) of :class:`ContrastiveNet`: ``"flatten"`` is the reference's projection head,
  see :class:`ContrastiveNet`; ``"grid"`` pools the bottleneck to a 2 x 2 grid (the bundle's head before issue 44).

Not made to follow the reference: the activation (the reference's ReLU, ``layers_bn.py`` 64-65; BasicUNet's
LeakyReLU 0.1 is kept), the depth (the reference pools five times with 16-128 channels, ``models.py`` 98-129 and 140;
FCL's U-Net pools four times with 48-768) and the initialisation.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F
from monai.networks.nets import BasicUNet
from torch import nn

from fedssl.core.checks import require
from fedssl.core.fedclf import ROTATIONS
from fedssl.models.seeding import seeded

#: Paper setting: standard U-Net, first level 48 channels, doubling per level (Ronneberger et al.).
PAPER_FEATURES: tuple[int, ...] = (48, 96, 192, 384, 768, 48)
#: Tiny twin for unit tests.
TINY_FEATURES: tuple[int, ...] = (4, 4, 8, 8, 16, 4)
#: Paper setting: slices of 192 x 192 px (FCL sec. 5; the reference's ACDC size too, experiment_init/init_acdc.py 16-17)
PAPER_IMAGE_SIZE = 192

#: the U-Net's normalisation (module docstring); the first is the default, the reference's
NORMS: tuple[str, ...] = ("batch", "instance")
#: the projection head of :class:`ContrastiveNet`; the first is the default, the reference's
HEADS: tuple[str, ...] = ("flatten", "grid")

#: BatchNorm eps: the reference's ``epsilon=1e-3`` (layers_bn.py 177, used at 223)
BN_EPS = 1e-3
#: BatchNorm running-average momentum (PyTorch's: the weight of the new batch).  The reference averages with
#: ``moving_average_decay=0.99`` (layers_bn.py 177, 214), i.e. momentum 0.01, over 10,001 iterations of pre-training and
#: of fine-tuning (train_model/*.py ``--n_iter`` default 10001), after which nothing of the average's start remains
#: (0.99^10001).  The bundle's shortest schedules are far shorter (bench fine-tuning at N = 1: 140 steps, where 0.01
#: would leave 0.99^140 = 25 % of the start in the statistics that evaluation uses, and random init's start is
#: mean 0 / variance 1 while a pre-trained encoder's is its pre-training's: an artefact in favour of pre-training).
#: PyTorch's default 0.1 leaves 0.9^140 = 4e-7: converged, as in the reference at its length.
BN_MOMENTUM = 0.1
#: the ACDC pre-training objectives of :class:`MoCoUNetEncoder` (FCL sec. 5 "Baselines"): "fcl" (MoCo's networks:
#: FCL, FedMoCo, Local CL; the default), "rotation" (FedRotation, Gidaris et al. 2018), "simclr" (FedSimCLR, Chen et
#: al. 2020)
OBJECTIVES: tuple[str, ...] = ("fcl", "rotation", "simclr")
#: the width of the reference's projection head: flatten -> dense 1024 (ReLU, no bias) -> dense 128 (no activation,
#: no bias), models.py 155-158
FLATTEN_HIDDEN = 1024


def norm_spec(norm: str) -> tuple[str, dict]:
    """MONAI's ``norm`` argument for the U-Net's normalisation ``norm`` (one of :data:`NORMS`).

    ``"batch"``: ``BatchNorm2d`` with a learnt scale and shift (the reference's ``gamma`` and ``beta``, layers_bn.py
    206-211: ``affine=True``), batch statistics in training and running averages in evaluation (layers_bn.py
    221-222: ``tf.cond(training, ...)``; PyTorch's ``train()`` / ``eval()``), :data:`BN_EPS` and
    :data:`BN_MOMENTUM`.  ``"instance"``: MONAI BasicUNet's default, ``InstanceNorm2d(affine=True)``."""
    if norm == "batch":
        return ("batch", {"eps": BN_EPS, "momentum": BN_MOMENTUM, "affine": True})
    if norm == "instance":
        return ("instance", {"affine": True})
    raise ValueError(f"norm={norm!r}: use one of {list(NORMS)}")


def require_norm(component: str, norm: object) -> None:
    require(norm in NORMS, component, "norm", norm,
            "use \"batch\" (BatchNorm after every convolution, the reference code's, Chaitanya et al. 2020) or "
            "\"instance\" (MONAI's InstanceNorm, the bundle's network before issue 44)")


def require_head(component: str, head: object) -> None:
    require(head in HEADS, component, "head", head,
            "use \"flatten\" (the reference code's flatten -> 1024 -> proj_dim) or \"grid\" (2 x 2 average pool "
            "-> C4 -> proj_dim)")


def require_objective(component: str, objective: object) -> None:
    require(objective in OBJECTIVES, component, "objective", objective,
            f"use one of {list(OBJECTIVES)} (FCL / FedMoCo / Local CL, FedRotation, FedSimCLR), set with "
            "shape.objective so that the server's model and the sites agree")


def require_image_size(component: str, image_size: object) -> None:
    require(isinstance(image_size, int) and not isinstance(image_size, bool) and image_size >= 16
            and image_size % 16 == 0, component, "image_size", image_size,
            "use a multiple of 16 (the U-Net pools 4 times), paper: 192")


ENCODER_MODULES: tuple[str, ...] = ("conv_0", "down_1", "down_2", "down_3", "down_4")


def check_features(features: Sequence[int]) -> tuple[int, ...]:
    feats = tuple(int(f) for f in features)
    if len(feats) != 6 or any(f <= 0 for f in feats):
        raise ValueError(
            f"features={list(features)!r}: a U-Net needs 6 positive channel counts "
            f"(5 encoder levels + last decoder level), e.g. {list(PAPER_FEATURES)}"
        )
    return feats


def require_unet_args(component: str, features: object, image_size: object, norm: object = NORMS[0],
                      head: object = HEADS[0]) -> None:
    """The U-Net arguments every ACDC executor shares: 6 channel counts, a size the 4 poolings divide, the
    normalisation and (pre-training) the projection head."""
    try:
        check_features(features)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{component}: {e}") from None
    require_image_size(component, image_size)
    require_norm(component, norm)
    require_head(component, head)


def build_unet(
    features: Sequence[int] = PAPER_FEATURES, in_channels: int = 1, out_channels: int = 4, dropout: float = 0.0,
    norm: str = NORMS[0],
) -> BasicUNet:
    """The segmentation network: MONAI BasicUNet in 2D (4 classes for ACDC: bg, RV, MYO, LV), normalised by
    ``norm`` (:func:`norm_spec`) after every convolution of the encoder and the decoder."""
    require_norm("build_unet", norm)
    return BasicUNet(
        spatial_dims=2,
        in_channels=in_channels,
        out_channels=out_channels,
        features=check_features(features),
        dropout=dropout,
        norm=norm_spec(norm),
    )


def unet_norm(module: nn.Module) -> str:
    """The normalisation a built U-Net (or encoder) uses: "batch" when it holds a ``BatchNorm2d``."""
    return "batch" if any(isinstance(m, nn.BatchNorm2d) for m in module.modules()) else "instance"


def state_norm(state: Mapping[str, object]) -> str:
    """The normalisation of a U-Net or encoder state dict: "batch" when it carries BatchNorm running statistics."""
    return "batch" if any(str(k).endswith(".running_mean") for k in state) else "instance"



def unset_batch_norms(module: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """The BatchNorm layers of ``module`` that never normalised a batch in training (``num_batches_tracked`` 0):
    a network at its random start, whose running statistics are BatchNorm's initial mean 0 and variance 1."""
    return [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
            and m.num_batches_tracked is not None and int(m.num_batches_tracked) == 0]


@torch.no_grad()
def fill_batch_statistics(module: nn.Module, inputs: Iterable[torch.Tensor],
                          forward: Callable[[torch.Tensor], object] | None = None) -> int:
    """Give the unset BatchNorm layers of ``module`` (:func:`unset_batch_norms`) the statistics of ``inputs``, in
    place: ``forward`` (default ``module``) runs on every input with only those layers in training mode, each
    averaging the batches' statistics with equal weights (momentum None); then their momentum and every module's
    mode are restored.  Returns the number of layers filled (0: nothing to do, nothing run).

    Evaluation-mode features of a random network with BatchNorm would otherwise normalise by mean 0 and variance 1,
    i.e. not at all, and fade to nearly one vector whatever the input: a random baseline beside a pre-trained
    encoder (whose layers carry their pre-training's statistics) must not be measured that way.  A pre-trained
    layer keeps its own statistics."""
    unset = unset_batch_norms(module)
    if not unset:
        return 0
    modes = {m: m.training for m in module.modules()}
    momenta = [m.momentum for m in unset]
    module.eval()
    for m in unset:
        m.momentum = None
        m.train()
    try:
        for x in inputs:
            (forward or module)(x)
    finally:
        for m, momentum in zip(unset, momenta):
            m.momentum = momentum
        for m, mode in modes.items():
            m.train(mode)
    return len(unset)


class UNet2D(BasicUNet):
    """``BasicUNet`` in 2D with JSON-friendly arguments, as a FLARE persistor model component; ``norm`` as
    :func:`build_unet`."""

    def __init__(self, features: Sequence[int] = PAPER_FEATURES, in_channels: int = 1, out_channels: int = 4,
                 seed: int | None = 0, norm: str = NORMS[0]):
        require_norm(type(self).__name__, norm)
        with seeded(seed):
            super().__init__(spatial_dims=2, in_channels=in_channels, out_channels=out_channels,
                             features=check_features(features), norm=norm_spec(norm))
        self.seed = seed
        self.features = list(features)
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.norm = norm


class UNetEncoder(nn.Module):
    """The contracting path of ``BasicUNet``; returns the deepest feature map ``[B, C4, H/16, W/16]``."""

    def __init__(self, features: Sequence[int] = PAPER_FEATURES, in_channels: int = 1, norm: str = NORMS[0]):
        super().__init__()
        require_norm(type(self).__name__, norm)
        unet = build_unet(features, in_channels=in_channels, out_channels=1, norm=norm)
        for name in ENCODER_MODULES:
            setattr(self, name, getattr(unet, name))
        self.out_channels = check_features(features)[4]
        self.norm = norm

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

    ``head="flatten"`` (the default) is the reference code's head (Chaitanya et al. 2020, krishnabits001/
    domain_specific_cl ``models.py`` 155-158: ``tf.layers.flatten(enc_c6_b)``, ``dense(units=1024,
    activation=relu, use_bias=False)``, ``dense(units=128, activation=None, use_bias=False)``): the whole last
    encoder feature map flattened, ``Linear(C4 * (image_size / 16)^2, 1024, bias=False)`` - ReLU -
    ``Linear(1024, proj_dim, bias=False)``.  The reference flattens its full bottleneck, not a pooled one; so does
    this head, whatever its size.  Its bottleneck is small (6 x 6 x 128 = 4,608 inputs at 192 px: five poolings, 128
    channels; the comment's "flat -> 3200" at line 154 is stale), FCL's U-Net's is not: 12 x 12 x 768 = 110,592
    inputs at the paper's 192 px and 48 channels, a first layer of 113 M weights (the bench's 64 px and 8 channels:
    4 x 4 x 128 = 2,048 inputs, 2.1 M weights).  The flattened map keeps where in the slice a feature is, which
    FCL's partition positives and MoCo's instance positives both need, at any normalisation.  ``image_size`` fixes
    the first layer's width, so a flatten head takes only inputs of that size.

    ``head="grid"`` (the bundle's head before issue 44): the bottleneck average-pooled to a ``POOL_GRID x POOL_GRID``
    grid (:func:`pool_bottleneck`) instead of one global average, ``Linear(C4 * 4, C4)`` - ReLU -
    ``Linear(C4, proj_dim)`` (with biases, as MoCo v2): with instance normalisation each channel of the bottleneck
    has zero mean and unit variance per image and its global average hardly depends on the input.  Measured on
    synthetic ACDC slices at the quick profile, random init: the spread of L2-normalised globally pooled features
    was 0.005 (0.06 of the 1/sqrt(D) reference: near collapse before any training); pooled on a 2 x 2 grid, 0.017
    (0.39 of its reference).

    Either head's layers are ``head.0`` and ``head.2`` (the same keys).  ``norm``: the encoder's, as
    :func:`build_unet`.
    """

    def __init__(self, features: Sequence[int] = PAPER_FEATURES, proj_dim: int = 128, in_channels: int = 1,
                 normalize: bool = True, *, norm: str = NORMS[0], head: str = HEADS[0],
                 image_size: int = PAPER_IMAGE_SIZE):
        super().__init__()
        name = type(self).__name__
        if int(proj_dim) <= 0:
            raise ValueError(f"proj_dim={proj_dim!r}: must be a positive integer (paper: 128)")
        require_head(name, head)
        require_image_size(name, image_size)
        self.encoder = UNetEncoder(features, in_channels, norm=norm)
        c = self.encoder.out_channels
        if head == "flatten":
            inputs = c * (image_size // 16) ** 2
            self.head = nn.Sequential(nn.Linear(inputs, FLATTEN_HIDDEN, bias=False), nn.ReLU(inplace=True),
                                      nn.Linear(FLATTEN_HIDDEN, int(proj_dim), bias=False))
        else:
            self.head = nn.Sequential(nn.Linear(c * POOL_GRID**2, c), nn.ReLU(inplace=True),
                                      nn.Linear(c, int(proj_dim)))
        self.normalize = normalize
        self.norm, self.head_kind, self.image_size = norm, head, int(image_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x)  # [B, C4, H/16, W/16]
        if self.head_kind == "grid":
            h = pool_bottleneck(h)  # [B, C4 * POOL_GRID^2]
        else:
            h = h.flatten(1)  # [B, C4 * (H/16) * (W/16)]
            if h.shape[1] != self.head[0].in_features:
                raise ValueError(f"{type(self).__name__}(head='flatten') was built for {self.image_size} x "
                                 f"{self.image_size} px inputs; got {tuple(x.shape[-2:])}: build it with that "
                                 "image_size")
        z = self.head(h)  # [B, proj_dim]
        return F.normalize(z, dim=1) if self.normalize else z


def contrastive_net_like(state: Mapping[str, object], normalize: bool = True) -> ContrastiveNet:
    """A :class:`ContrastiveNet` shaped as the network of ``state`` (its ``encoder.*`` / ``head.*`` keys: the
    prefix-stripped MoCo main or BYOL online network of a pre-training global model), with ``state`` loaded: the
    channels, ``proj_dim``, norm (:func:`state_norm`) and head (the flatten head has no biases) read from it."""
    own = {str(k): torch.as_tensor(v) for k, v in state.items()}
    enc = {k[len("encoder."):]: v for k, v in own.items() if k.startswith("encoder.")}
    convs = [f"{m}.{'' if m == 'conv_0' else 'convs.'}conv_{i}.conv.weight" for m in ENCODER_MODULES for i in (0, 1)]
    if not all(k in enc for k in convs) or "head.0.weight" not in own or "head.2.weight" not in own:
        raise ValueError(f"not the state of a ContrastiveNet (first keys: {sorted(own)[:3]}); pass the main.* or "
                         "online.* keys of a pre-training global model without their prefix")
    features = [int(enc[k].shape[0]) for k in convs[1::2]] + [int(enc[convs[1]].shape[0])]
    head = "grid" if "head.0.bias" in own else "flatten"
    c4, inputs = features[4], int(own["head.0.weight"].shape[1])
    side = round((inputs / c4) ** 0.5)
    net = ContrastiveNet(features, int(own["head.2.weight"].shape[0]), int(enc[convs[0]].shape[1]), normalize,
                         norm=state_norm(enc), head=head, image_size=16 * side if head == "flatten" else 16)
    net.load_state_dict(own)
    return net


class RotationNet(nn.Module):
    """FedRotation's network (FCL (Wu et al., MedIA 2022) sec. 5 "Baselines": Rotation, Gidaris et al., ICLR 2018):
    the U-Net encoder (``encoder.*``, the same modules as :class:`ContrastiveNet`'s, so fine-tuning loads it
    unchanged) and a linear classifier of the 4 rotations (``classifier.*``) on the globally average-pooled
    bottleneck, as RotNet's own head (gidariss/FeatureLearningRotNet ``architectures/NetworkInNetwork.py``:
    ``GlobalAveragePooling`` then ``nn.Linear(nChannels, num_classes)``, with a bias).  ``forward``: the rotation
    logits ``[B, 4]``."""

    def __init__(self, features: Sequence[int] = PAPER_FEATURES, in_channels: int = 1, *, norm: str = NORMS[0]):
        super().__init__()
        self.encoder = UNetEncoder(features, in_channels, norm=norm)
        self.classifier = nn.Linear(self.encoder.out_channels, ROTATIONS)
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x)  # [B, C4, H/16, W/16]
        return self.classifier(h.mean(dim=(2, 3)))  # [B, 4]


class MoCoUNetEncoder(nn.Module):
    """The ACDC pre-training global model: by default (``objective="fcl"``) FCL's MoCo main network and momentum
    network (FCL (Wu et al., MedIA 2022), Fig. 2); the baselines of sec. 5 "Baselines" that share the job
    (:data:`OBJECTIVES`) hold only what they train, under ``main.*``:

    * ``"fcl"`` (FCL, FedMoCo, Local CL): ``main.*`` and ``momentum.*``, two :class:`ContrastiveNet`;
    * ``"simclr"`` (FedSimCLR): ``main.*``, one :class:`ContrastiveNet` (encoder + projection head), no momentum
      network;
    * ``"rotation"`` (FedRotation): ``main.*``, a :class:`RotationNet` (encoder + 4-way rotation classifier).

    ``main.encoder.*`` is the U-Net encoder in every case (:func:`encoder_state_from_global`), built first from the
    same seed, so every objective starts from the same encoder.

    Both networks of ``"fcl"`` are federated (FedAvg by sample count of main *and* momentum encoders, SPEC "FCL"),
    so the FLARE persistor holds this whole module, BatchNorm running statistics included (``norm="batch"``).
    ``norm``, ``head``, ``image_size``: :class:`ContrastiveNet`'s (``"rotation"`` has no projection head: ``head``
    and ``proj_dim`` are not used).

    Batch normalisation and MoCo's key encoder: MoCo v1 (He et al. 2020, sec. 3.3) shuffles the key batch across
    GPUs so that a query's batch statistics differ from its key's; on one device that shuffle permutes the batch
    within itself and changes nothing (facebookresearch/moco, ``_batch_shuffle_ddp`` over one process).  Here, as
    MoCo's code on one device, the key (momentum) network runs in training mode on its own batch of key views and
    normalises with that batch's statistics (:class:`fedssl.train.fcl.FCLLocalTrainer`); its running statistics
    follow the main network's (:func:`fedssl.core.state_dict.ema_update` copies buffers) and are never used in
    pre-training.  The reference code (Chaitanya et al.) has no key encoder: all views go through one network in
    one batch (models.py 150, ``train_phase`` True).
    """

    def __init__(self, features: Sequence[int] = PAPER_FEATURES, proj_dim: int = 128, in_channels: int = 1,
                 seed: int | None = 0, *, norm: str = NORMS[0], head: str = HEADS[0],
                 image_size: int = PAPER_IMAGE_SIZE, objective: str = OBJECTIVES[0]):
        super().__init__()
        require_objective(type(self).__name__, objective)
        self.features = list(features)
        self.proj_dim = proj_dim
        self.in_channels = in_channels
        self.seed = seed
        self.norm, self.head, self.image_size, self.objective = norm, head, image_size, objective
        shape = dict(norm=norm, head=head, image_size=image_size)
        with seeded(seed):
            if objective == "rotation":
                self.main = RotationNet(features, in_channels, norm=norm)
            else:
                self.main = ContrastiveNet(features, proj_dim, in_channels, **shape)
            if objective == "fcl":
                self.momentum = ContrastiveNet(features, proj_dim, in_channels, **shape)
        if objective == "fcl":
            self.momentum.load_state_dict(self.main.state_dict())
            for p in self.momentum.parameters():
                p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x)


class BYOLUNetEncoder(nn.Module):
    """The FCLOpt / FedBYOL global model (FCL (Wu et al., MedIA 2022) section 4.3): online network (U-Net encoder +
    projector), predictor, and target network (encoder + projector, EMA of the online one).  Keys ``online.*``,
    ``predictor.*`` and ``target.*``; ``target.X`` pairs with ``online.X`` (PTNU / DP distances).  ``norm``,
    ``head``, ``image_size``: :class:`ContrastiveNet`'s (the projector is its head); the target network runs in
    training mode on its own batch, as MoCo's key network (:class:`MoCoUNetEncoder`)."""

    def __init__(self, features: Sequence[int] = PAPER_FEATURES, proj_dim: int = 128, pred_hidden: int = 512,
                 in_channels: int = 1, seed: int | None = 0, *, norm: str = NORMS[0], head: str = HEADS[0],
                 image_size: int = PAPER_IMAGE_SIZE):
        super().__init__()
        self.features = list(features)
        self.proj_dim = proj_dim
        self.pred_hidden = pred_hidden
        self.in_channels = in_channels
        self.seed = seed
        self.norm, self.head, self.image_size = norm, head, image_size
        shape = dict(norm=norm, head=head, image_size=image_size)
        with seeded(seed):
            self.online = ContrastiveNet(features, proj_dim, in_channels, normalize=False, **shape)
            self.predictor = nn.Sequential(nn.Linear(proj_dim, pred_hidden), nn.BatchNorm1d(pred_hidden),
                                           nn.ReLU(inplace=True), nn.Linear(pred_hidden, proj_dim))
            self.target = ContrastiveNet(features, proj_dim, in_channels, normalize=False, **shape)
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
    """Load a pre-trained encoder 1:1 into a U-Net; every encoder key must match by name and shape.  With batch
    normalisation the encoder's running statistics (``running_mean``, ``running_var``, ``num_batches_tracked``)
    are loaded with its weights."""
    own = unet.state_dict()
    expected = {k for k in own if k.split(".", 1)[0] in ENCODER_MODULES}
    given = set(encoder_state)
    if given != expected and state_norm(encoder_state) != unet_norm(unet):
        raise ValueError(
            f"pre-trained encoder has norm {state_norm(encoder_state)!r} but the U-Net norm {unet_norm(unet)!r}; "
            f"fine-tune with norm={state_norm(encoder_state)!r}, the norm of the pre-training"
        )
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
