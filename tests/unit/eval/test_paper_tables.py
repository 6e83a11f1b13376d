"""fedssl.eval.paper_tables: values pinned from the papers' text (FCL Tables 1-3; SSL-FL Tables II, VII)."""

import pytest

from fedssl.eval.paper_tables import (
    FCL_METHODS,
    FCL_N,
    FCL_TABLES,
    SSLFL_METHODS,
    SSLFL_TABLE_II,
    SSLFL_TABLE_VII,
    fcl_paper_rows,
    sslfl_paper_rows,
)


def _cell(rows, method, column):
    (row,) = [r for r in rows if r["method"] == method and r["column"] == column]
    return row["mean"], row["std"]


@pytest.mark.parametrize("table, method, n, expected", [
    (1, "random", 1, (0.280, 0.037)),  # FCL Table 1, Random init, N=1
    (1, "random", 8, (0.766, 0.027)),
    (1, "Local CL", 1, (0.320, 0.106)),
    (1, "FCLOpt-PTNU-DP", 4, (0.729, 0.016)),  # paper row "FCL-PTNU-DP"
    (2, "FCLOpt", 1, (0.769, 0.025)),  # FCL Table 2
    (2, "FedMoCo", 2, (0.675, 0.053)),
    (3, "FCL", 1, (0.575, 0.113)),  # FCL Table 3
    (3, "FedBYOL", 8, (0.805, 0.021)),
    (1, "FedRotation", 1, (0.357, 0.058)),  # sec. 5 "Baselines", Rotation (Gidaris et al., 2018) with FedAvg
    (1, "FedSimCLR", 8, (0.765, 0.033)),
    (2, "FedRotation", 2, (0.627, 0.074)),
    (2, "FedSimCLR", 4, (0.788, 0.014)),
    (3, "FedRotation", 4, (0.686, 0.056)),
    (3, "FedSimCLR", 1, (0.287, 0.030)),
])
def test_fcl_values_typed_from_the_paper(table, method, n, expected):
    assert _cell(fcl_paper_rows(table), method, f"N={n}") == expected


def test_every_fcl_method_has_all_four_n_in_every_table():
    assert set(FCL_METHODS.values()) == set(FCL_TABLES[1]) == set(FCL_TABLES[2]) == set(FCL_TABLES[3])
    for table in (1, 2, 3):
        for name, values in FCL_TABLES[table].items():
            assert len(values) == len(FCL_N) == 4, (table, name)
        assert len(fcl_paper_rows(table)) == 10 * 4


def test_sslfl_values_typed_from_the_paper():
    assert _cell(sslfl_paper_rows("II"), "Fed-MAE", "Split3") == (77.43, None)
    assert _cell(sslfl_paper_rows("II"), "scratch", "Central") == (73.70, None)  # row "None"
    assert _cell(sslfl_paper_rows("II"), "Fed-BEiT", "Split2") == (76.80, None)
    assert _cell(sslfl_paper_rows("VII"), "scratch", "10%") == (52.23, None)  # row "Rand. init."
    assert _cell(sslfl_paper_rows("VII"), "Fed-MAE", "100%") == (81.67, None)
    # the 100 % column of Table VII is Table II's Split1 column (same setting)
    for method, name in SSLFL_METHODS.items():
        vii = SSLFL_TABLE_VII["Rand. init." if method == "scratch" else name]
        assert vii[-1] == SSLFL_TABLE_II[name][1]


def test_unknown_table_method_or_n_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"use one of \[1, 2, 3\]"):
        fcl_paper_rows(4)
    with pytest.raises(ValueError, match="FedU"):
        fcl_paper_rows(1, ["FedU"])
    with pytest.raises(ValueError, match="N=3"):
        fcl_paper_rows(1, n_labelled=[3])
    with pytest.raises(ValueError, match="'II' or 'VII'"):
        sslfl_paper_rows("III")


def test_fedclf_tables_as_typed_from_the_paper():
    from fedssl.eval.paper_tables import fedclf_paper_rows

    rows = {(r["method"], r["column"]): r["mean"] for r in fedclf_paper_rows("II")}
    assert rows[("Random Init.", "L=10%")] == 43.15 and rows[("FedCLF", "L=80%")] == 59.23
    prec = {(r["method"], r["column"]): r["mean"] for r in fedclf_paper_rows("I", "precision", ["FedSimCLR"])}
    assert prec == {("FedSimCLR", "L=10%"): 31.25, ("FedSimCLR", "L=20%"): 31.67, ("FedSimCLR", "L=40%"): 33.09,
                    ("FedSimCLR", "L=80%"): 33.85}
    # the text's claims check out against the typed tables: FedCLF beats the best baseline by 2.14 recall at 10 %
    assert round(rows[("FedCLF", "L=10%")] - rows[("FedSimCLR", "L=10%")], 2) == 2.14
    assert [r["mean"] for r in fedclf_paper_rows("Fig6")] == [44.72, 47.45, 48.03]
    with pytest.raises(ValueError, match="recall only"):
        fedclf_paper_rows("Fig6", "precision")
    with pytest.raises(ValueError, match="not rows of FedCLF Table I"):
        fedclf_paper_rows("I", methods=["FedMoCo"])


def test_fedmae_table3_as_typed_from_the_paper():
    from fedssl.eval.paper_tables import fedmae_table3_rows

    rows = {(r["method"], r["column"]): r["mean"] for r in fedmae_table3_rows()}
    assert len(rows) == 8 * 6
    assert rows[("CNN: Random Init.", "Recall")] == 32.65 and rows[("CNN: FedCLF", "Precision")] == 44.23
    assert rows[("CNN: FedMoCo", "Specificity")] == 93.02 and rows[("ViT: Random Init.", "AUC")] == 77.42
    assert rows[("ViT: FedMAE", "Accuracy")] == 64.80 and rows[("CNN: FedSimCLR", "F1")] == 37.09
    # the text's claims: FedMAE beats the best CNN baseline FedSimCLR by +5.67 F1 and +3.64 AUC
    assert round(rows[("ViT: FedMAE", "F1")] - rows[("CNN: FedSimCLR", "F1")], 2) == 5.67
    assert round(rows[("ViT: FedMAE", "AUC")] - rows[("CNN: FedSimCLR", "AUC")], 2) == 3.64
    assert {r["method"] for r in fedmae_table3_rows([("ViT", "FedMAE")])} == {"ViT: FedMAE"}
    with pytest.raises(ValueError, match="not rows of Table III"):
        fedmae_table3_rows([("ViT", "FedCLF")])
