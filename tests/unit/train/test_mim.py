"""MIMLocalTrainer and KMeansPatches on a tiny ViT and 12 synthetic retina images: step caps and lr, abort within
one step, the restart state round trip, the knowledge-split loading rules, the Fed-BEiT tokenizer and the
site's k-means answers."""

import math

import numpy as np
import pytest
import torch

from fedssl.core.seeds import site_seed
from fedssl.core.tokenizer import PatchTokenizer, init_codebook, kmeans_stats, kmeans_update, patch_vectors
from fedssl.core.trainer import StopRequested
from fedssl.data.image_synthetic import write_synthetic_images
from fedssl.data.images import ImageDataset, load_image_records
from fedssl.models.vit import TINY_DECODER, TINY_VIT, MAEViT
from fedssl.train.mim import KMeansPatches, MIMLocalTrainer, MIMSettings, mim_chance_loss, peak_lr

torch.set_num_threads(1)

N_IMAGES = 12
VOCAB = 16
TINY = dict(image_size=32, patch_size=4, embed_dim=48, depth=2, num_heads=3, decoder_embed_dim=32, decoder_depth=1,
            decoder_num_heads=2, vocab_size=VOCAB, batch_size=4, lr=1e-3, lr_per_256=False, warmup_rounds=1)
CLS = "encoder.cls_token"


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    root = tmp_path_factory.mktemp("retina")
    write_synthetic_images(root, "retina", n_images=N_IMAGES, seed=0, image_size=40)
    return load_image_records(str(root), "retina", site="site-1")


def mae(records, site="site-1", **kw):
    return make(records, site=site, **{"max_steps_per_round": 2, **kw})


def make(records, site="site-1", codebook_path="", **kw):
    """A trainer of 3 rounds with the TINY settings updated by ``kw``."""
    return MIMLocalTrainer(records, MIMSettings(**{**TINY, **kw}), num_rounds=3, site=site, codebook_path=codebook_path)


def global_weights():
    return MAEViT(**TINY_VIT, **TINY_DECODER, seed=0).state_dict()


def stop_after(n):
    """should_stop that answers False ``n`` times, then True."""
    asked = []

    def should_stop():
        asked.append(1)
        return len(asked) > n

    return should_stop


def test_peak_lr_is_absolute_unless_per_256_is_asked(records):
    """SSL-FL Table I eta is absolute (Retina Fed-MAE 1e-3 at B = 128 = the script's blr 2e-3 x 128 / 256)."""
    assert peak_lr(1e-3, 128, False) == 1e-3 and peak_lr(2e-3, 128, True) == pytest.approx(1e-3)
    settings = MIMSettings(**{k: v for k, v in TINY.items() if k not in ("lr_per_256", "batch_size")})
    default = MIMLocalTrainer(records, settings, num_rounds=3, site="site-1")
    assert default.peak_lr == 1e-3  # the trainer's default: lr is not rescaled by batch_size / 256


def test_adamw_uses_the_configured_second_moment_decay(records):
    """Issue 47: SSL-FL's Fed-MAE (code/util/FedAvg_utils.py) and MAE use AdamW betas (0.9, 0.95); the trainer
    used (0.9, 0.999) whatever the job said.  0.95 is the default, a job's value is applied, others refused."""
    assert make(records).trainer.optimizer.param_groups[0]["betas"] == (0.9, 0.95)
    assert make(records, adam_beta2=0.999).trainer.optimizer.param_groups[0]["betas"] == (0.9, 0.999)
    with pytest.raises(ValueError, match="adam_beta2=1.0"):
        make(records, adam_beta2=1.0)


def test_min_lr_is_where_the_cosine_ends(records):
    """BEiT's min lr 1e-5 (SSL-FL run_beit_pretrain_FedAvg.py): 3 rounds, 1 warm-up round, peak 1e-3:
    progress 2 is half-way down the cosine, 1e-5 + (1e-3 - 1e-5) / 2 = 5.05e-4; the last round ends at 1e-5."""
    t = mae(records, min_lr=1e-5)
    assert t.trainer.lr_at(1.0) == pytest.approx(1e-3) and t.trainer.lr_at(2.0) == pytest.approx(5.05e-4)
    assert t.trainer.lr_at(3.0) == pytest.approx(1e-5)


def test_sites_draw_their_own_data_from_one_job_seed_and_start_from_the_same_model(records):
    """Issue 13 item 9: two sites with the same images and job seed 0 build identical initial weights but draw
    their own augmentations, batches and masks (site_seed(0, site)); a run outside FLARE (site "") keeps seed 0."""
    a, b = mae(records, site="site-1"), mae(records, site="site-2")
    assert (a.data_seed, b.data_seed) == (site_seed(0, "site-1"), site_seed(0, "site-2"))
    assert a.data_seed != b.data_seed and mae(records, site="").data_seed == 0
    assert all(torch.equal(v, b.model.state_dict()[k]) for k, v in a.model.state_dict().items())
    assert a.train_round(0).loss != b.train_round(0).loss  # same weights, same images: only the draws differ


