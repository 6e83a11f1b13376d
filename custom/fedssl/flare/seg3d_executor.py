"""Client executor for federated 3D segmentation (ACDC ED/ES stacks, HVSMR volumes) with a DynUNet.

Each round: evaluate the received global model on the site's validation patients (Dice and HD95 per class, by
sliding windows; reported in the result meta), then train ``local_epochs`` epochs of random patches on its
training patients (:class:`fedssl.train.seg3d.Seg3DLocalTrainer`) and upload the weights with the number of
training volumes.  Validation patients: ``val_fraction`` of the site's patients (at least one when it has two or
more), drawn with ``site_seed(split_seed, site)``; ``n_labelled`` > 0 keeps only that many training patients
(the few-label setting).  Both phases of an ACDC patient stay on the same side.  Task ``test`` (the job's
FinalEvaluation, after the last round): the last global model on the same held-out patients, which never chose
a checkpoint.
"""

from __future__ import annotations

import math

from nvflare.apis.dxo import DXO, DataKind
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.apis.signal import Signal

from fedssl.core.checks import require, require_amp, require_choice, require_int, require_workers
from fedssl.core.seeds import site_seed
from fedssl.core.trainer import RoundStats
from fedssl.core.partition import holdout_patients
from fedssl.data.seg3d import CLASSES, list_items, load_volumes, patient_of
from fedssl.flare.site_executor import pick_device
from fedssl.flare.trainer_executor import TrainerExecutor
from fedssl.models.dynunet3d import build_dynunet, check_dynunet_args
from fedssl.train.seg3d import Seg3DLocalTrainer


