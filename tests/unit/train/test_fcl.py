"""FCLLocalTrainer on a tiny MoCo U-Net and 4 synthetic 32 px volumes: round statistics by hand, the remote bank,
abort within one step, the restart round trip and the checked global load."""

import copy
import io
import math

import numpy as np
import pytest
import torch

from fedssl.core.seeds import site_seed
from fedssl.core.trainer import LocalTrainer, StopRequested
from fedssl.data.volume import Volume
from fedssl.models.unet import MoCoUNetEncoder
from fedssl.train.fcl import FCLLocalTrainer

torch.set_num_threads(1)
TINY = dict(n_partitions=2, features=[4, 4, 8, 8, 16, 4], proj_dim=4, batch_size=4, lr=0.05, bank_size=16, seed=0)


def volumes(n=4, slices=4, size=32):
    rng = np.random.default_rng(0)
    return [Volume(f"patient{i:03d}", "ED", rng.random((slices, size, size), dtype=np.float32), site="site-1")
            for i in range(n)]


def trainer(**kw):
    return FCLLocalTrainer(volumes(), num_rounds=2, **{**TINY, **kw})


def test_round_statistics_by_hand():
    t = trainer()
    assert isinstance(t, LocalTrainer)
    stats = t.train_round(0)
    # 4 volumes, 2 per batch: 2 steps; every step enqueues 2 volumes x 2 partitions momentum features
    assert (stats.steps, stats.samples, t.trainer.bank.filled) == (2, 4, 8)
    # cosine over 2 rounds x 2 steps: step s of round 0 at lr 0.05 * 0.5 * (1 + cos(pi * s / 4))
    lrs = [0.05 * 0.5 * (1 + math.cos(math.pi * s / 4)) for s in range(2)]
    assert [p["lr"] for p in stats.curve] == pytest.approx(lrs) and stats.metrics["lr"] == pytest.approx(lrs[-1])
    assert stats.loss == pytest.approx(np.mean([p["loss"] for p in stats.curve]))
    assert stats.loss == pytest.approx(stats.metrics["loss_local"] + stats.metrics["loss_remote"])
    assert stats.metrics["remote_features"] == 0
    assert (stats.metrics["bank_filled"], stats.metrics["bank_fill"]) == (8, 0.5)  # 8 of K = 16 slots
    assert 0 < stats.metrics["feature_std"] < 1  # issue 14: the spread of the query features, mean of 2 steps
    features, partitions = t.export_bank()
    assert features.shape == (16, 4) and features.dtype == np.float32 and partitions.dtype == np.int64
    assert sorted(partitions[partitions >= 0].tolist()) == [0] * 4 + [1] * 4  # 8 filled slots, partitions 0 and 1


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
    with_remote.set_remote(None)
    assert with_remote.remote is None
    with pytest.raises(ValueError, match=r"expected \[M, 4\] and \[M\]"):
        with_remote.set_remote(np.zeros((3, 5), np.float32), np.zeros(3, np.int64))


def test_should_stop_after_one_step_raises_stop_requested():
    t, calls = trainer(), []

    def should_stop():
        calls.append(1)
        return len(calls) >= 2  # no before the round, yes after the first step

    with pytest.raises(StopRequested):
        t.train_round(0, should_stop)
    assert len(calls) == 2 and t.trainer.bank.filled == 4  # exactly one step (2 volumes x 2 partitions)


def test_restart_round_trip_of_state_dict_gives_the_same_next_round():
    a = trainer()
    a.set_remote(*remote())
    a.train_round(0)
    buf = io.BytesIO()
    torch.save({"round": 0, "trainer": a.state_dict()}, buf)  # what the executor checkpoints
    buf.seek(0)
    b = trainer()
    b.load_state_dict(torch.load(buf, weights_only=True)["trainer"])
    assert b.trainer.bank.filled == a.trainer.bank.filled
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
        FCLLocalTrainer(volumes(1), num_rounds=1, site="site-7", **TINY)
    with pytest.raises(ValueError, match="split='val'"):
        trainer().evaluate()


def first_draws(site, **kw):
    """A fresh site trainer's initial bank, first batch of round 0 and initial weights."""
    t = FCLLocalTrainer(volumes(6), num_rounds=2, site=site, **{**TINY, **kw})
    x, _ = next(t.dataset.batches(t.volumes_per_batch, 0))
    return t, t.trainer.bank.features.clone(), x, t.global_state()


def test_data_randomness_is_per_site_and_model_init_is_per_job():
    """Issue 13 item 9: the initial bank, slice draws, batch order, augmentations and negative draws use
    site_seed(seed, site); the initial weights are the same at every site (the server's model component)."""
    t1, bank1, x1, w1 = first_draws("site-1")
    t2, bank2, x2, w2 = first_draws("site-2")
    assert (t1.data_seed, t2.data_seed) == (site_seed(0, "site-1"), site_seed(0, "site-2"))
    assert t1.dataset.seed == t1.data_seed and t1.data_seed != t2.data_seed
    assert not torch.equal(bank1, bank2) and not torch.equal(x1, x2)
    assert t1.trainer.generator.initial_seed() == t1.data_seed  # augmentations and negative draws
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    _, again_bank, again_x, _ = first_draws("site-1")  # reproducible per site
    assert torch.equal(again_bank, bank1) and torch.equal(again_x, x1)
    server = MoCoUNetEncoder(TINY["features"], TINY["proj_dim"]).state_dict()  # the server's model component
    assert all(torch.equal(w1[k], server[k]) for k in w1)
    anonymous = FCLLocalTrainer(volumes(6), num_rounds=2, **TINY)  # no site (outside FLARE): the job seed as is
    assert anonymous.data_seed == 0 and anonymous.dataset.seed == 0


def test_plain_moco_reaches_the_core_trainer():
    assert trainer(plain_moco=True).trainer.cfg.plain_moco and not trainer().trainer.cfg.plain_moco


def test_loader_workers_give_the_same_round_and_bad_workers_are_refused(loader_workers):
    a, b = trainer(site="site-1"), trainer(site="site-1", workers=2)
    sa, sb = a.train_round(0), b.train_round(0)
    assert sa.loss == sb.loss and sa.steps == sb.steps == 2
    assert all(torch.equal(v, b.model.state_dict()[k]) for k, v in a.model.state_dict().items())
    assert loader_workers and set(loader_workers) == {2}  # only the workers=2 trainer built DataLoaders
    with pytest.raises(ValueError, match="workers=-1"):
        trainer(workers=-1)
