"""The FCL fine-tuning protocols: local, centralised, and per-site evaluation of a federated model.

FCL (Wu et al., MedIA 2022) section 5, "Evaluation": "During fine-tuning, we use 5-fold cross-validation to evaluate the
segmentation performance. In each fold, 10 patients on one client are split into a training set of 8
patients and a validation set of 2 patients. For each fold, we fine-tune with annotations from
N in {1, 2, 4, 8} patients in the training set, and validate on the validation set of the same fold on
all clients (i.e. 20 patients)." The metric is the Dice averaged over LV, MYO and RV.

Splits (:func:`site_fold`): per site ``kfold_split(site_patients, fold)`` (8 train / 2 validation for 10 patients),
seeded by ``site_seed(split_seed, site)`` (:func:`fedssl.core.seeds.site_seed`), and
``select_labelled(train_patients, N)``, seeded by ``fold_seed(split_seed, site, fold)``
(:func:`fedssl.core.seeds.fold_seed`, a fresh draw in every fold): which patients are labelled at a site depends
only on (fold, N, ``split_seed``, site name), not on the method (init), so every method is fine-tuned and validated
on exactly the same patients, and sites draw their subsets independently (one shared seed picked the same positions
in every site's sorted patient list). Federated fine-tuning (:func:`site_split`) uses the same function, hence the
same patients as local fine-tuning. Every patient contributes all its annotated volumes (ACDC: ED and ES). Rows
carry the patient ids used, so the splits are auditable.

Training randomness: the U-Net's initial weights come from ``seed`` (the same for every site and protocol);
the batch order and augmentations of a site's run from ``site_seed(seed, site)`` (centralised: ``seed``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn

from fedssl.core.partition import kfold_split, select_labelled
from fedssl.core.seeds import fold_seed, site_seed
from fedssl.data.volume import Volume
from fedssl.eval.segmentation import ACDC_CLASSES, dice_per_volume, mean_dice
from fedssl.models.unet import NORMS
from fedssl.train.segmentation import init_unet, train_segmentation

Progress = Callable[[dict], None]


def group_by_patient(volumes: Sequence[Volume]) -> dict[str, list[Volume]]:
    """Volumes of one site grouped by ``patient_id`` (each ACDC patient has an ED and an ES volume)."""
    groups: dict[str, list[Volume]] = {}
    for v in volumes:
        groups.setdefault(v.patient_id, []).append(v)
    return groups


def _site_patients(site_volumes: Mapping[str, Sequence[Volume]]) -> dict[str, dict[str, list[Volume]]]:
    """site -> patient -> volumes; a patient id may belong to one site only."""
    if not site_volumes:
        raise ValueError("site_volumes is empty: give {site name: [Volume, ...]}")
    out: dict[str, dict[str, list[Volume]]] = {}
    owner: dict[str, str] = {}
    for site in sorted(site_volumes):
        groups = group_by_patient(site_volumes[site])
        if not groups:
            raise ValueError(f"site {site!r} has no volumes")
        for pid in groups:
            if pid in owner:
                raise ValueError(f"patient {pid!r} appears in sites {owner[pid]!r} and {site!r}; sites must be "
                                 "disjoint")
            owner[pid] = site
        out[site] = groups
    return out


#: where the centralised protocol draws its N annotated patients from (:func:`centralised_finetune`)
LABELLED_FROM = ("pooled", "per_site")


def site_fold(patient_ids: Sequence[str], site: str, fold: int, *, n_folds: int = 5,
              split_seed: int = 0) -> tuple[list[str], list[str]]:
    """One site's (training, validation) patients of ``fold``: ``kfold_split`` seeded by
    ``site_seed(split_seed, site)``, so the split is reproducible from (fold, split_seed, site name)."""
    return kfold_split(sorted(patient_ids), fold, n_folds=n_folds, seed=site_seed(split_seed, site))


def site_labelled(train_ids: Sequence[str], site: str, n: int, *, fold: int, split_seed: int = 0) -> list[str]:
    """The ``n`` annotated patients of ``site`` among its training patients of ``fold``: ``select_labelled``
    seeded by ``fold_seed(split_seed, site, fold)`` (the same for every method and protocol, a fresh draw in
    every fold)."""
    return select_labelled(train_ids, n, seed=fold_seed(split_seed, site, fold))


def _fold_split(
    patients: Mapping[str, Mapping[str, list[Volume]]], fold: int, n_folds: int, split_seed: int
) -> dict[str, tuple[list[str], list[str]]]:
    """site -> (train patient ids, validation patient ids) for one fold."""
    return {site: site_fold(list(p), site, fold, n_folds=n_folds, split_seed=split_seed)
            for site, p in patients.items()}


def _volumes_of(patients: Mapping[str, list[Volume]], ids: Sequence[str]) -> list[Volume]:
    return [v for pid in ids for v in patients[pid]]


def _pooled_validation(
    patients: Mapping[str, Mapping[str, list[Volume]]], split: Mapping[str, tuple[list[str], list[str]]]
) -> tuple[list[str], list[Volume]]:
    """Validation patients of the fold on ALL sites (paper: 2 per site -> 20 patients) and their volumes."""
    ids = [pid for site in sorted(split) for pid in split[site][1]]
    vols = [v for site in sorted(split) for v in _volumes_of(patients[site], split[site][1])]
    return ids, vols


def local_split(site_volumes: Mapping[str, Sequence[Volume]], site: str, n_labelled: int, fold: int, *,
                n_folds: int = 5, split_seed: int = 0) -> tuple[list[str], list[Volume], list[str], list[Volume]]:
    """The local protocol's data for one site: (its ``n_labelled`` annotated patients of ``fold``, their volumes,
    the fold's validation patients of ALL sites, their volumes) -- what :func:`local_finetune` trains and
    validates that site on, for reuse by other evaluations of the same split (the frozen-encoder probe)."""
    patients = _site_patients(site_volumes)
    if site not in patients:
        raise ValueError(f"site={site!r} is not among the sites {sorted(patients)}")
    split = _fold_split(patients, fold, n_folds, split_seed)
    val_ids, val_vols = _pooled_validation(patients, split)
    train_ids = site_labelled(split[site][0], site, n_labelled, fold=fold, split_seed=split_seed)
    return train_ids, _volumes_of(patients[site], train_ids), val_ids, val_vols


def _dice_fields(model: nn.Module, volumes: Sequence[Volume], device: str | torch.device) -> dict:
    summary = mean_dice(dice_per_volume(model, volumes, device=device))
    out = {"dice": summary["mean"]}
    out.update({name: summary[name] for name in ACDC_CLASSES.values()})
    return out


def _finetune_and_evaluate(
    init: object,
    train_volumes: Sequence[Volume],
    val_volumes: Sequence[Volume],
    *,
    features: Sequence[int],
    epochs: int,
    batch_size: int,
    lr: float,
    seed: int,
    data_seed: int,
    device: str | torch.device,
    max_steps_per_epoch: int | None,
    min_steps: int = 0,
    norm: str = NORMS[0],
) -> dict:
    """Initialise from ``seed`` (model), train with batches and augmentations from ``data_seed``, evaluate;
    ``epochs`` in the row is the number run (more than asked where ``min_steps`` lifted it)."""
    unet = init_unet(init, features=features, seed=seed, norm=norm)  # type: ignore[arg-type]
    losses = train_segmentation(
        unet,
        train_volumes,
        epochs=epochs,
        batch_size=batch_size,
        lr=lr,
        seed=data_seed,
        device=device,
        max_steps_per_epoch=max_steps_per_epoch,
        min_steps=min_steps,
    )
    out = _dice_fields(unet, val_volumes, device)
    out["final_loss"] = losses[-1]
    out["epochs"] = len(losses)
    return out


def _run(key: dict, init: object, train_ids: Sequence[str], patients: Mapping[str, list[Volume]],
         val_ids: Sequence[str], val_vols: Sequence[Volume], train_kw: dict, progress: Progress | None) -> dict:
    """Fine-tune one model on ``train_ids`` and evaluate it on ``val_vols``; one result row.  The data seed is
    the site's (``key["site"]``; "all", the centralised run, uses the job seed)."""
    train_vols = _volumes_of(patients, train_ids)
    row: dict[str, Any] = dict(key)
    site = "" if key["site"] == "all" else key["site"]
    row.update(_finetune_and_evaluate(init, train_vols, val_vols, data_seed=site_seed(train_kw["seed"], site),
                                      **train_kw))
    row.update(train_patients=list(train_ids), n_train_volumes=len(train_vols),
               val_patients=list(val_ids), n_val_volumes=len(val_vols))
    if progress is not None:
        progress(row)
    return row


