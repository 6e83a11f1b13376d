import numpy as np
import pytest
import torch

from fedssl.experiments.wire_cost import SETTINGS, format_table, run_wire_cost, summarise


def cell(setting, seed, score, up, down=None):
    b = {"upload": up, "download": up if down is None else down}
    return {"method": "fcl", "setting": setting, "seed": seed, "metric": "dice", "score": score,
            "pretraining_bytes": b, "finetuning_bytes": {"upload": up / 2, "download": up / 2}}


def test_paired_differences_and_spread_by_hand():
    cells = [cell("none", 0, 0.50, 4e6), cell("none", 1, 0.60, 4e6), cell("none", 2, 0.55, 4e6),
             cell("float16", 0, 0.48, 2e6), cell("float16", 1, 0.61, 2e6), cell("float16", 2, 0.51, 2e6),
             cell("adaquant", 0, 0.30, 1e6)]
    rows = {r["setting"]: r for r in summarise(cells)}
    assert list(rows) == ["none", "float16", "adaquant"]  # SETTINGS order, whatever the cells' order
    # float16 - none by seed: -0.02, +0.01, -0.04 -> mean -0.01667, std 0.02055; none std 0.04082
    f = rows["float16"]
    assert f["paired_difference"] == pytest.approx(-0.0167, abs=1e-4)
    assert f["paired_difference_std"] == pytest.approx(0.0205, abs=1e-4)
    assert f["none_std_over_seeds"] == pytest.approx(0.0408, abs=1e-4) and f["within_spread"] is True
    assert f["bytes_ratio_vs_none"] == 2.0 and f["pretraining_mb_per_site_round"] == 4.0  # 2 MB up + 2 MB down
    a = rows["adaquant"]  # 0.30 - 0.50 = -0.2: outside one std of none
    assert a["paired_difference"] == pytest.approx(-0.2) and a["within_spread"] is False and a["paired_seeds"] == 1
    assert rows["none"]["paired_difference"] is None
    text = format_table(list(rows.values()))
    assert "-0.017 +- 0.021" in text and "4.00" in text


def test_unknown_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown \\['int3'\\]"):
        run_wire_cost(str(tmp_path), settings=("none", "int3"))
    assert set(SETTINGS) >= {"none", "float16", "adaquant", "float16+banks"}


def test_message_sizes_of_a_job_model_as_sent_and_quantised():
    from fedssl.experiments.wire_cost import format_message_sizes, message_sizes

    r = message_sizes("fcl_acdc_finetune", "quick")
    b = r["bytes"]
    assert r["parameters"] > 0 and r["tensors"] > 0
    assert b["none"] > 4 * r["parameters"]  # float32 values plus the message's keys and framing
    assert 1.9 < b["none"] / b["float16"] < 2.0  # half the values; the per-tensor meta stays
    assert b["adaquant"] < b["float16"]
    assert "| fcl_acdc_finetune | quick |" in format_message_sizes([r])
    # the weights after the receiver's dequantiser: float16 keeps ~3 decimal digits, adaquant loses more
    e = r["relative_error"]
    assert set(e) == {"float16", "adaquant"}
    assert 0 < e["float16"] < 5e-4 < e["adaquant"] < 0.1
    assert f"({b['none'] / b['float16']:.3f}x, error {e['float16']:.1e})" in format_message_sizes([r])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="blockwise8.*need a GPU"):
            message_sizes("fcl_acdc_finetune", "quick", settings=("none", "blockwise8"))
    with pytest.raises(ValueError, match="int3"):
        message_sizes("fcl_acdc_finetune", "quick", settings=("none", "int3"))


def test_relative_error_hand_computed():
    from fedssl.experiments.wire_cost import relative_error

    # float tensors as one vector: ||(0, 0.5, 0)|| / ||(3, 4, 0)|| = 0.1; the integer buffer is not counted
    original = {"w": np.array([3.0, 4.0], np.float32), "b": np.zeros(1, np.float32), "n": np.array([5])}
    restored = {"w": torch.tensor([3.0, 4.5]), "b": np.zeros(1), "n": np.array([9])}
    assert relative_error(original, restored) == pytest.approx(0.1)
    assert relative_error(original, {**restored, "w": torch.tensor([3.0, 4.0])}) == 0.0
    assert relative_error({"n": np.array([1])}, {"n": np.array([2])}) == 0.0
