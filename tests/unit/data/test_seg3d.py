import gzip
import os

import nibabel as nib
import numpy as np
import pytest
import torch

from fedssl.data.acdc_synthetic import write_synthetic_acdc
from fedssl.data.hvsmr_synthetic import write_synthetic_hvsmr
from fedssl.data.seg3d import Seg3DDataError, list_items, load_volumes


@pytest.fixture(scope="module")
def acdc(tmp_path_factory):
    root = tmp_path_factory.mktemp("acdc")
    write_synthetic_acdc(root, n_patients=2, n_sites=1, seed=0, shape=(64, 64), n_frames=4)
    return str(root / "site-1")


def test_acdc_items_are_the_ed_and_es_frames_with_labels(acdc):
    items = list_items("acdc", acdc, "site-1")
    assert [i["id"] for i in items] == ["patient001_ED", "patient001_ES", "patient002_ED", "patient002_ES"]
    assert all(i["label"].endswith("_gt.nii.gz") and os.path.isfile(i["label"]) for i in items)


def test_volumes_are_resampled_to_pixdim_and_padded_to_the_patch(acdc):
    item = list_items("acdc", acdc, "site-1")[0]
    img = nib.load(item["image"])
    zooms, shape = img.header.get_zooms(), img.shape
    fine, coarse = (load_volumes([item], "acdc", pixdim, (8, 8, 4), "site-1")[0]
                    for pixdim in ((1.0, 1.0, 10.0), (2.0, 2.0, 10.0)))
    # in-plane: extent / spacing, halved when the voxel doubles; z at the native slice count (10 mm ~ native)
    expected = round(shape[0] * float(zooms[0]) / 1.0)
    assert abs(fine["image"].shape[1] - expected) <= 1 and abs(coarse["image"].shape[1] - expected / 2) <= 1
    # intensity: the 1st percentile maps to 0 and the 99th to 1, clipped beyond: both ends are reached exactly
    assert fine["image"].dtype == torch.float32
    assert float(fine["image"].min()) == 0.0 and float(fine["image"].max()) == 1.0
    assert fine["image"].shape == fine["label"].shape and set(fine["label"].unique().tolist()) <= {0, 1, 2, 3}
    small = load_volumes([item], "acdc", (2.0, 2.0, 10.0), (64, 64, 16), "site-1")[0]
    assert small["image"].shape[1:] >= (64, 64, 16)  # padded up to the patch


def test_a_corrupt_file_and_a_foreign_label_are_named_with_the_site(acdc, tmp_path):
    item = dict(list_items("acdc", acdc, "site-1")[0])
    bad = tmp_path / "broken.nii.gz"
    bad.write_bytes(gzip.compress(b"not a nifti"))
    with pytest.raises(Seg3DDataError, match=r"site site-1: .*broken\.nii\.gz.*cannot be loaded"):
        load_volumes([{**item, "image": str(bad)}], "acdc", (2.0, 2.0, 10.0), (8, 8, 4), "site-1")
    lab = nib.load(item["label"])
    data = np.asarray(lab.dataobj).copy()
    data[0, 0, 0] = 7
    foreign = tmp_path / "foreign_gt.nii.gz"
    nib.save(nib.Nifti1Image(data, lab.affine), foreign)
    with pytest.raises(Seg3DDataError, match=r"foreign_gt\.nii\.gz: label values \[7\] are not acdc classes"):
        load_volumes([{**item, "label": str(foreign)}], "acdc", (2.0, 2.0, 10.0), (8, 8, 4), "site-1")


def test_hvsmr_uses_the_same_pipeline(tmp_path):
    write_synthetic_hvsmr(tmp_path, n_subjects=1, seed=0, shape=(24, 24, 16))
    items = list_items("hvsmr", str(tmp_path), "site-1")
    vol = load_volumes(items, "hvsmr", (1.5, 1.5, 1.5), (8, 8, 8), "site-1")[0]
    assert vol["id"] == "pat0" and set(vol["label"].unique().tolist()) <= {0, 1, 2}


@pytest.mark.parametrize("value", [256, 257, -255, 1.6])
def test_labels_are_checked_before_the_uint8_cast(acdc, tmp_path, value):
    """Issue 45: 256 became background, 257 and -255 RV and 1.6 became 1: the uint8 cast ran before the check."""
    item = dict(list_items("acdc", acdc, "site-1")[0])
    lab = nib.load(item["label"])
    data = np.asarray(lab.dataobj).astype(np.float32)
    data[2, 2, 0] = value
    bad = tmp_path / "wraps_gt.nii.gz"
    nib.save(nib.Nifti1Image(data, lab.affine), bad)
    with pytest.raises(Seg3DDataError, match=r"wraps_gt\.nii\.gz: label values \[.*\] are not acdc classes"):
        load_volumes([{**item, "label": str(bad)}], "acdc", (1.5, 1.5, 10.0), (8, 8, 4), "site-1")


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_a_non_finite_image_voxel_is_refused_naming_the_file(acdc, tmp_path, value):
    item = dict(list_items("acdc", acdc, "site-1")[0])
    img = nib.load(item["image"])
    data = np.asarray(img.dataobj).astype(np.float32)
    data[3, 3, 0] = value
    bad = tmp_path / "nan_image.nii.gz"
    nib.save(nib.Nifti1Image(data, img.affine), bad)
    with pytest.raises(Seg3DDataError, match=r"site site-1: .*nan_image\.nii\.gz.*1 voxel\(s\) are NaN or infinite"):
        load_volumes([{**item, "image": str(bad)}], "acdc", (1.5, 1.5, 10.0), (8, 8, 4), "site-1")
