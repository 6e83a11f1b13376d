"""Mixup, CutMix and random erasing of SSL-FL's fine-tuning batches (issue 47; fedssl.data.mixup): hand-computed
boxes, lambdas and mixes, the draws coming from the caller's generator only, and the argument checks."""

import math
import random

import numpy as np
import pytest
import torch

from fedssl.data.mixup import (
    ERASE_AREA,
    BatchAugment,
    box_lam,
    centred_box,
    cutmix_box,
    draw_mix,
    erasing_box,
    mix_batch,
    random_erasing,
    sample_beta,
)

#: rui-yan/SSL-FL's Fed-MAE fine-tuning recipe (the jobs' values); erasing on to exercise it
RECIPE = dict(mixup_alpha=0.8, cutmix_alpha=1.0, cutmix_minmax=None, mixup_prob=1.0, mixup_switch_prob=0.5,
              mixup_mode="batch", erasing_prob=0.25, erasing_mode="pixel", erasing_count=1)
OFF = dict(RECIPE, mixup_alpha=0.0, cutmix_alpha=0.0, erasing_prob=0.0)


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def clone(g):
    c = torch.Generator()
    c.set_state(g.get_state())
    return c


def batch(n=4, c=3, h=16, w=16, seed=1):
    return torch.randn(n, c, h, w, generator=gen(seed))


# ------------------------------------------------------------------------------------------------ Beta draws
@pytest.mark.parametrize("alpha", [0.8, 1.0, 0.3, 4.0])
def test_beta_draws_have_the_beta_mean_and_variance(alpha):
    g = gen(int(alpha * 10))
    x = torch.tensor([sample_beta(alpha, g) for _ in range(3000)], dtype=torch.float64)
    var = 1.0 / (4.0 * (2.0 * alpha + 1.0))  # Beta(a, a): mean 1/2, variance 1 / (4 (2a + 1))
    assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0
    assert abs(float(x.mean()) - 0.5) < 4 * math.sqrt(var / 3000)
    assert float(x.var()) == pytest.approx(var, rel=0.1)


# ------------------------------------------------------------------------------------------------ mix parameters
def test_a_batch_that_is_not_mixed_draws_lam_1_and_nothing_else():
    g = gen()
    state = g.get_state()
    assert draw_mix(g, 0.0, 0.0) == (1.0, False) and torch.equal(g.get_state(), state)  # both off: no draw at all
    assert draw_mix(g, 0.8, 1.0, prob=0.0) == (1.0, False)
    assert not torch.equal(g.get_state(), state)  # the one draw that decided it


def test_switch_probability_picks_cutmix_or_mixup():
    assert all(draw_mix(gen(s), 0.8, 1.0, switch_prob=1.0)[1] for s in range(20))
    assert not any(draw_mix(gen(s), 0.8, 1.0, switch_prob=0.0)[1] for s in range(20))
    assert all(draw_mix(gen(s), 0.0, 1.0, switch_prob=0.0)[1] for s in range(20))  # CutMix alone
    assert not any(draw_mix(gen(s), 0.8, 0.0, switch_prob=1.0)[1] for s in range(20))  # mixup alone
    picks = [draw_mix(gen(s), 0.8, 1.0, switch_prob=0.5)[1] for s in range(400)]
    assert 0.4 < sum(picks) / len(picks) < 0.6


def test_draw_order_is_prob_then_switch_then_beta():
    g = gen(3)
    c = clone(g)
    lam, use_cutmix = draw_mix(g, 0.8, 1.0, prob=1.0, switch_prob=0.5)
    u_prob = float(torch.rand((), generator=c, dtype=torch.float64))
    u_switch = float(torch.rand((), generator=c, dtype=torch.float64))
    assert u_prob < 1.0 and use_cutmix == (u_switch < 0.5)
    assert lam == sample_beta(1.0 if use_cutmix else 0.8, c)


# ------------------------------------------------------------------------------------------------ CutMix box
def test_cutmix_box_area_gives_the_lambda_correction():
    # 8 x 8, lam 0.75: sides int(8 * sqrt(0.25)) = 4, rows cy - 2 .. cy + 2
    assert centred_box(8, 8, 0.75, 4, 4) == (2, 6, 2, 6) and box_lam((2, 6, 2, 6), 8, 8) == 1 - 16 / 64
    # centred on a corner the box is clipped to 2 x 2: lam rises from 0.75 to 1 - 4 / 64
    assert centred_box(8, 8, 0.75, 0, 0) == (0, 2, 0, 2) and box_lam((0, 2, 0, 2), 8, 8) == 0.9375
    # odd sides (timm 0.3.2): int(10 * sqrt(1 - 0.51)) = 7, rows cy - 3 .. cy + 3 (6 rows), 6 x 6 = 36 of 100
    assert centred_box(10, 10, 0.51, 5, 5) == (2, 8, 2, 8) and box_lam(centred_box(10, 10, 0.51, 5, 5), 10, 10) == 0.64
    assert centred_box(8, 8, 1.0, 3, 3) == (3, 3, 3, 3) and box_lam((3, 3, 3, 3), 8, 8) == 1.0
    # clipped on one side only: rows 0-2, columns 2-6, 8 pixels of 64
    assert centred_box(8, 8, 0.75, 0, 4) == (0, 2, 2, 6) and box_lam((0, 2, 2, 6), 8, 8) == 1 - 8 / 64
    # a non-square image: 8 x 16 at lam 0.75 -> 4 x 8 box
    assert centred_box(8, 16, 0.75, 4, 8) == (2, 6, 4, 12) and box_lam((2, 6, 4, 12), 8, 16) == 1 - 32 / 128


