"""End to end in the FLARE simulator (quick profile, 3 sites): FCL pre-training, then fine-tuning.

Marked slow; CI runs them (the README's test command runs everything).
"""

import glob
import json
import math
import os
import shutil

import pytest
import torch

from fedssl.data.acdc_synthetic import write_synthetic_acdc
from fedssl.experiments.fcl_finetune import (encoder_init, evaluate_federated, export_unet_init, load_labelled_sites,
                                             protocol_settings, run_protocols)
from fedssl.experiments.table7 import exchanged_rows
from fedssl.models.unet import MoCoUNetEncoder, encoder_state_from_global
from fedssl.ops.jobs import REPO_ROOT
from fedssl.ops.simulate import run_simulation, server_run_dir

pytestmark = pytest.mark.slow
JOBS = os.path.join(REPO_ROOT, "jobs")
SITES = 3


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("acdc")
    write_synthetic_acdc(root, n_patients=10 * SITES, n_sites=SITES, seed=0, shape=(96, 96), n_frames=6)
    return str(root)


@pytest.fixture(scope="module")
def pretrained(data, tmp_path_factory):
    ws = tmp_path_factory.mktemp("ws") / "fcl"
    return run_simulation(os.path.join(JOBS, "fcl_acdc"), str(ws), n_sites=SITES,
                          data_root=os.path.join(data, "{site}"),
                          profile="quick", sets=["server.scatter_and_gather.num_rounds=2"], echo=False)


def test_fcl_pretraining_produces_model_summary_and_exchanges_features(pretrained):
    assert os.path.isfile(pretrained["global_model"])
    rounds = pretrained["rounds"]
    assert [r["round"] for r in rounds] == [0, 1]
    assert all(r["aggregated_sites"] == SITES and math.isfinite(r["mean_loss"]) for r in rounds)
    # every cine frame (10 patients x 6 frames = 60 volumes), 4 volumes per batch of 16, capped at 5 steps (quick):
    # 5 x 16 = 80 of the K = 256 bank slots fill per round
    means = [r["site_record_means"] for r in rounds]
    assert [(m["volumes"], m["steps_per_round"], m["bank_filled"]) for m in means] == [(60, 5, 80), (60, 5, 160)]
    assert means[1]["bank_fill"] == 160 / 256 and "model_uploaded" not in rounds[0]
    # each feature is sent once: the 80 rows of a round go up, and as many of the others' come down a round later
    assert [(m["rows_shared"], m["remote_features"]) for m in means] == [(80, 0), (80, 80)]
    assert exchanged_rows(pretrained) == (80.0, 40.0)  # Table 7's expected bytes use these counts
    comm = pretrained["communication_per_round"]
    assert comm[0]["upload"]["features"] > 0 and comm[0]["upload"]["weights"] > 0
    assert "features" not in comm[0]["download"]  # nothing to exchange before the first aggregation
    assert comm[1]["download"]["features"] > 0  # round 2: the other sites' banks
    ws = pretrained["workspace"]
    for png in ("loss.png", "bytes_per_round.png"):
        assert os.path.getsize(os.path.join(ws, "server", "simulate_job", png)) > 0
    for site in range(1, SITES + 1):
        run = os.path.join(ws, f"site-{site}", "simulate_job")
        assert os.path.isfile(os.path.join(run, "fcl_client_state.pt"))
        metrics = [json.loads(line) for line in open(os.path.join(run, "fcl_metrics.jsonl"))]
        # round 2: each site received as many of the others' features as it shared in round 1 (5 steps x 16 = 80
        # of K = 256), whatever the number of other sites
        assert metrics[-1]["remote_features"] == 80


