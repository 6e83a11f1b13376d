"""The 3D segmentation network: MONAI's ``DynUNet`` with kernels and strides planned for anisotropic voxels.

:func:`plan_dynunet` follows nnU-Net's rule (Isensee et al., Nature Methods 2021): an axis is downsampled only while
its voxel spacing is at most twice the finest spacing, and while the patch along it stays at least 4 voxels; a
kernel is 3 wide along an axis whose spacing is at most twice the finest, 1 otherwise.  For ACDC's short-axis
stacks (1.25 x 1.25 x 10 mm) the first levels therefore convolve and pool in-plane only, until the in-plane
spacing has caught up with the 10 mm slices.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from monai.networks.nets import DynUNet
from torch import nn

from fedssl.core.checks import require
from fedssl.models.seeding import seeded

#: filters per level: "paper" as nnU-Net's 3D full-resolution network (32 doubling, capped at 320), "tiny" for CPUs
PRESETS: dict[str, tuple[int, ...]] = {"paper": (32, 64, 128, 256, 320, 320), "small": (16, 32, 64, 128, 256),
                                       "tiny": (8, 16, 32, 64)}
#: the modules of the encoder (what a pre-trained encoder may initialise)
ENCODER_PREFIXES = ("input_block.", "downsamples.", "bottleneck.")


def plan_dynunet(pixdim: Sequence[float], roi_size: Sequence[int], levels: int) -> tuple[list, list]:
    """(kernel sizes, strides) per level for voxels of ``pixdim`` mm and patches of ``roi_size`` voxels."""
    spacing, size = [float(p) for p in pixdim], [int(r) for r in roi_size]
    kernels, strides = [], []
    for level in range(levels):
        finest = min(spacing)
        if level == 0:
            stride = [1, 1, 1]
        else:
            stride = [2 if sp <= 2 * finest and sz // 2 >= 4 else 1 for sp, sz in zip(spacing, size)]
            spacing = [sp * st for sp, st in zip(spacing, stride)]
            size = [sz // st for sz, st in zip(size, stride)]
        finest = min(spacing)
        kernels.append([3 if sp <= 2 * finest else 1 for sp in spacing])
        strides.append(stride)
    return kernels, strides


def check_dynunet_args(component: str, filters: object, pixdim: object, roi_size: object, num_classes: object) -> None:
    require(isinstance(filters, (list, tuple)) and len(filters) >= 2
            and all(isinstance(f, int) and f >= 1 for f in filters),
            component, "filters", filters, "use a list of >= 2 channel counts, one per level, e.g. [8, 16, 32, 64]")
    require(isinstance(pixdim, (list, tuple)) and len(pixdim) == 3
            and all(isinstance(p, (int, float)) and p > 0 for p in pixdim),
            component, "pixdim", pixdim, "use three voxel sizes in mm, e.g. [1.25, 1.25, 10.0]")
    require(isinstance(roi_size, (list, tuple)) and len(roi_size) == 3
            and all(isinstance(r, int) and r >= 4 for r in roi_size),
            component, "roi_size", roi_size, "use three patch sizes in voxels (>= 4), e.g. [160, 160, 16]")
    require(isinstance(num_classes, int) and num_classes >= 1, component, "num_classes", num_classes,
            "use the number of foreground classes (ACDC 3, HVSMR 2)")
    _, strides = plan_dynunet(pixdim, roi_size, len(filters))
    for axis in range(3):
        factor = 1
        for s in strides:
            factor *= s[axis]
        require(roi_size[axis] % factor == 0, component, "roi_size", roi_size,
                f"axis {axis} is downsampled {factor}x: make its patch size a multiple of {factor}")


class DynUNet3D(DynUNet):
    """DynUNet (1 channel in, background + ``num_classes`` out; instance norm, residual blocks, no deep
    supervision) with kernels and strides from :func:`plan_dynunet`, JSON-friendly arguments, usable as the
    server persistor's model component.  ``encoder_path``: a state-dict or FLARE model file of a DynUNet with
    the same filters / pixdim / roi_size whose encoder initialises this one (fine-tuning from a pre-trained
    3D encoder; ``weights_only`` load); the decoder starts random."""

    def __init__(self, filters: Sequence[int] = PRESETS["paper"], pixdim: Sequence[float] = (1.25, 1.25, 10.0),
                 roi_size: Sequence[int] = (160, 160, 16), num_classes: int = 3, encoder_path: str = "", seed: int = 0):
        check_dynunet_args(type(self).__name__, list(filters), list(pixdim), list(roi_size), num_classes)
        kernels, strides = plan_dynunet(pixdim, roi_size, len(filters))
        with seeded(int(seed)):  # initial weights from ``seed``; torch's global generator is left as it was
            super().__init__(spatial_dims=3, in_channels=1, out_channels=num_classes + 1, kernel_size=kernels,
                             strides=strides, upsample_kernel_size=strides[1:], filters=list(filters),
                             norm_name="instance", res_block=True, deep_supervision=False)
        # DynUNet registers its encoder and decoder blocks twice (``skip_layers.*`` aliases the same modules):
        # the state dict carries each alias once, under its canonical name, so a model message is not doubled
        full = super().state_dict(keep_vars=True)
        canonical = {}
        for k, v in full.items():
            if not k.startswith("skip_layers."):
                canonical.setdefault(id(v), k)
        self._aliases = {k: canonical[id(v)] for k, v in full.items() if k.startswith("skip_layers.")
                         and id(v) in canonical}
        self._register_state_dict_hook(_drop_aliases)
        self.filters, self.pixdim, self.roi_size = list(filters), list(pixdim), list(roi_size)
        self.num_classes, self.encoder_path, self.seed = num_classes, encoder_path, seed
        #: what the run starts from, for the server persistor's INIT_PROP
        self.initial_weights: dict = {"init": "random", "path": "", "sha256": ""}
        if encoder_path:
            from fedssl.core.digest import file_sha256
            from fedssl.models.vit_classifier import read_checkpoint

            load_encoder(self, read_checkpoint(encoder_path), encoder_path)
            self.initial_weights = {"init": "checkpoint", "path": encoder_path, "sha256": file_sha256(encoder_path)}

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Loads a state dict without the ``skip_layers.*`` aliases (as :meth:`state_dict` gives it) or with them."""
        full = dict(state_dict)
        for alias, name in self._aliases.items():
            if alias not in full and name in full:
                full[alias] = full[name]
        return super().load_state_dict(full, strict=strict, assign=assign)

    @property
    def init_fix(self) -> str:
        return "set encoder_path to a pre-trained DynUNet encoder" if self.initial_weights["init"] == "random" else ""


