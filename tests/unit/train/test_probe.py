"""Frozen-encoder probes (fedssl.train.probe): the U-Net probe leaves the encoder bit-identical and trains the
decoder on the local protocol's split; the ViT linear probe fits a head on frozen mean-pooled tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fedssl.train.probe as probe
from fedssl.data.image_synthetic import write_synthetic_images
from fedssl.data.images import load_image_records
from fedssl.data.volume import Volume
from fedssl.models.unet import ENCODER_MODULES, TINY_FEATURES, UNetEncoder
from fedssl.models.vit import TINY_DECODER, TINY_VIT, MAEViT
from fedssl.train.classifier import ClassifierLocalTrainer, ClassifierSettings
from fedssl.train.probe import DecoderTrainer, FrozenEncoderUNet, fit_logistic, frozen_encoder_probe, linear_probe
from fedssl.train.protocol import local_finetune
from fedssl.train.segmentation import init_unet

torch.set_num_threads(1)


def site_volumes(n_sites=2, per_site=5):
    """Tiny labelled volumes (as tests/unit/train/test_protocol.py): n_folds=5 -> 4 train / 1 validation patient."""
    rng = np.random.default_rng(0)
    out = {}
    for s in range(n_sites):
        vols = []
        for p in range(per_site):
            for phase in ("ED", "ES"):
                label = rng.integers(0, 4, size=(2, 32, 32)).astype(np.uint8)
                vols.append(Volume(f"s{s}p{p}", phase, (label / 3.0).astype(np.float32), label, f"site-{s + 1}"))
        out[f"site-{s + 1}"] = vols
    return out


def encoder_init():
    """A "pre-trained" encoder: random weights whose BatchNorm layers have statistics (one training-mode batch)."""
    torch.manual_seed(3)
    enc = UNetEncoder(TINY_FEATURES)
    enc(torch.rand(4, 1, 32, 32))
    return enc.state_dict()


def is_encoder(key):
    return key.split(".", 1)[0] in ENCODER_MODULES


KW = dict(site="site-1", n_labelled=1, fold=0, features=TINY_FEATURES, epochs=2, batch_size=2, lr=1e-2)


def test_the_probe_leaves_the_encoder_bit_identical_and_trains_the_decoder(monkeypatch):
    init = encoder_init()
    start = init_unet(init, features=TINY_FEATURES, seed=0).state_dict()
    seen, per_volume = [], []
    original = probe.dice_per_volume

    def spy(model, *a, **k):
        seen.append(model)
        per_volume.extend(original(model, *a, **k))
        return per_volume

    monkeypatch.setattr(probe, "dice_per_volume", spy)
    row = frozen_encoder_probe(site_volumes(), init, method="fcl", **KW)
    after = seen[0].state_dict()
    assert all(torch.equal(after[k], start[k]) for k in start if is_encoder(k))
    assert any(not torch.equal(after[k], start[k]) for k in start if not is_encoder(k))
    assert row["mode"] == "probe" and row["method"] == "fcl"
    # the row's Dice is the mean over the validation volumes of the trained model's per-volume Dice (pooled over
    # both sites: fold 0 holds out one patient per site -> 2 patients x ED/ES = 4 volumes)
    assert len(per_volume) == 4 == row["n_val_volumes"]
    assert row["dice"] == pytest.approx(sum(r["mean"] for r in per_volume) / 4)
    assert row["LV"] == pytest.approx(sum(r["LV"] for r in per_volume) / 4)


def test_a_random_encoder_gets_the_statistics_of_the_labelled_slices_and_keeps_its_weights(monkeypatch):
    """Issue 44: a random encoder with BatchNorm has no statistics (mean 0, variance 1); the probe gives its
    layers those of the site's labelled slices before the decoder trains, and changes no weight."""
    start = init_unet("random", features=TINY_FEATURES, seed=0).state_dict()
    seen = []
    monkeypatch.setattr(probe, "dice_per_volume", lambda model, *a, **k: seen.append(model) or
                        [{"mean": 0.0, "RV": 0.0, "MYO": 0.0, "LV": 0.0}])
    frozen_encoder_probe(site_volumes(), "random", **KW)
    after = seen[0].state_dict()
    key = "down_4.convs.conv_1.adn.N."
    assert int(after[key + "num_batches_tracked"]) > 0 and not torch.equal(after[key + "running_var"],
                                                                            start[key + "running_var"])
    assert all(torch.equal(after[k], start[k]) for k in start if is_encoder(k) and "running" not in k
               and "num_batches" not in k)


def test_encoder_is_out_of_the_optimiser_and_stays_in_eval_mode():
    model = FrozenEncoderUNet(init_unet("random", features=TINY_FEATURES, seed=0))
    trainer = DecoderTrainer(model, lr=1e-3, batch_size=2, total_steps=4, seed=0)
    optimised = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    encoder = {id(p) for p in model.encoder_parameters()}
    assert not optimised & encoder and optimised == {id(p) for p in model.decoder_parameters()}
    assert all(not p.requires_grad for p in model.encoder_parameters())
    model.train()
    assert model.training and not any(m.training for enc in model.encoder_modules() for m in enc.modules())
    assert trainer.scheduler.optimizer is trainer.optimizer  # the cosine schedule drives the decoder's optimiser


