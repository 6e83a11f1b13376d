"""Issue 42: no hidden global randomness.  Every local trainer draws its dropout, drop path, augmentations, batches,
banks and masks from what it owns, seeded from (seed, site), never from torch's, numpy's or Python's global
generators (fedssl.core.rng.owned_global_rng).  For every trainer, on tiny models and synthetic data:

- building it, one round and an evaluation leave the three global generators exactly as they were;
- two runs of one seed and site, with the global generators scrambled differently before each, give bit-identical
  weights; another seed, from the same received weights, gives other weights;
- the trainers that do draw from the global generators (dropout: FedDRA's BERT, the DenseNet's head; drop path: the
  ViTs) would change them without the owned RNG, and a client restarted from its checkpoint trains the round the
  uninterrupted one trains.
"""

from __future__ import annotations

import contextlib
import copy
import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import fedssl.train.classifier
import fedssl.train.classifier_loop
import fedssl.train.feddra
import fedssl.train.mim_loop
import fedssl.train.multilabel
from fedssl.core.tokenizer import PatchTokenizer
from fedssl.data.image_synthetic import write_synthetic_images
from fedssl.data.images import load_image_records
from fedssl.data.volume import Volume
from fedssl.models.dynunet3d import build_dynunet
from fedssl.models.unet import TINY_FEATURES
from fedssl.train.byol import BYOLLocalTrainer, BYOLSettings
from fedssl.train.classifier import ClassifierLocalTrainer, ClassifierSettings
from fedssl.train.fcl import FCLLocalTrainer, FCLSettings
from fedssl.train.fedclf import FedCLFLocalTrainer, FedCLFSettings
from fedssl.train.feddra import FedDRALocalTrainer, FedDRASettings
from fedssl.train.mim import MIMLocalTrainer, MIMSettings
from fedssl.train.multilabel import MultiLabelLocalTrainer, MultiLabelSettings
from fedssl.train.resnet_classifier import ResNetClassifierLocalTrainer, ResNetClassifierSettings
from fedssl.train.seg3d import Seg3DLocalTrainer, Seg3DSettings
from fedssl.train.segmentation import SegmentationLocalTrainer, SegmentationSettings, init_unet

torch.set_num_threads(1)
SITE = "site-1"


