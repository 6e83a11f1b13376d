"""FedCLF pre-training and its baselines on one device as a LocalTrainer ("Federated Self-Supervised Learning for
Dermatological Disease Diagnosis", FedCLF / FedMAE-KS, sections III and V-A).

:class:`FedCLFLocalTrainer` holds :class:`fedssl.core.fedclf.FedCLFTrainer` and the device's unlabelled training
images as MoCo v2 view pairs (:class:`fedssl.data.views.TwoViewDataset`).  One round = one local epoch of
``batch_size`` images (the last incomplete batch dropped, as MoCo does; at most ``max_steps_per_round`` steps,
0 = all).  The methods, each a switch of the same trainer:

=============  ==========  ============  =========================================================
method          network     queue         what is exchanged (the executor decides the federation)
=============  ==========  ============  =========================================================
FedCLF          MoCo        ``fe_neg``    weights + local bank (eq. 5: negatives only remote)
FE (Fig. 6)     MoCo        ``fe``        weights + local bank (eq. 4: local + remote negatives)
FedMoCo         MoCo        ``none``      weights (W/o FE)
Local CL        MoCo        ``none``      nothing
FedSimCLR       SimCLR      ``none``      weights
FedRotation     Rotation    ``none``      weights
=============  ==========  ============  =========================================================

Randomness: the initial weights are the same on every device (the models seed their own construction, as the
server's model component does); batch order, augmentations, the initial bank and remote draws use
:func:`fedssl.core.seeds.site_seed` of the job seed and the device name, and each round runs in the owned global RNG of
(that seed, round) (:meth:`fedssl.core.fedclf.FedCLFTrainer.train_round`), so nothing draws from, or moves, the
process's global generators.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from fedssl.core.fedclf import FedCLFConfig, FedCLFTrainer
from fedssl.core.seeds import site_seed
from fedssl.core.trainer import RoundStats, check_stop
from fedssl.data.images import ImageRecord
from fedssl.data.loading import check_workers, load_batches, loader_options
from fedssl.data.views import TwoViewDataset
from fedssl.train.pretraining import WrappedPretrainer
from fedssl.models.resnet import PAPER_DEPTH, PAPER_PROJ_DIM, PAPER_WIDTH, PretrainingResNet


def view_batches(dataset: TwoViewDataset, batch_size: int, seed: int, epoch: int, max_steps: int = 0, *,
                 workers: int = 0, pin_memory: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Shuffled full batches ``(v1 [B, 3, S, S], v2 [B, 3, S, S])`` of one epoch (order from ``(seed, epoch)``);
    ``workers`` / ``pin_memory``: :func:`fedssl.data.loading.load_batches` (the same batches)."""
    dataset.set_epoch(epoch)
    order = np.random.default_rng([int(seed), int(epoch)]).permutation(len(dataset))
    starts = range(0, len(order) - batch_size + 1, batch_size)
    if max_steps:
        starts = starts[:max_steps]
    yield from load_batches(dataset, [order[start:start + batch_size] for start in starts], workers=workers,
                            pin_memory=pin_memory)


class FedCLFLocalTrainer(WrappedPretrainer):
    """One device's pre-training (a ``LocalTrainer``); paper settings as defaults (sec. V-A: batch 128, lr 0.03
    cosine, 100 rounds of 1 local epoch; MoCo v2's tau 0.2 and momentum 0.999 where the paper is silent)."""

    method_name = "FedCLF"
    finetune_hint = "jobs/fedclf_derm_finetune"
    global_name = "the global pre-training model"

    def __init__(self, records: Sequence[ImageRecord], *, num_rounds: int, method: str = "moco", queue: str = "fe_neg",
                 dataset: str = "derm5", image_size: int = 64, width: int = PAPER_WIDTH,
                 proj_dim: int = PAPER_PROJ_DIM, batch_size: int = 128, lr: float = 0.03, tau: float = 0.2,
                 momentum: float = 0.999, bank_size: int = 4096, max_steps_per_round: int = 0, seed: int = 0,
                 device: str | torch.device = "cpu", site: str = "", depth: int = PAPER_DEPTH, amp: bool = False,
                 workers: int = 0):
        self.workers = check_workers(workers, type(self).__name__)
        records = list(records)
        if len(records) < batch_size:
            raise ValueError(f"{site or 'this device'}: {len(records)} training images cannot fill one batch of "
                             f"{batch_size}; lower batch_size")
        self.data_seed = site_seed(seed, site)
        self.dataset = TwoViewDataset(records, image_size, dataset, site=site, seed=self.data_seed)
        cfg = FedCLFConfig(method=method, queue=queue, tau=tau, momentum=momentum, bank_size=bank_size, lr=lr,
                           num_rounds=num_rounds)
        model = PretrainingResNet(method, width, proj_dim, seed=seed, depth=depth)
        self.trainer = FedCLFTrainer(model, cfg, device=device, seed=self.data_seed, amp=amp)
        self.batch_size, self.max_steps_per_round = batch_size, int(max_steps_per_round)
        #: the remote bank Q_r [R, D] of the last download, or None
        self.remote: torch.Tensor | None = None

    @property
    def steps_per_round(self) -> int:
        full = len(self.dataset) // self.batch_size
        return min(full, self.max_steps_per_round) if self.max_steps_per_round else full

    # ------------------------------------------------------------------ the exchanged banks
    def set_remote(self, features: object | None) -> None:
        """Q_r for the next rounds (the other devices' features, eq. 2); None clears it."""
        if features is None:
            self.remote = None
            return
        f = torch.as_tensor(np.asarray(features, dtype=np.float32))
        dim = self.trainer.bank.dim
        if f.ndim != 2 or f.shape[1] != dim or f.shape[0] < 1:
            raise ValueError(f"the remote bank has shape {tuple(f.shape)}; expected [R, {dim}] with R >= 1")
        self.remote = f

    def export_bank(self) -> tuple[np.ndarray, np.ndarray]:
        """Q_l as uploaded: float32 ``[K, D]`` features and int64 ``[K]`` fill marks (0 filled, -1 initial)."""
        return self.trainer.bank.export()

    # ------------------------------------------------------------------ LocalTrainer
    def train_round(self, round_idx: int, should_stop: Callable[[], bool] | None = None) -> RoundStats:
        check_stop(should_stop)
        optimizer, curve = self.trainer.optimizer, []

        def progress(step: int, loss: float) -> None:
            curve.append({"loss": loss, "lr": float(optimizer.param_groups[0]["lr"])})
            check_stop(should_stop)

        batches = view_batches(self.dataset, self.batch_size, self.data_seed, round_idx, self.max_steps_per_round,
                               **loader_options(self.workers, self.trainer.device))
        out = self.trainer.train_round(batches, self.steps_per_round, round_idx, self.remote, progress)
        metrics = {k: v for k, v in out.items() if k not in ("loss", "steps")}
        metrics["lr"] = out["lr_end"]
        metrics["remote_features"] = 0 if self.remote is None else int(self.remote.shape[0])
        if "bank_filled" in out:
            metrics["bank_fill"] = out["bank_filled"] / self.trainer.bank.capacity
        return RoundStats(loss=out["loss"], steps=out["steps"], samples=len(self.dataset), metrics=metrics, curve=curve)
