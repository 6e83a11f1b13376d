"""fedssl.eval.feddra_report and FedDRA's paper tables (typed from the paper's Tables 2 and 3)."""

import csv
import json
import math
import os

import numpy as np
import pytest

from fedssl.eval.feddra_report import (
    cosine_per_turn_png,
    cosine_series,
    format_table3,
    lambda_series,
    lambda_trajectory_png,
    write_summary,
)
from fedssl.eval.paper_tables import (
    FEDDRA_TABLE2_COLUMNS,
    FEDDRA_TABLE2_CONVIRT,
    FEDDRA_TABLE3,
    FEDDRA_TABLE3_COLUMNS,
    feddra_paper_rows,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("key, column, value", [
    ((False, True, True), "Covid (cls.) 1%", 83.0),  # row 1: two-stage off
    ((False, True, True), "Wst.@5", 68.1),
    ((True, False, True), "RSNA (cls.) 10%", 88.6),  # row 2: global constraint off
    ((True, True, False), "Rec.@1", 29.7),  # row 3: DRO off
    ((True, True, False), "Wst.@1", 25.6),
    ((True, True, True), "Rec.@5", 73.2),  # full method
])
def test_table3_typed_from_the_paper(key, column, value):
    assert FEDDRA_TABLE3[key][FEDDRA_TABLE3_COLUMNS.index(column)] == value


def test_table3_column_order_as_printed_and_full_row_is_table2_fedrda():
    assert FEDDRA_TABLE3_COLUMNS[:4] == ("Covid (cls.) 1%", "Covid (cls.) 10%", "RSNA (cls.) 1%", "RSNA (cls.) 10%")
    assert FEDDRA_TABLE2_COLUMNS[:4] == ("RSNA (cls.) 1%", "RSNA (cls.) 10%", "Covid (cls.) 1%", "Covid (cls.) 10%")
    full, t2 = FEDDRA_TABLE3[(True, True, True)], FEDDRA_TABLE2_CONVIRT["FedDRA (Ours)"]
    assert full == t2[:4] + t2[6:]  # same numbers in the same positions: Table 3's header swaps RSNA/Covid
    assert all(len(v) == 8 for v in FEDDRA_TABLE3.values())
    assert all(len(v) == 10 for v in FEDDRA_TABLE2_CONVIRT.values())


@pytest.mark.parametrize("method, column, value", [
    ("FedEMA", "Wst.@1", 21.9),
    ("FedEMA", "Covid (cls.) 10%", 86.5),
    ("FedMOON", "Covid (cls.) 10%", 89.2),
    ("FedAvg", "Rec.@1", 28.8),
    ("FedAvg", "RSNA (cls.) 1%", 83.1),
    ("FedDRA (Ours)", "RSNA (seg.) 10%", 74.1),
])
def test_table2_convirt_typed_from_the_paper(method, column, value):
    (row,) = [r for r in feddra_paper_rows(2) if r["method"] == method and r["column"] == column]
    assert row["mean"] == value and row["std"] is None


def test_paper_rows_table3_names():
    rows = feddra_paper_rows(3)
    assert len(rows) == 32
    (cell,) = [r for r in rows if r["method"] == "two-stage on, anchor on, DRO off" and r["column"] == "Wst.@5"]
    assert cell["mean"] == 67.3
    with pytest.raises(ValueError, match="use 2"):
        feddra_paper_rows(4)


ROWS = [
    {"variant": "full", "two_stage": True, "anchor": True, "dro": True, "rsna_1%": [0.80, 0.82], "avg_R@1": 0.302,
     "worst_R@5": np.float64(0.689)},
    {"variant": "no DRO", "two_stage": True, "anchor": True, "dro": False, "covidx_10%": None},
]


def test_format_table3_ours_then_paper():
    text = format_table3(ROWS)
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("| Variant"))
    assert header == ("| Variant | Two-stage | Anchor (global constraint) | DRO | RSNA cls 1% | RSNA cls 10% | "
                      "COVIDx cls 1% | COVIDx cls 10% | R@1 | R@5 | Worst R@1 | Worst R@5 |")
    assert "| full | ✓ | ✓ | ✓ | 81.0 ± 1.0 | - | - | - | 30.2 | - | - | 68.9 |" in lines
    assert "| no DRO | ✓ | ✓ |  | - | - | - | - | - | - | - | - |" in lines
    ours_end = lines.index("| no DRO | ✓ | ✓ |  | - | - | - | - | - | - | - | - |")
    paper_part = "\n".join(lines[ours_end + 1:])
    assert "Paper's numbers, not ours" in paper_part and "TMLR" in paper_part
    assert "| Two-stage | Global Constraint | DRO-Weighing | Covid (cls.) 1% |" in paper_part
    assert "|  | ✓ | ✓ | 83.0 | 83.4 | 80.5 | 89.6 | 29.4 | 72.7 | 26.2 | 68.1 |" in paper_part
    assert "| ✓ | ✓ | ✓ | 83.2 | 83.7 | 81.0 | 90.3 | 30.2 | 73.2 | 27.0 | 68.9 |" in paper_part
    assert "Note:" in paper_part
    assert "Paper's numbers" not in format_table3(ROWS, paper=False)


