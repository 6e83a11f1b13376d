"""BYOLLocalTrainer on a tiny BYOL U-Net and 3 synthetic 32 px volumes: round statistics by hand, what each mode does
with the download (FCLOpt / FedBYOL / PTNU), the DP proxy distance, abort within one step, the restart round trip."""

import copy
import dataclasses
import io
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedssl.core.byol import FCLOPT_LR
from fedssl.core.ptnu import ONLINE, TARGET, ptnu_steps
from fedssl.core.seeds import site_seed
from fedssl.core.trainer import LocalTrainer, MixedPrecision, StopRequested
from fedssl.data.volume import Volume
from fedssl.models.unet import TINY_FEATURES, BYOLUNetEncoder
from fedssl.train.byol import BYOLLocalTrainer, BYOLSettings

TINY = dict(n_partitions=2, features=[4, 4, 8, 8, 16, 4], proj_dim=4, pred_hidden=8, batch_size=2, lr=0.5, seed=0,
            image_size=32)


def volumes(n=3, slices=4, size=32):
    rng = np.random.default_rng(0)
    return [Volume(f"patient{i:03d}", "ED", rng.random((slices, size, size), dtype=np.float32), site="site-1")
            for i in range(n)]


def trainer(**kw):
    site = kw.pop("site", "")
    return BYOLLocalTrainer(volumes(), BYOLSettings(**{**TINY, **kw}), num_rounds=2, site=site)


def numpy_state(t, prefix=""):
    return {k: v.detach().numpy().copy() for k, v in t.model.state_dict().items() if k.startswith(prefix)}


def global_download(shift=0.25, with_target=False):
    """Another model's weights (different seed), online + predictor (+ target)."""
    other = trainer(seed=7)
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
    assert (a.dataset.seed, a.generator.initial_seed()) == (a.data_seed, a.data_seed)
    assert (b.dataset.seed, b.generator.initial_seed()) == (b.data_seed, b.data_seed)
    assert trainer(site="").data_seed == 0  # outside FLARE: the job seed itself
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)  # model init: the job seed
    assert not all(torch.equal(x, y) for x, y in zip(sa.values(), trainer(seed=1).model.state_dict().values()))
    ra, rb, ra2 = a.train_round(0), b.train_round(0), a2.train_round(0)
    assert ra.curve == ra2.curve and ra.curve != rb.curve


def test_symmetric_switch_reaches_the_loss():
    assert trainer().settings.symmetric is False  # FCL eq. 6
    assert trainer(symmetric=True).settings.symmetric is True


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
    step = t.optimizer.step
    t.optimizer.step = lambda *a, **k: (steps.append(1), step(*a, **k))[1]

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


# ---------------------------------------------------------------------------------------------- the loop
class LinearBYOL(nn.Module):
    """online = identity matrix (trainable), predictor = identity, target = diag(1, 2) (frozen)."""

    def __init__(self):
        super().__init__()
        self.online = nn.Linear(2, 2, bias=False)
        self.predictor = nn.Identity()
        self.target = nn.Linear(2, 2, bias=False)
        with torch.no_grad():
            self.online.weight.copy_(torch.eye(2))
            self.target.weight.copy_(torch.diag(torch.tensor([1.0, 2.0])))
        self.target.weight.requires_grad_(False)


def fixed_views(*views):
    """An ``augment`` that returns ``views`` in turn (t, t', t, t', ...), whatever the batch."""
    queue = list(views)
    return lambda x, g: queue.pop(0)


def one_step(kw, t, t2):
    """One step of a trainer with the hand-checkable LinearBYOL, views ``t`` (online) and ``t2`` (target)."""
    model = LinearBYOL()
    kw = {**TINY, "lr": 0.5, "seed": 0, **kw}
    rounds = kw.pop("num_rounds", 200)
    tr = BYOLLocalTrainer(volumes(), BYOLSettings(**kw), num_rounds=rounds, model=model, augment=fixed_views(t, t2))
    out = tr.train_batches([torch.zeros(1, 2)], 1, 0)
    return out, model


T, T2 = torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 1.0]])
#: eq. 6, L(t, t'): z = q(f(t)) = (1, 0), z' = diag(1, 2) t' = (1, 2): cos = 1/sqrt(5)
L_T_T2 = 2 - 2 / math.sqrt(5)
#: the swapped term L(t', t): z = (1, 1), z' = diag(1, 2) t = (1, 0): cos = 1/sqrt(2)
L_T2_T = 2 - math.sqrt(2)


def test_default_is_eq6_one_direction():
    """FCL eq. 6: the online network sees t, the target t' -- one term, not Grill et al.'s sum."""
    assert BYOLSettings().symmetric is False
    out, _ = one_step(dict(num_rounds=1), T, T2)
    assert out["loss"] == pytest.approx(L_T_T2, abs=1e-6)  # 1.1056; the symmetric sum would be 1.6914


def test_symmetric_switch_adds_the_swapped_term():
    out, _ = one_step(dict(num_rounds=1, symmetric=True), T, T2)
    assert out["loss"] == pytest.approx(L_T_T2 + L_T2_T, abs=1e-6)  # 1.6914, not 2 x 1.1056 nor 1.1056


