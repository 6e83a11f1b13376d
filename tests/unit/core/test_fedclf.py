"""FedCLF's negative queue modes (eqs. 3-5), its loss (eq. 6) and the FedSimCLR / FedRotation losses, with
hand-computed expectations (the trainer: tests/unit/train/test_fedclf.py)."""

from __future__ import annotations

import math

import pytest
import torch

from fedssl.core.fedclf import (
    NegativeQueue,
    info_nce,
    initial_queue,
    nt_xent,
    queue_update,
    rotated_batch,
    sample_remote,
)
from fedssl.core.memory_bank import FeatureBank

torch.set_num_threads(1)


def test_info_nce_by_hand():
    q, k, neg = torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    # -log(e / (e + e^0)) = log(1 + e^-1)
    assert info_nce(q, k, neg, 1.0).item() == pytest.approx(math.log(1 + math.exp(-1)))
    # temperature 0.5 doubles every logit: log(1 + e^-2)
    assert info_nce(q, k, neg, 0.5).item() == pytest.approx(math.log(1 + math.exp(-2)))


def test_nt_xent_by_hand():
    z = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    # row 0's logits over the other three views: [0 (view 1), 1 (its positive), 0]: -log(e / (e + 2))
    assert nt_xent(z, z.clone(), 1.0).item() == pytest.approx(math.log(1 + 2 / math.e))
    swapped = nt_xent(z, z.flip(0), 1.0)  # positives orthogonal, one negative aligned: -log(1 / (1 + e + 1))
    assert swapped.item() == pytest.approx(math.log(2 + math.e))


def test_rotated_batch_blocks_and_labels():
    x = torch.arange(8.0).view(2, 1, 2, 2)
    views, labels = rotated_batch(x)
    assert labels.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert torch.equal(views[:2], x) and torch.equal(views[2], torch.rot90(x[0], 1, dims=(-2, -1)))
    assert torch.equal(views[7], torch.rot90(x[1], 3, dims=(-2, -1)))
    with pytest.raises(ValueError, match="square"):
        rotated_batch(torch.zeros(1, 1, 2, 3))


def test_queue_modes_start_and_update_as_eqs_4_and_5():
    bank = FeatureBank(6, 2, seed=0)
    bank.enqueue(torch.ones(2, 2), torch.zeros(2, dtype=torch.long))  # oldest entry now at index 2
    remote = torch.tensor([[10.0, 0.0], [20.0, 0.0], [30.0, 0.0]])
    keys = torch.tensor([[-1.0, -1.0], [-2.0, -2.0]])
    g = torch.Generator().manual_seed(0)
    # W/o FE: MoCo's queue, the local bank; the keys replace its two oldest entries, where the bank's are
    q = initial_queue("none", bank, remote)
    q.replace_oldest(*queue_update("none", keys, remote, g))
    assert torch.equal(q.features[2:4], keys) and torch.equal(q.features[:2], bank.features[:2])
    assert q.remote_fraction == 0.0
    # FE (eq. 4): starts as the local bank; B keys + B remote draws replace the 2B oldest
    q = initial_queue("fe", bank, remote)
    q.replace_oldest(*queue_update("fe", keys, remote, g))
    assert torch.equal(q.features[2:4], keys)
    assert all(any(torch.equal(row, r) for r in remote) for row in q.features[4:6])
    assert q.remote_fraction == pytest.approx(2 / 6)
    # FE+Neg (eq. 5): starts as the remote bank; B remote draws replace the oldest B: no local feature ever
    q = initial_queue("fe_neg", bank, remote)
    assert torch.equal(q.features, remote) and q.remote_fraction == 1.0
    q.replace_oldest(*queue_update("fe_neg", keys, remote, g))
    assert all(any(torch.equal(row, r) for r in remote) for row in q.features) and q.ptr == 2


def test_remote_draws_are_uniform_over_the_bank():
    remote = torch.arange(4.0).view(4, 1)
    drawn = sample_remote(remote, 40_000, torch.Generator().manual_seed(1))
    counts = torch.bincount(drawn.view(-1).long(), minlength=4).float() / 40_000
    assert torch.allclose(counts, torch.full((4,), 0.25), atol=0.01)


def test_remote_draws_are_independent_not_a_cycle():
    """Issue 47: drawing round-robin passed the frequency test above.  Eq. (3) draws each index uniformly and
    independently: consecutive pairs cover all 16 combinations about equally (a cycle gives only 4), and the draw
    is torch.randint on the trainer's generator."""
    remote = torch.arange(4.0).view(4, 1)
    drawn = sample_remote(remote, 40_000, torch.Generator().manual_seed(2)).view(-1).long()
    pairs = torch.bincount(drawn[:-1] * 4 + drawn[1:], minlength=16).float() / (40_000 - 1)
    assert torch.allclose(pairs, torch.full((16,), 1 / 16), atol=0.006)
    g = torch.Generator().manual_seed(5)
    expected = torch.randint(4, (7,), generator=torch.Generator().manual_seed(5))
    assert torch.equal(sample_remote(remote, 7, g).view(-1).long(), expected)


def test_queue_keeps_the_last_entries_when_more_arrive_than_it_holds():
    q = NegativeQueue(torch.zeros(2, 1), False)
    q.replace_oldest(torch.tensor([[1.0], [2.0], [3.0]]), torch.tensor([False, True, True]))
    assert sorted(q.features.view(-1).tolist()) == [2.0, 3.0] and q.remote_fraction == 1.0
