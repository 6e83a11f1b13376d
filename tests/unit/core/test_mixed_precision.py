"""MixedPrecision (the trainers' ``amp`` switch), run on a CPU with the autocast dtype forced (the trainers' bfloat16
paths, FCL's, BYOL's, FedCLF's and the classifier loop's: in their tests under tests/unit/train): the networks'
convolutions and linear layers compute in bfloat16, the loss, the weights and the banks stay float32, and a round
ends with a finite loss."""

import pytest
import torch
from torch import nn

from fedssl.core.checks import require_amp
from fedssl.core.trainer import MixedPrecision

torch.set_num_threads(1)
BF16 = torch.bfloat16


def layer_dtypes(model: nn.Module) -> list:
    """Records the output dtype of every convolution and linear layer of ``model`` from now on."""
    seen = []
    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.Conv3d, nn.Linear)):
            m.register_forward_hook(lambda mod, i, o: seen.append(o.dtype))
    return seen


def float32(model: nn.Module) -> bool:
    return all(p.dtype == torch.float32 for p in model.parameters())


def test_on_a_cpu_amp_is_plain_float32_and_the_step_is_sgd():
    mp = MixedPrecision("cpu", True)
    assert mp.dtype is None and not mp.enabled and not mp.scaler.is_enabled()
    torch.manual_seed(0)
    lin = nn.Linear(3, 1)
    w0 = lin.weight.detach().clone()
    opt = torch.optim.SGD(lin.parameters(), lr=0.5)
    x = torch.ones(2, 3)
    with mp.autocast():
        out = lin(x)
    assert out.dtype == torch.float32
    loss = out.sum()
    mp.step(loss, opt)
    assert torch.allclose(lin.weight, w0 - 0.5 * 2 * torch.ones(1, 3))  # d(sum)/dW = 2 rows of ones


def test_clip_grad_bounds_the_gradient_norm_before_the_step():
    mp = MixedPrecision("cpu", False)
    lin = nn.Linear(4, 1, bias=False)
    nn.init.zeros_(lin.weight)
    opt = torch.optim.SGD(lin.parameters(), lr=1.0)
    mp.step(lin(torch.full((1, 4), 10.0)).sum(), opt, clip_grad=1.0, parameters=lin.parameters())
    assert lin.weight.norm().item() == pytest.approx(1.0, rel=1e-5)  # the 20-norm gradient clipped to 1


def test_forced_bfloat16_autocasts_linear_layers_on_a_cpu():
    mp = MixedPrecision("cpu", False, force=BF16)
    with mp.autocast():
        assert nn.Linear(2, 2)(torch.ones(1, 2)).dtype == BF16


@pytest.mark.parametrize("bad", [1, "true", None])
def test_the_switch_is_true_or_false(bad):
    with pytest.raises(ValueError, match=f"amp={bad!r}.*use true or false"):
        require_amp("X", bad)
