"""FedDRA's client reweighting (fedssl.core.dro): the chi^2-ball projection against a brute-force grid, the
exponentiated-gradient step by hand, and the missing-loss rule."""

import itertools
import math

import numpy as np
import pytest

from fedssl.core.dro import (check_dro_args, chi2_divergence, dro_update, exponentiated_gradient, project_chi2_ball,
                             project_simplex, step_scale, uniform_weights)


def grid_projection(y, rho, step=0.004):
    """An independent solver: the nearest point to y among a fine grid of the 3-simplex inside the ball."""
    best, best_d = None, math.inf
    ticks = np.arange(0.0, 1.0 + 1e-12, step)
    for a, b in itertools.product(ticks, ticks):
        if a + b > 1.0 + 1e-12:
            continue
        x = np.array([a, b, max(1.0 - a - b, 0.0)])
        if chi2_divergence(x) <= rho + 1e-12:
            d = float(np.sum((x - y) ** 2))
            if d < best_d:
                best, best_d = x, d
    return best


def test_divergence_by_hand():
    # N = 4, lambda = (0.4, 0.2, 0.2, 0.2): N lambda = (1.6, .8, .8, .8);
    # f = (t-1)^2/2 -> (.18, .02, .02, .02); mean .06
    assert chi2_divergence(np.array([0.4, 0.2, 0.2, 0.2])) == pytest.approx(0.06)
    assert chi2_divergence(np.full(5, 0.2)) == 0.0


@pytest.mark.parametrize("seed", range(6))
def test_projection_matches_a_grid_search(seed):
    rng = np.random.default_rng(seed)
    y = rng.dirichlet(np.ones(3) * 0.5) if seed % 2 else rng.normal(0.33, 0.4, 3)  # on and off the simplex
    rho = [0.02, 0.1, 0.3][seed % 3]
    x = project_chi2_ball(y, rho)
    assert x.min() >= 0 and x.sum() == pytest.approx(1.0)
    assert chi2_divergence(x) <= rho + 1e-9
    ref = grid_projection(y, rho)
    # the grid's answer is at most a grid step away and no closer to y than the exact projection
    assert np.abs(x - ref).max() < 0.01
    assert np.sum((x - y) ** 2) <= np.sum((ref - y) ** 2) + 1e-9


def test_projection_leaves_a_point_inside_unchanged_and_lands_on_the_boundary_otherwise():
    inside = np.array([0.25, 0.2, 0.2, 0.2, 0.15])
    assert chi2_divergence(inside) < 0.1
    np.testing.assert_allclose(project_chi2_ball(inside, 0.1), inside)
    outside = np.array([0.7, 0.1, 0.1, 0.05, 0.05])
    x = project_chi2_ball(outside, 0.1)
    assert chi2_divergence(x) == pytest.approx(0.1, rel=1e-6)  # the boundary case
    # a point of the simplex is projected radially towards uniform (the ball's projection lies in the simplex)
    u = np.full(5, 0.2)
    direction = (x - u) / np.linalg.norm(x - u)
    np.testing.assert_allclose(direction, (outside - u) / np.linalg.norm(outside - u), atol=1e-8)


def test_simplex_projection_by_hand():
    np.testing.assert_allclose(project_simplex(np.array([0.5, 0.5, 0.5])), [1 / 3] * 3)
    np.testing.assert_allclose(project_simplex(np.array([2.0, 0.0, -1.0])), [1.0, 0.0, 0.0])
    np.testing.assert_allclose(project_simplex(np.array([0.6, 0.6, 0.0])), [0.5, 0.5, 0.0])


def test_exponentiated_gradient_by_hand():
    lam, v = np.array([0.5, 0.25, 0.25]), np.array([1.0, 2.0, 0.0])
    w = lam * np.exp(0.5 * v)  # gamma 0.5
    np.testing.assert_allclose(exponentiated_gradient(lam, v, 0.5), w / w.sum())
    # a constant shift of every loss changes nothing; huge losses do not overflow
    np.testing.assert_allclose(exponentiated_gradient(lam, v + 1000.0, 0.5), w / w.sum())


def test_update_raises_the_weight_of_the_worst_site_within_the_ball():
    weights = uniform_weights(["site-1", "site-2", "site-3"])
    new, kept = dro_update(weights, {"site-1": 3.0, "site-2": 2.0, "site-3": 1.0}, gamma=0.5, rho=0.1)
    assert kept == []
    assert new["site-1"] > new["site-2"] > new["site-3"]
    assert sum(new.values()) == pytest.approx(1.0)
    assert chi2_divergence(np.array(list(new.values()))) <= 0.1 + 1e-9
    # small steps stay inside the ball: then the update is exactly the exponentiated step
    small, _ = dro_update(weights, {"site-1": 0.3, "site-2": 0.2, "site-3": 0.1}, gamma=0.5, rho=0.1)
    e = np.exp(0.5 * np.array([0.3, 0.2, 0.1]))
    np.testing.assert_allclose([small[s] for s in sorted(small)], e / e.sum())


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), "3.0", True])
def test_a_site_without_a_valid_loss_keeps_its_weight(bad):
    weights = {"site-1": 0.3, "site-2": 0.4, "site-3": 0.3}
    losses = {"site-1": 2.0, "site-2": bad, "site-3": 1.0}
    if bad is None:
        del losses["site-2"]
    new, kept = dro_update(weights, losses, gamma=0.5, rho=0.5)
    assert kept == ["site-2"]
    assert new["site-2"] == 0.4
    assert sum(new.values()) == pytest.approx(1.0)
    assert new["site-1"] > new["site-3"]
    # the others took the exponentiated step among themselves, with their total weight kept
    e = np.array([0.3, 0.3]) * np.exp(0.5 * np.array([2.0, 1.0]))
    np.testing.assert_allclose([new["site-1"], new["site-3"]], 0.6 * e / e.sum())


