"""Site-side 3D segmentation: DynUNet trained on random patches, evaluated by sliding windows (the local-trainer seam).

Loss: Dice + cross-entropy (MONAI ``DiceCELoss``, softmax, one-hot targets).  Optimiser: Adam, cosine learning rate
over all rounds' steps.  Each local epoch draws ``num_samples`` patches per training volume (half centred on
foreground, :func:`fedssl.data.seg3d.train_transform`), capped at ``max_steps_per_epoch`` steps.  On a GPU the
forward pass runs under autocast in bfloat16 where the GPU supports it (float16 with a gradient scaler
otherwise), the network uses ``channels_last_3d`` memory, and the loader pins memory with ``workers`` processes;
on a CPU: float32, no workers.

Randomness: ``seed`` (a site passes ``site_seed(job seed, site)``) seeds the trainer's generator, which draws each
epoch's seed (patch sampling, batch order, the loader's worker seeds); each round runs in the owned global RNG of
(seed, round index) and each evaluation in that of (seed, split) (:func:`fedssl.core.rng.owned_global_rng`), so
nothing draws from, or moves, the process's global generators.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from fedssl.core.checks import require, require_amp, require_choice, require_int, require_workers
from fedssl.core.rng import owned_global_rng
from fedssl.core.seeds import derived_seed, site_seed
from fedssl.core.trainer import MixedPrecision, RoundStats, check_optimizer_state, check_stop, detached, load_checked
from fedssl.data.seg3d import CLASSES, train_transform
from fedssl.eval.segmentation3d import mean_metrics, predict_volume3d, volume_metrics
from fedssl.models.dynunet3d import check_dynunet_args


@dataclass(frozen=True)
class Seg3DSettings:
    """Every setting of a site's 3D segmentation, declared once: the job arguments of ``Seg3DExecutor`` and what
    :class:`Seg3DLocalTrainer` reads (nnU-Net's 3D full-resolution settings and FCL's federation as defaults).

    data_root: the site's folder; "" = site config / FEDSSL_DATA_ROOT.  dataset: "acdc" (RV, MYO, LV) or "hvsmr"
    (myocardium, blood pool); pixdim: voxel size (mm) the volumes are resampled to; roi_size: training patch and
    sliding window (voxels); filters: DynUNet channels per level (the kernels and strides follow from pixdim and
    roi_size); lr: Adam, cosine over all rounds; batch_size: patches per step, a multiple of num_samples (patches
    drawn per volume); local_epochs; max_steps_per_epoch: 0 = no cap; val_fraction: held-out patients of the site;
    n_labelled: 0 = every training patient; seed: the job seed (initial model; the site's draws use
    site_seed(seed, site)); split_seed: the seed of the patient split; device: "auto", "cpu", "cuda[:N]"; amp:
    bfloat16 autocast on GPUs that support it; workers: loader processes on a GPU (none on a CPU).
    """

    data_root: str = ""
    dataset: str = "acdc"
    pixdim: Sequence[float] = (1.25, 1.25, 10.0)
    roi_size: Sequence[int] = (160, 160, 16)
    filters: Sequence[int] = (32, 64, 128, 256, 320, 320)
    lr: float = 1e-3
    batch_size: int = 2
    num_samples: int = 2
    local_epochs: int = 1
    max_steps_per_epoch: int = 0
    val_fraction: float = 0.2
    n_labelled: int = 0
    seed: int = 0
    split_seed: int = 0
    device: str = "auto"
    amp: bool = True
    workers: int = 4

    def check(self, name: str) -> None:
        """Every argument checked; the message names component ``name``, the argument, its value and the fix."""
        require(isinstance(self.data_root, str), name, "data_root", self.data_root, 'use a path string or ""')
        require_choice(name, "dataset", self.dataset, tuple(CLASSES))
        check_dynunet_args(name, list(self.filters), list(self.pixdim), list(self.roi_size), len(CLASSES[self.dataset]))
        require(isinstance(self.lr, (int, float)) and self.lr > 0, name, "lr", self.lr,
                "use a positive learning rate, e.g. 1e-3")
        require_int(name, "num_samples", self.num_samples, 1, "use the patches drawn per volume, e.g. 2")
        require(isinstance(self.batch_size, int) and self.batch_size >= self.num_samples
                and self.batch_size % self.num_samples == 0, name, "batch_size", self.batch_size,
                f"use a multiple of num_samples={self.num_samples} (patches per step)")
        require_int(name, "local_epochs", self.local_epochs, 1, "use >= 1")
        require_int(name, "max_steps_per_epoch", self.max_steps_per_epoch, 0, "use 0 (no cap) or a positive step count")
        require(isinstance(self.val_fraction, (int, float)) and 0 <= self.val_fraction < 1, name, "val_fraction",
                self.val_fraction, "use a fraction in [0, 1), e.g. 0.2")
        require_int(name, "n_labelled", self.n_labelled, 0,
                    "use 0 (every training patient) or the number of labelled patients")
        require_int(name, "seed", self.seed, 0, "use a non-negative integer")
        require_int(name, "split_seed", self.split_seed, 0, "use a non-negative integer")
        require_amp(name, self.amp)
        require_workers(name, self.workers)


class Seg3DLocalTrainer:
    """One site's 3D segmentation training (a ``LocalTrainer``) of ``model`` (built from the settings' filters,
    pixdim and roi_size) with the settings of a :class:`Seg3DSettings`; the site's seed ``site_seed(seed, site)``
    draws its patches and seeds the owned global RNG of every round.  ``device``: a torch device (the executor
    resolves the settings' "auto")."""

    def __init__(self, model: nn.Module, train_volumes: Sequence[dict], val_volumes: Sequence[dict],
                 settings: Seg3DSettings, *, num_rounds: int, site: str = "", device: str | torch.device = "cpu"):
        from monai.losses import DiceCELoss

        s = settings
        s.check(type(self).__name__)
        self.settings = s
        if not train_volumes:
            raise ValueError("Seg3DLocalTrainer: no training volume; the site needs at least one labelled volume")
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.precision = MixedPrecision(self.device, s.amp)
        if self.device.type == "cuda":
            self.model = self.model.to(memory_format=torch.channels_last_3d)
        self.train_volumes, self.val_volumes = list(train_volumes), list(val_volumes)
        self.classes, self.pixdim, self.roi_size = dict(CLASSES[s.dataset]), list(s.pixdim), list(s.roi_size)
        self.batch_size, self.num_samples = int(s.batch_size), int(s.num_samples)
        self.local_epochs = int(s.local_epochs)
        self.max_steps = int(s.max_steps_per_epoch) or None
        self.workers = int(s.workers) if self.device.type == "cuda" else 0
        self.lr, self.seed = float(s.lr), int(site_seed(s.seed, site))
        per_epoch = math.ceil(len(self.train_volumes) * self.num_samples / self.batch_size)
        self.steps_per_epoch = min(per_epoch, self.max_steps) if self.max_steps else per_epoch
        self.total_steps = max(1, int(num_rounds) * self.local_epochs * self.steps_per_epoch)
        self.loss_fn = DiceCELoss(to_onehot_y=True, softmax=True)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=self.lr)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, self.total_steps) / self.total_steps)))
        self.generator = torch.Generator().manual_seed(self.seed)
        self.step = 0

    def _loader(self, epoch_seed: int):
        from monai.data import DataLoader, Dataset

        transform = train_transform(self.roi_size, self.num_samples)
        transform.set_random_state(seed=epoch_seed)
        return DataLoader(Dataset(self.train_volumes, transform=transform),
                          batch_size=max(1, self.batch_size // self.num_samples),
                          shuffle=True, generator=torch.Generator().manual_seed(epoch_seed), num_workers=self.workers,
                          pin_memory=self.device.type == "cuda", persistent_workers=False)

    def train_round(self, round_idx: int, should_stop: Callable[[], bool] | None = None) -> RoundStats:
        with owned_global_rng(derived_seed(self.seed, "seg3d_round", round_idx), self.device):
            return self._train_round(should_stop)

    def _train_round(self, should_stop: Callable[[], bool] | None) -> RoundStats:
        self.model.train()
        step0, losses, curve = self.step, [], []
        for _ in range(self.local_epochs):
            epoch_seed = int(torch.randint(0, 2**31 - 1, (1,), generator=self.generator))
            for i, batch in enumerate(self._loader(epoch_seed)):
                if self.max_steps and i >= self.max_steps:
                    break
                check_stop(should_stop)
                image = batch["image"].to(self.device, non_blocking=True)
                label = batch["label"].to(self.device, non_blocking=True)
                if self.device.type == "cuda":
                    image = image.contiguous(memory_format=torch.channels_last_3d)
                with self.precision.autocast():
                    loss = self.loss_fn(self.model(image).float(), label.long())
                self.precision.step(loss, self.optimizer)
                self.scheduler.step()
                self.step += 1
                losses.append(float(loss.detach()))
                curve.append({"loss": losses[-1]})
        lr = self.optimizer.param_groups[0]["lr"]
        return RoundStats(loss=sum(losses) / max(len(losses), 1), steps=self.step - step0,
                          samples=len(self.train_volumes), metrics={"lr": lr}, curve=curve)

    def evaluate(self, split: str = "val") -> dict[str, Any]:
        if split != "val":
            raise ValueError(f"split={split!r}: this trainer holds only a validation split ('val')")
        if not self.val_volumes:
            return {"dice": float("nan"), "hd95": float("nan"), "volumes": 0}
        rows = []
        with owned_global_rng(derived_seed(self.seed, "evaluate", split), self.device):
            for v in self.val_volumes:
                pred = predict_volume3d(self.model, v["image"], self.roi_size, device=self.device,
                                        amp_dtype=self.precision.dtype)
                rows.append(volume_metrics(pred, v["label"][0], self.classes, self.pixdim))
        return {**mean_metrics(rows, self.classes), "volumes": len(rows)}

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "generator": self.generator.get_state(), "step": self.step, "total_steps": self.total_steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if int(state["total_steps"]) != self.total_steps:
            raise ValueError(f"trainer state was saved with total_steps={state['total_steps']}; this trainer has "
                             f"{self.total_steps} (another number of rounds, volumes or batch settings)")
        check_optimizer_state(self.optimizer, state["optimizer"], "the saved 3D segmentation state")
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.generator.set_state(torch.as_tensor(state["generator"], dtype=torch.uint8).cpu())
        self.step = int(state["step"])

    def global_state(self) -> dict[str, torch.Tensor]:
        return detached(self.model.state_dict())

    def load_global(self, state: Mapping[str, Any], keep_local: Sequence[str] = ()) -> list[str]:
        return load_checked(self.model, state, "the global DynUNet", keep_local)
