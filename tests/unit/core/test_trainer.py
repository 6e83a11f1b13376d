"""check_optimizer_state: a saved optimiser state fits the optimiser's parameters or is refused by name (torch
itself checks only the number of parameters per group, so another model's Adam moments would load)."""

import pytest
import torch

from fedssl.core.trainer import check_optimizer_state

torch.set_num_threads(1)


def adam_after_one_step(model):
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1, model.in_features)).sum().backward()
    opt.step()
    return opt


def test_the_state_of_the_same_model_fits():
    torch.manual_seed(0)
    saved = adam_after_one_step(torch.nn.Linear(2, 3)).state_dict()
    check_optimizer_state(torch.optim.Adam(torch.nn.Linear(2, 3).parameters()), saved, "site-1: state")


def test_another_models_moments_are_refused_although_torch_would_load_them():
    torch.manual_seed(0)
    saved = adam_after_one_step(torch.nn.Linear(2, 3)).state_dict()  # weight (3, 2), bias (3,)
    other = torch.optim.Adam(torch.nn.Linear(3, 2).parameters())  # weight (2, 3), bias (2,): same counts
    with pytest.raises(ValueError, match=r"site-1: state: the optimiser's exp_avg of parameter 0 has shape \(3, 2\), "
                                         r"this model's parameter \(2, 3\)"):
        check_optimizer_state(other, saved, "site-1: state")
    other.load_state_dict(saved)  # what the check prevents: torch accepts it and fails at the next step


@pytest.mark.parametrize("saved, needle", [
    ({"state": {}, "param_groups": [{"params": [0]}]}, r"groups of sizes \[1\], this model \[2\]"),
    ({"state": {}, "param_groups": [{"params": [0, 1]}, {"params": [2]}]}, r"sizes \[2, 1\], this model \[2\]"),
    ({"queue": torch.zeros(3)}, "is not an optimiser state dict"),
    (None, "is not an optimiser state dict"),
])
def test_a_state_of_another_shape_of_groups_is_refused(saved, needle):
    with pytest.raises(ValueError, match=needle):
        check_optimizer_state(torch.optim.Adam(torch.nn.Linear(2, 3).parameters()), saved, "state")
