"""site_seed: reproducible, distinct per site, job seed outside FLARE; fold_seed: distinct per fold too; derived_seed:
one seed per named use (a trainer's round, epoch, ...)."""

import hashlib

import numpy as np
import pytest

from fedssl.core.seeds import SEED_SPACE, derived_seed, fold_seed, site_seed


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


def test_fold_seed_is_sha256_of_job_seed_site_and_fold():
    expected = int.from_bytes(hashlib.sha256(b"3/site-2/fold4").digest()[:8], "big") % SEED_SPACE
    assert fold_seed(3, "site-2", 4) == expected
    assert fold_seed(0, "", 1) == int.from_bytes(hashlib.sha256(b"0//fold1").digest()[:8], "big") % SEED_SPACE


def test_fold_seeds_differ_by_fold_site_and_job_seed():
    seeds = {fold_seed(0, site, fold) for site in ("site-1", "site-2", "") for fold in range(5)}
    assert len(seeds) == 15 and all(0 <= s < SEED_SPACE for s in seeds)
    assert fold_seed(0, "site-1", 0) != fold_seed(1, "site-1", 0)
    assert fold_seed(0, "site-1", 0) != site_seed(0, "site-1")


@pytest.mark.parametrize("args, match", [((-1, "site-1", 0), "fold_seed: job_seed=-1"),
                                         ((0, 1, 0), "fold_seed: site=1"),
                                         ((0, "site-1", -1), "fold_seed: fold=-1"),
                                         ((0, "site-1", True), "fold_seed: fold=True"),
                                         ((0, "site-1", 1.0), "fold_seed: fold=1.0")])
def test_bad_fold_seed_argument_is_named(args, match):
    with pytest.raises(ValueError, match=match):
        fold_seed(*args)


def test_derived_seed_is_sha256_of_seed_and_keys_and_apart_from_site_seeds():
    expected = int.from_bytes(hashlib.sha256(b"derived:5/round/3").digest()[:8], "big") % SEED_SPACE
    assert derived_seed(5, "round", 3) == expected
    seeds = {derived_seed(s, "round", r) for s in (0, 1) for r in range(5)} | {derived_seed(0, "epoch", 0)}
    assert len(seeds) == 11 and all(0 <= s < SEED_SPACE for s in seeds)
    assert derived_seed(0, "site-1") != site_seed(0, "site-1")  # a site name is no key collision
    assert derived_seed(0, "round", np.int64(3)) == derived_seed(0, "round", 3)  # numpy integers are integers


@pytest.mark.parametrize("args, match", [((-1, "round"), "derived_seed: seed=-1"),
                                         ((True, "round"), "derived_seed: seed=True"),
                                         ((1.0, "round"), "derived_seed: seed=1.0"),
                                         ((0, 1.5), "derived_seed: key 1.5"),
                                         ((0, None), "derived_seed: key None"),
                                         ((0, False), "derived_seed: key False")])
def test_bad_derived_seed_argument_is_named(args, match):
    with pytest.raises(ValueError, match=match):
        derived_seed(*args)
