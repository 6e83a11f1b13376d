"""FedDRA's demo / Table 3 runner: the variants' job switches, the rows and verdicts by hand, and a resumed run of
the in-process baselines (no simulator)."""

import json
import os

import pytest

from fedssl.experiments import feddra_demo as fd
from fedssl.ops.jobs import build_job

TINY = dict(preset="tiny", n_patients=40, image_px=32, vocab_size=256, turns=1, steps=1, batch_size=4, ood_images=24,
            seg_epochs=2, seg_decoder_channels=[8, 8, 8],
            n_clients=2)


#: the paper's Table 3 rows and FedAvg, typed independently of the module: (two-stage, mu, DRO)
EXPECTED = {"fedavg": (False, 0.0, False), "no_two_stage": (False, 5.0, True), "no_anchor": (True, 0.0, True),
            "no_dro": (True, 5.0, False), "feddra": (True, 5.0, True)}


@pytest.mark.parametrize("variant", sorted(EXPECTED))
def test_each_variant_sets_the_table3_switches_on_the_job(variant, tmp_path):
    settings = {**fd.DEMO, **TINY}
    job = build_job(fd.JOB, str(tmp_path / "job"), profile="quick", sets=fd.switch_sets(variant, settings, seed=3),
                    n_sites=2)
    server = json.load(open(os.path.join(job, "app", "config", "config_fed_server.json")))
    client = json.load(open(os.path.join(job, "app", "config", "config_fed_client.json")))
    ctrl = next(w for w in server["workflows"] if w["id"] == "scatter_and_gather")["args"]
    site = client["executors"][0]["executor"]["args"]
    assert (ctrl["two_stage"], site["mu"], ctrl["dro"]) == EXPECTED[variant]
    assert site["seed"] == 3 and site["preset"] == "tiny" and ctrl["num_rounds"] == 1


def test_rows_and_the_paired_verdict_by_hand():
    cell = {"variant": "feddra", "seed": 0, "clients": {"a": {"R@1": 0.2, "R@5": 0.6}, "b": {"R@1": 0.1, "R@5": 0.5}},
            "probe": {"rsna": {"1%": {"accuracy": 0.7, "auroc": 0.8}},
                      "rsna_seg": {"1%": {"dice": 0.55, "dice_positive": 0.25}}},
            "lambda": [{"turn": 0, "lambda": {"a": 0.6, "b": 0.4}}], "wall_time_s": 1.0}
    row = fd.cell_row(cell)
    assert row["rsna_seg_1%_dice"] == 0.55 and row["rsna_seg_1%_dice_pos"] == 0.25 and "rsna_seg_1%_acc" not in row
    assert "rsna_seg_1%_dice" in fd.format_results([row], ["feddra"]).splitlines()[0]  # a column of the table
    assert row["avg_R@1"] == pytest.approx(0.15) and row["worst_R@1"] == 0.1 and row["worst_R@5"] == 0.5
    assert row["rsna_1%_acc"] == 0.7 and row["lambda_max"] == 0.6
    assert row["lambda_chi2"] == pytest.approx(((1.2 - 1) ** 2 + (0.8 - 1) ** 2) / 2 / 2)
    rows = [{"variant": "feddra", "seed": s, "worst_R@1": w} for s, w in ((0, 0.3), (1, 0.2), (2, 0.4))]
    rows += [{"variant": "fedavg", "seed": s, "worst_R@1": w} for s, w in ((0, 0.1), (1, 0.2), (2, 0.3))]
    v = fd.paired_worst(rows, "feddra", "fedavg")
    assert v["diff"] == pytest.approx(0.1) and v["n"] == 3 and v["std"] == pytest.approx(0.0816, abs=1e-3)
    assert v["beyond_spread"] is True
    # differences 0.2 / 0.0 / 0.1: sample std 0.1, SE 0.1 / sqrt(3)
    assert v["by_seed"] == {0: pytest.approx(0.2), 1: pytest.approx(0.0), 2: pytest.approx(0.1)}
    assert v["se"] == pytest.approx(0.1 / 3 ** 0.5)
    assert fd.paired_worst(rows[:1] + rows[3:4], "feddra", "fedavg")["se"] is None


