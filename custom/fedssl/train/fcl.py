"""FCL pre-training on one site (FCL (Wu et al., MedIA 2022) section 3) as a LocalTrainer.

:class:`FCLLocalTrainer` holds :class:`fedssl.core.fcl.FCLTrainer` (MoCo main + momentum encoder, optimiser,
local bank, generator) and the site's :class:`fedssl.data.acdc.PartitionSampleDataset` (one slice from each of
the S partitions of every unlabelled volume).  One round = one local epoch of batches of
``batch_size // n_partitions`` volumes (at most ``max_steps_per_round`` of them; 0 = all).

What crosses the wire besides the model: the remote bank (the other sites' features, in through
:meth:`FCLLocalTrainer.set_remote`) and this site's bank (out through :meth:`FCLLocalTrainer.export_bank`).
FedMoCo is ``feature_exchange=False`` with ``plain_moco=True`` (MoCo's own positives; a remote bank is then
ignored); Local CL is the executor exchanging nothing.

Randomness (issue 13 item 9): the initial weights are the same at every site (``MoCoUNetEncoder`` seeds its own
construction, as the server's model component does); everything data-side (partition slices, batch order, augmentations, the initial bank, negative draws)
uses :func:`fedssl.core.seeds.site_seed` of the job seed and the site name, so sites draw independently and
each site is reproducible.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from fedssl.core.fcl import FCLConfig, FCLTrainer
from fedssl.core.seeds import site_seed
from fedssl.core.trainer import RoundStats, check_stop
from fedssl.data.acdc import PartitionSampleDataset
from fedssl.data.loading import check_workers, loader_options
from fedssl.data.transforms import augment_views
from fedssl.data.volume import Volume
from fedssl.train.pretraining import WrappedPretrainer
from fedssl.models.unet import PAPER_FEATURES, MoCoUNetEncoder


class FCLLocalTrainer(WrappedPretrainer):
    """One site's FCL pre-training (a ``LocalTrainer``); paper settings as defaults (FCL (Wu et al., MedIA 2022) section 5).

    Build order (it fixes every random draw): the partition dataset (site seed), the batch check, the config, the MoCo
    encoder (its own fixed seed, drawn in a forked RNG), the FCLTrainer (site seed: generator, initial bank and the
    owned global RNG of every round, :func:`fedssl.core.rng.owned_global_rng`).  Building one leaves torch's global
    generator as it was.  ``state_dict`` = the FCLTrainer's (model, optimiser, bank, generator, config): what a
    restarted client resumes from.
    """

    method_name = "FCL"
    finetune_hint = "fedssl.experiments.fcl_finetune"
    global_name = "the global MoCo model"

    def __init__(self, volumes: Sequence[Volume], *, num_rounds: int, n_partitions: int = 4,
                 features: Sequence[int] = PAPER_FEATURES, proj_dim: int = 128, batch_size: int = 32, lr: float = 0.05,
                 tau: float = 0.1, momentum: float = 0.99, bank_size: int = 4096, feature_exchange: bool = True,
                 negative_sampling: bool = True, structural_matching: bool = True, plain_moco: bool = False,
                 max_steps_per_round: int = 0, seed: int = 0, device: str | torch.device = "cpu", site: str = "",
                 amp: bool = False, workers: int = 0):
        volumes = list(volumes)
        self.workers = check_workers(workers, type(self).__name__)
        self.data_seed = site_seed(seed, site)
        self.dataset = PartitionSampleDataset(volumes, n_partitions, seed=self.data_seed)
        self.volumes_per_batch = batch_size // n_partitions
        if len(volumes) < self.volumes_per_batch:
            raise ValueError(f"{site or 'this site'}: {len(volumes)} volumes cannot fill one batch of "
                             f"{self.volumes_per_batch} volumes; lower batch_size")
        cfg = FCLConfig(tau=tau, momentum=momentum, bank_size=bank_size, lr=lr, num_rounds=num_rounds,
                        feature_exchange=feature_exchange, negative_sampling=negative_sampling,
                        structural_matching=structural_matching, plain_moco=plain_moco)
        model = MoCoUNetEncoder(features, proj_dim)
        self.trainer = FCLTrainer(model, cfg, augment_views, device=device, seed=self.data_seed, amp=amp)
        self.max_steps_per_round = int(max_steps_per_round)
        #: the remote bank ``(features [M, D], partitions [M])`` of the last download, or None
        self.remote: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def model(self) -> MoCoUNetEncoder:
        return self.trainer.model

    @property
    def device(self) -> torch.device:
        return self.trainer.device

    @property
    def feature_exchange(self) -> bool:
        return self.trainer.cfg.feature_exchange

    # ------------------------------------------------------------------ the exchanged banks
    def set_remote(self, features: object | None, partitions: object | None = None) -> None:
        """The remote bank for the next rounds (the other sites' features and partition ids, eq. 1); None
        clears it.  Ignored in training when feature exchange is off (FedMoCo)."""
        if features is None:
            self.remote = None
            return
        f = torch.as_tensor(np.asarray(features, dtype=np.float32))  # float16 when banks travel in half precision
        p = torch.as_tensor(np.asarray(partitions))
        if f.ndim != 2 or f.shape[1] != self.model.proj_dim or tuple(p.shape) != (f.shape[0],):
            raise ValueError(f"the remote bank has features {tuple(f.shape)} and partitions {tuple(p.shape)}; "
                             f"expected [M, {self.model.proj_dim}] and [M]")
        self.remote = (f, p)

    def export_bank(self) -> tuple[np.ndarray, np.ndarray]:
        """This site's bank as uploaded for feature exchange: float32 ``[K, D]`` features, int64 ``[K]`` partitions."""
        return self.trainer.bank.export()

    # ------------------------------------------------------------------ LocalTrainer
    def train_round(self, round_idx: int, should_stop: Callable[[], bool] | None = None) -> RoundStats:
        """One local epoch; ``should_stop`` is checked before the round and after every optimiser step."""
        check_stop(should_stop)
        v, cap = self.volumes_per_batch, self.max_steps_per_round
        steps_per_round = self.dataset.n_batches(v, cap)
        remote = self.remote if self.feature_exchange else None
        optimizer, curve = self.trainer.optimizer, []

        def progress(step: int, loss: float) -> None:
            curve.append({"loss": loss, "lr": float(optimizer.param_groups[0]["lr"])})
            check_stop(should_stop)

        data = self.dataset.batches(v, round_idx, cap, **loader_options(self.workers, self.device))
        out = self.trainer.train_round(data, steps_per_round, round_idx, remote, progress)
        n_remote = 0 if remote is None else int(remote[0].shape[0])
        metrics = {"loss_local": out["loss_local"], "loss_remote": out["loss_remote"], "lr": out["lr_end"],
                   "lr_end": out["lr_end"], "remote_features": n_remote, "bank_filled": out["bank_filled"],
                   "bank_fill": out["bank_filled"] / self.trainer.bank.capacity, "feature_std": out["feature_std"]}
        return RoundStats(loss=out["loss"], steps=out["steps"], samples=len(self.dataset), metrics=metrics, curve=curve)
