import numpy as np
import pytest
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.app_common.app_constant import AppConstants

from fedssl.flare.partial_exclusion import PartialModelExclusion
from tests.unit.flare.fakes import context

WEIGHTS = {"encoder.cls_token": np.ones((1, 1, 4), np.float32), "encoder.pos_embed": np.zeros((1, 5, 4), np.float32),
           "decoder.pred.weight": np.zeros((2, 4), np.float32)}


def result(round_idx=None, num_rounds=None, kind=DataKind.WEIGHTS, data=WEIGHTS):
    s = DXO(kind, data=dict(data), meta={"num_samples": 3}).to_shareable()
    if round_idx is not None:
        s.set_header(AppConstants.CURRENT_ROUND, round_idx)
        s.set_header(AppConstants.NUM_ROUNDS, num_rounds)
    return s


def test_upload_holds_back_matching_tensors_until_the_last_round():
    f = PartialModelExclusion(patterns=["encoder.cls_token"], direction="upload")
    out = from_shareable(f.process(result(0, 3), context()))
    assert set(out.data) == {"encoder.pos_embed", "decoder.pred.weight"}
    assert out.get_meta_prop("excluded_keys") == ["encoder.cls_token"] and out.get_meta_prop("num_samples") == 3
    last = from_shareable(f.process(result(2, 3), context()))
    # averaged once, at the end of the last round: the site's own value, with the rest of the model
    assert set(last.data) == set(WEIGHTS) and last.get_meta_props() == {"num_samples": 3}  # nothing excluded
    np.testing.assert_array_equal(last.data["encoder.cls_token"], WEIGHTS["encoder.cls_token"])


def test_unknown_round_and_fedbn_keep_tensors_local():
    f = PartialModelExclusion(patterns=["encoder.cls_token"], direction="upload")
    assert "encoder.cls_token" not in from_shareable(f.process(result(), context())).data
    fedbn = PartialModelExclusion(patterns=["decoder.*"], direction="upload", average_at_end=False)
    assert set(from_shareable(fedbn.process(result(2, 3), context())).data) == {"encoder.cls_token",
                                                                                "encoder.pos_embed"}


def test_download_removes_matching_tensors_every_round():
    f = PartialModelExclusion(patterns=["encoder.cls_token", "decoder.*"], direction="download")
    assert set(from_shareable(f.process(result(2, 3), context())).data) == {"encoder.pos_embed"}


def test_non_weight_payloads_pass():
    f = PartialModelExclusion(patterns=["encoder.cls_token"])
    s = result(kind=DataKind.METRICS, data={"accuracy": 0.5})
    assert f.process(s, context()) is s


def test_patterns_that_match_nothing_refuse_to_send():
    f = PartialModelExclusion(patterns=["encoder.class_token"])
    with pytest.raises(ValueError, match="no parameter matches"):
        f.process(result(0, 3), context())


@pytest.mark.parametrize("args, arg", [({"patterns": []}, "patterns"), ({"patterns": "encoder.cls_token"}, "patterns"),
                                       ({"patterns": ["x"], "direction": "up"}, "direction"),
                                       ({"patterns": ["x"], "average_at_end": "yes"}, "average_at_end")])
def test_misconfiguration_is_refused(args, arg):
    with pytest.raises(ValueError, match=arg):
        PartialModelExclusion(**args)
