"""The synthetic ACDC writer (fedssl.data.acdc_synthetic): writing some sites alone."""

import numpy as np

from fedssl.data.acdc_synthetic import write_synthetic_acdc


def test_only_sites_writes_the_same_patients_as_a_full_write(tmp_path):
    """Writing one site alone (parallel writers) gives that site exactly the files of a full write, and no other."""
    import nibabel as nib

    kw = dict(n_patients=4, n_sites=2, seed=3, shape=(16, 16), n_frames=2, slices_range=(2, 3))
    full = write_synthetic_acdc(tmp_path / "full", **kw)
    part = write_synthetic_acdc(tmp_path / "part", only_sites=["site-2"], **kw)
    assert part == full  # the assignment of every site is still returned
    assert not (tmp_path / "part" / "site-1").exists()
    names = sorted(p.relative_to(tmp_path / "full") for p in (tmp_path / "full" / "site-2").rglob("*.nii.gz"))
    assert names and names == sorted(p.relative_to(tmp_path / "part")
                                     for p in (tmp_path / "part" / "site-2").rglob("*.nii.gz"))
    for name in names:
        a = np.asarray(nib.load(tmp_path / "full" / name).dataobj)
        b = np.asarray(nib.load(tmp_path / "part" / name).dataobj)
        assert np.array_equal(a, b)
