"""RSNA boxes -> masks (fedssl.data.vlp_segmentation) and the mBRSET layout (fedssl.data.vlp_mbrset)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedssl.data.vlp_mbrset import load_mbrset, write_synthetic_mbrset
from fedssl.data.vlp_segmentation import RSNASegmentationDataset, box_mask, load_rsna_segmentation
from fedssl.data.vlp_synthetic import write_synthetic_rsna

torch.set_num_threads(1)


def test_box_mask_scales_the_1024_frame_by_pixel_centres():
    m = box_mask([(300.0, 512.0, 200.0, 512.0)], 4, 4)  # pixel centres at 128, 384, 640, 896 of the frame
    assert m.tolist() == [[0, 0, 0, 0], [0, 0, 0, 0], [0, 1, 0, 0], [0, 1, 0, 0]]


def test_synthetic_rsna_boxes_mark_the_painted_opacities(tmp_path):
    s = write_synthetic_rsna(tmp_path / "r", n_images=30, image_px=32, seed=0)
    items = load_rsna_segmentation(tmp_path / "r")
    assert sum(bool(b) for _, b in items) == s["positives"] > 0 and sum(len(b) for _, b in items) == s["rows"] - (
        30 - s["positives"])
    ds = RSNASegmentationDataset(items, 32, 3)
    inside, outside = [], []
    for i in range(len(ds)):
        x, m = ds[i]
        assert m.shape == (1, 32, 32) and (m.sum() > 0) == bool(ds.has_box[i])
        if m.sum() > 0:
            inside.append(float(x[0][m[0] > 0].mean()))
            outside.append(float(x[0][m[0] == 0].mean()))
    assert np.mean(inside) > np.mean(outside) + 0.3  # the opacity is where the box is


def test_a_target_one_row_without_a_box_is_refused(tmp_path):
    write_synthetic_rsna(tmp_path / "r", n_images=10, image_px=16, seed=0)
    csv = tmp_path / "r" / "stage_2_train_labels.csv"
    lines = csv.read_text().splitlines()
    pid = lines[1].split(",")[0]
    csv.write_text("\n".join(lines + [f"{pid},,,,,1"]) + "\n")
    with pytest.raises(ValueError, match="Target 1 row without a box"):
        load_rsna_segmentation(tmp_path / "r")


def test_mbrset_layout_binary_targets_and_patient_split(tmp_path):
    s = write_synthetic_mbrset(tmp_path / "m", n_images=40, image_px=16, seed=0)
    split = load_mbrset(tmp_path / "m")
    items = split["train"] + split["test"]
    assert len(items) == 40 and sum(dr for _, dr, _ in items) == s["dr"] and sum(e for *_, e in items) == s["edema"]
    train_patients = {p.split("/")[-1].split(".")[0] for p, *_ in split["train"]}
    test_patients = {p.split("/")[-1].split(".")[0] for p, *_ in split["test"]}
    assert train_patients and test_patients and not train_patients & test_patients  # both eyes together
    (tmp_path / "m" / "labels_mbrset.csv").write_text("patient,file,final_icdr,final_edema\n1,1.1.jpg,7,no\n")
    with pytest.raises(ValueError, match="final_icdr='7'"):
        load_mbrset(tmp_path / "m")
