import math

import pytest

from fedssl.core.schedule import cosine_lr, warmup_cosine


def test_linear_warmup_then_cosine_to_min_lr():
    lr = lambda p: warmup_cosine(p, base_lr=1e-3, warmup=5, total=105, min_lr=1e-5)  # noqa: E731
    assert lr(0) == 0.0
    assert math.isclose(lr(2.5), 5e-4)  # half-way through the warm-up
    assert math.isclose(lr(5), 1e-3)  # peak at the end of the warm-up
    assert math.isclose(lr(55), (1e-3 + 1e-5) / 2)  # half-way through the cosine
    assert math.isclose(lr(30), 1e-5 + (1e-3 - 1e-5) * 0.5 * (1 + math.cos(math.pi * 0.25)))
    assert lr(105) == 1e-5 and lr(400) == 1e-5
    values = [lr(5 + i * 0.5) for i in range(201)]
    assert all(a >= b for a, b in zip(values, values[1:]))  # non-increasing after the warm-up


def test_fractional_progress_within_a_round():
    # step 3 of 4 in round 1 with a 2-round warm-up: progress 1.75 rounds
    assert math.isclose(warmup_cosine(1 + 3 / 4, 0.1, 2, 10), 0.1 * 1.75 / 2)


def test_no_warmup_and_warmup_equal_total():
    assert warmup_cosine(0, 0.1, 0, 10) == 0.1
    assert warmup_cosine(3, 0.1, 4, 4) == pytest.approx(0.075)
    assert warmup_cosine(4, 0.1, 4, 4, min_lr=0.01) == 0.01


@pytest.mark.parametrize(
    "args",
    [(-1, 0.1, 1, 10), (0, 0.1, 11, 10), (0, 0.1, 1, 0), (0, 0.0, 1, 10), (0, 0.1, 1, 10, 0.2)],
)
def test_bad_arguments_raise(args):
    with pytest.raises(ValueError, match="warmup_cosine"):
        warmup_cosine(*args)


def test_cosine_lr():
    assert cosine_lr(0.05, 0.0) == pytest.approx(0.05)
    assert cosine_lr(0.05, 0.5) == pytest.approx(0.025)
    assert cosine_lr(0.05, 1.0) == pytest.approx(0.0)
    assert cosine_lr(0.05, -1.0) == cosine_lr(0.05, 0.0) and cosine_lr(0.05, 2.0) == cosine_lr(0.05, 1.0)  # clipped
