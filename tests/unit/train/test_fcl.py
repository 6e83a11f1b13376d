"""FCLLocalTrainer (FCL (Wu et al., MedIA 2022) section 3, Fig. 2) on a tiny MoCo U-Net and 4 synthetic 32 px volumes:
round statistics by hand, the remote bank, abort within one step, the restart round trip and the checked global
load; the loop on hand-made batches (``train_batches``, identity views): bank, momentum update, positives,
checkpoints, every expectation computed by hand from the pre-step networks; its settings (FCLSettings)."""

import copy
import dataclasses
import io
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedssl.core.seeds import site_seed
from fedssl.core.trainer import LocalTrainer, MixedPrecision, StopRequested
from fedssl.data.volume import Volume
import fedssl.train.fcl as train_fcl
from fedssl.core.checks import settings_from
from fedssl.models.unet import TINY_FEATURES, MoCoUNetEncoder
from fedssl.train.fcl import FCLLocalTrainer, FCLSettings

torch.set_num_threads(1)
TINY = dict(n_partitions=2, features=[4, 4, 8, 8, 16, 4], proj_dim=4, batch_size=4, lr=0.05, bank_size=16, seed=0,
            image_size=32)


def volumes(n=4, slices=4, size=32):
    rng = np.random.default_rng(0)
    return [Volume(f"patient{i:03d}", "ED", rng.random((slices, size, size), dtype=np.float32), site="site-1")
            for i in range(n)]


def settings(**kw):
    return FCLSettings(**{**TINY, **kw})


def trainer(**kw):
    site = kw.pop("site", "")
    return FCLLocalTrainer(volumes(), settings(**kw), num_rounds=2, site=site)


def test_round_statistics_by_hand():
    t = trainer()
    assert isinstance(t, LocalTrainer)
    stats = t.train_round(0)
    # 4 volumes, 2 per batch: 2 steps; every step enqueues 2 volumes x 2 partitions momentum features
    assert (stats.steps, stats.samples, t.bank.filled) == (2, 4, 8)
    # cosine over 2 rounds x 2 steps: step s of round 0 at lr 0.05 * 0.5 * (1 + cos(pi * s / 4))
    lrs = [0.05 * 0.5 * (1 + math.cos(math.pi * s / 4)) for s in range(2)]
    assert [p["lr"] for p in stats.curve] == pytest.approx(lrs) and stats.metrics["lr"] == pytest.approx(lrs[-1])
    assert stats.loss == pytest.approx(np.mean([p["loss"] for p in stats.curve]))
    assert stats.loss == pytest.approx(stats.metrics["loss_local"] + stats.metrics["loss_remote"])
    assert stats.metrics["remote_features"] == 0
    assert (stats.metrics["bank_filled"], stats.metrics["bank_fill"]) == (8, 0.5)  # 8 of K = 16 slots
    assert 0 < stats.metrics["feature_std"] < 1  # issue 14: the spread of the query features, mean of 2 steps
    assert stats.metrics["chance_loss_local"] == pytest.approx(math.log(17))  # issue 44: ln(K + 1), K = 16
    features, partitions = t.export_bank()  # the 8 rows taken in this round, each shared once (issue 45)
    assert features.shape == (8, 4) and features.dtype == np.float32 and partitions.dtype == np.int64
    assert sorted(partitions.tolist()) == [0] * 4 + [1] * 4  # partitions 0 and 1
    assert t.export_bank()[0].shape == (0, 4)


def test_max_steps_per_round_caps_the_round():
    assert trainer(max_steps_per_round=1).train_round(0).steps == 1


def remote(m=6):
    return np.eye(4, dtype=np.float32)[np.arange(m) % 4], np.arange(m, dtype=np.int64) % 2


