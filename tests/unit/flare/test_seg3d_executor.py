import pytest

from fedssl.flare.seg3d_executor import Seg3DExecutor, patient_of, split_patients

TINY = dict(filters=[4, 8, 16], pixdim=[2.0, 2.0, 10.0], roi_size=[16, 16, 8])


def test_split_by_patient_is_seeded_and_keeps_phases_together():
    patients = [f"patient{i:03d}" for i in range(1, 11)]
    train, val = split_patients(patients, 0.2, 0, seed=5)
    assert len(val) == 2 and len(train) == 8 and not set(train) & set(val)
    assert (train, val) == split_patients(list(reversed(patients)), 0.2, 0, seed=5)  # order of discovery irrelevant
    assert split_patients(patients, 0.2, 0, seed=6) != (train, val)
    few, val2 = split_patients(patients, 0.2, 2, seed=5)
    assert val2 == val and len(few) == 2 and set(few) <= set(train)
    assert split_patients(["p1", "p2"], 0.2, 0, seed=0)[1] != []  # at least one validation patient
    assert split_patients(["p1"], 0.2, 0, seed=0) == (["p1"], [])
    assert patient_of("patient007_ES", "acdc") == "patient007" and patient_of("pat3", "hvsmr") == "pat3"


@pytest.mark.parametrize("arg,value,fix", [
    ("batch_size", 3, "a multiple of num_samples=2"),
    ("dataset", "brats", "dataset"),
    ("roi_size", [16, 18, 8], "multiple of"),
    ("val_fraction", 1.0, "a fraction in"),
    ("amp", 1, "true or false"),
])
def test_arguments_are_checked_with_the_fix(arg, value, fix):
    with pytest.raises(ValueError, match=fix):
        Seg3DExecutor(**{**TINY, arg: value})


def test_arguments_are_stored_verbatim():
    ex = Seg3DExecutor(**TINY, n_labelled=2)
    assert (ex.filters, ex.roi_size, ex.n_labelled, ex.dataset) == ([4, 8, 16], [16, 16, 8], 2, "acdc")
