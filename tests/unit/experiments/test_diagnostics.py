"""Diagnostics under every table (fedssl.experiments.diagnostics): the rounds of a RunSummary summary.json, the text
block from a hand-made dict, and small end-to-end runs of diagnose_acdc / diagnose_vit."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fedssl.data.image_synthetic import write_synthetic_images
from fedssl.data.images import load_image_records
from fedssl.data.volume import Volume
from fedssl.experiments.diagnostics import (
    _scale_text,
    diagnose_acdc,
    diagnose_vit,
    format_diagnostics,
    pretraining_rounds,
    verdict,
)
from fedssl.models.unet import TINY_FEATURES, BYOLUNetEncoder, MoCoUNetEncoder, encoder_state_from_global
from fedssl.models.vit import TINY_DECODER, TINY_VIT, MAEViT

torch.set_num_threads(1)
#: the pre-training networks of these tests: projection size 8, 32 px slices (the flatten head's input size)
TINY_NET = dict(proj_dim=8, image_size=32)

#: the format fedssl.flare.run_summary.RunSummary writes (write_run_report): a round without loss or records
#: (nothing aggregated) and two FCL rounds with loss terms and site-record means
SUMMARY = {
    "title": "fcl_acdc", "wall_time_s": 12.5,
    "rounds": [
        {"round": 0, "time_s": 4.1, "aggregated_sites": 2, "mean_loss": 9.5, "loss_std_over_sites": 0.25,
         "site_record_means": {"volumes": 40.0, "steps_per_round": 5.0, "bank_filled": 80.0, "bank_fill": 0.3125,
                               "bank_size": 256.0, "feature_std": 0.07},
         "loss_terms": {"loss_local": 6.0, "loss_remote": 3.5}},
        {"round": 1, "time_s": 8.0, "aggregated_sites": 2, "mean_loss": 9.0, "loss_std_over_sites": 0.5,
         "site_record_means": {"volumes": 40.0, "steps_per_round": 5.0, "bank_filled": 160.0, "bank_fill": 0.625,
                               "bank_size": 256.0, "feature_std": 0.05},
         "loss_terms": {"loss_local": 5.5, "loss_remote": 3.5}, "refused_contributions": []},
        {"round": 2, "time_s": 9.0, "aggregated_sites": 0, "mean_loss": None, "loss_std_over_sites": None},
    ],
    "communication_per_round": [], "bytes_per_site_per_round": {"upload": 1.0, "download": 2.0, "total": 3.0},
}


def write(tmp_path, data, name="summary.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_pretraining_rounds_reads_loss_terms_and_record_means(tmp_path):
    rounds = pretraining_rounds(write(tmp_path, SUMMARY))
    assert rounds[0] == {"round": 0, "loss": 9.5, "loss_std_over_sites": 0.25, "loss_local": 6.0, "loss_remote": 3.5,
                         "volumes": 40.0, "steps_per_round": 5.0, "bank_filled": 80.0, "bank_fill": 0.3125,
                         "bank_size": 256.0, "feature_std": 0.07}
    assert rounds[1]["bank_fill"] == 0.625 and rounds[1]["loss_local"] == 5.5
    assert rounds[2] == {"round": 2}  # what the run did not record is absent, not None


@pytest.mark.parametrize("content, needle", [(None, "does not exist"), ("{not json", "not readable JSON"),
                                             ({"rounds": [{"loss": 1}]}, "no list of rounds")])
def test_a_bad_summary_names_the_file(tmp_path, content, needle):
    path = str(tmp_path / "missing.json") if content is None else write(tmp_path, content)
    with pytest.raises(ValueError, match=needle) as e:
        pretraining_rounds(path)
    assert path in str(e.value)


def hand_made(spread=0.002, pretrained=0.412, random=0.371):
    rounds = [{"round": r, "loss": 9.0 - r, "loss_local": 6.0 - r, "loss_remote": 3.0, "bank_fill": (r + 1) / 4,
               "bank_filled": 64.0 * (r + 1), "bank_size": 256.0, "feature_std": 0.08 - 0.02 * r} for r in range(4)]
    return {"method": "FCL", "rounds": rounds,
            "spread": {"what": "pooled encoder bottleneck", "value": spread, "random": 0.02, "reference": 0.088,
                       "per_site": {"site-1": spread}},
            "probe": {"metric": "dice", "setting": "N=1, fold 0", "pretrained": pretrained, "pretrained_std": 0.05,
                      "random": random, "random_std": 0.04, "n_sites": 2, "rows": []},
            "weight_scale": {"geomean": 4.6, "min": 2.2, "max": 8.5, "n": 10, "cosine": 0.27, "change": 3.8, "seed": 0}}


def test_format_shows_first_middle_last_round_bank_fill_spread_probe_and_verdict():
    text = format_diagnostics([hand_made()])
    lines = text.splitlines()
    assert lines[1] == "  FCL:"
    assert ("    pre-training (round 0 / 2 / 3): loss 9.0000 / 7.0000 / 6.0000; loss_local 6.0000 / 4.0000 / 3.0000; "
            "loss_remote 3.0000 / 3.0000 / 3.0000") in lines
    assert "    bank fill at round 3: 1.00 (256 of 256 slots)" in lines
    assert ("    feature spread (pooled encoder bottleneck): 0.002 vs random encoder 0.020; uniform 1/sqrt(D) 0.088; "
            "in training 0.080 -> 0.020") in lines
    assert ("    frozen-encoder probe dice (N=1, fold 0, 2 sites): pre-trained 0.412 +- 0.050 vs random 0.371 +- 0.040"
            in lines)
    assert ("    encoder kernels vs the random encoder (seed 0: a pre-training's start at model seed 0; 10 "
            "kernels): norm x4.60 (x2.20 to x8.50), cosine 0.27, relative change 3.80") in lines
    assert lines[-1] == ("    verdict: encoder collapsed (spread 0.002, random encoder 0.020); frozen encoder beats "
                         "random by +0.041 Dice")


def test_verdicts_without_collapse_and_without_a_win():
    assert verdict(hand_made(spread=0.05)) == "frozen encoder beats random by +0.041 Dice"
    assert verdict(hand_made(spread=0.05, pretrained=0.30)) == "frozen encoder does not beat random (-0.071 Dice)"
    assert format_diagnostics({"method": "random init"}).splitlines()[-1] == "    verdict: no diagnostics recorded"


def site_volumes(n_sites=2, per_site=5):
    rng = np.random.default_rng(0)
    return {f"site-{s + 1}": [Volume(f"s{s}p{p}", ph, (lab / 3.0).astype(np.float32), lab, f"site-{s + 1}")
                              for p in range(per_site) for ph in ("ED", "ES")
                              for lab in [rng.integers(0, 4, size=(2, 32, 32)).astype(np.uint8)]]
            for s in range(n_sites)}


def test_diagnose_acdc_of_a_global_moco_model(tmp_path):
    state = MoCoUNetEncoder(TINY_FEATURES, **TINY_NET, seed=1).state_dict()
    settings = {"features": list(TINY_FEATURES), "epochs": 1, "lr": 1e-2, "device": "cpu", "batch_size": 4}
    lines = []
    d = diagnose_acdc("FCL", write(tmp_path, SUMMARY), state, site_volumes(), settings, progress=lines.append)
    assert [r["round"] for r in d["rounds"]] == [0, 1, 2] and len(lines) == 2 and "site-2" in lines[1]
    # the encoder bottleneck (16 channels) pooled to the 2 x 2 grid: 64 features, reference 1/8
    assert d["spread"]["reference"] == pytest.approx(1 / 8) and set(d["spread"]["per_site"]) == {"site-1", "site-2"}
    assert d["spread"]["value"] != d["spread"]["random"]  # a different encoder from the random one
    assert d["projection_spread"]["reference"] == pytest.approx(1 / np.sqrt(8))
    probe = d["probe"]
    assert (probe["n_sites"] == 2 and [r["method"] for r in probe["rows"]]
            == ["FCL", "FCL", "random init", "random init"])
    assert probe["rows"][0]["train_patients"] == probe["rows"][2]["train_patients"]  # the same split for both
    json.dumps(d)  # JSON-able, for the table's JSON beside the text
    assert "verdict" in format_diagnostics([d])
    # the encoder's 10 conv kernels (5 blocks x 2 convs) against the random encoder's (seed 0); the pre-trained
    # state is seed 1's initialisation: the same scale roughly, an unrelated direction
    w = d["weight_scale"]
    assert w["n"] == 10 and 0.7 < w["min"] <= w["geomean"] <= w["max"] < 1.3 and w["geomean"] != 1.0
    assert abs(w["cosine"]) < 0.3 and w["change"] > 1.0 and w["seed"] == 0


def test_diagnose_vit_of_a_mae_model(tmp_path):
    root = tmp_path / "retina"
    write_synthetic_images(root, "retina", n_images=12, seed=0, image_size=40)
    records = {"site-1": load_image_records(str(root), "retina", site="site-1")}
    settings = {"dataset": "retina", **TINY_VIT, "val_fraction": 0.25, "seed": 0, "device": "cpu"}
    state = MAEViT(**TINY_VIT, **TINY_DECODER, seed=5).state_dict()
    d = diagnose_vit("Fed-MAE", None, state, records, settings)
    assert d["rounds"] == [] and d["spread"]["reference"] == pytest.approx(1 / np.sqrt(48))
    assert d["probe"]["metric"] == "accuracy" and [r["method"] for r in d["probe"]["rows"]] == ["Fed-MAE", "scratch"]
    assert "frozen-encoder probe accuracy (label fraction 1, 1 sites)" in format_diagnostics([d])


@pytest.mark.parametrize("cls", [MoCoUNetEncoder, BYOLUNetEncoder])
@pytest.mark.parametrize("seed", [0, 3])
def test_the_random_encoder_is_the_pretraining_start_at_its_seed(cls, seed):
    """The kernel comparison line reads "a pre-training's start at model seed s": a MoCo / BYOL model built with
    seed s holds exactly the diagnostics' random encoder of seed s, so an untrained model compares as unchanged."""
    from fedssl.core.weight_scale import compare_kernels, summarise
    from fedssl.experiments.diagnostics import _unet_encoder
    start = encoder_state_from_global(cls(TINY_FEATURES, **TINY_NET, seed=seed).state_dict())
    summary = summarise(compare_kernels(start, _unet_encoder("random", list(TINY_FEATURES), seed).state_dict()))
    assert summary == pytest.approx({"geomean": 1.0, "min": 1.0, "max": 1.0, "n": 10, "cosine": 1.0, "change": 0.0})
    assert "seed 3: a pre-training's start at model seed 3" in _scale_text({**summary, "seed": 3})


