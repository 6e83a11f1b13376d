"""FedCLF's negative queue modes (eqs. 3-5), its loss (eq. 6), the FedSimCLR / FedRotation losses and the trainer
on a tiny network, with hand-computed expectations."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fedssl.core.fedclf import (
    FedCLFConfig,
    FedCLFTrainer,
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


class TinyNet(nn.Module):
    def __init__(self, out: int = 4):
        super().__init__()
        self.lin = nn.Linear(12, out)

    def forward(self, x):
        return F.normalize(self.lin(x.flatten(1)), dim=1)


class TinyMoCo(nn.Module):
    proj_dim = 4

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.main, self.momentum = TinyNet(), TinyNet()
        self.momentum.load_state_dict(self.main.state_dict())


class TinyRotation(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Linear(12, 4)

    def forward(self, x):
        return self.main(x.flatten(1))


def _batches(n: int, b: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, 3, 2, 2, generator=g), torch.randn(b, 3, 2, 2, generator=g)) for _ in range(n)]


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


def test_queue_keeps_the_last_entries_when_more_arrive_than_it_holds():
    q = NegativeQueue(torch.zeros(2, 1), False)
    q.replace_oldest(torch.tensor([[1.0], [2.0], [3.0]]), torch.tensor([False, True, True]))
    assert sorted(q.features.view(-1).tolist()) == [2.0, 3.0] and q.remote_fraction == 1.0


def test_moco_round_fills_the_bank_and_fe_neg_never_uses_a_local_negative():
    remote = F.normalize(torch.randn(7, 4, generator=torch.Generator().manual_seed(3)), dim=1)
    t = FedCLFTrainer(TinyMoCo(), FedCLFConfig(queue="fe_neg", bank_size=8, num_rounds=2), seed=0)
    stats = t.train_round(_batches(2), steps_per_round=2, round_idx=0, remote=remote)
    assert stats["steps"] == 2 and stats["bank_filled"] == 6 and stats["queue_size"] == 7
    assert stats["queue_remote_fraction"] == 1.0
    assert all(any(torch.allclose(row, r) for r in remote) for row in t.queue.features)
    # the local bank holds the momentum features of the batches (what is uploaded), not remote ones
    assert not any(torch.allclose(row, r) for row in t.bank.features[:6] for r in remote)


def test_moco_without_exchange_is_plain_moco_the_queue_is_the_bank():
    t = FedCLFTrainer(TinyMoCo(), FedCLFConfig(queue="none", bank_size=5, num_rounds=1), seed=0)
    t.train_round(_batches(1), steps_per_round=3, round_idx=0)
    stats = t.train_round(_batches(3, seed=1), steps_per_round=3, round_idx=0)
    assert torch.equal(t.queue.features, t.bank.features) and stats["queue_remote_fraction"] == 0.0


def test_momentum_network_is_an_ema_and_lr_follows_the_cosine():
    model = TinyMoCo()
    before = model.momentum.lin.weight.detach().clone()
    t = FedCLFTrainer(model, FedCLFConfig(queue="none", bank_size=8, momentum=0.5, lr=0.1, num_rounds=2), seed=0)
    stats = t.train_round(_batches(1), steps_per_round=2, round_idx=1)
    # one step: momentum = 0.5 * old + 0.5 * main (after the step)
    assert torch.allclose(model.momentum.lin.weight, 0.5 * before + 0.5 * model.main.lin.weight.detach())
    assert stats["lr_end"] == pytest.approx(0.1 * 0.5 * (1 + math.cos(math.pi * 2 / 4)))


def test_first_round_without_a_remote_bank_draws_from_the_own_initial_bank():
    t = FedCLFTrainer(TinyMoCo(), FedCLFConfig(queue="fe_neg", bank_size=6, num_rounds=1), seed=0)
    initial = t.bank.features.clone()  # random unit vectors: nobody's data
    t.train_round(_batches(1), steps_per_round=1, round_idx=0, remote=None)
    assert all(any(torch.allclose(row, r) for r in initial) for row in t.queue.features)


def test_simclr_and_rotation_methods_train_their_losses():
    t = FedCLFTrainer(nn.ModuleDict({"main": TinyNet()}), FedCLFConfig(method="simclr", queue="none", tau=0.5), seed=0)
    stats = t.train_round(_batches(2), steps_per_round=2, round_idx=0)
    assert stats["steps"] == 2 and "feature_std" in stats and "queue_size" not in stats
    r = FedCLFTrainer(TinyRotation(), FedCLFConfig(method="rotation", queue="none"), seed=0)
    stats = r.train_round(_batches(2), steps_per_round=2, round_idx=0)
    assert 0.0 <= stats["rotation_accuracy"] <= 1.0 and stats["loss"] > 0


def test_config_refuses_bad_values_naming_them():
    with pytest.raises(ValueError, match="queue='fe'.*only method='moco'"):
        FedCLFConfig(method="simclr", queue="fe")
    with pytest.raises(ValueError, match="queue='both'"):
        FedCLFConfig(queue="both")
    with pytest.raises(ValueError, match="tau=0"):
        FedCLFConfig(tau=0)


def test_state_round_trip_resumes_identically():
    a = FedCLFTrainer(TinyMoCo(), FedCLFConfig(queue="fe", bank_size=8), seed=0)
    a.train_round(_batches(1), steps_per_round=1, round_idx=0, remote=torch.eye(4))
    b = FedCLFTrainer(TinyMoCo(), FedCLFConfig(queue="fe", bank_size=8), seed=5)
    b.load_state_dict(a.state_dict())
    sa = a.train_round(_batches(1, seed=2), steps_per_round=1, round_idx=1, remote=torch.eye(4))
    sb = b.train_round(_batches(1, seed=2), steps_per_round=1, round_idx=1, remote=torch.eye(4))
    assert sa["loss"] == sb["loss"] and torch.equal(a.bank.features, b.bank.features)
