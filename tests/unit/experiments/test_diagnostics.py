"""Diagnostics under every table (fedssl.experiments.diagnostics): the rounds of a RunSummary summary.json, the text
block from a hand-made dict, and small end-to-end runs of diagnose_acdc / diagnose_vit."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch

from fedssl.data.image_synthetic import write_synthetic_images
from fedssl.data.images import load_image_records
from fedssl.data.volume import Volume
from fedssl.experiments.diagnostics import (
    reconstruction_reference,
    _scale_text,
    diagnose_acdc,
    diagnose_vit,
    failed_mark,
    failed_verdict,
    failure_footer,
    failure_record,
    format_diagnostics,
    health_settings,
    health_text,
    job_health_settings,
    mark_lines,
    pretraining_health,
    pretraining_rounds,
    verdict,
)
from fedssl.ops.jobs import REPO_ROOT
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


def test_reconstruction_reference_on_the_pretraining_views(tmp_path):
    """12 synthetic retina images, 32 px views in 4 px patches (d = 48 values), 60 % masked.  With norm_pix, predicting
    each patch's mean is predicting zero for a target of unit unbiased variance: (d - 1) / d = 47/48 exactly when no
    patch is flat.  Harmonic inpainting of these smooth images does far better; the same call gives the same
    numbers; a site list without images is refused."""
    root = tmp_path / "retina"
    write_synthetic_images(root, "retina", n_images=12, seed=0, image_size=40)
    records = {"site-1": load_image_records(str(root), "retina", site="site-1")[:7],
               "site-2": load_image_records(str(root), "retina", site="site-2")[7:]}
    kw = dict(dataset="retina", image_size=32, patch_size=4, mask_ratio=0.6, norm_pix=True, seed=0)
    ref = reconstruction_reference(records, **kw)
    assert ref["images"] == 12 and ref["masked_patches"] == 12 * round(64 * 0.6)
    assert ref["predict_mean"] == pytest.approx(47 / 48, rel=1e-4)  # less by var / (var + 1e-6), the target eps
    assert ref["inpainting"] < 0.5 * ref["predict_mean"]
    assert reconstruction_reference(records, **kw) == ref
    assert reconstruction_reference(records, **{**kw, "seed": 1})["inpainting"] != ref["inpainting"]
    text = format_diagnostics([{"method": "Fed-MAE", "reconstruction": ref}])
    assert f"predicting each patch's mean {47 / 48:.4f}, harmonic inpainting from the visible pixels " \
           f"{ref['inpainting']:.4f}" in text
    with pytest.raises(ValueError, match="no image"):
        reconstruction_reference({"site-1": []}, **kw)


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


# ------------------------------------------------------------------------------------------------ loss health (H4)

#: ln(K+1) of a 1024-entry bank: 6.9324
LN_1025 = math.log(1025)


def fcl_rounds(local, spread=None):
    """FCL rounds: ``loss_local`` per round (the total adds a remote term of 3), ``feature_std`` where given."""
    return [{"round": r, "loss": x + 3.0, "loss_local": x, **({} if spread is None else {"feature_std": spread[r]})}
            for r, x in enumerate(local)]


FCL_KW = dict(chance=LN_1025, chance_what="ln(K+1), K = 1024", dim=32, loss_key="loss_local")


def test_a_loss_never_below_chance_is_a_failed_pretraining():
    h = pretraining_health(fcl_rounds([7.2, 7.0, 6.95]), **FCL_KW)
    assert h["failed"] is True
    assert h["reasons"] == ["loss never below chance: min loss_local 6.950 (round 2) vs ln(K+1), K = 1024 = 6.932"]
    assert (h["min_loss"], h["min_loss_round"], h["chance"]) == (6.95, 2, pytest.approx(LN_1025))
    # at chance is not below it: a loss that only reaches ln(K+1) has learnt nothing
    assert pretraining_health(fcl_rounds([7.2, LN_1025]), **FCL_KW)["failed"] is True


def test_a_loss_that_ends_well_below_chance_is_not_a_failure():
    h = pretraining_health(fcl_rounds([7.2, 5.9, 6.5]), **FCL_KW)
    assert h["failed"] is False and h["reasons"] == [] and h["min_loss"] == 5.9 and h["min_loss_round"] == 1
    assert (h["last_loss"], h["last_loss_round"], h["last_chance"]) == (6.5, 2, pytest.approx(LN_1025))
    # the total (local + remote 3) is above chance throughout; the local term is the one against ln(K+1)
    assert pretraining_health(fcl_rounds([7.2, 5.9]), chance=LN_1025, loss_key="loss")["failed"] is True


def test_a_loss_back_at_chance_at_the_end_is_a_failed_pretraining():
    """FedCLF's bench run: below chance in round 0 only (its queue short: the run records a lower chance), then
    0.3 % below ln(257) to the end.  5 % below chance is the least that counts: 0.95 x ln(1025) = 6.5858."""
    rounds = [{"round": 0, "loss": 1.7, "chance_loss": math.log(17)}, {"round": 1, "loss": 5.53}]
    h = pretraining_health(rounds, chance=math.log(257), chance_what="ln(K+1), K = 256")
    assert h["failed"] is True
    assert h["reasons"] == ["loss ends at chance: loss 5.530 (round 1) is less than 5% below ln(K+1), K = 256 = 5.549"]
    rounds[1]["chance_loss"] = 5.7  # the last round's own recorded chance is the one it is held to
    assert pretraining_health(rounds, chance=math.log(257))["reasons"][0].endswith("by the run = 5.700")
    assert pretraining_health(fcl_rounds([7.2, 5.0, 6.58]), **FCL_KW)["failed"] is False
    assert pretraining_health(fcl_rounds([7.2, 5.0, 6.59]), **FCL_KW)["reasons"][0].startswith("loss ends at chance")


def test_a_bank_loss_below_chance_with_a_network_at_chance_without_the_bank_is_a_failed_pretraining():
    """FCL without structural matching: the logged loss 4.70 against ln 1,025 = 6.93 while two fixed views of the
    network scored 5.98 against their chance 5.98.  5 % below that chance is the least that counts."""
    rounds = fcl_rounds([6.0, 4.7], spread=[0.05, 0.05])
    at_chance = {"loss": 5.98, "chance": 5.98, "start_loss": 5.99}
    h = pretraining_health(rounds, bank=True, discrimination=at_chance, **FCL_KW)
    assert h["failed"] is True
    assert h["reasons"] == ["the network discriminates at chance without its bank: instance discrimination 5.980 is "
                            "less than 5% below its chance level 5.980, its start 5.990"]
    assert (h["discrimination_loss"], h["discrimination_chance"], h["discrimination_start"]) == (5.98, 5.98, 5.99)
    # 0.95 x 5.98 = 5.681: just below passes, just above fails; the logged loss alone passes either way
    assert pretraining_health(rounds, bank=True, discrimination=dict(at_chance, loss=5.68), **FCL_KW)["failed"] is False
    assert pretraining_health(rounds, bank=True, discrimination=dict(at_chance, loss=5.69), **FCL_KW)["failed"] is True
    assert pretraining_health(rounds, **FCL_KW)["failed"] is False
    # a bank loss with nothing measured without the bank: said, not failed; no bank: not asked
    none = pretraining_health(rounds, bank=True, **FCL_KW)
    assert none["failed"] is False and none["notes"] == ["the loss reads a memory bank, and no bank-free "
                                                         "discrimination was measured: a stale bank can hold it "
                                                         "below chance while the network learns nothing"]
    assert pretraining_health(rounds, discrimination=at_chance, **FCL_KW)["failed"] is False
    ok = pretraining_health(rounds, bank=True, discrimination=dict(at_chance, loss=5.5), **FCL_KW)
    assert health_text(ok) == ("ok (min loss_local 4.700 vs ln(K+1), K = 1024 = 6.932; final spread 0.0500 >= "
                               "0.0177; bank-free discrimination 5.500 vs chance 5.980)")


def test_a_round_recorded_chance_is_the_one_that_round_is_held_to():
    rounds = fcl_rounds([6.0, 5.0])
    for r in rounds:
        r["chance_loss_local"] = 4.0  # e.g. fewer negatives than the settings' K: the trainer's own count
    h = pretraining_health(rounds, **FCL_KW)
    assert h["failed"] is True and h["chance"] == 4.0 and "vs chance recorded by the run = 4.000" in h["reasons"][0]
    rounds[1]["chance_loss_local"] = 5.5
    assert pretraining_health(rounds, **FCL_KW)["failed"] is False


def test_the_chance_level_a_run_summary_recorded_reaches_the_health(tmp_path):
    """The trainers report ``chance_loss_local`` / ``chance_loss`` in their summary record; RunSummary averages it
    over the sites per round (``site_record_means``), :func:`pretraining_rounds` reads it."""
    summary = {"rounds": [{"round": r, "mean_loss": 9.0, "loss_terms": {"loss_local": 5.0},
                           "site_record_means": {"chance_loss_local": 4.5, "feature_std": 0.1}} for r in range(2)]}
    rounds = pretraining_rounds(write(tmp_path, summary))
    assert rounds[0]["chance_loss_local"] == 4.5
    h = pretraining_health(rounds, **FCL_KW)  # 5.0 is below the settings' ln 1025 but not below the recorded 4.5
    assert h["failed"] is True and h["chance"] == 4.5 and h["chance_what"] == "chance recorded by the run"


def test_a_collapsed_spread_is_a_failed_pretraining():
    limit = 0.1 / math.sqrt(32)  # COLLAPSE_FRACTION x 1/sqrt(D)
    h = pretraining_health(fcl_rounds([6.0, 5.0], spread=[0.1, 0.004]), **FCL_KW)
    assert h["failed"] is True and h["final_spread"] == 0.004 and h["spread_round"] == 1
    assert h["reasons"] == [f"feature spread collapsed: 0.0040 (round 1) < 0.1 x 1/sqrt(32) = {limit:.4f}"]
    assert h["collapse_below"] == pytest.approx(limit) and h["spread_reference"] == pytest.approx(1 / math.sqrt(32))
    # the final spread counts, an early dip does not; at the limit is not below it
    assert pretraining_health(fcl_rounds([6.0, 5.0], spread=[0.004, 0.1]), **FCL_KW)["failed"] is False
    assert pretraining_health(fcl_rounds([6.0, 5.0], spread=[0.1, limit]), **FCL_KW)["failed"] is False
    both = pretraining_health(fcl_rounds([7.0, 7.0], spread=[0.1, 0.004]), **FCL_KW)
    assert [r.split(":")[0] for r in both["reasons"]] == ["loss never below chance", "feature spread collapsed"]


def test_byol_has_no_chance_level_only_the_spread_check():
    kw = health_settings("byol_trainer", {"proj_dim": 32})
    assert kw == {"chance": None, "chance_what": "BYOL has no negatives, no chance level", "loss_key": "loss",
                  "dim": 32}
    rounds = [{"round": r, "loss": 4.0, "feature_std": s} for r, s in enumerate([0.2, 0.1])]
    h = pretraining_health(rounds, **kw)
    assert h["failed"] is False and h["min_loss"] == 4.0
    assert h["notes"] == ["BYOL has no negatives, no chance level: the loss is not checked"]
    rounds[-1]["feature_std"] = 0.001
    assert pretraining_health(rounds, **kw)["reasons"][0].startswith("feature spread collapsed: 0.0010")


def test_no_rounds_is_not_a_failure_and_says_so():
    h = pretraining_health([], **FCL_KW)
    assert h["failed"] is False and h["reasons"] == ["no rounds recorded"]
    # rounds without the loss term or the spread: nothing to fail on, each check says why it did not apply
    h = pretraining_health([{"round": 0, "loss": 9.0}], **FCL_KW)
    assert h["failed"] is False and h["notes"] == ["no loss_local recorded: the loss is not checked against chance",
                                                   "no feature spread recorded: the spread is not checked for collapse"]


def test_chance_levels_from_each_trainers_job_settings():
    def job(name, sets=()):
        trainer = {"fcl_acdc": "fcl_trainer", "fclopt_acdc": "byol_trainer", "fedclf_derm": "fedclf_trainer"}
        return job_health_settings(os.path.join(REPO_ROOT, "jobs", name), "bench", list(sets),
                                   trainer.get(name, "mim_trainer"))

    # bench: FCL bank 1024, projection 32 (the quick profile's shape); MoCo / Local CL are the same trainer
    assert job("fcl_acdc") == {"chance": pytest.approx(LN_1025), "chance_what": "ln(K+1), K = 1024",
                               "loss_key": "loss_local", "dim": 32, "bank": True}
    assert job("fclopt_acdc")["chance"] is None and job("fclopt_acdc")["dim"] == 32
    # 4 x 4 RGB patches, norm-pix targets: (48 - 1) / 48; BEiT's 64 visual tokens; D = embed_dim 48
    mae, beit = job("sslfl_mae_retina"), job("sslfl_beit_retina")
    assert (mae["chance"], mae["chance_what"], mae["dim"]) == (pytest.approx(47 / 48), "(d-1)/d, d = 48", 48)
    assert (beit["chance"], beit["chance_what"]) == (pytest.approx(math.log(64)), "ln(V), V = 64")
    assert job("sslfl_mae_retina", ["client.mim_trainer.norm_pix_loss=false"])["chance"] is None
    # FedCLF bench: K = 256, batch 16, projection 128
    assert job("fedclf_derm")["chance"] == pytest.approx(math.log(257)) and job("fedclf_derm")["dim"] == 128
    assert job("fedclf_derm")["bank"] is True  # MoCo's queue: the logged loss reads a memory bank
    simclr = job("fedclf_derm", ["client.fedclf_trainer.method=simclr", "client.fedclf_trainer.queue=none"])
    assert (simclr["chance"], simclr["chance_what"]) == (pytest.approx(math.log(31)), "ln(2B-1), B = 16")
    assert "bank" not in simclr  # in-batch negatives: nothing stale to flatter the loss
    rotation = job("fedclf_derm", ["client.fedclf_trainer.method=rotation", "client.fedclf_trainer.queue=none"])
    assert rotation["chance"] == pytest.approx(math.log(4))
    # FCL's FedRotation / FedSimCLR (the fcl_acdc job with another objective; bench batch 16 slices): the total loss
    # against ln 4 (no feature spread recorded) / ln(2 x 16 - 1)
    off = ["client.fcl_trainer.feature_exchange=false", "server.aggregator.collectors=[]"]
    assert job("fcl_acdc", ["shape.objective=rotation", *off]) == {
        "chance": pytest.approx(math.log(4)), "chance_what": "ln(4) rotations", "loss_key": "loss", "dim": None}
    assert job("fcl_acdc", ["shape.objective=simclr", *off]) == {
        "chance": pytest.approx(math.log(31)), "chance_what": "ln(2B-1), B = 16", "loss_key": "loss", "dim": 32}
    with pytest.raises(ValueError, match="no loss-health settings"):
        health_settings("cls_trainer", {})


def test_failure_marks_verdicts_and_footer_lines():
    bad = pretraining_health(fcl_rounds([7.0]), **FCL_KW)
    good = pretraining_health(fcl_rounds([6.0]), **FCL_KW)
    per = {"seed 0": good, "seed 1": bad}
    assert failure_record(per) == {"pretraining_failed": True, "pretraining_failed_at": ["seed 1"],
                                   "pretraining_reasons": {"seed 1": bad["reasons"]}}
    assert failure_record({"seed 0": good})["pretraining_failed"] is False
    assert failed_mark(["seed 1"], list(per)) == " [failed pre-training: seed 1]"
    assert failed_mark(["seed 0", "seed 1"], list(per)) == " [failed pre-training]"
    assert failed_mark([], list(per)) == ""
    assert failure_footer({"FCL": per}) == [f"[failed pre-training] FCL seed 1: {bad['reasons'][0]}"]
    line = "FCL vs random, local fine-tuning at N=1: +0.050 +- 0.010 Dice over 2 seeds -> pre-training helped"
    assert failed_verdict(line, "FCL", ["seed 1"], list(per)) == (
        "FCL vs random, local fine-tuning at N=1: +0.050 +- 0.010 Dice over 2 seeds -> not FCL's result: its "
        "pre-training failed at seed 1 of 2 ([failed pre-training] below)")
    assert failed_verdict(line, "FCL", ["seed 0", "seed 1"], list(per)).endswith(
        "-> not FCL's result: its pre-training failed ([failed pre-training] below)")
    assert failed_verdict(line, "FCL", [], list(per)) == line
    assert mark_lines(["FCL minus random: N=1 +0.05", "FCLOpt minus random: N=1 +0.01"], {"FCL": " [x]"}) == [
        "FCL [x] minus random: N=1 +0.05", "FCLOpt minus random: N=1 +0.01"]


def test_the_diagnostics_block_shows_the_loss_health_and_the_verdict_leads_with_a_failure():
    d = dict(hand_made(spread=0.05), health=pretraining_health(fcl_rounds([7.0]), **FCL_KW))
    lines = format_diagnostics([d]).splitlines()
    assert ("    loss health: FAILED pre-training: loss never below chance: min loss_local 7.000 (round 0) vs "
            "ln(K+1), K = 1024 = 6.932; no feature spread recorded: the spread is not checked for collapse") in lines
    assert lines[-1] == ("    verdict: pre-training failed (loss health above); frozen encoder beats random by "
                         "+0.041 Dice")
    d["health"] = pretraining_health(fcl_rounds([6.0], spread=[0.1]), **FCL_KW)
    assert ("    loss health: ok (min loss_local 6.000 vs ln(K+1), K = 1024 = 6.932; final spread 0.1000 >= 0.0177)"
            in format_diagnostics([d]).splitlines())
