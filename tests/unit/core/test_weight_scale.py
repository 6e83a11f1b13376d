import math

import pytest
import torch
from torch import nn

from fedssl.core.weight_scale import compare_kernels, summarise


def test_kernels_by_hand_skip_vectors_and_shape_mismatches():
    ref = {"a": torch.tensor([[1.0, 0.0], [0.0, 0.0]]), "b": torch.full((1, 4), 2.0), "bias": torch.ones(3),
           "c": torch.ones(2, 2)}
    state = {"a": torch.tensor([[3.0, 4.0], [0.0, 0.0]]), "b": torch.full((1, 4), -1.0), "bias": torch.full((3,), 9.0),
             "c": torch.ones(4, 1), "only_here": torch.ones(2, 2)}
    got = compare_kernels(state, ref)
    # a: ||(3, 4)|| = 5 vs 1, cosine 3/5, ||(2, 4)|| = sqrt(20); b: 2 vs 4, opposite, ||(-3,)*4|| = 6 vs 4.
    # The bias (rank 1), c (another shape) and only_here (no reference) are left out.
    assert set(got) == {"a", "b"}
    assert got["a"] == pytest.approx({"ratio": 5.0, "cosine": 0.6, "change": math.sqrt(20)})
    assert got["b"] == pytest.approx({"ratio": 0.5, "cosine": -1.0, "change": 1.5})


def test_summary_is_the_geometric_mean_min_max_and_mean_cosine_and_change():
    kernels = {"a": {"ratio": 3.0, "cosine": 0.5, "change": 1.0}, "b": {"ratio": 0.5, "cosine": 1.0, "change": 0.0},
               "c": {"ratio": 6.0, "cosine": 0.0, "change": 2.0}}
    assert summarise(kernels) == pytest.approx({"geomean": 9 ** (1 / 3), "min": 0.5, "max": 6.0, "n": 3,
                                                "cosine": 0.5, "change": 1.0})


def test_scaling_a_conv_before_instance_norm_keeps_the_function_and_shows_in_the_ratio():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.InstanceNorm2d(4, affine=True), nn.LeakyReLU())
    scaled = nn.Sequential(nn.Conv2d(1, 4, 3), nn.InstanceNorm2d(4, affine=True), nn.LeakyReLU())
    scaled.load_state_dict(net.state_dict())
    with torch.no_grad():
        scaled[0].weight.mul_(5.0)
        scaled[0].bias.mul_(5.0)
    x = torch.randn(2, 1, 8, 8)
    assert torch.allclose(net(x), scaled(x), atol=1e-4)
    assert compare_kernels(scaled.state_dict(), net.state_dict()) == {
        "0.weight": pytest.approx({"ratio": 5.0, "cosine": 1.0, "change": 4.0})}


def test_nothing_to_compare_or_a_zero_reference_is_an_error():
    with pytest.raises(ValueError, match="share no kernel"):
        compare_kernels({"w": torch.ones(3)}, {"w": torch.ones(3)})
    with pytest.raises(ValueError, match="'w' of the reference is all zeros"):
        compare_kernels({"w": torch.ones(2, 2)}, {"w": torch.zeros(2, 2)})
