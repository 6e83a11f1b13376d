"""perturb_features (FCL section 3.4): normalise(f + N(0, sigma^2 I)), by hand with a stand-in noise source."""

import numpy as np
import pytest

from fedssl.core.privacy import perturb_features


class FixedNoise:
    """A ``numpy.random.Generator`` stand-in: ``normal`` returns ``noise`` and records its arguments."""

    def __init__(self, noise):
        self.noise, self.calls = np.asarray(noise, dtype=np.float64), []

    def normal(self, loc, scale, size):
        self.calls.append((loc, scale, tuple(size)))
        return self.noise


def test_noise_is_added_then_rows_are_normalised_by_hand():
    f = np.array([[1.0, 0.0], [0.0, 2.0]], dtype=np.float32)
    rng = FixedNoise([[0.0, 1.0], [-3.0, 2.0]])  # rows become (1, 1) and (-3, 4)
    out = perturb_features(f, 0.1, rng)
    np.testing.assert_allclose(out, [[2 ** -0.5, 2 ** -0.5], [-0.6, 0.8]], rtol=1e-6)
    assert rng.calls == [(0.0, 0.1, (2, 2))]  # N(0, sigma^2), one draw per entry
    np.testing.assert_array_equal(f, [[1.0, 0.0], [0.0, 2.0]])  # input untouched


def test_small_noise_keeps_unit_rows_close_to_the_original():
    f = np.eye(4, dtype=np.float32)
    out = perturb_features(f, 0.1, np.random.default_rng(0))
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, rtol=1e-5)
    assert (out * f).sum(axis=1).min() > 0.8


def test_refuses_zero_sigma():
    with pytest.raises(ValueError, match="sigma=0"):
        perturb_features(np.eye(2), 0, np.random.default_rng(0))
