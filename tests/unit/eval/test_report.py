"""Summaries, tables and report files (fedssl.eval.report)."""

from __future__ import annotations

import json

import pytest

from fedssl.eval.report import (
    accuracy_verdict,
    format_paired,
    format_table,
    paired_against,
    pretraining_verdict,
    summarise,
    write_report,
)


def _row(mode, method, n, fold, site, dice):
    return {"mode": mode, "method": method, "n_labelled": n, "fold": fold, "site": site, "dice": dice,
            "RV": dice, "MYO": dice, "LV": dice}


ROWS = [
    # local, FCL, N=1: site a folds 0.5 / 0.7 -> 0.6; site b 0.8 / 0.8 -> 0.8 => 0.7 +- 0.1 over 2 sites
    _row("local", "FCL", 1, 0, "a", 0.5),
    _row("local", "FCL", 1, 1, "a", 0.7),
    _row("local", "FCL", 1, 0, "b", 0.8),
    _row("local", "FCL", 1, 1, "b", 0.8),
    # local, FCL, N=2: sites 0.9 and 0.5 (one fold) => 0.7 +- 0.2
    _row("local", "FCL", 2, 0, "a", 0.9),
    _row("local", "FCL", 2, 0, "b", 0.5),
    # local, Random init, N=1 only
    _row("local", "Random init", 1, 0, "a", 0.25),
    _row("local", "Random init", 1, 0, "b", 0.35),
    # centralised, FCL, N=1: over folds 0.4, 0.6 => 0.5 +- 0.1
    _row("centralised", "FCL", 1, 0, "all", 0.4),
    _row("centralised", "FCL", 1, 1, "all", 0.6),
]


def test_summarise_hand_computed():
    s = summarise(ROWS)
    key = {(r["mode"], r["method"], r["n_labelled"]): r for r in s}
    assert [(r["mode"], r["method"], r["n_labelled"]) for r in s] == [
        ("local", "FCL", 1), ("local", "FCL", 2), ("local", "Random init", 1), ("centralised", "FCL", 1)
    ]
    assert key["local", "FCL", 1]["dice_mean"] == pytest.approx(0.7)
    assert key["local", "FCL", 1]["dice_std"] == pytest.approx(0.1)
    assert key["local", "FCL", 1]["n"] == 2
    assert key["local", "FCL", 2]["dice_mean"] == pytest.approx(0.7)
    assert key["local", "FCL", 2]["dice_std"] == pytest.approx(0.2)
    assert key["local", "Random init", 1]["dice_mean"] == pytest.approx(0.3)
    assert key["local", "Random init", 1]["dice_std"] == pytest.approx(0.05)
    assert key["centralised", "FCL", 1]["dice_mean"] == pytest.approx(0.5)
    assert key["centralised", "FCL", 1]["dice_std"] == pytest.approx(0.1)
    assert key["centralised", "FCL", 1]["n"] == 2


def test_format_table_cells():
    table = format_table(summarise(ROWS))
    lines = table.splitlines()
    assert "N=1" in lines[0] and "N=2" in lines[0]
    fcl_local = next(line for line in lines if line.startswith("local") and "FCL" in line)
    assert "0.700 +- 0.100" in fcl_local and "0.700 +- 0.200" in fcl_local
    rand = next(line for line in lines if "Random init" in line)
    assert "0.300 +- 0.050" in rand and rand.rstrip().endswith("-")
    cen = next(line for line in lines if line.startswith("centralised"))
    assert "0.500 +- 0.100" in cen


