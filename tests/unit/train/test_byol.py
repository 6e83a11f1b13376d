"""BYOLLocalTrainer on a tiny BYOL U-Net and 3 synthetic 32 px volumes: round statistics by hand, what each mode does
with the download (FCLOpt / FedBYOL / PTNU), the DP proxy distance, abort within one step, the restart round trip."""

import io
import math

import numpy as np
import pytest
import torch

from fedssl.core.ptnu import ONLINE, TARGET, ptnu_steps
from fedssl.core.seeds import site_seed
from fedssl.core.trainer import LocalTrainer, StopRequested
from fedssl.data.volume import Volume
from fedssl.train.byol import BYOLLocalTrainer

TINY = dict(n_partitions=2, features=[4, 4, 8, 8, 16, 4], proj_dim=4, pred_hidden=8, batch_size=2, lr=0.5, seed=0)


def volumes(n=3, slices=4, size=32):
    rng = np.random.default_rng(0)
    return [Volume(f"patient{i:03d}", "ED", rng.random((slices, size, size), dtype=np.float32), site="site-1")
            for i in range(n)]


def trainer(**kw):
    return BYOLLocalTrainer(volumes(), num_rounds=2, **{**TINY, **kw})


def numpy_state(t, prefix=""):
    return {k: v.detach().numpy().copy() for k, v in t.model.state_dict().items() if k.startswith(prefix)}


def global_download(shift=0.25, with_target=False):
    """Another model's weights (different seed), online + predictor (+ target)."""
    other = BYOLLocalTrainer(volumes(), num_rounds=2, **{**TINY, "seed": 7})
    state = numpy_state(other)
    state = {k: (v + np.float32(shift) if v.dtype.kind == "f" else v) for k, v in state.items()}
    return {k: v for k, v in state.items() if with_target or not k.startswith(TARGET)}


def as_target(online):
    return {TARGET + k[len(ONLINE):]: v for k, v in online.items() if k.startswith(ONLINE)}


def assert_state(t, expected):
    own = numpy_state(t)
    for k, v in expected.items():
        np.testing.assert_array_equal(own[k], v, err_msg=k)


def test_round_statistics_by_hand():
    t = trainer()
    assert isinstance(t, LocalTrainer)
    stats = t.train_round(0)
    assert (stats.steps, stats.samples) == (3, 3)  # batches of 1 volume x 2 partitions
    lrs = [0.5 * 0.5 * (1 + math.cos(math.pi * s / 6)) for s in range(3)]  # cosine over 2 rounds x 3 steps
    assert [p["lr"] for p in stats.curve] == pytest.approx(lrs) and stats.metrics["lr"] == pytest.approx(lrs[-1])
    assert stats.loss == pytest.approx(np.mean([p["loss"] for p in stats.curve]))
    assert 0 < stats.metrics["feature_std"] < 1  # issue 14: the spread of the online projections, mean of 3 steps
    assert trainer(max_steps_per_round=2).train_round(0).steps == 2


def test_data_randomness_from_the_site_seed_model_from_the_job_seed():
    """Issue 13 item 9: two sites with the same job seed and the same images build the same initial network
    but draw their own slices, batch order and augmentations (site_seed(seed, site)); the same site again
    reproduces its round exactly."""
    a, b, a2 = trainer(site="site-1"), trainer(site="site-2"), trainer(site="site-1")
    assert (a.data_seed, b.data_seed) == (site_seed(0, "site-1"), site_seed(0, "site-2"))
    assert (a.dataset.seed, a.trainer.generator.initial_seed()) == (a.data_seed, a.data_seed)
    assert (b.dataset.seed, b.trainer.generator.initial_seed()) == (b.data_seed, b.data_seed)
    assert trainer(site="").data_seed == 0  # outside FLARE: the job seed itself
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)  # model init: the job seed
    assert not all(torch.equal(x, y) for x, y in zip(sa.values(), trainer(seed=1).model.state_dict().values()))
    ra, rb, ra2 = a.train_round(0), b.train_round(0), a2.train_round(0)
    assert ra.curve == ra2.curve and ra.curve != rb.curve


def test_symmetric_switch_reaches_the_loss():
    assert trainer().trainer.cfg.symmetric is False  # FCL eq. 6
    assert trainer(symmetric=True).trainer.cfg.symmetric is True


def test_first_round_local_target_is_the_global_online_network():
    t, g = trainer(), global_download()
    assert not t.has_local_target
    assert t.apply_global("fedbyol", g) is None and t.has_local_target
    assert_state(t, g)
    assert_state(t, as_target(g))  # the target starts as a copy of the global online network


