"""fedssl.train.vlp_finetune: FedDRA's few-shot classification (a linear layer fine-tuned on the frozen encoder)."""

import pytest
import torch
from torch import nn

from fedssl.train.vlp_finetune import (FEDDRA_FINETUNE, FewShotFinetuneSettings, _epoch_batches, _resize_crop, _Run,
                                       few_shot_finetune, finetune_linear, finetune_seed, settings_dict)
from fedssl.train.vlp_probe import few_shot_probe, few_shot_subset

NO_CROP = {"crop_scale": 1.0}


class _Items(torch.utils.data.Dataset):
    """Items ``(x [D], label)``; feature vectors stand in for images (no crop)."""

    def __init__(self, x, y):
        self.x, self.y = x, [int(v) for v in y]

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def _line(n_per):
    """Class 0 at x = -1, -2, ...; class 1 at x = +1, +2, ... (1-D, separable by the sign)."""
    mags = torch.arange(1, n_per + 1, dtype=torch.float32)
    x = torch.cat([-mags, mags]).reshape(-1, 1)
    return x, [0] * n_per + [1] * n_per


def _clusters(n_per, seed, noise=0.3):
    g = torch.Generator().manual_seed(seed)
    centres = torch.tensor([[4.0, 0.0, 0.0], [0.0, 4.0, 0.0], [0.0, 0.0, 4.0]])
    x = torch.cat([c + noise * torch.randn(n_per, 3, generator=g) for c in centres])
    return x, torch.arange(3).repeat_interleave(n_per).tolist()


# ------------------------------------------------------------------ the toy sets: 100 %
def test_separable_two_classes_reach_full_accuracy():
    """x < 0 is class 0, x > 0 class 1: a linear layer trained 50 epochs reaches 100 % on the held-out points."""
    (xs, ys), (xt, yt) = _line(10), _line(5)
    xt = xt * 1.5  # -1.5 ... -7.5 and +1.5 ... +7.5
    out = few_shot_finetune(nn.Identity(), _Items(xs, ys), _Items(xt, yt), dataset="toy", fractions=(0.5, 1.0),
                            lr=0.05, **NO_CROP)
    assert list(out) == ["50%", "100%"]
    for key, n_train in (("50%", 10), ("100%", 20)):
        r = out[key]
        assert (r["accuracy"], r["balanced_accuracy"], r["auroc"]) == (1.0, 1.0, 1.0), key
        assert (r["n_train"], r["n_test"], r["epochs_run"], r["selected_epoch"]) == (n_train, 10, 50, 50)
        assert r["train_encoder"] is False


def test_separable_three_classes_reach_full_accuracy():
    (xs, ys), (xt, yt) = _clusters(10, 0), _clusters(10, 1)
    out = few_shot_finetune(nn.Identity(), _Items(xs, ys), _Items(xt, yt), dataset="toy", fractions=(0.5,),
                            lr=0.05, **NO_CROP)
    assert out["50%"]["accuracy"] == 1.0 and out["50%"]["auroc"] == 1.0


def test_binary_is_one_logit_multiclass_one_per_class():
    """RSNA (2 classes) as MGCA: one logit and a binary cross-entropy; COVIDx (3): three logits, cross-entropy."""
    g = torch.Generator().manual_seed(0)
    two = _Run("t", nn.Identity(), None, 2, FEDDRA_FINETUNE, g, torch.device("cpu"))
    three = _Run("t", nn.Identity(), None, 3, FEDDRA_FINETUNE, g, torch.device("cpu"))
    assert two.make_head(5).out_features == 1 and three.make_head(5).out_features == 3
    z = torch.tensor([[0.0], [2.0]])
    # BCE of logit 0 for label 1: log 2; of logit 2 for label 0: log(1 + e^2)
    expected = (torch.log(torch.tensor(2.0)) + torch.log1p(torch.exp(torch.tensor(2.0)))) / 2
    assert two.loss(z, torch.tensor([1, 0])).item() == pytest.approx(expected.item())
    assert two.probs(z)[:, 1].tolist() == pytest.approx([0.5, torch.sigmoid(torch.tensor(2.0)).item()])