def test_target_is_the_ema_of_the_online_network_not_a_copy():
    """Views with cos(z, z') = 1 give a zero loss gradient, so the SGD step is weight decay alone:
    theta_1 = (1 - lr wd) I = 0.99995 I; eq. 7: xi_1 = m diag(1, 2) + (1 - m) theta_1."""
    out, model = one_step(dict(num_rounds=1), T, T)
    assert out["loss"] == pytest.approx(0.0, abs=1e-6)
    theta = 1 - 0.5 * 1e-4
    torch.testing.assert_close(model.online.weight, torch.diag(torch.tensor([theta, theta])), atol=1e-7, rtol=0)
    xi = torch.tensor([[0.99 * 1 + 0.01 * theta, 0.0], [0.0, 0.99 * 2 + 0.01 * theta]])  # 0.9999995, 1.9899995
    torch.testing.assert_close(model.target.weight, xi, atol=1e-6, rtol=0)


def test_paper_settings():
    """FCL section 5, "Training details": lr 0.5 for FCLOpt (the default), m 0.99, SGD momentum 0.9, weight decay
    1e-4, both fixed constants of the settings (no job argument)."""
    assert (BYOLSettings().lr, BYOLSettings().momentum) == (FCLOPT_LR, 0.99) == (0.5, 0.99)
    assert (BYOLSettings.sgd_momentum, BYOLSettings.weight_decay) == (0.9, 1e-4)
    assert "sgd_momentum" not in {f.name for f in dataclasses.fields(BYOLSettings)}


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="BYOLLocalTrainer: argument symmetric='yes' is invalid"):
        trainer(symmetric="yes")
    with pytest.raises(ValueError, match="BYOLLocalTrainer: argument lr=0 is invalid"):
        trainer(lr=0)
    with pytest.raises(ValueError, match="BYOLLocalTrainer: argument num_rounds=0 is invalid"):
        BYOLLocalTrainer(volumes(), BYOLSettings(**TINY), num_rounds=0)


def test_real_network_step_loss_and_target_ema():
    """On the BYOL U-Net: the reported loss is eq. 6 recomputed independently on the same views before the
    step, and after it every target parameter is m xi_0 + (1 - m) theta_1 (BN buffers copied)."""
    model = BYOLUNetEncoder(TINY_FEATURES, proj_dim=8, pred_hidden=16, seed=0, image_size=32)
    with torch.no_grad():  # a target that differs from the online network, as after some rounds
        for p in model.target.parameters():
            p.add_(0.05)
    before = copy.deepcopy(model)
    augment = lambda x, g: x + 0.01 * torch.randn(x.shape, generator=g)  # noqa: E731
    x = torch.rand(4, 1, 32, 32, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(3)
    t, t2 = augment(x, g), augment(x, g)
    z = F.normalize(before.predictor(before.online(t)), dim=1)
    z2 = F.normalize(before.target(t2), dim=1)
    expected = (2 - 2 * (z * z2).sum(1)).mean().item()
    tr = BYOLLocalTrainer(volumes(), BYOLSettings(**{**TINY, "lr": 0.05, "seed": 3}), num_rounds=2, model=model,
                          augment=augment)
    out = tr.train_batches([x], 1, 0)
    assert out["steps"] == 1 and out["loss"] == pytest.approx(expected, rel=1e-5)
    m = 0.99
    for (name, xi1), xi0, theta1 in zip(model.target.named_parameters(), before.target.parameters(),
                                        model.online.parameters()):
        torch.testing.assert_close(xi1, m * xi0 + (1 - m) * theta1, msg=name)
    assert any(not torch.equal(a, b) for a, b in zip(model.online.parameters(), model.target.parameters()))


def test_feature_std_is_the_spread_of_the_online_projections():
    """Issue 14 item 4: online = identity, so the projections of t = (e_1, e_2) are e_1, e_2: each coordinate is
    (1, 0) over the batch, std 1/2.  The target's projections of t' = (e_1, e_1) would give 0: not those."""
    t, t2 = torch.eye(2), torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    out, _ = one_step(dict(lr=0.1), t, t2)
    assert out["feature_std"] == pytest.approx(0.5)
    sym, _ = one_step(dict(lr=0.1, symmetric=True), t, t2)  # the swapped term's online(t') is not counted
    assert sym["feature_std"] == pytest.approx(0.5)


def test_amp_runs_the_networks_in_bfloat16_and_the_target_stays_float32():
    model = BYOLUNetEncoder(TINY_FEATURES, proj_dim=8, pred_hidden=16, seed=0, image_size=32)
    tr = BYOLLocalTrainer(volumes(), BYOLSettings(**{**TINY, "lr": 0.05}), num_rounds=2, model=model,
                          augment=lambda x, g: x)
    tr.precision = MixedPrecision("cpu", True, force=torch.bfloat16)  # the bfloat16 path on a CPU
    seen = []
    for m in model.online.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            m.register_forward_hook(lambda mod, i, o: seen.append(o.dtype))
    out = tr.train_batches([torch.rand(4, 1, 32, 32, generator=torch.Generator().manual_seed(0))], 1, 0)
    assert seen and set(seen) == {torch.bfloat16} and math.isfinite(out["loss"])
    assert all(p.dtype == torch.float32 for p in model.parameters())
