"""The papers' published numbers that the bundle's table runners print beside their own, typed from the papers.

- FCL: Y. Wu, D. Zeng, Z. Wang, Y. Shi, J. Hu, "Distributed contrastive learning for medical image segmentation",
  Medical Image Analysis 2022 (FCL / FCLOpt).  Tables 1 (local fine-tuning), 2 (federated fine-tuning) and 3
  (centralised fine-tuning) on ACDC: Dice (mean of LV, MYO, RV), mean +- std; Tables 1 and 2 over the 10 clients
  (each client's Dice averaged over the 5 folds), Table 3 over folds.  Columns N = 1, 2, 4, 8 annotated patients
  (per client in Tables 1-2, in total in Table 3).  Only the methods the bundle runs are kept; the paper's row
  names are the keys, :data:`FCL_METHODS` maps the bundle's labels to them.
- SSL-FL: R. Yan, L. Qu, Q. Wei, S.-C. Huang, L. Shen, D. Rubin, L. Xing, Y. Zhou, "Label-Efficient
  Self-Supervised Federated Learning for Tackling Data Heterogeneity in Medical Imaging", IEEE Transactions on
  Medical Imaging 2023.  Table II: test accuracy (%) of federated fine-tuning on Retina, columns Central,
  Split1-3 (rows None = ViT from scratch, Fed-BEiT, Fed-MAE); Table VII: Retina Split-1 with 10 / 30 / 70 / 100 %
  of the labels.  The paper gives no standard deviations there (std None).
- FedCLF: Y. Wu, D. Zeng, Z. Wang, Y. Sheng, L. Yang, A. J. James, Y. Shi, J. Hu, "Federated Self-Supervised
  Learning for Dermatological Disease Diagnosis" (journal extension of the ICCAD 2021 paper).  Tables I (local
  fine-tuning) and II (federated fine-tuning): mean recall and mean precision (%) over the 10 devices' test sets,
  columns L = 10 / 20 / 40 / 80 % labels per device; Fig. 6 (ablation, federated fine-tuning at L = 10 %): mean
  recall W/o FE 44.72, FE 47.45, FE+Neg 48.03 (the text gives recall only).  No standard deviations.
- FedDRA: Z. Shuai, C. Wu, Z. Tang, L. Shen, "Distributionally Robust Alignment for Medical Federated
  Vision-Language Pre-training Under Data Heterogeneity", TMLR.  Table 2 (ConVIRT rows) and Table 3 (ablations,
  ConVIRT): few-shot linear-layer classification accuracy (%) with 1 % / 10 % of the training set, RSNA
  segmentation Dice (%, Table 2 only), in-domain text-to-image retrieval recall (%) averaged over clients (Rec.@k)
  and of the worst client (Wst.@k).  No standard deviations.  Column order as printed: Table 2 is RSNA then Covid,
  Table 3's header is Covid then RSNA -- but Table 3's full-method row (83.2 83.7 81.0 90.3) is Table 2's FedDRA
  ConVIRT row in Table 2's order (RSNA 83.2 83.7, Covid 81.0 90.3), as are Tables 7-9's FedDRA rows, so Table 3's
  first pair is most likely RSNA (header swapped in the paper).  Kept here as printed; see
  :data:`FEDDRA_TABLE3_NOTE`.
"""

from __future__ import annotations

#: bundle label -> FCL paper row name (Tables 1-3); the bundle's "FCLOpt-PTNU(-DP)" are the paper's "FCL-PTNU(-DP)"
#: (the PTNU variants are built on FCLOpt, FCL sec. 4)
FCL_METHODS = {
    "random": "Random init",
    "Local CL": "Local CL",
    "FedRotation": "FedRotation",
    "FedSimCLR": "FedSimCLR",
    "FedMoCo": "FedMoCo",
    "FedBYOL": "FedBYOL",
    "FCL": "FCL",
    "FCLOpt": "FCLOpt",
    "FCLOpt-PTNU": "FCL-PTNU",
    "FCLOpt-PTNU-DP": "FCL-PTNU-DP",
}
FCL_N = (1, 2, 4, 8)
FCL_SOURCE = "FCL, Wu et al., MedIA 2022, Table {table}"
FCL_TABLE_MODES = {1: "local", 2: "federated", 3: "centralised"}

