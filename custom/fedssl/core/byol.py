"""The BYOL loss of FedBYOL / FCLOpt (FCL (Wu et al., MedIA 2022) section 4.3) and its learning rates, free of FLARE
types; the trainer that uses them is :class:`fedssl.train.byol.BYOLLocalTrainer`.

Online network (encoder + projector) + predictor q, target network xi updated by EMA (eq. 7, m = 0.99) after
every step.  The loss is FCLOpt's eq. 6, one direction: L = 2 - 2 cos(q(f_theta(t)), f_xi(t')), t fed to the
online network and t' to the target network.  BYOL's own paper (Grill et al. 2020, eq. 2) adds the swapped term
L(t', t); that sum doubles the loss and its gradient, which at FCLOpt's lr 0.5 is a different optimisation, so it
is a switch (``symmetric``, default off) and not the default.  No negatives, so no features cross the wire.

Learning rates (FCL section 5, "Training details"): 0.5 for FCLOpt, FCLOpt-PTNU and FCLOpt-PTNU-DP (the
default here); 0.05, the paper's general rate, for the baselines, FedBYOL included (:data:`FEDBYOL_LR`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


#: FCL section 5, "Training details": lr 0.5 for FCLOpt and its PTNU / DP variants
FCLOPT_LR = 0.5
#: the same passage's general rate (0.05), which the baselines use: FedBYOL's lr
FEDBYOL_LR = 0.05


def byol_loss(p: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """mean over the batch of 2 - 2 cos(p, z) (FCL eq. 6); ``z`` is treated as a constant."""
    return (2 - 2 * F.cosine_similarity(p, z.detach(), dim=1)).mean()


def view_loss(model: torch.nn.Module, t: torch.Tensor, t2: torch.Tensor,
              symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """FCL eq. 6 on the views ``t`` (online network) and ``t2`` (target network); with ``symmetric`` plus the
    swapped term L(t2, t) (Grill et al. eq. 2).  ``model`` has ``online``, ``predictor`` and ``target``.
    Returns the loss and the online projections of ``t`` (whose spread the round reports)."""
    with torch.no_grad():
        z2 = model.target(t2)
    online = model.online(t)
    loss = byol_loss(model.predictor(online), z2)
    if symmetric:
        with torch.no_grad():
            z1 = model.target(t)
        loss = loss + byol_loss(model.predictor(model.online(t2)), z1)
    return loss, online