def test_cutmix_box_draws_its_centre_from_the_generator():
    for seed in range(30):
        g = gen(seed)
        c = clone(g)
        box, lam = cutmix_box(12, 10, 0.6, g)
        cy, cx = int(torch.randint(0, 12, (), generator=c)), int(torch.randint(0, 10, (), generator=c))
        assert box == centred_box(12, 10, 0.6, cy, cx) and lam == box_lam(box, 12, 10)


def test_cutmix_minmax_box_lies_inside_the_image_with_sides_in_range():
    for seed in range(30):
        (top, bottom, left, right), lam = cutmix_box(20, 20, 0.5, gen(seed), minmax=(0.2, 0.8))
        assert 0 <= top < bottom <= 20 and 0 <= left < right <= 20
        assert 4 <= bottom - top < 16 and 4 <= right - left < 16
        assert lam == 1 - (bottom - top) * (right - left) / 400
    with pytest.raises(ValueError, match=r"cutmix_minmax=\[0.5, 0.55\] leaves no box size"):
        cutmix_box(8, 8, 0.5, gen(), minmax=(0.5, 0.55))


# ------------------------------------------------------------------------------------------------ mixing
def test_mixup_and_cutmix_of_a_two_image_batch_by_hand():
    x = torch.stack([torch.ones(1, 4, 4), torch.zeros(1, 4, 4)])
    mixed = mix_batch(x, 0.3)
    assert torch.equal(mixed[0], torch.full((1, 4, 4), 0.3)) and torch.equal(mixed[1], torch.full((1, 4, 4), 0.7))
    cut = mix_batch(x, 0.75, (1, 3, 0, 2))
    expect0 = torch.ones(1, 4, 4)
    expect0[:, 1:3, 0:2] = 0.0
    assert torch.equal(cut[0], expect0) and torch.equal(cut[1], 1.0 - expect0)
    assert torch.equal(x[0], torch.ones(1, 4, 4))  # the input is left alone


def test_an_odd_batch_keeps_its_middle_image():
    x = batch(n=5)
    assert torch.equal(mix_batch(x, 0.4)[2], x[2] * 0.4 + x[2] * 0.6)
    assert torch.equal(mix_batch(x, 0.4, (0, 8, 0, 8))[2], x[2])


# ------------------------------------------------------------------------------------------------ random erasing
def test_erasing_with_prob_0_is_the_identity_and_draws_nothing():
    x, g = batch(), gen()
    state = g.get_state()
    assert random_erasing(x, g, 0.0) is x and torch.equal(g.get_state(), state)


def test_erasing_with_prob_1_changes_exactly_the_drawn_box():
    """Replayed from a copy of the generator: per image, the coin, the box (erasing_box), the noise; every pixel in
    the box is the noise, every other pixel of the batch is untouched."""
    x = batch(n=3, h=24, w=20)
    for seed in range(10):
        g = gen(seed)
        c = clone(g)
        out = random_erasing(x, g, 1.0, "pixel", 1)
        for i in range(3):
            assert float(torch.rand((), generator=c, dtype=torch.float64)) < 1.0  # the per-image coin
            top, bottom, left, right = erasing_box(24, 20, 1, c)
            fill = torch.randn((3, bottom - top, right - left), generator=c)
            changed = torch.zeros(24, 20, dtype=torch.bool)
            changed[top:bottom, left:right] = True
            assert torch.equal(out[i][:, changed], fill.reshape(3, -1))
            assert torch.equal(out[i][:, ~changed], x[i][:, ~changed])
            assert torch.equal((out != x).any(1)[i], changed)  # nothing else moved
        assert torch.equal(g.get_state(), c.get_state())  # and the generator is where the replay is


def test_erasing_boxes_fit_and_cover_the_timm_area_range():
    h, w = 32, 32
    areas = []
    for seed in range(200):
        box = erasing_box(h, w, 1, gen(seed))
        if box is None:
            continue
        top, bottom, left, right = box
        assert 0 <= top <= bottom <= h and 0 <= left <= right <= w and bottom - top < h and right - left < w
        areas.append((bottom - top) * (right - left) / (h * w))
    assert len(areas) > 150
    # timm's RandomErasing: area fraction U(0.02, 1/3) (rounding the sides moves it a little), spread over the range
    assert ERASE_AREA == (0.02, 1 / 3)
    assert min(areas) > 0.01 and max(areas) < 0.4 and sum(a > 0.25 for a in areas) > 10


