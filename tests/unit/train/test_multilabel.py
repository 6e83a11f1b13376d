"""MultiLabelLocalTrainer (fedssl.train.multilabel) on a tiny DenseNet and in-memory images: the losses by method,
warm-up then epochs, FedBN+, abort within one step, the restart state, checked loading and what is uploaded."""

from __future__ import annotations

import io
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedssl.core.trainer import LocalTrainer, StopRequested
from fedssl.eval.auroc import labelled_bce, labelled_mean_auroc
from fedssl.models.densenet import MultiLabelDenseNet, is_bn_key
from fedssl.train.multilabel import MultiLabelLocalTrainer, MultiLabelSettings, check_multilabel_args

SETTINGS = MultiLabelSettings(growth_rate=8, block_config=(2, 2, 2, 2), num_init_features=16, hidden_features=4,
                              dropout=0.0, batch_size=4, warmup_epochs=1, warmup_lr=1e-2, lr=1e-2, local_epochs=2,
                              n_bootstrap=0)


class Images(torch.utils.data.Dataset):
    """Random 32x32 images (seeded) with the given multi-hot targets."""

    def __init__(self, targets, seed):
        self.y = torch.as_tensor(targets, dtype=torch.float32)
        self.x = torch.randn(len(self.y), 3, 32, 32, generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i].clone()


def make(method="surgical", backbone="fedavg", classes=("A", "B"), head=None, n=8, **settings):
    # every class positive and negative
    targets = [[float((i >> j) & 1) for j in range(len(classes))] for i in range(n)]
    splits = {"train": Images(targets, 0), "val": Images(targets, 1), "test": Images(targets, 2)}
    return MultiLabelLocalTrainer(splits, classes, head or classes, method=method, backbone=backbone, site="site-1",
                                  settings=replace(SETTINGS, **settings))


