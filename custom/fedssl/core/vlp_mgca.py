"""MGCA's image-text objective (torch only), a local loss of FedDRA's site trainer (``local_loss="mgca"``).

Wang, Zhou, Wang, Ma and Yu, "Multi-Granularity Cross-modal Alignment for Generalized Medical Visual Representation
Learning", NeurIPS 2022, sec. 3 (section and equation numbers as we read the paper, which is not among this bundle's
seeds; the constants were checked against the authors' code, HKU-MedAI/MGCA ``mgca_module.py``).  Three terms,
``L = lambda1 L_ITA + lambda2 L_CTA + lambda3 L_CPA`` (sec. 3.5):

- **instance-wise alignment, ITA (sec. 3.2):** the two-way InfoNCE of the global image and report embeddings with
  temperature tau1, ``1 / (2N) sum_i (l_i^{v->t} + l_i^{t->v})``;
- **cross-attention-based token-wise alignment, CTA (sec. 3.3):** every image patch attends to the report's words
  (and every word to the patches); the attended output o_j of token j is matched with its own token within the
  same sample: ``l_i = -log exp(s(p_i, o_i) / tau2) / sum_j exp(s(p_i, o_j) / tau2)`` (and the column direction),
  weighted by each token's importance w_i, the last layer's [CLS] attention to it, clipped to its 10th-90th
  percentile and normalised over the sample's tokens; patch and word terms are added, each the mean of its two
  directions (as the authors' code);
- **cross-modal prototype alignment, CPA (sec. 3.4):** K learnable prototypes c_k (unit vectors); image and report
  scores ``s = z^T c``; soft cluster codes q by Sinkhorn-Knopp (epsilon 0.05, 3 iterations, equal partition of the
  batch among the prototypes); predictions ``p = softmax(s / tau3)``; each modality predicts the other's code:
  ``L_CPA = -1/2 mean( sum_k q_img log p_txt + q_txt log p_img )``.

Settings (:class:`MGCASettings`): tau1 = tau2 = 0.1, tau3 = 0.2, K = 500, epsilon = 0.05, 3 Sinkhorn iterations,
lambda1 = lambda2 = lambda3 = 1 (as we read the paper's implementation details; the authors' code defaults differ:
softmax temperature 0.07, lambda2 = 0.7, lambda3 = 0.5, and a sum instead of a mean over the two ITA directions).

Where this departs from the paper, and why:

- **the cross-attention has no learned projections:** the paper writes Q, K, V maps; the authors' code by default
  (``use_local_atten=False``) attends with ``softmax(p w^T / tau2)`` on the embeddings themselves, and so does this
  module: learned maps would be a per-loss part of the federated model;
- **the prototypes are the site's own** (see :class:`fedssl.train.feddra.FedDRALocalTrainer`): they are trained
  and checkpointed on the site but neither uploaded nor averaged (FedAvg of cluster centres that no site aligned
  with another's mixes unrelated clusters, and the model the server builds is the same for every local loss);
  MGCA also freezes them for its first epoch, which has no counterpart in a federated turn and is not done;
- tokens, regions and embeddings come from FedDRA's alignment blocks and its one projection per modality (MGCA has
  separate global and local embedders), for the reasons given in :mod:`fedssl.core.vlp_gloria`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

_COMPONENT = "MGCASettings"


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class MGCASettings:
    """MGCA's constants (module docstring); each checked at once with argument, value and fix."""

    tau1: float = 0.1
    tau2: float = 0.1
    tau3: float = 0.2
    lambda1: float = 1.0
    lambda2: float = 1.0
    lambda3: float = 1.0
    num_prototypes: int = 500
    epsilon: float = 0.05
    sinkhorn_iterations: int = 3

    def __post_init__(self) -> None:
        for name, fix in (("tau1", "use a temperature > 0 (paper: 0.1)"), ("tau2", "use a temperature > 0 (0.1)"),
                          ("tau3", "use a temperature > 0 (0.2)"), ("epsilon", "use a Sinkhorn epsilon > 0 (0.05)")):
            value = getattr(self, name)
            if not (_number(value) and value > 0):
                raise ValueError(f"{_COMPONENT}: argument {name}={value!r} is invalid; {fix}")
        for name in ("lambda1", "lambda2", "lambda3"):
            value = getattr(self, name)
            if not (_number(value) and value >= 0):
                raise ValueError(f"{_COMPONENT}: argument {name}={value!r} is invalid; use a weight >= 0 (paper: 1)")
        for name, lo, fix in (("num_prototypes", 2, "use at least 2 prototypes (paper: 500)"),
                              ("sinkhorn_iterations", 1, "use at least 1 iteration (paper: 3)")):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= lo):
                raise ValueError(f"{_COMPONENT}: argument {name}={value!r} is invalid; {fix}")


