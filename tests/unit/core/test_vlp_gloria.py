"""GLoRIA's loss (fedssl.core.vlp_gloria) on vectors small enough to work out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from fedssl.core.vlp_gloria import (GloriaSettings, gloria_loss, global_loss, local_loss, local_scores,
                                    merge_word_pieces, word_attention)

torch.set_num_threads(1)


def test_word_pieces_are_summed_into_words_and_specials_dropped():
    tokens = torch.tensor([[[9.0], [1.0], [2.0], [4.0], [9.0]]])
    index = torch.tensor([[-1, 0, 0, 1, -1]])  # [CLS] "pleu" "##ral" "effusion" [SEP]
    words, mask = merge_word_pieces(tokens, index)
    assert words[0, :, 0].tolist() == [3.0, 4.0] and mask.tolist() == [[True, True]]


def test_attention_is_a_softmax_of_gamma1_times_the_dot_product():
    words = torch.tensor([[[1.0, 0.0]]])
    regions = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    context, a = word_attention(words, regions, gamma1=4.0)
    hi = math.exp(4) / (math.exp(4) + 1)
    assert a[0, 0, 0].tolist() == pytest.approx([hi, 1 - hi])
    assert context[0, 0, 0].tolist() == pytest.approx([hi, 1 - hi])


def test_local_score_is_the_gamma2_log_sum_exp_over_the_words_divided_by_gamma2():
    # one image with regions e1, e2; one report with words e1 and (1, 1) and a padded word that must not count
    regions = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    words = torch.tensor([[[1.0, 0.0], [1.0, 1.0], [0.0, 5.0]]])
    mask = torch.tensor([[True, True, False]])
    z = local_scores(words, mask, regions, gamma1=4.0, gamma2=5.0)
    hi = math.exp(4) / (math.exp(4) + 1)
    r1 = hi / math.sqrt(hi ** 2 + (1 - hi) ** 2)  # cos((hi, 1-hi), (1, 0))
    r2 = 1.0  # word (1,1) attends both regions equally: context (0.5, 0.5), cosine 1
    assert z.item() == pytest.approx(math.log(math.exp(5 * r1) + math.exp(5 * r2)) / 5, rel=1e-5)


def test_global_and_local_losses_of_matched_orthogonal_pairs():
    eye = torch.eye(2)
    expected = 2 * math.log(1 + math.exp(-10))  # gamma3 = 10, both directions added
    assert global_loss(eye, eye).item() == pytest.approx(expected, abs=1e-6)
    # one region per image, one word per report equal to it: R = delta, Z = R (the 1/gamma2 power), logits 10 delta
    regions, words = eye.unsqueeze(1), eye.unsqueeze(1)
    mask = torch.ones(2, 1, dtype=torch.bool)
    assert local_loss(regions, words, mask).item() == pytest.approx(expected, abs=1e-6)
    total, terms = gloria_loss(eye, eye, regions, words, mask, GloriaSettings(local_weight=0.5))
    assert total.item() == pytest.approx(1.5 * expected, abs=1e-6) and set(terms) == {"loss_global", "loss_local"}


def test_a_report_without_words_and_bad_constants_are_refused():
    with pytest.raises(ValueError, match="no word"):
        local_loss(torch.ones(2, 1, 2), torch.ones(2, 1, 2), torch.tensor([[True], [False]]))
    with pytest.raises(ValueError, match=r"argument gamma1=0 .*paper: 4"):
        GloriaSettings(gamma1=0)
