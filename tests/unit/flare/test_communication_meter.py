import json

import numpy as np
from nvflare.apis.dxo import DXO, DataKind

from nvflare.app_common.decomposers import common_decomposers

from fedssl.flare.communication_meter import COMM_FILE, CommunicationMeter, payload_breakdown
from tests.unit.flare.fakes import FakeEngine, context


common_decomposers.register()  # FLARE registers these at start-up; numpy arrays need them


def test_counts_the_real_serialised_size(tmp_path):
    s = DXO(DataKind.WEIGHTS, data={"w": np.zeros((100, 10), np.float32)},
            meta={"bank_features": np.zeros((64, 8), np.float32), "num_samples": 3}).to_shareable()
    s.set_header("current_round", 4)
    CommunicationMeter("upload").process(s, context(peer_site="site-2", engine=FakeEngine(tmp_path)))
    rec = json.loads((tmp_path / COMM_FILE).read_text().splitlines()[0])
    assert rec["total"] == len(s.to_bytes())
    assert rec["site"] == "site-2" and rec["round"] == 4 and rec["direction"] == "upload"
    # 4000 bytes of weights and 2048 bytes of features, plus framing
    assert 4000 <= rec["weights"] < 4400 and 2048 <= rec["features"] < 2400 and rec["scalars"] < 100
    assert rec["weights"] + rec["features"] + rec["scalars"] <= rec["total"]


def test_breakdown_of_non_dxo():
    from nvflare.apis.shareable import Shareable

    assert set(payload_breakdown(Shareable())) == {"total"}
