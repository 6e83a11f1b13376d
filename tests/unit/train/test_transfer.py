"""FCL Table 5 transfer protocol (fedssl.train.transfer): 5-fold CV over the HVSMR subjects, M annotated subjects from
the fold's training part, the U-Net's 3 classes, Dice per class (myocardium, blood pool), mean +- std over folds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from fedssl.core.partition import kfold_split
from fedssl.core.seeds import site_seed
from fedssl.data.hvsmr import load_hvsmr
from fedssl.data.hvsmr_synthetic import write_synthetic_hvsmr
from fedssl.data.volume import Volume
from fedssl.train import transfer
from fedssl.train.transfer import PAPER_TRANSFER, summarise_transfer, transfer_finetune

torch.set_num_threads(1)
SUBJECTS = [f"pat{n}" for n in range(5)]


def _volumes() -> list[Volume]:
    """5 subjects [Z=2, 4, 4]: 2 myocardium pixels, 2 blood-pool pixels, image = label / 2 (an oracle can read it)."""
    out = []
    for sid in SUBJECTS:
        label = np.zeros((2, 4, 4), dtype=np.uint8)
        label[0, 0, 0:2] = 1
        label[0, 1, 0:2] = 2
        out.append(Volume(patient_id=sid, phase="axial_crop", image=label.astype(np.float32) / 2, label=label))
    return out


class _Predict(nn.Module):
    """Logits of a fixed rule: the label the image encodes (``oracle``) or blood pool everywhere."""

    def __init__(self, oracle: bool):
        super().__init__()
        self.oracle = oracle

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cls = torch.round(x[:, 0] * 2).long() if self.oracle else torch.full_like(x[:, 0], 2).long()
        return nn.functional.one_hot(cls, 3).permute(0, 3, 1, 2).float()


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Replace the U-Net and its training by fixed predictors; record what the protocol passes them."""
    calls: list[dict] = []

    def fake_init(init, *, features, seed, out_channels, norm):
        calls.append({"init": init, "init_seed": seed, "out_channels": out_channels})
        return _Predict(oracle=init == "oracle")

    def fake_train(unet, volumes, *, seed, epochs, **kw):
        calls[-1].update(train_seed=seed, train_ids=[v.patient_id for v in volumes], epochs=epochs, lr=kw["lr"])
        return [0.25]

    monkeypatch.setattr(transfer, "init_unet", fake_init)
    monkeypatch.setattr(transfer, "train_segmentation", fake_train)
    return calls


def test_paper_settings_of_table5() -> None:
    # FCL section 5 ("Training details", "Dataset and preprocessing") and Table 5 (M = 1, 2, 4, 8; 5-fold CV)
    assert PAPER_TRANSFER == {"target_spacing": 0.7, "n_labelled": [1, 2, 4, 8], "n_folds": 5,
                              "folds": [0, 1, 2, 3, 4], "epochs": 200, "lr": 5e-4, "batch_size": 10,
                              "features": [48, 96, 192, 384, 768, 48], "norm": "batch"}


def test_dice_per_class_hand_computed(recorded: list[dict]) -> None:
    rows = transfer_finetune(_volumes(), {"oracle": "oracle", "all_blood": "x"}, n_labelled=[1], folds=[0],
                             features=[4] * 6, epochs=3)
    oracle, blood = rows
    assert (oracle["dice"], oracle["myocardium"], oracle["blood_pool"]) == (1.0, 1.0, 1.0)
    # all blood pool: myocardium 0; blood pool 2|A n B| / (|A| + |B|) = 2 * 2 / (2 + 32) per volume
    assert blood["myocardium"] == 0.0
    assert blood["blood_pool"] == pytest.approx(4 / 34)
    assert blood["dice"] == pytest.approx(2 / 34)
    assert oracle["final_loss"] == 0.25 and oracle["mode"] == "transfer" and oracle["site"] == "hvsmr"