def test_the_remote_bank_enters_training_unless_feature_exchange_is_off():
    plain, with_remote = trainer(), trainer()
    with_remote.set_remote(*remote())
    a, b = plain.train_round(0), with_remote.train_round(0)
    assert b.metrics["remote_features"] == 6 and b.loss != a.loss
    # FedMoCo: a remote bank is ignored, the round is the one without it
    off, off_remote = trainer(feature_exchange=False), trainer(feature_exchange=False)
    off_remote.set_remote(*remote())
    c, d = off.train_round(0), off_remote.train_round(0)
    assert d.metrics["remote_features"] == 0 and c.loss == d.loss
    # each remote row arrives once: the site keeps them in its own FIFO of K = 16 (None: nothing delivered)
    with_remote.set_remote(None)
    assert with_remote.remote[0].shape == (6, 4)
    with_remote.set_remote(*remote(12))
    assert with_remote.remote[0].shape == (16, 4) and torch.equal(with_remote.remote[1][-12:], torch.arange(12) % 2)
    with pytest.raises(ValueError, match=r"expected \[M, 4\] and \[M\]"):
        with_remote.set_remote(np.zeros((3, 5), np.float32), np.zeros(3, np.int64))
    with pytest.raises(ValueError, match="partition ids"):
        with_remote.set_remote(np.zeros((3, 4), np.float32))


def test_should_stop_after_one_step_raises_stop_requested():
    t, calls = trainer(), []

    def should_stop():
        calls.append(1)
        return len(calls) >= 2  # no before the round, yes after the first step

    with pytest.raises(StopRequested):
        t.train_round(0, should_stop)
    assert len(calls) == 2 and t.bank.filled == 4  # exactly one step (2 volumes x 2 partitions)


def test_restart_round_trip_of_state_dict_gives_the_same_next_round():
    a = trainer()
    a.set_remote(*remote())
    a.train_round(0)
    buf = io.BytesIO()
    torch.save({"round": 0, "trainer": a.state_dict()}, buf)  # what the executor checkpoints
    buf.seek(0)
    b = trainer()
    b.load_state_dict(torch.load(buf, weights_only=True)["trainer"])
    assert b.bank.filled == a.bank.filled
    for t in (a, b):
        t.set_remote(*remote())
    sa, sb = a.train_round(1), b.train_round(1)
    assert sa.loss == sb.loss and sa.curve == sb.curve
    ga, gb = a.global_state(), b.global_state()
    assert all(torch.equal(ga[k], gb[k]) for k in ga)
    assert all(np.array_equal(x, y) for x, y in zip(a.export_bank(), b.export_bank()))
    fresh = trainer()  # a trainer that did not resume trains differently
    fresh.set_remote(*remote())
    assert fresh.train_round(1).loss != sa.loss


def test_global_state_is_a_detached_copy_and_load_global_checks_keys():
    t = trainer()
    state = t.global_state()
    assert set(state) == set(t.model.state_dict())
    key = "main.encoder.conv_0.conv_0.conv.weight"
    state[key].add_(1.0)  # editing the copy does not touch the model
    assert not torch.equal(state[key], t.model.state_dict()[key])
    assert t.load_global(copy.deepcopy(state)) == []
    assert torch.equal(t.model.state_dict()[key], state[key])
    missing = {k: v for k, v in state.items() if k != key}
    with pytest.raises(ValueError, match=r"lacks 1 keys.*" + key.replace(".", r"\.")):
        t.load_global(missing)
    assert t.load_global(missing, keep_local=[key]) == [key]
    with pytest.raises(ValueError, match=r"has 1 keys this model does not have.*'bogus'"):
        t.load_global({**state, "bogus": torch.zeros(1)})


def test_too_few_volumes_for_one_batch_names_the_site():
    with pytest.raises(ValueError, match="site-7: 1 volumes cannot fill one batch of 2 volumes"):
        FCLLocalTrainer(volumes(1), settings(), num_rounds=1, site="site-7")
    with pytest.raises(ValueError, match="split='val'"):
        trainer().evaluate()


