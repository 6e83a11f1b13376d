"""GLoRIA's image-text objective (torch only), a local loss of FedDRA's site trainer (``local_loss="gloria"``).

Huang, Shen, Lungren and Yeung, "GLoRIA: A Multimodal Global-Local Representation Learning Framework for
Label-efficient Medical Image Recognition", ICCV 2021, sec. 3 (the section and equation numbers below are those
of the ICCV paper as we read it; the paper is not among this bundle's seeds, so they could not be re-checked
here).  What follows the paper:

- **attention-weighted image representation (sec. 3.2.1, eq. 2-3):** the dot-product similarity of every word
  t_i with every sub-region v_j, ``s_ij = t_i^T v_j``; the attention of word i over the regions
  ``a_ij = exp(gamma1 s_ij) / sum_k exp(gamma1 s_ik)`` (gamma1 = 4); the word's visual context
  ``c_i = sum_j a_ij v_j``;
- **local similarity (eq. 4-5):** ``R(c_i, t_i)`` the cosine of context and word; the image-report score
  ``Z(x, y) = log( sum_i exp(gamma2 R(c_i, t_i)) )^(1 / gamma2)`` (gamma2 = 5), i.e.
  ``(1 / gamma2) log sum_i exp(gamma2 R_i)`` over the report's words;
- **local contrastive loss (eq. 6-7):** ``P(x_k | y_k) = exp(gamma3 Z(x_k, y_k)) / sum_l exp(gamma3 Z(x_l, y_k))``
  (gamma3 = 10) and its mirror ``P(y_k | x_k)``; ``L_l = -log P(x|y) - log P(y|x)``, averaged over the batch;
- **global contrastive loss (eq. 8):** the same with the cosine of the global image and report embeddings in place
  of Z; ``L = L_g + L_l`` (eq. 9, both weights 1).

Where this departs from the paper, and why:

- **regions and words come from FedDRA's alignment blocks**, not GLoRIA's ResNet-50 conv4 map (19 x 19) and BERT's
  last four layers: FedDRA's encoders are a ViT and a BERT with one alignment block each; the regions are the ViT
  patch tokens of the image alignment block, the words the text alignment layer's tokens;
- **one projection per modality:** the global and the local embeddings share FedDRA's ``image_proj`` /
  ``text_proj`` (GLoRIA has separate global and local embedders); a separate local embedder would add parameters
  to the federated model for one local loss only, and the model is the same for every local loss;
- **word pieces are summed into words** (``merge_word_pieces``): the paper works on words and does not say how
  sub-word pieces form one; summing follows the authors' code.  [CLS], [SEP] and padding are not words.
- the paper's ``Z`` (with the 1 / gamma2 power) is used; the authors' code omits the 1 / gamma2.  Its attention
  also applies a softmax over the words before the one over the regions (from AttnGAN); the paper's single
  softmax over the regions is used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

_COMPONENT = "GloriaSettings"


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class GloriaSettings:
    """GLoRIA's constants (the paper's implementation details: gamma1 = 4, gamma2 = 5, gamma3 = 10, also the authors'
    configs) and the weights of eq. 9 (1 and 1)."""

    gamma1: float = 4.0
    gamma2: float = 5.0
    gamma3: float = 10.0
    global_weight: float = 1.0
    local_weight: float = 1.0

    def __post_init__(self) -> None:
        for name, fix in (("gamma1", "use a positive attention sharpness (paper: 4)"),
                          ("gamma2", "use a positive aggregation sharpness (paper: 5)"),
                          ("gamma3", "use a positive inverse temperature (paper: 10)")):
            value = getattr(self, name)
            if not (_number(value) and value > 0):
                raise ValueError(f"{_COMPONENT}: argument {name}={value!r} is invalid; {fix}")
        for name in ("global_weight", "local_weight"):
            value = getattr(self, name)
            if not (_number(value) and value >= 0):
                raise ValueError(f"{_COMPONENT}: argument {name}={value!r} is invalid; use a weight >= 0 (paper: 1)")


def merge_word_pieces(tokens: torch.Tensor, word_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the token features of each word.

    Args:
        tokens: ``[B, T, D]`` token features.
        word_index: ``[B, T]`` long, the word a token belongs to (0, 1, ...), -1 for tokens that are no word
            ([CLS], [SEP], padding).

    Returns:
        ``(words [B, W, D], mask [B, W] bool)``, W the most words of a report; padded words are zero and False.
    """
    b, _, d = tokens.shape
    n_words = int(word_index.max().item()) + 1 if word_index.numel() else 0
    n_words = max(n_words, 1)
    keep = word_index >= 0
    idx = word_index.clamp(min=0)
    words = tokens.new_zeros(b, n_words, d)
    words = words.scatter_add(1, idx.unsqueeze(-1).expand(-1, -1, d), tokens * keep.unsqueeze(-1).to(tokens.dtype))
    counts = torch.zeros(b, n_words, device=tokens.device).scatter_add(1, idx, keep.float())
    return words, counts > 0