def test_write_report_files_and_json_round_trip(tmp_path):
    paths = write_report(ROWS, tmp_path / "out", title="FCL ACDC", extra={"epochs": 2})
    assert set(paths) == {"summary_json", "dice_table", "dice_vs_n"}
    with open(paths["summary_json"]) as f:
        data = json.load(f)
    assert data["title"] == "FCL ACDC" and data["extra"] == {"epochs": 2}
    assert data["rows"] == ROWS
    # the hand-computed summary of ROWS (see test_summarise_hand_computed), as written to the file
    assert [(r["mode"], r["method"], r["n_labelled"], round(r["dice_mean"], 6), round(r["dice_std"], 6), r["n"])
            for r in data["summary"]] == [
        ("local", "FCL", 1, 0.7, 0.1, 2), ("local", "FCL", 2, 0.7, 0.2, 2),
        ("local", "Random init", 1, 0.3, 0.05, 2), ("centralised", "FCL", 1, 0.5, 0.1, 2)]
    with open(paths["dice_table"]) as f:
        text = f.read()
    assert text.startswith("FCL ACDC") and "0.700 +- 0.100" in text
    with open(paths["dice_vs_n"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError):
        write_report([], tmp_path / "empty", title="x")


def _vrow(method, n, site, dice, fold=0):
    return {"mode": "local", "method": method, "n_labelled": n, "fold": fold, "site": site, "dice": dice}


def test_pretraining_verdict_pairs_sites_at_the_smallest_common_n():
    # N=1 differences per site (folds averaged first): s1 (0.5+0.7)/2-0.4 = 0.2, s2 0.5-0.3 = 0.2, s3 0.35-0.25 = 0.1
    # mean 0.1667, population std 0.0471 -> helped.  N=2 is ignored (not the smallest N).
    rows = [_vrow("FCL", 1, "s1", 0.5), _vrow("FCL", 1, "s1", 0.7, fold=1), _vrow("random", 1, "s1", 0.4),
            _vrow("FCL", 1, "s2", 0.5), _vrow("random", 1, "s2", 0.3), _vrow("FCL", 1, "s3", 0.35),
            _vrow("random", 1, "s3", 0.25), _vrow("FCL", 2, "s1", 0.1), _vrow("random", 2, "s1", 0.9)]
    line = pretraining_verdict(rows, "FCL")
    assert line == "FCL vs random, local fine-tuning at N=1: +0.167 +- 0.047 Dice over 3 sites -> pre-training helped"
    # a mean gain smaller than the spread: +0.05 with diffs +0.3 and -0.2 (std 0.25)
    rows = [_vrow("FCL", 1, "a", 0.6), _vrow("random", 1, "a", 0.3), _vrow("FCL", 1, "b", 0.2),
            _vrow("random", 1, "b", 0.4)]
    assert pretraining_verdict(rows, "FCL").endswith("+0.050 +- 0.250 Dice over 2 sites -> pre-training within the "
                                                     "spread (no clear effect)")
    rows = [_vrow("FCL", 1, "a", 0.1), _vrow("random", 1, "a", 0.3), _vrow("FCL", 1, "b", 0.2),
            _vrow("random", 1, "b", 0.4)]
    assert pretraining_verdict(rows, "FCL").endswith("-0.200 +- 0.000 Dice over 2 sites -> pre-training hurt")
    assert "no local fine-tuning at a common N" in pretraining_verdict([_vrow("FCL", 1, "a", 0.1)], "FCL")
    # seeds: each seed's difference is its mean over the sites; the spread is the std over seeds.  Seed 0: sites
    # +0.2 and +0.1 -> +0.15; seed 1: -0.1 and -0.1 -> -0.1.  Mean +0.025, std 0.125 -> within the spread, although
    # the std over sites of the seed-averaged differences (+0.05, 0.0) is only 0.025
    rows = [_vrow("FCL", 1, "a", 0.6), _vrow("random", 1, "a", 0.4), _vrow("FCL", 1, "b", 0.5),
            _vrow("random", 1, "b", 0.4), dict(_vrow("FCL", 1, "a", 0.3), seed=1),
            dict(_vrow("random", 1, "a", 0.4), seed=1), dict(_vrow("FCL", 1, "b", 0.3), seed=1),
            dict(_vrow("random", 1, "b", 0.4), seed=1)]
    assert pretraining_verdict(rows, "FCL").endswith(
        "+0.025 +- 0.125 Dice over 2 seeds (each the mean over its sites) -> pre-training within the spread (no clear "
        "effect)")
    assert "no local fine-tuning of a common seed at N=1" in pretraining_verdict(
        [_vrow("FCL", 1, "a", 0.1), dict(_vrow("random", 1, "a", 0.4), seed=1)], "FCL")


def test_paired_against_pairs_site_and_fold_locally_and_folds_centrally():
    # local, N=1, pairs (s1, f0), (s1, f1), (s2, f0): FCL - random = +0.1, -0.1, +0.2 -> mean 0.0667; sample sd
    # sqrt((0.0333^2 + 0.1667^2 + 0.1333^2) / 2) = 0.15275, SE 0.15275 / sqrt(3) = 0.08819; ahead in 2 of 3.
    # (s2, f1) has no random row: not a pair.  N=2 has one pair: SE undefined.
    rows = [_vrow("random", 1, "s1", 0.5), _vrow("random", 1, "s1", 0.4, fold=1), _vrow("random", 1, "s2", 0.3),
            _vrow("FCL", 1, "s1", 0.6), _vrow("FCL", 1, "s1", 0.3, fold=1), _vrow("FCL", 1, "s2", 0.5),
            _vrow("FCL", 1, "s2", 0.9, fold=1), _vrow("FCL", 2, "s1", 0.4), _vrow("random", 2, "s1", 0.5)]
    first, second = paired_against(rows, mode="local")
    assert first["method"] == "FCL" and first["n_labelled"] == 1 and (first["ahead"], first["pairs"]) == (2, 3)
    assert first["diff_mean"] == pytest.approx(0.2 / 3) and first["diff_se"] == pytest.approx(0.08819, abs=1e-5)
    assert second == {"method": "FCL", "n_labelled": 2, "diff_mean": pytest.approx(-0.1), "diff_se": None,
                      "ahead": 0, "pairs": 1, "seeds": 1}
    assert format_paired([first, second]) == ("FCL minus random: N=1 +0.067 (SE 0.088) ahead in 2/3; "
                                              "N=2 -0.100 (SE n/a) ahead in 0/1")
    # centralised: one model per fold, so folds are the pairs (site is "all")
    central = [dict(r, mode="centralised", site="all") for r in rows if r["site"] == "s1" and r["n_labelled"] == 1]
    (c,) = paired_against(central, mode="centralised")
    assert (c["ahead"], c["pairs"]) == (1, 2) and c["diff_mean"] == pytest.approx(0.0)
    assert paired_against(rows, mode="federated") == [] and format_paired([]) == ""
    with pytest.raises(ValueError, match="mode='global' is not one of"):
        paired_against(rows, mode="global")


def test_paired_against_pairs_runs_of_the_same_seed_and_gives_the_spread_over_seeds():
    # local, N=1, two sites x fold 0 x seeds 0 and 1.  Seed 0: FCL - random = +0.1 (s1), +0.3 (s2) -> mean +0.2;
    # seed 1: -0.2 (s1), 0.0 (s2) -> mean -0.1.  Over the 4 pairs: mean +0.05, sample sd
    # sqrt((0.05^2 + 0.25^2 + 0.25^2 + 0.05^2) / 3) = 0.20817, SE 0.10408; ahead in 2/4.
    # Over seeds: means +0.2 and -0.1, sample sd 0.21213, SE 0.15.  A seed-1 row must not overwrite seed 0's.
    rows = [_vrow("random", 1, "s1", 0.5), _vrow("random", 1, "s2", 0.4),
            dict(_vrow("random", 1, "s1", 0.6), seed=1), dict(_vrow("random", 1, "s2", 0.3), seed=1),
            _vrow("FCL", 1, "s1", 0.6), _vrow("FCL", 1, "s2", 0.7),
            dict(_vrow("FCL", 1, "s1", 0.4), seed=1), dict(_vrow("FCL", 1, "s2", 0.3), seed=1),
            dict(_vrow("FCL", 1, "s1", 0.9), seed=2)]  # seed 2 has no random run: no pair
    (p,) = paired_against(rows, mode="local")
    assert (p["ahead"], p["pairs"], p["seeds"]) == (2, 4, 2) and p["diff_mean"] == pytest.approx(0.05)
    assert p["diff_se"] == pytest.approx(0.10408, abs=1e-5)
    assert p["by_seed"] == {"0": pytest.approx(0.2), "1": pytest.approx(-0.1)}
    assert p["seed_se"] == pytest.approx(0.15)
    assert format_paired([p]) == ("FCL minus random: N=1 +0.050 (SE 0.104) ahead in 2/4, by seed +0.200 / -0.100 "
                                  "(SE over seeds 0.150)")


def test_accuracy_verdict_uses_twice_the_binomial_standard_error():
    # a = 0.70, b = 0.60, n = 400: SE = sqrt(0.21/400 + 0.24/400) = sqrt(0.001125) = 0.03354; 2 SE = 0.0671 < 0.10
    line = accuracy_verdict("Fed-MAE", 0.70, "ViT scratch", 0.60, 400)
    assert line == ("Fed-MAE vs ViT scratch: test accuracy +0.100 (2 x binomial SE 0.067, 400 test images, one seed) "
                    "-> pre-training helped")
    # n = 100: 2 SE = 0.134 > 0.10 -> within the spread; reversed -> still within; a large loss -> hurt
    assert accuracy_verdict("A", 0.70, "B", 0.60, 100).endswith("within the spread (no clear effect)")
    assert accuracy_verdict("A", 0.60, "B", 0.70, 100).endswith("within the spread (no clear effect)")
    assert accuracy_verdict("A", 0.50, "B", 0.90, 100).endswith("-> pre-training hurt")
    with pytest.raises(ValueError, match="n_test=0"):
        accuracy_verdict("A", 0.5, "B", 0.5, 0)
    with pytest.raises(ValueError, match=r"accuracy of A=1\.5"):
        accuracy_verdict("A", 1.5, "B", 0.5, 10)