def _check_common(n_labelled: Sequence[int], folds: Sequence[int], inits: Mapping[str, object]) -> None:
    if not inits:
        raise ValueError("inits is empty: give {method name: 'random' | encoder state dict}")
    if not n_labelled or not folds:
        raise ValueError(f"n_labelled={list(n_labelled)} and folds={list(folds)} must both be non-empty")


def local_finetune(
    site_volumes: Mapping[str, Sequence[Volume]],
    inits: Mapping[str, object],
    *,
    n_labelled: Sequence[int],
    folds: Sequence[int],
    features: Sequence[int],
    epochs: int,
    batch_size: int = 10,
    lr: float = 5e-4,
    seed: int = 0,
    device: str | torch.device = "cpu",
    max_steps_per_epoch: int | None = None,
    progress: Progress | None = None,
    n_folds: int = 5,
    split_seed: int = 0,
    min_steps: int = 0,
    sites: Sequence[str] | None = None,
    norm: str = NORMS[0],
) -> list[dict]:
    """Local fine-tuning (FCL (Wu et al., MedIA 2022) Table 1): each site fine-tunes alone on its N annotated patients.

    For every method (``inits``: name -> ``"random"`` or an encoder / U-Net state dict), N, fold and
    site: a U-Net initialised by :func:`init_unet` is trained on both volumes (ED, ES) of the site's N
    labelled patients (drawn from the site's training patients of the fold) and validated on the
    fold's validation patients of ALL sites, pooled. One row per run::

        {"method", "mode": "local", "n_labelled", "fold", "site", "dice", "RV", "MYO", "LV",
         "train_patients", "n_train_volumes", "val_patients", "n_val_volumes", "final_loss", "epochs"}

    ``epochs`` epochs each, or more up to ``min_steps`` optimiser steps (0 = the paper's protocol; the row's
    ``epochs`` is the number run).  ``norm``: the U-Net's normalisation (:func:`init_unet`), the pre-training's.
    ``progress(row)`` is called after every run.  ``sites``: only these sites fine-tune (default all); the
    validation still pools every site's validation patients, so one site's run is the same as in a full run.
    """
    _check_common(n_labelled, folds, inits)
    patients = _site_patients(site_volumes)
    unknown = sorted(set(sites or ()) - set(patients))
    if unknown:
        raise ValueError(f"sites={list(sites)}: {unknown} not among the sites {sorted(patients)}")
    train_kw = dict(features=features, epochs=epochs, batch_size=batch_size, lr=lr, seed=seed, device=device,
                    max_steps_per_epoch=max_steps_per_epoch, min_steps=min_steps, norm=norm)
    rows: list[dict] = []
    for fold in folds:
        split = _fold_split(patients, fold, n_folds, split_seed)
        val_ids, val_vols = _pooled_validation(patients, split)
        for method, init in inits.items():
            for n in n_labelled:
                for site in sorted(sites or patients):
                    train_ids = site_labelled(split[site][0], site, n, fold=fold, split_seed=split_seed)
                    key = {"method": method, "mode": "local", "n_labelled": int(n), "fold": int(fold), "site": site}
                    rows.append(_run(key, init, train_ids, patients[site], val_ids, val_vols, train_kw, progress))
    return rows