def test_head_initialisation_is_nn_linear_default_range_drawn_from_the_generator():
    state = torch.get_rng_state()
    head = _Run("t", nn.Identity(), None, 3, FEDDRA_FINETUNE, torch.Generator().manual_seed(3),
                torch.device("cpu")).make_head(16)
    assert torch.equal(torch.get_rng_state(), state)  # the global generator is not drawn from
    bound = 1 / 4  # 1 / sqrt(16)
    g = torch.Generator().manual_seed(3)
    assert torch.equal(head.weight, (torch.rand(3, 16, generator=g) * 2 - 1) * bound)
    assert torch.equal(head.bias, (torch.rand(3, generator=g) * 2 - 1) * bound)


def test_dropout_mask_is_drawn_from_the_generator():
    s = FewShotFinetuneSettings(dropout=0.5)
    run = _Run("t", nn.Identity(), None, 2, s, torch.Generator().manual_seed(4), torch.device("cpu"))
    run.head = nn.Identity()
    f = torch.ones(3, 5)
    state = torch.get_rng_state()
    out = run.logits(f, train=True)
    assert torch.equal(torch.get_rng_state(), state)
    keep = torch.rand(3, 5, generator=torch.Generator().manual_seed(4)) >= 0.5
    assert torch.equal(out, keep.float() * 2)  # kept features scaled by 1 / (1 - p)
    assert torch.equal(run.logits(f, train=False), f)  # evaluation: no dropout


# ------------------------------------------------------------------ the labelled subset: the probe's
class _IdRecorder(nn.Module):
    """Feature = x[:, 1:] (times a parameter); records the item ids in x[:, 0], its mode and grad of every call."""

    def __init__(self):
        super().__init__()
        self.ids, self.modes = [], set()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        self.ids += [int(v) for v in x[:, 0].tolist()]
        self.modes.add((self.training, torch.is_grad_enabled()))
        return x[:, 1:] * self.scale


def _id_items(x, y, offset):
    ids = torch.arange(offset, offset + len(y), dtype=torch.float32).reshape(-1, 1)
    return _Items(torch.cat([ids, x], dim=1), y)


def test_labelled_subset_is_the_probes():
    (xs, ys), (xt, yt) = _clusters(20, 0), _clusters(4, 1)
    train, test = _id_items(xs, ys, 0), _id_items(xt, yt, 1000)
    for seed in (0, 5):
        for f in (0.1, 0.25):
            enc = _IdRecorder()
            r = few_shot_finetune(enc, train, test, dataset="rsna", seed=seed, fractions=(f,), epochs=2, **NO_CROP)
            seen = sorted({i for i in enc.ids if i < 1000})
            assert enc.modes == {(False, False)}  # frozen: eval mode, no graph, in training too (MGCA)
            assert seen == few_shot_subset(ys, f, seed)
            assert sorted(i for i in set(enc.ids) if i >= 1000) == list(range(1000, 1012))  # the whole test set
            probe = few_shot_probe(lambda x: x[:, 1:], train, test, fractions=(f,), seed=seed)
            key = next(iter(probe))
            assert r[key]["n_train"] == probe[key]["n_train"] == len(seen)


def test_each_epoch_sees_every_labelled_image_once_in_batches_of_the_setting():
    idx = list(range(100, 200))
    g = torch.Generator().manual_seed(0)
    chunks = _epoch_batches(idx, FEDDRA_FINETUNE, g)
    assert [len(c) for c in chunks] == [48, 48]  # the last 4 dropped, as MGCA's drop_last
    assert len(set(sum(chunks, []))) == 96 and set(sum(chunks, [])) <= set(idx)
    assert [len(c) for c in _epoch_batches(idx, FewShotFinetuneSettings(drop_last=False), g)] == [48, 48, 4]
    small = _epoch_batches(idx[:10], FEDDRA_FINETUNE, g)
    assert len(small) == 1 and sorted(small[0]) == idx[:10]  # fewer than a batch: one batch of all


