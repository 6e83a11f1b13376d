"""Pooled (centralised) targets: a site's missing classes are unknown (NaN) and never count in the loss."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedssl.core.multilabel import labelled, masked_bce, pool_targets

HEAD = ["A", "B", "C"]


def test_pool_targets_marks_the_sites_missing_classes_unknown():
    t = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # site classes C, A
    full = pool_targets(t, ["C", "A"], HEAD, "site-1")
    assert torch.equal(full[:, [0, 2]], torch.tensor([[0.0, 1.0], [1.0, 0.0]]))
    assert torch.isnan(full[:, 1]).all()
    with pytest.raises(ValueError, match="site-1"):
        pool_targets(t, ["C", "D"], HEAD, "site-1")


def test_unlabelled_entries_do_not_count_in_the_loss():
    logits = torch.tensor([[0.3, -1.0, 2.0], [-0.5, 0.7, 0.1]], requires_grad=True)
    targets = torch.tensor([[1.0, float("nan"), 0.0], [float("nan"), 1.0, 1.0]])
    loss = masked_bce(logits, *labelled(targets))
    by_hand = np.mean([F.binary_cross_entropy_with_logits(logits[i, j], targets[i, j]).item()
                       for i, j in ((0, 0), (0, 2), (1, 1), (1, 2))])
    assert math.isclose(loss.item(), by_hand, rel_tol=1e-6)
    loss.backward()
    assert logits.grad[0, 1] == 0 and logits.grad[1, 0] == 0 and logits.grad[0, 0] != 0
    plain = torch.tensor([[1.0, 0.0, 0.0]])
    assert labelled(plain)[1] is None  # fully labelled: plain BCE, as for the federated methods
