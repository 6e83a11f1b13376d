"""fedssl.experiments.bench: the throughput figure comes from real, finite training steps of the executors' models."""

import json

import pytest
import torch

from fedssl.experiments.bench import measure, run_bench


@pytest.mark.parametrize("method", ["mae", "beit", "finetune"])
def test_tiny_step_is_timed_and_trains(method):
    r = measure(method, "tiny", batch_size=4, steps=2, warmup=1, device="cpu")
    assert r["images_per_s"] == pytest.approx(2 * 4 / r["seconds"], rel=0.01)
    assert r["device"] == "cpu" and r["amp_bf16"] is False  # autocast is a GPU switch
    assert r["mask_ratio"] == {"mae": 0.6, "beit": 0.4, "finetune": None}[method]
    assert torch.isfinite(torch.tensor(r["last_loss"]))


def test_run_bench_writes_one_row_per_method_and_batch(tmp_path):
    out = tmp_path / "b.json"
    rows = run_bench(str(out), methods=["mae"], size="tiny", batch_sizes=[2, 4], steps=1, warmup=0, device="cpu")
    assert [r["batch_size"] for r in json.loads(out.read_text())] == [2, 4] == [r["batch_size"] for r in rows]


@pytest.mark.parametrize("kw, word", [({"method": "simclr"}, "method"), ({"size": "vit_l"}, "size"),
                                      ({"batch_size": 0}, "batch_size")])
def test_bad_arguments_name_the_argument(kw, word):
    with pytest.raises(ValueError, match=word):
        measure(**{"method": "mae", "size": "tiny", **kw})