# ------------------------------------------------------------------ determinism
def test_same_seed_same_numbers_and_global_rng_untouched():
    (xs, ys), (xt, yt) = _clusters(20, 0, noise=2.5), _clusters(20, 1, noise=2.5)
    train, test = _Items(xs, ys), _Items(xt, yt)
    kw = dict(dataset="covidx", fractions=(0.25,), epochs=5, lr=0.05, dropout=0.3, **NO_CROP)
    torch.manual_seed(1)
    a = few_shot_finetune(nn.Identity(), train, test, seed=0, **kw)
    torch.manual_seed(2)
    state = torch.get_rng_state()
    b = few_shot_finetune(nn.Identity(), train, test, seed=0, **kw)
    assert torch.equal(torch.get_rng_state(), state)
    assert a == b
    c = few_shot_finetune(nn.Identity(), train, test, seed=1, **kw)
    assert c["25%"]["auroc"] != a["25%"]["auroc"]


def test_run_seed_depends_on_seed_dataset_and_fraction():
    seeds = {finetune_seed(s, d, f) for s in (0, 1) for d in ("rsna", "covidx") for f in (0.01, 0.1)}
    assert len(seeds) == 8
    assert finetune_seed(0, "rsna", 0.01) == finetune_seed(0, "rsna", 0.01)


def test_crop_is_drawn_from_the_generator_and_centred_for_evaluation():
    """8 x 8 images resized to 12 x 12 (bilinear) and cropped back: at offsets in [0, 4] drawn from the generator
    (rows of every image, then columns), or at the centre, round((12 - 8) / 2) = 2."""
    x = torch.arange(2 * 64, dtype=torch.float32).reshape(2, 1, 8, 8)
    big = torch.nn.functional.interpolate(x, size=(12, 12), mode="bilinear", align_corners=False)
    state = torch.get_rng_state()
    for seed in range(4):
        a = _resize_crop(x, 1.5, torch.Generator().manual_seed(seed))
        g = torch.Generator().manual_seed(seed)
        tops, lefts = torch.randint(0, 5, (2,), generator=g), torch.randint(0, 5, (2,), generator=g)
        for i in range(2):
            assert torch.equal(a[i], big[i, :, tops[i]:tops[i] + 8, lefts[i]:lefts[i] + 8]), (seed, i)
    assert torch.equal(torch.get_rng_state(), state)
    crops = {tuple(_resize_crop(x, 1.5, torch.Generator().manual_seed(s))[0].flatten().tolist()) for s in range(8)}
    assert len(crops) > 1  # offsets vary with the generator
    assert torch.equal(_resize_crop(x, 1.5, None), big[..., 2:10, 2:10])
    assert torch.equal(_resize_crop(x, 1.0, None), x)
    assert round(224 * FEDDRA_FINETUNE.crop_scale) == 256  # MGCA: 256 px images, 224 px crops


# ------------------------------------------------------------------ frozen vs trained encoder
def _scaled_encoder():
    enc = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        enc.weight.fill_(1.0)
    return enc


def test_frozen_encoder_comes_back_bit_identical_in_its_mode():
    (xs, ys), (xt, yt) = _line(10), _line(5)
    enc = _scaled_encoder().train()
    s = FewShotFinetuneSettings(crop_scale=1.0, lr=0.1)
    r = finetune_linear(enc, _Items(xs, ys), list(range(20)), _Items(xt, yt), 2, seed=0, settings=s)
    assert enc.weight.item() == 1.0 and enc.weight.requires_grad and enc.training
    assert r["accuracy"] == 1.0