def test_fclopt_loads_the_global_target_or_keeps_the_local_one_when_none_came():
    t = trainer()
    t.apply_global("fclopt", global_download())
    t.train_round(0)
    mine = t.local_target()
    full = global_download(0.5, with_target=True)
    t.apply_global("fclopt", full)
    assert_state(t, full)
    full_target = {k: v for k, v in full.items() if k.startswith(TARGET)}
    g = global_download(0.75)
    t.apply_global("fclopt", g)  # no target in the download: the local one stays
    assert_state(t, {**g, **full_target})
    g = global_download(1.0)
    t.apply_global("fedbyol", g)  # FedBYOL: never a global target
    assert_state(t, {**g, **full_target})
    assert not all(np.array_equal(mine[k], full[k]) for k in mine)


def test_ptnu_predicts_the_target_to_the_servers_distance():
    t = trainer()
    t.apply_global("fclopt", global_download())
    t.train_round(0)
    xi = t.local_target()
    g = global_download(0.5)
    floats = [k for k in xi if xi[k].dtype.kind == "f"]
    online = {TARGET + k[len(ONLINE):]: v for k, v in g.items() if k.startswith(ONLINE)}
    d0 = sum(np.abs(online[k].astype(np.float64) - xi[k]).sum() for k in floats) / sum(xi[k].size for k in floats)
    d = d0 / 3
    n = t.apply_global("ptnu", g, distance=d)
    assert n == ptnu_steps(d0, d, 0.995) and n == math.ceil(math.log(1 / 3) / math.log(0.995))
    keep = 0.995 ** n  # n EMA steps towards the fixed global online network, in closed form
    new = numpy_state(t, TARGET)
    for k in floats:
        np.testing.assert_allclose(new[k], online[k] + keep * (xi[k] - online[k]), rtol=1e-5, atol=1e-6)
    assert t.proxy_distance(g) == pytest.approx(keep * d0, rel=1e-5) and keep * d0 <= d


def test_proxy_distance_by_hand_and_first_round_start():
    t, g = trainer(), global_download()
    assert t.proxy_distance(g) == 0.0 and t.has_local_target  # round 0: the target is the online network
    g2 = global_download(0.5)
    xi = t.local_target()
    floats = [k for k in xi if xi[k].dtype.kind == "f"]
    expected = (sum(np.abs(g2[ONLINE + k[len(TARGET):]].astype(np.float64) - xi[k]).sum() for k in floats)
                / sum(xi[k].size for k in floats))
    assert t.proxy_distance(g2) == pytest.approx(expected)


def test_should_stop_after_one_step_raises_stop_requested():
    t, calls, steps = trainer(), [], []
    step = t.trainer.optimizer.step
    t.trainer.optimizer.step = lambda *a, **k: (steps.append(1), step(*a, **k))[1]

    def should_stop():
        calls.append(1)
        return len(calls) >= 2

    with pytest.raises(StopRequested):
        t.train_round(0, should_stop)
    assert len(calls) == 2 and len(steps) == 1


def test_restart_round_trip_of_state_dict_gives_the_same_next_round():
    a = trainer()
    a.apply_global("fclopt", global_download())
    a.train_round(0)
    buf = io.BytesIO()
    torch.save({"round": 0, "trainer": a.state_dict()}, buf)
    buf.seek(0)
    b = trainer()
    b.load_state_dict(torch.load(buf, weights_only=True)["trainer"])
    assert b.has_local_target  # a restored site has a target network of its own
    assert all(np.array_equal(v, b.local_target()[k]) for k, v in a.local_target().items())
    g = global_download(0.5)
    for t in (a, b):
        t.apply_global("fedbyol", g)
    sa, sb = a.train_round(1), b.train_round(1)
    assert sa.loss == sb.loss and sa.curve == sb.curve
    ga, gb = a.global_state(), b.global_state()
    assert all(torch.equal(ga[k], gb[k]) for k in ga)


def test_global_state_and_checked_loads():
    t = trainer()
    assert set(t.global_state()) == set(t.model.state_dict())
    assert not any(k.startswith(TARGET) for k in t.global_state(with_target=False))
    online_only = global_download()
    with pytest.raises(ValueError, match=r"lacks \d+ keys.*'target\."):
        t.load_global(online_only)  # the protocol's load is strict
    with pytest.raises(ValueError, match=r"has 1 keys this model does not have.*'bogus'"):
        t.apply_global("fedbyol", {**online_only, "bogus": np.zeros(1, np.float32)})
    with pytest.raises(ValueError, match="mode='byol'"):
        t.apply_global("byol", online_only)
    with pytest.raises(ValueError, match="mode ptnu needs the server's target distance"):
        t.apply_global("ptnu", online_only)


def test_loader_workers_give_the_same_round_and_bad_workers_are_refused(loader_workers):
    a, b = trainer(site="site-1"), trainer(site="site-1", workers=2)
    assert a.train_round(0).loss == b.train_round(0).loss
    assert all(torch.equal(v, b.model.state_dict()[k]) for k, v in a.model.state_dict().items())
    assert loader_workers and set(loader_workers) == {2}  # only the workers=2 trainer built DataLoaders
    with pytest.raises(ValueError, match="workers=True"):
        trainer(workers=True)
