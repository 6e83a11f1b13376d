"""fedssl.core.chance: each chance level by hand, and against the loss it is the chance level of, fed an output that
carries no information."""

import math

import pytest
import torch
import torch.nn.functional as F

from fedssl.core.chance import infonce_chance, norm_pix_mae_chance, nt_xent_chance, uniform_chance
from fedssl.core.fcl_loss import contrastive_term
from fedssl.core.fedclf import nt_xent
from fedssl.core.mim import mae_loss


def test_values_by_hand():
    assert infonce_chance(1024) == pytest.approx(6.9324, abs=1e-4)  # ln 1025
    assert infonce_chance(1) == pytest.approx(math.log(2))
    assert nt_xent_chance(16) == pytest.approx(math.log(31))
    assert uniform_chance(64) == pytest.approx(4.1589, abs=1e-4)  # ln 64
    assert norm_pix_mae_chance(48) == pytest.approx(47 / 48)  # 4 x 4 patches of 3 channels


def test_infonce_of_identical_features_is_the_chance_level():
    q = F.normalize(torch.ones(3, 8), dim=1)
    loss = contrastive_term(q, q.unsqueeze(1), q[:1].expand(5, 8), tau=0.1)
    assert loss.tolist() == pytest.approx([infonce_chance(5)] * 3)


def test_nt_xent_of_identical_views_is_the_chance_level():
    z = torch.ones(4, 8)
    assert float(nt_xent(z, z, tau=0.2)) == pytest.approx(nt_xent_chance(4))


def test_uniform_logits_over_the_vocabulary_is_the_chance_level():
    logits = torch.zeros(6, 64)
    assert float(F.cross_entropy(logits, torch.arange(6))) == pytest.approx(uniform_chance(64))


def test_mae_predicting_the_patch_mean_on_norm_pix_targets_is_the_chance_level():
    target = torch.rand(2, 5, 48, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 5, dtype=torch.bool)
    loss = mae_loss(torch.zeros_like(target), target, mask, norm_pix=True)
    assert float(loss) == pytest.approx(norm_pix_mae_chance(48), rel=1e-4)


@pytest.mark.parametrize("fn, bad", [(infonce_chance, 0), (nt_xent_chance, 1), (uniform_chance, 1),
                                     (norm_pix_mae_chance, True)])
def test_counts_are_checked(fn, bad):
    with pytest.raises(ValueError, match="use an integer"):
        fn(bad)
