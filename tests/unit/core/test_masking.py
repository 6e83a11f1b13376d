import pytest
import torch

from fedssl.core.masking import (
    block_mask_target,
    block_masking,
    block_masks,
    default_min_block,
    num_masked,
    random_masking,
)

torch.set_num_threads(1)


@pytest.mark.parametrize("ratio,expected", [(0.6, 118), (0.75, 147), (0.3, 59), (0.5, 98)])
def test_random_masking_masks_exactly_round_l_ratio_per_sample(ratio, expected):
    _, mask, _ = random_masking(16, 196, ratio, torch.Generator().manual_seed(0))
    assert mask.dtype == torch.bool and mask.sum(dim=1).tolist() == [expected] * 16
    assert num_masked(196, ratio) == expected


def test_random_masks_differ_per_sample_and_are_seeded():
    ids_keep, mask, ids_restore = random_masking(8, 64, 0.75, torch.Generator().manual_seed(1))
    assert len({tuple(m.tolist()) for m in mask}) == 8
    again = random_masking(8, 64, 0.75, torch.Generator().manual_seed(1))
    assert torch.equal(again[0], ids_keep) and torch.equal(again[1], mask) and torch.equal(again[2], ids_restore)
    other = random_masking(8, 64, 0.75, torch.Generator().manual_seed(2))[1]
    assert not torch.equal(other, mask)


def test_ids_restore_inverts_the_shuffle_and_keep_are_the_visible_patches():
    ids_keep, mask, ids_restore = random_masking(4, 20, 0.6, torch.Generator().manual_seed(3))
    ids_shuffle = torch.argsort(ids_restore, dim=1)
    assert torch.equal(ids_shuffle[:, :8], ids_keep)
    assert torch.equal(torch.gather(ids_shuffle, 1, ids_restore), torch.arange(20).expand(4, 20))
    assert not torch.gather(mask, 1, ids_keep).any()
    assert mask.sum().item() == 4 * 12
    # MAE's decoder un-shuffle: tokens [visible (shuffled order), masked] -> patch order
    x = torch.arange(20).expand(4, 20)
    shuffled = torch.gather(x, 1, ids_shuffle)
    assert torch.equal(torch.gather(shuffled, 1, ids_restore), x)


def test_random_masking_rejects_bad_ratios():
    for bad in (0.0, 1.0, -0.1, 0.001):
        with pytest.raises(ValueError, match="mask"):
            random_masking(2, 64, bad)


def test_block_masking_budget_is_the_reference_budget():
    """SSL-FL code/util/datasets.py: num_mask_patches = round(ratio * 196 / 5) * 5, scaled here by grid area:
    0.4 -> round(15.68) * 5 = 80 of 196; 80 * 64 / 196 = 26.1 -> 26; 0.5 -> round(19.6) * 5 = 100;
    80 * 4 / 196 = 1.6 -> 2 on a 2 x 2 grid."""
    assert block_mask_target(196, 0.4) == 80 and block_mask_target(64, 0.4) == 26
    assert block_mask_target(196, 0.5) == 100 and block_mask_target(4, 0.4) == 2
    assert default_min_block(196) == 16 and default_min_block(64) == 5 and default_min_block(4) == 1


def test_block_masks_mask_40_percent_on_average_as_the_reference():
    """SSL-FL sec. IV-A.3 masks "at most 40%" with BEiT's generator; over 2000 masks a port of the reference
    generator masks 0.406 of the 14 x 14 grid on average (the old budget floor(0.4 L) = 78 with blocks under
    16 patches redrawn gave 0.385)."""
    g = torch.Generator().manual_seed(0)
    for h, w in ((14, 14), (8, 8)):
        masks = block_masks(1000, h, w, 0.4, generator=g)
        counts = masks.sum(dim=1).float()
        assert masks.shape == (1000, h * w) and masks.dtype == torch.bool
        assert counts.max() <= block_mask_target(h * w, 0.4)  # never above the budget
        assert 0.398 <= counts.mean().item() / (h * w) <= 0.414
        assert len({tuple(m.tolist()) for m in masks[:200]}) == 200  # one independent mask per sample


def test_block_masking_is_seeded():
    a = block_masks(5, 14, 14, generator=torch.Generator().manual_seed(7))
    b = block_masks(5, 14, 14, generator=torch.Generator().manual_seed(7))
    c = block_masks(5, 14, 14, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_block_masking_rejects_bad_settings():
    with pytest.raises(ValueError, match="min_block"):
        block_masking(8, 8, 0.4, min_block=30)
    with pytest.raises(ValueError, match="max_mask_ratio"):
        block_masking(8, 8, 1.2)
    with pytest.raises(ValueError, match="2 x 2"):
        block_masking(1, 8)
