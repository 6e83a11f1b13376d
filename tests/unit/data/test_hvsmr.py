"""The HVSMR 2016 loader (fedssl.data.hvsmr): the challenge's layout, FCL section 5 preprocessing (0.7 mm in-plane,
axial slices), and one clear error naming the file for anything outside the layout."""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from fedssl.data.hvsmr import HVSMRDataError, PAPER_SPACING, list_subjects, load_hvsmr, load_subject, subject_files

ZOOMS = (1.4, 1.4, 1.0)


def _save(path: Path, data: np.ndarray, zooms: tuple[float, ...] = ZOOMS) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    img = nib.Nifti1Image(data, np.diag([*zooms[:3], 1.0]))
    img.header.set_zooms(zooms)
    nib.save(img, str(path))


def _pair() -> tuple[np.ndarray, np.ndarray]:
    """(X=4, Y=6, Z=2) image and labels: a 2 x 3 myocardium block and a 1 x 2 blood-pool block in slice 0 only."""
    image = np.zeros((4, 6, 2), dtype=np.int16)
    label = np.zeros((4, 6, 2), dtype=np.uint8)
    label[0:2, 0:3, 0] = 1
    label[3, 4:6, 0] = 2
    image[label == 1] = 300
    image[label == 2] = 900
    return image, label


def _subject(folder: Path, n: int, *, label_folder: Path | None = None, variant: str = "axial_crop") -> None:
    image, label = _pair()
    _save(folder / f"training_{variant}_pat{n}.nii.gz", image)
    _save((label_folder or folder) / f"training_{variant}_pat{n}-label.nii.gz", label)


def test_flat_layout_axial_slices_resampled_to_the_papers_spacing(tmp_path: Path) -> None:
    _subject(tmp_path, 0)
    (vol,) = load_hvsmr(tmp_path, image_size=16, site="hospital-a")
    assert PAPER_SPACING == 0.7  # FCL section 5: "r_f = 0.7 x 0.7 mm^2 for HVS MR"
    # slices along NIfTI's third (axial) axis; 1.4 mm -> 0.7 mm doubles 4 x 6 to 8 x 12, padded to 16 x 16
    assert vol.image.shape == vol.label.shape == (2, 16, 16)
    assert (vol.patient_id, vol.phase, vol.site) == ("pat0", "axial_crop", "hospital-a")
    assert int((vol.label[0] == 1).sum()) == 2 * 3 * 4 and int((vol.label[0] == 2).sum()) == 1 * 2 * 4
    assert not vol.label[1].any()
    # percentile min-max of the 3D volume: the 900 blood pool is above the 99th percentile -> 1, background 0
    assert vol.image[0][vol.label[0] == 2].max() == pytest.approx(1.0)
    assert vol.image[1].max() == pytest.approx(0.0)


def test_archive_folders_numeric_order_and_other_files_of_the_layout(tmp_path: Path) -> None:
    images, labels = tmp_path / "Training dataset", tmp_path / "Ground truth"
    for n in (10, 2):
        _subject(images, n, label_folder=labels)
    _subject(images, 2, label_folder=labels, variant="sa_crop")  # another version of the same subject
    _save(images / "testing_axial_crop_pat11.nii.gz", _pair()[0])  # the unlabelled test set
    (images / "README.txt").write_text("HVSMR 2016")
    assert list_subjects(tmp_path) == ["pat2", "pat10"]
    assert list_subjects(tmp_path, variant="sa_crop") == ["pat2"]
    files = subject_files(tmp_path)
    assert files["pat10"] == (images / "training_axial_crop_pat10.nii.gz",
                              labels / "training_axial_crop_pat10-label.nii.gz")
    assert load_subject(tmp_path, "pat10", image_size=16).label.sum() == 2 * 3 * 4 * 1 + 1 * 2 * 4 * 2


