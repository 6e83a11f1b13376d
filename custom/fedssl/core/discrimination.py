"""Instance discrimination in a network's own feature space: can it tell an input's second view from the others?

A contrastive pre-training's logged loss compares the main network's queries with *stored* keys: MoCo's bank
holds features of a momentum encoder that lags the main one by about ``1 / (1 - m)`` steps (FCL (Wu et al., MedIA
2022) and MoCo (He et al., CVPR 2020) use m = 0.99).  When the main network's features drift faster than that, the
logged loss reads low while the keys point elsewhere, and rises again as the learning rate decays and the momentum
encoder catches up, although the network itself kept improving.  This measure uses fresh features of one network
only, so it reads what the network has learned:

    for two views ``z1, z2 [M, D]`` of M inputs (rows L2-normalised here), row i's positive is ``z2[i]`` and its
    negatives are the ``z2[j]`` whose group differs from row i's (``groups``: e.g. the patient, so that another
    slice or cine frame of the same patient is not counted against it; None = every other row);

    loss_i = logsumexp_{j in {i} + negatives(i)} (z1[i] . z2[j] / tau) - z1[i] . z2[i] / tau     (InfoNCE)

* ``loss``: mean of loss_i;
* ``chance``: mean of log(1 + |negatives(i)|), the loss of features that carry no information (all equal);
* ``top1``: fraction of rows whose positive scores above every negative (ties count as a miss);
* ``n``: M, the rows measured.

:func:`knn_accuracy` asks a different question of the same features: does a label that is not the instance (FCL's
slice position, the partition its global structural matching pulls together) sit among an input's nearest
neighbours from *other* groups (patients)?

Torch only (core); :func:`fedssl.eval.features.unet_discrimination` and :func:`fedssl.eval.features.unet_position_knn`
measure a U-Net on a site's slices.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class Discrimination(NamedTuple):
    loss: float
    chance: float
    top1: float
    n: int


def instance_discrimination(z1: torch.Tensor, z2: torch.Tensor, tau: float = 0.1,
                            groups: torch.Tensor | None = None) -> Discrimination:
    """InfoNCE of view ``z1`` against view ``z2`` of the same M inputs (module docstring)."""
    if z1.dim() != 2 or z1.shape != z2.shape or z1.shape[0] < 2:
        raise ValueError(f"instance discrimination needs two views [M, D] of the same M >= 2 inputs, got shapes "
                         f"{tuple(z1.shape)} and {tuple(z2.shape)}")
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not tau > 0:
        raise ValueError(f"tau={tau!r}: must be a positive number (FCL / MoCo: 0.1)")
    m = int(z1.shape[0])
    if groups is None:
        groups = torch.arange(m)
    groups = torch.as_tensor(groups).reshape(-1)
    if groups.shape[0] != m:
        raise ValueError(f"groups has {groups.shape[0]} entries for {m} inputs; give one group id per input")
    a, b = F.normalize(z1.detach().float(), dim=1), F.normalize(z2.detach().float(), dim=1)
    logits = a @ b.t() / float(tau)  # [M, M]
    eye = torch.eye(m, dtype=torch.bool)
    negative = groups.view(-1, 1) != groups.view(1, -1)  # [M, M]; the diagonal is never a negative
    n_neg = negative.sum(dim=1)
    if not bool((n_neg > 0).all()):  # with two groups or more every row has a negative
        raise ValueError("every input shares its group with all the others: no negatives to discriminate against")
    pos = logits.diagonal()
    masked = logits.masked_fill(~(negative | eye), float("-inf"))
    loss = torch.logsumexp(masked, dim=1) - pos
    hardest = logits.masked_fill(~negative, float("-inf")).max(dim=1).values
    top1 = (pos > hardest).float()
    return Discrimination(loss=float(loss.mean()), chance=float(torch.log1p(n_neg.float()).mean()),
                          top1=float(top1.mean()), n=m)


def knn_accuracy(z: torch.Tensor, labels: torch.Tensor, groups: torch.Tensor, k: int = 5) -> float:
    """Leave-group-out k-nearest-neighbour accuracy of ``labels`` from the features ``z [M, D]``: each row's ``k``
    most cosine-similar rows of *other* groups vote (ties: the smaller label wins); the fraction of rows whose vote
    is their own label."""
    labels, groups = torch.as_tensor(labels).reshape(-1).long(), torch.as_tensor(groups).reshape(-1)
    if z.dim() != 2 or labels.shape[0] != z.shape[0] or groups.shape[0] != z.shape[0]:
        raise ValueError(f"knn_accuracy needs features [M, D] with one label and one group per row, got shapes "
                         f"{tuple(z.shape)}, {tuple(labels.shape)}, {tuple(groups.shape)}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k={k!r}: must be a positive integer (neighbours that vote)")
    other = groups.view(-1, 1) != groups.view(1, -1)
    if int(other.sum(dim=1).min()) < k:
        raise ValueError(f"k={k} neighbours from other groups are not available for every row; lower k or give more "
                         "groups")
    if labels.min() < 0:
        raise ValueError("labels must be non-negative class indices")
    u = F.normalize(z.detach().float(), dim=1)
    sim = (u @ u.t()).masked_fill(~other, float("-inf"))
    nearest = sim.topk(k, dim=1).indices  # [M, k]
    votes = F.one_hot(labels[nearest], int(labels.max()) + 1).sum(dim=1)  # [M, C]
    return float((votes.argmax(dim=1) == labels).float().mean())