@pytest.mark.parametrize("cls", [MoCoUNetEncoder, BYOLUNetEncoder])
def test_instance_discrimination_of_the_projection_against_its_start(cls):
    """MoCo main / BYOL online network on 5 patients x 2 phases x 2 slices per site: 16 negatives per slice (chance
    log 17).  An untrained model at the default seed is the start itself (equal losses); seed 1 is another network."""
    settings = {"features": list(TINY_FEATURES), "epochs": 1, "lr": 1e-2, "device": "cpu", "batch_size": 4}
    same = diagnose_acdc("m", None, cls(TINY_FEATURES, **TINY_NET).state_dict(), site_volumes(), settings)
    x = same["discrimination"]
    assert x["chance"] == pytest.approx(np.log(17)) and x["tau"] == 0.1 and set(x["per_site"]) == {"site-1", "site-2"}
    assert x["loss"] == pytest.approx(x["start_loss"], abs=1e-6) and x["top1"] == pytest.approx(x["start_top1"])
    other = diagnose_acdc("m", None, cls(TINY_FEATURES, **TINY_NET, seed=1).state_dict(), site_volumes(), settings)
    y = other["discrimination"]
    assert (y["start_loss"] == pytest.approx(x["start_loss"], abs=1e-6)
            and y["loss"] != pytest.approx(x["loss"], abs=1e-4))
    assert np.mean(list(y["per_site"].values())) == pytest.approx(y["loss"])
    line = next(s for s in format_diagnostics([other]).splitlines() if "instance discrimination, the" in s)
    assert f"InfoNCE {y['loss']:.3f} vs the start's {y['start_loss']:.3f} (chance {np.log(17):.3f})" in line
    json.dumps(other)