def test_the_probe_uses_the_local_protocols_split_and_row():
    sv = site_volumes()
    row = frozen_encoder_probe(sv, "random", **KW)
    (local,) = [r for r in local_finetune(sv, {"random": "random"}, n_labelled=[1], folds=[0], features=TINY_FEATURES,
                                          epochs=1, batch_size=2, max_steps_per_epoch=1) if r["site"] == "site-1"]
    for key in ("train_patients", "val_patients", "n_train_volumes", "n_val_volumes", "n_labelled", "fold", "site"):
        assert row[key] == local[key], key
    assert set(row) == set(local)
    # the fine-tuning protocol's step floor holds for the probe too: 4 slices at batch 2 = 2 steps an epoch, so a
    # floor of 9 steps turns KW's 2 epochs into 5
    assert row["epochs"] == 2 and frozen_encoder_probe(sv, "random", **{**KW, "min_steps": 9})["epochs"] == 5
    with pytest.raises(ValueError, match="site='site-9' is not among"):
        frozen_encoder_probe(sv, "random", **{**KW, "site": "site-9"})


def test_fit_logistic_separates_separable_points():
    x = torch.tensor([[-2.0, 0.0], [-1.0, 1.0], [1.0, -1.0], [2.0, 0.0]])
    y = torch.tensor([0, 0, 1, 1])
    head = fit_logistic(x, y, 2, steps=200, seed=0)
    assert torch.equal(head(x).argmax(dim=1), y)


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    root = tmp_path_factory.mktemp("retina")
    write_synthetic_images(root, "retina", n_images=12, seed=0, image_size=40)
    return load_image_records(str(root), "retina", site="site-1")


VIT = dict(dataset="retina", site="site-1", **TINY_VIT, label_fraction=1.0, val_fraction=0.25, steps=50)


def test_linear_probe_uses_the_fine_tuning_split_and_a_frozen_encoder(records, monkeypatch):
    pretrained = MAEViT(**TINY_VIT, **TINY_DECODER, seed=5).state_dict()
    seen = []
    original = probe.vit_features
    monkeypatch.setattr(probe, "vit_features", lambda model, *a, **k: (seen.append(model), original(model, *a, **k))[1])
    pooled = []
    original_pooled = probe._pooled
    monkeypatch.setattr(probe, "_pooled", lambda *a, **k: pooled.append(original_pooled(*a, **k)) or pooled[-1])
    out = linear_probe(records, pretrained, method="fed-mae", **VIT)
    encoder = {k: v for k, v in seen[0].state_dict().items() if k.startswith("encoder.")}
    assert all(torch.equal(v, pretrained[k]) for k, v in encoder.items())  # the pre-trained encoder, untouched
    settings = ClassifierSettings(**TINY_VIT, drop_path_rate=0.0, label_fraction=1.0, val_fraction=0.25)
    ft = ClassifierLocalTrainer(records, settings, num_rounds=1, site="site-1")
    assert (out["n_labelled"], out["n_test"]) == (len(ft.train_set), len(ft.val_set))
    assert out["mode"] == "linear_probe"
    # accuracy recomputed by hand from the same frozen features: standardised with the LABELLED features' statistics,
    # the logistic head refitted with the same seed, argmax against the held-out labels
    (xs, ys), (xt, yt) = pooled
    mean, std = xs.mean(dim=0), xs.std(dim=0, unbiased=False).clamp(min=1e-6)
    head = fit_logistic((xs - mean) / std, ys, 2, steps=50, seed=0)
    with torch.no_grad():
        expected = float((head((xt - mean) / std).argmax(dim=1) == yt).float().mean())
    assert out["accuracy"] == expected and out["n_test"] == len(yt)
    again = linear_probe(records, pretrained, method="fed-mae", **VIT)
    assert again == out  # seeded: the same numbers


def test_local_split_is_the_local_protocols_split_and_refuses_an_unknown_site():
    from fedssl.train.protocol import local_finetune, local_split

    vols = site_volumes()
    train_ids, train_vols, val_ids, val_vols = local_split(vols, "site-2", 2, 1)
    (row,) = local_finetune(vols, {"r": "random"}, n_labelled=[2], folds=[1], features=TINY_FEATURES, epochs=1,
                            batch_size=2, sites=["site-2"])
    assert (train_ids, val_ids) == (row["train_patients"], row["val_patients"])
    assert len(train_vols) == row["n_train_volumes"] == 4 and len(val_vols) == row["n_val_volumes"]
    assert all(v.patient_id in train_ids for v in train_vols)
    with pytest.raises(ValueError, match="site='site-9' is not among the sites"):
        local_split(vols, "site-9", 1, 0)
