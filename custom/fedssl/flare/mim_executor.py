"""Client executor for masked-image-modelling pre-training: Fed-MAE / Fed-BEiT (SSL-FL, Yan et al., IEEE TMI 2023),
FedMAE-KS (Wu et al., "Federated Self-Supervised Learning for Dermatological Disease Diagnosis").

Task ``train`` (TrainerExecutor's round protocol): load the global auto-encoder (keys a PartialModelExclusion held
back and listed in the meta ``excluded_keys`` keep this site's values) -> :class:`fedssl.train.mim.MIMLocalTrainer`
-> the weights with ``num_samples`` = |D_k| and the mean loss; the summary record carries the round's feature spread
(``feature_std``, :mod:`fedssl.core.spread`), the loss's chance level the trainer reports (``chance_loss``, where
it has one) and, for Fed-BEiT, its tokenizer's description.

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

from fedssl.core.checks import takes_settings
from fedssl.core.tokenizer import save_codebook
from fedssl.core.trainer import RoundStats
from fedssl.data.images import load_image_records
from fedssl.flare.constants import (DESCRIPTION_KEY, IMAGES_KEY, INIT_KEY, ITER_KEY, K_KEY, KMEANS_INIT, KMEANS_STEP,
                                    LOCAL_ITERS_KEY, LOCAL_TOKENIZER_KEY, MIN_CLUSTER_KEY, SEED_KEY, SET_TOKENIZER,
                                    SITE_RECORD_META, VECTORS_KEY)
from fedssl.flare.site_executor import pick_device
from fedssl.flare.trainer_executor import TrainerExecutor
from fedssl.train.mim import (KMeansPatches, MIMLocalTrainer, MIMSettings, check_kmeans_sharing, check_kmeans_task,
                              cluster_floor, received_codebook, site_tokenizer)


class MIMExecutor(TrainerExecutor):
    task_handlers = {"train": "train", KMEANS_INIT: "kmeans_init", KMEANS_STEP: "kmeans_step",
                     SET_TOKENIZER: "set_tokenizer"}
    checkpoint_name = "mim_client_state.pt"
    metrics_name = "mim_metrics.jsonl"
    #: the federated codebook, in the site's run folder
    codebook_name = "tokenizer_codebook.pt"

    @takes_settings(MIMSettings)
    def __init__(self, **args):
        """The arguments are the fields of :class:`fedssl.train.mim.MIMSettings` (defaults: Fed-MAE on Retina, SSL-FL
        sec. IV-A.3 and Table I; documented there), each stored verbatim and checked at once; an unknown name is
        refused."""
        super().__init__()
        self.configure(MIMSettings, args)
        self.records = None
        self.patches: KMeansPatches | None = None  # the k-means sample of this site's patches

    peak_lr = property(lambda self: self.settings.peak_lr)

    def site_records(self, fl_ctx: FLContext):
        if self.records is None:
            root = self.resolve_root(self.data_root, fl_ctx)
            self.records = load_image_records(root, self.dataset, site=self.site_name(fl_ctx))
        return self.records

    def codebook_path(self, fl_ctx: FLContext) -> str:
        return os.path.join(self.run_dir(fl_ctx), self.codebook_name)

    def build_trainer(self, fl_ctx: FLContext, num_rounds: int) -> MIMLocalTrainer:
        site, records = self.site_name(fl_ctx), self.site_records(fl_ctx)
        trainer = MIMLocalTrainer(records, self.settings, num_rounds=num_rounds, site=site,
                                  codebook_path=self.codebook_path(fl_ctx), device=pick_device(self.device))
        self.log_info(fl_ctx, f"{site}: {len(records)} unlabelled images, {self.method.upper()} on {trainer.device}"
                      + (f", tokenizer {trainer.tokenizer_description}" if self.method == "beit" else ""))
        return trainer

    def result_meta(self, stats: RoundStats, dxo: DXO, fl_ctx: FLContext) -> dict:
        """The summary record: the round's feature spread and the loss's chance level (bounded numbers: the run
        summary averages them over the sites per round) and, for Fed-BEiT, the tokenizer's description."""
        record = {k: stats.metrics[k] for k in ("feature_std", "chance_loss") if stats.metrics.get(k) is not None}
        if self.method == "beit":
            record["tokenizer"] = self.trainer.tokenizer_description
        return {SITE_RECORD_META: record} if record else {}

    def describe_round(self, stats: RoundStats) -> str:
        kept = stats.metrics.get("kept_local")
        return (f"{self.method} loss {stats.loss:.4f} ({stats.steps} steps, {stats.samples} images"
                + (f", kept local: {kept}" if kept else "") + ")")

    # ------------------------------------------------------------------ tasks: federated k-means tokenizer
    def kmeans_task(self, shareable: Shareable, fl_ctx: FLContext, shares: bool = False) -> DXO:
        """The task's DXO, checked; ``shares``: the answer holds statistics of the site's patches (consent needed)."""
        dxo, site = from_shareable(shareable), self.site_name(fl_ctx)
        check_kmeans_task(site, self.settings, dxo.get_meta_prop(K_KEY))
        if shares and dxo.get_meta_prop(INIT_KEY) != "random":  # the data-free start sends no statistic
            ws = fl_ctx.get_engine().get_workspace()
            check_kmeans_sharing(site, self.share_kmeans_statistics, ws.get_site_config_dir())
        return dxo

    def min_cluster_size_for(self, dxo: DXO, site: str) -> int:
        """The larger of this site's min_cluster_size and the server's (a server value below 2 is refused)."""
        return cluster_floor(site, dxo.get_meta_prop(MIN_CLUSTER_KEY), self.min_cluster_size, MIN_CLUSTER_KEY)

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
        dxo = self.kmeans_task(shareable, fl_ctx, shares=True)
        if dxo.get_meta_prop(INIT_KEY) == "random":  # data-free start: the server only needs the patch size
            return DXO(DataKind.COLLECTION, data={}, meta={"patch_size": self.patch_size}).to_shareable()
        m = self.min_cluster_size_for(dxo, site)
        centroids, counts, n = self.kmeans_patches(fl_ctx).local_centroids(
            self.vocab_size, int(dxo.get_meta_prop(IMAGES_KEY)), int(dxo.get_meta_prop(SEED_KEY)),
            dxo.get_meta_prop(LOCAL_ITERS_KEY), m, should_stop=lambda: abort_signal.triggered)
        self.log_info(fl_ctx, f"{site}: local k-means of {n} patch vectors -> {int((counts > 0).sum())} centroids "
                              f"sent (means of >= {m} vectors; {n - int(counts.sum())} in smaller ones withheld)")
        return DXO(DataKind.COLLECTION, data={"centroids": centroids.numpy(), "counts": counts.numpy()},
                   meta={VECTORS_KEY: n, "patch_size": self.patch_size, MIN_CLUSTER_KEY: m}).to_shareable()

    def kmeans_step(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        dxo = self.kmeans_task(shareable, fl_ctx, shares=True)
        m = self.min_cluster_size_for(dxo, self.site_name(fl_ctx))
        codebook = torch.as_tensor(np.asarray(dxo.data["codebook"]), dtype=torch.float32)
        sums, counts, sse, n = self.kmeans_patches(fl_ctx).e_step(codebook, int(dxo.get_meta_prop(IMAGES_KEY)),
                                                                  int(dxo.get_meta_prop(SEED_KEY)), m)
        return DXO(DataKind.COLLECTION, data={"sums": sums.float().numpy(), "counts": counts.numpy()},
                   meta={ITER_KEY: dxo.get_meta_prop(ITER_KEY), VECTORS_KEY: n, "sse": sse,
                         MIN_CLUSTER_KEY: m}).to_shareable()

    def set_tokenizer(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        dxo = self.kmeans_task(shareable, fl_ctx)
        site, patch_size = self.site_name(fl_ctx), int(dxo.get_meta_prop("patch_size"))
        codebook = received_codebook(site, dxo.data["codebook"], patch_size, self.patch_size, self.vocab_size)
        path = save_codebook(self.codebook_path(fl_ctx), codebook, patch_size, str(dxo.get_meta_prop(DESCRIPTION_KEY)))
        self.patches = None  # the sample is not needed any more
        self.log_info(fl_ctx, f"{site}: stored the federated codebook ({self.vocab_size} tokens) in {path}")
        return DXO(DataKind.METRICS, data={"stored": 1}).to_shareable()