def first_draws(site, **kw):
    """A fresh site trainer's initial bank, first batch of round 0 and initial weights."""
    t = FCLLocalTrainer(volumes(6), settings(**kw), num_rounds=2, site=site)
    x, _ = next(t.dataset.batches(t.volumes_per_batch, 0))
    return t, t.bank.features.clone(), x, t.global_state()


def test_data_randomness_is_per_site_and_model_init_is_per_job():
    """Issue 13 item 9: the initial bank, slice draws, batch order, augmentations and negative draws use
    site_seed(seed, site); the initial weights are the same at every site (the server's model component)."""
    t1, bank1, x1, w1 = first_draws("site-1")
    t2, bank2, x2, w2 = first_draws("site-2")
    assert (t1.data_seed, t2.data_seed) == (site_seed(0, "site-1"), site_seed(0, "site-2"))
    assert t1.dataset.seed == t1.data_seed and t1.data_seed != t2.data_seed
    assert not torch.equal(bank1, bank2) and not torch.equal(x1, x2)
    assert t1.generator.initial_seed() == t1.data_seed  # augmentations and negative draws
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    _, again_bank, again_x, _ = first_draws("site-1")  # reproducible per site
    assert torch.equal(again_bank, bank1) and torch.equal(again_x, x1)
    server = MoCoUNetEncoder(TINY["features"], TINY["proj_dim"], image_size=32).state_dict()  # the server's model
    assert all(torch.equal(w1[k], server[k]) for k in w1)
    anonymous = FCLLocalTrainer(volumes(6), settings(), num_rounds=2)  # no site (outside FLARE): the job seed as is
    assert anonymous.data_seed == 0 and anonymous.dataset.seed == 0


def test_plain_moco_and_local_cl_reach_the_trainer():
    assert trainer(plain_moco=True).settings.plain_moco and not trainer().settings.plain_moco
    assert trainer().feature_exchange and not trainer(federated=False).feature_exchange  # Local CL: no exchange


def test_loader_workers_give_the_same_round_and_bad_workers_are_refused(loader_workers):
    a, b = trainer(site="site-1"), trainer(site="site-1", workers=2)
    sa, sb = a.train_round(0), b.train_round(0)
    assert sa.loss == sb.loss and sa.steps == sb.steps == 2
    assert all(torch.equal(v, b.model.state_dict()[k]) for k, v in a.model.state_dict().items())
    assert loader_workers and set(loader_workers) == {2}  # only the workers=2 trainer built DataLoaders
    with pytest.raises(ValueError, match="workers=-1"):
        trainer(workers=-1)


# ---------------------------------------------------------------------------------------------- the loop
def identity_augment(x, g):
    return x


