"""Tests for fedssl.core.partition (seeded patient split, k-fold, labelled subset)."""

from __future__ import annotations

import pytest

from fedssl.core.partition import holdout_patients, kfold_split, select_labelled, split_patients
from fedssl.data.seg3d import patient_of

IDS = [f"patient{i:03d}" for i in range(1, 101)]


def test_split_patients_sizes_disjoint_sorted() -> None:
    groups = split_patients(IDS, n_sites=10, per_site=10, seed=0)
    assert len(groups) == 10 and all(len(g) == 10 for g in groups)
    flat = [p for g in groups for p in g]
    assert len(set(flat)) == 100 and set(flat) == set(IDS)
    assert all(g == sorted(g) for g in groups)
    # Fewer than all patients: still disjoint, right sizes, subset of the input.
    small = split_patients(IDS, n_sites=3, per_site=7, seed=1)
    flat = [p for g in small for p in g]
    assert [len(g) for g in small] == [7, 7, 7] and len(set(flat)) == 21 and set(flat) <= set(IDS)


def test_split_patients_deterministic_and_seed_dependent() -> None:
    a = split_patients(IDS, 10, 10, seed=0)
    assert a == split_patients(IDS, 10, 10, seed=0)
    assert a != split_patients(IDS, 10, 10, seed=1)
    # Random, not contiguous blocks of sorted ids.
    assert a != [IDS[i * 10 : (i + 1) * 10] for i in range(10)]


def test_split_patients_input_order_irrelevant() -> None:
    shuffled = list(reversed(IDS[::2])) + IDS[1::2]
    assert split_patients(shuffled, 10, 10, seed=4) == split_patients(IDS, 10, 10, seed=4)


def test_split_patients_errors() -> None:
    with pytest.raises(ValueError):
        split_patients(IDS[:5], n_sites=2, per_site=3)
    with pytest.raises(ValueError):
        split_patients(IDS, n_sites=0, per_site=3)
    with pytest.raises(ValueError):
        split_patients(IDS[:4] + IDS[:1], n_sites=1, per_site=2)


def test_kfold_split_sizes_and_folds_partition_patients() -> None:
    site = IDS[:10]
    vals: list[str] = []
    for fold in range(5):
        train, val = kfold_split(site, fold, n_folds=5, seed=0)
        assert len(train) == 8 and len(val) == 2
        assert set(train).isdisjoint(val) and set(train) | set(val) == set(site)
        assert train == sorted(train) and val == sorted(val)
        vals.extend(val)
    assert sorted(vals) == sorted(site) and len(set(vals)) == 10
    # Deterministic, order-free, seed-dependent.
    assert kfold_split(list(reversed(site)), 2, seed=0) == kfold_split(site, 2, seed=0)
    assert [kfold_split(site, f, seed=0)[1] for f in range(5)] != [kfold_split(site, f, seed=1)[1] for f in range(5)]
    with pytest.raises(ValueError):
        kfold_split(site, 5, n_folds=5)
    with pytest.raises(ValueError):
        kfold_split(site[:3], 0, n_folds=5)


def test_select_labelled() -> None:
    train, _ = kfold_split(IDS[:10], 0)
    for n in (1, 2, 4, 8):
        chosen = select_labelled(train, n, seed=0)
        assert len(chosen) == n and set(chosen) <= set(train) and chosen == sorted(chosen)
        assert chosen == select_labelled(list(reversed(train)), n, seed=0)
    assert select_labelled(train, 8) == sorted(train)
    # Nested draws: the first n of one permutation, so smaller N is a subset of larger N.
    assert set(select_labelled(train, 2, seed=3)) <= set(select_labelled(train, 4, seed=3))
    assert any(select_labelled(train, 2, seed=s) != select_labelled(train, 2, seed=0) for s in range(1, 6))
    with pytest.raises(ValueError):
        select_labelled(train, 0)
    with pytest.raises(ValueError):
        select_labelled(train, 9)


def test_holdout_patients_is_seeded_and_order_free():
    patients = [f"patient{i:03d}" for i in range(1, 11)]
    train, val = holdout_patients(patients, 0.2, 0, seed=5)
    assert len(val) == 2 and len(train) == 8 and not set(train) & set(val)
    assert (train, val) == holdout_patients(list(reversed(patients)), 0.2, 0, seed=5)  # order of discovery irrelevant
    assert holdout_patients(patients, 0.2, 0, seed=6) != (train, val)
    few, val2 = holdout_patients(patients, 0.2, 2, seed=5)
    assert val2 == val and len(few) == 2 and set(few) <= set(train)
    assert holdout_patients(["p1", "p2"], 0.2, 0, seed=0)[1] != []  # at least one validation patient
    assert holdout_patients(["p1"], 0.2, 0, seed=0) == (["p1"], [])
    assert patient_of("patient007_ES", "acdc") == "patient007" and patient_of("pat3", "hvsmr") == "pat3"
