"""MGCA's loss (fedssl.core.vlp_mgca): ITA, token weights, CTA, Sinkhorn codes and CPA, by hand."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fedssl.core.vlp_mgca import MGCASettings, cpa_loss, cta_loss, ita_loss, mgca_loss, sinkhorn, token_weights

torch.set_num_threads(1)


def test_ita_is_the_mean_of_the_two_directions():
    eye = torch.eye(2)
    assert ita_loss(eye, eye, tau1=0.1).item() == pytest.approx(math.log(1 + math.exp(-10)), abs=1e-6)


def test_sinkhorn_splits_the_batch_equally_among_the_prototypes():
    # both samples prefer prototype 0; the equal-partition constraint gives each prototype half of each sample
    q = sinkhorn(torch.tensor([[1.0, 0.0], [1.0, 0.0]]), epsilon=1.0, iterations=3)
    assert q.tolist() == [[pytest.approx(0.5), pytest.approx(0.5)]] * 2


def test_token_weights_clip_to_the_10th_and_90th_percentiles_and_sum_to_one():
    w = token_weights(torch.tensor([[0.1, 0.2, 0.3, 0.4, 9.0]]), torch.tensor([[True, True, True, True, False]]))
    clipped = [0.13, 0.2, 0.3, 0.37]
    assert w[0, :4].tolist() == pytest.approx([c / sum(clipped) for c in clipped], rel=1e-5) and w[0, 4] == 0


def _cta_by_loops(patches, pa, words, wa, tau):
    """CTA written out token by token (one sample, no padding)."""
    def weights(a):
        lo, hi = torch.quantile(a, 0.1), torch.quantile(a, 0.9)
        a = a.clamp(lo, hi)
        return a / a.sum()

    def side(q, k, w):
        o = F.normalize(torch.softmax(q @ k.t() / tau, dim=1) @ k, dim=1)
        n, total = len(q), 0.0
        for i in range(n):
            row = [math.exp(float(q[i] @ o[j]) / tau) for j in range(n)]
            col = [math.exp(float(q[j] @ o[i]) / tau) for j in range(n)]
            total += float(w[i]) * 0.5 * (-math.log(row[i] / sum(row)) - math.log(col[i] / sum(col)))
        return total

    return side(words, patches, weights(wa)) + side(patches, words, weights(pa))


def test_cta_matches_the_token_by_token_formula():
    g = torch.Generator().manual_seed(0)
    patches = F.normalize(torch.randn(1, 4, 3, generator=g), dim=-1)
    words = F.normalize(torch.randn(1, 3, 3, generator=g), dim=-1)
    pa, wa = torch.tensor([[0.1, 0.4, 0.2, 0.3]]), torch.tensor([[0.5, 0.3, 0.2]])
    got = cta_loss(patches, pa, words, torch.ones(1, 3, dtype=torch.bool), wa, tau2=0.1)
    assert got.item() == pytest.approx(_cta_by_loops(patches[0], pa[0], words[0], wa[0], 0.1), rel=1e-4)
    # a padded word changes nothing
    padded = torch.cat([words, torch.tensor([[[0.0, 1.0, 0.0]]])], dim=1)
    mask = torch.tensor([[True, True, True, False]])
    got_padded = cta_loss(patches, pa, padded, mask, torch.cat([wa, torch.tensor([[0.9]])], 1), tau2=0.1)
    assert got_padded.item() == pytest.approx(got.item(), rel=1e-5)


def test_cpa_predicts_the_balanced_code_of_the_other_modality():
    z = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    loss = cpa_loss(z, z, torch.eye(2), tau3=0.2, epsilon=0.05, iterations=3)
    # codes 1/2 each; p = softmax((1, 0) / 0.2)
    expected = 0.5 * (math.log(1 + math.exp(-5)) + math.log(1 + math.exp(5)))
    assert loss.item() == pytest.approx(expected, rel=1e-4)


def test_total_weights_and_settings_checks():
    eye = torch.eye(2)
    tokens = eye.unsqueeze(1)
    args = (eye, eye, tokens, torch.ones(2, 1), tokens, torch.ones(2, 1, dtype=torch.bool), torch.ones(2, 1), eye)
    total, terms = mgca_loss(*args, MGCASettings(lambda1=2.0, lambda2=0.0, lambda3=0.0, num_prototypes=2))
    assert total.item() == pytest.approx(2 * terms["loss_ita"], rel=1e-5)
    with pytest.raises(ValueError, match=r"argument num_prototypes=1 .*paper: 500"):
        MGCASettings(num_prototypes=1)
