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


# issue 43 item 7: every method's settings are declared once, in its settings dataclass; the executor's arguments (what
# FLARE builds it with from the job's JSON) are exactly its fields, stored verbatim, and a misspelt name is refused
SETTINGS = [
    ("fedssl.flare.fcl_executor", "FCLExecutor", "fedssl.train.fcl", "FCLSettings"),
    ("fedssl.flare.byol_executor", "BYOLExecutor", "fedssl.train.byol", "BYOLSettings"),
    ("fedssl.flare.fedclf_executor", "FedCLFExecutor", "fedssl.train.fedclf", "FedCLFSettings"),
    ("fedssl.flare.mim_executor", "MIMExecutor", "fedssl.train.mim", "MIMSettings"),
    ("fedssl.flare.classifier_executor", "ClassifierExecutor", "fedssl.train.classifier", "ClassifierSettings"),
    ("fedssl.flare.resnet_classifier_executor", "ResNetClassifierExecutor", "fedssl.train.resnet_classifier",
     "ResNetClassifierSettings"),
    ("fedssl.flare.multilabel_executor", "MultiLabelExecutor", "fedssl.train.multilabel", "MultiLabelSettings"),
    ("fedssl.flare.feddra_executor", "FedDRAExecutor", "fedssl.train.feddra", "FedDRASettings"),
    ("fedssl.flare.segmentation_executor", "SegmentationExecutor", "fedssl.train.segmentation", "SegmentationSettings"),
    ("fedssl.flare.seg3d_executor", "Seg3DExecutor", "fedssl.train.seg3d", "Seg3DSettings"),
]


def test_every_trainer_executor_has_its_settings():
    import pkgutil

    import fedssl.flare
    from fedssl.flare.trainer_executor import TrainerExecutor

    for info in pkgutil.iter_modules(fedssl.flare.__path__):
        __import__(f"fedssl.flare.{info.name}")
    methods = {cls.__name__ for cls in _subclasses(TrainerExecutor) if cls.__module__.startswith("fedssl.flare.")}
    assert methods == {cls for _, cls, _, _ in SETTINGS}


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


@pytest.mark.parametrize("module, cls, settings_module, settings", SETTINGS)
def test_the_arguments_are_the_settings_fields_and_a_typo_is_refused(module, cls, settings_module, settings):
    import dataclasses
    import importlib
    import inspect

    executor = getattr(importlib.import_module(module), cls)
    settings_class = getattr(importlib.import_module(settings_module), settings)
    fields = {f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
              for f in dataclasses.fields(settings_class)}  # a dict default ({}) is a default_factory
    assert {k: p.default for k, p in inspect.signature(executor).parameters.items()} == fields
    ex = executor()
    assert ex.settings == settings_class() and all(getattr(ex, k) == v for k, v in fields.items() if k != "classes")
    with pytest.raises(TypeError, match=rf"^{cls}: unknown argument seeed; it accepts .*\bseed\b"):
        executor(seeed=1)


# issue 47: SSL-FL's fine-tuning regularisation, checked when FLARE builds the executor from the job's JSON
@pytest.mark.parametrize("kw, message", [
    ({"label_smoothing": 1.0}, "label_smoothing=1.0 is invalid; use a value in [0, 1) (0 = none; SSL-FL's "
                               "fine-tuning scripts: 0.1)"),
    ({"mixup_alpha": -1}, "mixup_alpha=-1 is invalid; use 0 (off) or a positive Beta alpha (SSL-FL's Fed-MAE "
                          "fine-tuning scripts: 0.8)"),
    ({"cutmix_alpha": None}, "cutmix_alpha=None is invalid; use 0 (off) or a positive Beta alpha"),
    ({"cutmix_minmax": [0.2]}, "cutmix_minmax=[0.2] is invalid; use null (box size from lam, the reference's) or "
                               "[min, max] with 0 < min < max <= 1"),
    ({"mixup_prob": 2}, "mixup_prob=2 is invalid; use a probability in [0, 1] (reference: 1.0)"),
    ({"mixup_switch_prob": -0.5}, "mixup_switch_prob=-0.5 is invalid; use a probability in [0, 1] (reference: 0.5)"),
    ({"mixup_mode": "pair"}, "mixup_mode='pair' is invalid; use \"batch\""),
    ({"erasing_prob": 1.25}, "erasing_prob=1.25 is invalid; use a probability in [0, 1]"),
    ({"erasing_mode": "noise"}, "erasing_mode='noise' is invalid; use one of ['pixel', 'rand', 'const']"),
    ({"erasing_count": 0}, "erasing_count=0 is invalid; use a positive number of boxes per erased image"),
])
def test_classifier_executor_checks_the_regularisation(kw, message):
    import re

    from fedssl.flare.classifier_executor import ClassifierExecutor

    with pytest.raises(ValueError, match="^" + re.escape(f"ClassifierExecutor: argument {message}")):
        ClassifierExecutor(**kw)
    ok = ClassifierExecutor(mixup_alpha=0.8, cutmix_alpha=1.0, cutmix_minmax=[0.2, 0.8], label_smoothing=0.1)
    assert ok.cutmix_minmax == [0.2, 0.8] and ok.settings.batch_augment().mixing