def centralised_finetune(
    site_volumes: Mapping[str, Sequence[Volume]],
    inits: Mapping[str, object],
    *,
    n_labelled: Sequence[int],
    folds: Sequence[int],
    features: Sequence[int],
    epochs: int,
    batch_size: int = 10,
    lr: float = 5e-4,
    seed: int = 0,
    device: str | torch.device = "cpu",
    max_steps_per_epoch: int | None = None,
    progress: Progress | None = None,
    n_folds: int = 5,
    split_seed: int = 0,
    min_steps: int = 0,
    labelled_from: Literal["pooled", "per_site"] = "pooled",
    norm: str = NORMS[0],
) -> list[dict]:
    """Centralised fine-tuning (FCL (Wu et al., MedIA 2022) Table 3): all data combined, one model per method, N and
    fold.

    ``labelled_from="pooled"`` (default): N patients IN TOTAL are drawn (``select_labelled`` seeded by
    ``fold_seed(split_seed, "", fold)``) from the union of all sites' training patients of the fold. Section 5: "In
    centralized fine-tuning, all data are combined for sampling the annotated data"; Table 3: "N is the number of
    annotated patients for fine-tuning"; and its numbers imply it: Random init reaches 0.296 at N=1 centralised
    (Table 3) against 0.445 in federated fine-tuning with 1 patient at each of 10 sites (Table 2), so the
    centralised model saw far fewer than 10 patients. ``labelled_from="per_site"``: the N labelled patients of
    EVERY site (those the local protocol uses), N x n_sites patients in one model. Validation is the fold's
    validation patients of all sites, pooled. Rows as in :func:`local_finetune` with ``mode="centralised"`` and
    ``site="all"``.
    """
    if labelled_from not in LABELLED_FROM:
        raise ValueError(f"labelled_from={labelled_from!r}: use one of {list(LABELLED_FROM)} (paper, Table 3: "
                         "'pooled')")
    _check_common(n_labelled, folds, inits)
    patients = _site_patients(site_volumes)
    all_patients = {pid: vols for site in patients.values() for pid, vols in site.items()}
    train_kw = dict(features=features, epochs=epochs, batch_size=batch_size, lr=lr, seed=seed, device=device,
                    max_steps_per_epoch=max_steps_per_epoch, min_steps=min_steps, norm=norm)
    rows: list[dict] = []
    for fold in folds:
        split = _fold_split(patients, fold, n_folds, split_seed)
        val_ids, val_vols = _pooled_validation(patients, split)
        for method, init in inits.items():
            for n in n_labelled:
                if labelled_from == "per_site":
                    train_ids = [pid for site in sorted(split)
                                 for pid in site_labelled(split[site][0], site, n, fold=fold, split_seed=split_seed)]
                else:
                    pool = [pid for site in sorted(split) for pid in split[site][0]]
                    train_ids = select_labelled(pool, n, seed=fold_seed(split_seed, "", fold))
                key = {"method": method, "mode": "centralised", "n_labelled": int(n), "fold": int(fold), "site": "all"}
                rows.append(_run(key, init, train_ids, all_patients, val_ids, val_vols, train_kw, progress))
    return rows