def test_a_bare_encoder_has_no_instance_discrimination():
    settings = {"features": list(TINY_FEATURES), "epochs": 1, "lr": 1e-2, "device": "cpu", "batch_size": 4}
    state = encoder_state_from_global(MoCoUNetEncoder(TINY_FEATURES, **TINY_NET).state_dict())
    d = diagnose_acdc("m", None, state, site_volumes(), settings)
    assert "discrimination" not in d and "instance discrimination, the" not in format_diagnostics([d])
    # a global state whose head was left out (main.encoder.* only): the encoder is measured, no projection
    headless = {k: v for k, v in MoCoUNetEncoder(TINY_FEATURES, **TINY_NET).state_dict().items()
                if k.startswith("main.encoder.")}
    h = diagnose_acdc("m", None, headless, site_volumes(), settings)
    assert "discrimination" not in h and "projection_spread" not in h
    # its encoder is the seed-0 start, i.e. the random encoder: the position measure equals the random one's
    assert h["position"]["encoder"] == pytest.approx(h["position"]["random"]) and h["position"]["per_site"] == \
        pytest.approx(d["position"]["per_site"])


def test_slice_position_of_the_encoder_against_the_random_encoder():
    """Every U-Net encoder gets the position kNN (4 partitions, 5 voters); the random encoder's value is the same for
    every method, and an untrained start scores as the random encoder."""
    settings = {"features": list(TINY_FEATURES), "epochs": 1, "lr": 1e-2, "device": "cpu", "batch_size": 4}
    vols = site_volumes()
    a = diagnose_acdc("a", None, MoCoUNetEncoder(TINY_FEATURES, **TINY_NET, seed=3).state_dict(), vols, settings)
    b = diagnose_acdc("b", None, encoder_state_from_global(MoCoUNetEncoder(TINY_FEATURES, **TINY_NET).state_dict()),
                      vols, settings)
    pa, pb = a["position"], b["position"]
    assert (pa["n_partitions"], pa["k"]) == (4, 5) and set(pa["per_site"]) == {"site-1", "site-2"}
    # b is the start
    assert pa["random"] == pytest.approx(pb["random"]) and pb["encoder"] == pytest.approx(pb["random"])
    assert np.mean(list(pa["per_site"].values())) == pytest.approx(pa["encoder"])
    from fedssl.eval.features import unet_position_knn
    from fedssl.experiments.diagnostics import _unet_encoder
    enc = _unet_encoder(encoder_state_from_global(MoCoUNetEncoder(TINY_FEATURES, **TINY_NET, seed=3).state_dict()),
                        list(TINY_FEATURES), 0)
    assert pa["per_site"]["site-2"] == pytest.approx(unet_position_knn(enc, vols["site-2"], k=5))
    line = next(s for s in format_diagnostics([a]).splitlines() if "slice position" in s and "vote" in s)
    assert f": {pa['encoder']:.3f} vs random encoder {pa['random']:.3f} (chance about 0.25)" in line
