"""FedDRA's client reweighting: exponentiated-gradient ascent on the client weights, projected onto a chi^2 ball.

"Distributionally Robust Alignment for Medical Federated Vision-Language Pre-training Under Data Heterogeneity"
(Shuai, Wu, Tang and Shen, TMLR), sec. 4.3 and Algorithm 1 line 18, after the decentralised DRO of Zhang et al.
(2023).  With N clients and the weights lambda on the simplex:

    lambda_i <- lambda_i exp(gamma v_i) / sum_j lambda_j exp(gamma v_j)          (mirror ascent, v_i: client loss)
    lambda   <- Proj { lambda in simplex : D_chi2(N lambda || 1) <= rho }         (the uncertainty set)

The divergence is the chi^2 f-divergence with f(t) = (t - 1)^2 / 2 between the reweighted distribution and the
uniform one, ``D = (1 / N) sum_i f(N lambda_i) = (N / 2) ||lambda - u||^2`` (u = 1/N): the convention of Namkoong and
Duchi's chi^2-ball projection, which the authors' code uses.  The set is the simplex cut by a Euclidean ball
around u, so the projection is exact: ``x(nu) = Proj_simplex((y + nu u) / (1 + nu))`` with the smallest nu >= 0
whose x lies in the ball, found by bisection (the ball term only shrinks as nu grows).

A client whose loss is missing or not finite keeps its previous weight: the exponentiated step runs over the
others (their total weight unchanged) and the projection moves only them.  Each client's step size is scaled by
``N lambda_i`` (:func:`step_scale`), so uniform weights reproduce plain training.

No sequence of reports can stop the update (issue 45): the step is computed from the losses shifted by their
largest value (a loss of 1e308 cannot overflow), and the projection never fails: when the others' fixed weights
leave the moving sites no feasible point, or the set is met only in the limit, every weight is projected (the full
set always holds the uniform weights).  ``min_share`` (a deviation from the paper, whose weights may reach 0): no
weight falls below ``min_share / N``, so no weight exceeds ``1 - (N - 1) min_share / N`` either; with two sites and
the default 0.5 a site that lies about its loss gets at most 0.75 and the other keeps 0.25 and trains.  The set
projected on is then the simplex with that floor, cut by the chi^2 ball; ``min_share = 0`` is the paper's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np


#: no client weight below MIN_SHARE / N by default (see the module docstring)
MIN_SHARE = 0.5


def check_dro_args(component: str, rho: object, gamma: object, min_share: object = MIN_SHARE) -> None:
    """ValueError unless rho and gamma are finite numbers > 0 (the uncertainty radius and the mirror step) and
    min_share is a number in [0, 1)."""
    if not (isinstance(min_share, (int, float)) and not isinstance(min_share, bool) and 0 <= min_share < 1):
        raise ValueError(f"{component}: argument min_share={min_share!r} is invalid; use a number in [0, 1): each "
                         f"client keeps at least min_share / N of the weight (default {MIN_SHARE}; 0 = the paper's "
                         "unbounded weights)")
    for name, value, fix in (("rho", rho, "use the uncertainty radius, > 0 (paper: 0.1 on MIMIC-CXR, 0.5 on retina)"),
                             ("gamma", gamma, "use the mirror-ascent step, > 0 (the authors' code: 0.01 x steps per "
                                              "turn)")):
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0):
            raise ValueError(f"{component}: argument {name}={value!r} is invalid; {fix}")


def chi2_divergence(lam: np.ndarray) -> float:
    """D_chi2(N lambda || 1) = (1/N) sum_i (N lambda_i - 1)^2 / 2."""
    lam = np.asarray(lam, dtype=np.float64)
    n = lam.size
    return float(np.mean((n * lam - 1.0) ** 2) / 2.0)


def project_simplex(v: np.ndarray, mass: float = 1.0, floor: float = 0.0) -> np.ndarray:
    """Euclidean projection onto {x >= floor, sum x = mass} (Duchi, Shalev-Shwartz, Singer and Chandra, ICML 2008,
    shifted by the floor; ``mass >= floor * size``)."""
    v = np.asarray(v, dtype=np.float64) - floor
    m = max(0.0, mass - floor * v.size)
    if m == 0.0:
        return np.full(v.size, floor)
    u = np.sort(v)[::-1]
    css = np.cumsum(u) - m
    idx = np.arange(1, v.size + 1)
    k = idx[u - css / idx > 0][-1]
    return np.maximum(v - css[k - 1] / k, 0.0) + floor


def _project_ball_simplex(y: np.ndarray, centre: np.ndarray, radius2: float, mass: float, floor: float = 0.0,
                          iters: int = 200) -> np.ndarray:
    """Projection of y onto {x >= floor, sum x = mass, ||x - centre||^2 <= radius2}: x(nu) =
    Proj((y + nu centre) / (1 + nu)) with the smallest nu >= 0 inside the ball (bisection).  Never raises: where the
    ball is met only in the limit (the centre's projection on the bounded simplex touches the ball's edge), the
    point of the largest nu tried (1e12) is returned, within 1e-12 of that limit."""
    def at(nu: float) -> np.ndarray:
        return project_simplex((y + nu * centre) / (1.0 + nu), mass, floor)

    x = at(0.0)
    if np.sum((x - centre) ** 2) <= radius2:
        return x
    lo, hi = 0.0, 1.0
    while np.sum((at(hi) - centre) ** 2) > radius2:
        lo, hi = hi, hi * 2.0
        if hi > 1e12:
            return at(hi)
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if np.sum((at(mid) - centre) ** 2) > radius2:
            lo = mid
        else:
            hi = mid
    return at(hi)


def project_chi2_ball(lam: np.ndarray, rho: float, fixed: np.ndarray | None = None,
                      min_share: float = 0.0) -> np.ndarray:
    """Euclidean projection of ``lam`` onto {simplex, every weight >= min_share / N, D_chi2(N lambda || 1) <= rho};
    unchanged when already inside.

    ``fixed``: a boolean mask of entries that keep their value; the others are projected onto the simplex part
    of the remaining mass inside what is left of the ball (when nothing feasible is left, every entry is
    projected: the full set always holds the uniform weights)."""
    lam = np.asarray(lam, dtype=np.float64)
    n = lam.size
    radius2 = 2.0 * float(rho) / n  # D = (N/2) ||lam - u||^2 <= rho
    centre = np.full(n, 1.0 / n)
    floor = float(min_share) / n
    if fixed is None or not np.any(fixed):
        return _project_ball_simplex(lam, centre, radius2, 1.0, floor)
    fixed = np.asarray(fixed, dtype=bool)
    free = ~fixed
    mass = 1.0 - float(np.sum(lam[fixed]))
    left = radius2 - float(np.sum((lam[fixed] - centre[fixed]) ** 2))
    n_free = int(free.sum())
    if np.any(lam[fixed] < floor) or mass < floor * n_free + 1e-12:
        return _project_ball_simplex(lam, centre, radius2, 1.0, floor)
    # the smallest distance from the free part of the centre to the free (bounded) simplex of this mass
    nearest = project_simplex(centre[free], mass, floor)
    if left <= float(np.sum((nearest - centre[free]) ** 2)) + 1e-12:  # empty or met only at its edge
        return _project_ball_simplex(lam, centre, radius2, 1.0, floor)
    out = lam.copy()
    out[free] = _project_ball_simplex(lam[free], centre[free], left, mass, floor)
    return out


def exponentiated_gradient(lam: np.ndarray, losses: np.ndarray, gamma: float) -> np.ndarray:
    """lambda_i exp(gamma v_i) / sum_j lambda_j exp(gamma v_j), computed stably: the losses are shifted by the
    largest one before the step multiplies them (no overflow for any finite loss)."""
    lam = np.asarray(lam, dtype=np.float64)
    v = np.asarray(losses, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        shifted = np.nan_to_num(v - v.max(), nan=-np.inf, neginf=-np.inf)  # <= 0; -inf where v - max overflows
        logits = np.log(np.maximum(lam, 1e-300)) + float(gamma) * shifted
    w = np.exp(logits - logits.max())
    return w / w.sum()


def dro_update(weights: Mapping[str, float], losses: Mapping[str, object], gamma: float, rho: float,
               min_share: float = 0.0) -> tuple[dict[str, float], list[str]]:
    """One server update of the client weights.  Returns (new weights, the sites that kept their weight).

    ``weights``: every site of the run (on the simplex); ``losses``: the reported v_i (a site may be absent; a
    value that is not a finite number counts as missing).  Sites with a valid loss take the exponentiated step
    among themselves (their total weight is kept), then the chi^2 projection (with the floor ``min_share / N``)
    moves only them.  Raises only for a server-side error (no sites, or current weights off the simplex), never
    for what the sites reported."""
    sites = sorted(weights)
    if not sites:
        raise ValueError("dro_update: no sites")
    lam = np.array([float(weights[s]) for s in sites], dtype=np.float64)
    if not np.all(np.isfinite(lam)) or np.any(lam < 0) or abs(lam.sum() - 1.0) > 1e-6:
        raise ValueError(f"dro_update: the current weights {dict(zip(sites, lam.tolist()))} are not on the simplex")
    valid = np.array([_finite(losses.get(s)) for s in sites])
    kept = [s for s, ok in zip(sites, valid) if not ok]
    if not valid.any():
        return {s: float(v) for s, v in zip(sites, lam)}, kept
    v = np.array([float(losses[s]) if ok else 0.0 for s, ok in zip(sites, valid)])
    new = lam.copy()
    mass = lam[valid].sum()
    if mass > 0:
        new[valid] = mass * exponentiated_gradient(lam[valid] / mass, v[valid], gamma)
    new = project_chi2_ball(new, rho, fixed=~valid, min_share=min_share)
    return {s: float(x) for s, x in zip(sites, new)}, kept


def uniform_weights(sites) -> dict[str, float]:
    sites = sorted(sites)
    return {s: 1.0 / len(sites) for s in sites}


def step_scale(weight: float, n_sites: int) -> float:
    """The factor on a client's step size: N lambda_i (1 under uniform weights)."""
    return float(n_sites) * float(weight)


def _finite(value: object) -> bool:
    return isinstance(value, (int, float, np.floating)) and not isinstance(value, bool) and math.isfinite(float(value))
