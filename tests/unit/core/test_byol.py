"""The BYOL loss (FCL (Wu et al., MedIA 2022) eq. 6) by hand and the paper's learning rates (the trainer:
tests/unit/train/test_byol.py)."""

import pytest
import torch

from fedssl.core.byol import FCLOPT_LR, FEDBYOL_LR, byol_loss


def test_loss_by_hand():
    p = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    z = torch.tensor([[1.0, 0.0], [2.0, 0.0]])  # cos = 1 and 0 -> losses 0 and 2
    assert byol_loss(p, z).item() == pytest.approx(1.0)


def test_paper_learning_rates():
    """FCL section 5, "Training details": lr 0.05 in general (the baselines, FedBYOL), 0.5 for FCLOpt."""
    assert (FCLOPT_LR, FEDBYOL_LR) == (0.5, 0.05)
