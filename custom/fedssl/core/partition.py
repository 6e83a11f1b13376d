"""Seeded, pure partitioners for patients (FCL: 10 sites x 10 patients; 5-fold 8/2 split; N labelled)."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def split_patients(patient_ids: Sequence[str], n_sites: int, per_site: int, seed: int = 0) -> list[list[str]]:
    """Randomly split patients into ``n_sites`` disjoint groups of ``per_site`` (FCL (Wu et al., MedIA 2022) section 5:
    "we randomly split 100 patients in ACDC into 10 partitions, each with 10 patients").

    The input order does not matter (ids are sorted first), so the split depends only on the set of
    ids and the seed.
    """
    if n_sites <= 0 or per_site <= 0:
        raise ValueError(f"n_sites={n_sites}, per_site={per_site}: both must be positive integers")
    ids = sorted(set(patient_ids))
    if len(ids) != len(patient_ids):
        raise ValueError("patient_ids contains duplicates; each patient must appear once")
    need = n_sites * per_site
    if len(ids) < need:
        raise ValueError(
            f"{len(ids)} patients cannot fill n_sites={n_sites} x per_site={per_site} = {need}; "
            "lower n_sites/per_site or add patients"
        )
    order = np.random.default_rng(seed).permutation(len(ids))
    return [sorted(ids[i] for i in order[s * per_site : (s + 1) * per_site]) for s in range(n_sites)]


def kfold_split(
    patient_ids: Sequence[str], fold: int, n_folds: int = 5, seed: int = 0
) -> tuple[list[str], list[str]]:
    """Patient-level k-fold split of one site: fold ``fold`` is the validation set (FCL (Wu et al., MedIA 2022) section
    5: 10 patients -> 8 train / 2 validation per fold, 5 folds)."""
    if not 0 <= fold < n_folds:
        raise ValueError(f"fold={fold}: must be in [0, {n_folds - 1}] for n_folds={n_folds}")
    ids = sorted(set(patient_ids))
    if len(ids) < n_folds:
        raise ValueError(f"{len(ids)} patients cannot make {n_folds} folds; use fewer folds")
    order = [ids[i] for i in np.random.default_rng(seed).permutation(len(ids))]
    val = sorted(np.array_split(np.array(order, dtype=object), n_folds)[fold].tolist())
    train = sorted(p for p in ids if p not in set(val))
    return train, val


def select_labelled(train_ids: Sequence[str], n: int, seed: int = 0) -> list[str]:
    """The ``n`` annotated patients drawn from a site's training patients (N in {1, 2, 4, 8})."""
    ids = sorted(set(train_ids))
    if not 1 <= n <= len(ids):
        raise ValueError(f"n_labelled={n}: must be between 1 and the {len(ids)} training patients")
    order = np.random.default_rng(seed).permutation(len(ids))
    return sorted(ids[i] for i in order[:n])


def holdout_patients(patients: list[str], val_fraction: float, n_labelled: int,
                     seed: int) -> tuple[list[str], list[str]]:
    """(training patients, validation patients): ``val_fraction`` of them (>= 1 with two or more patients) for
    validation, drawn by ``seed``; then at most ``n_labelled`` (0 = all) of the rest for training."""
    order = sorted(patients)
    np.random.default_rng(seed).shuffle(order)
    n_val = max(1, round(val_fraction * len(order))) if len(order) >= 2 and val_fraction > 0 else 0
    val, train = sorted(order[:n_val]), order[n_val:]
    return sorted(train[:n_labelled] if n_labelled else train), val
