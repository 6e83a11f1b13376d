"""Server workflow that learns Fed-BEiT's visual tokenizer by federated k-means, before pre-training starts.

SSL-FL (SSL-FL (Yan et al., IEEE TMI 2023), sec. III-C) predicts the DALL-E dVAE token of every masked patch; that
tokenizer cannot be downloaded here, so the bundle can learn a patch codebook inside the federation instead: K =
vocab_size centroids of the sites' patch vectors (``fedssl.core.tokenizer.patch_vectors``: each p x p x 3 patch
normalised by its own mean and variance).  Raw images and patches never leave a site:

1. ``kmeans_init``, with ``init="local_kmeans"``: every site runs k-means++ and ``local_iters`` (>= 1) Lloyd
   steps on its own patch vectors and returns the means of its K local clusters with their sizes; the server
   seeds the codebook by k-means++ over the pooled local means (``fedssl.core.tokenizer.init_codebook``).
   With ``init="random"`` (data-free) the sites only report their patch size and the server starts from
   ``fedssl.core.tokenizer.random_codebook``; clusters no patch ever reaches keep their random centroid.
2. ``kmeans_step`` x n_iters: the server broadcasts the codebook; each site returns its E-step statistics
   (per-centroid sums and counts); the server's M-step (``kmeans_update``) averages them.
3. The codebook is written to the server run folder (``codebook_file``) and sent once to every site
   (``set_tokenizer``); it is never part of a training round's payload.

No raw patch leaves a site (``min_cluster_size`` m, default 5, >= 2).  The mean or sum of a cluster of one is
that patch, and the k-means++ seeds of a site's local k-means are patches.  So a site sends only statistics
of at least m vectors: a cluster with fewer members goes up as zero sum and zero count (the site uses the
larger of its own MIMExecutor ``min_cluster_size`` and this one), and in step 1 it sends the means of its
last local Lloyd step, never the seeds; ``local_iters=0`` is refused.  It stays k-means.  Each exchange is
still one Lloyd step on the union of the sites' patches, less the vectors of clusters that have fewer than m
members at their site.  Those vectors count as unassigned for that step, and a cluster no site reports keeps
its centroid, as an empty cluster always does.  Measured on synthetic retina at the quick profile's scale (3
sites, K=64 and K=256, about 16 vectors per local cluster), m=5 left out 5-6 % of the vectors per step, and
the final k-means cost was within 0.5-1.5 % of the unsuppressed cost (m=10: 16-21 % left out, cost +15-18 %).
5 is also the usual small-cell threshold of health statistics.  Not covered: the differences between one
site's statistics of successive iterations over the same sample (a cluster that loses one member between
steps reveals that member's vector to a server that tracks them).  That needs secure aggregation or
differential privacy, which this bundle does not provide (README, threat model).

Every site contribution is checked before it touches the codebook (``fedssl.core.untrusted``).  It must come
from a client of this run and answer the current iteration.  Its arrays are cast to float32 / int64
(``cast_array``: a float64 1e300 overflows to inf and is refused) with the codebook's shape, and its values
must be finite.  The declared sample size ``n_vectors`` must be whole images of the site, at most
``images_per_site x (image_size / patch_size)^2``, and the same in every step.  Counts must be non-negative,
each 0 or >= m, and add up to at most ``n_vectors``.  Sums and means must fit their counts:
``||S_k|| <= n_k sqrt(D - 1)``, the norm bound of patch vectors (``patch_norm_bound``), and zero where the count
is 0.  The cost ``sse`` must be a finite number in ``[0, 4 (D - 1) sum(counts)]``.  A site that fails a check
is left out of that exchange and named in the log ("REJECTED k-means contribution: ..."); the run goes on
as long as ``min_clients`` sites remain.

Put this workflow before ScatterAndGather in ``config_fed_server.json``: FLARE's ServerRunner runs the
configured workflows one after the other, in order, in one job.  The run summary records
``"tokenizer": "federated k-means K=..., iters=..."`` and the details (``tokenizer_details``).

Sites configured with a local tokenizer (MIMExecutor ``tokenizer_path``) answer ``kmeans_init`` with that
path instead of centroids; when every site does, the workflow stops there (nothing learnt, nothing sent)
and the summary's ``tokenizer`` is the sites' own ``"local: <path>"`` record.  A mix of both is an error.
"""

