import pytest

from fedssl.flare.seg3d_executor import Seg3DExecutor

TINY = dict(filters=[4, 8, 16], pixdim=[2.0, 2.0, 10.0], roi_size=[16, 16, 8])


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
