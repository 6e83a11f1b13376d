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
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from fedssl.core.rng import owned_global_rng
from fedssl.core.seeds import derived_seed
from fedssl.core.trainer import MixedPrecision, RoundStats, check_optimizer_state, check_stop, detached, load_checked
from fedssl.data.seg3d import train_transform
from fedssl.eval.segmentation3d import mean_metrics, predict_volume3d, volume_metrics


class Seg3DLocalTrainer:
    def __init__(self, model: nn.Module, train_volumes: Sequence[dict], val_volumes: Sequence[dict], *,
                 classes: Mapping[int, str], pixdim: Sequence[float], roi_size: Sequence[int], num_rounds: int,
                 lr: float = 1e-3, batch_size: int = 2, num_samples: int = 2, local_epochs: int = 1,
                 max_steps_per_epoch: int = 0, seed: int = 0, device: str | torch.device = "cpu", amp: bool = True,
                 workers: int = 4):
        from monai.losses import DiceCELoss

        if not train_volumes:
            raise ValueError("Seg3DLocalTrainer: no training volume; the site needs at least one labelled volume")
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.precision = MixedPrecision(self.device, amp)
        if self.device.type == "cuda":
            self.model = self.model.to(memory_format=torch.channels_last_3d)
        self.train_volumes, self.val_volumes = list(train_volumes), list(val_volumes)
        self.classes, self.pixdim, self.roi_size = dict(classes), list(pixdim), list(roi_size)
        self.batch_size, self.num_samples, self.local_epochs = int(batch_size), int(num_samples), int(local_epochs)
        self.max_steps = int(max_steps_per_epoch) or None
        self.workers = int(workers) if self.device.type == "cuda" else 0
        self.lr, self.seed = float(lr), int(seed)
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
        return DataLoader(Dataset(self.train_volumes, transform=transform), batch_size=max(1, self.batch_size // self.num_samples),
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