def word_attention(words: torch.Tensor, regions: torch.Tensor, gamma1: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 2-3 for every (report, image) pair: ``words [Bt, W, D]``, ``regions [Bi, M, D]`` ->
    ``(contexts [Bt, Bi, W, D], attention [Bt, Bi, W, M])``, attention normalised over the regions."""
    s = torch.einsum("lwd,kmd->lkwm", words, regions)  # s_ij = t_i^T v_j
    a = torch.softmax(gamma1 * s, dim=-1)
    return torch.einsum("lkwm,kmd->lkwd", a, regions), a


def local_scores(words: torch.Tensor, word_mask: torch.Tensor, regions: torch.Tensor, gamma1: float,
                 gamma2: float) -> torch.Tensor:
    """``Z [Bt, Bi]``: eq. 4-5, ``Z(x_k, y_l) = (1 / gamma2) log sum_i exp(gamma2 R(c_i, t_i))`` over the words of
    report l attending to the regions of image k."""
    context, _ = word_attention(words, regions, gamma1)
    r = F.cosine_similarity(context, words.unsqueeze(1).expand_as(context), dim=-1, eps=1e-8)  # [Bt, Bi, W]
    r = r.masked_fill(~word_mask.unsqueeze(1), float("-inf"))
    return torch.logsumexp(gamma2 * r, dim=-1) / gamma2


def _two_way(scores: torch.Tensor, gamma3: float) -> torch.Tensor:
    """``-log P(x|y) - log P(y|x)`` averaged over the batch, ``scores[l, k]`` of report l and image k."""
    target = torch.arange(scores.shape[0], device=scores.device)
    logits = gamma3 * scores
    return F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target)


def global_loss(v: torch.Tensor, t: torch.Tensor, gamma3: float = 10.0) -> torch.Tensor:
    """Eq. 8: the two-way contrastive loss of the cosine of global embeddings ``v [B, D]`` (images), ``t [B, D]``."""
    scores = F.normalize(t, dim=-1) @ F.normalize(v, dim=-1).t()  # [report, image]
    return _two_way(scores, gamma3)


def local_loss(regions: torch.Tensor, words: torch.Tensor, word_mask: torch.Tensor,
               settings: GloriaSettings = GloriaSettings()) -> torch.Tensor:
    """Eq. 6-7: ``regions [B, M, D]`` of the images, ``words [B, W, D]`` (with ``word_mask [B, W]``) of the reports,
    pair i matched; a report without a word is an error."""
    if not bool(word_mask.any(dim=1).all()):
        raise ValueError("gloria local_loss: a report has no word (only [CLS]/[SEP]/padding); pass reports with text")
    z = local_scores(words, word_mask, regions, settings.gamma1, settings.gamma2)
    return _two_way(z, settings.gamma3)


def gloria_loss(v: torch.Tensor, t: torch.Tensor, regions: torch.Tensor, words: torch.Tensor,
                word_mask: torch.Tensor, settings: GloriaSettings = GloriaSettings()
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """Eq. 9: ``global_weight L_g + local_weight L_l``; returns the total and its terms."""
    lg = global_loss(v, t, settings.gamma3)
    ll = local_loss(regions, words, word_mask, settings)
    total = settings.global_weight * lg + settings.local_weight * ll
    return total, {"loss_global": float(lg.detach()), "loss_local": float(ll.detach())}


__all__ = ["GloriaSettings", "gloria_loss", "global_loss", "local_loss", "local_scores", "merge_word_pieces",
           "word_attention"]