def test_training_curves_reach_the_servers_tensorboard(pretrained):
    """Each site's per-round scalars travel TBWriter -> ConvertToFedEvent -> TBAnalyticsReceiver into
    <server run folder>/tb_events/<site>/; the summary's loss terms are their means over the sites."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = os.path.join(server_run_dir(pretrained["workspace"]), "tb_events")
    assert sorted(os.listdir(tb)) == [f"site-{i}" for i in range(1, SITES + 1)]
    for site in sorted(os.listdir(tb)):
        acc = EventAccumulator(os.path.join(tb, site), size_guidance={"scalars": 0})
        acc.Reload()
        tags = acc.Tags()["scalars"]
        for tag in ("loss", "loss_local", "loss_remote", "lr"):
            assert tag in tags, (site, tag, tags)
            assert sorted(e.step for e in acc.Scalars(tag)) == [0, 1], (site, tag)  # step = round
    for r in pretrained["rounds"]:
        terms = r["loss_terms"]  # means over sites, no site names
        assert set(terms) >= {"loss_local", "loss_remote"} and not any("site" in k for k in terms)
        # FCL's loss = local + remote term per step, so the means over steps and sites add up too
        assert terms["loss_local"] + terms["loss_remote"] == pytest.approx(r["mean_loss"], rel=1e-5)


def test_local_and_federated_finetuning_from_fcl(pretrained, data, tmp_path):
    settings = protocol_settings("quick", epochs=2)  # 2 epochs, no step floor
    sites = load_labelled_sites(data, settings)
    rows = run_protocols(sites, {"FCL": encoder_init(pretrained["global_model"]), "random": "random"}, modes=["local"],
                         n_labelled=[1], folds=[0], settings=settings)
    assert sorted((r["method"], r["site"], r["n_labelled"]) for r in rows) == sorted(
        (m, f"site-{i}", 1) for m in ("FCL", "random") for i in range(1, SITES + 1))
    assert all(math.isfinite(r["dice"]) for r in rows)
    init = export_unet_init(pretrained["global_model"], str(tmp_path / "init.pt"), settings["features"])
    ft = run_simulation(os.path.join(JOBS, "fcl_acdc_finetune"), str(tmp_path / "ws_ft"), n_sites=SITES,
                        data_root=os.path.join(data, "{site}"), profile="quick", echo=False,
                        sets=["server.scatter_and_gather.num_rounds=1", "client.seg_trainer.local_epochs=1",
                              f"server.persistor.source_ckpt_file_full_name={init}"])
    fed = evaluate_federated(ft["global_model"], sites, method="FCL", n_labelled=1, fold=0, settings=settings)
    assert len(fed) == SITES and all(math.isfinite(r["dice"]) for r in fed)
    # the fine-tuning run started from the pre-trained encoder, not from random weights
    log = open(ft["log"]).read()
    assert "Loading checkpoint from" in log and init in log


def test_corrupt_site_fails_alone_with_a_clear_error(data, tmp_path):
    bad = tmp_path / "acdc_bad"
    shutil.copytree(data, bad)
    victim = sorted(glob.glob(str(bad / "site-2" / "patient*" / "*_4d.nii.gz")))[0]  # pre-training reads the cines
    with open(victim, "wb") as f:
        f.write(b"this is not a NIfTI file")
    s = run_simulation(os.path.join(JOBS, "fcl_acdc"), str(tmp_path / "ws_bad"), n_sites=SITES,
                       data_root=str(bad / "{site}"), profile="quick", echo=False, tolerate_site_failures=True,
                       sets=["server.scatter_and_gather.num_rounds=1", "server.scatter_and_gather.min_clients=2"])
    assert len(s["site_failures"]) == 1
    assert "site-2" in s["site_failures"][0] and victim in s["site_failures"][0]
    assert s["rounds"][0]["aggregated_sites"] == SITES - 1  # the other sites went on; server stayed up
    assert os.path.isfile(s["global_model"])


def test_client_state_survives_restarts(data, tmp_path):
    """-t 1 with -n 2: the simulator restarts each client between tasks; banks/optimiser come back from disk.
    Two sites are enough to show it (every client start imports torch + MONAI, so each site costs ~10 s a round)."""
    s = run_simulation(os.path.join(JOBS, "fcl_acdc"), str(tmp_path / "ws_restart"), n_sites=2, threads=1,
                       data_root=os.path.join(data, "{site}"), profile="quick", echo=False,
                       sets=["server.scatter_and_gather.num_rounds=2", "client.fcl_trainer.max_steps_per_round=1"])
    log = open(s["log"]).read()
    for site in (1, 2):
        assert "resumed client state from round 0" in log
        state = torch.load(os.path.join(s["workspace"], f"site-{site}", "simulate_job", "fcl_client_state.pt"),
                           weights_only=True)
        assert state["round"] == 1 and state["trainer"]["bank"]["filled"] == 2 * 16  # 1 step per round x 16 images


def test_local_cl_exchanges_nothing_and_each_site_keeps_its_own_encoder(data, tmp_path):
    """Issue 13 item 6: Local CL (sites federated=false; aggregator exclude_patterns ["*"], collectors []) completes;
    no weight and no feature goes up, the summary says so, the global model stays the initial one, and each site's
    own encoder (its fcl_client_state.pt) exports to a U-Net init for fine-tuning."""
    s = run_simulation(os.path.join(JOBS, "fcl_acdc"), str(tmp_path / "ws_local"), n_sites=SITES,
                       data_root=os.path.join(data, "{site}"), profile="quick", echo=False,
                       sets=["server.scatter_and_gather.num_rounds=2", "client.fcl_trainer.federated=false",
                             'server.aggregator.exclude_patterns=["*"]', "server.aggregator.collectors=[]"])
    assert [(r["aggregated_sites"], r["model_uploaded"]) for r in s["rounds"]] == [(SITES, False), (SITES, False)]
    for r in s["communication_per_round"]:
        assert "weights" not in r["upload"] and "features" not in r["upload"] and "features" not in r["download"]
    settings = protocol_settings("quick")
    encoders = []
    for site in range(1, SITES + 1):
        ckpt = os.path.join(s["workspace"], f"site-{site}", "simulate_job", "fcl_client_state.pt")
        export_unet_init(ckpt, str(tmp_path / f"unet_site-{site}.pt"), settings["features"])
        encoders.append(encoder_init(ckpt))
    key = sorted(encoders[0])[0]
    assert not torch.equal(encoders[0][key], encoders[1][key])  # each site trained its own encoder
    global_encoder = encoder_init(s["global_model"])
    initial = encoder_state_from_global(MoCoUNetEncoder(settings["features"], 32).state_dict())  # the quick shape
    assert all(torch.equal(global_encoder[k], initial[k]) for k in initial)  # nothing was averaged in