class Seg3DExecutor(TrainerExecutor):
    task_handlers = {"train": "train", "test": "test"}
    checkpoint_name = "seg3d_client_state.pt"
    metrics_name = "seg3d_metrics.jsonl"

    def __init__(self, data_root: str = "", dataset: str = "acdc", pixdim: list = (1.25, 1.25, 10.0),
                 roi_size: list = (160, 160, 16), filters: list = (32, 64, 128, 256, 320, 320), lr: float = 1e-3,
                 batch_size: int = 2, num_samples: int = 2, local_epochs: int = 1, max_steps_per_epoch: int = 0,
                 val_fraction: float = 0.2, n_labelled: int = 0, seed: int = 0, split_seed: int = 0,
                 device: str = "auto", amp: bool = True, workers: int = 4):
        """
        Args: dataset "acdc" (RV, MYO, LV) or "hvsmr" (myocardium, blood pool); pixdim: voxel size (mm) the volumes
        are resampled to; roi_size: training patch and sliding window (voxels); filters: DynUNet channels per level
        (the kernels and strides follow from pixdim and roi_size); batch_size: patches per step, a multiple of
        num_samples (patches drawn per volume); lr: Adam, cosine over all rounds; amp: bfloat16 autocast on GPUs
        that support it; workers: loader processes on a GPU (none on a CPU).
        """
        super().__init__()
        name = type(self).__name__
        require(isinstance(data_root, str), name, "data_root", data_root, 'use a path string or ""')
        require_choice(name, "dataset", dataset, tuple(CLASSES))
        check_dynunet_args(name, list(filters), list(pixdim), list(roi_size), len(CLASSES[dataset]))
        require(isinstance(lr, (int, float)) and lr > 0, name, "lr", lr, "use a positive learning rate, e.g. 1e-3")
        require_int(name, "num_samples", num_samples, 1, "use the patches drawn per volume, e.g. 2")
        require(isinstance(batch_size, int) and batch_size >= num_samples and batch_size % num_samples == 0, name,
                "batch_size", batch_size, f"use a multiple of num_samples={num_samples} (patches per step)")
        require_int(name, "local_epochs", local_epochs, 1, "use >= 1")
        require_int(name, "max_steps_per_epoch", max_steps_per_epoch, 0, "use 0 (no cap) or a positive step count")
        require(isinstance(val_fraction, (int, float)) and 0 <= val_fraction < 1, name, "val_fraction", val_fraction,
                "use a fraction in [0, 1), e.g. 0.2")
        require_int(name, "n_labelled", n_labelled, 0, "use 0 (every training patient) or the number of labelled patients")
        require_int(name, "seed", seed, 0, "use a non-negative integer")
        require_int(name, "split_seed", split_seed, 0, "use a non-negative integer")
        require_amp(name, amp)
        require_workers(name, workers)
        self.data_root, self.dataset = data_root, dataset
        self.pixdim, self.roi_size, self.filters = list(pixdim), list(roi_size), list(filters)
        self.lr, self.batch_size, self.num_samples = lr, batch_size, num_samples
        self.local_epochs, self.max_steps_per_epoch = local_epochs, max_steps_per_epoch
        self.val_fraction, self.n_labelled, self.seed, self.split_seed = val_fraction, n_labelled, seed, split_seed
        self.device, self.amp, self.workers = device, amp, workers
        self._val: dict = {}

    def build_trainer(self, fl_ctx: FLContext, num_rounds: int) -> Seg3DLocalTrainer:
        site = self.site_name(fl_ctx)
        items = list_items(self.dataset, self.resolve_root(self.data_root, fl_ctx), site)
        patients = sorted({patient_of(i["id"], self.dataset) for i in items})
        train_p, val_p = holdout_patients(patients, self.val_fraction, self.n_labelled, site_seed(self.split_seed, site))
        volumes = load_volumes(items, self.dataset, self.pixdim, self.roi_size, site)
        train = [v for v in volumes if patient_of(v["id"], self.dataset) in train_p]
        val = [v for v in volumes if patient_of(v["id"], self.dataset) in val_p]
        model = build_dynunet(self.filters, self.pixdim, self.roi_size, len(CLASSES[self.dataset]), seed=self.seed)
        self.log_info(fl_ctx, f"{site}: {len(train_p)} training patients ({len(train)} volumes), {len(val_p)} "
                              f"validation patients {val_p} ({len(val)} volumes), voxels {self.pixdim} mm, patch {self.roi_size}")
        return Seg3DLocalTrainer(model, train, val, classes=CLASSES[self.dataset], pixdim=self.pixdim,
                                 roi_size=self.roi_size, num_rounds=num_rounds, lr=self.lr, batch_size=self.batch_size,
                                 num_samples=self.num_samples, local_epochs=self.local_epochs,
                                 max_steps_per_epoch=self.max_steps_per_epoch, seed=site_seed(self.seed, site),
                                 device=pick_device(self.device), amp=self.amp, workers=self.workers)

    def receive(self, dxo: DXO, fl_ctx: FLContext, round_idx: int) -> dict:
        super().receive(dxo, fl_ctx, round_idx)
        m = self.trainer.evaluate("val")  # the received global model, before local training
        self._val = {f"val_{k}_global": v for k, v in m.items() if k != "volumes"}
        return self._val

    def result_meta(self, stats: RoundStats, dxo: DXO, fl_ctx: FLContext) -> dict:
        return {"val_dice": self._val.get("val_dice_global"), "val_hd95": self._val.get("val_hd95_global")}

    def test(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        """The model FinalEvaluation sends (the last global model), on this site's held-out patients: Dice and
        HD95 (mm) per class, by sliding windows."""
        trainer = self.ensure_trainer(shareable, fl_ctx)
        dxo = self.received_weights(shareable, fl_ctx, "test")
        trainer.load_global(dxo.data or {}, keep_local=self.declared_local(dxo))
        metrics = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                   for k, v in trainer.evaluate("val").items()}
        metrics["n"] = metrics.pop("volumes")
        self.append_metrics(fl_ctx, {"task": "test", **{f"test_{k}": v for k, v in metrics.items()}})
        self.log_info(fl_ctx, f"test on {metrics['n']} held-out volumes: Dice {metrics['dice']}, HD95 {metrics['hd95']} mm")
        return DXO(data_kind=DataKind.METRICS, data=metrics, meta={"n_test": metrics["n"]}).to_shareable()

    def describe_round(self, stats: RoundStats) -> str:
        return (f"loss {stats.loss:.4f}, global model validation Dice {self._val.get('val_dice_global', float('nan')):.3f}, "
                f"HD95 {self._val.get('val_hd95_global', float('nan')):.1f} mm")