def _drop_aliases(module: "DynUNet3D", state: dict, prefix: str, local_metadata) -> None:
    for alias in module._aliases:
        state.pop(prefix + alias, None)


def build_dynunet(filters: Sequence[int], pixdim: Sequence[float], roi_size: Sequence[int], num_classes: int,
                  seed: int = 0) -> nn.Module:
    """The sites' network: :class:`DynUNet3D` without an encoder file (the server's broadcast sets the weights)."""
    return DynUNet3D(list(filters), list(pixdim), list(roi_size), num_classes, seed=seed)


def load_encoder(model: nn.Module, state: Mapping[str, object], source: str) -> list[str]:
    """Copy the encoder tensors (:data:`ENCODER_PREFIXES`) of ``state`` into ``model``; returns the keys loaded.
    Every encoder key of the model must be present with its shape (ValueError naming ``source`` otherwise);
    decoder keys of ``state`` are ignored."""
    own = model.state_dict()
    keys = [k for k in own if k.startswith(ENCODER_PREFIXES)]
    missing = [k for k in keys if k not in state]
    if missing:
        raise ValueError(f"{source} lacks {len(missing)} encoder tensors of this DynUNet (e.g. {missing[:3]}); it must "
                         "come from a DynUNet with the same filters, pixdim and roi_size")
    loaded = {}
    for k in keys:
        t = torch.as_tensor(state[k])
        if tuple(t.shape) != tuple(own[k].shape):
            raise ValueError(f"{source}: {k} has shape {tuple(t.shape)}, this DynUNet expects {tuple(own[k].shape)}")
        loaded[k] = t.to(own[k].dtype)
    model.load_state_dict(loaded, strict=False)
    return keys
