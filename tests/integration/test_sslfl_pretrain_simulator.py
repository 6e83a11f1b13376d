"""End to end in the FLARE simulator (quick profile, 3 sites): Fed-MAE and Fed-BEiT pre-training on
synthetic Retina (SSL-FL), and FedMAE with the class-token knowledge split on synthetic ISIC 2019.

The paper runs 5 sites (SSL-FL) and 10 (FedMAE); 3 sites and 2-3 rounds keep CI short.  Marked slow.
"""

import json
import math
import os
import re

import numpy as np
import pytest
import torch

from fedssl.core.tokenizer import load_tokenizer
from fedssl.data.image_sites import write_site_folders
from fedssl.data.image_synthetic import write_synthetic_images
from fedssl.ops.jobs import REPO_ROOT
from fedssl.models.vit import TINY_DECODER, TINY_VIT, MAEViT, read_state_dict
from fedssl.ops.simulate import run_simulation

pytestmark = pytest.mark.slow
JOBS = os.path.join(REPO_ROOT, "jobs")
SITES = 3
CLS = "encoder.cls_token"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    parts = {}
    for dataset in ("retina", "derm"):
        write_synthetic_images(root / f"src_{dataset}", dataset, n_images=90, seed=0, image_size=40)
        parts[dataset] = write_site_folders(root / f"src_{dataset}", dataset, root / dataset, n_sites=SITES,
                                            alpha=0.5, seed=0)
    return str(root), parts


def simulate(job, data, tmp_path, rounds):
    root, _ = data
    dataset = "derm" if "derm" in job else "retina"
    return run_simulation(os.path.join(JOBS, job), str(tmp_path / job), n_sites=SITES,
                          data_root=os.path.join(root, dataset, "{site}"), profile="quick", echo=False,
                          sets=[f"server.scatter_and_gather.num_rounds={rounds}"])


def site_run_dir(summary, site):
    return os.path.join(summary["workspace"], site, "simulate_job")


def check_rounds_and_bytes(summary, rounds, data, dataset):
    assert [r["round"] for r in summary["rounds"]] == list(range(rounds))
    for r in summary["rounds"]:
        assert r["aggregated_sites"] == SITES and math.isfinite(r["mean_loss"])
        assert math.isfinite(r["loss_std_over_sites"]) and "site_losses" not in r  # no per-site value is kept
    comm = summary["communication_per_round"]
    assert [c["round"] for c in comm] == list(range(rounds))
    for c in comm:
        assert c["n_sites_upload"] == SITES and c["n_sites_download"] == SITES
        assert c["upload"]["weights"] > 0 and c["download"]["weights"] > 0
    # pre-training weights = |D_k|, every image of the site (SSL-FL), not the number of steps
    counts = [data[1][dataset]["sites"][f"site-{i}"]["n_images"] for i in range(1, SITES + 1)]
    log = open(summary["log"]).read()
    weights = re.findall(r"aggregated 3/3 sites, weights \(num_samples\): ([\d, ]+)", log)
    assert len(weights) == rounds and all([int(w) for w in ws.split(", ")] == counts for ws in weights)


def test_fed_mae_retina(data, tmp_path):
    s = simulate("sslfl_mae_retina", data, tmp_path, rounds=2)
    check_rounds_and_bytes(s, 2, data, "retina")
    assert "tokenizer" not in s
    state = read_state_dict(s["global_model"])
    assert any(k.startswith("decoder.") for k in state) and torch.isfinite(state[CLS]).all()


def test_fed_beit_retina_with_federated_kmeans_tokenizer(data, tmp_path):
    s = simulate("sslfl_beit_retina", data, tmp_path, rounds=2)
    check_rounds_and_bytes(s, 2, data, "retina")
    assert s["tokenizer"] == "federated k-means K=64, iters=3"
    details = s["tokenizer_details"]
    assert details["sites"] == [f"site-{i}" for i in range(1, SITES + 1)] and len(details["iterations"]) == 3
    server_codebook = load_tokenizer(details["codebook"]).codebook
    assert server_codebook.shape == (64, 4 * 4 * 3)
    for i in range(1, SITES + 1):
        site_codebook = load_tokenizer(os.path.join(site_run_dir(s, f"site-{i}"), "tokenizer_codebook.pt")).codebook
        torch.testing.assert_close(site_codebook, server_codebook)  # every site tokenises with the same codebook
        assert s["site_records"][f"site-{i}"] == {"tokenizer": s["tokenizer"]}
    # the codebook went down once per site, outside the rounds; a round's download is the model alone
    setup = s["communication_outside_rounds"]
    assert setup["set_tokenizer"]["download"]["exchanges"] == SITES
    assert setup["kmeans_step"]["download"]["exchanges"] == 3 * SITES
    codebook_bytes = server_codebook.numel() * 4
    for c in s["communication_per_round"]:
        assert c["download"]["total"] - c["download"]["weights"] < codebook_bytes / 4


def test_fedmae_derm_keeps_the_class_token_local_until_the_final_average(data, tmp_path):
    rounds = 3
    s = simulate("fedmae_derm", data, tmp_path, rounds=rounds)
    check_rounds_and_bytes(s, rounds, data, "derm")
    # upload: as received by the server, the class token is absent in every round but the last
    for r in s["rounds"][:-1]:
        assert r["keys_not_uploaded"] == [CLS]
    assert "keys_not_uploaded" not in s["rounds"][-1]
    comm = s["communication_per_round"]
    cls_bytes = 48 * 4
    assert comm[-1]["upload"]["weights"] - comm[0]["upload"]["weights"] >= cls_bytes
    assert comm[0]["upload"]["weights"] == comm[1]["upload"]["weights"]
    # download: no broadcast carried it (each site loaded every round with the token kept local)
    n_samples, local = {}, {}
    for site in [f"site-{i}" for i in range(1, SITES + 1)]:
        run = site_run_dir(s, site)
        records = [json.loads(line) for line in open(os.path.join(run, "mim_metrics.jsonl"))]
        assert [m["round"] for m in records] == list(range(rounds)) and all(m["kept_local"] == [CLS] for m in records)
        n_samples[site] = records[-1]["num_samples"]
        ckpt = torch.load(os.path.join(run, "mim_client_state.pt"), weights_only=True)
        assert ckpt["round"] == rounds - 1
        local[site] = ckpt["trainer"]["local"][CLS]  # the tensors kept local are part of the trainer state
        torch.testing.assert_close(ckpt["trainer"]["model"][CLS], local[site])
    # the sites' tokens diverged (never synchronised) ...
    sites = sorted(local)
    for a in range(len(sites)):
        for b in range(a + 1, len(sites)):
            assert not torch.allclose(local[sites[a]], local[sites[b]])
    # ... and the global token is their average (weighted by |D_k|, as every other key), once, at the end
    total = sum(n_samples.values())
    expected = sum(local[site] * (n_samples[site] / total) for site in sites)
    final = read_state_dict(s["global_model"])[CLS]
    torch.testing.assert_close(final.float(), expected.float(), rtol=1e-5, atol=1e-6)
    initial = MAEViT(**TINY_VIT, **TINY_DECODER, seed=0).state_dict()[CLS]
    assert not torch.allclose(final.float(), initial)
    assert np.isfinite(final.numpy()).all()
