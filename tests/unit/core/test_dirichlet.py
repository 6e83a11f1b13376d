"""Tests for the SSL-FL Dirichlet splitter and the real-site split (fedssl.core.dirichlet)."""

from __future__ import annotations

import numpy as np
import pytest

from fedssl.core.dirichlet import class_counts, dirichlet_split, iid_split, real_site_split

# a Retina-like label vector: 2 classes, 73 % class 0, 1000 images
LABELS = np.array([0] * 730 + [1] * 270)
# a Derm-like one: 8 classes, NV-dominated
DERM = np.repeat(np.arange(8), [180, 510, 130, 35, 100, 10, 10, 25])


def _mean_tv(labels: np.ndarray, parts: list[list[int]]) -> float:
    k = int(labels.max()) + 1
    glob = np.bincount(labels, minlength=k) / len(labels)
    m = class_counts(labels, parts, k).astype(float)
    site = m / m.sum(1, keepdims=True)
    return float(np.mean(0.5 * np.abs(site - glob).sum(1)))


def test_deterministic_for_a_seed_and_different_across_seeds():
    a = dirichlet_split(LABELS, 5, 0.5, seed=3)
    b = dirichlet_split(list(LABELS), 5, 0.5, seed=3)
    c = dirichlet_split(LABELS, 5, 0.5, seed=4)
    assert a == b
    assert a != c


@pytest.mark.parametrize("alpha", [100.0, 1.0, 0.5, 0.1])
def test_every_index_exactly_once_and_min_per_site(alpha):
    parts = dirichlet_split(DERM, 5, alpha, seed=0, min_per_site=10)
    flat = [i for p in parts for i in p]
    assert sorted(flat) == list(range(len(DERM)))
    assert len(parts) == 5
    assert min(len(p) for p in parts) >= 10
    assert all(p == sorted(p) for p in parts)


def test_min_per_site_forces_redraws_to_a_valid_split():
    # for this seed the first draw leaves a site below 60 images (one draw is not enough) ...
    with pytest.raises(ValueError, match="attempts"):
        dirichlet_split(LABELS, 5, 0.3, seed=0, min_per_site=60, max_redraws=1)
    # ... and the splitter redraws until every site has 60
    parts = dirichlet_split(LABELS, 5, 0.3, seed=0, min_per_site=60)
    assert min(len(p) for p in parts) >= 60


def test_capacity_cap_bounds_site_sizes():
    # a site stops receiving new classes once it holds >= N / n_sites images: with many small classes the
    # largest site can exceed the cap by at most one class's worth of images
    labels = np.repeat(np.arange(50), 20)  # 1000 images, 50 classes of 20
    for seed in range(5):
        parts = dirichlet_split(labels, 5, 0.1, seed=seed, min_per_site=1)
        assert max(len(p) for p in parts) <= 1000 / 5 + 20
    # without the cap (one class) nothing bounds a site: the cap only applies across classes
    one = dirichlet_split(np.zeros(1000, int), 5, 0.1, seed=0, min_per_site=0)
    assert sum(len(p) for p in one) == 1000


def test_alpha_orders_similarity_to_global_class_mix():
    tv = {a: np.mean([_mean_tv(LABELS, dirichlet_split(LABELS, 5, a, seed=s)) for s in range(10)])
          for a in (100.0, 1.0, 0.5)}
    assert tv[100.0] < 0.05  # near-uniform class mixes (Split-1, IID)
    assert tv[0.5] > 0.2  # strongly skewed (Split-3)
    assert tv[100.0] < tv[1.0] < tv[0.5]
    tv8 = {a: np.mean([_mean_tv(DERM, dirichlet_split(DERM, 5, a, seed=s)) for s in range(10)])
           for a in (100.0, 1.0, 0.5)}
    assert tv8[100.0] < tv8[1.0] < tv8[0.5]


def test_impossible_min_per_site_raises_clear_error():
    with pytest.raises(ValueError, match="min_per_site=30"):
        dirichlet_split(np.zeros(100, int), 5, 0.5, seed=0, min_per_site=30)
    with pytest.raises(ValueError, match="attempts"):
        # feasible in principle (5 x 19 <= 100) but a 2-class split with a tiny alpha never gets there
        dirichlet_split(np.array([0] * 50 + [1] * 50), 5, 0.001, seed=0, min_per_site=19, max_redraws=20)


@pytest.mark.parametrize("kwargs, match", [
    ({"n_sites": 0}, "n_sites"), ({"alpha": 0.0}, "alpha"), ({"alpha": float("nan")}, "alpha"),
    ({"min_per_site": -1}, "min_per_site"),
])
def test_bad_arguments(kwargs, match):
    args = {"labels": LABELS, "n_sites": 5, "alpha": 0.5, "seed": 0} | kwargs
    with pytest.raises(ValueError, match=match):
        dirichlet_split(**args)
    with pytest.raises(ValueError, match="labels"):
        dirichlet_split([0, -1, 1], 2, 1.0, 0, min_per_site=0)


def test_real_site_split_cuts_the_named_sources_as_sslfl():
    """SSL-FL's 12_clients/split_real: rsna -> rsna-0..rsna-4, other sources whole, in name order."""
    src = ["rsna"] * 11 + ["a"] * 3 + ["gz"] * 4
    parts = real_site_split(src, None, seed=0)
    assert parts == [("a", [11, 12, 13]), ("gz", [14, 15, 16, 17]), ("rsna", list(range(11)))]
    cut = real_site_split(src, {"rsna": 5}, seed=0)
    assert [n for n, _ in cut] == ["a", "gz", "rsna-0", "rsna-1", "rsna-2", "rsna-3", "rsna-4"]
    assert [len(p) for _, p in cut] == [3, 4, 3, 2, 2, 2, 2]  # 11 = 3 + 2 + 2 + 2 + 2
    assert sorted(i for _, p in cut[2:] for i in p) == list(range(11))
    assert real_site_split(src, {"rsna": 5}, seed=0) == cut and real_site_split(src, {"rsna": 5}, seed=1) != cut
    with pytest.raises(ValueError, match="'bimcv', which is not a source"):
        real_site_split(src, {"bimcv": 2})
    with pytest.raises(ValueError, match="cannot cut source 'a'"):
        real_site_split(src, {"a": 4})


def test_iid_split_near_equal_random_shards():
    """FedMAE-KS (section V-B): random partitions of near-equal size; sizes by hand: 23 = 5 + 5 + 5 + 4 + 4."""
    parts = iid_split(23, 5, seed=0)
    assert [len(p) for p in parts] == [5, 5, 5, 4, 4]
    assert sorted(i for p in parts for i in p) == list(range(23))
    order = np.random.default_rng(0).permutation(23)
    assert parts[0] == sorted(order[:5].tolist()) and parts[4] == sorted(order[19:].tolist())
    assert iid_split(23, 5, seed=0) == parts and iid_split(23, 5, seed=1) != parts
    # no label skew: on the skewed DERM labels each of 10 shards stays close to the global mix (Dirichlet 0.5 does not)
    dirichlet_tv = _mean_tv(DERM, dirichlet_split(DERM, 10, 0.5, seed=0))
    assert _mean_tv(DERM, iid_split(len(DERM), 10, seed=0)) < 0.1 < dirichlet_tv
    with pytest.raises(ValueError, match="n_items=3 cannot fill n_sites=5"):
        iid_split(3, 5, seed=0)
    with pytest.raises(ValueError, match="n_sites=0"):
        iid_split(3, 0, seed=0)
