import numpy as np
import pytest
from nvflare.apis.dxo import DXO, DataKind, from_shareable

from fedssl.flare.feature_bank_perturbation import FeatureBankPerturbation
from tests.unit.flare.fakes import context


def test_bank_is_perturbed_and_weights_untouched(monkeypatch):
    """Each row f becomes normalise(f + N(0, sigma^2 I)), the noise from the site's secret (pinned here to 7)."""
    monkeypatch.setattr("fedssl.flare.feature_bank_perturbation.secrets.randbits", lambda bits: 7)
    bank = np.eye(3, dtype=np.float32)
    s = DXO(DataKind.WEIGHTS, data={"w": np.ones(2)}, meta={"bank_features": bank, "num_samples": 2}).to_shareable()
    out = from_shareable(FeatureBankPerturbation(sigma=0.2).process(s, context()))
    noisy = bank + 0.2 * np.random.default_rng(7).standard_normal((3, 3)).astype(np.float32)
    expected = noisy / np.sqrt((noisy ** 2).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(out.get_meta_prop("bank_features"), expected, rtol=1e-5, atol=1e-6)
    assert out.get_meta_prop("num_samples") == 2 and np.allclose(out.data["w"], 1.0)


def test_without_bank_nothing_changes():
    s = DXO(DataKind.WEIGHTS, data={"w": np.ones(2)}).to_shareable()
    assert FeatureBankPerturbation().process(s, context()) is s


@pytest.mark.parametrize("sigma", [0, -1, "0.1", None])
def test_misconfigured_filter_refuses_to_build(sigma):
    with pytest.raises(ValueError, match="sigma"):
        FeatureBankPerturbation(sigma=sigma)
