"""Predictive target network update (PTNU) and distance prediction (DP), FCL (Wu et al., MedIA 2022) sections 4.4-4.5.

Distances are mean absolute differences over all target-network parameters and their online
counterparts (``target.X`` <-> ``online.X``):  d(F_theta, F_xi) = mean |theta - xi|  (eq. 10).

PTNU (Algorithm 2): a client starts from its own last target xi and repeats
    xi <- m_d xi + (1 - m_d) theta_global
until d(theta_global, xi) <= d.  With theta fixed, after n steps xi_n - theta = m_d^n (xi_0 - theta), so
the distance after n steps is exactly m_d^n d_0.  We run Algorithm 2's loop on that scalar (same stopping
rule, same n) and then apply the n updates at once in closed form, which costs one pass over the
parameters instead of n.

DP: each client reports d_pc = d(theta_global, xi_c) (eq. 12); the server predicts
d~ = alpha * mean_c d_pc (eqs. 13-14) and, on calibration rounds, sets alpha = d_exact / mean_c d_pc (eq. 15).
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np

from fedssl.core.untrusted import ContributionError, as_finite_float

ONLINE, TARGET = "online.", "target."


class PTNUError(ValueError):
    """The predicted target cannot be computed (bad distance, no convergence within the bound)."""


def target_pairs(keys: Sequence[str]) -> list[tuple[str, str]]:
    """(online key, target key) for every target parameter whose online counterpart exists."""
    keyset = set(keys)
    pairs = [(ONLINE + k[len(TARGET):], k) for k in sorted(keyset) if k.startswith(TARGET)]
    missing = [t for o, t in pairs if o not in keyset]
    if missing:
        raise PTNUError(f"target keys without online counterpart: {missing[:3]}")
    if not pairs:
        raise PTNUError("no target.* parameters in the model")
    return pairs


def _float_keys(state: Mapping[str, object], pairs) -> list[tuple[str, str]]:
    return [(o, t) for o, t in pairs if np.asarray(state[t]).dtype.kind == "f"]


def mean_l1(online: Mapping[str, object], target: Mapping[str, object], pairs: Sequence[tuple[str, str]]) -> float:
    """mean |theta - xi| over every element of the paired float parameters (eq. 10 / eq. 12)."""
    total, count = 0.0, 0
    for o, t in pairs:
        a, b = np.asarray(online[o], dtype=np.float64), np.asarray(target[t], dtype=np.float64)
        total += float(np.abs(a - b).sum())
        count += a.size
    return total / max(count, 1)


def global_distance(state: Mapping[str, object]) -> float:
    """d(F_theta, F_xi) of one state dict holding both networks (server side, eq. 10)."""
    pairs = _float_keys(state, target_pairs(list(state)))
    return mean_l1(state, state, pairs)


def ptnu_steps(d0: float, d: float, m_d: float = 0.995, max_iter: int = 100_000) -> int:
    """Number of Algorithm-2 iterations until m_d^n d0 <= d (0 if already within d)."""
    if not (math.isfinite(d) and d >= 0):
        raise PTNUError(f"target distance d={d!r} must be finite and >= 0")
    if not 0 < m_d < 1:
        raise PTNUError(f"m_d={m_d!r} must be in (0, 1) (paper: 0.995)")
    n, dist = 0, d0
    while dist > d:
        if n >= max_iter:
            raise PTNUError(
                f"PTNU did not reach d={d:.3g} from {d0:.3g} within {max_iter} iterations (m_d={m_d}); "
                "the server's distance is inconsistent with this site's target network"
            )
        dist *= m_d
        n += 1
    return n


def predict_target(
    xi: Mapping[str, np.ndarray], theta: Mapping[str, np.ndarray], d: float, m_d: float = 0.995, max_iter: int = 100_000
) -> tuple[dict[str, np.ndarray], int]:
    """Algorithm 2: the predicted global target from this site's last target ``xi`` and the global online
    ``theta`` (both keyed ``target.X`` / ``online.X``); returns (new target state, iterations)."""
    pairs = target_pairs(list(xi) + [o for o in theta if o.startswith(ONLINE)])
    pairs = [(o, t) for o, t in pairs if t in xi and o in theta]
    fpairs = [(o, t) for o, t in pairs if np.asarray(xi[t]).dtype.kind == "f"]
    d0 = mean_l1(theta, xi, fpairs)
    n = ptnu_steps(d0, d, m_d, max_iter)
    keep = m_d ** n
    out = {}
    for o, t in pairs:
        x, th = np.asarray(xi[t]), np.asarray(theta[o])
        # float parameters: n EMA steps in closed form; integer buffers (BN counters) follow the online net
        out[t] = (th + keep * (x - th)).astype(x.dtype) if x.dtype.kind == "f" else th.copy()
    return out, n


def proxy_distance(theta: Mapping[str, np.ndarray], xi: Mapping[str, np.ndarray]) -> float:
    """d_pc = d(F_theta^{r+1}, f_xi_c^r), computed on the client (eq. 12)."""
    pairs = [(o, t) for o, t in target_pairs(list(xi) + [o for o in theta if o.startswith(ONLINE)])
             if t in xi and o in theta and np.asarray(xi[t]).dtype.kind == "f"]
    return mean_l1(theta, xi, pairs)


def valid_distances(d_pcs: Mapping[str, object], max_ratio: float = 10.0) -> tuple[dict[str, float], dict[str, object]]:
    """Split reported proxy distances into usable and rejected ones.

    Usable: a real number (not a bool or a string), finite, >= 0, and, when at least 3 sites reported, at most
    ``max_ratio`` times their median, so that one site cannot drive the predicted distance d~ (a mean) alone.
    """
    good, bad = {}, {}
    for site, v in d_pcs.items():
        try:
            f = as_finite_float(v, "d_pc", site)
        except ContributionError:
            bad[site] = v
            continue
        (good if f >= 0 else bad)[site] = f
    if len(good) >= 3:
        median = float(np.median(list(good.values())))
        for site in [s for s, f in good.items() if median > 0 and f > max_ratio * median]:
            bad[site] = good.pop(site)
    return good, bad


def predicted_distance(alpha: float, d_pcs: Sequence[float]) -> float:
    """d~ = alpha * mean_c d_pc (eqs. 13-14)."""
    if not d_pcs:
        raise PTNUError("no valid proxy distance this round: cannot predict the target distance")
    return float(alpha) * float(np.mean(d_pcs))


def calibrate_alpha(d_exact: float, d_pcs: Sequence[float], previous: float) -> float:
    """alpha = d_exact / mean_c d_pc (eq. 15); keeps ``previous`` when DP is 0 (nothing to scale)."""
    dp = float(np.mean(d_pcs)) if d_pcs else 0.0
    if not (math.isfinite(d_exact) and d_exact >= 0):
        raise PTNUError(f"exact distance d={d_exact!r} is not a finite non-negative number")
    if dp <= 0:
        return previous
    return d_exact / dp


def uploads_target(mode: str, calibration_round: bool) -> bool:
    """Whether the sites upload their target network in a round: always under FCLOpt and PTNU (the server
    averages it), never under FedBYOL, and under PTNU-DP only in calibration rounds (every R rounds).  The
    server's round plan and the sites' uploads both follow this one rule."""
    return mode in ("fclopt", "ptnu") or (mode == "ptnu_dp" and bool(calibration_round))