def test_round_is_capped_and_reports_image_count_and_lr(records):
    t = mae(records)
    stats = t.train_round(0)
    # 2 steps of round 0 with warm-up over 1 round: lr 0 then 0.5 x peak (step s: peak x s / 2)
    assert stats.steps == 2 and t.trainer.step == 2 and stats.samples == N_IMAGES and np.isfinite(stats.loss)
    spread = stats.metrics.pop("feature_std")  # issue 14: the round's feature spread, 1/sqrt(48) = 0.144 if uniform
    assert spread == t.trainer.last_stats["feature_std"] and 0 < spread < 1
    # issue 44: the chance level of MAE on norm-pix targets of 4 x 4 x 3 values, (48 - 1) / 48
    assert stats.metrics == {"lr_peak": 1e-3, "lr": pytest.approx(0.5e-3), "kept_local": [], "chance_loss": 47 / 48}
    assert [p["lr"] for p in stats.curve] == pytest.approx([0.0, 0.5e-3])  # one point per step
    assert stats.loss == pytest.approx(sum(p["loss"] for p in stats.curve) / 2)
    full = mae(records, max_steps_per_round=0, local_epochs=2)
    assert full.train_round(0).steps == 2 * 3  # 2 epochs x ceil(12 / 4)


def test_should_stop_during_a_round_stops_within_one_step(records):
    t = mae(records)
    with pytest.raises(StopRequested):
        t.train_round(0, stop_after(1))
    assert t.trainer.step == 1


def test_knowledge_split_keeps_declared_keys_and_refuses_undeclared_ones(records):
    t = mae(records)
    t.train_round(0)
    local_cls = t.model.state_dict()[CLS].clone()
    fresh = global_weights()
    broadcast = {k: v.numpy() for k, v in fresh.items() if k != CLS}
    assert t.load_global(broadcast, keep_local=[CLS]) == [CLS] and t.kept_local == [CLS]
    state = t.model.state_dict()
    assert torch.equal(state[CLS], local_cls) and not torch.equal(local_cls, fresh[CLS])
    assert torch.equal(state["encoder.patch_embed.proj.weight"], fresh["encoder.patch_embed.proj.weight"])
    assert t.train_round(1).metrics["kept_local"] == [CLS]
    with pytest.raises(ValueError, match=r"site-1: the global model lacks 1 keys .*'encoder\.cls_token'"):
        t.load_global(broadcast, keep_local=[])
    with pytest.raises(ValueError, match=r"site-1: the global model has 1 keys .*'decoder\.extra'"):
        t.load_global({**broadcast, "decoder.extra": np.zeros(2, np.float32)}, keep_local=[CLS])


def test_state_round_trip_continues_the_same_run(records):
    a = mae(records)
    a.train_round(0)
    broadcast = {k: v for k, v in global_weights().items() if k != CLS}
    a.load_global(broadcast, keep_local=[CLS])
    a.train_round(1)
    state = a.state_dict()
    assert set(state["local"]) == {CLS} and torch.equal(state["local"][CLS], a.model.state_dict()[CLS])
    b = mae(records)  # a restarted site
    b.load_state_dict(state)
    assert b.kept_local == [CLS] and b.trainer.step == 4
    for k, v in a.model.state_dict().items():
        assert torch.equal(v, b.model.state_dict()[k]), k
    # round 2 from the same broadcast: the same loss and weights, bit for bit
    a.load_global(broadcast, keep_local=[CLS])
    b.load_global(broadcast, keep_local=[CLS])
    assert a.train_round(2).loss == b.train_round(2).loss
    assert all(torch.equal(v, b.global_state()[k]) for k, v in a.global_state().items())
    assert not any(v.data_ptr() == a.model.state_dict()[k].data_ptr() for k, v in a.global_state().items())


def test_beit_with_a_local_codebook_and_a_missing_federated_one(records, tmp_path):
    path = str(tmp_path / "codebook.pt")
    PatchTokenizer(torch.randn(VOCAB, 48, generator=torch.Generator().manual_seed(0)), 4).save(path)
    t = make(records, method="beit", mask_ratio=0.4, tokenizer_path=path, max_steps_per_round=1)
    assert t.tokenizer_description == f"local: {path}" and np.isfinite(t.train_round(0).loss)
    with pytest.raises(ValueError, match="no federated codebook was received"):
        make(records, method="beit", codebook_path=str(tmp_path / "no.pt"))
    with pytest.raises(ValueError, match=f"has {VOCAB} tokens but vocab_size=32"):
        make(records, method="beit", tokenizer_path=path, vocab_size=32)


