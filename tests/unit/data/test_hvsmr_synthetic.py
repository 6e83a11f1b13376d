"""The synthetic HVSMR stand-in (fedssl.data.hvsmr_synthetic): the challenge's layout, read unchanged by the loader,
with a plausible whole heart (FCL section 5: "expert annotations of the blood pool and ventricular myocardium")."""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from fedssl.data.hvsmr import list_subjects, load_hvsmr
from fedssl.data.hvsmr_synthetic import write_synthetic_hvsmr

SHAPE = (32, 32, 16)


@pytest.fixture(scope="module")
def synth(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hvsmr")
    assert write_synthetic_hvsmr(root, n_subjects=3, shape=SHAPE, seed=1) == ["pat0", "pat1", "pat2"]
    return root


def _raw(root: Path, name: str) -> nib.Nifti1Image:
    return nib.load(str(root / name))


def _enclosed_blood(label: np.ndarray) -> int:
    """Blood-pool voxels whose first non-blood neighbour along +x, -x, +y and -y is myocardium (a walled cavity)."""
    count = 0
    for x, y, z in zip(*np.nonzero(label == 2)):
        rays = (label[x + 1:, y, z], label[:x, y, z][::-1], label[x, y + 1:, z], label[x, :y, z][::-1])
        firsts = [next((v for v in ray if v != 2), 0) for ray in rays]
        count += all(v == 1 for v in firsts)
    return count


def test_files_headers_and_loader(synth: Path) -> None:
    assert sorted(p.name for p in synth.iterdir())[:2] == ["training_axial_crop_pat0-label.nii.gz",
                                                           "training_axial_crop_pat0.nii.gz"]
    assert list_subjects(synth) == ["pat0", "pat1", "pat2"]
    for n in range(3):
        image = _raw(synth, f"training_axial_crop_pat{n}.nii.gz")
        label = _raw(synth, f"training_axial_crop_pat{n}-label.nii.gz")
        assert image.shape == label.shape == SHAPE
        assert image.get_data_dtype() == np.int16 and label.get_data_dtype() == np.uint8
        # the documented draw: subject n seeds default_rng([seed, n]) and takes in-plane, then slice spacing
        want_xy, want_z = np.random.default_rng([1, n]).uniform(0.7, 1.0, size=2)
        assert image.header.get_zooms() == pytest.approx((want_xy, want_xy, want_z), rel=1e-6)
        assert label.header.get_zooms() == image.header.get_zooms()
        assert set(np.unique(np.asarray(label.dataobj)).tolist()) == {0, 1, 2}
    assert [v.n_slices for v in load_hvsmr(synth, image_size=32)] == [16, 16, 16]


def test_anatomy_matches_the_labels(synth: Path) -> None:
    for n in range(3):
        label = np.asarray(_raw(synth, f"training_axial_crop_pat{n}-label.nii.gz").dataobj)
        image = np.asarray(_raw(synth, f"training_axial_crop_pat{n}.nii.gz").dataobj).astype(np.float64)
        # SSFP contrast: bright blood, darker myocardium
        assert image[label == 2].mean() > 1.4 * image[label == 1].mean()
        assert np.median(image[label == 1]) < np.percentile(image[label == 2], 10)  # no cavity labelled myocardium
        assert _enclosed_blood(label) > 20  # ventricular cavities inside their myocardial wall
        per_slice = [(int((label[..., z] == 1).sum()), int((label[..., z] == 2).sum())) for z in range(SHAPE[2])]
        # the great vessels leave through the top (superior) slice: blood pool there, no ventricular myocardium
        assert per_slice[-1][0] == 0 and per_slice[-1][1] > 0
        # the lowest slice holding the heart cuts the apex: myocardium only
        lowest = next(z for z, (myo, blood) in enumerate(per_slice) if myo or blood)
        assert per_slice[lowest][0] > 0 and per_slice[lowest][1] == 0


def test_deterministic_seeded_and_archive_folders(synth: Path, tmp_path: Path) -> None:
    write_synthetic_hvsmr(tmp_path / "same", n_subjects=2, shape=SHAPE, seed=1, archive_folders=True)
    write_synthetic_hvsmr(tmp_path / "other", n_subjects=1, shape=SHAPE, seed=2)
    assert (tmp_path / "same" / "Ground truth" / "training_axial_crop_pat1-label.nii.gz").is_file()
    a, b = load_hvsmr(synth, image_size=32, subjects=["pat1"]), load_hvsmr(tmp_path / "same", image_size=32)[1:]
    assert np.array_equal(a[0].image, b[0].image) and np.array_equal(a[0].label, b[0].label)
    c = load_hvsmr(tmp_path / "other", image_size=32)[0]
    assert not np.array_equal(load_hvsmr(synth, image_size=32, subjects=["pat0"])[0].label, c.label)


@pytest.mark.parametrize("kwargs, message", [
    ({"n_subjects": 0}, "n_subjects=0"), ({"variant": "coronal"}, "variant='coronal'"),
    ({"shape": (32, 32)}, r"shape=\(32, 32\)"), ({"spacing_range": (1.0, 0.5)}, r"spacing_range=\(1.0, 0.5\)"),
])
def test_bad_arguments(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        write_synthetic_hvsmr(tmp_path, **kwargs)
    assert not any(tmp_path.iterdir())
