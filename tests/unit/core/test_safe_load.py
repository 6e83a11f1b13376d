"""safe_load: tensors and numpy arrays load; any other pickled object is refused (no code runs)."""

import pickle

import numpy as np
import pytest
import torch

from fedssl.core.safe_load import safe_load


class Payload:
    ran = False

    def __reduce__(self):
        return (setattr, (Payload, "ran", True))


def test_loads_tensors_and_numpy_arrays(tmp_path):
    path = tmp_path / "m.pt"
    torch.save({"model": {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": torch.ones(2)}, "round": 3,
                "rng": torch.get_rng_state()}, path)
    data = safe_load(str(path))
    assert data["round"] == 3 and torch.equal(data["model"]["b"], torch.ones(2))
    np.testing.assert_array_equal(data["model"]["w"], np.arange(6, dtype=np.float32).reshape(2, 3))


def test_refuses_an_arbitrary_object(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"x": Payload()}, path)
    with pytest.raises(pickle.UnpicklingError):
        safe_load(str(path))
    assert Payload.ran is False
