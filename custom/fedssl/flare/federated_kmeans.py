"""Server workflow that learns Fed-BEiT's visual tokenizer by federated k-means, before pre-training starts.

SSL-FL (SSL-FL (Yan et al., IEEE TMI 2023), sec. III-C) predicts the DALL-E dVAE token of every masked patch; that tokenizer cannot
be downloaded here, so the bundle can learn a patch codebook inside the federation instead: K = vocab_size
centroids of the sites' patch vectors (``fedssl.core.tokenizer.patch_vectors``: each p x p x 3 patch
normalised by its own mean and variance).  Raw images and patches never leave a site:

1. ``kmeans_init``, with ``init="local_kmeans"``: every site runs k-means++ and a few Lloyd steps on its
   own patch vectors and returns its K local centroids (means of its patches) with their cluster sizes;
   the server seeds the codebook by k-means++ over the pooled local centroids
   (``fedssl.core.tokenizer.init_codebook``).  With ``init="random"`` (data-free: no site shares even a
   centroid) the sites only report their patch size and the server starts from
   ``fedssl.core.tokenizer.random_codebook``; clusters no patch ever reaches keep their random centroid.
2. ``kmeans_step`` x n_iters: the server broadcasts the codebook; each site returns its E-step statistics
   (per-centroid sums and counts, ``kmeans_stats``); the server's M-step (``kmeans_update``) averages them.
3. The codebook is written to the server run folder (``codebook_file``) and sent once to every site
   (``set_tokenizer``); it is never part of a training round's payload.

Put this workflow before ScatterAndGather in ``config_fed_server.json``: FLARE's ServerRunner runs the
configured workflows one after the other, in order, in one job.  The run summary records
``"tokenizer": "federated k-means K=..., iters=..."`` and the details (``tokenizer_details``).

Sites configured with a local tokenizer (MIMExecutor ``tokenizer_path``) answer ``kmeans_init`` with that
path instead of centroids; when every site does, the workflow stops there (nothing learnt, nothing sent)
and the summary's ``tokenizer`` is the sites' own ``"local: <path>"`` record.  A mix of both is an error.
"""

from __future__ import annotations

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
from fedssl.core.tokenizer import init_codebook, kmeans_update, random_codebook, save_codebook
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
    SEED_KEY,
    SET_TOKENIZER,
)
from fedssl.flare.run_summary import record_in_summary

TOKENIZER_TASKS = (KMEANS_INIT, KMEANS_STEP, SET_TOKENIZER)
INITS = ("local_kmeans", "random")