from __future__ import annotations

import math
import os
import time

import numpy as np
import torch
from nvflare.apis.controller_spec import ClientTask, Task
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.impl.controller import Controller
from nvflare.apis.signal import Signal

from fedssl.core.checks import require, require_choice, require_int
from fedssl.core.tokenizer import init_codebook, kmeans_update, patch_norm_bound, random_codebook, save_codebook
from fedssl.core.untrusted import ContributionError, as_count, as_finite_float, cast_array
from fedssl.flare.constants import (
    DESCRIPTION_KEY,
    IMAGES_KEY,
    INIT_KEY,
    ITER_KEY,
    K_KEY,
    KMEANS_INIT,
    KMEANS_STEP,
    LOCAL_ITERS_KEY,
    LOCAL_TOKENIZER_KEY,
    MIN_CLUSTER_KEY,
    SEED_KEY,
    SET_TOKENIZER,
    VECTORS_KEY,
)
from fedssl.flare.run_summary import record_in_summary

TOKENIZER_TASKS = (KMEANS_INIT, KMEANS_STEP, SET_TOKENIZER)
INITS = ("local_kmeans", "random")
#: relative slack of the norm bound for float32 rounding of a site's sums
NORM_SLACK = 1e-4


class KMeansError(ValueError):
    """Too few sites sent a usable k-means contribution, or the sites are configured inconsistently."""


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def describe(vocab_size: int, n_iters: int) -> str:
    return f"federated k-means K={vocab_size}, iters={n_iters}"


