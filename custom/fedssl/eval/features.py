"""Feature spread of an encoder on a site's data: does it tell inputs apart, or has it collapsed (issue 14 item 4)?

:func:`feature_spread` is the std over a batch of the L2-normalised feature vectors, averaged over the dimensions
(:mod:`fedssl.core.spread`; SimSiam, Chen & He 2021, sec. 4.1), returned with its ``1 / sqrt(D)`` reference (the
value for features spread uniformly on the sphere).  0 means every input maps to one direction: a collapsed
encoder, whose features cannot help a decoder or a head.

What is measured (eval mode, no gradient, BatchNorm running statistics; a network whose BatchNorm layers never saw a
batch, a random start, first gets the statistics of the slices measured, on a copy:
:func:`fedssl.models.unet.fill_batch_statistics`):

* U-Net encoders (FCL, FedMoCo, FCLOpt, FedBYOL, random init): :func:`unet_spread` on every 2D slice of a site's
  volumes: the projection of a ``ContrastiveNet`` (the MoCo main / BYOL online network, what pre-training
  shapes) or, for a bare encoder, the globally average-pooled bottleneck (what fine-tuning receives);
* U-Net projection networks: :func:`unet_discrimination`, instance discrimination in the network's own space
  (:mod:`fedssl.core.discrimination`: two augmented views of every slice, the other patients' slices as negatives);
* U-Net encoders or projections: :func:`unet_position_knn`, whether the features know where a slice sits in the
  heart (its partition, as FCL's pre-training splits a volume), from the nearest slices of other patients;
* ViT encoders (Fed-MAE, Fed-BEiT, scratch): :func:`vit_spread`, the average of the patch tokens of
  ``encoder.forward_features`` over a batch of images.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from fedssl.core.discrimination import Discrimination, instance_discrimination, knn_accuracy
from fedssl.core.spread import normalised_spread, uniform_reference
from fedssl.data.transforms import augment_views
from fedssl.data.volume import Volume
from fedssl.models.unet import fill_batch_statistics, pool_bottleneck, unset_batch_norms


class Spread(NamedTuple):
    """A feature spread and its reference ``1 / sqrt(D)`` (uniform on the sphere); ``n`` feature vectors."""

    value: float
    reference: float
    n: int


def feature_spread(z: torch.Tensor) -> Spread:
    """Spread of the feature batch ``z [B, D]`` (0 = collapsed) with its ``1 / sqrt(D)`` reference."""
    value = normalised_spread(z)
    return Spread(value, uniform_reference(int(z.shape[1])), int(z.shape[0]))


def volume_slices(volumes: Sequence[Volume]) -> torch.Tensor:
    """Every 2D slice of ``volumes`` as ``[S, 1, H, W]`` float32 (labels not needed)."""
    if not volumes:
        raise ValueError("no volumes: the feature spread needs at least one volume of the site")
    return torch.cat([torch.as_tensor(np.ascontiguousarray(v.image), dtype=torch.float32)
                      for v in volumes]).unsqueeze(1)


def with_statistics(model: nn.Module, x: torch.Tensor, batch_size: int, device: str | torch.device) -> nn.Module:
    """``model`` itself, or where it has unset BatchNorm layers (a random start) a copy of it whose layers hold the
    statistics of ``x`` in batches of ``batch_size`` (:func:`fedssl.models.unet.fill_batch_statistics`)."""
    if not unset_batch_norms(model):
        return model
    model = copy.deepcopy(model)
    fill_batch_statistics(model, (x[i:i + batch_size].to(device) for i in range(0, len(x), batch_size)))
    return model


@torch.no_grad()
def _features(fn, model: nn.Module, x: torch.Tensor, batch_size: int, device: str | torch.device) -> torch.Tensor:
    """``fn(model, batch)`` over ``x`` in batches with ``model`` in eval mode (its mode restored afterwards); a
    model with unset BatchNorm layers is measured as :func:`with_statistics` of ``x`` (the caller's model as it
    was)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}: must be a positive integer")
    model = with_statistics(model, x, batch_size, device)
    was_training = model.training
    model.eval()
    try:
        return torch.cat([fn(model, x[i:i + batch_size].to(device)).float().cpu()
                          for i in range(0, len(x), batch_size)])
    finally:
        model.train(was_training)


def _unet_pooled(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)  # a ContrastiveNet: the projection [B, D]; a bare encoder: the bottleneck [B, C4, h, w]
    return out if out.dim() == 2 else pool_bottleneck(out)  # as the grid head pools it, whatever the head


def unet_features(model: nn.Module, volumes: Sequence[Volume], *, batch_size: int = 64,
                  device: str | torch.device = "cpu") -> torch.Tensor:
    """Features ``[S, D]`` of every slice of ``volumes``: the projection of a ``ContrastiveNet``
    (``MoCoUNetEncoder.main`` / ``BYOLUNetEncoder.online``) or the bottleneck of a ``UNetEncoder`` pooled to the grid
    head's 2 x 2 grid (``pool_bottleneck``, one size whatever the pre-training's head)."""
    return _features(_unet_pooled, model, volume_slices(volumes), batch_size, device)


