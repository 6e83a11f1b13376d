"""FCLTrainer (FCL (Wu et al., MedIA 2022) section 3, Fig. 2) on a tiny MoCo U-Net: bank, momentum update, positives,
checkpoints; every expectation computed by hand from the pre-step networks."""

import copy

import pytest
import torch
import torch.nn.functional as F

import fedssl.core.fcl as core_fcl
from fedssl.core.fcl import FCLConfig, FCLTrainer, cosine_lr
from fedssl.models.unet import TINY_FEATURES, MoCoUNetEncoder

torch.set_num_threads(1)


def identity_augment(x, g):
    return x


def batches(n, v=2, s=2, hw=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        yield torch.rand(v, s, 1, hw, hw, generator=g), torch.arange(s).repeat(v, 1)


def make(**kw):
    torch.manual_seed(0)
    cfg = FCLConfig(bank_size=16, num_rounds=2, lr=0.01, **kw)
    return FCLTrainer(MoCoUNetEncoder(TINY_FEATURES, proj_dim=8), cfg, identity_augment, seed=0)


def test_round_fills_the_bank_in_batch_order_with_partition_ids():
    tr = make()
    remote = (F.normalize(torch.randn(8, 8, generator=torch.Generator().manual_seed(1)), dim=1),
              torch.tensor([0, 1] * 4))
    stats = tr.train_round(batches(3), steps_per_round=3, round_idx=0, remote=remote)
    assert (stats["steps"], stats["bank_filled"], tr.bank.filled, tr.bank.ptr) == (3, 12, 12, 12)  # 3 x 2 vol x 2 parts
    assert tr.bank.partitions.tolist() == [0, 1] * 6 + [-1] * 4  # volume-major rows: partition 0, 1, 0, 1 ...
    assert stats["loss"] == pytest.approx(stats["loss_local"] + stats["loss_remote"])


def one_step(tr, x):
    """One step on one batch ``x [V, S, 1, H, W]`` (identity augmentation: both views are ``x``)."""
    v, s = x.shape[:2]
    return tr.train_round(iter([(x, torch.arange(s).repeat(v, 1))]), steps_per_round=1, round_idx=0)


def test_momentum_encoder_is_the_ema_of_the_main_encoder():
    """xi' = m xi + (1 - m) theta' with m = 0.99 (section 5 "Training details"), theta' the main encoder after the
    step; a plain copy (m = 0) would give xi' = theta'.  Buffers (BN statistics) are copied from the main encoder."""
    tr = make()
    with torch.no_grad():  # a momentum encoder that differs from the main one, as after a few rounds
        for p in tr.model.momentum.parameters():
            p.mul_(0.5)
    xi = {k: v.clone() for k, v in tr.model.momentum.named_parameters()}
    one_step(tr, next(batches(1))[0])
    theta = dict(tr.model.main.named_parameters())
    for k, p in tr.model.momentum.named_parameters():
        expected = 0.99 * xi[k] + 0.01 * theta[k].detach()
        torch.testing.assert_close(p, expected, rtol=0, atol=1e-6, msg=k)
    main_buffers = dict(tr.model.main.named_buffers())
    assert all(torch.equal(b, main_buffers[k]) for k, b in tr.model.momentum.named_buffers())


def test_the_bank_stores_momentum_features_not_main_features():
    """Section 3.2: the bank holds the momentum encoder's features of the step's images (key view)."""
    tr = make()
    with torch.no_grad():
        for p in tr.model.momentum.parameters():
            p.mul_(0.5)
    x = next(batches(1))[0]
    momentum_before, main_before = copy.deepcopy(tr.model.momentum), copy.deepcopy(tr.model.main)
    with torch.no_grad():
        expected = momentum_before.train()(x.reshape(4, 1, 32, 32))
        main_features = main_before.train()(x.reshape(4, 1, 32, 32))
    assert not torch.allclose(expected, main_features, atol=1e-3)  # the two encoders really differ
    one_step(tr, x)
    torch.testing.assert_close(tr.bank.features[:4], expected, rtol=0, atol=1e-6)


def test_plain_moco_positive_is_the_other_view_of_the_same_slice():
    """plain_moco (FedMoCo, Table 6 "Without FE"): l(q, {k+}, Q) with k+ the momentum feature of the same slice
    (He et al., 2020), no partner-volume positive, no GSM term even with partition-labelled remote features.
    First step, identity views, momentum = main: q = k, so q.k+ = 1 and the loss is the batch mean of
    softplus(LSE_n(q.n / tau) - 1 / tau) over the initial bank n."""
    tr = make(plain_moco=True, negative_sampling=False)
    x = next(batches(1))[0]
    bank0 = tr.bank.features.clone()
    with torch.no_grad():
        q = copy.deepcopy(tr.model.main).train()(x.reshape(4, 1, 32, 32))
    remote = (q.clone(), torch.tensor([0, 1, 0, 1]))  # would be GSM positives of the same partitions
    stats = tr.train_round(iter([(x, torch.arange(2).repeat(2, 1))]), 1, 0, remote=remote)
    negatives = torch.cat([bank0, q])
    expected = F.softplus(torch.logsumexp(q @ negatives.t() / 0.1, dim=1) - 1.0 / 0.1).mean()
    assert stats["loss_local"] == pytest.approx(expected.item(), rel=1e-5)
    assert stats["loss_remote"] == 0.0
    fcl = make(negative_sampling=False)  # FCL's positives on the same step: the partner volume's slice as well
    assert fcl.train_round(iter([(x, torch.arange(2).repeat(2, 1))]), 1, 0, remote=remote)["loss_local"] != \
        pytest.approx(expected.item(), rel=1e-3)


def test_plain_moco_hands_one_positive_per_query_to_the_loss(monkeypatch):
    seen = {}
    original = core_fcl.fcl_loss_terms

    def spy(q, pos, *args, gsm):
        seen.update(positives=pos.shape[1], gsm=gsm)
        return original(q, pos, *args, gsm=gsm)

    monkeypatch.setattr(core_fcl, "fcl_loss_terms", spy)
    make(plain_moco=True).train_round(batches(1), 1, 0)
    assert seen == {"positives": 1, "gsm": False}
    make().train_round(batches(1), 1, 0)
    assert seen == {"positives": 2, "gsm": True}


def test_checkpoint_round_trip_resumes_identically():
    a = make()
    a.train_round(batches(2), 2, 0)
    b = make()
    b.load_state_dict(a.state_dict())
    sa = a.train_round(batches(1, seed=5), 2, 1)
    sb = b.train_round(batches(1, seed=5), 2, 1)
    assert sa["loss"] == pytest.approx(sb["loss"], rel=1e-6)


def test_cosine_lr():
    assert cosine_lr(0.05, 0.0) == pytest.approx(0.05)
    assert cosine_lr(0.05, 0.5) == pytest.approx(0.025)
    assert cosine_lr(0.05, 1.0) == pytest.approx(0.0)


def test_bad_config_names_argument():
    with pytest.raises(ValueError, match="tau"):
        FCLConfig(tau=0)


def test_feature_std_is_the_spread_of_the_query_features():
    """Issue 14 item 4: the round reports the spread of the batch's (normalised) query features q = main(view_q),
    not the momentum keys: with a momentum encoder that differs, the expectation is the pre-step main network's.
    A main network whose projection ignores its input gives q equal for every slice: spread 0 (collapse)."""
    tr = make()
    with torch.no_grad():
        for p in tr.model.momentum.parameters():
            p.mul_(0.5)
    x = next(batches(1))[0]
    with torch.no_grad():
        q = copy.deepcopy(tr.model.main).train()(x.reshape(4, 1, 32, 32))
    expected = F.normalize(q, dim=1).std(dim=0, unbiased=False).mean().item()
    assert one_step(tr, x)["feature_std"] == pytest.approx(expected, rel=1e-5)
    collapsed = make()
    with torch.no_grad():
        collapsed.model.main.head[2].weight.zero_()
        collapsed.model.main.head[2].bias.fill_(1.0)
    assert one_step(collapsed, x)["feature_std"] == 0.0