def ita_loss(z_img: torch.Tensor, z_txt: torch.Tensor, tau1: float = 0.1) -> torch.Tensor:
    """ITA: the mean of the image->text and text->image InfoNCE of cosine similarities / tau1."""
    logits = F.normalize(z_img, dim=-1) @ F.normalize(z_txt, dim=-1).t() / tau1
    target = torch.arange(logits.shape[0], device=logits.device)
    return 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target))


def token_weights(cls_attention: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, N]`` importance of each token: its [CLS] attention clipped to the 10th-90th percentile of the sample's
    valid tokens (``mask`` True), normalised to sum 1 over them; 0 elsewhere."""
    out = torch.zeros_like(cls_attention, dtype=torch.float32)
    for i in range(cls_attention.shape[0]):
        a = cls_attention[i][mask[i]].float()
        lo, hi = torch.quantile(a, 0.1), torch.quantile(a, 0.9)
        a = a.clamp(lo, hi)
        out[i][mask[i]] = a / a.sum().clamp_min(1e-12)
    return out


def cross_attend(query: torch.Tensor, keys: torch.Tensor, key_mask: torch.Tensor, tau2: float) -> torch.Tensor:
    """``o [B, Nq, D]``: each query token's attention-weighted sum of the other modality's tokens,
    ``softmax(q k^T / tau2)`` over the valid keys, L2-normalised."""
    sim = torch.bmm(query, keys.transpose(1, 2)) / tau2
    sim = sim.masked_fill(~key_mask.unsqueeze(1), float("-inf"))
    return F.normalize(torch.bmm(torch.softmax(sim, dim=-1), keys), dim=-1)


def _token_alignment(tokens: torch.Tensor, attended: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor,
                     tau2: float) -> torch.Tensor:
    """One modality's CTA term: per sample, token i's own attended output against the others' (rows) and the
    mirror (columns), each weighted by ``weights``, summed over tokens, averaged over the batch and directions."""
    sim = torch.bmm(tokens, attended.transpose(1, 2)) / tau2  # [B, N, N]
    invalid = ~(mask.unsqueeze(1) & mask.unsqueeze(2))
    sim = sim.masked_fill(invalid, -1e4)  # finite: a padded token's row stays finite (no NaN gradient)
    eye = torch.arange(sim.shape[1], device=sim.device)
    diag = sim[:, eye, eye]
    rows = -(diag - torch.logsumexp(sim, dim=2))
    cols = -(diag - torch.logsumexp(sim, dim=1))
    rows, cols = rows.masked_fill(~mask, 0.0), cols.masked_fill(~mask, 0.0)
    b = tokens.shape[0]
    return 0.5 * (((rows * weights).sum() + (cols * weights).sum()) / b)


def cta_loss(patches: torch.Tensor, patch_attention: torch.Tensor, words: torch.Tensor, word_mask: torch.Tensor,
             word_attention: torch.Tensor, tau2: float = 0.1) -> torch.Tensor:
    """CTA: ``patches [B, M, D]`` and ``words [B, W, D]`` unit vectors, ``word_mask [B, W]``, the [CLS] attentions
    ``patch_attention [B, M]`` / ``word_attention [B, W]`` (detached importance weights)."""
    patch_mask = torch.ones(patches.shape[:2], dtype=torch.bool, device=patches.device)
    with torch.no_grad():
        wp = token_weights(patch_attention.detach(), patch_mask)
        ww = token_weights(word_attention.detach(), word_mask)
    o_words = cross_attend(words, patches, patch_mask, tau2)  # each word's visual context
    o_patches = cross_attend(patches, words, word_mask, tau2)  # each patch's textual context
    return (_token_alignment(words, o_words, word_mask, ww, tau2)
            + _token_alignment(patches, o_patches, patch_mask, wp, tau2))


@torch.no_grad()
def sinkhorn(scores: torch.Tensor, epsilon: float = 0.05, iterations: int = 3) -> torch.Tensor:
    """Soft codes ``q [B, K]`` (rows sum to 1) of prototype scores ``[B, K]`` by Sinkhorn-Knopp (Cuturi 2013, as
    SwAV): ``Q = exp(scores / epsilon)``, alternately scaled so the prototypes share the batch equally (rows of
    ``Q^T`` sum to 1/K) and every sample has mass 1/B."""
    q = torch.exp((scores - scores.max()) / epsilon).t().double()  # [K, B]
    q /= q.sum()
    k, b = q.shape
    for _ in range(iterations):
        q *= (1.0 / k) / q.sum(dim=1, keepdim=True)
        q *= (1.0 / b) / q.sum(dim=0, keepdim=True)
    return (q / q.sum(dim=0, keepdim=True)).t().to(scores.dtype)


def cpa_loss(z_img: torch.Tensor, z_txt: torch.Tensor, prototypes: torch.Tensor, tau3: float = 0.2,
             epsilon: float = 0.05, iterations: int = 3) -> torch.Tensor:
    """CPA with ``prototypes [K, D]`` (normalised here): each modality's softmax(s / tau3) predicts the other's
    Sinkhorn code."""
    c = F.normalize(prototypes, dim=-1)
    s_img, s_txt = F.normalize(z_img, dim=-1) @ c.t(), F.normalize(z_txt, dim=-1) @ c.t()
    q_img, q_txt = sinkhorn(s_img.detach(), epsilon, iterations), sinkhorn(s_txt.detach(), epsilon, iterations)
    log_p_img, log_p_txt = F.log_softmax(s_img / tau3, dim=1), F.log_softmax(s_txt / tau3, dim=1)
    return -0.5 * ((q_img * log_p_txt).sum(1).mean() + (q_txt * log_p_img).sum(1).mean())


def mgca_loss(z_img: torch.Tensor, z_txt: torch.Tensor, patches: torch.Tensor, patch_attention: torch.Tensor,
              words: torch.Tensor, word_mask: torch.Tensor, word_attention: torch.Tensor, prototypes: torch.Tensor,
              settings: MGCASettings = MGCASettings()) -> tuple[torch.Tensor, dict[str, float]]:
    """``lambda1 L_ITA + lambda2 L_CTA + lambda3 L_CPA`` and its terms."""
    s = settings
    if not bool(word_mask.any(dim=1).all()):
        raise ValueError("mgca_loss: a report has no word (only [CLS]/[SEP]/padding); pass reports with text")
    ita = ita_loss(z_img, z_txt, s.tau1)
    cta = cta_loss(F.normalize(patches, dim=-1), patch_attention, F.normalize(words, dim=-1), word_mask,
                   word_attention, s.tau2)
    cpa = cpa_loss(z_img, z_txt, prototypes, s.tau3, s.epsilon, s.sinkhorn_iterations)
    total = s.lambda1 * ita + s.lambda2 * cta + s.lambda3 * cpa
    return total, {"loss_ita": float(ita.detach()), "loss_cta": float(cta.detach()), "loss_cpa": float(cpa.detach())}


__all__ = ["MGCASettings", "cpa_loss", "cross_attend", "cta_loss", "ita_loss", "mgca_loss", "sinkhorn",
           "token_weights"]
