"""FedDRA's local objective (torch only): image-text InfoNCE plus the global-anchor constraint, and its switches.

"Distributionally Robust Alignment for Medical Federated Vision-Language Pre-training Under Data Heterogeneity"
(Shuai, Wu, Tang and Shen, TMLR), eq. (1):  L_local = L_MI + mu L_C  with

- L_MI: the symmetric image-text contrastive loss of ConVIRT ("Contrastive Learning of Medical Visual
  Representations from Paired Images and Text", Zhang et al., MLHC 2022): cross-entropy of the cosine
  similarities / tau, image->text and text->image, averaged with weights ``image_weight`` and 1 - image_weight;
- L_C = ||z_x - z_x*||^2 + ||z_y - z_y*||^2 (sec. 4.1), per pair, averaged over the batch, with z* the
  embeddings of a frozen copy of the model received this stage (the global model).  The authors' code uses a
  mean-squared error (the same divided by the embedding size); we follow the paper's formula.

Stages (sec. 4.2, Algorithms 2-3): stage 1 trains the alignment modules and projections with the encoders
frozen; stage 2 trains everything; "full" is a plain FedAvg turn (one task, everything trained).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: the tasks of a turn: stage 1 (alignment only), stage 2 (everything), or one plain FedAvg task
STAGES = ("align", "full_model", "fedavg")


def convirt_loss(z_img: torch.Tensor, z_txt: torch.Tensor, tau: float = 0.07,
                 image_weight: float = 0.5) -> torch.Tensor:
    """Symmetric InfoNCE over the batch: pair i is the positive of row / column i."""
    a, b = F.normalize(z_img, dim=-1), F.normalize(z_txt, dim=-1)
    logits = a @ b.t() / tau
    target = torch.arange(a.shape[0], device=a.device)
    return image_weight * F.cross_entropy(logits, target) + (1.0 - image_weight) * F.cross_entropy(logits.t(), target)


def anchor_loss(z_img: torch.Tensor, z_txt: torch.Tensor, z_img_star: torch.Tensor,
                z_txt_star: torch.Tensor) -> torch.Tensor:
    """mean over the batch of ||z_x - z_x*||^2 + ||z_y - z_y*||^2 (the anchors carry no gradient)."""
    return (((z_img - z_img_star.detach()) ** 2).sum(-1) + ((z_txt - z_txt_star.detach()) ** 2).sum(-1)).mean()


@dataclass(frozen=True)
class FedDRAConfig:
    """The local objective's settings; checked at once (argument, value, fix)."""

    mu: float = 5.0  # anchor weight (paper: 5 on MIMIC-CXR, 1 on retina); 0 = no anchor (Table 3 ablation)
    tau: float = 0.07  # temperature (the authors' code: 0.07)
    image_weight: float = 0.5

    def __post_init__(self) -> None:
        for name, value, lo, fix in (("mu", self.mu, 0.0,
                                      "use the anchor weight >= 0 (paper: 5; 0 turns the anchor off)"),
                                     ("tau", self.tau, None, "use a temperature > 0 (0.07)"),
                                     ("image_weight", self.image_weight, 0.0, "use a weight in [0, 1] (0.5)")):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            ok = ok and (value > 0 if lo is None else value >= lo)
            if name == "image_weight":
                ok = ok and value <= 1
            if not ok:
                raise ValueError(f"FedDRAConfig: argument {name}={value!r} is invalid; {fix}")

    def loss(self, z_img, z_txt, z_img_star=None, z_txt_star=None) -> tuple[torch.Tensor, dict[str, float]]:
        """(L_local, its terms) for one batch; the anchor term only when mu > 0 and anchors are given."""
        mi = convirt_loss(z_img, z_txt, self.tau, self.image_weight)
        terms = {"loss_mi": float(mi.detach())}
        total = mi
        if self.mu > 0 and z_img_star is not None:
            c = anchor_loss(z_img, z_txt, z_img_star, z_txt_star)
            terms["loss_anchor"] = float(c.detach())
            total = mi + self.mu * c
        return total, terms


def trainable_names(names, stage: str, alignment_prefixes) -> list[str]:
    """The parameter names a stage trains: "align" -> those under ``alignment_prefixes``, else all."""
    if stage not in STAGES:
        raise ValueError(f"stage {stage!r} is not one of {list(STAGES)}")
    names = list(names)
    if stage == "align":
        return [n for n in names if n.startswith(tuple(alignment_prefixes))]
    return names
