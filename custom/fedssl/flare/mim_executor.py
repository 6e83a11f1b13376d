"""Client executor for masked-image-modelling pre-training: Fed-MAE / Fed-BEiT (SSL-FL, Yan et al., IEEE TMI 2023), FedMAE-KS (Wu et al., "Federated Self-Supervised Learning for Dermatological Disease Diagnosis").

Task ``train`` (TrainerExecutor's round protocol): load the global auto-encoder (keys a PartialModelExclusion held
back and listed in the meta ``excluded_keys`` keep this site's values) -> :class:`fedssl.train.mim.MIMLocalTrainer`
-> the weights with ``num_samples`` = |D_k| and the mean loss; the summary record carries the round's feature spread
(``feature_std``, :mod:`fedssl.core.spread`) and, for Fed-BEiT, its tokenizer's description.

Fed-BEiT tokenizer: ``tokenizer_path`` names a local codebook / TorchScript dVAE encoder; "" means the codebook
learnt by the FederatedKMeans workflow before pre-training: the site answers ``kmeans_init`` (the means of its
local k-means clusters, or only its patch size for a random start), ``kmeans_step`` (E-step sums and counts
against the broadcast codebook) and ``set_tokenizer`` (stores the final codebook in its run folder, so a
restarted client finds it again).  Never an image or a patch: every mean or sum it sends covers at least
``min_cluster_size`` patch vectors (the larger of this site's setting and the server's; smaller clusters are
sent as zero sum, zero count), and a server asking for fewer than 2 or for no local Lloyd step is refused.
A site with a local tokenizer answers ``kmeans_init`` with its description ("local: <path>") and the server
skips the federated k-means.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.apis.signal import Signal

from fedssl.core.tokenizer import save_codebook
from fedssl.core.trainer import RoundStats
from fedssl.data.images import load_image_records
from fedssl.flare.constants import (DESCRIPTION_KEY, IMAGES_KEY, INIT_KEY, ITER_KEY, K_KEY, KMEANS_INIT, KMEANS_STEP,
                                    LOCAL_ITERS_KEY, LOCAL_TOKENIZER_KEY, MIN_CLUSTER_KEY, SEED_KEY, SET_TOKENIZER,
                                    SITE_RECORD_META, VECTORS_KEY)
from fedssl.flare.site_executor import pick_device
from fedssl.flare.trainer_executor import TrainerExecutor
from fedssl.train.mim import KMeansPatches, MIMLocalTrainer, check_mim_args, peak_lr, site_tokenizer


class MIMExecutor(TrainerExecutor):
    task_handlers = {"train": "train", KMEANS_INIT: "kmeans_init", KMEANS_STEP: "kmeans_step",
                     SET_TOKENIZER: "set_tokenizer"}
    checkpoint_name = "mim_client_state.pt"
    metrics_name = "mim_metrics.jsonl"
    #: the federated codebook, in the site's run folder
    codebook_name = "tokenizer_codebook.pt"

    def __init__(self, method: str = "mae", dataset: str = "retina", data_root: str = "", image_size: int = 224,
                 patch_size: int = 16, embed_dim: int = 768, depth: int = 12, num_heads: int = 12,
                 decoder_embed_dim: int = 512, decoder_depth: int = 8, decoder_num_heads: int = 16,
                 norm_pix_loss: bool = True, vocab_size: int = 8192, mask_ratio: float = 0.6, lr: float = 1e-3,
                 lr_per_256: bool = False, min_lr: float = 0.0, weight_decay: float = 0.05, batch_size: int = 128, local_epochs: int = 1,
                 warmup_rounds: int = 5, max_steps_per_round: int = 0, clip_grad: float = 0.0, amp: bool = False,
                 tokenizer_path: str = "", min_cluster_size: int = 5, seed: int = 0, device: str = "auto",
                 workers: int = 0):
        """Args (defaults: Fed-MAE on Retina, SSL-FL sec. IV-A.3 and Table I): the settings of
        :class:`fedssl.train.mim.MIMLocalTrainer` (documented there), plus
            data_root: the site's folder; "" = site config / FEDSSL_DATA_ROOT; ``{site}`` is replaced;
            min_cluster_size: Fed-BEiT federated k-means: the fewest patch vectors a mean or sum this site sends
                may cover (>= 2; the server's FederatedKMeans min_cluster_size applies when larger), see
                :class:`fedssl.train.mim.KMeansPatches`;
            device: "auto" (CUDA when available), "cpu", "cuda", "cuda:1" ...
        """
        args = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        super().__init__()
        check_mim_args(type(self).__name__, args)
        self.__dict__.update(args)  # stored verbatim
        self.settings = args
        self.records = None
        self.patches: KMeansPatches | None = None  # the k-means sample of this site's patches

    @property
    def peak_lr(self) -> float:
        return peak_lr(self.lr, self.batch_size, self.lr_per_256)

    def site_records(self, fl_ctx: FLContext):
        if self.records is None:
            root = self.resolve_root(self.data_root, fl_ctx)
            self.records = load_image_records(root, self.dataset, site=self.site_name(fl_ctx))
        return self.records

    def codebook_path(self, fl_ctx: FLContext) -> str:
        return os.path.join(self.run_dir(fl_ctx), self.codebook_name)

    def build_trainer(self, fl_ctx: FLContext, num_rounds: int) -> MIMLocalTrainer:
        site, records = self.site_name(fl_ctx), self.site_records(fl_ctx)
        settings = {k: v for k, v in self.settings.items() if k not in ("data_root", "min_cluster_size")}
        trainer = MIMLocalTrainer(records, num_rounds=num_rounds, site=site, codebook_path=self.codebook_path(fl_ctx),
                                  **{**settings, "device": pick_device(self.device)})
        self.log_info(fl_ctx, f"{site}: {len(records)} unlabelled images, {self.method.upper()} on {trainer.device}"
                      + (f", tokenizer {trainer.tokenizer_description}" if self.method == "beit" else ""))
        return trainer

    def result_meta(self, stats: RoundStats, dxo: DXO, fl_ctx: FLContext) -> dict:
        """The summary record: the round's feature spread (a bounded number: the run summary averages it over
        the sites per round) and, for Fed-BEiT, the tokenizer's description."""
        spread = stats.metrics.get("feature_std")
        record = {} if spread is None else {"feature_std": spread}
        if self.method == "beit":
            record["tokenizer"] = self.trainer.tokenizer_description
        return {SITE_RECORD_META: record} if record else {}

    def describe_round(self, stats: RoundStats) -> str:
        kept = stats.metrics.get("kept_local")
        return (f"{self.method} loss {stats.loss:.4f} ({stats.steps} steps, {stats.samples} images"
                + (f", kept local: {kept}" if kept else "") + ")")

    # ------------------------------------------------------------------ tasks: federated k-means tokenizer
    def kmeans_task(self, shareable: Shareable, fl_ctx: FLContext) -> DXO:
        site = self.site_name(fl_ctx)
        if self.method != "beit" or self.tokenizer_path:
            raise ValueError(f"{site}: received a federated k-means task but this site is configured with method="
                             f"{self.method!r}, tokenizer_path={self.tokenizer_path!r}; remove the FederatedKMeans "
                             'workflow or configure the sites for Fed-BEiT with tokenizer_path ""')
        dxo = from_shareable(shareable)
        if dxo.get_meta_prop(K_KEY) != self.vocab_size:
            raise ValueError(f"{site}: the server learns a codebook of K={dxo.get_meta_prop(K_KEY)} tokens but this "
                             f"site's vocab_size={self.vocab_size}; set FederatedKMeans vocab_size and the sites' "
                             "vocab_size alike")
        return dxo

    def min_cluster_size_for(self, dxo: DXO, site: str) -> int:
        """The larger of this site's min_cluster_size and the server's (a server value below 2 is refused)."""
        requested = dxo.get_meta_prop(MIN_CLUSTER_KEY)
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 2:
            raise ValueError(f"{site}: the server asks for k-means statistics with {MIN_CLUSTER_KEY}={requested!r}; "
                             "this site sends only means of >= 2 patch vectors: set FederatedKMeans "
                             f"{MIN_CLUSTER_KEY} to an integer >= 2")
        return max(requested, self.min_cluster_size)

    def kmeans_patches(self, fl_ctx: FLContext) -> KMeansPatches:
        if self.patches is None:
            self.patches = KMeansPatches(self.site_records(fl_ctx), dataset=self.dataset, image_size=self.image_size,
                                         patch_size=self.patch_size, site=self.site_name(fl_ctx), seed=self.seed)
        return self.patches

    def kmeans_init(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        site = self.site_name(fl_ctx)
        if self.method == "beit" and self.tokenizer_path:  # the local tokenizer must load (and fit vocab_size)
            _, description = site_tokenizer(site, self.tokenizer_path, "", self.vocab_size)
            self.log_info(fl_ctx, f"{site}: uses {description}; no federated k-means")
            return DXO(DataKind.COLLECTION, data={}, meta={LOCAL_TOKENIZER_KEY: description}).to_shareable()
        dxo = self.kmeans_task(shareable, fl_ctx)
        if dxo.get_meta_prop(INIT_KEY) == "random":  # data-free start: the server only needs the patch size
            return DXO(DataKind.COLLECTION, data={}, meta={"patch_size": self.patch_size}).to_shareable()
        m = self.min_cluster_size_for(dxo, site)
        centroids, counts, n = self.kmeans_patches(fl_ctx).local_centroids(
            self.vocab_size, int(dxo.get_meta_prop(IMAGES_KEY)), int(dxo.get_meta_prop(SEED_KEY)),
            dxo.get_meta_prop(LOCAL_ITERS_KEY), m, should_stop=lambda: abort_signal.triggered)
        self.log_info(fl_ctx, f"{site}: local k-means of {n} patch vectors -> {int((counts > 0).sum())} of "
                              f"{self.vocab_size} centroids sent (means of >= {m} vectors; "
                              f"{n - int(counts.sum())} vectors in smaller clusters withheld)")
        return DXO(DataKind.COLLECTION, data={"centroids": centroids.numpy(), "counts": counts.numpy()},
                   meta={VECTORS_KEY: n, "patch_size": self.patch_size, MIN_CLUSTER_KEY: m}).to_shareable()

    def kmeans_step(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        dxo = self.kmeans_task(shareable, fl_ctx)
        m = self.min_cluster_size_for(dxo, self.site_name(fl_ctx))
        codebook = torch.as_tensor(np.asarray(dxo.data["codebook"]), dtype=torch.float32)
        sums, counts, sse, n = self.kmeans_patches(fl_ctx).e_step(codebook, int(dxo.get_meta_prop(IMAGES_KEY)),
                                                                  int(dxo.get_meta_prop(SEED_KEY)), m)
        return DXO(DataKind.COLLECTION, data={"sums": sums.float().numpy(), "counts": counts.numpy()},
                   meta={ITER_KEY: dxo.get_meta_prop(ITER_KEY), VECTORS_KEY: n, "sse": sse,
                         MIN_CLUSTER_KEY: m}).to_shareable()

    def set_tokenizer(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        dxo = self.kmeans_task(shareable, fl_ctx)
        codebook = torch.as_tensor(np.asarray(dxo.data["codebook"]), dtype=torch.float32)
        patch_size, site = int(dxo.get_meta_prop("patch_size")), self.site_name(fl_ctx)
        if codebook.shape != (self.vocab_size, 3 * self.patch_size ** 2) or patch_size != self.patch_size:
            raise ValueError(f"{site}: received a codebook of shape {tuple(codebook.shape)} for patch size "
                             f"{patch_size}; this site expects ({self.vocab_size}, {3 * self.patch_size ** 2})")
        if not torch.isfinite(codebook).all():
            raise ValueError(f"{site}: received a codebook with NaN/Inf values; not stored (see the server's log)")
        path = save_codebook(self.codebook_path(fl_ctx), codebook, patch_size, str(dxo.get_meta_prop(DESCRIPTION_KEY)))
        self.patches = None  # the sample is not needed any more
        self.log_info(fl_ctx, f"{site}: stored the federated codebook ({self.vocab_size} tokens) in {path}")
        return DXO(DataKind.METRICS, data={"stored": 1}).to_shareable()
