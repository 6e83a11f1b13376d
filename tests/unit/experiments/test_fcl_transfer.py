"""``fedssl fcl hvsmr-synth`` / ``fedssl fcl transfer`` (fedssl.experiments.fcl_transfer): the ACDC pre-trained encoder
read from a pre-training run's global model or an export-unet checkpoint, and the Table 5 report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fedssl.cli import main
from fedssl.experiments.fcl_transfer import transfer_encoder
from fedssl.models.unet import TINY_FEATURES, MoCoUNetEncoder, UNet2D, UNetEncoder
from fedssl.train.segmentation import init_unet

torch.set_num_threads(1)


def _pretrained(path: Path) -> MoCoUNetEncoder:
    model = MoCoUNetEncoder(TINY_FEATURES, proj_dim=8, image_size=32, seed=3)
    torch.save({"model": model.state_dict()}, path)
    return model


def test_encoder_of_a_pretraining_global_model_loads_into_the_3_class_unet(tmp_path: Path) -> None:
    model = _pretrained(tmp_path / "FL_global_model.pt")
    encoder = transfer_encoder(str(tmp_path / "FL_global_model.pt"))
    assert set(encoder) == set(UNetEncoder(TINY_FEATURES).state_dict())
    unet = init_unet(encoder, features=TINY_FEATURES, out_channels=3)
    assert torch.equal(unet.state_dict()["down_4.convs.conv_1.conv.weight"],
                       model.state_dict()["main.encoder.down_4.convs.conv_1.conv.weight"])


def test_only_the_encoder_of_an_exported_4_class_unet_transfers(tmp_path: Path) -> None:
    acdc_unet = UNet2D(TINY_FEATURES, out_channels=4, seed=1)
    torch.save({"model": acdc_unet.state_dict()}, tmp_path / "unet_init.pt")
    encoder = transfer_encoder(str(tmp_path / "unet_init.pt"))
    assert set(encoder) == set(UNetEncoder(TINY_FEATURES).state_dict())  # no upcat_* / final_conv (4 classes)
    assert init_unet(encoder, features=TINY_FEATURES, out_channels=3).final_conv.out_channels == 3
    torch.save({"model": {"fc.weight": torch.zeros(2)}}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match=r"other\.pt holds neither a pre-training global model"):
        transfer_encoder(str(tmp_path / "other.pt"))


def test_cli_writes_the_table5_report(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _pretrained(tmp_path / "pre.pt")
    assert main(["fcl", "hvsmr-synth", str(tmp_path / "hvsmr"), "--subjects", "5", "--size", "16", "16", "8"]) == 0
    out = tmp_path / "report"
    assert main(["fcl", "transfer", "--data-root", str(tmp_path / "hvsmr"), "--init", "random=random",
                 "--init", f"fcl={tmp_path / 'pre.pt'}", "--n", "1", "--folds", "0", "--image-size", "32",
                 "--spacing", "0.5", "--features", *map(str, TINY_FEATURES), "--epochs", "1", "--out", str(out)]) == 0
    report = json.loads((out / "summary.json").read_text())
    assert [(r["method"], r["n_labelled"], r["fold"]) for r in report["rows"]] == [("random", 1, 0), ("fcl", 1, 0)]
    assert report["rows"][0]["val_patients"] == report["rows"][1]["val_patients"]
    assert report["extra"]["settings"]["target_spacing"] == 0.5 and report["extra"]["settings"]["epochs"] == 1
    table = (out / "dice_table.txt").read_text()
    assert all(f"\n{key}\n" in table for key in ("dice", "myocardium", "blood_pool"))
    assert "transfer  fcl" in capsys.readouterr().out


def test_a_bad_init_file_is_refused_before_the_data_is_read(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    rc = main(["fcl", "transfer", "--data-root", str(tmp_path / "missing"), "--init", f"x={tmp_path / 'bad.pt'}",
               "--out", str(tmp_path / "out")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "bad.pt" in err and "missing" not in err
    assert not (tmp_path / "out").exists()