@pytest.mark.parametrize("name", ["training_axial_crop_pat0_label_A.nii.gz", "pat1.nii.gz",
                                  "training_axial_crop_pat1.mha"])
def test_a_file_outside_the_layout_is_refused_by_name(tmp_path: Path, name: str) -> None:
    _subject(tmp_path, 0)
    (tmp_path / name).write_bytes(b"x")
    with pytest.raises(HVSMRDataError, match=rf"\[site s1\] file is not part of the HVSMR 2016 layout: .*{name}"):
        list_subjects(tmp_path, site="s1")


def test_missing_partner_files_are_named(tmp_path: Path) -> None:
    _subject(tmp_path, 0)
    _save(tmp_path / "training_axial_crop_pat1.nii.gz", _pair()[0])
    with pytest.raises(HVSMRDataError,
                       match=r"image of subject pat1 has no label: .*training_axial_crop_pat1\.nii\.gz"):
        load_hvsmr(tmp_path)
    (tmp_path / "training_axial_crop_pat1.nii.gz").unlink()
    _save(tmp_path / "training_axial_crop_pat3-label.nii.gz", _pair()[1])
    with pytest.raises(HVSMRDataError, match=r"label of subject pat3 has no image: .*pat3-label\.nii\.gz"):
        load_hvsmr(tmp_path)


def test_layout_level_refusals(tmp_path: Path) -> None:
    with pytest.raises(HVSMRDataError, match="does not exist"):
        list_subjects(tmp_path / "nowhere")
    (tmp_path / "patient001").mkdir()  # an ACDC folder given by mistake
    with pytest.raises(HVSMRDataError, match="no HVSMR training subject of variant 'axial_crop' found"):
        list_subjects(tmp_path)
    (tmp_path / "Training dataset").mkdir()
    with pytest.raises(HVSMRDataError, match=r"layout is incomplete.*Ground truth"):
        list_subjects(tmp_path)
    (tmp_path / "Training dataset").rmdir()
    _subject(tmp_path, 0)
    _save(tmp_path / "training_axial_crop_pat0.nii", _pair()[0])
    with pytest.raises(HVSMRDataError, match=r"pat0 has two copies"):
        list_subjects(tmp_path)


@pytest.mark.parametrize("change, message", [
    # the 2 x 3 myocardium block: 0.5
    (lambda lab: lab.astype(np.float32) * 0.5, r"6 non-integer value\(s\), e\.g\. 0\.5"),
    (lambda lab: np.where(lab == 2, 3, lab).astype(np.uint8), r"label values 3 are not HVSMR 2016 classes"),
    (lambda lab: lab[:, :5], r"label shape \(4, 5, 2\) does not match image shape \(4, 6, 2\)"),
])
def test_bad_labels_are_refused_naming_the_label_file(tmp_path: Path, change, message) -> None:
    _subject(tmp_path, 0)
    _save(tmp_path / "training_axial_crop_pat0-label.nii.gz", change(_pair()[1]))
    with pytest.raises(HVSMRDataError, match=message + r".*training_axial_crop_pat0-label\.nii\.gz"):
        load_hvsmr(tmp_path)


def test_corrupt_file_is_named_and_nothing_is_half_loaded(tmp_path: Path) -> None:
    _subject(tmp_path, 0)
    _subject(tmp_path, 1)
    (tmp_path / "training_axial_crop_pat1.nii.gz").write_bytes(b"\x1f\x8b not really gzip")
    with pytest.raises(HVSMRDataError, match=r"corrupt or unreadable NIfTI file .*training_axial_crop_pat1\.nii\.gz"):
        load_hvsmr(tmp_path)
    assert [v.patient_id for v in load_hvsmr(tmp_path, subjects=["pat0"], image_size=16)] == ["pat0"]
    with pytest.raises(HVSMRDataError, match=r"subjects \['pat7'\] not found \(have pat0, pat1\)"):
        load_hvsmr(tmp_path, subjects=["pat7"])
