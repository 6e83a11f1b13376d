"""BackboneBNExclusion: the batch-norm tensors follow the run's backbone strategy (no filter edits per strategy)."""

import numpy as np
import pytest
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.shareable import make_reply

from fedssl.flare.backbone_exclusion import BackboneBNExclusion
from fedssl.flare.constants import BACKBONE_HEADER, EXCLUDED_META
from fedssl.flare.surgical_registration import REGISTRY_PROP, build_registry
from tests.unit.flare.fakes import FakeEngine, context

BN = ["features.norm0.weight", "features.norm0.running_mean", "features.denseblock1.denselayer1.norm1.bias",
      "features.transition1.norm.num_batches_tracked"]
OTHER = ["features.conv0.weight", "classifier.weight", "classifier.bias"]


def payload(header=None):
    s = DXO(DataKind.WEIGHTS, data={k: np.ones(2, np.float32) for k in BN + OTHER}).to_shareable()
    if header is not None:
        s.set_header(BACKBONE_HEADER, header)
    return s


def server_ctx(tmp_path, backbone):
    reg = build_registry("surgical", backbone, {"site-1": ["A"], "site-2": ["A", "B"]})
    return context(peer_site="site-1", engine=FakeEngine(tmp_path), props={REGISTRY_PROP: reg})


@pytest.mark.parametrize("backbone,kept", [("fedavg", BN + OTHER), ("fedbn", OTHER), ("fedbn_plus", OTHER)])
def test_download_follows_the_registry_and_announces_it(tmp_path, backbone, kept):
    out = BackboneBNExclusion(direction="download").process(payload(), server_ctx(tmp_path, backbone))
    assert sorted(from_shareable(out).data) == sorted(kept)
    assert out.get_header(BACKBONE_HEADER) == backbone
    if backbone != "fedavg":
        assert sorted(from_shareable(out).get_meta_prop(EXCLUDED_META)) == sorted(BN)


@pytest.mark.parametrize("backbone,kept", [("fedavg", BN + OTHER), ("fedbn", OTHER), ("fedbn_plus", OTHER)])
def test_upload_follows_the_result_header(tmp_path, backbone, kept):
    out = BackboneBNExclusion(direction="upload").process(payload(backbone), context(engine=FakeEngine(tmp_path)))
    assert sorted(from_shareable(out).data) == sorted(kept)


def test_upload_never_sends_batchnorm_on_the_last_round(tmp_path):
    from nvflare.app_common.app_constant import AppConstants

    s = payload("fedbn")
    s.set_header(AppConstants.CURRENT_ROUND, 4)
    s.set_header(AppConstants.NUM_ROUNDS, 5)
    out = BackboneBNExclusion(direction="upload").process(s, context(engine=FakeEngine(tmp_path)))
    assert sorted(from_shareable(out).data) == sorted(OTHER)


@pytest.mark.parametrize("header", [None, "fedprox", ""])
def test_upload_refuses_a_missing_or_unknown_strategy(tmp_path, header):
    with pytest.raises(ValueError, match="backbone strategy"):
        BackboneBNExclusion(direction="upload").process(payload(header), context(engine=FakeEngine(tmp_path)))


def test_download_without_registry_refuses(tmp_path):
    with pytest.raises(ValueError, match="ClassRegistration"):
        BackboneBNExclusion(direction="download").process(payload(), context(engine=FakeEngine(tmp_path)))


def test_error_reply_passes_untouched(tmp_path):
    reply = make_reply(ReturnCode.EXECUTION_EXCEPTION)
    assert BackboneBNExclusion(direction="upload").process(reply, context(engine=FakeEngine(tmp_path))) is reply


def test_bad_direction_is_rejected():
    with pytest.raises(ValueError, match="direction"):
        BackboneBNExclusion(direction="sideways")