def params(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def same(a, b, keys=None):
    return all(torch.equal(a[k], b[k]) for k in (keys if keys is not None else a))


# ---------------------------------------------------------------------------------------------- losses
def test_vanilla_treats_missing_classes_as_negative():
    t = make("vanilla", classes=["A", "C"], head=["A", "B", "C"])
    loss = t.loss(torch.tensor([[5.0, 5.0, -5.0]]), torch.tensor([[1.0, 0.0]]))  # A positive, C negative
    sp = F.softplus  # BCE with logits: softplus(-z) for a positive, softplus(z) for a negative
    # all three columns count; B (non-local) has target 0 and a logit of +5: a large penalty
    assert torch.isclose(loss, (sp(torch.tensor(-5.0)) + sp(torch.tensor(5.0)) + sp(torch.tensor(-5.0))) / 3)


def test_partial_loss_masks_non_local_classes():
    t = make("partial_loss", classes=["A", "C"], head=["A", "B", "C"])
    y = torch.tensor([[1.0, 0.0]])
    a = t.loss(torch.tensor([[5.0, 5.0, -5.0]]), y)
    b = t.loss(torch.tensor([[5.0, -40.0, -5.0]]), y)  # the non-local logit does not matter
    assert torch.isclose(a, b) and torch.isclose(a, F.softplus(torch.tensor(-5.0)))  # mean over the 2 local entries


@pytest.mark.parametrize("method", ["surgical", "personalised", "individual", "centralised"])
def test_own_head_methods_use_plain_bce_without_unlabelled_entries(method):
    t = make(method, classes=["C", "A", "B"])
    logits = torch.tensor([[0.3, -1.0, 2.0]])
    assert torch.isclose(t.loss(logits, torch.tensor([[1.0, 0.0, 1.0]])),
                         F.binary_cross_entropy_with_logits(logits, torch.tensor([[1.0, 0.0, 1.0]])))
    # pooled data: a class the image's source does not label (NaN) is left out
    expected = F.binary_cross_entropy_with_logits(logits[:, [0, 2]], torch.tensor([[1.0, 0.0]]))
    assert torch.isclose(t.loss(logits, torch.tensor([[1.0, float("nan"), 0.0]])), expected)


def test_a_site_class_outside_the_head_is_refused():
    with pytest.raises(ValueError, match=r"site-1: classes \['C'\] are not columns"):
        make("vanilla", classes=["A", "C"], head=["A", "B"])


# ---------------------------------------------------------------------------------------------- training
def test_round_zero_warms_the_head_up_once_then_trains_every_weight():
    t = make(n=8)  # 2 batches of 4 per epoch
    assert isinstance(t, LocalTrainer)
    before = params(t.model)
    t.warm_up()
    after = params(t.model)
    features = [k for k in before if k.startswith("features.")]
    assert same(before, after, features)  # frozen backbone, batch-norm statistics included
    assert not torch.equal(before["classifier.weight"], after["classifier.weight"])
    assert all(p.requires_grad for p in t.model.parameters()) and t.warmed_up and t.epoch == 1

    t = make(n=8)
    r0 = t.train_round(0)
    assert (r0.steps, r0.samples, t.epoch) == (4, 8, 3)  # warm-up epoch + 2 local epochs of 2 steps
    assert set(r0.metrics) == {"warmup_loss", "lr"} and r0.metrics["lr"] == SETTINGS.lr and np.isfinite(r0.loss)
    assert len(r0.curve) == 4  # the 4 local steps; the warm-up's steps are not part of the round's curve
    assert r0.loss == pytest.approx(sum(p["loss"] for p in r0.curve) / 4)
    before = params(t.model)
    r1 = t.train_round(1)
    assert (r1.steps, t.epoch) == (4, 5) and set(r1.metrics) == {"lr"}  # no second warm-up
    assert not torch.equal(before["features.conv0.weight"], t.model.state_dict()["features.conv0.weight"])


def test_max_steps_per_epoch_caps_every_epoch():
    t = make(n=16, max_steps_per_epoch=1, warmup_epochs=0)
    assert t.train_round(0).steps == 2


def test_fedbn_plus_keeps_batchnorm_at_its_initial_values():
    t = make(backbone="fedbn_plus")
    before = params(t.model)
    t.train_round(0)
    t.train_round(1)
    after = params(t.model)
    bn = [k for k in before if is_bn_key(k)]
    assert bn and same(before, after, bn)
    assert not torch.equal(before["features.conv0.weight"], after["features.conv0.weight"])
    assert all(not p.requires_grad for n, p in t.model.named_parameters() if is_bn_key(n))


def test_should_stop_stops_within_one_step():
    t = make(n=16, warmup_epochs=0)  # 4 steps per epoch
    calls = []

    def should_stop():
        calls.append(1)
        return len(calls) > 2

    with pytest.raises(StopRequested):
        t.train_round(0, should_stop)
    steps = {int(s["step"]) for s in t.optimizer.state.values()}
    assert steps == {2} and len(calls) == 3  # asked before every step; the third answer stopped it

    t = make(warmup_epochs=2)
    with pytest.raises(StopRequested):
        t.train_round(0, lambda: True)  # stopped inside the warm-up: the backbone is trainable again
    assert all(p.requires_grad for p in t.model.parameters()) and not t.warmed_up


# ---------------------------------------------------------------------------------------------- state
def test_state_round_trip_continues_bit_identically():
    a = make(dropout=0.3)  # dropout draws from the global RNG
    torch.manual_seed(0)
    a.train_round(0)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)  # the checkpoint path
    saved = a.state_dict()
    b = make(dropout=0.3)
    b.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    assert (b.warmed_up, b.epoch) == (True, 3) and same(params(a.model), params(b.model))
    torch.manual_seed(1)
    ra = a.train_round(1)
    torch.manual_seed(1)
    rb = b.train_round(1)
    assert ra.loss == rb.loss and "warmup_loss" not in rb.metrics
    assert same(params(a.model), params(b.model))
    assert not same(saved["model"], params(a.model))  # the state is a copy, not the live tensors
    with pytest.raises(ValueError, match=r"site-1: the saved state was written for head \['A', 'B'\]"):
        make("personalised").load_state_dict(saved)
    with pytest.raises(ValueError, match="saved state was written"):
        make(classes=("B", "A")).load_state_dict(saved)


# ---------------------------------------------------------------------------------------------- exchange
def other_state(classes=("A", "B"), seed=5):
    return {k: v.numpy() for k, v in MultiLabelDenseNet(list(classes), 8, (2, 2, 2, 2), 16, hidden_features=4,
                                                        seed=seed).state_dict().items()}


