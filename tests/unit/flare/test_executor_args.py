import pytest

from fedssl.flare.fcl_executor import FCLExecutor
from fedssl.flare.segmentation_executor import SegmentationExecutor


@pytest.mark.parametrize("kw, needle", [
    ({"image_size": 100}, "image_size=100"),
    ({"batch_size": 4}, "batch_size=4"),
    ({"frames": "es"}, "frames='es'"),
    ({"feature_exchange": "yes"}, "feature_exchange='yes'"),
    ({"features": [4, 4]}, "6 positive"),
    ({"tau": 0}, "tau=0"),
])
def test_fcl_executor_rejects_bad_args(kw, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        FCLExecutor(**kw)


def test_segmentation_executor_rejects_bad_fold():
    with pytest.raises(ValueError, match="fold=5"):
        SegmentationExecutor(fold=5)
