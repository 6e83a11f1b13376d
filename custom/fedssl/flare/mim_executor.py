"""Client executor for masked-image-modelling pre-training: Fed-MAE / Fed-BEiT (SSL-FL, seed 000), FedMAE-KS (seed 001).

Task ``train``: load the global auto-encoder -> ``fedssl.core.mim.MIMTrainer.train_round`` for
``local_epochs`` epochs of the site's unlabelled images (learning rate: warm-up then cosine, indexed by
round) -> upload the weights with meta ``num_samples`` = |D_k| (every image of the site: SSL-FL weights
the average by local data size) and the mean loss.

Knowledge split (FedMAE-KS): when the broadcast lacks some keys (a server-side PartialModelExclusion
held them back, and listed them in the meta ``excluded_keys``), the model loads with ``strict=False`` and
the site keeps its own tensors for exactly those keys; any other missing or any unexpected key is an error.

Fed-BEiT tokenizer: ``tokenizer_path`` names a local codebook / TorchScript dVAE encoder; "" means the
codebook learnt by the FederatedKMeans workflow before pre-training: the site answers ``kmeans_init``
(local k-means centroids of its patch vectors, or only its patch size for a random start; never
images or patches), ``kmeans_step`` (E-step statistics
against the broadcast codebook) and ``set_tokenizer`` (stores the final codebook in its run folder, so
a restarted client finds it again).  A site with a local tokenizer answers ``kmeans_init`` with its
description ("local: <path>") and the server skips the federated k-means.

Everything a restart needs (model, optimiser, round) is checkpointed in the site's run folder.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch
from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.apis.signal import Signal
from nvflare.app_common.app_constant import AppConstants

from fedssl.core.mim import MIMTrainer
from fedssl.core.tokenizer import init_codebook, kmeans_stats, kmeans_update, load_tokenizer, patch_vectors
from fedssl.data.images import DATASETS, ImageDataset, batches, load_image_records
from fedssl.flare.federated_kmeans import (DESCRIPTION_KEY, IMAGES_KEY, INIT_KEY, ITER_KEY, K_KEY, KMEANS_INIT, KMEANS_STEP,
                                           LOCAL_ITERS_KEY, LOCAL_TOKENIZER_KEY, SEED_KEY, SET_TOKENIZER,
                                           codebook_description, save_codebook)
from fedssl.flare.partial_exclusion import EXCLUDED_META
from fedssl.flare.run_summary import SITE_RECORD_META
from fedssl.flare.site_executor import SiteExecutor, TaskAborted, pick_device
from fedssl.flare.validation import require, require_choice, require_int
from fedssl.models.vit import BEiTViT, MAEViT

METHODS = ("mae", "beit")


def sum_squared_distance(x: torch.Tensor, codebook: torch.Tensor, sums: torch.Tensor, counts: torch.Tensor) -> float:
    """k-means cost sum_i ||x_i - c_a(i)||^2 from the E-step statistics, without an [N, K] distance matrix:
    sum_i ||x_i||^2 - 2 sum_k c_k . S_k + sum_k n_k ||c_k||^2."""
    c = codebook.to(torch.float64)
    x_sq = (x.to(torch.float64) ** 2).sum()
    return float(x_sq - 2 * (c * sums).sum() + (counts.to(torch.float64) * (c ** 2).sum(1)).sum())


def _positive_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


class MIMExecutor(SiteExecutor):
    task_handlers = {"train": "train", KMEANS_INIT: "kmeans_init", KMEANS_STEP: "kmeans_step",
                     SET_TOKENIZER: "set_tokenizer"}
    checkpoint_name = "mim_client_state.pt"
    metrics_name = "mim_metrics.jsonl"
    #: the federated codebook, in the site's run folder
    codebook_name = "tokenizer_codebook.pt"

    def __init__(
        self,
        method: str = "mae",
        dataset: str = "retina",
        data_root: str = "",
        image_size: int = 224,
        patch_size: int = 16,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        decoder_embed_dim: int = 512,
        decoder_depth: int = 8,
        decoder_num_heads: int = 16,
        norm_pix_loss: bool = True,
        vocab_size: int = 8192,
        mask_ratio: float = 0.6,
        lr: float = 1e-3,
        lr_per_256: bool = True,
        weight_decay: float = 0.05,
        batch_size: int = 128,
        local_epochs: int = 1,
        warmup_rounds: int = 5,
        max_steps_per_round: int = 0,
        clip_grad: float = 0.0,
        amp: bool = False,
        tokenizer_path: str = "",
        seed: int = 0,
        device: str = "auto",
    ):
        """
        Args (defaults: Fed-MAE on Retina, SSL-FL sec. IV-A.3 and Table I):
            method: "mae" (random masking, pixel MSE on masked patches) or "beit" (block-wise masking,
                cross-entropy on the visual tokens of masked patches).
            dataset: "retina", "derm" or "covidfl" (real layout of the site folder, see fedssl.data.images).
            data_root: the site's folder; "" = site config / FEDSSL_DATA_ROOT; ``{site}`` is replaced.
            image_size, patch_size, embed_dim, depth, num_heads: the ViT encoder (ViT-B/16 at 224).
            decoder_embed_dim, decoder_depth, decoder_num_heads: MAE's lightweight decoder (512 / 8 / 16).
            norm_pix_loss: MAE target = per-patch normalised pixels (as SSL-FL's and MAE's public scripts).
            vocab_size: BEiT's number of visual tokens (= codebook size K; DALL-E 8192).
            mask_ratio: MAE: fraction of patches masked (SSL-FL 0.6, FedMAE 0.75); BEiT: the maximum
                fraction of the block-wise mask (0.4).
            lr: base learning rate eta of Table I; with ``lr_per_256`` the peak rate is
                lr x batch_size / 256 (SSL-FL's / MAE's code), else lr itself.
            weight_decay: AdamW (betas 0.9, 0.999) weight decay, 0.05.
            batch_size: images per mini-batch (Table I).
            local_epochs: E, epochs over the site's images per round (SSL-FL 1; FedMAE 10).
            warmup_rounds: linear warm-up, in rounds (MAE 5, BEiT 10); then cosine decay to 0 at the last round.
            max_steps_per_round: 0 = full epochs; > 0 caps the optimiser steps per round (quick CPU profile).
            clip_grad: gradient-norm clipping (0 = off; SSL-FL's BEiT code clips at 3.0).
            amp: bfloat16 autocast (GPU throughput; the paper trains in mixed precision).
            tokenizer_path: BEiT only: a local tokenizer (codebook .pt or TorchScript dVAE encoder);
                "" = the federated k-means codebook (FederatedKMeans workflow).
            seed: model initialisation (all sites alike: they start from the same weights), masks, batches.
            device: "auto" (CUDA when available), "cpu", "cuda", "cuda:1" ...
        """
        super().__init__()
        name = type(self).__name__
        require_choice(name, "method", method, METHODS)
        require_choice(name, "dataset", dataset, DATASETS)
        require(isinstance(data_root, str), name, "data_root", data_root, 'use a path string or ""')
        require_int(name, "patch_size", patch_size, 1, "use a positive patch size (paper: 16)")
        require(isinstance(image_size, int) and not isinstance(image_size, bool) and image_size >= patch_size
                and image_size % patch_size == 0, name, "image_size", image_size,
                f"use a multiple of patch_size={patch_size} (paper: 224)")
        require_int(name, "num_heads", num_heads, 1, "use a positive number of heads (ViT-B: 12)")
        require(isinstance(embed_dim, int) and not isinstance(embed_dim, bool) and embed_dim > 0
                and embed_dim % num_heads == 0, name, "embed_dim", embed_dim,
                f"use a positive multiple of num_heads={num_heads} (ViT-B: 768)")
        require_int(name, "depth", depth, 1, "use a positive number of blocks (ViT-B: 12)")
        require_int(name, "decoder_num_heads", decoder_num_heads, 1, "use a positive number of heads (MAE: 16)")
        require(isinstance(decoder_embed_dim, int) and not isinstance(decoder_embed_dim, bool) and decoder_embed_dim > 0
                and decoder_embed_dim % decoder_num_heads == 0, name, "decoder_embed_dim", decoder_embed_dim,
                f"use a positive multiple of decoder_num_heads={decoder_num_heads} (MAE: 512)")
        require_int(name, "decoder_depth", decoder_depth, 1, "use a positive number of decoder blocks (MAE: 8)")
        require(isinstance(norm_pix_loss, bool), name, "norm_pix_loss", norm_pix_loss, "use true or false")
        require_int(name, "vocab_size", vocab_size, 2, "use the number of visual tokens (DALL-E: 8192)")
        require(isinstance(mask_ratio, (int, float)) and not isinstance(mask_ratio, bool) and 0 < mask_ratio < 1,
                name, "mask_ratio", mask_ratio, "use a fraction in (0, 1): MAE 0.6 (SSL-FL) / 0.75 (FedMAE), BEiT 0.4")
        require(_positive_number(lr), name, "lr", lr, "use a positive learning rate (Table I, e.g. 1e-3)")
        require(isinstance(lr_per_256, bool), name, "lr_per_256", lr_per_256, "use true or false")
        require(isinstance(weight_decay, (int, float)) and not isinstance(weight_decay, bool) and weight_decay >= 0,
                name, "weight_decay", weight_decay, "use a non-negative weight decay (paper: 0.05)")
        require_int(name, "batch_size", batch_size, 1, "use a positive batch size (Table I, e.g. 128)")
        require_int(name, "local_epochs", local_epochs, 1, "use at least one local epoch per round")
        require_int(name, "warmup_rounds", warmup_rounds, 0, "use 0 or more warm-up rounds (MAE 5, BEiT 10)")
        require_int(name, "max_steps_per_round", max_steps_per_round, 0, "use 0 (full epochs) or a positive step count")
        require(isinstance(clip_grad, (int, float)) and not isinstance(clip_grad, bool) and clip_grad >= 0, name,
                "clip_grad", clip_grad, "use 0 (no clipping) or a positive gradient norm (SSL-FL BEiT: 3.0)")
        require(isinstance(amp, bool), name, "amp", amp, "use true or false")
        require(isinstance(tokenizer_path, str), name, "tokenizer_path", tokenizer_path,
                'use a path to a local tokenizer, or "" for the federated k-means codebook')
        require(method == "beit" or tokenizer_path == "", name, "tokenizer_path", tokenizer_path,
                'only Fed-BEiT uses a tokenizer; leave it "" for method "mae"')
        require_int(name, "seed", seed, 0, "use a non-negative integer")
        require(isinstance(device, str) and (device in ("auto", "cpu") or device.startswith("cuda")), name, "device",
                device, 'use "auto", "cpu" or "cuda[:N]"')
        self.method = method
        self.dataset = dataset
        self.data_root = data_root
        self.image_size = image_size
        self.patch_size = patch_size
        self.embed_dim = embed_dim
        self.depth = depth
        self.num_heads = num_heads
        self.decoder_embed_dim = decoder_embed_dim
        self.decoder_depth = decoder_depth
        self.decoder_num_heads = decoder_num_heads
        self.norm_pix_loss = norm_pix_loss
        self.vocab_size = vocab_size
        self.mask_ratio = mask_ratio
        self.lr = lr
        self.lr_per_256 = lr_per_256
        self.weight_decay = weight_decay
        self.batch_size = batch_size
        self.local_epochs = local_epochs
        self.warmup_rounds = warmup_rounds
        self.max_steps_per_round = max_steps_per_round
        self.clip_grad = clip_grad
        self.amp = amp
        self.tokenizer_path = tokenizer_path
        self.seed = seed
        self.device = device
        self._trainer: MIMTrainer | None = None
        self._records = None
        self._dataset: ImageDataset | None = None
        self._tokenizer_desc = ""
        self._last_round = -1
        self._patches: tuple[tuple, torch.Tensor] | None = None  # (sample key, patch vectors) for k-means

    # ------------------------------------------------------------------ helpers
    @property
    def peak_lr(self) -> float:
        return self.lr * self.batch_size / 256 if self.lr_per_256 else self.lr

    def build_model(self) -> torch.nn.Module:
        common = dict(img_size=self.image_size, patch_size=self.patch_size, embed_dim=self.embed_dim, depth=self.depth,
                      num_heads=self.num_heads, seed=self.seed)
        if self.method == "mae":
            return MAEViT(**common, decoder_embed_dim=self.decoder_embed_dim, decoder_depth=self.decoder_depth,
                          decoder_num_heads=self.decoder_num_heads, norm_pix_loss=self.norm_pix_loss)
        return BEiTViT(**common, vocab_size=self.vocab_size)

    def _load_records(self, fl_ctx: FLContext):
        if self._records is None:
            site = self.site_name(fl_ctx)
            self._records = load_image_records(self.resolve_root(self.data_root, fl_ctx), self.dataset, site=site)
        return self._records

    def _codebook_path(self, fl_ctx: FLContext) -> str:
        return os.path.join(self.run_dir(fl_ctx), self.codebook_name)

    def _tokenizer(self, fl_ctx: FLContext):
        """BEiT's tokenizer: the local one, or the federated codebook this site stored (set_tokenizer)."""
        site = self.site_name(fl_ctx)
        if self.tokenizer_path:
            path = self.tokenizer_path
            self._tokenizer_desc = f"local: {path}"
            if not os.path.isfile(path):
                raise ValueError(f"{site}: tokenizer_path {path!r} does not exist; give the path of a local codebook "
                                 'or TorchScript dVAE encoder on this site, or "" for the federated k-means codebook')
        else:
            path = self._codebook_path(fl_ctx)
            if not os.path.isfile(path):
                raise ValueError(f"{site}: tokenizer_path is \"\" but no federated codebook was received ({path} is "
                                 "missing); put the FederatedKMeans workflow before scatter_and_gather in the server "
                                 "config, or set tokenizer_path to a local tokenizer")
        tokenizer = load_tokenizer(path)
        codebook = getattr(tokenizer, "codebook", None)
        if codebook is not None and int(codebook.shape[0]) != self.vocab_size:
            raise ValueError(f"{site}: tokenizer {path} has {int(codebook.shape[0])} tokens but vocab_size="
                             f"{self.vocab_size}; set vocab_size to the tokenizer's size (FederatedKMeans vocab_size)")
        if not self.tokenizer_path:
            self._tokenizer_desc = codebook_description(path) or tokenizer.describe()
        return tokenizer

    def _setup(self, fl_ctx: FLContext, num_rounds: int) -> None:
        site = self.site_name(fl_ctx)
        records = self._load_records(fl_ctx)
        self._dataset = ImageDataset(records, self.image_size, "pretrain", self.dataset, site=site, seed=self.seed)
        tokenizer = self._tokenizer(fl_ctx) if self.method == "beit" else None
        self._trainer = MIMTrainer(self.build_model(), self.method, lr=self.peak_lr, weight_decay=self.weight_decay,
                                   warmup_rounds=self.warmup_rounds, total_rounds=num_rounds,
                                   mask_ratio=self.mask_ratio, tokenizer=tokenizer, device=pick_device(self.device),
                                   seed=self.seed, clip_grad=self.clip_grad or None, amp=self.amp)
        state = self.load_checkpoint(fl_ctx)
        if state is not None:
            self._trainer.load_state_dict(state["trainer"])
            self._last_round = int(state["round"])
        self.log_info(fl_ctx, f"{site}: {len(records)} unlabelled images, {self.method.upper()} on {self._trainer.device}"
                      + (f", tokenizer {self._tokenizer_desc}" if tokenizer is not None else ""))

    def load_global(self, weights: dict, excluded: list, site: str) -> list[str]:
        """Load the broadcast into the local model; keys the server held back keep their local values.

        Returns the keys kept local.  Raises ValueError on unexpected keys, on wrong shapes, and on missing
        keys that the broadcast does not declare as excluded (meta ``excluded_keys``).
        """
        model = self._trainer.model
        own = model.state_dict()
        unexpected = sorted(set(weights) - set(own))
        if unexpected:
            raise ValueError(f"{site}: the global model has {len(unexpected)} keys this {self.method.upper()} model "
                             f"does not have (e.g. {unexpected[:3]}); the server and site model args differ")
        missing = sorted(set(own) - set(weights))
        undeclared = sorted(set(missing) - set(excluded or []))
        if undeclared:
            raise ValueError(f"{site}: the global model lacks {len(undeclared)} keys (e.g. {undeclared[:3]}) that no "
                             "exclusion filter held back; the server and site model args differ")
        state = {}
        for k, v in weights.items():
            t = torch.as_tensor(np.asarray(v))
            if tuple(t.shape) != tuple(own[k].shape):
                raise ValueError(f"{site}: global tensor {k} has shape {tuple(t.shape)}, the local model "
                                 f"{tuple(own[k].shape)}; the server and site model args differ")
            state[k] = t
        # strict=False: the keys the server held back keep this site's values (no unexpected key: checked above)
        return list(model.load_state_dict(state, strict=False).missing_keys)

    # ------------------------------------------------------------------ task: train
    def train(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        site = self.site_name(fl_ctx)
        round_idx = int(shareable.get_header(AppConstants.CURRENT_ROUND, 0))
        num_rounds = int(shareable.get_header(AppConstants.NUM_ROUNDS, 1))
        if self._trainer is None:
            self._setup(fl_ctx, num_rounds)
        trainer = self._trainer
        dxo = from_shareable(shareable)
        if dxo.data_kind != DataKind.WEIGHTS:
            raise ValueError(f"{site}: train task carries {dxo.data_kind}, expected {DataKind.WEIGHTS}")
        kept_local = self.load_global(dxo.data or {}, dxo.get_meta_prop(EXCLUDED_META) or [], site)
        n = len(self._dataset)
        per_epoch = math.ceil(n / self.batch_size)
        steps = self.local_epochs * per_epoch
        if self.max_steps_per_round:
            steps = min(steps, self.max_steps_per_round)

        def round_batches():
            done = 0
            for e in range(self.local_epochs):
                for imgs, _ in batches(self._dataset, self.batch_size, seed=self.seed,
                                       epoch=round_idx * self.local_epochs + e):
                    if abort_signal.triggered:
                        raise TaskAborted()
                    if done >= steps:
                        return
                    done += 1
                    yield imgs

        loss = trainer.train_round(round_batches(), round_idx, steps_per_round=steps)
        if not math.isfinite(loss):
            raise FloatingPointError(f"{site}: {self.method.upper()} loss became {loss} in round {round_idx}; "
                                     "lower lr or check the images")
        self._last_round = round_idx
        self.save_checkpoint(fl_ctx, {"round": round_idx, "trainer": trainer.state_dict(),
                                      "local": {k: trainer.model.state_dict()[k].detach().cpu() for k in kept_local}})
        self.append_metrics(fl_ctx, {"round": round_idx, "loss": loss, "steps": steps, "num_samples": n,
                                     "kept_local": kept_local, "lr_peak": self.peak_lr})
        self.log_info(fl_ctx, f"round {round_idx + 1}/{num_rounds}: {self.method} loss {loss:.4f} ({steps} steps, "
                              f"{n} images" + (f", kept local: {kept_local}" if kept_local else "") + ")")
        weights = {k: v.detach().cpu().numpy() for k, v in trainer.model.state_dict().items()}
        meta = {"num_samples": n, MetaKey.NUM_STEPS_CURRENT_ROUND: steps, "loss": loss}
        if self.method == "beit":
            meta[SITE_RECORD_META] = {"tokenizer": self._tokenizer_desc}
        return DXO(data_kind=DataKind.WEIGHTS, data=weights, meta=meta).to_shareable()

    # ------------------------------------------------------------------ tasks: federated k-means tokenizer
    def _check_kmeans_task(self, shareable: Shareable, fl_ctx: FLContext) -> DXO:
        site = self.site_name(fl_ctx)
        if self.method != "beit" or self.tokenizer_path:
            raise ValueError(f"{site}: received a federated k-means task but this site is configured with method="
                             f"{self.method!r}, tokenizer_path={self.tokenizer_path!r}; remove the FederatedKMeans "
                             'workflow or configure the sites for Fed-BEiT with tokenizer_path ""')
        dxo = from_shareable(shareable)
        K = dxo.get_meta_prop(K_KEY)
        if K != self.vocab_size:
            raise ValueError(f"{site}: the server learns a codebook of K={K} tokens but this site's vocab_size="
                             f"{self.vocab_size}; set FederatedKMeans vocab_size and the sites' vocab_size alike")
        return dxo

    def _patch_sample(self, dxo: DXO, fl_ctx: FLContext) -> torch.Tensor:
        """Patch vectors [N, 3 p^2] of a seeded sample of this site's images (resize + centre crop, normalised)."""
        n_images, seed = int(dxo.get_meta_prop(IMAGES_KEY)), int(dxo.get_meta_prop(SEED_KEY))
        key = (n_images, seed)
        if self._patches is None or self._patches[0] != key:
            site = self.site_name(fl_ctx)
            records = self._load_records(fl_ctx)
            order = np.random.default_rng([seed, 7]).permutation(len(records))
            chosen = [records[i] for i in sorted(order[: n_images] if n_images else order)]
            ds = ImageDataset(chosen, self.image_size, "eval", self.dataset, site=site, seed=self.seed)
            vectors = [patch_vectors(torch.stack([ds[i][0] for i in range(s, min(s + 64, len(ds)))]), self.patch_size)
                       for s in range(0, len(ds), 64)]
            self._patches = (key, torch.cat(vectors).reshape(-1, 3 * self.patch_size ** 2).float())
        return self._patches[1]

    def kmeans_init(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        if self.method == "beit" and self.tokenizer_path:
            self._tokenizer(fl_ctx)  # the local tokenizer must load (and fit vocab_size) before the server skips
            self.log_info(fl_ctx, f"{self.site_name(fl_ctx)}: uses {self._tokenizer_desc}; no federated k-means")
            return DXO(DataKind.COLLECTION, data={}, meta={LOCAL_TOKENIZER_KEY: self._tokenizer_desc}).to_shareable()
        dxo = self._check_kmeans_task(shareable, fl_ctx)
        site = self.site_name(fl_ctx)
        if dxo.get_meta_prop(INIT_KEY) == "random":  # data-free start: the server only needs the patch size
            return DXO(DataKind.COLLECTION, data={}, meta={"patch_size": self.patch_size}).to_shareable()
        x = self._patch_sample(dxo, fl_ctx)  # [N, D]
        K, seed = self.vocab_size, int(dxo.get_meta_prop(SEED_KEY))
        if x.shape[0] < K:
            raise ValueError(f"{site}: only {x.shape[0]} patch vectors for K={K} local centroids; raise the server's "
                             "images_per_site or lower vocab_size")
        codebook = init_codebook(x, K, generator=torch.Generator().manual_seed(seed + 1))
        for _ in range(int(dxo.get_meta_prop(LOCAL_ITERS_KEY))):
            if abort_signal.triggered:
                raise TaskAborted()
            codebook = kmeans_update(codebook, [kmeans_stats(x, codebook)])
        _, counts = kmeans_stats(x, codebook)
        self.log_info(fl_ctx, f"{site}: local k-means of {x.shape[0]} patch vectors -> {int((counts > 0).sum())} "
                              f"non-empty of {K} centroids")
        return DXO(DataKind.COLLECTION, data={"centroids": codebook.float().numpy(), "counts": counts.numpy()},
                   meta={"n_vectors": int(x.shape[0]), "patch_size": self.patch_size}).to_shareable()

    def kmeans_step(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        dxo = self._check_kmeans_task(shareable, fl_ctx)
        codebook = torch.as_tensor(np.asarray(dxo.data["codebook"]), dtype=torch.float32)
        x = self._patch_sample(dxo, fl_ctx)
        if codebook.shape[1] != x.shape[1]:
            raise ValueError(f"{self.site_name(fl_ctx)}: codebook vectors have {codebook.shape[1]} values but this "
                             f"site's patches {x.shape[1]} (patch_size={self.patch_size}); use one patch_size everywhere")
        sums, counts = kmeans_stats(x, codebook)
        sse = sum_squared_distance(x, codebook, sums, counts)
        return DXO(DataKind.COLLECTION, data={"sums": sums.numpy(), "counts": counts.numpy()},
                   meta={ITER_KEY: dxo.get_meta_prop(ITER_KEY), "n_vectors": int(x.shape[0]), "sse": sse}).to_shareable()

    def set_tokenizer(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        dxo = self._check_kmeans_task(shareable, fl_ctx)
        codebook = torch.as_tensor(np.asarray(dxo.data["codebook"]), dtype=torch.float32)
        patch_size = int(dxo.get_meta_prop("patch_size"))
        if codebook.shape != (self.vocab_size, 3 * self.patch_size ** 2) or patch_size != self.patch_size:
            raise ValueError(f"{self.site_name(fl_ctx)}: received a codebook of shape {tuple(codebook.shape)} for patch "
                             f"size {patch_size}; this site expects ({self.vocab_size}, {3 * self.patch_size ** 2})")
        path = self._codebook_path(fl_ctx)
        save_codebook(path, codebook, patch_size, str(dxo.get_meta_prop(DESCRIPTION_KEY)))
        self._patches = None  # the sample is not needed any more
        self.log_info(fl_ctx, f"{self.site_name(fl_ctx)}: stored the federated codebook ({self.vocab_size} tokens) "
                              f"in {path}")
        return DXO(DataKind.METRICS, data={"stored": 1}).to_shareable()