class FederatedKMeans(Controller):
    def __init__(
        self,
        vocab_size: int = 8192,
        n_iters: int = 10,
        images_per_site: int = 1000,
        local_iters: int = 5,
        min_clients: int = 5,
        wait_time_after_min_received: int = 10,
        task_timeout: int = 0,
        seed: int = 0,
        codebook_file: str = "tokenizer_codebook.pt",
        init: str = "local_kmeans",
        min_cluster_size: int = 5,
        image_size: int = 224,
        patch_size: int = 16,
    ):
        """
        Args:
            vocab_size: K, the number of visual tokens (must equal the sites' BEiT ``vocab_size``; DALL-E: 8192).
            n_iters: federated Lloyd iterations (one ``kmeans_step`` exchange each).
            images_per_site: images each site draws (seeded) for its patch vectors; 0 = all its images (then a
                site's weight in the M-step is bounded only by the sample size it declares).
            local_iters: Lloyd steps (>= 1) of each site's local k-means that seeds the codebook.
            min_clients: sites that must answer each exchange.
            wait_time_after_min_received: seconds to wait for the other sites once min_clients answered.
            task_timeout: seconds per exchange (0 = no limit).
            seed: seeds the sites' image sample and the server's k-means++.
            codebook_file: file name of the codebook in the server run folder.
            init: "local_kmeans" (k-means++ over the sites' local cluster means) or "random" (data-free start).
            min_cluster_size: m >= 2, the fewest patch vectors a statistic from a site may cover (module docstring).
            image_size, patch_size: the sites' (MIMExecutor) image and patch size: the codebook's dimension
                3 p^2 and the patches per image, which bound a site's sample.
        """
        super().__init__()
        name = type(self).__name__
        require_int(name, "vocab_size", vocab_size, 2, "use the number of visual tokens K >= 2 (DALL-E: 8192)")
        require_int(name, "n_iters", n_iters, 1, "use at least one federated Lloyd iteration")
        require_int(name, "images_per_site", images_per_site, 0, "use a positive number of images, or 0 for all")
        require_int(name, "local_iters", local_iters, 1, "use at least one local Lloyd step: with 0 a site's local "
                    "centroids would be its k-means++ seeds, which are single patches")
        require_int(name, "min_clients", min_clients, 1, "use the number of sites that must answer")
        require_int(name, "wait_time_after_min_received", wait_time_after_min_received, 0, "use seconds >= 0")
        require_int(name, "task_timeout", task_timeout, 0, "use seconds >= 0 (0 = no limit)")
        require_int(name, "seed", seed, 0, "use a non-negative integer")
        require(isinstance(codebook_file, str) and codebook_file.endswith(".pt")
                and os.path.basename(codebook_file) == codebook_file, name, "codebook_file", codebook_file,
                'use a plain file name ending in ".pt"')
        require_choice(name, "init", init, INITS)
        require_int(name, "min_cluster_size", min_cluster_size, 2, "use an integer >= 2: a k-means statistic of "
                    "one patch vector is that patch (default 5)")
        require_int(name, "patch_size", patch_size, 1, "use the sites' ViT patch size (16)")
        require(isinstance(image_size, int) and not isinstance(image_size, bool) and image_size >= patch_size
                and image_size % patch_size == 0, name, "image_size", image_size,
                f"use the sites' image size, a multiple of patch_size={patch_size} (224)")
        self.vocab_size = vocab_size
        self.n_iters = n_iters
        self.images_per_site = images_per_site
        self.local_iters = local_iters
        self.min_clients = min_clients
        self.wait_time_after_min_received = wait_time_after_min_received
        self.task_timeout = task_timeout
        self.seed = seed
        self.codebook_file = codebook_file
        self.init = init
        self.min_cluster_size = min_cluster_size
        self.image_size = image_size
        self.patch_size = patch_size
        self.dim = 3 * patch_size ** 2  # D of a patch vector
        self.patches_per_image = (image_size // patch_size) ** 2
        self.history: list[dict] = []  # per iteration: sites, vectors, mean squared distance, codebook shift
        self.declared: dict[str, int] = {}  # site -> the sample size it declared first (fixed for the run)

    def start_controller(self, fl_ctx: FLContext) -> None:
        self.history = []
        self.declared = {}

    def stop_controller(self, fl_ctx: FLContext) -> None:
        pass

    def process_result_of_unknown_task(self, client, task_name, client_task_id, result, fl_ctx) -> None:
        self.log_warning(fl_ctx, f"late {task_name} result from {client.name} ignored")

    # ------------------------------------------------------------------ exchanges
    def _task_meta(self) -> dict:
        return {K_KEY: self.vocab_size, IMAGES_KEY: self.images_per_site, LOCAL_ITERS_KEY: self.local_iters,
                SEED_KEY: self.seed, INIT_KEY: self.init, MIN_CLUSTER_KEY: self.min_cluster_size}

    def _exchange(self, name: str, data: dict, meta: dict, fl_ctx: FLContext, abort_signal: Signal) -> dict[str, DXO]:
        """Broadcast one task, wait for min_clients, return the sites' result DXOs (failed sites left out)."""
        task = Task(name=name, data=DXO(DataKind.COLLECTION, data=data, meta=meta).to_shareable(),
                    timeout=self.task_timeout)
        self.broadcast_and_wait(task=task, fl_ctx=fl_ctx, min_responses=self.min_clients,
                                wait_time_after_min_received=self.wait_time_after_min_received,
                                abort_signal=abort_signal)
        clients = {getattr(c, "name", None) for c in fl_ctx.get_engine().get_clients()}
        results = {}
        for ct in task.client_tasks:
            if ct.client.name not in clients:
                self.log_error(fl_ctx, f"REJECTED k-means contribution: {ct.client.name!r} is not a client of this "
                                       f"run ({sorted(clients)}); its {name} result is ignored")
                continue
            dxo = self._result_of(ct, fl_ctx)
            if dxo is not None:
                results[ct.client.name] = dxo
        return results

    def _result_of(self, ct: ClientTask, fl_ctx: FLContext) -> DXO | None:
        if ct.result is None:
            self.log_warning(fl_ctx, f"{ct.client.name} sent no result for {ct.task.name}")
            return None
        rc = ct.result.get_return_code()
        if not (rc is None or (isinstance(rc, str) and rc == ReturnCode.OK)):
            self.log_warning(fl_ctx, f"{ct.client.name} returned {_short(rc)} for {ct.task.name}; left out")
            return None
        try:
            dxo = from_shareable(ct.result)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            self.log_warning(fl_ctx, f"{ct.client.name} sent an unreadable {ct.task.name} result ({e}); left out")
            return None
        if not isinstance(dxo.data, dict):
            self.log_warning(fl_ctx, f"{ct.client.name} sent {ct.task.name} data of type {type(dxo.data).__name__}, "
                                     "not a dict; left out")
            return None
        return dxo

    def _enough(self, results: dict, what: str) -> None:
        if len(results) < self.min_clients:
            raise KMeansError(f"{what}: only {len(results)} of the required {self.min_clients} sites sent a valid "
                              f"result ({sorted(results)}); see the REJECTED lines of the log and the sites' logs")

    # ------------------------------------------------------------------ checks of site contributions
    def _sample_size(self, dxo: DXO, site: str, task: str) -> int:
        """The site's declared sample size: whole images, at most images_per_site of them, fixed for the run."""
        cap = self.images_per_site * self.patches_per_image if self.images_per_site else math.inf
        n = as_count(dxo.get_meta_prop(VECTORS_KEY), f"{VECTORS_KEY} in {task}", site, cap=cap)
        if n % self.patches_per_image:
            raise ContributionError(f"{site} sent {VECTORS_KEY}={n} in {task}; not a whole number of images of "
                                    f"{self.patches_per_image} patches")
        first = self.declared.setdefault(site, n)
        if n != first:
            raise ContributionError(f"{site} sent {VECTORS_KEY}={n} in {task} after declaring {first}; a site's "
                                    "sample is fixed for the run")
        return n

    def _counts(self, dxo: DXO, site: str, task: str, n: int) -> np.ndarray:
        counts = cast_array((dxo.data or {}).get("counts"), np.int64, f"'counts' in {task}", site,
                            shape=(self.vocab_size,))
        if (counts < 0).any() or int(counts.sum()) > n:
            raise ContributionError(f"{site} sent 'counts' in {task} that are negative or add up to "
                                    f"{int(counts.sum())} > its {n} patch vectors")
        small = counts[(counts > 0) & (counts < self.min_cluster_size)]
        if small.size:
            raise ContributionError(f"{site} sent a cluster of {int(small.min())} patch vectors in {task}, fewer than "
                                    f"{MIN_CLUSTER_KEY}={self.min_cluster_size}: it would reveal patches; left out")
        return counts

    def _vectors(self, dxo: DXO, key: str, site: str, task: str, counts: np.ndarray, sums: bool) -> np.ndarray:
        """``key`` [K, D] as float32; each row's norm at most ``sqrt(D - 1)`` times its count (``sums``) or once
        (means), and zero where the count is 0."""
        rows = cast_array((dxo.data or {}).get(key), np.float32, f"{key!r} in {task}", site,
                          shape=(self.vocab_size, self.dim))
        norms = np.linalg.norm(rows.astype(np.float64), axis=1)
        scale = counts if sums else (counts > 0)
        limit = scale * patch_norm_bound(self.dim) * (1 + NORM_SLACK)
        if (norms > limit).any():
            k = int(np.argmax(norms - limit))
            raise ContributionError(f"{site} sent {key!r} in {task} with row {k} of norm {norms[k]:.4g} for a count "
                                    f"of {int(counts[k])}; patch vectors have norm < sqrt(D - 1) = "
                                    f"{patch_norm_bound(self.dim):.4g}")
        return rows

    def _patch_size_ok(self, dxo: DXO, site: str, task: str) -> None:
        reported = dxo.get_meta_prop("patch_size")
        if isinstance(reported, bool) or not isinstance(reported, int) or reported != self.patch_size:
            raise ContributionError(f"{site} reports patch_size={reported!r} in {task} but this job's is "
                                    f"{self.patch_size}; configure the site with the job's patch_size")

    def _checked(self, results: dict[str, DXO], check, fl_ctx: FLContext) -> dict:
        """``check(site, dxo)`` for every site; a site whose contribution fails is logged and left out."""
        good = {}
        for site, dxo in sorted(results.items()):
            try:
                good[site] = check(site, dxo)
            except ContributionError as e:
                self.log_error(fl_ctx, f"REJECTED k-means contribution: {e}")
        return good

    def _check_init(self, results: dict[str, DXO], fl_ctx: FLContext) -> list[np.ndarray]:
        """The sites' local cluster means (only those of non-empty clusters)."""
        def check(site: str, dxo: DXO) -> np.ndarray:
            self._patch_size_ok(dxo, site, KMEANS_INIT)
            n = self._sample_size(dxo, site, KMEANS_INIT)
            counts = self._counts(dxo, site, KMEANS_INIT, n)
            return self._vectors(dxo, "centroids", site, KMEANS_INIT, counts, sums=False)[counts > 0]

        good = self._checked(results, check, fl_ctx)
        self._enough(good, KMEANS_INIT)
        pooled = sum(c.shape[0] for c in good.values())
        if pooled < self.vocab_size:
            raise KMeansError(f"the sites' local k-means gave {pooled} centroids of >= {self.min_cluster_size} "
                              f"vectors in all, fewer than vocab_size K={self.vocab_size}; lower vocab_size or "
                              "min_cluster_size, or raise images_per_site")
        return list(good.values())

    def _check_random_init(self, results: dict[str, DXO], fl_ctx: FLContext) -> None:
        """init="random": the sites only report their patch size, which must be the job's."""
        self._enough(self._checked(results, lambda site, dxo: self._patch_size_ok(dxo, site, KMEANS_INIT), fl_ctx),
                     KMEANS_INIT)

    def _check_step(self, results: dict[str, DXO], it: int, fl_ctx: FLContext) -> dict:
        task = f"{KMEANS_STEP} {it}"

        def check(site: str, dxo: DXO) -> tuple[torch.Tensor, torch.Tensor, float]:
            answered = dxo.get_meta_prop(ITER_KEY)
            if isinstance(answered, bool) or not isinstance(answered, int) or answered != it:
                raise ContributionError(f"{site} answered k-means iteration {answered!r} during {it}")
            n = self._sample_size(dxo, site, task)
            counts = self._counts(dxo, site, task, n)
            sums = self._vectors(dxo, "sums", site, task, counts, sums=True)
            worst = 4.0 * (self.dim - 1) * float(counts.sum())  # ||x - c||^2 <= (2 sqrt(D - 1))^2 per vector
            sse = as_finite_float(dxo.get_meta_prop("sse"), f"sse in {task}", site, bound=max(worst, 1.0))
            if sse < 0:
                raise ContributionError(f"{site} sent sse={sse} in {task}; a cost is >= 0")
            return torch.from_numpy(sums).double(), torch.from_numpy(counts).double(), sse

        stats = self._checked(results, check, fl_ctx)
        self._enough(stats, task)
        return stats

    def _split_local(self, results: dict[str, DXO], fl_ctx: FLContext) -> tuple[dict[str, DXO], dict[str, str]]:
        """(the results less malformed ones, {site: its local tokenizer's description} of the sites that have one)."""
        kept, local = {}, {}
        for site, dxo in results.items():
            value = dxo.get_meta_prop(LOCAL_TOKENIZER_KEY)
            if value is not None and not isinstance(value, str):
                self.log_error(fl_ctx, f"REJECTED k-means contribution: {site} sent {LOCAL_TOKENIZER_KEY}="
                                       f"{_short(value)}; a description string is required")
                continue
            kept[site] = dxo
            if value:
                local[site] = value
        return kept, local

    def _skip_for_local_tokenizers(self, local: dict, results: dict, fl_ctx: FLContext) -> None:
        federated = sorted(set(results) - set(local))
        if federated:
            raise KMeansError(f"sites {sorted(local)} use local tokenizers but {federated} wait for the federated "
                              "codebook; configure every site alike (tokenizer_path) so all predict the same tokens")
        self._enough(results, KMEANS_INIT)
        self.log_info(fl_ctx, f"every site uses a local tokenizer ({sorted(set(local.values()))}): "
                              "federated k-means skipped")
        record_in_summary(self, fl_ctx, {"tokenizer_details": {"federated_kmeans": "skipped: every site uses a local "
                                                               "tokenizer", "sites": dict(sorted(local.items()))}})

    # ------------------------------------------------------------------ workflow
    def _initial_codebook(self, results: dict[str, DXO], fl_ctx: FLContext) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed)
        if self.init == "random":
            self._check_random_init(results, fl_ctx)
            self.log_info(fl_ctx, f"random codebook (data-free start), patch size {self.patch_size}")
            return random_codebook(self.vocab_size, self.patch_size, generator)
        local_means = self._check_init(results, fl_ctx)
        pooled = torch.as_tensor(np.concatenate(local_means, axis=0), dtype=torch.float32)
        self.log_info(fl_ctx, f"codebook seeded from {pooled.shape[0]} local cluster means of {len(local_means)} "
                              f"sites (D={pooled.shape[1]}, patch size {self.patch_size})")
        return init_codebook(pooled, self.vocab_size, generator=generator)  # k-means++ over the pooled means

    def _lloyd_step(self, codebook: torch.Tensor, it: int, fl_ctx: FLContext,
                    abort_signal: Signal) -> torch.Tensor | None:
        """One federated Lloyd iteration -> the new codebook (None on abort)."""
        K = self.vocab_size
        meta = {**self._task_meta(), ITER_KEY: it}
        results = self._exchange(KMEANS_STEP, {"codebook": codebook.numpy()}, meta, fl_ctx, abort_signal)
        if abort_signal.triggered:
            return None
        stats = self._check_step(results, it, fl_ctx)
        new = kmeans_update(codebook, [(s, c) for s, c, _ in stats.values()]).to(torch.float32)
        n_vectors = sum(float(c.sum()) for _, c, _ in stats.values())
        sse = sum(e for _, _, e in stats.values())
        used = int((sum(c for _, c, _ in stats.values()) > 0).sum())
        shift = float((new - codebook).norm(dim=1).mean())
        declared = sum(self.declared[s] for s in stats)
        self.history.append({"iter": it, "sites": len(stats), "vectors": int(n_vectors),
                             "withheld_vectors": int(declared - n_vectors),
                             "mean_sq_distance": sse / max(n_vectors, 1.0), "used_tokens": used,
                             "mean_centroid_shift": shift})
        self.log_info(fl_ctx, f"k-means iteration {it + 1}/{self.n_iters}: {len(stats)} sites, {int(n_vectors)} "
                              f"patch vectors ({int(declared - n_vectors)} in clusters of < {self.min_cluster_size} "
                              f"withheld), mean squared distance {sse / max(n_vectors, 1.0):.4f}, "
                              f"{used}/{K} tokens used, centroid shift {shift:.4g}")
        return new

    def control_flow(self, abort_signal: Signal, fl_ctx: FLContext) -> None:
        t0 = time.time()
        K = self.vocab_size
        self.log_info(fl_ctx, f"{describe(K, self.n_iters)}: local k-means at {self.min_clients}+ sites, statistics "
                              f"of >= {self.min_cluster_size} patch vectors")
        results = self._exchange(KMEANS_INIT, {}, self._task_meta(), fl_ctx, abort_signal)
        if abort_signal.triggered:
            return
        results, local = self._split_local(results, fl_ctx)
        if local:
            self._skip_for_local_tokenizers(local, results, fl_ctx)
            return
        codebook = self._initial_codebook(results, fl_ctx)
        for it in range(self.n_iters):
            codebook = self._lloyd_step(codebook, it, fl_ctx, abort_signal)
            if codebook is None:
                return
        run_dir = fl_ctx.get_engine().get_workspace().get_run_dir(fl_ctx.get_job_id())
        path = os.path.join(run_dir, self.codebook_file)
        description = describe(K, self.n_iters)
        save_codebook(path, codebook, self.patch_size, description)
        results = self._exchange(SET_TOKENIZER, {"codebook": codebook.numpy()},
                                 {**self._task_meta(), "patch_size": self.patch_size, DESCRIPTION_KEY: description},
                                 fl_ctx, abort_signal)
        if abort_signal.triggered:
            return
        self._enough(results, SET_TOKENIZER)
        details = {"vocab_size": K, "n_iters": self.n_iters, "init": self.init, "images_per_site": self.images_per_site,
                   "local_iters": self.local_iters, "min_cluster_size": self.min_cluster_size,
                   "patch_size": self.patch_size, "codebook": path, "sites": sorted(results),
                   "time_s": round(time.time() - t0, 2), "iterations": self.history}
        record_in_summary(self, fl_ctx, {"tokenizer": description, "tokenizer_details": details})
        self.log_info(fl_ctx, f"tokenizer ready: {description}; codebook {path} sent to {len(results)} sites "
                              f"({time.time() - t0:.1f}s)")
