"""Per-site seeds: every site draws its own data order, augmentations, labelled subset and negatives.

A job configuration holds one ``seed``.  Used as is at every site, it gives every site the same augmentations, the
same initial feature bank and the same negative draws, so sites are not independent samples of the federation (and
FCL's exchanged banks start identical).  :func:`site_seed` derives each site's seed from the job seed and the site
name: reproducible (same job seed + same site name -> same seed, on any machine and Python version, since it is a
SHA-256 of the two, not Python's salted ``hash``) and different between sites.

Model initialisation stays on the job seed (every site builds the same initial weights; the server's broadcast
overwrites them anyway).  This is not a secret: randomness that protects privacy (feature perturbation, the shuttle's
order) comes from ``secrets`` at the party that applies it, never from here.
"""

from __future__ import annotations

import hashlib
import numbers

#: the derived seeds lie in [0, 2**31): valid for torch, numpy and random alike
SEED_SPACE = 2 ** 31


def site_seed(job_seed: int, site: str) -> int:
    """The seed of ``site`` in a job seeded with ``job_seed``: the first 8 bytes of SHA-256(``"<job_seed>/<site>"``)
    modulo 2**31.  An empty site name (a run outside FLARE, e.g. a local protocol) gives the job seed itself."""
    _check("site_seed", job_seed, site)
    if not site:
        return job_seed
    return _sha_seed(f"{job_seed}/{site}")


def fold_seed(job_seed: int, site: str, fold: int) -> int:
    """The seed of ``site``'s draw in cross-validation fold ``fold`` (which of its training patients are
    annotated): the first 8 bytes of SHA-256(``"<job_seed>/<site>/fold<fold>"``) modulo 2**31.  ``site`` may be
    empty (a draw from all sites' patients pooled).  Each fold draws afresh: with the site's seed alone the same
    positions of the fold's sorted training patients were drawn in every fold, so at N = 1 one patient was often
    the annotated one in several folds, and those folds repeated one fine-tuning."""
    _check("fold_seed", job_seed, site)
    if isinstance(fold, bool) or not isinstance(fold, int) or fold < 0:
        raise ValueError(f"fold_seed: fold={fold!r} is not a non-negative integer; pass the fold index (0-4)")
    return _sha_seed(f"{job_seed}/{site}/fold{fold}")


def derived_seed(seed: int, *keys: str | int) -> int:
    """A seed for one use of ``seed`` named by ``keys`` (e.g. ``derived_seed(site_seed(0, "site-1"), "round", 3)``):
    the first 8 bytes of SHA-256(``"derived:<seed>/<key>/<key>..."``) modulo 2**31.  Different keys give unrelated
    seeds, the same keys the same seed on any machine.  A trainer seeds its owned global RNG from it
    (:func:`fedssl.core.rng.owned_global_rng`) with a key it keeps in its state (round index, epoch, step), so a
    restarted client draws what the uninterrupted one would have."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise ValueError(f"derived_seed: seed={seed!r} is not a non-negative integer")
    parts = [str(int(seed))]
    for key in keys:
        if isinstance(key, bool) or not isinstance(key, (str, numbers.Integral)):
            raise ValueError(f"derived_seed: key {key!r} is not a string or an integer")
        parts.append(key if isinstance(key, str) else str(int(key)))
    return _sha_seed("derived:" + "/".join(parts))


def _check(caller: str, job_seed: object, site: object) -> None:
    if isinstance(job_seed, bool) or not isinstance(job_seed, int) or job_seed < 0:
        raise ValueError(f"{caller}: job_seed={job_seed!r} is not a non-negative integer; use the job's 'seed'")
    if not isinstance(site, str):
        raise ValueError(f"{caller}: site={site!r} is not a string; pass the FLARE client name")


def _sha_seed(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") % SEED_SPACE