def test_load_global_keeps_local_tensors_and_rejects_surprises():
    t = make(backbone="fedbn")
    bn_before = {k: v.clone() for k, v in t.model.state_dict().items() if is_bn_key(k)}
    sent = {k: v for k, v in other_state().items() if not is_bn_key(k)}  # BN held back (FedBN)
    kept = t.load_global(sent)
    assert kept == sorted(bn_before)
    st = t.model.state_dict()
    assert same(bn_before, st, list(bn_before))  # own batch-norm kept
    assert np.array_equal(st["features.conv0.weight"].numpy(), sent["features.conv0.weight"])
    with pytest.raises(ValueError, match=r"site-1: the received model .* has 1 keys this model does not have"):
        t.load_global({**sent, "extra.weight": np.zeros(1)})
    with pytest.raises(ValueError, match="lacks 1 keys of this model"):
        t.load_global({k: v for k, v in sent.items() if k != "features.conv0.weight"})
    with pytest.raises(ValueError, match=r"classifier.bias has shape \(3,\), this model expects \(2,\)"):
        t.load_global({**sent, "classifier.bias": np.zeros(3, np.float32)})
    # a key a server-side filter declared held back may be missing too
    t.load_global({k: v for k, v in sent.items() if k != "features.conv0.weight"}, keep_local=["features.conv0.weight"])
    # under FedAvg batch-norm comes from the server
    with pytest.raises(ValueError, match="lacks"):
        make().load_global(sent)


def test_personalised_and_individual_keep_their_heads():
    t = make("personalised")
    head = t.model.state_dict()["classifier.weight"].clone()
    kept = t.load_global({k: v for k, v in other_state().items() if not k.startswith("classifier.")})
    assert (kept == ["classifier.bias", "classifier.weight"]
            and torch.equal(t.model.state_dict()["classifier.weight"], head))
    t = make("individual")
    before = params(t.model)
    assert t.load_global({}) == [] and same(before, params(t.model))  # nothing received after round 0


def test_global_state_is_what_the_method_uploads():
    keys = list(make().model.state_dict())
    assert list(make().global_state()) == keys
    assert list(make("personalised").global_state()) == [k for k in keys if not k.startswith("classifier.")]
    assert make("individual").global_state() == {}
    t = make()
    t.global_state()["features.conv0.weight"].zero_()  # detached copies
    assert t.model.state_dict()["features.conv0.weight"].abs().sum() > 0


# ---------------------------------------------------------------------------------------------- evaluation
def test_validation_is_nan_aware_bce_and_mean_auroc_over_the_sites_columns():
    t = make("vanilla", classes=["A", "C"], head=["A", "B", "C"])
    t.model.eval()
    with torch.no_grad():
        probs = torch.sigmoid(t.model(t.splits["val"].x)).numpy()[:, [0, 2]]
    val = t.evaluate("val")
    assert val == {"val_loss": labelled_bce(probs, t.splits["val"].y.numpy()),
                   "val_auroc": labelled_mean_auroc(probs, t.splits["val"].y.numpy())}
    test = t.evaluate("test")
    assert test["model"] == "local model" and list(test["test"]["per_class"]) == ["A", "C"] and test["n_test"] == 8
    with pytest.raises(ValueError, match="split='train'"):
        t.evaluate("train")


def test_global_model_has_the_network_head_and_the_sites_batchnorm():
    t = make(backbone="fedbn")
    t.train_round(0)  # the site's batch-norm statistics move away from their initial values
    sent = {k: v for k, v in other_state(["A", "B", "C"]).items() if not is_bn_key(k)}
    model = t.global_model(sent, ["A", "B", "C"])
    st, own = model.state_dict(), t.model.state_dict()
    assert (model.classes == ["A", "B", "C"]
            and np.array_equal(st["classifier.weight"].numpy(), sent["classifier.weight"]))
    assert all(torch.equal(st[k], own[k]) for k in own if is_bn_key(k))
    assert t.evaluate("test", model=model, source="global model")["model"] == "global model"


def test_argument_checks_name_the_argument():
    check_multilabel_args("X", {})  # the paper defaults pass
    with pytest.raises(ValueError, match=r"X: argument lr=0 is invalid"):
        check_multilabel_args("X", {"lr": 0})
    assert MultiLabelSettings.of({"lr": 0.1, "device": "cpu", "no_such": 1}) == MultiLabelSettings(lr=0.1, device="cpu")
    with pytest.raises(ValueError, match=r"X: argument amp=1 is invalid"):
        check_multilabel_args("X", {"amp": 1})


# -------------------------------------------------------------------------------- per-site randomness (issue 13 item 9)
class Recording(Images):
    """Images that record the order in which training reads them."""

    def __init__(self, targets, seed):
        super().__init__(targets, seed)
        self.read = []

    def __getitem__(self, i):
        self.read.append(int(i))
        return super().__getitem__(i)