def hand_batches(n, v=2, s=2, hw=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        yield torch.rand(v, s, 1, hw, hw, generator=g), torch.arange(s).repeat(v, 1)


def test_the_chance_level_counts_the_negatives_each_step_drew():
    """Issue 44: without negative sampling the remote features join the K local ones: ln(16 + 5 + 1); with it,
    Q' is K = 16 draws: ln 17."""
    remote = F.normalize(torch.randn(5, 4, generator=torch.Generator().manual_seed(0)), dim=1).numpy()
    for sample, k in ((False, 21), (True, 16)):
        t = trainer(negative_sampling=sample)
        t.set_remote(remote, np.zeros(5, dtype=np.int64))
        assert t.train_round(0).metrics["chance_loss_local"] == pytest.approx(math.log(k + 1))


def make(**kw):
    """A trainer with proj_dim 8, K = 16, lr 0.01 and identity views, fed hand-made batches (``train_batches``)."""
    torch.manual_seed(0)
    s = settings(features=list(TINY_FEATURES), proj_dim=8, bank_size=16, lr=0.01, **kw)
    return FCLLocalTrainer(volumes(), s, num_rounds=2, augment=identity_augment)


def test_round_fills_the_bank_in_batch_order_with_partition_ids():
    tr = make()
    remote = (F.normalize(torch.randn(8, 8, generator=torch.Generator().manual_seed(1)), dim=1),
              torch.tensor([0, 1] * 4))
    stats = tr.train_batches(hand_batches(3), steps_per_round=3, round_idx=0, remote=remote)
    assert (stats["steps"], stats["bank_filled"], tr.bank.filled, tr.bank.ptr) == (3, 12, 12, 12)  # 3 x 2 vol x 2 parts
    assert tr.bank.partitions.tolist() == [0, 1] * 6 + [-1] * 4  # volume-major rows: partition 0, 1, 0, 1 ...
    assert stats["loss"] == pytest.approx(stats["loss_local"] + stats["loss_remote"])


def one_step(tr, x):
    """One step on one batch ``x [V, S, 1, H, W]`` (identity augmentation: both views are ``x``)."""
    v, s = x.shape[:2]
    return tr.train_batches(iter([(x, torch.arange(s).repeat(v, 1))]), steps_per_round=1, round_idx=0)


def test_momentum_encoder_is_the_ema_of_the_main_encoder():
    """xi' = m xi + (1 - m) theta' with m = 0.99 (section 5 "Training details"), theta' the main encoder after the
    step; a plain copy (m = 0) would give xi' = theta'.  Buffers (BN statistics) are copied from the main encoder."""
    tr = make()
    with torch.no_grad():  # a momentum encoder that differs from the main one, as after a few rounds
        for p in tr.model.momentum.parameters():
            p.mul_(0.5)
    xi = {k: v.clone() for k, v in tr.model.momentum.named_parameters()}
    one_step(tr, next(hand_batches(1))[0])
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
    x = next(hand_batches(1))[0]
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
    x = next(hand_batches(1))[0]
    bank0 = tr.bank.features.clone()
    with torch.no_grad():
        q = copy.deepcopy(tr.model.main).train()(x.reshape(4, 1, 32, 32))
    remote = (q.clone(), torch.tensor([0, 1, 0, 1]))  # would be GSM positives of the same partitions
    stats = tr.train_batches(iter([(x, torch.arange(2).repeat(2, 1))]), 1, 0, remote=remote)
    negatives = torch.cat([bank0, q])
    expected = F.softplus(torch.logsumexp(q @ negatives.t() / 0.1, dim=1) - 1.0 / 0.1).mean()
    assert stats["loss_local"] == pytest.approx(expected.item(), rel=1e-5)
    assert stats["loss_remote"] == 0.0
    fcl = make(negative_sampling=False)  # FCL's positives on the same step: the partner volume's slice as well
    assert fcl.train_batches(iter([(x, torch.arange(2).repeat(2, 1))]), 1, 0, remote=remote)["loss_local"] != \
        pytest.approx(expected.item(), rel=1e-3)


def test_plain_moco_hands_one_positive_per_query_to_the_loss(monkeypatch):
    seen = {}
    original = train_fcl.fcl_loss_terms

    def spy(q, pos, *args, gsm):
        seen.update(positives=pos.shape[1], gsm=gsm)
        return original(q, pos, *args, gsm=gsm)

    monkeypatch.setattr(train_fcl, "fcl_loss_terms", spy)
    make(plain_moco=True).train_batches(hand_batches(1), 1, 0)
    assert seen == {"positives": 1, "gsm": False}
    make().train_batches(hand_batches(1), 1, 0)
    assert seen == {"positives": 2, "gsm": True}


def test_checkpoint_round_trip_resumes_identically():
    a = make()
    a.train_batches(hand_batches(2), 2, 0)
    b = make()
    b.load_state_dict(a.state_dict())
    sa = a.train_batches(hand_batches(1, seed=5), 2, 1)
    sb = b.train_batches(hand_batches(1, seed=5), 2, 1)
    assert sa["loss"] == pytest.approx(sb["loss"], rel=1e-6)


def test_bad_settings_name_the_argument():
    with pytest.raises(ValueError, match=r"FCLLocalTrainer: argument tau=0 is invalid"):
        FCLLocalTrainer(volumes(), settings(tau=0), num_rounds=2)
    with pytest.raises(ValueError, match=r"FCLLocalTrainer: argument num_rounds=0 is invalid"):
        FCLLocalTrainer(volumes(), settings(), num_rounds=0)
    with pytest.raises(TypeError, match=r"FCLExecutor: unknown argument lrr; it accepts .*\blr\b"):
        settings_from("FCLExecutor", FCLSettings, {"lrr": 0.1})
    with pytest.raises(ValueError, match=r"FCLExecutor: argument momentum=1.0 is invalid; out of range \(paper: 0\.99"):
        settings_from("FCLExecutor", FCLSettings, {"momentum": 1.0})
    # the optimiser's constants are no argument: not settable, not in the job's JSON
    assert "sgd_momentum" not in {f.name for f in dataclasses.fields(FCLSettings)}
    assert (FCLSettings.sgd_momentum, FCLSettings.weight_decay) == (0.9, 1e-4)


def test_feature_std_is_the_spread_of_the_query_features():
    """Issue 14 item 4: the round reports the spread of the batch's (normalised) query features q = main(view_q),
    not the momentum keys: with a momentum encoder that differs, the expectation is the pre-step main network's.
    A main network whose projection ignores its input gives q equal for every slice: spread 0 (collapse)."""
    tr = make()
    with torch.no_grad():
        for p in tr.model.momentum.parameters():
            p.mul_(0.5)
    x = next(hand_batches(1))[0]
    with torch.no_grad():
        q = copy.deepcopy(tr.model.main).train()(x.reshape(4, 1, 32, 32))
    expected = F.normalize(q, dim=1).std(dim=0, unbiased=False).mean().item()
    assert one_step(tr, x)["feature_std"] == pytest.approx(expected, rel=1e-5)
    collapsed = make()
    with torch.no_grad():  # the flatten head has no bias (the reference's): every projection is 0
        collapsed.model.main.head[2].weight.zero_()
    assert one_step(collapsed, x)["feature_std"] == 0.0


def test_amp_runs_the_encoders_in_bfloat16_loss_and_bank_stay_float32():
    tr = make()
    tr.precision = MixedPrecision("cpu", True, force=torch.bfloat16)  # the bfloat16 path on a CPU
    seen = []
    for m in tr.model.main.modules():
        if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)):
            m.register_forward_hook(lambda mod, i, o: seen.append(o.dtype))
    out = tr.train_batches(hand_batches(2), 2, 0)
    assert seen and set(seen) == {torch.bfloat16}
    assert math.isfinite(out["loss"]) and tr.bank.features.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in tr.model.parameters())


def test_channels_last_trains_the_same_run_in_the_other_memory_format():
    """``channels_last``: 4-D weights and the encoders' inputs in channels-last format; the round is the default
    format's up to float rounding (the flag changes the memory layout, not the arithmetic)."""
    seen = []
    cl = trainer(channels_last=True)
    for m in cl.model.main.modules():
        if isinstance(m, torch.nn.Conv2d):
            m.register_forward_pre_hook(lambda mod, args: seen.append(args[0].is_contiguous(
                memory_format=torch.channels_last)))
    assert all(p.is_contiguous(memory_format=torch.channels_last) for p in cl.model.parameters() if p.dim() == 4)
    a, b = trainer().train_round(0), cl.train_round(0)
    assert seen and all(seen)
    assert b.loss == pytest.approx(a.loss, rel=1e-4)
    with pytest.raises(ValueError, match="channels_last"):
        settings(channels_last="yes").check("FCLLocalTrainer")