def unet_spread(model: nn.Module, volumes: Sequence[Volume], *, batch_size: int = 64,
                device: str | torch.device = "cpu") -> Spread:
    """Spread of a U-Net encoder's :func:`unet_features` over every slice of ``volumes``."""
    return feature_spread(unet_features(model, volumes, batch_size=batch_size, device=device))


def unet_discrimination(net: nn.Module, volumes: Sequence[Volume], *, tau: float = 0.1, max_inputs: int = 400,
                        seed: int = 0, batch_size: int = 64, device: str | torch.device = "cpu") -> Discrimination:
    """Instance discrimination (:func:`fedssl.core.discrimination.instance_discrimination`) of a ``ContrastiveNet``
    (MoCo main / BYOL online network) on the slices of ``volumes``: two views of each slice drawn with the
    pre-training's augmentation (``augment_views``) from a generator seeded with ``seed`` (the same views for every
    network measured with the same seed), negatives the slices of other patients (``Volume.patient_id``).  At most
    ``max_inputs`` slices, evenly spaced over the site's slices in volume order."""
    if isinstance(max_inputs, bool) or not isinstance(max_inputs, int) or max_inputs < 2:
        raise ValueError(f"max_inputs={max_inputs!r}: must be an integer >= 2 (slices to discriminate between)")
    x, groups = volume_slices(volumes), slice_partitions(volumes)[1]
    if len(x) > max_inputs:
        pick = torch.linspace(0, len(x) - 1, max_inputs).round().long()
        x, groups = x[pick], groups[pick]
    g = torch.Generator().manual_seed(int(seed))
    view1, view2 = augment_views(x, g), augment_views(x, g)
    net = with_statistics(net, x, batch_size, device)  # both views measured with the same statistics
    z1 = _features(_unet_pooled, net, view1, batch_size, device)
    z2 = _features(_unet_pooled, net, view2, batch_size, device)
    return instance_discrimination(z1, z2, tau, groups)


def slice_partitions(volumes: Sequence[Volume], n_partitions: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """For every slice of ``volumes`` (in :func:`volume_slices` order): its partition, as FCL's pre-training splits a
    volume (``np.array_split`` of the slice indices into ``n_partitions``,
    :class:`fedssl.data.acdc.PartitionSampleDataset`), and its patient's index."""
    if isinstance(n_partitions, bool) or not isinstance(n_partitions, int) or n_partitions < 2:
        raise ValueError(f"n_partitions={n_partitions!r}: must be an integer >= 2 (FCL: 4)")
    patients = sorted({v.patient_id for v in volumes})
    part, pat = [], []
    for v in volumes:
        for i, chunk in enumerate(np.array_split(np.arange(v.image.shape[0]), n_partitions)):
            part += [i] * len(chunk)
            pat += [patients.index(v.patient_id)] * len(chunk)
    return torch.tensor(part), torch.tensor(pat)


def unet_position_knn(model: nn.Module, volumes: Sequence[Volume], *, n_partitions: int = 4, k: int = 5,
                      batch_size: int = 64, device: str | torch.device = "cpu") -> float:
    """Accuracy of a slice's partition (:func:`slice_partitions`) from the ``k`` nearest slices of other patients in
    ``model``'s :func:`unet_features` (:func:`fedssl.core.discrimination.knn_accuracy`); about ``1 / n_partitions``
    for features that do not know the position."""
    part, patient = slice_partitions(volumes, n_partitions)
    return knn_accuracy(unet_features(model, volumes, batch_size=batch_size, device=device), part, patient, k)


def _vit_pooled(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    enc = model.encoder
    tokens = enc.forward_features(x)  # [B, prefix + L, D]
    return tokens[:, enc.num_prefix_tokens:].mean(dim=1)


def vit_features(model: nn.Module, images: torch.Tensor, *, batch_size: int = 64,
                 device: str | torch.device = "cpu") -> torch.Tensor:
    """The average of the patch tokens (class token excluded, as the classifier pools) of a ViT encoder
    (``model.encoder``, a timm VisionTransformer: MAEViT, BEiTViT, ViTClassifier) for ``images [N, 3, H, W]``."""
    if not isinstance(getattr(model, "encoder", None), nn.Module):
        raise ValueError(f"{type(model).__name__} has no ViT 'encoder'; pass an MAEViT, BEiTViT or ViTClassifier")
    return _features(_vit_pooled, model, images, batch_size, device)


def vit_spread(model: nn.Module, images: torch.Tensor, *, batch_size: int = 64,
               device: str | torch.device = "cpu") -> Spread:
    """Spread of a ViT encoder's :func:`vit_features` over ``images [N, 3, H, W]``."""
    return feature_spread(vit_features(model, images, batch_size=batch_size, device=device))
