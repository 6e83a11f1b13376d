"""Soft targets of SSL-FL's fine-tuning (issue 47): label smoothing, mixed targets and the soft-target cross-entropy,
against hand-computed values (and timm's implementation, which the reference code calls)."""

import math

import pytest
import torch
from torch.nn import functional as F

from fedssl.core.soft_targets import mixed_targets, smoothed_one_hot, soft_target_cross_entropy


def test_mixup_of_two_one_hot_targets_with_lambda_0_3_gives_exactly_0_3_and_0_7():
    y = torch.tensor([0, 1])  # the batch reversed pairs image 0 with image 1
    t = mixed_targets(y, 2, 0.3)
    assert t.dtype == torch.float32 and torch.equal(t, torch.tensor([[0.3, 0.7], [0.7, 0.3]]))  # exact in float32
    t3 = mixed_targets(torch.tensor([2, 1, 0]), 3, 0.3)  # odd batch: the middle image is its own partner
    assert torch.equal(t3, torch.tensor([[0.7, 0.0, 0.3], [0.0, 1.0, 0.0], [0.3, 0.0, 0.7]]))


@pytest.mark.parametrize("k", [2, 3, 8])
def test_label_smoothing_0_1_over_k_classes(k):
    t = smoothed_one_hot(torch.tensor([1, 0]), k, 0.1)
    on, off = 1 - 0.1 + 0.1 / k, 0.1 / k
    assert t[0, 1].item() == pytest.approx(on, abs=1e-7) and t[1, 0].item() == pytest.approx(on, abs=1e-7)
    others = [t[0, j].item() for j in range(k) if j != 1] + [t[1, j].item() for j in range(1, k)]
    assert others == pytest.approx([off] * (2 * (k - 1)), abs=1e-7)
    assert t.sum(1).tolist() == pytest.approx([1.0, 1.0], abs=1e-6)
    assert smoothed_one_hot(torch.tensor([1, 0]), k).tolist() == F.one_hot(torch.tensor([1, 0]), k).float().tolist()


def test_mixed_targets_carry_the_smoothing_inside_each_code():
    # K = 2, s = 0.1: codes (0.95, 0.05) / (0.05, 0.95); lam 0.3 -> 0.3 * 0.95 + 0.7 * 0.05 = 0.32 on class 0
    t = mixed_targets(torch.tensor([0, 1]), 2, 0.3, 0.1)
    assert t[0].tolist() == pytest.approx([0.32, 0.68], abs=1e-6) and t[1].tolist() == pytest.approx([0.68, 0.32],
                                                                                                          abs=1e-6)
    assert mixed_targets(torch.tensor([0, 1]), 2, 1.0, 0.1).tolist() == smoothed_one_hot(torch.tensor([0, 1]), 2,
                                                                                          0.1).tolist()


def test_soft_target_cross_entropy_by_hand():
    logits = torch.tensor([[0.0, math.log(3.0)]])  # softmax (0.25, 0.75)
    loss = soft_target_cross_entropy(logits, torch.tensor([[0.3, 0.7]]))
    assert loss.item() == pytest.approx(-(0.3 * math.log(0.25) + 0.7 * math.log(0.75)), rel=1e-6)
    g = torch.Generator().manual_seed(0)
    z, y = torch.randn(6, 4, generator=g), torch.tensor([0, 3, 1, 2, 2, 0])
    # one-hot targets: plain cross-entropy; smoothed ones: cross-entropy with label smoothing (the trainer's loss
    # when mixing is off, timm's LabelSmoothingCrossEntropy in the reference)
    assert soft_target_cross_entropy(z, smoothed_one_hot(y, 4)).item() == pytest.approx(F.cross_entropy(z, y).item())
    assert soft_target_cross_entropy(z, smoothed_one_hot(y, 4, 0.1)).item() == pytest.approx(
        F.cross_entropy(z, y, label_smoothing=0.1).item(), rel=1e-6)


def test_the_same_targets_and_loss_as_timm_which_the_reference_calls():
    timm_mixup = pytest.importorskip("timm.data.mixup")
    timm_loss = pytest.importorskip("timm.loss")
    y = torch.tensor([0, 2, 1, 1, 0])
    for lam, s in ((0.3, 0.1), (0.77, 0.0), (1.0, 0.1)):
        ours = mixed_targets(y, 3, lam, s)
        assert torch.allclose(ours, timm_mixup.mixup_target(y, 3, lam, s), atol=1e-7)
        z = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))
        assert soft_target_cross_entropy(z, ours).item() == pytest.approx(
            timm_loss.SoftTargetCrossEntropy()(z, ours).item(), rel=1e-6)


@pytest.mark.parametrize("call, needle", [
    (lambda: smoothed_one_hot(torch.tensor([0, 2]), 2), "labels must lie in 0..1"),
    (lambda: smoothed_one_hot(torch.tensor([[0]]), 2), r"\[B\] tensor"),
    (lambda: smoothed_one_hot(torch.tensor([0]), 2, 1.0), "smoothing=1.0"),
    (lambda: mixed_targets(torch.tensor([0]), 2, 1.5), "lam=1.5"),
    (lambda: soft_target_cross_entropy(torch.zeros(2, 3), torch.zeros(2, 2)), "must both be"),
])
def test_bad_inputs_are_refused(call, needle):
    with pytest.raises(ValueError, match=needle):
        call()
