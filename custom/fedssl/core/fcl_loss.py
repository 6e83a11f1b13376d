"""FCL contrastive loss with local and remote positives (FCL (Wu et al., MedIA 2022), section 3.2-3.3, equations
(3)-(5)).

For one query feature q, a set of positives P and a set of negatives N (all L2-normalised):

    l(q, P, N) = -1/|P| sum_{k in P} log( e^{q.k/t} / (e^{q.k/t} + sum_{n in N} e^{q.n/t}) )      (3)

Each summand equals softplus(LSE_n(q.n/t) - q.k/t), which is what we compute (numerically stable).
The FCL loss per query is   L_q = l(q, A(q), Q') + l(q, P(q), Q')                                (5)
with A(q) = {p in Q' : partition(p) = partition(q)}  (4, global structural matching, "GSM").
The batch loss is the mean of L_q over the queries.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def contrastive_term(
    q: torch.Tensor,  # [B, D]
    pos: torch.Tensor,  # [B, P, D]  positives per query
    neg: torch.Tensor,  # [K, D]     negatives shared by the batch
    tau: float,
    pos_mask: torch.Tensor | None = None,  # [B, P] bool, which positives count; None = all
) -> torch.Tensor:  # [B]
    """Equation (3) for every query of a batch; a query with no positive contributes 0."""
    neg_logits = q @ neg.t() / tau  # [B, K]
    lse_neg = torch.logsumexp(neg_logits, dim=1, keepdim=True)  # [B, 1]
    pos_logits = torch.einsum("bd,bpd->bp", q, pos) / tau  # [B, P]
    per_pos = F.softplus(lse_neg - pos_logits)  # [B, P] = -log(e^p / (e^p + sum e^n))
    if pos_mask is None:
        return per_pos.mean(dim=1)
    w = pos_mask.to(per_pos.dtype)
    count = w.sum(dim=1)
    return (per_pos * w).sum(dim=1) / count.clamp_min(1.0)


def remote_term(
    q: torch.Tensor,  # [B, D]
    q_part: torch.Tensor,  # [B] partition id of each query
    neg: torch.Tensor,  # [K, D] the sampled bank Q'
    neg_part: torch.Tensor,  # [K] partition id of each bank feature (-1: unknown, never a positive)
    tau: float,
) -> torch.Tensor:  # [B]
    """l(q, A(q), Q') with A(q) the features of Q' in q's partition (equation (4)); 0 if A(q) is empty."""
    logits = q @ neg.t() / tau  # [B, K]
    lse_neg = torch.logsumexp(logits, dim=1, keepdim=True)  # [B, 1]
    per_pos = F.softplus(lse_neg - logits)  # [B, K] loss if that bank entry were the positive
    mask = (neg_part.view(1, -1) == q_part.view(-1, 1)) & (neg_part.view(1, -1) >= 0)  # [B, K]
    w = mask.to(per_pos.dtype)
    return (per_pos * w).sum(dim=1) / w.sum(dim=1).clamp_min(1.0)


def fcl_loss(
    q: torch.Tensor,  # [B, D] main-encoder features of the queries
    pos: torch.Tensor,  # [B, P, D] local positives P(q) (momentum features)
    q_part: torch.Tensor,  # [B]
    neg: torch.Tensor,  # [K, D] sampled negatives Q'
    neg_part: torch.Tensor,  # [K]
    tau: float = 0.1,
    gsm: bool = True,
) -> torch.Tensor:
    """Batch mean of equation (5) (or of equation (3) alone when ``gsm`` is False)."""
    local, remote = fcl_loss_terms(q, pos, q_part, neg, neg_part, tau, gsm)
    return local + remote


def fcl_loss_terms(
    q: torch.Tensor, pos: torch.Tensor, q_part: torch.Tensor, neg: torch.Tensor, neg_part: torch.Tensor,
    tau: float = 0.1, gsm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch means of L_local = l(q, P(q), Q') and L_remote = l(q, A(q), Q') (0 when ``gsm`` is off).

    L_remote is 0 for a query whose partition has no real feature in Q' yet, so it grows while the
    bank fills with real (partition-labelled) features: watch the two terms apart.
    """
    local = contrastive_term(q, pos, neg, tau).mean()
    remote = remote_term(q, q_part, neg, neg_part, tau).mean() if gsm else local.new_zeros(())
    return local, remote


def paired_local_positives(k: torch.Tensor, n_volumes: int, n_partitions: int) -> torch.Tensor:
    """Local positives P(q_s^i) = {k_s^i+, k_s^j+} (section 3.2) for a batch laid out volume-major.

    ``k``: momentum features ``[V*S, D]`` of V volumes x S partitions (row v*S + s).  Volumes are
    paired (0,1), (2,3), ...; with an odd V the last volume pairs with the first.  Returns
    ``[V*S, 2, D]``: for row (v, s) the momentum feature of (v, s) itself and of (partner(v), s).
    """
    if k.shape[0] != n_volumes * n_partitions:
        raise ValueError(f"k has {k.shape[0]} rows, expected n_volumes*n_partitions = {n_volumes * n_partitions}")
    if n_volumes < 2:
        raise ValueError("FCL local positives need at least 2 volumes per batch (x_s^i and x_s^j)")
    v = torch.arange(n_volumes, device=k.device)
    partner = torch.where(v % 2 == 0, v + 1, v - 1)
    if n_volumes % 2 == 1:
        partner[-1] = 0
    kk = k.view(n_volumes, n_partitions, -1)  # [V, S, D]
    return torch.stack([kk, kk[partner]], dim=2).reshape(n_volumes * n_partitions, 2, -1)