def test_kmeans_patches_sample_centroids_and_e_step(records):
    p = KMeansPatches(records, dataset="retina", image_size=32, patch_size=4, site="site-1")
    x = p.vectors(6, 0)
    assert x.shape == (6 * 64, 48) and torch.equal(p.vectors(6, 0), x)
    assert not torch.equal(p.vectors(6, 1), x)
    centroids, counts, n = p.local_centroids(VOCAB, 6, 0, iters=1, min_cluster_size=2)
    assert centroids.shape == (VOCAB, 48) and n == 6 * 64 and int(counts.sum()) <= n
    sums, counts, sse, n = p.e_step(centroids, 6, 0, min_cluster_size=2)
    ref_sums, ref_counts = kmeans_stats(x, centroids)
    kept = ref_counts >= 2
    assert torch.equal(counts, torch.where(kept, ref_counts, 0)) and torch.equal(sums[kept], ref_sums[kept])
    d2 = torch.cdist(x.double(), centroids.double()).pow(2)
    direct = float(d2.min(dim=1).values[kept[d2.argmin(dim=1)]].sum())  # cost of the vectors still reported
    assert sse == pytest.approx(direct, rel=1e-6)
    with pytest.raises(StopRequested):
        p.local_centroids(VOCAB, 6, 0, iters=3, min_cluster_size=2, should_stop=stop_after(1))
    with pytest.raises(ValueError, match="only 128 patch vectors for K=400"):
        p.local_centroids(400, 2, 0, iters=1, min_cluster_size=2)
    with pytest.raises(ValueError, match="codebook vectors have 12 values"):
        p.e_step(torch.zeros(VOCAB, 12), 6, 0, min_cluster_size=2)


def test_kmeans_answers_are_means_of_at_least_m_vectors_never_seeds(records):
    """The local centroids are the last Lloyd step's cluster means, clusters of < m vectors withheld; the
    k-means++ seeds (single patches) never leave; m < 2 and local_iters < 1 are refused."""
    p = KMeansPatches(records, dataset="retina", image_size=32, patch_size=4, site="site-1")
    x = p.vectors(6, 0)
    seeds = init_codebook(x, VOCAB, generator=torch.Generator().manual_seed(site_seed(0, "site-1") + 1))
    after_one = kmeans_update(seeds, [kmeans_stats(x, seeds)])
    sums, full_counts = kmeans_stats(x, seeds)  # the assignment the one Lloyd step averaged
    for m in (5, 40):
        centroids, counts, _ = p.local_centroids(VOCAB, 6, 0, iters=1, min_cluster_size=m)
        kept = full_counts >= m
        assert 0 < int(kept.sum()) < VOCAB  # this sample has clusters on both sides of m = 5 and of m = 40
        assert torch.equal(counts, torch.where(kept, full_counts, 0))
        torch.testing.assert_close(centroids[kept], after_one[kept].float())
        assert (centroids[~kept] == 0).all()
        assert not any(torch.equal(c, s) for c in centroids for s in seeds if s.abs().max() > 0)
    for bad in (1, 0, 2.0):
        with pytest.raises(ValueError, match=f"min_cluster_size={bad!r}"):
            p.local_centroids(VOCAB, 6, 0, iters=1, min_cluster_size=bad)
        with pytest.raises(ValueError, match=f"min_cluster_size={bad!r}"):
            p.e_step(seeds, 6, 0, min_cluster_size=bad)
    with pytest.raises(ValueError, match="local_iters=0; use at least one local Lloyd step"):
        p.local_centroids(VOCAB, 6, 0, iters=0, min_cluster_size=2)


def test_each_site_samples_its_own_images_for_k_means(records):
    """Issue 13 item 9: the server's k-means seed is a job seed; site-1 draws the 6 images that
    default_rng([site_seed(0, "site-1"), 7]) picks, site-2 others; a site named "" keeps the job seed."""
    def sample(site):
        return KMeansPatches(records, dataset="retina", image_size=32, patch_size=4, site=site).vectors(6, 0)

    def images_of(seed):
        order = np.random.default_rng([seed, 7]).permutation(N_IMAGES)[:6]
        ds = ImageDataset([records[i] for i in sorted(order)], 32, "eval", "retina", site="x")
        return patch_vectors(torch.stack([ds[i][0] for i in range(6)]), 4).reshape(-1, 48)

    assert torch.equal(sample("site-1"), images_of(site_seed(0, "site-1")))
    assert torch.equal(sample("site-2"), images_of(site_seed(0, "site-2")))
    assert torch.equal(sample(""), images_of(0)) and not torch.equal(sample("site-1"), sample("site-2"))


def test_loader_workers_give_the_same_round(records, loader_workers):
    a, b = mae(records), mae(records, workers=2)
    assert a.train_round(0).loss == b.train_round(0).loss
    assert all(torch.equal(v, b.model.state_dict()[k]) for k, v in a.model.state_dict().items())
    assert loader_workers and set(loader_workers) == {2}  # only the workers=2 trainer built DataLoaders
    with pytest.raises(ValueError, match="workers=-1"):
        mae(records, workers=-1)


def test_chance_level_of_each_mim_loss():
    assert mim_chance_loss("mae", 4, True, VOCAB) == 47 / 48  # 4 x 4 RGB patches, normalised per patch
    assert mim_chance_loss("mae", 16, True, VOCAB) == 767 / 768
    assert mim_chance_loss("beit", 4, True, VOCAB) == pytest.approx(math.log(VOCAB))  # uniform over V tokens
    assert mim_chance_loss("mae", 4, False, VOCAB) is None  # raw pixels: the data's variance, not a setting's