def test_seeds_classes_and_paired_splits(recorded: list[dict]) -> None:
    encoder = {"conv_0.w": torch.zeros(1)}
    rows = transfer_finetune(_volumes(), {"random": "random", "fcl": encoder}, n_labelled=[1, 4], folds=range(5),
                             features=[4] * 6, epochs=2, lr=1e-3, seed=7, site="hvsmr-site")
    data_seed = site_seed(7, "hvsmr-site")
    assert {c["init_seed"] for c in recorded} == {7}  # weights: the job seed
    assert {c["train_seed"] for c in recorded} == {data_seed}  # batches and augmentation: the site seed
    assert {c["out_channels"] for c in recorded} == {3}  # background, myocardium, blood pool
    assert recorded[2]["init"] is encoder and (recorded[2]["epochs"], recorded[2]["lr"]) == (2, 1e-3)
    # 5-fold CV: every subject validates exactly once; M subjects from the fold's 4 others; same for both methods
    assert sorted(s for r in rows if r["method"] == "random"
                  and r["n_labelled"] == 1 for s in r["val_patients"]) == SUBJECTS
    for fold in range(5):
        fold_rows = [r for r in rows if r["fold"] == fold]
        expected_val = kfold_split(SUBJECTS, fold, n_folds=5, seed=data_seed)[1]
        assert all(r["val_patients"] == expected_val for r in fold_rows)
        for m in (1, 4):
            picks = [r["train_patients"] for r in fold_rows if r["n_labelled"] == m]
            assert len(picks) == 2 and picks[0] == picks[1] and len(picks[0]) == m
            assert not set(picks[0]) & set(expected_val)
    # the split follows the site seed, not the job seed (the two give different folds here)
    assert any(kfold_split(SUBJECTS, f, seed=7)[1] != kfold_split(SUBJECTS, f, seed=data_seed)[1] for f in range(5))
    assert [c["train_ids"] for c in recorded] == [r["train_patients"] for r in rows]


@pytest.mark.parametrize("kwargs, message", [
    ({"inits": {}}, r"inits=\{\}"),
    ({"n_labelled": [5]}, r"n_labelled=\[5\] is invalid; use annotated-subject counts in \[1, 4\]"),
    ({"folds": [5]}, r"folds=\[5\] is invalid; use fold indices in \[0, 4\]"),
    ({"volumes": _volumes() + _volumes()[:1]}, r"argument volumes=.*one labelled volume per subject"),
])
def test_bad_arguments_name_the_argument(recorded: list[dict], kwargs: dict, message: str) -> None:
    args = {"volumes": _volumes(), "inits": {"random": "random"}, "n_labelled": [1], "folds": [0], **kwargs}
    with pytest.raises(ValueError, match=message):
        transfer_finetune(args.pop("volumes"), args.pop("inits"), features=[4] * 6, epochs=1, **args)
    assert recorded == []


def test_summary_is_mean_and_population_std_over_folds() -> None:
    rows = [{"method": "random", "n_labelled": 1, "fold": f, "dice": d, "myocardium": m, "blood_pool": b}
            for f, (d, m, b) in enumerate([(0.5, 0.4, 0.6), (0.7, 0.6, 0.8)])]
    rows.append({"method": "fcl", "n_labelled": 1, "fold": 0, "dice": 0.9, "myocardium": 0.8, "blood_pool": 1.0})
    first, second = summarise_transfer(rows)
    assert (first["method"], first["n"], second["method"], second["n"]) == ("random", 2, "fcl", 1)
    assert first["dice_mean"] == pytest.approx(0.6) and first["dice_std"] == pytest.approx(0.1)
    assert first["myocardium_mean"] == pytest.approx(0.5) and first["blood_pool_std"] == pytest.approx(0.1)
    assert second["dice_std"] == 0.0


@pytest.mark.slow
def test_end_to_end_fine_tuning_learns_the_heart(tmp_path: Path) -> None:
    """Tiny CPU run of the whole protocol on synthetic HVSMR (about 10-15 s): random init learns the blood pool."""
    write_synthetic_hvsmr(tmp_path, n_subjects=5, shape=(24, 24, 12), spacing_range=(1.2, 1.4), seed=0)
    volumes = load_hvsmr(tmp_path, image_size=32, target_spacing=1.0)
    (row,) = transfer_finetune(volumes, {"random": "random"}, n_labelled=[2], folds=[0], n_folds=5,
                               features=(8, 8, 16, 16, 32, 8), epochs=40, lr=5e-3, batch_size=4)
    assert row["blood_pool"] > 0.5 and row["myocardium"] > 0.1
    assert row["n_train_slices"] == 24 and len(row["val_patients"]) == 1 and row["seconds"] > 0
