"""Masked-image-modelling pre-training of one site (Fed-MAE / Fed-BEiT, SSL-FL (Yan et al., IEEE TMI 2023); FedMAE-KS,
Wu et al., "Federated Self-Supervised Learning for Dermatological Disease Diagnosis") as a
:class:`fedssl.core.trainer.LocalTrainer`, and the site's side of the federated k-means tokenizer.

- :class:`MIMLocalTrainer`: the site's unlabelled images (:class:`fedssl.data.images.ImageDataset`, mode
  ``pretrain``) -> :class:`fedssl.train.mim_loop.MIMTrainer` for ``local_epochs`` epochs per round (learning rate:
  warm-up then cosine to ``min_lr``, indexed by round); ``samples`` = |D_k|, every image of the site (SSL-FL
  weights the average by local data size).  Data-side randomness (augmentation, batch order, masks, the k-means
  image sample) uses the site's seed ``fedssl.core.seeds.site_seed(seed, site)``; the model's initial weights
  use the job seed, so every site builds the same initial model.  Knowledge split (FedMAE-KS): keys the server declared
  excluded keep this site's values; any other missing or unexpected key is an error.
- :class:`KMeansPatches`: seeded samples of the site's patch vectors and its k-means answers (local
  centroids, E-step statistics), each a mean or sum of at least ``min_cluster_size`` patch vectors; no image
  or patch leaves the site.
- :func:`site_tokenizer`: Fed-BEiT's tokenizer, a local codebook / TorchScript dVAE encoder or the federated
  codebook the site stored.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from fedssl.core.chance import norm_pix_mae_chance, uniform_chance
from fedssl.core.checks import require, require_amp, require_choice, require_int, require_workers
from fedssl.core.seeds import site_seed
from fedssl.core.tokenizer import (
    codebook_description,
    init_codebook,
    kmeans_stats,
    kmeans_update,
    load_tokenizer,
    patch_vectors,
    site_kmeans_stats,
    suppress_small_clusters,
)
from fedssl.core.trainer import RoundStats, check_stop, detached, load_checked
from fedssl.data.images import DATASETS, ImageDataset, ImageRecord, batches
from fedssl.data.site_config import read_site_config
from fedssl.data.loading import loader_options
from fedssl.models.vit import BEiTViT, MAEViT
from fedssl.models.vit_classifier import check_vit_args
from fedssl.train.mim_loop import METHODS, MIMTrainer


#: the channels of a ViT's input patches (fedssl.models.vit builds every ViT with in_chans=3): MAE's target per patch
#: holds patch_size^2 x 3 values
IMAGE_CHANNELS = 3


def mim_chance_loss(method: str, patch_size: int, norm_pix_loss: bool, vocab_size: int) -> float | None:
    """The chance level of the pre-training loss (:mod:`fedssl.core.chance`): BEiT ln(V), V = ``vocab_size``; MAE on
    per-patch normalised targets (d - 1) / d, d = ``patch_size``^2 x 3; MAE on raw pixels None (the patch mean's
    loss is the data's patch variance, not a property of the settings)."""
    if method == "beit":
        return uniform_chance(int(vocab_size))
    return norm_pix_mae_chance(int(patch_size) ** 2 * IMAGE_CHANNELS) if norm_pix_loss else None


def _positive_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


@dataclass(frozen=True)
class MIMSettings:
    """Every setting of Fed-MAE / Fed-BEiT pre-training, declared once: the job arguments of ``MIMExecutor`` and what
    :class:`MIMLocalTrainer` reads.  Defaults: Fed-MAE on Retina, SSL-FL sec. IV-A.3 and Table I.

    method: "mae" (random masking, pixel MSE on masked patches) or "beit" (block-wise masking, cross-entropy on the
        visual tokens of masked patches).
    dataset: "retina", "derm" or "covidfl" (the layout of the site folder, see fedssl.data.images).
    data_root: the site's folder; "" = site config / FEDSSL_DATA_ROOT; ``{site}`` is replaced.
    image_size, patch_size, embed_dim, depth, num_heads: the ViT encoder (ViT-B/16 at 224).
    rel_pos_bias: BEiT's relative position bias of the encoder (``fedssl.models.vit.ViTEncoder``): "none" (MAE, whose
        encoder sees only the visible patches, has none), "shared" (one table for every block: SSL-FL's Fed-BEiT
        pre-training, rui-yan/SSL-FL code/fed_beit/run_beit_pretrain_FedAvg.py) or "per_layer" (BEiT only).
    decoder_embed_dim, decoder_depth, decoder_num_heads: MAE's lightweight decoder (512 / 8 / 16).
    norm_pix_loss: MAE target = per-patch normalised pixels (as SSL-FL's and MAE's public scripts).
    vocab_size: BEiT's number of visual tokens (= codebook size K; DALL-E 8192).
    mask_ratio: MAE: fraction of patches masked (SSL-FL 0.6, FedMAE 0.75); BEiT: the maximum fraction of the
        block-wise mask (0.4).
    lr: the peak learning rate, absolute: SSL-FL Table I's eta (Retina Fed-MAE 1e-3 at batch 128, Fed-BEiT 1.5e-3 at
        256; Derm 7.5e-4 / 3e-3 at 128; COVID-FL 3.75e-4 / 1.5e-3 at 64).
    lr_per_256: false (default): ``lr`` is the absolute peak rate; true: ``lr`` is MAE's base rate per 256 images and
        the peak is lr x batch_size / 256 (for papers that quote MAE's blr).
    min_lr: the rate the cosine decays to at the last round (SSL-FL's scripts: Fed-BEiT 1e-5, Fed-MAE 0).
    weight_decay: AdamW weight decay, 0.05.
    adam_beta2: AdamW's second-moment decay (beta1 is 0.9): MAE's 0.95 (default; SSL-FL's Fed-MAE optimiser,
        rui-yan/SSL-FL code/util/FedAvg_utils.py ``betas=(0.9, 0.95)``, as MAE's main_pretrain.py; FedMAE-KS
        follows MAE); 0.999 for Fed-BEiT (BEiT's AdamW default).
    batch_size: images per mini-batch (Table I).
    local_epochs: E, epochs over the site's images per round (SSL-FL 1; FedMAE 10).
    warmup_rounds: linear warm-up, in rounds (MAE 5, BEiT 10); then cosine decay to ``min_lr`` at the last round.
    max_steps_per_round: 0 = full epochs; > 0 caps the optimiser steps per round (quick CPU profile).
    clip_grad: gradient-norm clipping (0 = off; SSL-FL's BEiT code clips at 3.0).
    amp: bfloat16 autocast (GPU throughput; the paper trains in mixed precision).
    tokenizer_path: BEiT only: a local tokenizer (codebook .pt or TorchScript dVAE encoder); "" = the federated
        k-means codebook the site stored.
    min_cluster_size: Fed-BEiT federated k-means: the fewest patch vectors a mean or sum this site sends may cover
        (>= 2; the server's FederatedKMeans min_cluster_size applies when larger), see :class:`KMeansPatches`.
    share_kmeans_statistics: Fed-BEiT federated k-means: this site answers the k-means tasks only when true.  The
        statistics are means and sums of at least ``min_cluster_size`` patches, but an honest-but-curious server
        that differences one site's successive Lloyd steps recovers raw patches (431 distinct ones at the paper's
        K / N, issue 45), and one that varies the images asked for gets every patch of a chosen image: sharing
        is an explicit choice.  ``share_kmeans_statistics`` in the site's own ``local/fedssl_site.json`` beats the
        job's; a site that does not share refuses the task, naming this setting.
    seed: the job seed: model initialisation (all sites alike: they start from the same weights); the site's data
        seed ``site_seed(seed, site)`` draws augmentations, batches and masks, and seeds each round's owned global
        RNG (drop path; :meth:`fedssl.train.mim_loop.MIMTrainer.train_round`).
    device: "auto" (CUDA when available), "cpu", "cuda", "cuda:1" ...
    workers: DataLoader worker processes that decode and augment the next batches (0 = in this process; the
        batches are the same either way); batches are pinned on a CUDA device.
    """

    method: str = "mae"
    dataset: str = "retina"
    data_root: str = ""
    image_size: int = 224
    patch_size: int = 16
    embed_dim: int = 768
    depth: int = 12
    num_heads: int = 12
    rel_pos_bias: str = "none"
    decoder_embed_dim: int = 512
    decoder_depth: int = 8
    decoder_num_heads: int = 16
    norm_pix_loss: bool = True
    vocab_size: int = 8192
    mask_ratio: float = 0.6
    lr: float = 1e-3
    lr_per_256: bool = False
    min_lr: float = 0.0
    weight_decay: float = 0.05
    adam_beta2: float = 0.95
    batch_size: int = 128
    local_epochs: int = 1
    warmup_rounds: int = 5
    max_steps_per_round: int = 0
    clip_grad: float = 0.0
    amp: bool = False
    tokenizer_path: str = ""
    min_cluster_size: int = 5
    share_kmeans_statistics: bool = False
    seed: int = 0
    device: str = "auto"
    workers: int = 0

    def check(self, name: str) -> None:
        """Every argument checked; the message names component ``name``, the argument, its value and the fix."""
        require_choice(name, "method", self.method, METHODS)
        require_choice(name, "dataset", self.dataset, DATASETS)
        require(isinstance(self.data_root, str), name, "data_root", self.data_root, 'use a path string or ""')
        # the encoder's shape: the same checks as every ViT component (no drop path in pre-training)
        check_vit_args(name, self.image_size, self.patch_size, self.embed_dim, self.depth, self.num_heads, 0.0,
                       rel_pos_bias=self.rel_pos_bias)
        require(self.method == "beit" or self.rel_pos_bias == "none", name, "rel_pos_bias", self.rel_pos_bias,
                'use "none" for method "mae" (its encoder sees only the visible patches); "shared" is Fed-BEiT\'s')
        decoder_num_heads = self.decoder_num_heads
        require_int(name, "decoder_num_heads", decoder_num_heads, 1, "use a positive number of heads (MAE: 16)")
        dec_dim = self.decoder_embed_dim
        require(isinstance(dec_dim, int) and not isinstance(dec_dim, bool) and dec_dim > 0
                and dec_dim % decoder_num_heads == 0, name, "decoder_embed_dim", dec_dim,
                f"use a positive multiple of decoder_num_heads={decoder_num_heads} (MAE: 512)")
        require_int(name, "decoder_depth", self.decoder_depth, 1, "use a positive number of decoder blocks (MAE: 8)")
        require(isinstance(self.norm_pix_loss, bool), name, "norm_pix_loss", self.norm_pix_loss, "use true or false")
        require_int(name, "vocab_size", self.vocab_size, 2, "use the number of visual tokens (DALL-E: 8192)")
        mask_ratio = self.mask_ratio
        require(isinstance(mask_ratio, (int, float)) and not isinstance(mask_ratio, bool) and 0 < mask_ratio < 1,
                name, "mask_ratio", mask_ratio, "use a fraction in (0, 1): MAE 0.6 (SSL-FL) / 0.75 (FedMAE), BEiT 0.4")
        require(_positive_number(self.lr), name, "lr", self.lr, "use a positive learning rate (Table I, e.g. 1e-3)")
        require(isinstance(self.lr_per_256, bool), name, "lr_per_256", self.lr_per_256,
                "use false (lr is the absolute rate, SSL-FL Table I) or true (lr is MAE's base rate per 256 images)")
        wd = self.weight_decay
        require(isinstance(wd, (int, float)) and not isinstance(wd, bool) and wd >= 0,
                name, "weight_decay", wd, "use a non-negative weight decay (paper: 0.05)")
        b2 = self.adam_beta2
        require(isinstance(b2, (int, float)) and not isinstance(b2, bool) and 0 < b2 < 1, name, "adam_beta2", b2,
                "use a number in (0, 1): MAE / SSL-FL Fed-MAE 0.95, BEiT 0.999")
        require_int(name, "batch_size", self.batch_size, 1, "use a positive batch size (Table I, e.g. 128)")
        min_lr, peak = self.min_lr, peak_lr(self.lr, self.batch_size, self.lr_per_256)
        require(isinstance(min_lr, (int, float)) and not isinstance(min_lr, bool) and 0 <= min_lr <= peak, name,
                "min_lr", min_lr,
                f"use 0 <= min_lr <= the peak lr {peak:g} (SSL-FL's scripts: Fed-BEiT 1e-5, Fed-MAE 0)")
        require_int(name, "local_epochs", self.local_epochs, 1, "use at least one local epoch per round")
        require_int(name, "warmup_rounds", self.warmup_rounds, 0, "use 0 or more warm-up rounds (MAE 5, BEiT 10)")
        require_int(name, "max_steps_per_round", self.max_steps_per_round, 0,
                    "use 0 (full epochs) or a positive step count")
        clip = self.clip_grad
        require(isinstance(clip, (int, float)) and not isinstance(clip, bool) and clip >= 0, name,
                "clip_grad", clip, "use 0 (no clipping) or a positive gradient norm (SSL-FL BEiT: 3.0)")
        require_amp(name, self.amp)
        require_workers(name, self.workers)
        tok = self.tokenizer_path
        require(isinstance(tok, str), name, "tokenizer_path", tok,
                'use a path to a local tokenizer, or "" for the federated k-means codebook')
        require(self.method == "beit" or tok == "", name, "tokenizer_path", tok,
                'only Fed-BEiT uses a tokenizer; leave it "" for method "mae"')
        require(isinstance(self.share_kmeans_statistics, bool), name, "share_kmeans_statistics",
                self.share_kmeans_statistics, "use true (answer the federated k-means tasks) or false")
        require_int(name, "min_cluster_size", self.min_cluster_size, 2,
                    "use an integer >= 2: a k-means statistic of one patch vector is that patch (default 5)")
        require_int(name, "seed", self.seed, 0, "use a non-negative integer")
        device = self.device
        require(isinstance(device, str) and (device in ("auto", "cpu") or device.startswith("cuda")), name, "device",
                device, 'use "auto", "cpu" or "cuda[:N]"')

    @property
    def peak_lr(self) -> float:
        return peak_lr(self.lr, self.batch_size, self.lr_per_256)


def peak_lr(lr: float, batch_size: int, lr_per_256: bool) -> float:
    """The peak learning rate: ``lr`` itself (the default: SSL-FL's Table I eta is the absolute rate, e.g. Retina
    Fed-MAE 1e-3 at batch 128, which its script reaches as blr 2e-3 x 128 / 256), or with ``lr_per_256``
    ``lr x batch_size / 256`` (``lr`` is then MAE's base rate per 256 images, as MAE's and FedMAE's papers quote)."""
    return lr * batch_size / 256 if lr_per_256 else lr


def site_tokenizer(site: str, tokenizer_path: str, codebook_path: str, vocab_size: int) -> tuple[Any, str]:
    """Fed-BEiT's tokenizer and its description: the local one (``tokenizer_path``), or, when that is "", the
    federated codebook this site stored at ``codebook_path`` (task set_tokenizer)."""
    if tokenizer_path:
        path, description = tokenizer_path, f"local: {tokenizer_path}"
        if not os.path.isfile(path):
            raise ValueError(f"{site}: tokenizer_path {path!r} does not exist; give the path of a local codebook "
                             'or TorchScript dVAE encoder on this site, or "" for the federated k-means codebook')
    else:
        path = codebook_path
        if not os.path.isfile(path):
            raise ValueError(f"{site}: tokenizer_path is \"\" but no federated codebook was received ({path} is "
                             "missing); put the FederatedKMeans workflow before scatter_and_gather in the server "
                             "config, or set tokenizer_path to a local tokenizer")
    tokenizer = load_tokenizer(path)
    codebook = getattr(tokenizer, "codebook", None)
    if codebook is not None and int(codebook.shape[0]) != vocab_size:
        raise ValueError(f"{site}: tokenizer {path} has {int(codebook.shape[0])} tokens but vocab_size="
                         f"{vocab_size}; set vocab_size to the tokenizer's size (FederatedKMeans vocab_size)")
    if not tokenizer_path:
        description = codebook_description(path) or tokenizer.describe()
    return tokenizer, description


def build_mim_model(method: str, image_size: int, patch_size: int, embed_dim: int, depth: int, num_heads: int,
                    decoder_embed_dim: int, decoder_depth: int, decoder_num_heads: int, norm_pix_loss: bool,
                    vocab_size: int, seed: int, rel_pos_bias: str = "none") -> torch.nn.Module:
    common = dict(image_size=image_size, patch_size=patch_size, embed_dim=embed_dim, depth=depth,
                  num_heads=num_heads, seed=seed)
    if method == "mae":
        if rel_pos_bias != "none":
            raise ValueError(f"build_mim_model: rel_pos_bias={rel_pos_bias!r} is BEiT's; use \"none\" for MAE")
        return MAEViT(**common, decoder_embed_dim=decoder_embed_dim, decoder_depth=decoder_depth,
                      decoder_num_heads=decoder_num_heads, norm_pix_loss=norm_pix_loss)
    return BEiTViT(**common, vocab_size=vocab_size, rel_pos_bias=rel_pos_bias)


class MIMLocalTrainer:
    """One site's Fed-MAE / Fed-BEiT pre-training (a ``LocalTrainer``) with the settings of a :class:`MIMSettings`.

    records: the site's images (labels unused); site: its name in messages; num_rounds: the schedule's length;
    codebook_path: where the site stored the federated codebook (Fed-BEiT with ``tokenizer_path`` ""); device: a
    torch device (the executor resolves the settings' "auto").
    """

    def __init__(self, records: Sequence[ImageRecord], settings: MIMSettings, *, num_rounds: int, site: str = "?",
                 codebook_path: str = "", device: str | torch.device = "cpu"):
        s = settings
        s.check(type(self).__name__)
        self.settings, self.workers = s, int(s.workers)
        self.site, self.method, self.seed, self.data_seed = site, s.method, s.seed, site_seed(s.seed, site)
        self.batch_size, self.local_epochs = s.batch_size, s.local_epochs
        self.max_steps_per_round = s.max_steps_per_round
        self.peak_lr = s.peak_lr
        self.dataset = ImageDataset(records, s.image_size, "pretrain", s.dataset, site=site, seed=self.data_seed)
        tokenizer, self.tokenizer_description = None, ""
        if s.method == "beit":
            tokenizer, self.tokenizer_description = site_tokenizer(site, s.tokenizer_path, codebook_path, s.vocab_size)
        model = build_mim_model(s.method, s.image_size, s.patch_size, s.embed_dim, s.depth, s.num_heads,
                                s.decoder_embed_dim, s.decoder_depth, s.decoder_num_heads, s.norm_pix_loss,
                                s.vocab_size, s.seed, s.rel_pos_bias)
        self.trainer = MIMTrainer(model, s.method, lr=self.peak_lr, weight_decay=s.weight_decay,
                                  betas=(0.9, float(s.adam_beta2)),
                                  warmup_rounds=s.warmup_rounds, total_rounds=num_rounds, mask_ratio=s.mask_ratio,
                                  tokenizer=tokenizer, device=device, seed=self.data_seed, min_lr=s.min_lr,
                                  clip_grad=s.clip_grad or None, amp=s.amp)
        self.kept_local: list[str] = []  # the keys the last broadcast held back (FedMAE-KS)

    @property
    def model(self) -> torch.nn.Module:
        return self.trainer.model

    @property
    def device(self) -> torch.device:
        return self.trainer.device

    def steps_per_round(self) -> int:
        steps = self.local_epochs * math.ceil(len(self.dataset) / self.batch_size)
        return min(steps, self.max_steps_per_round) if self.max_steps_per_round else steps

    def train_round(self, round_idx: int, should_stop: Callable[[], bool] | None = None) -> RoundStats:
        steps = self.steps_per_round()

        def round_batches():
            done = 0
            for e in range(self.local_epochs):
                for imgs, _ in batches(self.dataset, self.batch_size, seed=self.data_seed,
                                       epoch=round_idx * self.local_epochs + e,
                                       **loader_options(self.workers, self.device)):
                    check_stop(should_stop)
                    if done >= steps:
                        return
                    done += 1
                    yield imgs

        loss = self.trainer.train_round(round_batches(), round_idx, steps_per_round=steps)
        last, s = self.trainer.last_stats, self.settings
        chance = mim_chance_loss(s.method, s.patch_size, s.norm_pix_loss, s.vocab_size)
        return RoundStats(loss=loss, steps=steps, samples=len(self.dataset),
                          metrics={"lr_peak": self.peak_lr, "lr": last["lr_end"], "kept_local": list(self.kept_local),
                                   "feature_std": last["feature_std"],
                                   **({} if chance is None else {"chance_loss": chance})},
                          curve=[{"loss": x, "lr": lr} for x, lr in zip(last["losses"], last["lrs"])])

    def evaluate(self, split: str = "val") -> dict[str, Any]:
        raise ValueError(f"split={split!r}: MIM pre-training holds no evaluation split (its images are unlabelled)")

    def state_dict(self) -> dict:
        """The MIMTrainer's state (model, AdamW, mask generator, counters) and the tensors kept local."""
        return {**self.trainer.state_dict(), "local": detached(self.model.state_dict(), self.kept_local)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.trainer.load_state_dict(dict(state))
        self.kept_local = sorted(state.get("local", {}))

    def global_state(self) -> dict[str, torch.Tensor]:
        return detached(self.model.state_dict())

    def load_global(self, state: Mapping[str, Any], keep_local: Sequence[str] = ()) -> list[str]:
        """The broadcast into the model; keys declared in ``keep_local`` that it lacks keep this site's values."""
        self.kept_local = load_checked(self.model, state, f"{self.site}: the global model", keep_local)
        return self.kept_local


def check_kmeans_task(site: str, settings: MIMSettings, k: object) -> None:
    """A federated k-means task (FederatedKMeans) reaches a Fed-BEiT site without a local tokenizer, for a codebook
    of the site's vocab_size tokens; anything else is a ValueError naming the site and the fix."""
    if settings.method != "beit" or settings.tokenizer_path:
        raise ValueError(f"{site}: received a federated k-means task but this site is configured with method="
                         f"{settings.method!r}, tokenizer_path={settings.tokenizer_path!r}; remove the FederatedKMeans "
                         'workflow or configure the sites for Fed-BEiT with tokenizer_path ""')
    if k != settings.vocab_size:
        raise ValueError(f"{site}: the server learns a codebook of K={k} tokens but this site's vocab_size="
                         f"{settings.vocab_size}; set FederatedKMeans vocab_size and the sites' vocab_size alike")


def check_kmeans_sharing(site: str, job_value: object, site_config_dir: str | None) -> None:
    """ValueError naming the site and the setting unless it agreed to share k-means statistics: the site's own
    ``share_kmeans_statistics`` (``local/fedssl_site.json``) when it has one, else the job's ``job_value``."""
    own = read_site_config(site_config_dir).get("share_kmeans_statistics")
    share = job_value if own is None else own
    if share is not True:
        raise ValueError(f"{site}: does not share federated k-means statistics (share_kmeans_statistics="
                         f"{share!r}): they let the server recover raw image patches (threat model); set "
                         "share_kmeans_statistics true in the site's local/fedssl_site.json (or the job, where the "
                         "site has none) to accept, or give the sites a local tokenizer (tokenizer_path)")


def cluster_floor(site: str, requested: object, own: int, key: str = "min_cluster_size") -> int:
    """The fewest patch vectors a k-means statistic of this site covers: the larger of the site's ``own``
    min_cluster_size and the one the server ``requested`` (meta ``key``); a request below 2 (or not an integer)
    is refused."""
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 2:
        raise ValueError(f"{site}: the server asks for k-means statistics with {key}={requested!r}; this site sends "
                         f"only means of >= 2 patch vectors: set FederatedKMeans {key} to an integer >= 2")
    return max(requested, own)


def received_codebook(site: str, values: object, patch_size: int, own_patch_size: int, vocab_size: int) -> torch.Tensor:
    """The federated codebook the server sent (set_tokenizer), float32 ``[vocab_size, 3 p^2]``, checked: this site's
    patch size and vocabulary size, finite values."""
    codebook = torch.as_tensor(np.asarray(values), dtype=torch.float32)
    if codebook.shape != (vocab_size, 3 * own_patch_size ** 2) or patch_size != own_patch_size:
        raise ValueError(f"{site}: received a codebook of shape {tuple(codebook.shape)} for patch size "
                         f"{patch_size}; this site expects ({vocab_size}, {3 * own_patch_size ** 2})")
    if not torch.isfinite(codebook).all():
        raise ValueError(f"{site}: received a codebook with NaN/Inf values; not stored (see the server's log)")
    return codebook


class KMeansPatches:
    """The site's side of the federated k-means tokenizer (FederatedKMeans): patch vectors ``[N, 3 p^2]`` of a
    seeded sample of the site's images (resize + centre crop, normalised), kept for the k-means rounds, and
    the site's answers, in which every statistic is a mean (or sum) of at least ``min_cluster_size`` vectors:
    a cluster with fewer members is suppressed (zero sum, zero count, see
    :func:`fedssl.core.tokenizer.suppress_small_clusters`), because a one-member cluster's sum is a raw patch.
    ``min_cluster_size`` (>= 2) is the larger of the site's own setting and the server's.  The server's k-means
    ``seed`` is a job seed: the image sample and the local k-means++ start use ``site_seed(seed, site)``, so the
    sites draw independent samples."""

    def __init__(self, records: Sequence[ImageRecord], *, dataset: str, image_size: int, patch_size: int,
                 site: str = "?", seed: int = 0):
        self.records, self.dataset, self.site, self.seed = list(records), dataset, site, seed
        self.image_size, self.patch_size = image_size, patch_size
        self._sample: tuple[tuple, torch.Tensor] | None = None  # (sample key, patch vectors)

    def vectors(self, n_images: int, seed: int) -> torch.Tensor:
        """Patch vectors of ``n_images`` images drawn with the site's seed of the job seed ``seed`` (0 = every
        image), cached per sample."""
        key = (int(n_images), int(seed))
        if self._sample is None or self._sample[0] != key:
            order = np.random.default_rng([site_seed(key[1], self.site), 7]).permutation(len(self.records))
            chosen = [self.records[i] for i in sorted(order[: key[0]] if key[0] else order)]
            ds = ImageDataset(chosen, self.image_size, "eval", self.dataset, site=self.site, seed=self.seed)
            p = self.patch_size
            vectors = [patch_vectors(torch.stack([ds[i][0] for i in range(s, min(s + 64, len(ds)))]), p)
                       for s in range(0, len(ds), 64)]
            self._sample = (key, torch.cat(vectors).reshape(-1, 3 * p ** 2).float())
        return self._sample[1]

    def _check_min_cluster_size(self, min_cluster_size: int) -> None:
        if isinstance(min_cluster_size, bool) or not isinstance(min_cluster_size, int) or min_cluster_size < 2:
            raise ValueError(f"{self.site}: min_cluster_size={min_cluster_size!r}; a statistic must cover at least 2 "
                             "patch vectors (a cluster of one is a raw patch): use an integer >= 2")

    def local_centroids(self, k: int, n_images: int, seed: int, iters: int, min_cluster_size: int,
                        should_stop: Callable[[], bool] | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The site's local k-means: k-means++ start (generator ``site_seed(seed, site) + 1``), then ``iters`` >= 1
        Lloyd steps on the sample -> (centroids [K, D], counts [K], number of vectors).  The centroids are the last
        Lloyd step's cluster means (the k-means++ seeds, single patches, never leave); clusters of fewer than
        ``min_cluster_size`` vectors are suppressed (zero centroid, zero count)."""
        self._check_min_cluster_size(min_cluster_size)
        if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
            raise ValueError(f"{self.site}: local_iters={iters!r}; use at least one local Lloyd step (with 0 the "
                             "local centroids would be the k-means++ seeds, which are single patches)")
        x = self.vectors(n_images, seed)
        if x.shape[0] < k:
            raise ValueError(f"{self.site}: only {x.shape[0]} patch vectors for K={k} local centroids; raise the "
                             "server's images_per_site or lower vocab_size")
        codebook = init_codebook(x, k, generator=torch.Generator().manual_seed(site_seed(int(seed), self.site) + 1))
        for _ in range(iters):
            check_stop(should_stop)
            sums, counts = kmeans_stats(x, codebook)
            codebook = kmeans_update(codebook, [(sums, counts)])
        sums, counts = suppress_small_clusters(sums, counts, min_cluster_size)
        means = sums / counts.clamp(min=1).to(torch.float64)[:, None]  # suppressed rows: 0 / 1 = 0
        return means.float(), counts, int(x.shape[0])

    def e_step(self, codebook: torch.Tensor, n_images: int, seed: int,
               min_cluster_size: int) -> tuple[torch.Tensor, torch.Tensor, float, int]:
        """E-step statistics of the sample against ``codebook``, clusters of fewer than ``min_cluster_size``
        vectors suppressed -> (sums [K, D], counts [K], cost of the reported vectors, vectors in the sample)."""
        self._check_min_cluster_size(min_cluster_size)
        x = self.vectors(n_images, seed)
        if codebook.shape[1] != x.shape[1]:
            raise ValueError(f"{self.site}: codebook vectors have {codebook.shape[1]} values but this site's patches "
                             f"{x.shape[1]} (patch_size={self.patch_size}); use one patch_size everywhere")
        sums, counts, cost = site_kmeans_stats(x, codebook, min_cluster_size)
        return sums, counts, cost, int(x.shape[0])