def test_trained_encoder_takes_one_adamw_step_of_lr():
    """With the encoder trained, one epoch (one batch) moves its single weight by AdamW's first step: the decoupled
    decay w * lr * wd, then lr * sign(grad) (up to Adam's eps): 1 - 0.1 * 0.5 -+ 0.1 = 0.85 or 1.05.  (Adam with an
    L2 term would give 0.9 or 1.1; SGD lr * grad.)"""
    (xs, ys), (xt, yt) = _line(10), _line(5)
    enc = _scaled_encoder()
    s = FewShotFinetuneSettings(crop_scale=1.0, lr=0.1, weight_decay=0.5, epochs=1, train_encoder=True)
    finetune_linear(enc, _Items(xs, ys), list(range(20)), _Items(xt, yt), 2, seed=0, settings=s)
    assert abs(enc.weight.item() - 0.95) == pytest.approx(0.1, abs=1e-6)


def test_few_shot_finetune_never_changes_the_callers_encoder():
    (xs, ys), (xt, yt) = _line(10), _line(5)
    for train_encoder in (False, True):
        enc = _scaled_encoder()
        out = few_shot_finetune(enc, _Items(xs, ys), _Items(xt, yt), dataset="rsna", fractions=(1.0,), lr=0.1,
                                train_encoder=train_encoder, **NO_CROP)
        assert enc.weight.item() == 1.0 and out["100%"]["train_encoder"] is train_encoder