# ---------------------------------------------------------------------------------------------- synthetic data
def acdc_volumes(n: int, labelled: bool = False, seed: int = 0) -> list[Volume]:
    """``n`` volumes of 4 slices of 32 px (with a label map that follows the intensity when ``labelled``)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        image = rng.random((4, 32, 32), dtype=np.float32)
        label = np.minimum((image * 4).astype(np.uint8), 3) if labelled else None
        out.append(Volume(f"patient{i:03d}", "ED", image, label, site=SITE))
    return out


def seg3d_volume(seed: int, vid: str) -> dict:
    g = torch.Generator().manual_seed(seed)
    label = torch.zeros(1, 24, 24, 8, dtype=torch.uint8)
    label[0, 6:14, 6:14, 2:6] = 3
    label[0, 4:6, 6:14, 2:6] = 2
    label[0, 14:18, 8:12, 2:6] = 1
    image = (label.float() / 3 + 0.05 * torch.randn(label.shape, generator=g)).clamp(0, 1)
    return {"image": image, "label": label, "id": vid}


class Images(torch.utils.data.Dataset):
    """Fixed random 32 px images with multi-hot targets over two classes."""

    def __init__(self, seed: int, n: int = 8):
        self.y = torch.tensor([[float(i & 1), float((i >> 1) & 1)] for i in range(n)])
        self.x = torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i].clone()


class Data:
    """The synthetic sites, written on first use (module-scoped: each trainer type writes only what it reads)."""

    def __init__(self, factory):
        self.factory, self.cache = factory, {}

    def once(self, key: str, make: Callable):
        if key not in self.cache:
            self.cache[key] = make(self.factory.mktemp(key))
        return self.cache[key]

    def retina(self):
        def make(root):
            write_synthetic_images(root, "retina", n_images=40, seed=0, image_size=32)
            return load_image_records(str(root), "retina", site=SITE)
        return self.once("retina", make)

    def derm(self):
        def make(root):
            write_synthetic_images(root, "derm", n_images=24, seed=0, image_size=20)
            return load_image_records(root, "derm", site=SITE)
        return self.once("derm", make)

    def codebook(self):
        def make(root):
            path = str(root / "codebook.pt")
            PatchTokenizer(torch.randn(16, 48, generator=torch.Generator().manual_seed(0)), 4).save(path)
            return path
        return self.once("codebook", make)

    def mimic(self):
        def make(root):
            from fedssl.data.vlp import load_mimic_vlp
            from fedssl.data.vlp_synthetic import write_synthetic_mimic
            from fedssl.data.vocab import build_wordpiece_vocab, make_tokenizer, merge_word_counts, site_word_counts

            write_synthetic_mimic(str(root), n_patients=16, image_px=32, seed=0)
            records, _ = load_mimic_vlp(str(root), site=SITE)
            counts = site_word_counts([r.text for r in records], min_count=2)
            tok = make_tokenizer(vocab=build_wordpiece_vocab(merge_word_counts([counts], min_count=2), 256))
            return [r for r in records if r.split == "train"], [r for r in records if r.split == "test"], tok
        return self.once("mimic", make)


# ---------------------------------------------------------------------------------------------- the trainers
VIT = dict(image_size=32, patch_size=4, embed_dim=48, depth=2, num_heads=3)


def fcl(data, seed, site):
    settings = FCLSettings(n_partitions=2, features=[4, 4, 8, 8, 16, 4], proj_dim=4, batch_size=4, bank_size=16,
                           max_steps_per_round=2, seed=seed, image_size=32)
    return FCLLocalTrainer(acdc_volumes(4), settings, num_rounds=2, site=site)


def byol(data, seed, site):
    settings = BYOLSettings(n_partitions=2, features=[4, 4, 8, 8, 16, 4], proj_dim=4, pred_hidden=8, batch_size=2,
                            max_steps_per_round=2, seed=seed, image_size=32)
    return BYOLLocalTrainer(acdc_volumes(3), settings, num_rounds=2, site=site)


def fedclf(data, seed, site):
    settings = FedCLFSettings(dataset="derm", image_size=16, width=4, proj_dim=8, batch_size=4, bank_size=16,
                              max_steps_per_round=2, seed=seed)
    return FedCLFLocalTrainer(data.derm(), settings, num_rounds=2, site=site)


def mim_beit(data, seed, site):  # BEiT's ViT has drop path 0.1
    settings = MIMSettings(method="beit", mask_ratio=0.4, tokenizer_path=data.codebook(), vocab_size=16, batch_size=4,
                           lr=1e-3, warmup_rounds=1, max_steps_per_round=2, seed=seed, **VIT)
    return MIMLocalTrainer(data.retina()[:12], settings, num_rounds=3, site=site)


def classifier(data, seed, site):  # the fine-tuning ViT with drop path 0.1
    settings = ClassifierSettings(dataset="retina", drop_path_rate=0.1, batch_size=8, lr=1e-3, warmup_rounds=1,
                                  val_fraction=0.2, eval_batch_size=64, max_steps_per_epoch=2, seed=seed, **VIT)
    return ClassifierLocalTrainer(data.retina(), settings, num_rounds=3, site=site)


def resnet_classifier(data, seed, site):
    records = data.derm()
    settings = ResNetClassifierSettings(dataset="derm", image_size=16, width=4, batch_size=8, eval_batch_size=16,
                                        label_fraction=1.0, seed=seed)
    return ResNetClassifierLocalTrainer(records[:16], records[16:], settings, num_rounds=2, site=site)


def seg3d(data, seed, site):
    net = build_dynunet([4, 8, 16], (2.0, 2.0, 10.0), (16, 16, 8), 3, seed=0)
    settings = Seg3DSettings(filters=[4, 8, 16], pixdim=(2.0, 2.0, 10.0), roi_size=(16, 16, 8), lr=3e-3, batch_size=2,
                             num_samples=2, max_steps_per_epoch=1, seed=seed)
    return Seg3DLocalTrainer(net, [seg3d_volume(0, "a"), seg3d_volume(1, "b")], [seg3d_volume(3, "v")], settings,
                             num_rounds=2, site=site, device="cpu")


def segmentation(data, seed, site):
    volumes = acdc_volumes(3, labelled=True)
    settings = SegmentationSettings(features=TINY_FEATURES, batch_size=4, max_steps_per_epoch=2, seed=seed)
    return SegmentationLocalTrainer(init_unet("random", features=TINY_FEATURES, seed=0), volumes[:2], volumes[2:],
                                    settings, num_rounds=2, site=site)


def multilabel(data, seed, site):  # the DenseNet's head layer has dropout 0.3
    settings = MultiLabelSettings(growth_rate=8, block_config=(2, 2, 2, 2), num_init_features=16, hidden_features=8,
                                  dropout=0.3, batch_size=4, warmup_epochs=1, warmup_lr=1e-2, lr=1e-2, local_epochs=1,
                                  n_bootstrap=0, seed=seed)
    splits = {"train": Images(0), "val": Images(1), "test": Images(2)}
    return MultiLabelLocalTrainer(splits, ["A", "B"], ["A", "B"], method="surgical", site=site, settings=settings)


def feddra(data, seed, site):  # BERT's and the ViT's dropout
    train, test, tok = data.mimic()
    settings = FedDRASettings(preset="tiny", vocab_size=256, batch_size=4, steps=2, lr=1e-3, max_text_len=32,
                              holdout_fraction=0.2, dro_batch=3, seed=seed)
    return FedDRALocalTrainer(train, test, settings, tokenizer=tok, site=site)


@dataclass(frozen=True)
class Kind:
    build: Callable
    evaluate: str | None  # the split evaluate() reads; None: pre-training, nothing to evaluate
    #: the modules whose owned_global_rng keeps its global draws off the global generators (dropout / drop path)
    draws_globally: tuple = ()


KINDS = {
    "fcl": Kind(fcl, None),
    "byol": Kind(byol, None),
    "fedclf": Kind(fedclf, None),
    "mim_beit": Kind(mim_beit, None, (fedssl.train.mim_loop,)),
    "classifier": Kind(classifier, "val", (fedssl.train.classifier_loop, fedssl.train.classifier)),
    "resnet_classifier": Kind(resnet_classifier, "val"),
    "seg3d": Kind(seg3d, "val"),
    "segmentation": Kind(segmentation, "val"),
    "multilabel": Kind(multilabel, "val", (fedssl.train.multilabel,)),
    "feddra": Kind(feddra, "test", (fedssl.train.feddra,)),
}
DRAWS_GLOBALLY = [name for name, kind in KINDS.items() if kind.draws_globally]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return Data(tmp_path_factory)


@pytest.fixture(scope="module")
def received(data):
    """Per trainer type: the weights every run below receives before its round (a seed-0 build's)."""
    cache = {}

    def weights(name):
        if name not in cache:
            cache[name] = KINDS[name].build(data, 0, SITE).global_state()
        return cache[name]

    return weights


# ---------------------------------------------------------------------------------------------- helpers
def scramble(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def global_state() -> tuple:
    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def assert_unchanged(before: tuple, when: str) -> None:
    torch_state, numpy_state, python_state = global_state()
    assert torch.equal(torch_state, before[0]), f"torch's global generator moved {when}"
    assert numpy_state[0] == before[1][0] and np.array_equal(numpy_state[1], before[1][1]) \
        and numpy_state[2:] == before[1][2:], f"numpy's global state moved {when}"
    assert python_state == before[2], f"Python's random moved {when}"


def run(data, received, name: str, seed: int, scrambled_with: int, check_global: bool = False) -> dict:
    """Scramble the global generators, build a trainer of ``seed``, load the received weights, train round 0 (and
    evaluate); returns its weights.  ``check_global``: the global generators must not move at any point."""
    scramble(scrambled_with)
    before = global_state()

    def check(when: str) -> None:
        if check_global:
            assert_unchanged(before, when)

    t = KINDS[name].build(data, seed, SITE)
    check(f"building {name}")
    t.load_global(received(name))
    t.train_round(0, lambda: False)
    check(f"in {name}.train_round")
    if check_global and KINDS[name].evaluate:
        t.evaluate(KINDS[name].evaluate)
        check(f"in {name}.evaluate")
    return {k: v.clone() for k, v in t.global_state().items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("name", list(KINDS))
def test_a_round_is_a_function_of_seed_and_site_and_leaves_the_global_generators_alone(data, received, name):
    first = run(data, received, name, seed=0, scrambled_with=12345, check_global=True)
    again = run(data, received, name, seed=0, scrambled_with=999)  # another global state: the same weights
    assert same(first, again), f"{name}: two runs of seed 0 trained different weights"
    other = run(data, received, name, seed=1, scrambled_with=12345)  # the same global state, another seed
    assert not same(first, other), f"{name}: seeds 0 and 1 trained the same weights"


@pytest.mark.parametrize("name", DRAWS_GLOBALLY)
def test_without_the_owned_rng_the_round_would_draw_from_the_global_generator(data, received, name, monkeypatch):
    """The dropout / drop-path trainers really draw from the global generator in training (so the test above can
    fail): with owned_global_rng made a no-op, a round moves torch's global generator."""
    for module in KINDS[name].draws_globally:
        monkeypatch.setattr(module, "owned_global_rng", lambda *a, **k: contextlib.nullcontext())
    scramble(12345)
    t = KINDS[name].build(data, 0, SITE)
    t.load_global(received(name))
    before = torch.get_rng_state()
    t.train_round(0, lambda: False)
    assert not torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("name", DRAWS_GLOBALLY)
def test_a_restarted_client_draws_what_the_uninterrupted_one_draws(data, received, name):
    """The round's owned seed comes from what the restart state holds (round, epoch, step or task count)."""
    running = KINDS[name].build(data, 0, SITE)
    running.load_global(received(name))
    running.train_round(0, lambda: False)
    saved, weights = copy.deepcopy(running.state_dict()), running.global_state()
    restarted = KINDS[name].build(data, 0, SITE)
    restarted.load_state_dict(saved)
    for t in (running, restarted):
        t.load_global(weights)
        t.train_round(1, lambda: False)
    assert same(running.global_state(), restarted.global_state())
