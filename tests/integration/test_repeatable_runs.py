"""Same command, same numbers, for every job family (issue 42): each job runs twice at tiny size in the FLARE
simulator into the same workspace, and the final global models are compared bit for bit.

What makes this hold: every trainer draws only from generators it owns, seeded from (seed, site)
(``fedssl.core.rng.owned_global_rng``; unit tests in tests/unit/train/test_owned_rng.py); each party's privacy
secrets (FCL's shuttle order, the sites' feature noise) live in its own folder and a rerun into the same workspace
reuses them (``fedssl.flare.party_folder``); the simulator's thread count is fixed.  Every simulator process starts
with its global torch / numpy / random generators seeded from OS entropy (:func:`scramble_global_rngs`), so a draw
from them anywhere in a round shows up as a difference.  A third run with another
training seed must give another model (FCL here, where the secrets also enter; every trainer type in
test_owned_rng.py), so the equality is not that of a run that ignores its seed.  Marked slow.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from fedssl.ops.jobs import REPO_ROOT
from tests.integration.repeat import check_repeatable, repeat_twice, scramble_global_rngs

pytestmark = pytest.mark.slow
JOBS = os.path.join(REPO_ROOT, "jobs")
ONE_ROUND = "server.scatter_and_gather.num_rounds=1"


@pytest.fixture(autouse=True)
def scrambled(monkeypatch, tmp_path):
    scramble_global_rngs(monkeypatch, tmp_path / "scrambler")


def acdc(root, n_sites=3, shape=(64, 64)):
    from fedssl.data.acdc_synthetic import write_synthetic_acdc

    write_synthetic_acdc(root, n_patients=4 * n_sites, n_sites=n_sites, seed=0, shape=shape, n_frames=4)
    return os.path.join(str(root), "{site}")


def images(root, dataset):
    from fedssl.data.image_sites import write_site_folders
    from fedssl.data.image_synthetic import write_synthetic_images

    write_synthetic_images(root / "src", dataset, n_images=60, seed=0, image_size=40)
    write_site_folders(root / "src", dataset, root / "sites", n_sites=3, alpha=0.5, seed=0)
    return str(root / "sites" / "{site}")


def fedclf_devices(root):
    from fedssl.data.fedclf_devices import build_devices
    from fedssl.data.fedclf_synthetic import write_synthetic_derm_sources

    write_synthetic_derm_sources(str(root / "raw"), n_isic=160, seed=0, image_size=40)
    build_devices(str(root / "devices"), *(str(root / "raw" / s) for s in ("isic2019", "atlasderm", "dermnet",
                                                                           "darkderm")),
                  seed=0, short_edge=36)
    return str(root / "devices" / "{site}")


def mimic(root):
    from fedssl.data.vlp import load_mimic_vlp, write_client_manifests
    from fedssl.data.vlp_synthetic import write_synthetic_mimic

    write_synthetic_mimic(str(root / "raw"), n_patients=60, image_px=32, seed=0)
    records, _ = load_mimic_vlp(str(root / "raw"), site="synthetic")
    write_client_manifests(records, str(root / "sites"), n_clients=3, alpha=1.0, seed=0)
    return str(root / "sites" / "{site}")


def cxr(root):
    from fedssl.data.cxr_synthetic import write_synthetic_surgical

    write_synthetic_surgical(root, n_patients=40, seed=0, image_size=64)
    return str(root / "{site}")


#: family -> (job, sites, data writer, extra settings); one round at the quick profile unless the method needs more
FAMILIES = {
    "FCLOpt-PTNU-DP": ("fclopt_acdc", 3, acdc, ["server.scatter_and_gather.mode=ptnu_dp",
                                                "server.scatter_and_gather.num_rounds=2",
                                                "server.scatter_and_gather.calibration_every=2"]),
    "Fed-MAE": ("sslfl_mae_retina", 3, lambda r: images(r, "retina"), [ONE_ROUND]),
    "Fed-BEiT": ("sslfl_beit_retina", 3, lambda r: images(r, "retina"), [ONE_ROUND]),
    "FedMAE-KS": ("fedmae_derm", 3, lambda r: images(r, "derm"), [ONE_ROUND]),
    "FedCLF": ("fedclf_derm", 3, fedclf_devices, ["server.scatter_and_gather.num_rounds=2"]),
    "FedDRA": ("feddra_mimic", 3, mimic, ["server.scatter_and_gather.num_rounds=1"]),
    "surgical": ("surgical_cxr", 2, cxr, [ONE_ROUND]),
    "3D": ("acdc_seg3d", 2, lambda r: acdc(r, n_sites=2), [ONE_ROUND, "client.seg3d_trainer.local_epochs=1"]),
}


def perturbing_fcl_job(folder) -> str:
    """jobs/fcl_acdc with every site's task results through FeatureBankPerturbation (sigma 0.05, the bundle's
    privacy.json scope): the simulator's clients apply no privacy scope, so the filter is put in the job here."""
    job = os.path.join(str(folder), "fcl_acdc")
    shutil.copytree(os.path.join(JOBS, "fcl_acdc"), job)
    path = os.path.join(job, "app", "config", "config_fed_client.json")
    with open(path) as f:
        config = json.load(f)
    with open(os.path.join(REPO_ROOT, "app_config", "privacy.json")) as f:
        scope = json.load(f)["scopes"][0]
    config["task_result_filters"] = [{"tasks": ["train"], "filters": scope["task_result_filters"]}]
    with open(path, "w") as f:
        json.dump(config, f)
    return job


def test_fcl_repeats_with_shuttle_and_perturbation_and_another_seed_differs(tmp_path):
    """The feature exchange on and every site perturbing its shared features: the server's shuttle order and each
    site's noise come from their own secrets.  Two rounds, so that round 2 ships the shuttled banks."""
    data = acdc(tmp_path / "acdc")
    check_repeatable(perturbing_fcl_job(tmp_path / "job"), str(tmp_path / "ws"), n_sites=3, data_root=data,
                     sets=["server.scatter_and_gather.num_rounds=2", "client.fcl_trainer.max_steps_per_round=2"],
                     other_seed=["client.fcl_trainer.seed=1"])
    secrets = sorted(p.relative_to(tmp_path / "ws_secrets").as_posix()
                     for p in (tmp_path / "ws_secrets").rglob("*.secret"))
    assert secrets == sorted([*(f"site-{i}/feature_bank_perturbation.secret" for i in (1, 2, 3)),
                              "simulator_server/feature_bank_shuttle.secret"]), secrets


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_job_family_repeats_bit_for_bit(family, tmp_path):
    job, n_sites, write, sets = FAMILIES[family]
    data = write(tmp_path / "data")
    repeat_twice(os.path.join(JOBS, job), str(tmp_path / "ws"), n_sites=n_sites, data_root=data, sets=sets)