#: table -> paper row name -> ((mean, std) at N = 1, 2, 4, 8)
FCL_TABLES: dict[int, dict[str, tuple[tuple[float, float], ...]]] = {
    1: {  # local fine-tuning, mean +- std over 10 clients
        "Random init": ((0.280, 0.037), (0.414, 0.070), (0.618, 0.026), (0.766, 0.027)),
        "Local CL": ((0.320, 0.106), (0.456, 0.095), (0.637, 0.043), (0.770, 0.029)),
        "FedRotation": ((0.357, 0.058), (0.508, 0.054), (0.660, 0.021), (0.783, 0.029)),
        "FedSimCLR": ((0.288, 0.049), (0.435, 0.046), (0.619, 0.032), (0.765, 0.033)),
        "FedMoCo": ((0.287, 0.056), (0.442, 0.066), (0.626, 0.034), (0.767, 0.030)),
        "FedBYOL": ((0.431, 0.057), (0.554, 0.052), (0.685, 0.021), (0.781, 0.027)),
        "FCL": ((0.506, 0.056), (0.631, 0.051), (0.745, 0.017), (0.824, 0.025)),
        "FCLOpt": ((0.524, 0.052), (0.655, 0.039), (0.745, 0.020), (0.821, 0.020)),
        "FCL-PTNU": ((0.517, 0.061), (0.622, 0.045), (0.730, 0.019), (0.810, 0.022)),
        "FCL-PTNU-DP": ((0.512, 0.053), (0.621, 0.050), (0.729, 0.016), (0.810, 0.027)),
    },
    2: {  # federated fine-tuning, N per client (L = 10 N in total)
        "Random init": ((0.445, 0.012), (0.572, 0.061), (0.764, 0.017), (0.834, 0.011)),
        "Local CL": ((0.473, 0.013), (0.717, 0.024), (0.784, 0.015), (0.847, 0.009)),
        "FedRotation": ((0.516, 0.015), (0.627, 0.074), (0.821, 0.015), (0.867, 0.010)),
        "FedSimCLR": ((0.395, 0.023), (0.576, 0.046), (0.788, 0.014), (0.859, 0.011)),
        "FedMoCo": ((0.467, 0.016), (0.675, 0.053), (0.782, 0.018), (0.846, 0.011)),
        "FedBYOL": ((0.621, 0.065), (0.790, 0.011), (0.840, 0.006), (0.871, 0.006)),
        "FCL": ((0.646, 0.052), (0.824, 0.004), (0.871, 0.007), (0.894, 0.006)),
        "FCLOpt": ((0.769, 0.025), (0.853, 0.006), (0.877, 0.006), (0.897, 0.004)),
        "FCL-PTNU": ((0.680, 0.086), (0.840, 0.007), (0.868, 0.009), (0.889, 0.006)),
        "FCL-PTNU-DP": ((0.778, 0.016), (0.840, 0.002), (0.873, 0.006), (0.894, 0.004)),
    },
    3: {  # centralised fine-tuning, N in total
        "Random init": ((0.296, 0.091), (0.528, 0.064), (0.677, 0.056), (0.797, 0.028)),
        "Local CL": ((0.314, 0.058), (0.544, 0.065), (0.691, 0.040), (0.805, 0.014)),
        "FedRotation": ((0.374, 0.072), (0.583, 0.061), (0.686, 0.056), (0.815, 0.021)),
        "FedSimCLR": ((0.287, 0.030), (0.524, 0.065), (0.658, 0.037), (0.802, 0.022)),
        "FedMoCo": ((0.310, 0.068), (0.520, 0.055), (0.695, 0.045), (0.802, 0.017)),
        "FedBYOL": ((0.472, 0.073), (0.633, 0.042), (0.729, 0.039), (0.805, 0.021)),
        "FCL": ((0.575, 0.113), (0.702, 0.041), (0.790, 0.026), (0.844, 0.024)),
        "FCLOpt": ((0.587, 0.109), (0.708, 0.055), (0.785, 0.038), (0.837, 0.031)),
        "FCL-PTNU": ((0.547, 0.130), (0.691, 0.052), (0.771, 0.041), (0.837, 0.020)),
        "FCL-PTNU-DP": ((0.556, 0.132), (0.674, 0.069), (0.763, 0.055), (0.831, 0.031)),
    },
}

