import numpy as np
import pytest
import torch

from fedssl.core.state_dict import ContributionError, check_contribution, ema_update, match_keys, merge_into, weighted_average


def test_weighted_average_by_hand():
    a = {"w": np.array([1.0, 2.0], np.float32), "n": np.array(10, np.int64)}
    b = {"w": np.array([4.0, 8.0], np.float32), "n": np.array(20, np.int64)}
    out = weighted_average([a, b], [1, 2])  # (1*a + 2*b) / 3
    np.testing.assert_allclose(out["w"], [3.0, 6.0])
    assert out["w"].dtype == np.float32 and out["n"].dtype == np.int64 and int(out["n"]) == 17  # 16.67 -> 17
    assert a["w"].tolist() == [1.0, 2.0]  # inputs untouched


def test_weighted_average_rejects_bad_weights():
    with pytest.raises(ValueError, match=r"weights \[0\.0\] must be finite, non-negative and not all zero"):
        weighted_average([{"w": np.zeros(1)}], [0])
    with pytest.raises(ValueError, match="need one weight per state, got 1 states and 2 weights"):
        weighted_average([{"w": np.zeros(1)}], [1, 2])


def test_check_contribution_keys_shapes_nan():
    ref = {"a": np.zeros((2, 2)), "b": np.zeros(3)}
    check_contribution(ref, {"a": np.ones((2, 2)), "b": torch.ones(3)}, "site-1")
    with pytest.raises(ContributionError, match="site-1.*wrong keys"):
        check_contribution(ref, {"a": np.ones((2, 2))}, "site-1")
    with pytest.raises(ContributionError, match="shape"):
        check_contribution(ref, {"a": np.ones((2, 3)), "b": np.ones(3)}, "site-1")
    with pytest.raises(ContributionError, match="non-finite"):
        check_contribution(ref, {"a": np.full((2, 2), np.inf), "b": np.ones(3)}, "site-1")


def test_merge_keeps_every_key():
    assert merge_into({"a": 1, "b": 2}, {"b": 3}) == {"a": 1, "b": 3}


def test_ema_update_by_hand():
    t, o = torch.nn.Linear(1, 1, bias=False), torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        t.weight.fill_(1.0)
        o.weight.fill_(3.0)
    ema_update(t, o, 0.75)  # 0.75*1 + 0.25*3 = 1.5
    assert t.weight.item() == pytest.approx(1.5)


def test_match_keys_by_pattern():
    keys = ["encoder.cls_token", "encoder.pos_embed", "decoder.embed.weight", "decoder.pred.bias", "features.norm0.running_mean"]
    assert match_keys(keys, ["encoder.cls_token"]) == ["encoder.cls_token"]
    assert match_keys(keys, ["decoder.*"]) == ["decoder.embed.weight", "decoder.pred.bias"]
    assert match_keys(keys, ["*.running_mean", "encoder.cls_token"]) == ["encoder.cls_token", "features.norm0.running_mean"]
    assert match_keys(keys, ["encoder.cls"]) == []  # whole names only, no prefix matching
