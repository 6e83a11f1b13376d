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

#: the derived seeds lie in [0, 2**31): valid for torch, numpy and random alike
SEED_SPACE = 2 ** 31


def site_seed(job_seed: int, site: str) -> int:
    """The seed of ``site`` in a job seeded with ``job_seed``: the first 8 bytes of SHA-256(``"<job_seed>/<site>"``)
    modulo 2**31.  An empty site name (a run outside FLARE, e.g. a local protocol) gives the job seed itself."""
    if isinstance(job_seed, bool) or not isinstance(job_seed, int) or job_seed < 0:
        raise ValueError(f"site_seed: job_seed={job_seed!r} is not a non-negative integer; use the job's 'seed'")
    if not isinstance(site, str):
        raise ValueError(f"site_seed: site={site!r} is not a string; pass the FLARE client name")
    if not site:
        return job_seed
    digest = hashlib.sha256(f"{job_seed}/{site}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % SEED_SPACE
