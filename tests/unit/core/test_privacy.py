import numpy as np
import pytest

from fedssl.core.privacy import perturb_features


def test_perturbed_rows_are_unit_vectors_and_changed():
    f = np.eye(4, dtype=np.float32)
    out = perturb_features(f, 0.1, np.random.default_rng(0))
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, rtol=1e-5)
    assert not np.allclose(out, f) and np.allclose(f, np.eye(4))  # input untouched
    # small noise keeps features close: cosine with the original stays high
    assert (out * f).sum(axis=1).min() > 0.8


def test_refuses_zero_sigma():
    with pytest.raises(ValueError, match="sigma=0"):
        perturb_features(np.eye(2), 0, np.random.default_rng(0))
