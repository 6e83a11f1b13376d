"""``fedssl fcl finetune`` (fedssl.experiments.fcl_finetune): the centralised protocol's labelled set, from the
command line to the report (FCL (Wu et al., MedIA 2022) Table 3, issue 13 item 4)."""

import json

import pytest
import torch

from fedssl.cli import main
from fedssl.data.acdc_synthetic import write_synthetic_acdc
from fedssl.experiments.fcl_finetune import run_finetune

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def acdc(tmp_path_factory):
    """3 sites of 5 synthetic patients (4 training + 1 validation patient per site in every fold)."""
    root = tmp_path_factory.mktemp("acdc_ft")
    write_synthetic_acdc(root, n_patients=15, n_sites=3, seed=0, shape=(48, 48), n_frames=2, slices_range=(4, 5))
    return str(root)


def finetune(acdc, out, *extra):
    argv = ["fcl", "finetune", "--data-root", acdc, "--init", "random=random", "--n", "1", "--folds", "0",
            "--modes", "centralised", "--profile", "quick", "--epochs", "1", "--out", str(out), *extra]
    assert main(argv) == 0
    with open(out / "summary.json") as f:
        return json.load(f)


@pytest.mark.parametrize("extra, labelled_from, n_patients", [((), "pooled", 1),
                                                              (("--labelled-from", "per_site"), "per_site", 3)])
def test_centralised_n1_trains_on_one_patient_by_default(acdc, tmp_path, capsys, extra, labelled_from, n_patients):
    """Before issue 13 item 4 the centralised run at N=1 with 3 sites trained on 3 patients (1 per site); the
    paper's protocol draws N in total from the pooled sites; per_site stays reachable."""
    report = finetune(acdc, tmp_path, *extra)
    (row,) = report["rows"]
    assert (row["mode"], row["site"], report["extra"]["labelled_from"]) == ("centralised", "all", labelled_from)
    assert len(row["train_patients"]) == n_patients and row["n_train_volumes"] == 2 * n_patients  # ED + ES
    capsys.readouterr()


def test_bad_labelled_from_is_refused_before_any_file_is_read(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"labelled_from='site'.*'pooled'"):
        run_finetune(str(tmp_path / "missing"), {"random": "random"}, str(tmp_path / "out"), labelled_from="site")
    with pytest.raises(SystemExit):
        main(["fcl", "finetune", "--data-root", "x", "--init", "r=random", "--out", "o", "--labelled-from", "site"])
    assert "invalid choice: 'site' (choose from 'pooled', 'per_site')" in capsys.readouterr().err


def test_the_fine_tuning_step_floor_comes_from_the_profile_and_an_explicit_epochs_drops_it(tmp_path):
    from fedssl.experiments.fcl_finetune import protocol_settings

    assert protocol_settings(None)["min_steps"] == 0  # the paper's protocol: 200 epochs, no floor
    quick = protocol_settings("quick")
    assert (quick["epochs"], quick["min_steps"]) == (60, 140)
    assert protocol_settings("bench")["min_steps"] == 140  # bench extends quick's fine-tuning
    one = protocol_settings("quick", 1)
    assert (one["epochs"], one["min_steps"]) == (1, 0)  # --epochs 1 is one epoch
    for bad in (-5, 2.5, True, "240"):
        path = tmp_path / "bad.json"
        path.write_text(json.dumps({"finetune": {"min_steps": bad}}))
        with pytest.raises(ValueError, match=r"finetune.min_steps=.*non-negative integer"):
            protocol_settings(str(path))


def test_the_unet_norm_is_the_reference_codes_unless_the_profile_says_otherwise(tmp_path):
    """Issue 44: fine-tuning builds the U-Net with batch norm (the pre-training jobs' default) unless the profile's
    ``finetune.norm`` says "instance"; anything else is refused naming it."""
    from fedssl.experiments.fcl_finetune import protocol_settings

    assert protocol_settings(None)["norm"] == protocol_settings("quick")["norm"] == "batch"
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"finetune": {"norm": "instance"}}))
    assert protocol_settings(str(path))["norm"] == "instance"
    path.write_text(json.dumps({"finetune": {"norm": "layer"}}))
    with pytest.raises(ValueError, match=r"finetune: argument norm='layer' is invalid"):
        protocol_settings(str(path))


@pytest.mark.parametrize("norm", ["batch", "instance"])
def test_export_unet_takes_the_norm_of_the_pretraining(tmp_path, norm):
    """``fedssl fcl export-unet``: the U-Net has the pre-trained encoder's norm, its running statistics included."""
    from fedssl.experiments.fcl_finetune import export_unet_init
    from fedssl.models.unet import TINY_FEATURES, MoCoUNetEncoder, encoder_state_from_global

    moco = MoCoUNetEncoder(TINY_FEATURES, 8, image_size=32, norm=norm)
    moco.main(torch.rand(4, 1, 32, 32))  # training mode: batch norm's running statistics move
    torch.save({"model": moco.state_dict()}, tmp_path / "g.pt")
    unet = torch.load(export_unet_init(str(tmp_path / "g.pt"), str(tmp_path / "u.pt"), TINY_FEATURES),
                      weights_only=True)["model"]
    enc = encoder_state_from_global(moco.state_dict())
    assert all(torch.equal(unet[k], v) for k, v in enc.items())
    assert any(k.endswith("running_var") for k in unet) == (norm == "batch")