class KMeansError(ValueError):
    """A site's k-means contribution is unusable, or too few sites contributed."""


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
    ):
        """
        Args:
            vocab_size: K, the number of visual tokens (must equal the sites' BEiT ``vocab_size``; DALL-E: 8192).
            n_iters: federated Lloyd iterations (one ``kmeans_step`` exchange each).
            images_per_site: images each site draws (seeded) for its patch vectors; 0 = all its images.
            local_iters: Lloyd steps of each site's local k-means that seeds the codebook.
            min_clients: sites that must answer each exchange.
            wait_time_after_min_received: seconds to wait for the other sites once min_clients answered.
            task_timeout: seconds per exchange (0 = no limit).
            seed: seeds the sites' image sample and the server's k-means++.
            codebook_file: file name of the codebook in the server run folder.
            init: "local_kmeans" (k-means++ over the sites' local centroids) or "random" (data-free start).
        """
        super().__init__()
        name = type(self).__name__
        require_int(name, "vocab_size", vocab_size, 2, "use the number of visual tokens K >= 2 (DALL-E: 8192)")
        require_int(name, "n_iters", n_iters, 1, "use at least one federated Lloyd iteration")
        require_int(name, "images_per_site", images_per_site, 0, "use a positive number of images, or 0 for all")
        require_int(name, "local_iters", local_iters, 0, "use 0 or more local Lloyd steps")
        require_int(name, "min_clients", min_clients, 1, "use the number of sites that must answer")
        require_int(name, "wait_time_after_min_received", wait_time_after_min_received, 0, "use seconds >= 0")
        require_int(name, "task_timeout", task_timeout, 0, "use seconds >= 0 (0 = no limit)")
        require_int(name, "seed", seed, 0, "use a non-negative integer")
        require(isinstance(codebook_file, str) and codebook_file.endswith(".pt")
                and os.path.basename(codebook_file) == codebook_file, name, "codebook_file", codebook_file,
                'use a plain file name ending in ".pt"')
        self.vocab_size = vocab_size
        self.n_iters = n_iters
        self.images_per_site = images_per_site
        self.local_iters = local_iters
        self.min_clients = min_clients
        self.wait_time_after_min_received = wait_time_after_min_received
        self.task_timeout = task_timeout
        self.seed = seed
        self.codebook_file = codebook_file
        require_choice(name, "init", init, INITS)
        self.init = init
        self.history: list[dict] = []  # per iteration: sites, vectors, mean squared distance, codebook shift

    def start_controller(self, fl_ctx: FLContext) -> None:
        self.history = []

    def stop_controller(self, fl_ctx: FLContext) -> None:
        pass

    def process_result_of_unknown_task(self, client, task_name, client_task_id, result, fl_ctx) -> None:
        self.log_warning(fl_ctx, f"late {task_name} result from {client.name} ignored")

    # ------------------------------------------------------------------ exchanges
    def _task_meta(self) -> dict:
        return {K_KEY: self.vocab_size, IMAGES_KEY: self.images_per_site, LOCAL_ITERS_KEY: self.local_iters,
                SEED_KEY: self.seed, INIT_KEY: self.init}

    def _exchange(self, name: str, data: dict, meta: dict, fl_ctx: FLContext, abort_signal: Signal) -> dict[str, DXO]:
        """Broadcast one task, wait for min_clients, return the sites' result DXOs (failed sites left out)."""
        task = Task(name=name, data=DXO(DataKind.COLLECTION, data=data, meta=meta).to_shareable(),
                    timeout=self.task_timeout)
        self.broadcast_and_wait(task=task, fl_ctx=fl_ctx, min_responses=self.min_clients,
                                wait_time_after_min_received=self.wait_time_after_min_received,
                                abort_signal=abort_signal)
        results = {}
        for ct in task.client_tasks:
            dxo = self._result_of(ct, fl_ctx)
            if dxo is not None:
                results[ct.client.name] = dxo
        return results

    def _result_of(self, ct: ClientTask, fl_ctx: FLContext) -> DXO | None:
        if ct.result is None:
            self.log_warning(fl_ctx, f"{ct.client.name} sent no result for {ct.task.name}")
            return None
        rc = ct.result.get_return_code()
        if rc and rc != ReturnCode.OK:
            self.log_warning(fl_ctx, f"{ct.client.name} returned {rc} for {ct.task.name}; left out")
            return None
        try:
            return from_shareable(ct.result)
        except (ValueError, TypeError) as e:
            self.log_warning(fl_ctx, f"{ct.client.name} sent an unreadable {ct.task.name} result ({e}); left out")
            return None

    def _enough(self, results: dict, what: str) -> None:
        if len(results) < self.min_clients:
            raise KMeansError(f"{what}: only {len(results)} of the required {self.min_clients} sites sent a valid "
                              f"result ({sorted(results)}); see the sites' logs")

    # ------------------------------------------------------------------ checks of site contributions
    def _array(self, dxo: DXO, key: str, site: str, task: str, ndim: int) -> np.ndarray:
        value = (dxo.data or {}).get(key)
        if value is None:
            raise KMeansError(f"{site} sent no {key!r} in its {task} result")
        arr = np.asarray(value)
        if arr.ndim != ndim or not np.all(np.isfinite(arr)):
            raise KMeansError(f"{site} sent {key!r} of shape {arr.shape} (expected {ndim} dims, finite values) in {task}")
        return arr

    def _patch_size_of(self, results: dict[str, DXO], fl_ctx: FLContext) -> int:
        """init="random": the sites only report their patch size, which must be the same everywhere."""
        sizes = {site: dxo.get_meta_prop("patch_size") for site, dxo in results.items()}
        if len(set(sizes.values())) != 1 or not isinstance(next(iter(sizes.values()), None), int):
            raise KMeansError(f"sites report patch sizes {sizes}; configure every site with the same patch_size")
        self._enough(results, KMEANS_INIT)
        return next(iter(sizes.values()))

    def _check_init(self, results: dict[str, DXO], fl_ctx: FLContext) -> tuple[list[np.ndarray], int]:
        """The sites' local centroids (all of dimension D = 3 p^2, the same patch size everywhere)."""
        good, dims = [], {}
        for site, dxo in sorted(results.items()):
            try:
                c = self._array(dxo, "centroids", site, KMEANS_INIT, 2)
                n = self._array(dxo, "counts", site, KMEANS_INIT, 1)
                if c.shape[0] != n.shape[0] or c.shape[0] < 1 or (n < 0).any():
                    raise KMeansError(f"{site} sent {c.shape[0]} centroids with {n.shape[0]} counts in {KMEANS_INIT}")
            except KMeansError as e:
                self.log_error(fl_ctx, f"REJECTED k-means contribution: {e}")
                continue
            dims[site] = (int(c.shape[1]), dxo.get_meta_prop("patch_size"))
            good.append((site, c[n > 0]))
        if len({d for d in dims.values()}) > 1:
            raise KMeansError(f"sites disagree on the patch vectors (dimension, patch size): {dims}; "
                              "configure every site with the same patch_size")
        self._enough(dict(good), KMEANS_INIT)
        pooled = sum(c.shape[0] for _, c in good)
        if pooled < self.vocab_size:
            raise KMeansError(f"the sites' local k-means gave {pooled} non-empty centroids in all, fewer than "
                              f"vocab_size K={self.vocab_size}; lower vocab_size or raise images_per_site")
        patch_size = next(iter(dims.values()))[1]
        return [c for _, c in good], patch_size

    def _check_step(self, results: dict[str, DXO], codebook: torch.Tensor, it: int, fl_ctx: FLContext) -> dict:
        stats = {}
        for site, dxo in sorted(results.items()):
            try:
                sums = self._array(dxo, "sums", site, KMEANS_STEP, 2)
                counts = self._array(dxo, "counts", site, KMEANS_STEP, 1)
                if sums.shape != tuple(codebook.shape) or counts.shape != (codebook.shape[0],) or (counts < 0).any():
                    raise KMeansError(f"{site} sent sums {sums.shape} / counts {counts.shape} for a codebook of "
                                      f"shape {tuple(codebook.shape)} in {KMEANS_STEP} {it}")
                if dxo.get_meta_prop(ITER_KEY) != it:
                    raise KMeansError(f"{site} answered k-means iteration {dxo.get_meta_prop(ITER_KEY)} during {it}")
            except KMeansError as e:
                self.log_error(fl_ctx, f"REJECTED k-means contribution: {e}")
                continue
            stats[site] = (torch.as_tensor(sums, dtype=torch.float64), torch.as_tensor(counts, dtype=torch.float64),
                           float(dxo.get_meta_prop("sse", float("nan"))))
        self._enough(stats, f"{KMEANS_STEP} {it}")
        return stats

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
    def control_flow(self, abort_signal: Signal, fl_ctx: FLContext) -> None:
        t0 = time.time()
        K = self.vocab_size
        self.log_info(fl_ctx, f"{describe(K, self.n_iters)}: local k-means at {self.min_clients}+ sites")
        results = self._exchange(KMEANS_INIT, {}, self._task_meta(), fl_ctx, abort_signal)
        if abort_signal.triggered:
            return
        local = {site: dxo.get_meta_prop(LOCAL_TOKENIZER_KEY) for site, dxo in results.items()
                 if dxo.get_meta_prop(LOCAL_TOKENIZER_KEY)}
        if local:
            self._skip_for_local_tokenizers(local, results, fl_ctx)
            return
        generator = torch.Generator().manual_seed(self.seed)
        if self.init == "random":
            patch_size = self._patch_size_of(results, fl_ctx)
            codebook = random_codebook(K, patch_size, generator)
            self.log_info(fl_ctx, f"random codebook (data-free start), patch size {patch_size}")
        else:
            local_centroids, patch_size = self._check_init(results, fl_ctx)
            pooled = torch.as_tensor(np.concatenate(local_centroids, axis=0), dtype=torch.float32)
            codebook = init_codebook(pooled, K, generator=generator)  # k-means++ over the pooled local centroids
            self.log_info(fl_ctx, f"codebook seeded from {pooled.shape[0]} local centroids of {len(local_centroids)} "
                                  f"sites (D={pooled.shape[1]}, patch size {patch_size})")
        for it in range(self.n_iters):
            meta = {**self._task_meta(), ITER_KEY: it}
            results = self._exchange(KMEANS_STEP, {"codebook": codebook.numpy()}, meta, fl_ctx, abort_signal)
            if abort_signal.triggered:
                return
            stats = self._check_step(results, codebook, it, fl_ctx)
            new = kmeans_update(codebook, [(s, c) for s, c, _ in stats.values()]).to(torch.float32)
            n_vectors = sum(float(c.sum()) for _, c, _ in stats.values())
            sse = sum(e for _, _, e in stats.values())
            used = int((sum(c for _, c, _ in stats.values()) > 0).sum())
            shift = float((new - codebook).norm(dim=1).mean())
            self.history.append({"iter": it, "sites": len(stats), "vectors": int(n_vectors),
                                 "mean_sq_distance": sse / max(n_vectors, 1.0), "used_tokens": used,
                                 "mean_centroid_shift": shift})
            self.log_info(fl_ctx, f"k-means iteration {it + 1}/{self.n_iters}: {len(stats)} sites, {int(n_vectors)} "
                                  f"patch vectors, mean squared distance {sse / max(n_vectors, 1.0):.4f}, "
                                  f"{used}/{K} tokens used, centroid shift {shift:.4g}")
            codebook = new
        run_dir = fl_ctx.get_engine().get_workspace().get_run_dir(fl_ctx.get_job_id())
        path = os.path.join(run_dir, self.codebook_file)
        description = describe(K, self.n_iters)
        save_codebook(path, codebook, patch_size, description)
        results = self._exchange(SET_TOKENIZER, {"codebook": codebook.numpy()},
                                 {**self._task_meta(), "patch_size": patch_size, DESCRIPTION_KEY: description},
                                 fl_ctx, abort_signal)
        if abort_signal.triggered:
            return
        self._enough(results, SET_TOKENIZER)
        details = {"vocab_size": K, "n_iters": self.n_iters, "init": self.init, "images_per_site": self.images_per_site,
                   "local_iters": self.local_iters, "patch_size": patch_size, "codebook": path,
                   "sites": sorted(results), "time_s": round(time.time() - t0, 2), "iterations": self.history}
        record_in_summary(self, fl_ctx, {"tokenizer": description, "tokenizer_details": details})
        self.log_info(fl_ctx, f"tokenizer ready: {description}; codebook {path} sent to {len(results)} sites "
                              f"({time.time() - t0:.1f}s)")
