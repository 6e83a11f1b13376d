"""ClassifierLocalTrainer on a tiny ViT and synthetic retina data: the split, the per-epoch step cap, abort within
one step, validation / test evaluation, the restart state round trip and the checked loading of the global model."""

import math
from collections import Counter

import numpy as np
import pytest
import torch

from fedssl.core.classification import UntrainedHeadError
from fedssl.core.seeds import site_seed
from fedssl.core.trainer import StopRequested
from fedssl.data.image_synthetic import write_synthetic_images
from fedssl.data.images import load_image_records, select_labelled, train_val_split
from fedssl.models.vit_classifier import FineTuneViT
from fedssl.train.classifier import ClassifierLocalTrainer, ClassifierSettings

torch.set_num_threads(1)

TINY = dict(image_size=32, patch_size=4, embed_dim=48, depth=2, num_heads=3, drop_path_rate=0.0)
ARGS = dict(dataset="retina", batch_size=16, lr=1e-3, warmup_rounds=1, val_fraction=0.2, eval_batch_size=64, **TINY)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("retina")
    write_synthetic_images(root / "site-1", "retina", n_images=60, seed=0, image_size=32)
    write_synthetic_images(root / "test", "retina", n_images=24, seed=1, image_size=32)
    return (load_image_records(str(root / "site-1"), "retina", site="site-1"),
            load_image_records(str(root / "test"), "retina", site="site-1"))


def trainer(records, site="site-1", device="cpu", **kw):
    return ClassifierLocalTrainer(records, ClassifierSettings(**{**ARGS, **kw}), num_rounds=3, site=site, device=device)


def round_half_up(x):
    return int(math.floor(x + 0.5))


def stop_after(n):
    asked = []

    def should_stop():
        asked.append(1)
        return len(asked) > n

    return should_stop


def test_split_and_the_cap_per_local_epoch(data):
    records, _ = data
    t = trainer(records, max_steps_per_epoch=1, local_epochs=2)
    counts = Counter(r.label for r in records).values()
    n_val = sum(min(n - 1, round_half_up(0.2 * n)) for n in counts)  # stratified 20 %
    assert len(t.val_set) == n_val and len(t.train_set) == len(records) - n_val  # label_fraction 1.0
    stats = t.train_round(0)
    # the cap holds per epoch, not per round: 2 epochs x 1 step
    assert stats.steps == 2 and int(t.model.head_steps) == 2 and stats.samples == len(t.train_set)
    # lr of the last step: epoch 1 starts at progress 0.5 of the 1-round warm-up -> 0.5 x lr
    assert stats.metrics == {"lr": pytest.approx(0.5e-3)}
    # the per-step curve: one loss per step, their mean is the round's loss
    assert len(stats.curve) == 2 and stats.loss == pytest.approx(sum(p["loss"] for p in stats.curve) / 2)
    full = trainer(records)
    assert full.train_round(0).steps == math.ceil(len(full.train_set) / 16)


def test_should_stop_during_a_round_stops_within_one_step(data):
    t = trainer(data[0])
    with pytest.raises(StopRequested):
        t.train_round(0, stop_after(1))
    assert t.trainer.step == 1


def test_validation_and_test_metrics_refuse_an_untrained_head(data):
    records, test = data
    t = trainer(records, max_steps_per_epoch=1)
    assert not t.head_trained
    with pytest.raises(UntrainedHeadError, match="checkpoint round-0 model has no trained classification head"):
        t.evaluate("val", "round-0 model")
    t.train_round(0)
    assert t.head_trained and t.evaluate("val")["n"] == len(t.val_set)
    with pytest.raises(ValueError, match="no test data"):
        t.evaluate("test")
    t.set_test_records(test)
    metrics = t.evaluate("test")
    assert metrics["n"] == 24 and set(metrics["per_class"]) == {"no_dr", "dr"}
    with pytest.raises(ValueError, match="split='train'"):
        t.evaluate("train")


def test_state_round_trip_continues_the_same_run(data):
    records = data[0]
    a = trainer(records, max_steps_per_epoch=2, fedprox_mu=0.001)
    a.train_round(0)
    weights = a.global_state()
    b = trainer(records, max_steps_per_epoch=2, fedprox_mu=0.001)  # a restarted site
    b.load_state_dict(a.state_dict())
    assert b.trainer.step == 2
    a.load_global(weights)
    b.load_global(weights)
    sa, sb = a.train_round(1), b.train_round(1)
    assert sa.loss == sb.loss and sa.steps == sb.steps == 2
    assert all(torch.equal(v, b.global_state()[k]) for k, v in a.global_state().items())


def test_the_state_of_another_vit_width_is_refused_by_name(data):
    records = data[0]
    wide = trainer(records, max_steps_per_epoch=1)
    wide.train_round(0)
    narrow = trainer(records, embed_dim=24)  # as many tensors per AdamW group, other shapes
    with pytest.raises(ValueError, match=r"site-1: the saved classifier state: the optimiser's exp_avg of parameter"):
        narrow.load_state_dict(wide.state_dict())