def test_the_baselines_run_and_a_rerun_resumes(tmp_path, monkeypatch):
    out = str(tmp_path / "run")
    report = fd.run(out, variants=["decentralised", "centralised"], seeds=[0], settings=TINY)
    assert [r["variant"] for r in report["rows"]] == ["decentralised", "centralised"]
    for cell in report["cells"]:
        assert sorted(cell["clients"]) == ["site-1", "site-2"]
        assert all(0 <= m["R@1"] <= m["R@5"] <= 1 for m in cell["clients"].values())
        assert set(cell["probe"]) == {"rsna", "covidx", "rsna_seg"}
        seg = cell["probe"].pop("rsna_seg")  # Dice of the U-Net decoder per fraction
        assert set(seg) == {"1%", "10%"} and all(0 <= v["dice"] <= 1 for v in seg.values())
        for per in cell["probe"].values():  # the probe and the paper's fine-tuned linear layer, per fraction
            probes = {k for k in per if not k.endswith("_ft")}
            assert probes and {f"{k}_ft" for k in probes} == set(per) - probes
            assert all(0 <= per[f"{k}_ft"]["accuracy"] <= 1 for k in probes)
    assert all(any(k.endswith("_ft_acc") for k in row) for row in report["rows"])
    assert all("rsna_seg_10%_dice" in row for row in report["rows"])
    monkeypatch.setattr(fd, "run_local", lambda *a, **k: pytest.fail("a finished cell was run again"))
    again = fd.run(out, variants=["decentralised", "centralised"], seeds=[0], settings=TINY)
    assert again["rows"] == report["rows"]
    assert os.path.isfile(os.path.join(out, "results.md")) and os.path.isfile(os.path.join(out, "results.json"))


def _fake_cell(key, data, out, settings):
    """A finished cell without training: FedDRA's worst client 10 points above FedAvg's at every seed."""
    r1 = 0.2 + (0.1 if key["variant"] == "feddra" else 0.0) + 0.01 * key["seed"]
    return {"variant": key["variant"], "seed": key["seed"], "clients": {"site-1": {"R@1": r1, "R@5": 0.6},
                                                                        "site-2": {"R@1": 0.5, "R@5": 0.9}},
            "probe": {}, "lambda": [], "cosine_per_turn": [], "wall_time_s": 1.0}


def test_three_seeds_by_default_and_fewer_say_the_comparison_is_not_a_finding(tmp_path, monkeypatch):
    monkeypatch.setattr(fd, "run_federated", _fake_cell)
    (tmp_path / "data").mkdir()
    report = fd.run(str(tmp_path / "one"), seeds=[0], settings=TINY, data_root=str(tmp_path / "data"))
    note = ("one seed (0): not a finding; run fedssl feddra table --seeds 0 1 2 (a method's sign can change from one "
            "seed to the next)")
    assert report["seeds_note"] == note and note in open(tmp_path / "one" / "results.md").read()
    assert json.load(open(tmp_path / "one" / "results.json"))["seeds_note"] == note
    report = fd.run(str(tmp_path / "three"), settings=TINY, data_root=str(tmp_path / "data"))  # the runner's default
    assert [(r["variant"], r["seed"]) for r in report["rows"]] == [
        (v, s) for s in (0, 1, 2) for v in ("fedavg", "feddra")]
    assert report["seeds_note"] is None and "not a finding" not in open(tmp_path / "three" / "results.md").read()
    config = json.load(open(tmp_path / "three" / "run_config.json"))
    assert config["threads"] == 1 and config["environments"][0]["threads"] == 1


def test_cli_table_defaults_to_three_seeds_and_the_demo_to_its_one(monkeypatch, tmp_path):
    from fedssl.cli import main

    seen = {}
    monkeypatch.setattr(fd, "run", lambda out, **kw: seen.update(kw))
    assert main(["feddra", "table", "--out", str(tmp_path)]) == 0
    assert seen["seeds"] == [0, 1, 2] and seen["threads"] == 1
    assert main(["feddra", "demo", "--out", str(tmp_path), "--seed", "4", "--threads", "2"]) == 0
    assert seen["seeds"] == [4] and seen["threads"] == 2


def test_the_worst_client_gap_is_shown_beside_the_gap_alike_clients_would_show():
    """With the clients' test-set sizes kept (``n_pairs``), each row carries the floor of its recall and the table
    prints the measured mean-minus-worst gap next to it; cells without sizes (earlier runs) get neither."""
    clients = {"a": {"R@1": 0.5, "R@5": 1.0, "n_pairs": 2}, "b": {"R@1": 0.5, "R@5": 1.0, "n_pairs": 2}}
    cell = {"variant": "fedavg", "seed": 0, "clients": clients, "probe": {}, "lambda": [], "wall_time_s": 1.0}
    row = fd.cell_row(cell)
    assert row["floor_R@1"] == pytest.approx(3 / 16) and row["floor_R@5"] == pytest.approx(0.0)
    other = fd.cell_row({**cell, "seed": 1, "clients": {"a": {**clients["a"], "R@1": 0.25},
                                                         "b": {**clients["b"], "R@1": 0.75}}})
    assert other["floor_R@1"] == pytest.approx(3 / 16)  # the floor of the mean recall, 0.5 again
    text = fd.format_results([row, other], ["fedavg"])
    # measured gap: 0 at seed 0, 0.25 at seed 1 -> 12.5 points on average; the floor 18.75 -> 18.8
    assert text.splitlines()[-1] == ("fedavg: mean minus worst client, measured vs alike clients on these test "
                                     "sets (points): R@1 12.5 vs 18.8; R@5 0.0 vs 0.0")
    bare = {**cell, "clients": {s: {k: v for k, v in m.items() if k != "n_pairs"} for s, m in clients.items()}}
    assert "floor_R@1" not in fd.cell_row(bare) and "alike" not in fd.format_results([fd.cell_row(bare)], ["fedavg"])
    huge = {**cell, "clients": {s: {**m, "n_pairs": 10 ** 9} for s, m in clients.items()}}  # a site's claim
    assert "floor_R@1" not in fd.cell_row(huge)
    boolean = {**cell, "clients": {s: {**m, "n_pairs": True} for s, m in clients.items()}}  # not a count
    assert "floor_R@1" not in fd.cell_row(boolean)


