"""FCL loss against a direct, loop-by-loop implementation of equations (3)-(5) of FCL (Wu et al., MedIA 2022)."""

import math

import torch
import torch.nn.functional as F

from fedssl.core.fcl_loss import contrastive_term, fcl_loss, paired_local_positives, remote_term


def direct_l(q, P, N, tau):
    """l(q, P, N) = -1/|P| sum_{k in P} log(e^{q.k/t} / (e^{q.k/t} + sum_{n in N} e^{q.n/t})), plain floats."""
    if len(P) == 0:
        return 0.0
    neg = sum(math.exp(float(q @ n) / tau) for n in N)
    return -sum(math.log(math.exp(float(q @ k) / tau) / (math.exp(float(q @ k) / tau) + neg)) for k in P) / len(P)


def test_single_query_by_hand():
    # q = e1, positive at 60 degrees, negatives e2 and -e1; tau = 0.5
    q = torch.tensor([[1.0, 0.0]])
    pos = torch.tensor([[[0.5, math.sqrt(3) / 2]]])
    neg = torch.tensor([[0.0, 1.0], [-1.0, 0.0]])
    tau = 0.5
    expected = -math.log(math.exp(1.0) / (math.exp(1.0) + math.exp(0.0) + math.exp(-2.0)))  # q.k/t = 1
    assert abs(contrastive_term(q, pos, neg, tau).item() - expected) < 1e-6


def test_fcl_loss_matches_equation_5():
    g = torch.Generator().manual_seed(0)
    B, P, K, D, S, tau = 6, 2, 10, 5, 3, 0.1
    q = F.normalize(torch.randn(B, D, generator=g), dim=1)
    pos = F.normalize(torch.randn(B, P, D, generator=g), dim=2)
    neg = F.normalize(torch.randn(K, D, generator=g), dim=1)
    q_part = torch.randint(0, S, (B,), generator=g)
    neg_part = torch.randint(-1, S, (K,), generator=g)
    neg_part[0] = -1  # an initial random bank entry is never a positive
    expected = 0.0
    for b in range(B):
        A = [neg[j] for j in range(K) if neg_part[j] == q_part[b] and neg_part[j] >= 0]
        expected += direct_l(q[b], A, neg, tau) + direct_l(q[b], list(pos[b]), neg, tau)
    expected /= B
    got = fcl_loss(q, pos, q_part, neg, neg_part, tau=tau, gsm=True).item()
    assert abs(got - expected) < 1e-4 * max(1.0, abs(expected))
    no_gsm = sum(direct_l(q[b], list(pos[b]), neg, tau) for b in range(B)) / B
    assert abs(fcl_loss(q, pos, q_part, neg, neg_part, tau=tau, gsm=False).item() - no_gsm) < 1e-4 * max(1.0, no_gsm)


def test_remote_term_empty_positive_set_is_zero():
    q = torch.tensor([[1.0, 0.0]])
    neg = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    out = remote_term(q, torch.tensor([2]), neg, torch.tensor([0, 1]), 0.1)
    assert out.item() == 0.0


def test_paired_local_positives_layout():
    V, S, D = 3, 2, 1
    k = torch.arange(V * S, dtype=torch.float32).view(V * S, D)  # row v*S+s holds value v*S+s
    pos = paired_local_positives(k, V, S)
    assert pos.shape == (V * S, 2, D)
    # volume 0 pairs with 1, volume 1 with 0, odd last volume 2 with 0
    assert pos[:, 0, 0].tolist() == [0, 1, 2, 3, 4, 5]
    assert pos[:, 1, 0].tolist() == [2, 3, 0, 1, 0, 1]


def test_loss_gradient_is_finite_and_pulls_positive_closer():
    q = F.normalize(torch.tensor([[1.0, 0.2]]), dim=1).requires_grad_(True)
    pos = F.normalize(torch.tensor([[[0.0, 1.0]]]), dim=2)
    neg = F.normalize(torch.tensor([[1.0, -1.0]]), dim=1)
    loss = fcl_loss(q, pos, torch.tensor([0]), neg, torch.tensor([1]), tau=0.1)
    loss.backward()
    # gradient descent on q increases q . k+ (moves towards the positive)
    assert torch.isfinite(q.grad).all() and (q.grad @ pos[0, 0]).item() < 0


def test_terms_add_up_to_the_loss():
    from fedssl.core.fcl_loss import fcl_loss_terms

    g = torch.Generator().manual_seed(1)
    q = F.normalize(torch.randn(4, 3, generator=g), dim=1)
    pos = F.normalize(torch.randn(4, 2, 3, generator=g), dim=2)
    neg = F.normalize(torch.randn(6, 3, generator=g), dim=1)
    qp, npart = torch.tensor([0, 1, 0, 1]), torch.tensor([0, 1, -1, 0, 1, 1])
    local, remote = fcl_loss_terms(q, pos, qp, neg, npart, 0.2)
    assert torch.isclose(local + remote, fcl_loss(q, pos, qp, neg, npart, 0.2))
    assert fcl_loss_terms(q, pos, qp, neg, npart, 0.2, gsm=False)[1].item() == 0.0
