"""FCL Table 7's expected bytes: the model twice, plus the rows each feature exchange really carries (issue 47)."""

import pytest

from fedssl.experiments.table7 import _args, _floats, _shape, exchanged_rows, expected_bytes, method_bytes
from fedssl.models.unet import MoCoUNetEncoder
from fedssl.ops.jobs import REPO_ROOT, build_job


def test_exchanged_rows_are_the_round_means_of_what_sites_sent_and_received():
    summary = {"rounds": [{"site_record_means": {"rows_shared": 64, "remote_features": 0}},
                          {"site_record_means": {"rows_shared": 32, "remote_features": 64}},
                          {"site_record_means": {"rows_shared": 32, "remote_features": 32}}]}
    assert exchanged_rows(summary) == (128 / 3, 96 / 3)
    assert exchanged_rows({"rounds": [{"site_record_means": {"steps_per_round": 5}}]}) == (0.0, 0.0)  # FedMoCo
    assert exchanged_rows({}) == (0.0, 0.0)


def test_fcl_expected_bytes_are_the_model_both_ways_and_each_exchanged_row_once(tmp_path):
    built = build_job(f"{REPO_ROOT}/jobs/fcl_acdc", str(tmp_path / "job"), profile="quick", n_sites=3)
    a = _args(built, "fcl_trainer")
    w = 4 * _floats(MoCoUNetEncoder(a["features"], a["proj_dim"], **_shape(a)))
    row = 4 * a["proj_dim"] + 8  # a float32 feature and its int64 partition id
    assert expected_bytes("FedMoCo", built, 11) == 2 * w
    # 80 rows up and 40 down a round: not K = bank_size rows up and (N - 1) K down as before issue 45
    assert expected_bytes("FCL", built, 11, (80.0, 40.0)) == pytest.approx(2 * w + row * 120)
    assert expected_bytes("FCL", built, 11) == 2 * w


#: FCL (Wu et al., MedIA 2022) Table 7: communication per round normalised to FCL = 1.000 (124.2 MB)
PAPER_TABLE7 = {"FedMoCo": 0.544, "FCL": 1.000, "FedBYOL": 0.373, "FCLOpt": 0.645, "FCLOpt-PTNU": 0.509,
                "FCLOpt-PTNU-DP": 0.386}


def test_the_sizes_the_papers_table_implies_give_back_all_its_ratios():
    # FedMoCo = 2 x (main + momentum) and FedBYOL = 2 x (online + predictor) fix two sizes; FCL's features are the
    # rest of FCL's 1.000.  The target network is the online one without its predictor: from FCLOpt = 0.645.
    moco, online_pred = 0.544 / 2, 0.373 / 2
    target = 0.645 / 2 - online_pred  # 0.136 = moco / 2: the target is one of the MoCo pair's networks in size
    sizes = dict(moco=moco, online_pred=online_pred, target=target, features=1.0 - 0.544, calibrated=20 / 200)
    got = {name: method_bytes(name, **sizes) for name in PAPER_TABLE7}
    assert got == pytest.approx(PAPER_TABLE7, abs=0.001)  # PTNU and DP are predictions: 0.509 and 0.3866
    assert target == pytest.approx(moco / 2, abs=1e-12)
    with pytest.raises(ValueError, match="not a row of Table 7"):
        method_bytes("FedAvg", **sizes)