def site_split(
    site_volumes: Mapping[str, Sequence[Volume]],
    fold: int,
    n_labelled: int,
    *,
    n_folds: int = 5,
    split_seed: int = 0,
) -> dict[str, dict[str, list]]:
    """The per-site split federated fine-tuning uses (the same one as :func:`local_finetune`):
    site -> {"train_patients", "train_volumes", "val_patients", "val_volumes"} where the train part is
    the site's N labelled patients of the fold."""
    patients = _site_patients(site_volumes)
    split = _fold_split(patients, fold, n_folds, split_seed)
    out = {}
    for site in sorted(patients):
        train_ids = site_labelled(split[site][0], site, n_labelled, fold=fold, split_seed=split_seed)
        out[site] = {
            "train_patients": train_ids,
            "train_volumes": _volumes_of(patients[site], train_ids),
            "val_patients": split[site][1],
            "val_volumes": _volumes_of(patients[site], split[site][1]),
        }
    return out


def evaluate_per_site(
    unet: nn.Module,
    site_volumes: Mapping[str, Sequence[Volume]],
    fold: int,
    *,
    method: str,
    n_labelled: int,
    mode: str = "federated",
    device: str | torch.device = "cpu",
    n_folds: int = 5,
    split_seed: int = 0,
) -> list[dict]:
    """Evaluate one model (e.g. the global model of federated fine-tuning, FCL (Wu et al., MedIA 2022) Table 2) on every
    site's own validation patients of ``fold``. One row per site::

        {"method", "mode", "n_labelled", "fold", "site", "dice", "RV", "MYO", "LV",
         "val_patients", "n_val_volumes"}
    """
    patients = _site_patients(site_volumes)
    split = _fold_split(patients, fold, n_folds, split_seed)
    rows = []
    for site in sorted(patients):
        val_ids = split[site][1]
        val_vols = _volumes_of(patients[site], val_ids)
        row: dict[str, Any] = {"method": method, "mode": mode, "n_labelled": int(n_labelled), "fold": int(fold),
                               "site": site}
        row.update(_dice_fields(unet, val_vols, device))
        row.update(val_patients=list(val_ids), n_val_volumes=len(val_vols))
        rows.append(row)
    return rows
