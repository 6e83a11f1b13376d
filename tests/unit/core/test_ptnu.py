"""PTNU (Algorithm 2) and DP (eqs. 12-15) on tiny tensors with hand-computed values."""

import math

import numpy as np
import pytest

from fedssl.core.ptnu import (
    PTNUError,
    calibrate_alpha,
    global_distance,
    predict_target,
    predicted_distance,
    proxy_distance,
    ptnu_steps,
    valid_distances,
)

THETA = {"online.w": np.array([1.0, 1.0, 1.0, 1.0], np.float32)}
XI = {"target.w": np.array([0.0, 0.0, 2.0, 2.0], np.float32)}  # mean |theta - xi| = 1.0


def test_global_distance_by_hand():
    state = {"online.w": np.array([1.0, 2.0]), "target.w": np.array([0.0, 4.0]), "predictor.b": np.ones(3)}
    assert global_distance(state) == pytest.approx((1 + 2) / 2)


def test_predicted_target_meets_distance_and_moves_monotonically():
    d = 0.5
    xi, n = predict_target(XI, THETA, d, m_d=0.9)
    # 0.9^n <= 0.5 first at n = 7 (0.9^6 = 0.531, 0.9^7 = 0.478)
    assert n == 7
    assert proxy_distance(THETA, xi) <= d + 1e-7
    # the closed form equals Algorithm 2's loop, and every step moves towards theta
    loop, dists = XI["target.w"].astype(np.float64), []
    for _ in range(n):
        loop = 0.9 * loop + 0.1 * THETA["online.w"]
        dists.append(np.abs(loop - 1.0).mean())
    np.testing.assert_allclose(xi["target.w"], loop, rtol=1e-6)
    assert all(b < a for a, b in zip([1.0] + dists, dists))


def test_already_within_distance_means_no_step():
    xi, n = predict_target(XI, THETA, d=2.0)
    assert n == 0 and np.array_equal(xi["target.w"], XI["target.w"])


def test_unreachable_distance_is_a_clear_error():
    with pytest.raises(PTNUError, match="did not reach"):
        ptnu_steps(1.0, 1e-300, m_d=0.995, max_iter=1000)
    with pytest.raises(PTNUError, match="finite"):
        ptnu_steps(1.0, float("nan"))


def test_dp_alpha_recalibration_arithmetic():
    d_pcs = [0.2, 0.4]  # DP = 0.3
    alpha = calibrate_alpha(0.27, d_pcs, previous=1.0)
    assert alpha == pytest.approx(0.9)
    assert predicted_distance(alpha, [0.1, 0.3]) == pytest.approx(0.18)  # 0.9 * 0.2
    assert calibrate_alpha(0.27, [0.0, 0.0], previous=0.8) == 0.8  # nothing to scale: keep alpha
    with pytest.raises(PTNUError):
        predicted_distance(1.0, [])


def test_non_finite_or_missing_distances_are_set_aside():
    good, bad = valid_distances({"site-1": 0.3, "site-2": float("nan"), "site-3": None, "site-4": -1.0})
    assert good == {"site-1": 0.3} and set(bad) == {"site-2", "site-3", "site-4"}
    assert math.isclose(predicted_distance(0.9, list(good.values())), 0.27)


def test_a_forged_distance_cannot_drive_the_prediction():
    """A bool, a string, or a value far above the others' median (>= 3 reports) is set aside."""
    honest = {"site-1": 0.02, "site-2": 0.03, "site-3": 0.025}
    for forged in (1e300, 0.5, True, "0.02"):
        good, bad = valid_distances({**honest, "site-4": forged})
        assert good == honest and set(bad) == {"site-4"}, forged
    good, _ = valid_distances({**honest, "site-4": 0.2})  # 8 x the median: an unusual but possible site
    assert set(good) == {"site-1", "site-2", "site-3", "site-4"}
