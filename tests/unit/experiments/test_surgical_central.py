"""Centralised baseline: the pooled dataset (a site's missing classes negatives, as the paper's sec. 2.3 and its public
code; or unknown and masked out, the switch), the trainer loss on pooled targets, and a tiny end-to-end run
evaluated like the federated runs."""

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

from fedssl.experiments.surgical_central import CENTRAL, PooledDataset, run_centralised
from fedssl.train.multilabel import MultiLabelLocalTrainer, MultiLabelSettings

HEAD = ["A", "B", "C"]


def test_trainer_loss_masks_unknown_classes_for_the_central_model():
    tiny = MultiLabelSettings(growth_rate=8, block_config=(2, 2, 2, 2), num_init_features=16, hidden_features=4)
    central = MultiLabelLocalTrainer({}, HEAD, HEAD, method=CENTRAL, settings=tiny)
    logits = torch.tensor([[0.3, -1.0, 2.0]])
    targets = torch.tensor([[1.0, float("nan"), 0.0]])
    expected = F.binary_cross_entropy_with_logits(logits[:, [0, 2]], targets[:, [0, 2]])
    assert torch.isclose(central.loss(logits, targets), expected)


class Part(torch.utils.data.Dataset):
    def __init__(self, targets):
        self.t, self.epoch = torch.tensor(targets), None

    def __len__(self):
        return len(self.t)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __getitem__(self, i):
        return torch.full((1,), float(i)), self.t[i]


def test_pooled_dataset_treats_a_sites_missing_classes_as_negatives_by_default():
    """Paper sec. 2.3 (Centralized): "All missing classes in the combined dataset are treated as negatives"; the
    public code's Dataset.merge fills them with 0.  site-1 labels A, B (not C); site-2 labels C, B (not A)."""
    p1, p2 = Part([[1.0, 0.0]]), Part([[0.0, 1.0], [1.0, 1.0]])
    pooled = PooledDataset([p1, p2], [["A", "B"], ["C", "B"]], HEAD, ["site-1", "site-2"])
    assert len(pooled) == 3 and pooled.missing == "negative"
    assert [pooled[i][1].tolist() for i in range(3)] == [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 1.0, 1.0]]
    pooled.set_epoch(3)
    assert p1.epoch == p2.epoch == 3
    with pytest.raises(ValueError, match="one class list"):
        PooledDataset([p1], [["A"], ["B"]], HEAD, ["site-1"])
    with pytest.raises(ValueError, match="missing.*'negative', 'ignore'"):
        PooledDataset([p1], [["A", "B"]], HEAD, ["site-1"], missing="zero")


def test_pooled_dataset_masks_a_sites_missing_classes_when_switched_to_ignore():
    p1, p2 = Part([[1.0, 0.0]]), Part([[0.0, 1.0], [1.0, 1.0]])  # site-1: A, B; site-2: C, B
    pooled = PooledDataset([p1, p2], [["A", "B"], ["C", "B"]], HEAD, ["site-1", "site-2"], missing="ignore")
    _, y0 = pooled[0]
    assert y0[:2].tolist() == [1.0, 0.0] and torch.isnan(y0[2])
    _, y2 = pooled[2]
    assert torch.isnan(y2[0]) and y2[1:].tolist() == [1.0, 1.0]


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    from fedssl.data.cxr_synthetic import write_synthetic_surgical

    root = tmp_path_factory.mktemp("cxr")
    write_synthetic_surgical(root, n_patients=16, seed=0, image_size=32)  # + 8 external (MIMIC-like) patients
    return root


def test_tiny_centralised_run_is_evaluated_like_the_federated_runs(tiny_data, tmp_path):
    from fedssl.data.cxr import CHEXPERT_CLASSES, NIH_CLASSES

    sets = ["server.scatter_and_gather.num_rounds=2", "client.cxr_trainer.warmup_epochs=1",
            "client.cxr_trainer.image_size=32", "client.cxr_trainer.n_bootstrap=10",
            "client.cxr_trainer.max_steps_per_epoch=1", "client.cxr_trainer.local_epochs=1",
            "server.final_evaluation.model=best", f"client.cxr_trainer.external_test_root={tiny_data / 'mimic'}"]
    res = run_centralised(str(tiny_data / "{site}"), str(tmp_path / "central"), profile="quick", sets=sets,
                          say=lambda m: None)
    with open(tmp_path / "central" / "results.json") as f:
        saved = json.load(f)
    assert saved["method"] == "centralised" and saved["site_classes"] == {"site-1": list(NIH_CLASSES),
                                                                         "site-2": list(CHEXPERT_CLASSES)}
    assert len(saved["global_classes"]) == 20 and len(saved["table"]["shared_classes"]) == 7
    for site, classes in saved["site_classes"].items():
        assert list(saved["sites"][site]["test"]["per_class"]) == classes  # each site's test split, its classes
        assert len(saved["sites"][site]["external"]["per_class"]) == 20  # external set: every class
    assert ([h["round"] for h in saved["history"]] == [0, 1]
            and all(math.isfinite(h["val_loss"]) for h in saved["history"]))
    assert "round" in saved["model_source"] and res["wall_time_s"] > 0 and saved["missing_classes"] == "negative"
    assert saved["batchnorm"] == "frozen"  # the job's backbone is fedbn_plus (the paper's)
    assert os.path.isfile(tmp_path / "central" / "results.md") and os.path.isfile(tmp_path / "central" / "auroc.png")


def test_centralised_keeps_batchnorm_frozen_as_the_public_code_does(tiny_data, tmp_path, monkeypatch):
    """Issue 47: the reference's centralised training unfreezes the base model after the warm-up except its
    BatchNormalization layers; the baseline used to train them.  The running statistics stay the start ones when
    frozen (the default under the job's fedbn_plus) and move when trained (the default under fedavg)."""
    import torch

    import fedssl.experiments.surgical_central as sc
    from fedssl.train.multilabel import build_model

    built = []

    class Recording(sc.MultiLabelLocalTrainer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            built.append(self)

    monkeypatch.setattr(sc, "MultiLabelLocalTrainer", Recording)
    sets = ["server.scatter_and_gather.num_rounds=1", "client.cxr_trainer.warmup_epochs=1",
            "client.cxr_trainer.image_size=32", "client.cxr_trainer.n_bootstrap=10",
            "client.cxr_trainer.max_steps_per_epoch=1", "client.cxr_trainer.local_epochs=1"]
    moved = {}
    for backbone in ("fedbn_plus", "fedavg"):
        sc.run_centralised(str(tiny_data / "{site}"), str(tmp_path / backbone), profile="quick", say=lambda m: None,
                           sets=sets + [f"server.class_registration.backbone={backbone}"])
        model = built[-1].model
        bn = next(m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d))
        fresh = build_model(built[-1].head, built[-1].settings, None)
        bn0 = next(m for m in fresh.modules() if isinstance(m, torch.nn.BatchNorm2d))
        moved[backbone] = not torch.equal(bn.running_mean, bn0.running_mean)
    assert moved == {"fedbn_plus": False, "fedavg": True}


def test_centralised_refuses_a_missing_site_folder(tiny_data, tmp_path):
    with pytest.raises(ValueError, match="site-3"):
        run_centralised(str(tiny_data / "{site}"), str(tmp_path / "c"), sites=["site-1", "site-3"], profile="quick",
                        sets=["client.cxr_trainer.image_size=32"], say=lambda m: None)
