"""FedDRA's segmentation downstream task (fedssl.train.vlp_segment): Dice, the mixed loss, a tiny run."""

from __future__ import annotations

import math

import pytest
import torch

from fedssl.train.vlp_segment import SegmentationSettings, dice_per_image, few_shot_segmentation, mixed_loss

torch.set_num_threads(1)


def test_dice_per_image_as_mgca_counts_it():
    truth = torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    prob = torch.tensor([[0.9, 0.2, 0.8, 0.1], [0.1, 0.2, 0.3, 0.4], [0.6, 0.0, 0.0, 0.0]])
    # image 1: P = {0, 2}, T = {0, 1}: 2 * 1 / 4; image 2: empty and nothing predicted: 1; image 3: a false positive: 0
    assert dice_per_image(prob, truth).tolist() == pytest.approx([0.5, 1.0, 0.0])


def test_mixed_loss_is_alpha_focal_minus_log_soft_dice():
    logits, truth = torch.tensor([0.0, 0.0]), torch.tensor([1.0, 0.0])
    bce = math.log(2)
    focal = (0.5 ** 2) * bce  # p_t = 1/2 for both pixels
    dice = (2 * 0.5 + 1) / (1.0 + 1.0 + 1)
    assert mixed_loss(logits, truth, alpha=10.0, gamma=2.0).item() == pytest.approx(10 * focal - math.log(dice))


def test_a_tiny_decoder_run_leaves_the_encoder_and_the_callers_generators_alone(tmp_path):
    from fedssl.data.vlp_segmentation import RSNASegmentationDataset, load_rsna_segmentation
    from fedssl.data.vlp_synthetic import write_synthetic_rsna
    from fedssl.models.vlp import VisionLanguageModel

    write_synthetic_rsna(tmp_path / "r", n_images=20, image_px=32, seed=0)
    items = load_rsna_segmentation(tmp_path / "r")
    tr, te = RSNASegmentationDataset(items[:15], 32, 3), RSNASegmentationDataset(items[15:], 32, 3)
    model = VisionLanguageModel(preset="tiny")
    before = {k: v.clone() for k, v in model.image_encoder.state_dict().items()}
    rng = torch.get_rng_state()
    settings = SegmentationSettings(fractions=(0.2,), epochs=2, batch_size=4, decoder_channels=(8, 8, 8))
    a = few_shot_segmentation(model.image_encoder, 8, 3, tr, te, seed=0, settings=settings)
    b = few_shot_segmentation(model.image_encoder, 8, 3, tr, te, seed=0, settings=settings)
    assert a == b and 0 <= a["20%"]["dice"] <= 1 and a["20%"]["n_test"] == 5
    assert torch.equal(rng, torch.get_rng_state())
    assert all(torch.equal(before[k], v) for k, v in model.image_encoder.state_dict().items())
    with pytest.raises(ValueError, match="argument epochs=0"):
        SegmentationSettings(epochs=0)