@pytest.mark.parametrize("rows", [
    [],
    [{"variant": "x", "two_stage": True, "anchor": True}],  # no 'dro'
    [{"variant": "x", "two_stage": True, "anchor": True, "dro": True, "avg_R@1": 30.2}],  # % instead of fraction
    [{"variant": "x", "two_stage": True, "anchor": True, "dro": True, "avg_R@1": [0.3, float("nan")]}],
])
def test_format_table3_rejects_bad_rows(rows):
    with pytest.raises(ValueError, match="argument rows="):
        format_table3(rows)


TRAJ = [
    {"turn": 2, "lambda": {"a": 0.7, "b": 0.3}},
    {"turn": 1, "lambda": {"a": 0.5, "b": 0.5}},
    {"turn": 3, "lambda": {"a": 0.2, "b": 0.3, "c": 0.5}},
]


def test_lambda_series_sorted_with_gaps():
    turns, sites, values = lambda_series(TRAJ)
    assert turns == [1, 2, 3] and sites == ["a", "b", "c"]
    np.testing.assert_array_equal(values[:, :2], [[0.5, 0.5], [0.7, 0.3], [0.2, 0.3]])
    assert math.isnan(values[0, 2]) and math.isnan(values[1, 2]) and values[2, 2] == 0.5


def test_lambda_trajectory_png(tmp_path):
    path = lambda_trajectory_png(TRAJ, tmp_path / "lambda.png", "FedDRA lambda")
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC
    with pytest.raises(ValueError, match="argument trajectory="):
        lambda_trajectory_png([{"turn": 1, "lambda": {"a": float("inf")}}], tmp_path / "x.png", "")
    with pytest.raises(ValueError, match="argument trajectory="):
        lambda_trajectory_png([{"turn": 1, "lambda": {"a": 1.0}}] * 2, tmp_path / "x.png", "")


RECORDS = [
    {"turn": 2, "method": "FedDRA", "matched": 0.6, "unmatched": 0.1},
    {"turn": 1, "method": "FedDRA", "matched": 0.4, "unmatched": 0.2},
    {"turn": 1, "method": "FedAvg", "site": "c1", "matched": 0.3, "unmatched": 0.25},
]


def test_cosine_series_and_png(tmp_path):
    s = cosine_series(RECORDS)
    assert s == {"FedDRA": {"turn": [1, 2], "matched": [0.4, 0.6], "unmatched": [0.2, 0.1]},
                 "FedAvg / c1": {"turn": [1], "matched": [0.3], "unmatched": [0.25]}}
    path = cosine_per_turn_png(RECORDS, tmp_path / "cos.png", "Fig. 4(d)")
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC
    with pytest.raises(ValueError, match="argument records="):
        cosine_per_turn_png([{"turn": 1, "method": "m", "matched": 0.1}], tmp_path / "x.png", "")


def test_write_summary_json_and_flat_csv(tmp_path):
    summary = {"full": {"avg_R@1": np.float64(0.3), "per_seed": [0.2, 0.4]}, "n_clients": 5}
    paths = write_summary(tmp_path / "out", summary)
    with open(paths["json"]) as f:
        assert json.load(f) == {"full": {"avg_R@1": 0.3, "per_seed": [0.2, 0.4]}, "n_clients": 5}
    with open(paths["csv"], newline="") as f:
        assert list(csv.reader(f)) == [["key", "value"], ["full.avg_R@1", "0.3"], ["full.per_seed", "[0.2, 0.4]"],
                                       ["n_clients", "5"]]


def test_variant_stats_and_figure_by_hand(tmp_path):
    """R@1 0.10 / 0.20 / 0.30 over three seeds: mean 20 %, SE 10 / sqrt(3); one seed: no error bar; a variant with
    no row is left out and no row at all is refused."""
    from fedssl.eval.feddra_report import VARIANT_METRICS, variant_stats, variants_png

    rows = [{"variant": "fedavg", "seed": s, "avg_R@1": r, "worst_R@1": r / 2, "avg_R@5": 0.5, "worst_R@5": None}
            for s, r in ((0, 0.1), (1, 0.2), (2, 0.3))]
    rows.append({"variant": "feddra", "seed": 0, "avg_R@1": 0.4, "worst_R@1": 0.2, "avg_R@5": 0.6, "worst_R@5": 0.3})
    stats = variant_stats(rows, ["feddra", "no_dro", "fedavg"])
    assert list(stats) == ["feddra", "fedavg"] and set(stats["fedavg"]) == {k for k, _ in VARIANT_METRICS}
    assert stats["fedavg"]["avg_R@1"]["values"] == pytest.approx([10.0, 20.0, 30.0])
    assert stats["fedavg"]["avg_R@1"]["mean"] == pytest.approx(20.0)
    assert stats["fedavg"]["avg_R@1"]["se"] == pytest.approx(10.0 / 3 ** 0.5)
    assert stats["fedavg"]["worst_R@5"] == {"values": [], "mean": None, "se": None}
    assert stats["feddra"]["worst_R@1"] == {"values": [pytest.approx(20.0)], "mean": pytest.approx(20.0), "se": None}
    path = variants_png(rows, ["fedavg", "feddra"], tmp_path / "recall.png", "t")
    assert os.path.getsize(path) > 1000
    with pytest.raises(ValueError, match="rows"):
        variants_png(rows, ["no_dro"], tmp_path / "none.png")
