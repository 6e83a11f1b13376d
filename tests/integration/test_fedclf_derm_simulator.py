"""FedCLF's jobs end to end in the FLARE simulator (quick profile: ResNet width 8, 3 devices, 2 rounds): pre-training
with feature exchange (FedCLF, eq. 5) and the FedMoCo switch, then federated fine-tuning from the FedCLF global model
with FinalEvaluation testing the validation-selected model on every device.  Marked slow."""

import json
import os

import pytest

from fedssl.data.fedclf_devices import build_devices
from fedssl.data.fedclf_synthetic import write_synthetic_derm_sources
from fedssl.ops.jobs import REPO_ROOT
from fedssl.ops.simulate import run_simulation

pytestmark = pytest.mark.slow
JOBS = os.path.join(REPO_ROOT, "jobs")


@pytest.fixture(scope="module")
def devices(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("fedclf")
    write_synthetic_derm_sources(str(root / "raw"), n_isic=160, seed=0, image_size=40)
    build_devices(str(root / "devices"), *(str(root / "raw" / s) for s in ("isic2019", "atlasderm", "dermnet",
                                                                           "darkderm")),
                  seed=0, short_edge=36)
    return str(root / "devices")


def simulate(job: str, devices: str, tmp_path, *sets: str) -> dict:
    return run_simulation(os.path.join(JOBS, job), str(tmp_path / job), n_sites=3,
                          data_root=os.path.join(devices, "{site}"), profile="quick", echo=False, sets=list(sets))


def test_fedclf_pretraining_exchanges_banks_then_finetunes(devices, tmp_path):
    run = simulate("fedclf_derm", devices, tmp_path)
    assert [r["round"] for r in run["rounds"]] == [0, 1] and all(r["aggregated_sites"] == 3 for r in run["rounds"])
    # each device uploads its bank (64 x 32 float32) with the weights; round 1 trains on the others' banks
    assert run["bytes_per_site_per_round"]["upload"] > 64 * 32 * 4
    assert run["rounds"][1]["site_record_means"]["queue_remote_fraction"] == 1.0
    log = open(run["log"]).read()
    # site-1 receives as many of the 2 others' features as it shared in round 0 (its bank started empty)
    with open(os.path.join(run["workspace"], "site-1", "simulate_job", "fedclf_metrics.jsonl")) as f:
        first = json.loads(f.readline())
    assert 0 < first["bank_filled"] <= 64
    assert f"sending site-1 {first['bank_filled']} remote features from 2 other sites" in log
    ft = simulate("fedclf_derm_finetune", devices, tmp_path / "ft",
                  f"server.model.pretrained_path={run['global_model']}", "client.cls_trainer.label_fraction=0.4")
    with open(os.path.join(ft["workspace"], "server", "simulate_job", "test_metrics.json")) as f:
        report = json.load(f)
    assert sorted(report["sites"]) == ["site-1", "site-2", "site-3"]
    for metrics in report["sites"].values():
        per_class = metrics["per_class"]
        assert set(per_class) == {"BCC", "DF", "MEL", "NV", "SCC"}
        present = [c for c in per_class.values() if c["support"] > 0]
        # recomputed from the per-class counts: balanced accuracy is the mean recall of the classes present, and
        # accuracy the hits (recall x support) over all test images
        assert metrics["balanced_accuracy"] == pytest.approx(sum(c["recall"] for c in present) / len(present))
        assert metrics["n"] == sum(c["support"] for c in present)
        assert metrics["accuracy"] == pytest.approx(sum(c["recall"] * c["support"] for c in present) / metrics["n"])


def test_fedmoco_switch_sends_no_feature(devices, tmp_path):
    run = simulate("fedclf_derm", devices, tmp_path, "client.fedclf_trainer.queue=none",
                   "server.aggregator.collectors=[]")
    assert run["rounds"][1]["site_record_means"]["queue_remote_fraction"] == 0.0
    assert "remote bank" not in open(run["log"]).read()


def test_table3_cnn_pretraining_reads_partition_sites_at_resnet50(tmp_path):
    """Table III's CNN rows: jobs/fedclf_derm on ``fedssl sslfl partition`` sites (8 ISIC classes, the site folder
    itself, ``split=""``) with ResNet-50 (``shape.depth=50``), feature exchange on."""
    from fedssl.data.image_sites import write_site_folders
    from fedssl.data.image_synthetic import write_synthetic_images
    from fedssl.experiments.fedmae_table3 import CNN_DATA_SETS
    from fedssl.models.resnet import PretrainingResNet
    from fedssl.models.vit_classifier import read_checkpoint

    write_synthetic_images(str(tmp_path / "isic"), "derm", n_images=120, seed=0, image_size=40)
    write_site_folders(str(tmp_path / "isic"), "derm", str(tmp_path / "parts"), n_sites=3, split="iid", seed=0)
    run = run_simulation(os.path.join(JOBS, "fedclf_derm"), str(tmp_path / "ws"), n_sites=3,
                         data_root=str(tmp_path / "parts" / "{site}"), profile="quick", echo=False,
                         sets=[*CNN_DATA_SETS, "server.scatter_and_gather.num_rounds=1"])
    assert run["rounds"][0]["aggregated_sites"] == 3
    state = read_checkpoint(run["global_model"])
    assert set(state) == set(PretrainingResNet("moco", 8, 32, depth=50).state_dict())
