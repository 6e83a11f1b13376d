"""FedDRA's local objective (torch only): image-text InfoNCE plus the global-anchor constraint, and its switches.

"Distributionally Robust Alignment for Medical Federated Vision-Language Pre-training Under Data Heterogeneity"
(Shuai, Wu, Tang and Shen, TMLR), eq. (1):  L_local = L_MI + mu L_C  with

- L_MI: the symmetric image-text contrastive loss of ConVIRT ("Contrastive Learning of Medical Visual
  Representations from Paired Images and Text", Zhang et al., MLHC 2022): cross-entropy of the cosine
  similarities / tau, image->text and text->image, averaged with weights ``image_weight`` and 1 - image_weight;
- L_C = ||z_x - z_x*||^2 + ||z_y - z_y*||^2 (sec. 4.1), per pair, averaged over the batch, with z* the
  embeddings of a frozen copy of the model received this stage (the global model).  The authors' code uses a
  mean-squared error (the same divided by the embedding size); we follow the paper's formula.

L_MI is ConVIRT's loss by default; ``local_loss="gloria"`` (:mod:`fedssl.core.vlp_gloria`) or ``"mgca"``
(:mod:`fedssl.core.vlp_mgca`) replace it by those methods' objectives (FedDRA sec. 5.3, Table 2: "our method can be
transferred to multiple multi-modal pre-training methods"), each with its own constants (``local_loss_args``).  The
DRO client loss v_i is the method's own contrastive term (FedDRA sec. 6: "All of the loss objectives of these
pre-training methods contain a contrastive loss term ... we take this loss term for computing the client weights"):
ConVIRT's InfoNCE, GLoRIA's global loss, MGCA's ITA (:meth:`FedDRAConfig.contrastive`).

Stages (sec. 4.2, Algorithms 2-3): stage 1 trains the alignment modules and projections with the encoders
frozen; stage 2 trains everything; "full" is a plain FedAvg turn (one task, everything trained).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from fedssl.core.vlp_gloria import GloriaSettings
from fedssl.core.vlp_gloria import global_loss as gloria_global_loss
from fedssl.core.vlp_mgca import MGCASettings, ita_loss

#: the tasks of a turn: stage 1 (alignment only), stage 2 (everything), or one plain FedAvg task
STAGES = ("align", "full_model", "fedavg")
#: the image-text objectives L_MI of the local loss: ConVIRT (default, the paper's main one), GLoRIA, MGCA
LOCAL_LOSSES = ("convirt", "gloria", "mgca")
_LOSS_SETTINGS = {"gloria": GloriaSettings, "mgca": MGCASettings}


def local_loss_settings(local_loss: str, args: Any) -> GloriaSettings | MGCASettings | None:
    """The checked constants of ``local_loss`` from the JSON object ``args`` (``{}``: the paper's): a ValueError
    names the argument, the value and the fix (convirt takes none: its temperature is ``tau``)."""
    if local_loss not in LOCAL_LOSSES:
        raise ValueError(f"FedDRAConfig: argument local_loss={local_loss!r} is invalid; use one of "
                         f"{list(LOCAL_LOSSES)}")
    if not isinstance(args, dict) or not all(isinstance(k, str) for k in args):
        raise ValueError(f"FedDRAConfig: argument local_loss_args={args!r} is invalid; use a JSON object ({{}} for "
                         "the paper's constants)")
    cls = _LOSS_SETTINGS.get(local_loss)
    if cls is None:
        if args:
            raise ValueError(f"FedDRAConfig: argument local_loss_args={args!r} is invalid for local_loss='convirt'; "
                             "use {} (ConVIRT's temperature is the argument tau)")
        return None
    names = list(cls.__dataclass_fields__)
    unknown = sorted(set(args) - set(names))
    if unknown:
        raise ValueError(f"FedDRAConfig: argument local_loss_args has unknown keys {unknown} for "
                         f"local_loss={local_loss!r}; use only {names}")
    return cls(**args)


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
    local_loss: str = "convirt"  # L_MI: "convirt", "gloria" or "mgca"
    local_loss_args: dict = field(default_factory=dict)  # that method's constants, {} = its paper's

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", local_loss_settings(self.local_loss, self.local_loss_args))
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

    def contrastive(self, z_img: torch.Tensor, z_txt: torch.Tensor) -> torch.Tensor:
        """The method's image-text contrastive term of global embeddings (the DRO client loss v_i): ConVIRT's
        InfoNCE (tau), GLoRIA's global loss (gamma3) or MGCA's ITA (tau1)."""
        if self.local_loss == "gloria":
            return gloria_global_loss(z_img, z_txt, self.method.gamma3)
        if self.local_loss == "mgca":
            return ita_loss(z_img, z_txt, self.method.tau1)
        return convirt_loss(z_img, z_txt, self.tau, self.image_weight)

    def loss(self, z_img, z_txt, z_img_star=None, z_txt_star=None,
             mi: tuple[torch.Tensor, dict[str, float]] | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """(L_local, its terms) for one batch; the anchor term only when mu > 0 and anchors are given.  ``mi``:
        L_MI and its terms computed by the caller (GLoRIA / MGCA need token features); None = ConVIRT's."""
        if mi is None:
            mi_value = convirt_loss(z_img, z_txt, self.tau, self.image_weight)
            terms = {"loss_mi": float(mi_value.detach())}
        else:
            mi_value, extra = mi
            terms = {"loss_mi": float(mi_value.detach()), **extra}
        mi = mi_value
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