def test_erasing_modes_fill_noise_per_pixel_per_channel_or_zeros():
    x = batch(n=1)
    const = random_erasing(x, gen(2), 1.0, "const")
    assert (const != x).any() and (const[x != const] == 0).all()
    rand = random_erasing(x, gen(2), 1.0, "rand")
    diff = (rand != x)[0, 0]
    for ch in range(3):
        assert rand[0, ch][diff].unique().numel() == 1  # one colour per channel
    with pytest.raises(ValueError, match="mode='bogus'"):
        random_erasing(x, gen(), 1.0, "bogus")


def test_erasing_count_splits_the_area_over_several_boxes():
    x = batch(n=1, h=32, w=32)
    out = random_erasing(x, gen(5), 1.0, "pixel", count=3)
    assert (out != x).any()


# ------------------------------------------------------------------------------------------------ BatchAugment
def test_same_generator_seed_gives_the_same_batch():
    x = batch(n=6)
    aug = BatchAugment(**RECIPE)
    runs = [aug(x, gen(7)) for _ in range(2)]
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]
    others = [aug(x, gen(s)) for s in range(8, 14)]
    assert any(not torch.equal(o[0], runs[0][0]) for o in others)


def test_augmentation_never_touches_the_global_generators():
    torch_state, np_state, py_state = torch.random.get_rng_state(), np.random.get_state(), random.getstate()
    aug = BatchAugment(**RECIPE)
    for s in range(10):
        aug(batch(n=4), gen(s))
    assert torch.equal(torch.random.get_rng_state(), torch_state)
    assert np.array_equal(np.random.get_state()[1], np_state[1]) and np.random.get_state()[2] == np_state[2]
    assert random.getstate() == py_state


def test_off_returns_the_batch_itself_and_draws_nothing():
    x, g = batch(), gen()
    state = g.get_state()
    aug = BatchAugment(**OFF)
    assert not aug.active and aug(x, g) == (x, None) and torch.equal(g.get_state(), state)
    erase_only = BatchAugment(**dict(OFF, erasing_prob=1.0))
    assert erase_only.active and not erase_only.mixing and erase_only(x, gen())[1] is None


def test_the_batch_is_erased_then_mixed_with_the_drawn_lambda():
    x = batch(n=4)
    aug = BatchAugment(**dict(RECIPE, erasing_prob=0.5))
    for seed in range(12):
        g = gen(seed)
        c = clone(g)
        out, lam = aug(x, g)
        erased = random_erasing(x, c, 0.5, "pixel", 1)
        lam0, use_cutmix = draw_mix(c, 0.8, 1.0, 1.0, 0.5)
        if use_cutmix:
            box, lam1 = cutmix_box(16, 16, lam0, c)
            assert lam == lam1 and torch.equal(out, mix_batch(erased, lam1, box))
        else:
            assert lam == lam0 and torch.equal(out, mix_batch(erased, lam0))


def test_cutmix_minmax_turns_cutmix_on():
    aug = BatchAugment(**dict(OFF, cutmix_minmax=(0.2, 0.8)))
    assert aug.mixing
    out, lam = aug(batch(n=4, h=20, w=20), gen())
    assert 0.0 <= lam < 1.0


def test_non_image_batches_are_refused():
    with pytest.raises(ValueError, match=r"image batches \[B, C, H, W\]"):
        BatchAugment(**RECIPE)(torch.zeros(4, 2), gen())


@pytest.mark.parametrize("arg, value, fix", [
    ("mixup_alpha", -0.1, "use 0 (off) or a positive Beta alpha (SSL-FL's Fed-MAE fine-tuning scripts: 0.8)"),
    ("cutmix_alpha", "1", "use 0 (off) or a positive Beta alpha (SSL-FL's Fed-MAE fine-tuning scripts: 1.0)"),
    ("cutmix_minmax", (0.8, 0.2), "use null (box size from lam, the reference's) or [min, max]"),
    ("mixup_prob", 1.5, "use a probability in [0, 1] (reference: 1.0)"),
    ("mixup_switch_prob", True, "use a probability in [0, 1] (reference: 0.5)"),
    ("mixup_mode", "elem", "use \"batch\""),
    ("erasing_prob", -1, "use a probability in [0, 1]"),
    ("erasing_mode", "noise", "use one of ['pixel', 'rand', 'const']"),
    ("erasing_count", 0, "use a positive number of boxes"),
])
def test_each_setting_is_checked_with_argument_value_and_fix(arg, value, fix):
    with pytest.raises(ValueError) as err:
        BatchAugment(**dict(RECIPE, **{arg: value})).check("Trainer")
    assert str(err.value).startswith(f"Trainer: argument {arg}={value!r} is invalid; {fix}")
