"""SSL-FL's COVID-FL and Derm jobs end to end in the FLARE simulator (quick profile, tiny ViT, 2 rounds each).

COVID-FL: a synthetic release with two real sites (RSNA, Guangzhou) gives SSL-FL's composition in small: RSNA cut
into rsna-0..rsna-4, so 6 clients (the paper's 8 sources give 12). Derm (melanoma vs benign): 3 Dirichlet sites.
Each job runs once (fine-tuning from a stand-in tiny MAE checkpoint in the persistor's format). Marked slow.
"""

import json
import os

import pytest
import torch

from fedssl.data.image_sites import write_site_folders
from fedssl.data.image_synthetic import write_synthetic_images
from fedssl.data.images import class_names, load_image_records
from fedssl.models.vit import TINY_DECODER, TINY_VIT, MAEViT
from fedssl.ops.jobs import REPO_ROOT
from fedssl.ops.simulate import run_simulation

pytestmark = pytest.mark.slow
JOBS = os.path.join(REPO_ROOT, "jobs")


@pytest.fixture(scope="module")
def covidfl(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("covidfl")
    write_synthetic_images(root / "release", "covidfl", 150, seed=0, image_size=40, n_sources=2)
    part = write_site_folders(root / "release", "covidfl", root / "parts", seed=0)
    assert list(part["site_map"].values()) == ["gz", "rsna-0", "rsna-1", "rsna-2", "rsna-3", "rsna-4"]
    return str(root / "parts")


@pytest.fixture(scope="module")
def derm(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("derm_mel")
    write_synthetic_images(root / "release", "derm_mel", 160, seed=0, image_size=40)
    write_site_folders(root / "release", "derm_mel", root / "parts", n_sites=3, alpha=0.5, seed=0)
    return str(root / "parts")


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("pre") / "FL_global_model.pt"
    torch.save({"model": MAEViT(**TINY_VIT, **TINY_DECODER, seed=1).state_dict()}, path)  # persistor format
    return str(path)


def simulate(job: str, parts: str, n_sites: int, tmp_path, *sets: str) -> dict:
    return run_simulation(os.path.join(JOBS, job), str(tmp_path / job), n_sites=n_sites,
                          data_root=os.path.join(parts, "{site}"), profile="quick", echo=False,
                          sets=["server.scatter_and_gather.num_rounds=2", *sets])


def check_pretrain(run: dict, n_sites: int) -> None:
    assert [r["round"] for r in run["rounds"]] == [0, 1]
    assert all(r["aggregated_sites"] == n_sites for r in run["rounds"])
    assert os.path.getsize(run["global_model"]) > 0


def check_finetune(run: dict, parts: str, dataset: str, n_sites: int, pretrained: str) -> None:
    assert f"encoder initialised from pretrained weights {pretrained}" in open(run["log"]).read()
    with open(os.path.join(run["workspace"], "server", "simulate_job", "test_metrics.json")) as f:
        report = json.load(f)
    assert sorted(report["sites"]) == sorted(f"site-{i}" for i in range(1, n_sites + 1))
    n_test = len(load_image_records(os.path.join(parts, "test"), dataset))
    for metrics in report["sites"].values():
        assert metrics["n"] == n_test and set(metrics["per_class"]) == set(class_names(dataset))


def test_covidfl_pretrain_on_the_release_clients(covidfl, tmp_path):
    check_pretrain(simulate("sslfl_mae_covidfl", covidfl, 6, tmp_path), 6)


def test_covidfl_finetune(covidfl, pretrained, tmp_path):
    run = simulate("sslfl_covidfl_finetune", covidfl, 6, tmp_path, f"server.model.pretrained_path={pretrained}")
    check_finetune(run, covidfl, "covidfl", 6, pretrained)


def test_derm_pretrain(derm, tmp_path):
    check_pretrain(simulate("sslfl_mae_derm", derm, 3, tmp_path), 3)


def test_derm_melanoma_vs_benign_finetune(derm, pretrained, tmp_path):
    run = simulate("sslfl_derm_finetune", derm, 3, tmp_path, f"server.model.pretrained_path={pretrained}")
    check_finetune(run, derm, "derm_mel", 3, pretrained)