SSLFL_SOURCE = "SSL-FL, Yan et al., IEEE TMI 2023, Table {table}"
SSLFL_SPLITS = ("Central", "Split1", "Split2", "Split3")
#: Table II, Retina, test accuracy (%): paper row -> accuracy per column of SSLFL_SPLITS
SSLFL_TABLE_II: dict[str, tuple[float, ...]] = {
    "None": (73.70, 74.33, 69.50, 64.13),  # no pre-training: ViT from scratch
    "Fed-BEiT": (79.47, 78.40, 76.80, 76.77),
    "Fed-MAE": (81.93, 81.67, 79.40, 77.43),
}
SSLFL_FRACTIONS = (10, 30, 70, 100)
#: Table VII, Retina Split-1, test accuracy (%) at 10 / 30 / 70 / 100 % labelled samples
SSLFL_TABLE_VII: dict[str, tuple[float, ...]] = {
    "Rand. init.": (52.23, 53.37, 70.57, 74.33),
    "Fed-BEiT": (76.25, 77.03, 78.50, 78.40),
    "Fed-MAE": (76.57, 79.20, 80.93, 81.67),
}
#: bundle label -> SSL-FL paper row name (Table II; Table VII names the scratch row "Rand. init.")
SSLFL_METHODS = {"scratch": "None", "Fed-BEiT": "Fed-BEiT", "Fed-MAE": "Fed-MAE"}


FEDCLF_SOURCE = "FedCLF, Wu et al., Federated Self-Supervised Learning for Dermatological Disease Diagnosis, {table}"
FEDCLF_FRACTIONS = (10, 20, 40, 80)
#: paper row -> ((recall, precision) at L = 10, 20, 40, 80 %)
FEDCLF_TABLES: dict[str, dict[str, tuple[tuple[float, float], ...]]] = {
    "I": {
        "Random Init.": ((21.56, 17.35), (23.13, 20.79), (24.88, 23.69), (23.92, 26.06)),
        "Local CL": ((26.57, 26.54), (28.82, 28.20), (31.46, 30.49), (34.27, 30.71)),
        "FedRotation": ((23.45, 25.27), (25.05, 25.05), (29.39, 28.48), (32.87, 28.15)),
        "FedSimCLR": ((30.11, 31.25), (32.77, 31.67), (35.50, 33.09), (37.58, 33.85)),
        "FedCLF": ((30.41, 33.54), (34.41, 32.96), (37.03, 34.95), (39.25, 35.02)),
    },
    "II": {
        "Random Init.": ((43.15, 38.97), (45.63, 40.41), (50.73, 44.66), (55.61, 46.35)),
        "Local CL": ((43.41, 39.59), (45.69, 41.39), (50.35, 45.58), (55.47, 47.70)),
        "FedRotation": ((43.18, 39.57), (44.36, 40.27), (50.69, 44.10), (54.27, 46.70)),
        "FedSimCLR": ((45.89, 41.44), (48.92, 43.39), (54.17, 46.71), (58.64, 48.27)),
        "FedCLF": ((48.03, 42.87), (51.50, 45.71), (55.13, 48.73), (59.23, 50.21)),
    },
}
#: Fig. 6: federated fine-tuning at L = 10 %, mean recall (%) per ablation
FEDCLF_FIG6 = {"W/o FE": 44.72, "FE": 47.45, "FE+Neg": 48.03}


#: FedMAE-KS sec. V-B, Table III: local fine-tuning at 80 % labels on the full ISIC 2019 (8 classes, 10 random
#: partitions); (family, paper row) -> values in the order of :data:`FEDMAE_TABLE3_METRICS` (%)
FEDMAE_TABLE3_METRICS = ("Recall", "Precision", "F1", "Specificity", "AUC", "Accuracy")
FEDMAE_TABLE3: dict[tuple[str, str], tuple[float, ...]] = {
    ("CNN", "Random Init."): (32.65, 36.23, 33.93, 92.45, 74.64, 58.92),
    ("CNN", "Local CL"): (32.93, 40.87, 34.99, 92.89, 75.70, 62.51),
    ("CNN", "FedRotation"): (33.38, 33.49, 32.49, 92.45, 74.26, 59.47),
    ("CNN", "FedSimCLR"): (35.12, 40.85, 37.09, 93.01, 77.07, 62.00),
    ("CNN", "FedMoCo"): (34.36, 40.43, 36.31, 93.02, 76.93, 62.30),
    ("CNN", "FedCLF"): (37.52, 44.23, 39.80, 93.22, 77.35, 63.38),
    ("ViT", "Random Init."): (35.69, 38.15, 36.56, 92.69, 77.42, 59.70),
    ("ViT", "FedMAE"): (41.31, 45.41, 42.76, 93.63, 80.71, 64.80),
}