class _ViaMethod(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        raise AssertionError("forward must not be used when features names a method")

    def image_features(self, x):
        return x * self.scale


def test_features_names_the_encoders_method():
    (xs, ys), (xt, yt) = _line(10), _line(5)
    out = few_shot_finetune(_ViaMethod(), _Items(xs, ys), _Items(xt, yt), dataset="rsna", fractions=(1.0,),
                            features="image_features", lr=0.1, **NO_CROP)
    assert out["100%"]["accuracy"] == 1.0


# ------------------------------------------------------------------ validation: early stopping, best epoch
def test_validation_selects_lowest_loss_epoch_and_stops_after_patience():
    (xs, ys), (xt, yt) = _line(10), _line(5)
    train, test = _Items(xs, ys), _Items(xt, yt)
    s = FewShotFinetuneSettings(crop_scale=1.0, lr=0.05, epochs=30, patience=3)
    same = finetune_linear(nn.Identity(), train, list(range(20)), test, 2, seed=0, settings=s, val_items=train)
    assert (same["epochs_run"], same["selected_epoch"]) == (30, 30)  # the loss keeps falling
    flipped = _Items(xs, [1 - y for y in ys])  # every epoch of training raises this loss
    r = finetune_linear(nn.Identity(), train, list(range(20)), test, 2, seed=0, settings=s, val_items=flipped)
    assert (r["epochs_run"], r["selected_epoch"]) == (1 + 3, 1)
    # the tested head is epoch 1's: the same test numbers as one epoch without validation (same draws)
    one = finetune_linear(nn.Identity(), train, list(range(20)), test, 2, seed=0,
                          settings=FewShotFinetuneSettings(crop_scale=1.0, lr=0.05, epochs=1))
    four = finetune_linear(nn.Identity(), train, list(range(20)), test, 2, seed=0,
                           settings=FewShotFinetuneSettings(crop_scale=1.0, lr=0.05, epochs=4))
    assert r["test_loss"] == one["test_loss"] != four["test_loss"]


# ------------------------------------------------------------------ settings and argument checks
def test_settings_dict_is_json_ready():
    d = settings_dict()
    assert d["fractions"] == [0.01, 0.1] and d["betas"] == [0.9, 0.999] and d["train_encoder"] is False


_TR, _TE = _Items(*_line(3)), _Items(*_line(2))


@pytest.mark.parametrize("call, arg", [
    (lambda: few_shot_finetune(nn.Identity(), _TR, _TE, dataset="t", fractions=(0.0,)), "fractions"),
    (lambda: few_shot_finetune(nn.Identity(), _TR, _TE, dataset="t", fractions=(0.1, 0.1)), "fractions"),
    (lambda: few_shot_finetune(nn.Identity(), _TR, _TE, dataset="t", epochs=0), "epochs"),
    (lambda: few_shot_finetune(nn.Identity(), _TR, _TE, dataset="t", batch_size=0), "batch_size"),
    (lambda: few_shot_finetune(nn.Identity(), _TR, _TE, dataset="t", lr=-1.0), "lr"),
    (lambda: few_shot_finetune(nn.Identity(), _TR, _TE, dataset="t", weight_decay=float("nan")), "weight_decay"),
    (lambda: few_shot_finetune(nn.Identity(), _TR, _TE, dataset="t", betas=(0.9,)), "betas"),
    (lambda: few_shot_finetune(nn.Identity(), _TR, _TE, dataset="t", dropout=1.0), "dropout"),
    (lambda: few_shot_finetune(nn.Identity(), _TR, _TE, dataset="t", patience=0), "patience"),
    (lambda: few_shot_finetune(nn.Identity(), _TR, _TE, dataset="t", crop_scale=0.5), "crop_scale"),
    (lambda: few_shot_finetune(nn.Identity(), _TR, _TE, dataset="t", train_encoder="yes"), "train_encoder"),
    (lambda: few_shot_finetune(nn.Identity(), _TR, _TE, dataset="t", drop_last=1), "drop_last"),
    (lambda: few_shot_finetune(nn.Identity(), _TR, _TE, dataset=""), "dataset"),
    (lambda: few_shot_finetune(nn.Identity(), _TR, _TE, dataset="t", seed=-1), "seed"),
    (lambda: few_shot_finetune(nn.Identity(), _TR, _TE, dataset="t", train_labels=[0, 1]), "train_labels"),
    (lambda: few_shot_finetune(nn.Identity(), _TR, _TE, dataset="t", train_labels=[1, 1, 1, 0, 0, 0]),
     "train_labels"),
    (lambda: few_shot_finetune(nn.Identity(), _TR, _TE, dataset="t", settings={"lr": 1}), "settings"),
    (lambda: few_shot_finetune(nn.Identity(), _TR, _TE, dataset="t", features="nope"), "features"),
    (lambda: few_shot_finetune(nn.Identity(), _TR, _Items(*_line(2)), dataset="t"), "train_items"),  # crop, 1-D
    (lambda: few_shot_finetune(nn.Identity(), _TR, _Items(torch.ones(2, 1), [0, 2]), dataset="t", **NO_CROP),
     "test_items"),
    (lambda: finetune_linear(nn.Identity(), _TR, [0, 9], _TE, 2, seed=0), "train_indices"),
    (lambda: finetune_linear(nn.Identity(), _TR, [0, 0], _TE, 2, seed=0), "train_indices"),
    (lambda: finetune_linear(nn.Identity(), _TR, [0], _TE, 1, seed=0), "n_classes"),
    (lambda: finetune_linear(lambda x: x, _TR, [0], _TE, 2, seed=0), "encoder"),
    (lambda: finetune_linear(nn.Identity(), _TR, [0], _TE, 2, seed=0, val_items=[]), "val_items"),
    (lambda: finetune_linear(nn.Linear(1, 1), _TR, [0], _TE, 2, seed=0, device="meta"), "device"),
    (lambda: finetune_linear(nn.Identity(), _TR, [0], _TE, 2, seed=0, settings=FewShotFinetuneSettings(epochs=0)),
     "epochs"),
    (lambda: finetune_seed(0, "", 0.1), "dataset"),
])
def test_argument_errors_name_argument_value_and_fix(call, arg):
    with pytest.raises(ValueError, match=f"argument {arg}=") as err:
        call()
    message = str(err.value)
    assert "\n" not in message and "; " in message  # one line: argument, value, then the fix


def test_unknown_override_is_named():
    with pytest.raises(TypeError, match="unknown argument learning_rate"):
        few_shot_finetune(nn.Identity(), _TR, _TE, dataset="t", learning_rate=1e-3)
