import json

import numpy as np
from nvflare.apis.dxo import DXO, DataKind

from fedssl.flare.communication_meter import COMM_FILE, CommunicationMeter, payload_breakdown, register_decomposers
from tests.unit.flare.fakes import FakeEngine, context


register_decomposers()  # as a FLARE process at start: numpy arrays and FLARE's Shareable encoding


def payload(cols: int, bank_cols: int):
    s = DXO(DataKind.WEIGHTS, data={"w": np.zeros((100, cols), np.float32)},
            meta={"bank_features": np.zeros((64, bank_cols), np.float32), "num_samples": 3}).to_shareable()
    s.set_header("current_round", 4)
    return s


def test_counts_the_real_serialised_size(tmp_path):
    meter, ctx = CommunicationMeter("upload"), context(peer_site="site-2", engine=FakeEngine(tmp_path))
    s = payload(10, 8)
    meter.process(s, ctx)
    meter.process(payload(11, 9), ctx)
    rec, wider = (json.loads(line) for line in (tmp_path / COMM_FILE).read_text().splitlines())
    assert rec["total"] == len(s.to_bytes())
    assert rec["site"] == "site-2" and rec["round"] == 4 and rec["direction"] == "upload"
    # 4000 bytes of weights and 2048 bytes of features, plus framing
    assert 4000 <= rec["weights"] < 4400 and 2048 <= rec["features"] < 2400
    # one more float32 column: exactly 100 x 4 more weight bytes and 64 x 4 more feature bytes
    assert wider["weights"] - rec["weights"] == 400 and wider["features"] - rec["features"] == 256
    # {"num_samples": 3}: 10-byte FOBS frame + msgpack fixmap (1) + fixstr "num_samples" (1 + 11) + fixint (1)
    assert rec["scalars"] == 24
    assert rec["weights"] + rec["features"] + rec["scalars"] <= rec["total"]


def test_a_shareable_is_measured_in_flares_own_encoding():
    """Without FLARE's decomposers, fobs encodes a Shareable as a plain dataclass on the fly: other bytes than FLARE
    sends, and the test process could no longer open an admin session (the POC tests failed after this file)."""
    encoded = payload(10, 8).to_bytes()
    assert b"DataClassDecomposer" not in encoded and b"DictDecomposer" in encoded


def test_breakdown_of_non_dxo():
    from nvflare.apis.shareable import Shareable

    assert set(payload_breakdown(Shareable())) == {"total"}