def fedmae_table3_rows(rows=None) -> list[dict]:
    """Table III of the FedCLF / FedMAE-KS paper as :func:`fcl_paper_rows` gives them (one row per method and metric,
    std None; the paper averages 3 runs), for ``rows`` ((family, paper row) pairs, default all)."""
    unknown = [r for r in rows or () if tuple(r) not in FEDMAE_TABLE3]
    if unknown:
        raise ValueError(f"rows {unknown} are not rows of Table III; use some of {list(FEDMAE_TABLE3)}")
    return [{"table": "Table III", "method": f"{family}: {m}", "column": metric, "mean": v[i], "std": None, "n": 3}
            for (family, m), v in FEDMAE_TABLE3.items() if rows is None or (family, m) in [tuple(r) for r in rows]
            for i, metric in enumerate(FEDMAE_TABLE3_METRICS)]


def fedclf_paper_rows(table: str, metric: str = "recall", methods=None) -> list[dict]:
    """FedCLF's Table ``"I"`` or ``"II"`` (``metric`` "recall" or "precision", %) or ``"Fig6"`` (recall at L = 10 %)
    as :func:`fcl_paper_rows` gives them (std None), for ``methods`` (paper row names, default all)."""
    if table == "Fig6":
        if metric != "recall":
            raise ValueError("FedCLF Fig. 6: the text gives mean recall only")
        return [{"table": "FedCLF Fig. 6", "method": m, "column": "L=10%", "mean": v, "std": None, "n": None}
                for m, v in FEDCLF_FIG6.items() if methods is None or m in methods]
    if table not in FEDCLF_TABLES or metric not in ("recall", "precision"):
        raise ValueError(f"FedCLF table {table!r} / metric {metric!r}: use 'I', 'II' or 'Fig6' and 'recall' or "
                         "'precision'")
    values = FEDCLF_TABLES[table]
    unknown = [m for m in methods or () if m not in values]
    if unknown:
        raise ValueError(f"methods {unknown} are not rows of FedCLF Table {table}; use some of {list(values)}")
    k = 0 if metric == "recall" else 1
    return [{"table": f"FedCLF Table {table}", "method": m, "column": f"L={f}%", "mean": v[i][k], "std": None, "n": 10}
            for m, v in values.items() if methods is None or m in methods for i, f in enumerate(FEDCLF_FRACTIONS)]


def fcl_paper_rows(table: int, methods=None, n_labelled=FCL_N) -> list[dict]:
    """The FCL paper's rows of ``table`` (1, 2 or 3) for the bundle's ``methods`` (bundle labels, default all)
    and N, in the form :func:`fedssl.experiments.table_runner.write_table` takes:
    ``{"table", "method" (bundle label), "column" ("N=1"), "mean", "std", "n"}``."""
    if table not in FCL_TABLES:
        raise ValueError(f"FCL table {table!r} has no stored numbers; use one of {sorted(FCL_TABLES)}")
    rows = []
    for method in methods if methods is not None else FCL_METHODS:
        if method not in FCL_METHODS:
            raise ValueError(f"method {method!r} is not in the FCL paper's tables; use one of {list(FCL_METHODS)}")
        values = FCL_TABLES[table][FCL_METHODS[method]]
        for n in n_labelled:
            if n not in FCL_N:
                raise ValueError(f"N={n!r} is not a column of FCL Table {table}; use one of {list(FCL_N)}")
            mean, std = values[FCL_N.index(n)]
            rows.append({"table": f"FCL Table {table}", "method": method, "column": f"N={n}", "mean": mean,
                         "std": std, "n": 10 if table in (1, 2) else 5})
    return rows


def sslfl_paper_rows(table: str, methods=None) -> list[dict]:
    """SSL-FL's Table ``"II"`` (columns Central, Split1-3) or ``"VII"`` (columns 10%, 30%, 70%, 100%) for the
    bundle's ``methods`` (labels of :data:`SSLFL_METHODS`, default all), as :func:`fcl_paper_rows` gives them
    (accuracy in %, std None)."""
    if table == "II":
        values, columns, names = SSLFL_TABLE_II, SSLFL_SPLITS, SSLFL_METHODS
    elif table == "VII":
        values, columns = SSLFL_TABLE_VII, tuple(f"{f}%" for f in SSLFL_FRACTIONS)
        names = dict(SSLFL_METHODS, scratch="Rand. init.")
    else:
        raise ValueError(f"SSL-FL table {table!r} has no stored numbers; use 'II' or 'VII'")
    rows = []
    for method in methods if methods is not None else SSLFL_METHODS:
        if method not in names:
            raise ValueError(f"method {method!r} is not in SSL-FL Table {table}; use one of {list(names)}")
        for column, value in zip(columns, values[names[method]]):
            rows.append({"table": f"SSL-FL Table {table}", "method": method, "column": column, "mean": value,
                         "std": None, "n": None})
    return rows


