"""FedDRA Table 4 (fedssl.train.vlp_mbrset) on a tiny model and a tiny synthetic mBRSET."""

from __future__ import annotations

import torch

from fedssl.experiments.feddra_retina import format_table4
from fedssl.train.vlp_mbrset import mbrset_evaluation

torch.set_num_threads(1)


def test_two_binary_tasks_at_the_papers_fractions(tmp_path):
    from fedssl.data.vlp_mbrset import write_synthetic_mbrset
    from fedssl.models.vlp import VisionLanguageModel

    write_synthetic_mbrset(tmp_path / "m", n_images=30, image_px=32, seed=0)
    model = VisionLanguageModel(preset="tiny")
    res = mbrset_evaluation(model, str(tmp_path / "m"), seed=0, epochs=1)
    assert set(res) == {"dr", "edema"} and all(set(r) == {"10%", "20%", "100%"} for r in res.values())
    assert all(0 <= m["accuracy"] <= 1 for r in res.values() for m in r.values())
    table = format_table4({"feddra": {"mbrset": res}}, ["10%", "20%", "100%"])
    assert table.splitlines()[0].startswith("| variant | DR 10% | DR 20% | DR 100% | edema 10%")
    assert f"{100 * res['edema']['100%']['accuracy']:.1f}" in table.splitlines()[2]
