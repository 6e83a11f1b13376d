"""MixedPrecision (the trainers' ``amp`` switch) and the bfloat16 path of every core trainer, run on a CPU with the
autocast dtype forced: the networks' convolutions and linear layers compute in bfloat16, the loss, the weights and
the banks stay float32, and a round ends with a finite loss."""

import math

import pytest
import torch
from torch import nn

from fedssl.core.byol import BYOLConfig, BYOLTrainer
from fedssl.core.checks import require_amp
from fedssl.core.fedclf import FedCLFConfig, FedCLFTrainer
from fedssl.core.trainer import MixedPrecision
from fedssl.models.unet import TINY_FEATURES, BYOLUNetEncoder

from tests.unit.core.test_classification import TinyClassifier, make_trainer
from tests.unit.core.test_fcl_trainer import batches as fcl_batches, make as make_fcl
from tests.unit.core.test_fedclf import TinyMoCo, _batches as fedclf_batches

torch.set_num_threads(1)
BF16 = torch.bfloat16


def forced(trainer):
    trainer.precision = MixedPrecision("cpu", True, force=BF16)
    return trainer


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


def test_fcl_encoders_run_in_bfloat16_loss_and_bank_stay_float32():
    tr = forced(make_fcl())
    seen = layer_dtypes(tr.model.main)
    out = tr.train_round(fcl_batches(2), 2, 0)
    assert seen and set(seen) == {BF16}
    assert math.isfinite(out["loss"]) and tr.bank.features.dtype == torch.float32 and float32(tr.model)


def test_byol_networks_run_in_bfloat16_and_the_target_stays_float32():
    model = BYOLUNetEncoder(TINY_FEATURES, proj_dim=8, pred_hidden=16, seed=0)
    tr = forced(BYOLTrainer(model, BYOLConfig(lr=0.05, num_rounds=2), lambda x, g: x, seed=0))
    seen = layer_dtypes(model.online)
    out = tr.train_round([torch.rand(4, 1, 32, 32, generator=torch.Generator().manual_seed(0))], 1, 0)
    assert seen and set(seen) == {BF16} and math.isfinite(out["loss"]) and float32(model)


def test_fedclf_moco_runs_in_bfloat16_and_its_bank_stays_float32():
    tr = forced(FedCLFTrainer(TinyMoCo(), FedCLFConfig(queue="fe_neg", bank_size=8, num_rounds=2), seed=0))
    seen = layer_dtypes(tr.model.main)
    out = tr.train_round(fedclf_batches(2), 2, 0)
    assert seen and set(seen) == {BF16}
    assert math.isfinite(out["loss"]) and tr.bank.features.dtype == torch.float32 and float32(tr.model)


def test_classifier_forward_runs_in_bfloat16_with_a_float32_loss():
    torch.manual_seed(0)
    model = TinyClassifier()
    tr = forced(make_trainer(model))
    seen = layer_dtypes(model)
    x, y = torch.randn(8, 2), torch.randint(0, 2, (8,))
    loss = tr.train_round([(x, y)], 0, 1)
    assert seen and set(seen) == {BF16} and math.isfinite(loss) and float32(model)