FEDDRA_SOURCE = ("FedDRA, Shuai, Wu, Tang & Shen, Distributionally Robust Alignment for Medical Federated "
                 "Vision-Language Pre-training Under Data Heterogeneity, TMLR, Table {table}")
#: Table 2's columns in the paper's order (%): few-shot classification, segmentation Dice, retrieval
FEDDRA_TABLE2_COLUMNS = ("RSNA (cls.) 1%", "RSNA (cls.) 10%", "Covid (cls.) 1%", "Covid (cls.) 10%",
                         "RSNA (seg.) 1%", "RSNA (seg.) 10%", "Rec.@1", "Rec.@5", "Wst.@1", "Wst.@5")
#: Table 2, backbone ConVIRT: paper row -> values in the order of :data:`FEDDRA_TABLE2_COLUMNS`
FEDDRA_TABLE2_CONVIRT: dict[str, tuple[float, ...]] = {
    "FedEMA": (82.8, 83.1, 79.2, 86.5, 70.9, 73.6, 24.0, 67.0, 21.9, 62.4),
    "FedMOON": (82.5, 83.2, 77.8, 89.2, 69.0, 71.3, 27.8, 70.9, 25.3, 67.2),
    "FedAvg": (83.1, 83.3, 78.0, 88.5, 69.6, 71.5, 28.8, 72.1, 25.3, 66.7),
    "FedDRA (Ours)": (83.2, 83.7, 81.0, 90.3, 71.7, 74.1, 30.2, 73.2, 27.0, 68.9),
}
#: Table 3's columns as its header prints them (Covid first; see FEDDRA_TABLE3_NOTE)
FEDDRA_TABLE3_COLUMNS = ("Covid (cls.) 1%", "Covid (cls.) 10%", "RSNA (cls.) 1%", "RSNA (cls.) 10%",
                         "Rec.@1", "Rec.@5", "Wst.@1", "Wst.@5")
FEDDRA_TABLE3_NOTE = ("Table 3's header reads Covid (cls.) then RSNA (cls.), Table 2's RSNA then Covid; Table 3's "
                      "full-method row 83.2 83.7 81.0 90.3 equals Table 2's FedDRA ConVIRT RSNA 83.2 83.7, Covid "
                      "81.0 90.3, so Table 3's first pair is most likely RSNA. Numbers are kept in the printed order.")
#: Table 3 (ConVIRT): (two-stage, global constraint, DRO-weighing) -> values in the order of FEDDRA_TABLE3_COLUMNS
FEDDRA_TABLE3: dict[tuple[bool, bool, bool], tuple[float, ...]] = {
    (False, True, True): (83.0, 83.4, 80.5, 89.6, 29.4, 72.7, 26.2, 68.1),
    (True, False, True): (82.8, 83.0, 79.8, 88.6, 28.3, 71.9, 26.0, 67.9),
    (True, True, False): (82.5, 82.9, 80.2, 89.2, 29.7, 72.8, 25.6, 67.3),
    (True, True, True): (83.2, 83.7, 81.0, 90.3, 30.2, 73.2, 27.0, 68.9),
}


def feddra_paper_rows(table: int) -> list[dict]:
    """FedDRA's Table 2 (ConVIRT rows) or Table 3 as :func:`fcl_paper_rows` gives them (%, std None; the paper's
    column names, in its order).  Table 3's "method" is e.g. ``"two-stage off, anchor on, DRO on"``."""
    if table == 2:
        items = [(m, v) for m, v in FEDDRA_TABLE2_CONVIRT.items()]
        columns = FEDDRA_TABLE2_COLUMNS
    elif table == 3:
        onoff = lambda b: "on" if b else "off"  # noqa: E731
        items = [(f"two-stage {onoff(t)}, anchor {onoff(a)}, DRO {onoff(d)}", v)
                 for (t, a, d), v in FEDDRA_TABLE3.items()]
        columns = FEDDRA_TABLE3_COLUMNS
    else:
        raise ValueError(f"FedDRA table {table!r} has no stored numbers; use 2 (ConVIRT rows) or 3")
    return [{"table": f"FedDRA Table {table}", "method": m, "column": c, "mean": x, "std": None, "n": None}
            for m, v in items for c, x in zip(columns, v)]