def test_the_per_client_table_names_each_clients_test_pairs():
    """Each client ranks over its own test set, so its size is printed beside its name (earlier cells lack it)."""
    cells = [{"variant": "fedavg", "seed": 0, "lambda": [],
              "clients": {"site-1": {"R@1": 0.1, "R@5": 0.5, "n_pairs": 51}, "site-2": {"R@1": 0.2, "R@5": 0.6}}}]
    lines = fd.per_client_lines(cells, 0)
    assert lines[1] == "| variant | site-1 (51 pairs) | site-2 |"
    assert lines[3] == "| fedavg | 10.0 / 50.0 | 20.0 / 60.0 |"
    # chance: 51 pairs ranked in one gallery (the default batch of 100 is cut to the pairs): 1/51 and 5/51
    assert lines[4] == "| chance | 2.0 / 9.8 | n/a |"


def test_clients_at_chance_are_named_with_their_seeds():
    """338 pairs in batches of 100: chance 4/338 at R@1 and 20/338 at R@5 (FedDRA's site-3 at 25 turns); the 2-SE
    band at R@1 is 1.18 + 2 x 0.59 = 2.36 %, at R@5 5.92 + 2 x 1.28 = 8.49 %."""
    def cell(seed, r1, r5, batch=100):
        return {"variant": "fedavg", "seed": seed, "lambda": [], "clients": {
            "site-1": {"R@1": 0.2, "R@5": 0.5, "n_pairs": 313},
            "site-3": {"R@1": r1, "R@5": r5, "n_pairs": 338, "retrieval_batch": batch}}}
    assert fd.at_chance_lines([cell(0, 4 / 338, 20 / 338), cell(1, 0.023, 0.084)]) == [
        "clients at chance (R@1 and R@5 within 2 binomial SE of it): fedavg: site-3 (seeds 0, 1)"]
    assert fd.at_chance_lines([cell(0, 0.025, 0.05)]) == []  # R@1 above the band
    assert fd.at_chance_lines([cell(0, 0.01, 0.09)]) == []  # R@5 above the band
    # ranked in one gallery of 338 the chance level is far lower, and 1.2 % R@1 is above its band
    assert fd.at_chance_lines([cell(0, 4 / 338, 20 / 338, batch=338)]) == []
    huge = cell(0, 0.0, 0.0)
    huge["clients"]["site-3"]["n_pairs"] = 10 ** 9  # a site's claim is bounded, not looped over
    assert fd.at_chance_lines([huge]) == []


def test_device_ceilings_for_a_client_of_one_finding_code(monkeypatch):
    from fedssl.data.vlp import VLPRecord
    from fedssl.data.vlp_synthetic import DEVICE_SENTENCES

    ett = DEVICE_SENTENCES["endotracheal tube"]

    def rec(i, labels, text):
        return VLPRecord(image=f"/x/{i}.jpg", text=text, labels=labels, patient=str(i), study=str(i), split="test")

    normal = (0, 0, 0, 0, 0)
    clients = {"site-1": ([], [rec(0, normal, ett), rec(1, normal, f"Heart normal. {ett}"), rec(2, normal, "Clear."),
                               rec(3, normal, "No acute process.")]),
               "site-2": ([], [rec(4, normal, ett), rec(5, (1, 0, 0, 0, 0), "Clear.")])}
    monkeypatch.setattr(fd, "client_records", lambda data: clients)
    got = fd.device_ceilings("unused", {"style_coupling": 1.0})
    # site-1: two pairs name the tube, two nothing: each text's image ranks among 2 alike -> R@1 1/2, R@5 1
    assert got == {"site-1": {"n_pairs": 4, "with_devices": 2, "R@1": 0.5, "R@5": 1.0}}
    assert fd.ceiling_lines(got) == ["site-1: all 4 test pairs carry one finding code and the style follows it; 2 show "
                                     "a line or tube. Seeing only those, no model retrieves above R@1 50.0 / R@5 "
                                     "100.0 % there (in expectation)"]
    assert fd.device_ceilings("unused", {"style_coupling": 0.7}) == {}  # the style is then shared too
