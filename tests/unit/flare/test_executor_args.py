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


# every executor whose batches come from a dataset, with its data loader switch (issue 17 item 5); the ACDC
# fine-tuning and FedDRA executors keep their in-memory batches in the training process (jobs/README.md)
LOADER_EXECUTORS = [
    ("fedssl.flare.fcl_executor", "FCLExecutor"),
    ("fedssl.flare.byol_executor", "BYOLExecutor"),
    ("fedssl.flare.fedclf_executor", "FedCLFExecutor"),
    ("fedssl.flare.mim_executor", "MIMExecutor"),
    ("fedssl.flare.classifier_executor", "ClassifierExecutor"),
    ("fedssl.flare.resnet_classifier_executor", "ResNetClassifierExecutor"),
    ("fedssl.flare.multilabel_executor", "MultiLabelExecutor"),
    ("fedssl.flare.seg3d_executor", "Seg3DExecutor"),
]


@pytest.mark.parametrize("module, cls", LOADER_EXECUTORS)
def test_every_dataset_executor_takes_loader_workers(module, cls):
    import importlib

    executor = getattr(importlib.import_module(module), cls)
    assert executor(workers=3).workers == 3  # stored verbatim
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match=rf"{cls}: argument workers={bad!r} is invalid"):
            executor(workers=bad)


def test_feddra_executor_takes_loader_workers():
    from fedssl.flare.feddra_executor import FedDRAExecutor

    assert FedDRAExecutor(workers=2).workers == 2
    with pytest.raises(ValueError, match=r"FedDRAExecutor: argument workers=-1 is invalid"):
        FedDRAExecutor(workers=-1)
