"""Fine-tuning protocols (fedssl.train.protocol): row counts, pooled validation, disjoint splits."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from fedssl.core.seeds import site_seed
from fedssl.data.volume import Volume
from fedssl.train.protocol import (
    centralised_finetune,
    evaluate_per_site,
    group_by_patient,
    local_finetune,
    site_split,
)
from fedssl.train.segmentation import init_unet
from fedssl.models.unet import TINY_FEATURES, UNetEncoder

torch.set_num_threads(1)

N_SITES, PER_SITE = 3, 5  # n_folds=5 -> 4 train / 1 validation patient per site


def _site_volumes() -> dict[str, list[Volume]]:
    rng = np.random.default_rng(0)
    out = {}
    for s in range(N_SITES):
        site = f"site-{s + 1}"
        vols = []
        for p in range(PER_SITE):
            for phase in ("ED", "ES"):
                label = rng.integers(0, 4, size=(2, 32, 32)).astype(np.uint8)
                vols.append(Volume(f"s{s}p{p}", phase, (label / 3.0).astype(np.float32), label, site))
        out[site] = vols
    return out


def _inits() -> dict[str, object]:
    torch.manual_seed(0)
    return {"random": "random", "fcl": UNetEncoder(TINY_FEATURES).state_dict()}


KW = dict(n_labelled=[1], folds=[0], features=TINY_FEATURES, epochs=1, batch_size=4, max_steps_per_epoch=1)


def test_the_step_floor_lifts_the_small_label_budgets_and_the_row_says_so():
    """Each labelled patient has 2 volumes x 2 slices = 4 slices, 1 step an epoch at batch 4: a floor of 3 steps
    runs N=1 for 3 epochs and leaves N=4 (4 steps an epoch) at its 1 epoch."""
    kw = dict(KW, n_labelled=[1, 4], max_steps_per_epoch=None, min_steps=3)
    rows = local_finetune(_site_volumes(), {"random": "random"}, sites=["site-1"], **kw)
    assert {r["n_labelled"]: r["epochs"] for r in rows} == {1: 3, 4: 1}
    (row,) = centralised_finetune(_site_volumes(), {"random": "random"}, **dict(kw, n_labelled=[1]))
    assert row["epochs"] == 3
    (plain,) = local_finetune(_site_volumes(), {"random": "random"}, sites=["site-1"], **dict(kw, n_labelled=[1],
                                                                                              min_steps=0))
    assert plain["epochs"] == 1


def test_group_by_patient():
    groups = group_by_patient(_site_volumes()["site-1"])
    assert len(groups) == PER_SITE and all(sorted(v.phase for v in vs) == ["ED", "ES"] for vs in groups.values())


def test_local_finetune_rows_pooled_validation_disjoint():
    sv = _site_volumes()
    seen = []
    rows = local_finetune(sv, _inits(), progress=seen.append, **KW)
    assert len(rows) == 2 * 1 * 1 * N_SITES and len(seen) == len(rows)
    assert {r["method"] for r in rows} == {"random", "fcl"}
    assert {r["site"] for r in rows} == set(sv)
    val = set(rows[0]["val_patients"])
    assert len(val) == N_SITES  # one validation patient of every site, pooled
    assert {pid[:2] for pid in val} == {f"s{s}" for s in range(N_SITES)}
    for r in rows:
        assert r["mode"] == "local" and r["n_labelled"] == 1 and r["fold"] == 0
        assert set(r["val_patients"]) == val and r["n_val_volumes"] == 2 * N_SITES
        assert len(r["train_patients"]) == 1 and r["n_train_volumes"] == 2  # ED + ES
        assert not set(r["train_patients"]) & val
        site_ids = {v.patient_id for v in sv[r["site"]]}
        assert set(r["train_patients"]) <= site_ids
        assert r["dice"] == pytest.approx((r["RV"] + r["MYO"] + r["LV"]) / 3)
    # The same patients for every method.
    by = {(r["site"], r["method"]): r["train_patients"] for r in rows}
    assert all(by[(s, "random")] == by[(s, "fcl")] for s in sv)


def test_centralised_default_is_n_patients_in_total_from_the_pooled_sites():
    """FCL Table 3 / section 5 ("all data are combined for sampling the annotated data"): N annotated patients
    in total.  Before issue 13 item 4 the default drew N per site: 3 patients at N=1 with 3 sites."""
    sv = _site_volumes()
    local = local_finetune(sv, {"random": "random"}, **KW)
    rows = centralised_finetune(sv, _inits(), **KW)
    assert len(rows) == 2
    for r in rows:
        assert r["mode"] == "centralised" and r["site"] == "all"
        assert r["train_patients"] == ["s1p2"] and r["n_train_volumes"] == 2  # 1 patient (ED + ES), not 3
        assert set(r["val_patients"]) == set(local[0]["val_patients"])
        assert not set(r["train_patients"]) & set(r["val_patients"])
    per_site = centralised_finetune(sv, {"random": "random"}, labelled_from="per_site", **KW)
    assert sorted(per_site[0]["train_patients"]) == sorted(p for r in local for p in r["train_patients"])
    assert per_site[0]["n_train_volumes"] == 2 * N_SITES
    with pytest.raises(ValueError, match=r"labelled_from='site'.*'pooled'"):
        centralised_finetune(sv, {"random": "random"}, labelled_from="site", **KW)


def test_each_site_draws_its_split_from_its_site_seed():
    """Issue 13 item 9: kfold_split seeded by site_seed(split_seed, site), select_labelled by
    fold_seed(split_seed, site, fold).  With one shared seed every site labelled its 4th and validated on its 3rd
    sorted patient; now the positions differ, and the values below are reproducible from (fold 0, N,
    split_seed 0, site name)."""
    split = {s: (d["train_patients"], d["val_patients"]) for s, d in site_split(_site_volumes(), 0, 1).items()}
    assert split == {"site-1": (["s0p1"], ["s0p2"]), "site-2": (["s1p0"], ["s1p1"]), "site-3": (["s2p4"], ["s2p0"])}
    two = site_split(_site_volumes(), 0, 2)
    assert [two[s]["train_patients"] for s in sorted(two)] == [["s0p1", "s0p3"], ["s1p0", "s1p2"], ["s2p3", "s2p4"]]
    other = site_split(_site_volumes(), 0, 1, split_seed=1)
    assert [other[s]["val_patients"] for s in sorted(other)] == [["s0p1"], ["s1p3"], ["s2p0"]]
    rows = local_finetune(_site_volumes(), {"random": "random"}, **KW)
    assert {r["site"]: r["train_patients"] for r in rows} == {s: split[s][0] for s in split}  # = federated split


def _position_draw(ids: list[str], n: int, text: str) -> list[str]:
    """select_labelled written out: the first n of a numpy permutation of the sorted ids, seeded by
    SHA-256(text)[:8] mod 2**31."""
    seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") % 2 ** 31
    ids = sorted(ids)
    return sorted(ids[i] for i in np.random.default_rng(seed).permutation(len(ids))[:n])


def test_every_fold_draws_its_own_labelled_patients():
    """Issue 14: the labelled draw is seeded by (split_seed, site, fold).  Seeded by the site alone it took the same
    positions of the fold's sorted training patients in every fold, so at N = 1 the same patient was the
    annotated one in several folds (real site 2: patient017 in folds 0-2) and those cells repeated one
    fine-tuning.  Local, federated and centralised draws all follow the fold."""
    sv = _site_volumes()
    positions = {}
    for fold in range(5):
        trains = {}
        for site, d in site_split(sv, fold, 1).items():
            trains[site] = train = sorted({v.patient_id for v in sv[site]} - set(d["val_patients"]))
            assert d["train_patients"] == _position_draw(train, 1, f"0/{site}/fold{fold}")
            positions.setdefault(site, []).append(train.index(d["train_patients"][0]))
        rows = centralised_finetune(sv, {"random": "random"}, **{**KW, "folds": [fold], "n_labelled": [1]})
        pool = [p for site in sorted(trains) for p in trains[site]]
        assert rows[0]["train_patients"] == _position_draw(pool, 1, f"0//fold{fold}")
    # position of the annotated patient in the fold's sorted training patients: no longer one position per site
    assert positions == {"site-1": [1, 2, 3, 3, 1], "site-2": [0, 3, 2, 3, 3], "site-3": [3, 0, 0, 2, 0]}
    assert all(len(set(p)) > 1 for p in positions.values())


def test_local_runs_train_on_the_site_seed_and_initialise_on_the_job_seed(monkeypatch):
    """The U-Net starts from ``seed`` everywhere; a site's batches and augmentations use site_seed(seed, site),
    the centralised run the job seed.  (Training replaced by a recorder: the seeds are what is checked.)"""
    import fedssl.train.protocol as protocol

    seen = []
    monkeypatch.setattr(protocol, "init_unet", lambda init, features, seed, norm: seen.append(("init", seed)) or
                        init_unet("random", features=TINY_FEATURES, seed=0, norm=norm))
    monkeypatch.setattr(protocol, "train_segmentation",
                        lambda unet, vols, seed, **kw: seen.append(("data", seed)) or [0.5])
    local_finetune(_site_volumes(), {"random": "random"}, **{**KW, "seed": 4})
    assert seen == [x for s in ("site-1", "site-2", "site-3") for x in (("init", 4), ("data", site_seed(4, s)))]
    seen.clear()
    centralised_finetune(_site_volumes(), {"random": "random"}, **{**KW, "seed": 4})
    assert seen == [("init", 4), ("data", 4)]


def test_evaluate_per_site_uses_each_sites_validation():
    sv = _site_volumes()
    unet = init_unet("random", features=TINY_FEATURES, seed=0)
    rows = evaluate_per_site(unet, sv, 0, method="fcl", n_labelled=2)
    pooled = local_finetune(sv, {"random": "random"}, **KW)[0]["val_patients"]
    assert [r["site"] for r in rows] == sorted(sv)
    assert sorted(p for r in rows for p in r["val_patients"]) == sorted(pooled)
    split = site_split(sv, 0, 2)
    for r in rows:
        assert r["mode"] == "federated" and r["n_labelled"] == 2 and r["n_val_volumes"] == 2
        assert r["val_patients"] == split[r["site"]]["val_patients"]
        assert not set(split[r["site"]]["train_patients"]) & set(r["val_patients"])
        assert len(split[r["site"]]["train_volumes"]) == 4


def test_duplicate_patient_across_sites_rejected():
    sv = _site_volumes()
    sv["site-2"] = sv["site-2"] + [sv["site-1"][0]]
    with pytest.raises(ValueError, match="appears in sites"):
        local_finetune(sv, {"random": "random"}, **KW)
