"""fedssl.core.spread: the per-round meter the pre-training trainers report and the 1/sqrt(D) reference."""

import pytest
import torch

from fedssl.core.spread import SpreadMeter, uniform_reference


def test_meter_averages_the_steps_and_is_none_before_any():
    meter = SpreadMeter()
    assert meter.mean is None
    meter.add(torch.eye(2))  # rows e_1, e_2: 0.5
    meter.add(torch.ones(3, 2))  # identical rows: 0
    assert meter.mean == pytest.approx(0.25)


def test_reference_and_its_argument_check():
    assert uniform_reference(64) == pytest.approx(0.125)
    with pytest.raises(ValueError, match="dim=0"):
        uniform_reference(0)
