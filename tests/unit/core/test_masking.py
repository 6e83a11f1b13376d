from collections import deque

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


def components(mask: torch.Tensor, h: int, w: int) -> list[int]:
    """Sizes of the 4-connected masked regions of a flat [h*w] mask."""
    grid = mask.reshape(h, w).tolist()
    seen = [[False] * w for _ in range(h)]
    sizes = []
    for i in range(h):
        for j in range(w):
            if grid[i][j] and not seen[i][j]:
                seen[i][j] = True
                queue, size = deque([(i, j)]), 0
                while queue:
                    a, b = queue.popleft()
                    size += 1
                    for da, db in ((1, 0), (-1, 0), (0, 1), (0, -1)):
                        x, y = a + da, b + db
                        if 0 <= x < h and 0 <= y < w and grid[x][y] and not seen[x][y]:
                            seen[x][y] = True
                            queue.append((x, y))
                sizes.append(size)
    return sizes


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


def test_block_masking_budget_and_defaults():
    assert block_mask_target(196, 0.4) == 78 and block_mask_target(64, 0.4) == 25
    assert default_min_block(196) == 16 and default_min_block(64) == 5 and default_min_block(4) == 1
    g = torch.Generator().manual_seed(0)
    for h, w in ((14, 14), (8, 8)):
        masks = block_masks(200, h, w, 0.4, generator=g)
        counts = masks.sum(dim=1).float()
        target = block_mask_target(h * w, 0.4)
        assert masks.shape == (200, h * w) and masks.dtype == torch.bool
        assert counts.max() <= target  # never above 40 %
        assert counts.mean() >= 0.9 * target  # BEiT's generator fills the budget nearly always
        assert len({tuple(m.tolist()) for m in masks}) >= 190  # one independent mask per sample


def test_block_masks_are_blocks_of_at_least_min_block_patches():
    g = torch.Generator().manual_seed(4)
    for (h, w), min_block in (((14, 14), 16), ((8, 8), 5), ((14, 14), 9)):
        for _ in range(60):
            m = block_masking(h, w, 0.4, min_block, generator=g)
            sizes = components(m, h, w)
            assert sizes and min(sizes) >= min_block


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