def test_batch_order_follows_the_site_seed_and_the_model_the_job_seed():
    """Two sites of one job (seed 0) build the same initial weights (job seed) but read their data in the order of
    their own seed: epoch e's order is permutation(default_rng([site_seed(0, site), e])), as fedssl.data.cxr.batches
    documents; before the fix both sites read in the order of seed 0."""
    from fedssl.core.seeds import site_seed

    torch.set_num_threads(1)
    targets = [[float((i >> j) & 1) for j in range(2)] for i in range(8)]
    trainers = {}
    for site in ("site-1", "site-2"):
        splits = {"train": Recording(targets, 0), "val": Images(targets, 1)}
        trainers[site] = MultiLabelLocalTrainer(splits, ["A", "B"], ["A", "B"], method="surgical", site=site,
                                                settings=replace(SETTINGS, warmup_epochs=0, local_epochs=1))
    assert same(params(trainers["site-1"].model), params(trainers["site-2"].model))
    for site, t in trainers.items():
        t.train_round(0)
        expected = np.random.default_rng([site_seed(0, site), 0]).permutation(8).tolist()
        assert t.splits["train"].read == expected, site
    assert trainers["site-1"].splits["train"].read != trainers["site-2"].splits["train"].read


def test_a_sites_patient_split_and_augmentation_use_its_own_seed(tmp_path):
    """load_splits: the patient split and the augmentation seed of site s are those of site_seed(job seed, s)."""
    from fedssl.core.seeds import site_seed
    from fedssl.data.cxr import load_cxr_site, patient_split
    from fedssl.data.cxr_synthetic import write_synthetic_nih
    from fedssl.train.multilabel import load_splits

    write_synthetic_nih(tmp_path, 20, seed=0, image_size=16)
    s = replace(SETTINGS, image_size=16)
    records = load_cxr_site(str(tmp_path), "nih", site="x")
    for site in ("site-1", "site-2"):
        got = load_splits(str(tmp_path), "nih", site, ["Atelectasis"], s)
        _, _, test = patient_split(records, fractions=s.split, seed=site_seed(0, site))
        assert [r.path for r in got["test"].records] == [r.path for r in test]
        assert got["train"].seed == site_seed(0, site)
    one, two = (load_splits(str(tmp_path), "nih", site, ["Atelectasis"], s) for site in ("site-1", "site-2"))
    assert [r.path for r in one["test"].records] != [r.path for r in two["test"].records]


def test_an_nih_layout_external_root_is_scored_on_the_classes_nih_annotates(tmp_path):
    """The ablation's held-out NIH test set (paper sec. 2.4.1) as external set: an NIH-layout folder is read as NIH,
    so a head class NIH does not annotate (Lung Opacity) has no truth there and is listed as such."""
    from fedssl.data.cxr import load_nih
    from fedssl.data.cxr_synthetic import write_synthetic_nih

    torch.set_num_threads(1)
    write_synthetic_nih(tmp_path / "nih_test", 6, seed=0, image_size=32)
    t = make(classes=("Atelectasis", "Lung Opacity"), image_size=32)
    ext = t.evaluate("test", external_root=str(tmp_path / "nih_test"))["external"]
    assert list(ext["per_class"]) == ["Atelectasis"] and ext["not_annotated"] == ["Lung Opacity"]
    assert ext["n_images"] == len(load_nih(tmp_path / "nih_test"))


def test_amp_runs_the_densenet_in_bfloat16_and_keeps_the_loss_float32():
    from fedssl.core.trainer import MixedPrecision
    from tests.unit.core.test_mixed_precision import float32, layer_dtypes

    tr = make()
    tr.precision = MixedPrecision("cpu", True, force=torch.bfloat16)
    seen = layer_dtypes(tr.model)
    stats = tr.train_round(0)
    assert seen and set(seen) == {torch.bfloat16} and np.isfinite(stats.loss) and float32(tr.model)


def test_loader_workers_give_the_same_round_and_are_checked(loader_workers):
    a, b = make(), make(workers=2)
    assert a.train_round(0).loss == b.train_round(0).loss
    assert all(torch.equal(v, b.model.state_dict()[k]) for k, v in a.model.state_dict().items())
    assert loader_workers and set(loader_workers) == {2}  # only the workers=2 trainer built DataLoaders
    with pytest.raises(ValueError, match="workers=-1"):
        check_multilabel_args("X", {"workers": -1})
