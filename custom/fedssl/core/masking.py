"""Patch masking for masked image modelling (SSL-FL (Yan et al., IEEE TMI 2023) section III-C.1).

* MAE: random masking, a uniformly random subset of exactly ``round(L * ratio)`` patches per image
  (argsort of uniform noise, as in MAE's ``random_masking``).
* BEiT: block-wise masking, SSL-FL's ``MaskingGenerator`` (``code/util/masking_generator.py`` of rui-yan/SSL-FL,
  BEiT's generator): rectangles whose drawn area lies between ``min_block`` patches and the remaining budget,
  aspect ratio in ``[min_aspect, 1 / min_aspect]``, are added until the masked count reaches the budget; a block is
  only added when it keeps the count at or below the budget, so the ratio is "at most" ``max_mask_ratio``
  (SSL-FL sec. IV-A.3: "we randomly mask at most 40% of total image patches for BEiT").  The budget is the
  reference's ``round(max_mask_ratio * 196 / 5) * 5`` patches of the 14 x 14 grid (``code/util/datasets.py``:
  80 of 196 for 0.4), scaled by area on other grids (26 of 64 on the 8 x 8 tiny grid).  Measured over 2000
  masks of the 14 x 14 grid at 0.4: mean masked fraction 0.406 here and 0.406 for a port of the reference
  (0.385 before, when the budget was ``floor(0.4 L) = 78`` and blocks under ``min_block`` were redrawn).

Every draw comes from a ``torch.Generator``, so a seeded generator gives the same masks.
"""

from __future__ import annotations

import math

import torch

#: BEiT's minimum block (16 patches) on its 14 x 14 grid; scaled by grid area for other grids.
BEIT_MIN_BLOCK = 16
BEIT_NUM_PATCHES = 196


def num_masked(num_patches: int, mask_ratio: float) -> int:
    """Number of masked patches of random masking: ``round(L * ratio)``; at least one patch stays visible
    and at least one is masked."""
    if not 0.0 < float(mask_ratio) < 1.0:
        raise ValueError(f"mask_ratio={mask_ratio!r} must be in (0, 1) (SSL-FL MAE: 0.6, FedMAE: 0.75)")
    n = int(round(num_patches * float(mask_ratio)))
    if not 0 < n < num_patches:
        raise ValueError(
            f"mask_ratio={mask_ratio} masks {n} of {num_patches} patches; it must mask at least one patch and "
            "keep at least one visible"
        )
    return n