def test_checked_loading_of_the_global_model(data):
    t = trainer(data[0])
    fresh = FineTuneViT(num_classes=2, seed=3, **TINY).state_dict()
    own_head = t.model.state_dict()["head.weight"].clone()
    partial = {k: v.numpy() for k, v in fresh.items() if k != "head.weight"}
    assert t.load_global(partial, keep_local=["head.weight"]) == ["head.weight"]
    state = t.model.state_dict()
    assert torch.equal(state["head.weight"], own_head) and torch.equal(state["head.bias"], fresh["head.bias"])
    with pytest.raises(ValueError, match=r"the global model sent to site-1 lacks 1 keys .*'head\.weight'"):
        t.load_global(partial)
    with pytest.raises(ValueError, match=r"head\.weight has shape \(3, 48\)"):
        t.load_global({k: v.numpy() for k, v in FineTuneViT(num_classes=3, **TINY).state_dict().items()})
    with pytest.raises(ValueError, match="decoder.pred.weight"):
        t.load_global({**partial, "head.weight": own_head, "decoder.pred.weight": np.zeros((2, 2), np.float32)})


def test_sites_split_and_label_with_their_own_seed_but_build_the_same_model(data):
    """Issue 13 item 9: with one job seed (0), site-1's validation split and 30 % labelled subset are the ones
    site_seed(0, "site-1") draws, site-2's differ; both sites build the same initial weights (job seed)."""
    records, _ = data
    a, b = trainer(records, label_fraction=0.3), trainer(records, site="site-2", label_fraction=0.3)
    for t, site in ((a, "site-1"), (b, "site-2")):
        train, val = train_val_split(records, 0.2, seed=site_seed(0, site))
        assert [r.path for r in t.val_set.records] == [r.path for r in val]
        assert [r.path for r in t.train_set.records] == [r.path for r in select_labelled(train, 0.3,
                                                                                         seed=site_seed(0, site))]
    assert [r.path for r in a.val_set.records] != [r.path for r in b.val_set.records]
    assert all(torch.equal(v, b.model.state_dict()[k]) for k, v in a.model.state_dict().items())


def test_loader_workers_give_the_same_round_and_evaluation(data, loader_workers):
    records, _ = data
    a, b = trainer(records), trainer(records, workers=2)
    assert a.train_round(0).loss == b.train_round(0).loss
    assert a.evaluate("val") == b.evaluate("val")
    assert loader_workers and set(loader_workers) == {2}  # only the workers=2 trainer built DataLoaders
    with pytest.raises(ValueError, match="workers=-2"):
        trainer(records, workers=-2)


#: rui-yan/SSL-FL's Fed-MAE fine-tuning recipe, as the SSL-FL fine-tuning jobs set it (issue 47)
RECIPE = dict(label_smoothing=0.1, mixup_alpha=0.8, cutmix_alpha=1.0, cutmix_minmax=None, mixup_prob=1.0,
              mixup_switch_prob=0.5, mixup_mode="batch", erasing_prob=0.0, erasing_mode="pixel", erasing_count=1)


def test_the_reference_recipe_reaches_the_trainer_and_repeats_per_site(data):
    """The settings build the trainer's BatchAugment (off by default); a round with mixup / CutMix is reproducible
    from (seed, site), another site draws other mixes, and the site's log line names the regularisation."""
    records, _ = data
    assert trainer(records).trainer.batch_augment is None  # the defaults: off, the step as before issue 47
    a, b = trainer(records, max_steps_per_epoch=2, **RECIPE), trainer(records, max_steps_per_epoch=2, **RECIPE)
    aug = a.trainer.batch_augment
    assert aug is not None and aug.mixing and (aug.mixup_alpha, aug.cutmix_alpha, aug.erasing_prob) == (0.8, 1.0, 0.0)
    assert "label smoothing 0.1, mixup 0.8 / CutMix 1 (p 1, switch 0.5)" in a.summary
    sa, sb = a.train_round(0), b.train_round(0)
    assert sa.loss == sb.loss and all(torch.equal(v, b.global_state()[k]) for k, v in a.global_state().items())
    plain = trainer(records, max_steps_per_epoch=2, label_smoothing=0.1)
    assert plain.train_round(0).loss != sa.loss
    # another site: its own split, its own mixes (the model starts from the same weights)
    c = trainer(records, site="site-2", max_steps_per_epoch=2, **RECIPE)
    assert c.train_round(0).loss != sa.loss


def test_cutmix_minmax_from_json_is_a_list(data):
    t = trainer(data[0], max_steps_per_epoch=1, **{**RECIPE, "cutmix_minmax": [0.2, 0.8]})
    assert t.trainer.batch_augment.cutmix_minmax == [0.2, 0.8]
    assert math.isfinite(t.train_round(0).loss)