def test_no_valid_loss_changes_nothing_and_bad_weights_are_refused():
    weights = uniform_weights(["a", "b"])
    assert dro_update(weights, {}, 0.5, 0.1) == (weights, ["a", "b"])
    with pytest.raises(ValueError, match="not on the simplex"):
        dro_update({"a": 0.9, "b": 0.9}, {"a": 1.0, "b": 1.0}, 0.5, 0.1)


@pytest.mark.parametrize("rho,gamma,name", [(0, 0.5, "rho"), (-1, 0.5, "rho"), (0.1, 0, "gamma"),
                                            (float("nan"), 0.5, "rho"), (0.1, True, "gamma")])
def test_nonpositive_radius_or_step_is_refused(rho, gamma, name):
    with pytest.raises(ValueError, match=f"argument {name}="):
        check_dro_args("FedDRAController", rho, gamma)


def test_step_scale_is_one_under_uniform_weights():
    assert step_scale(0.2, 5) == pytest.approx(1.0)
    assert step_scale(0.3, 5) == pytest.approx(1.5)


def test_the_projection_moves_only_the_sites_with_a_valid_loss():
    weights = {"site-1": 0.35, "site-2": 0.3, "site-3": 0.35}
    new, kept = dro_update(weights, {"site-1": 10.0, "site-3": 0.0}, gamma=1.0, rho=0.05)
    assert kept == ["site-2"]
    assert new["site-2"] == 0.3
    assert chi2_divergence(np.array([new[s] for s in sorted(new)])) == pytest.approx(0.05, rel=1e-6)  # active
    assert new["site-1"] > 1 / 3 > new["site-3"]


@pytest.mark.parametrize("n,rho,gamma", [(2, 0.5, 0.2), (5, 0.1, 0.5), (3, 0.1, 0.5)])
def test_no_sequence_of_reports_stops_the_update_or_takes_a_site_over(n, rho, gamma):
    """Issue 45: honest, lying (50, 1e308, -1e308) and missing reports in random order over 24 turns, 150 runs:
    the update never raises, the weights stay on the simplex, inside the chi^2 ball and above min_share / N."""
    from fedssl.core.dro import MIN_SHARE, chi2_divergence, dro_update, uniform_weights

    rng = np.random.default_rng(0)
    sites = [f"site-{i}" for i in range(1, n + 1)]
    lies = (50.0, 1e308, -1e308, float("nan"), None)
    for _ in range(150):
        w = uniform_weights(sites)
        for _turn in range(24):
            losses = {}
            for s in sites:
                kind = rng.integers(3)
                if kind == 0:
                    losses[s] = float(rng.uniform(2.0, 4.0))
                elif kind == 1:
                    losses[s] = lies[int(rng.integers(len(lies)))]
            w, _ = dro_update(w, losses, gamma, rho, min_share=MIN_SHARE)
            lam = np.array([w[s] for s in sites])
            assert abs(lam.sum() - 1.0) < 1e-9 and np.all(np.isfinite(lam))
            assert lam.min() >= MIN_SHARE / n - 1e-9
            assert chi2_divergence(lam) <= rho + 1e-9


def test_one_lie_in_a_two_site_job_leaves_the_honest_site_a_bounded_share():
    """Issue 45: in feddra_retina (2 sites, rho 0.5, gamma 0.2) one reported loss of 50 gave the liar lambda = 1.0
    and the honest site 0.0; with the floor the liar gets at most 0.75 and the honest site keeps 0.25."""
    from fedssl.core.dro import MIN_SHARE, dro_update, uniform_weights

    w = uniform_weights(["site-1", "site-2"])
    paper, _ = dro_update(w, {"site-1": 50.0, "site-2": 3.0}, 0.2, 0.5, min_share=0.0)
    assert paper["site-1"] > 0.999 and paper["site-2"] < 1e-3  # the paper's unbounded weights
    bounded, _ = dro_update(w, {"site-1": 50.0, "site-2": 3.0}, 0.2, 0.5, min_share=MIN_SHARE)
    assert bounded["site-1"] == pytest.approx(0.75) and bounded["site-2"] == pytest.approx(0.25)


def test_the_reported_attack_sequence_no_longer_raises():
    """A site reports 50 twice, then nothing: the next turn's update raised 'the chi^2 ball does not meet the
    simplex' (the run panicked)."""
    from fedssl.core.dro import dro_update, uniform_weights

    sites = [f"site-{i}" for i in range(1, 6)]
    for min_share in (0.0, 0.5):
        w = uniform_weights(sites)
        honest = {s: 3.0 for s in sites[1:]}
        for report in (50.0, 50.0, None, 50.0, None, None):
            w, _ = dro_update(w, {**honest, **({} if report is None else {"site-1": report})}, 0.5, 0.1,
                              min_share=min_share)
            assert abs(sum(w.values()) - 1.0) < 1e-9