def random_masking(
    batch: int, num_patches: int, mask_ratio: float, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MAE random masking, one independent mask per sample.

    Returns ``ids_keep [B, L - M]`` (indices of the visible patches, ascending noise order),
    ``mask [B, L]`` (bool, True = masked) and ``ids_restore [B, L]`` (``ids_restore[b, i]`` is the position
    of patch ``i`` in the shuffled order, so ``torch.gather(shuffled, 1, ids_restore)`` restores patch order).
    Tensors are on the generator's device (CPU by default).
    """
    m = num_masked(num_patches, mask_ratio)
    device = generator.device if generator is not None else torch.device("cpu")
    noise = torch.rand(batch, num_patches, generator=generator, device=device)  # [B, L]
    ids_shuffle = torch.argsort(noise, dim=1)  # small noise first: kept
    ids_restore = torch.argsort(ids_shuffle, dim=1)
    ids_keep = ids_shuffle[:, : num_patches - m]
    mask = torch.ones(batch, num_patches, dtype=torch.bool, device=device)
    mask[:, : num_patches - m] = False
    mask = torch.gather(mask, 1, ids_restore)  # back to patch order
    return ids_keep, mask, ids_restore


def default_min_block(num_patches: int) -> int:
    """BEiT's 16-patch minimum block on a 14 x 14 grid, scaled by grid area (8 x 8 -> 5), at least 1."""
    return max(1, int(round(BEIT_MIN_BLOCK * num_patches / BEIT_NUM_PATCHES)))


def block_mask_target(num_patches: int, max_mask_ratio: float) -> int:
    """The masked-patch budget of block masking: SSL-FL's ``round(max_mask_ratio * 196 / 5) * 5`` on the
    14 x 14 grid (80 for 0.4), scaled by area to ``num_patches`` and rounded (26 on 64 patches), at least 1."""
    if not 0.0 < float(max_mask_ratio) < 1.0:
        raise ValueError(f"max_mask_ratio={max_mask_ratio!r} must be in (0, 1) (SSL-FL BEiT: 0.4)")
    reference = round(float(max_mask_ratio) * BEIT_NUM_PATCHES / 5.0) * 5
    return max(1, min(int(round(reference * num_patches / BEIT_NUM_PATCHES)), num_patches - 1))


def _uniform(lo: float, hi: float, generator: torch.Generator | None) -> float:
    return lo + (hi - lo) * float(torch.rand((), generator=generator))


def _randint(lo: int, hi_inclusive: int, generator: torch.Generator | None) -> int:
    return int(torch.randint(lo, hi_inclusive + 1, (), generator=generator))


def block_masking(
    grid_h: int,
    grid_w: int,
    max_mask_ratio: float = 0.4,
    min_block: int | None = None,
    generator: torch.Generator | None = None,
    min_aspect: float = 0.3,
    max_attempts: int = 10,
) -> torch.Tensor:
    """BEiT block-wise masking of one image: ``BoolTensor [grid_h * grid_w]`` (row-major, True = masked).

    As SSL-FL's / BEiT's ``MaskingGenerator``: draw a block area uniformly between ``min_block`` and the
    remaining budget (the last blocks may be smaller than ``min_block`` once less than that is left) and a
    log-uniform aspect ratio, place it uniformly (strictly smaller than the grid), and add it when it masks at
    least one new patch without exceeding the budget; stop at the budget or after ``max_attempts`` failed draws.
    """
    gh, gw = int(grid_h), int(grid_w)
    if gh < 2 or gw < 2:
        raise ValueError(f"block masking needs a grid of at least 2 x 2 patches, got {gh} x {gw}")
    n = gh * gw
    target = block_mask_target(n, max_mask_ratio)
    min_block = default_min_block(n) if min_block is None else int(min_block)
    if not 1 <= min_block <= target:
        raise ValueError(
            f"min_block={min_block} must be in [1, {target}] (the budget of {max_mask_ratio} x {n} patches); "
            f"BEiT uses 16 on a 14 x 14 grid, default here {default_min_block(n)}"
        )
    if not 0.0 < min_aspect <= 1.0:
        raise ValueError(f"min_aspect={min_aspect!r} must be in (0, 1] (BEiT: 0.3)")
    log_aspect = (math.log(min_aspect), math.log(1.0 / min_aspect))
    mask = torch.zeros(gh, gw, dtype=torch.bool)
    count = 0
    while count < target:
        budget = target - count
        delta = 0
        for _ in range(max_attempts):
            area = _uniform(min_block, budget, generator)  # as random.uniform: budget < min_block draws in between
            aspect = math.exp(_uniform(*log_aspect, generator))
            h = int(round(math.sqrt(area * aspect)))
            w = int(round(math.sqrt(area / aspect)))
            if not (h < gh and w < gw):
                continue
            top = _randint(0, gh - h, generator)
            left = _randint(0, gw - w, generator)
            block = mask[top : top + h, left : left + w]
            new = h * w - int(block.sum())
            if 0 < new <= budget:
                block.fill_(True)
                delta = new
                break
        if delta == 0:
            break
        count += delta
    return mask.reshape(n)


def block_masks(
    batch: int,
    grid_h: int,
    grid_w: int,
    max_mask_ratio: float = 0.4,
    min_block: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One independent :func:`block_masking` per sample: ``BoolTensor [B, grid_h * grid_w]``."""
    return torch.stack(
        [block_masking(grid_h, grid_w, max_mask_ratio, min_block, generator) for _ in range(int(batch))]
    )
