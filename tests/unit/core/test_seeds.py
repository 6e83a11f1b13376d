"""site_seed: reproducible, distinct per site, job seed outside FLARE."""

import hashlib

import pytest

from fedssl.core.seeds import SEED_SPACE, site_seed


def test_value_is_sha256_of_job_seed_and_site():
    expected = int.from_bytes(hashlib.sha256(b"0/site-1").digest()[:8], "big") % SEED_SPACE
    assert site_seed(0, "site-1") == expected


def test_sites_differ_and_job_seed_matters():
    seeds = {site_seed(0, f"site-{i}") for i in range(1, 11)}
    assert len(seeds) == 10
    assert site_seed(0, "site-1") != site_seed(1, "site-1")
    assert all(0 <= s < SEED_SPACE for s in seeds)


def test_empty_site_is_the_job_seed():
    assert site_seed(7, "") == 7


@pytest.mark.parametrize("seed", [-1, True, 1.5, "0"])
def test_bad_job_seed_is_named(seed):
    with pytest.raises(ValueError, match="job_seed"):
        site_seed(seed, "site-1")
