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

from fedssl.core.checks import takes_settings
from fedssl.core.seeds import site_seed
from fedssl.core.trainer import RoundStats
from fedssl.core.partition import holdout_patients
from fedssl.data.seg3d import CLASSES, list_items, load_volumes, patient_of
from fedssl.flare.site_executor import pick_device
from fedssl.flare.trainer_executor import TrainerExecutor
from fedssl.models.dynunet3d import build_dynunet
from fedssl.train.seg3d import Seg3DLocalTrainer, Seg3DSettings


class Seg3DExecutor(TrainerExecutor):
    task_handlers = {"train": "train", "test": "test"}
    checkpoint_name = "seg3d_client_state.pt"
    metrics_name = "seg3d_metrics.jsonl"

    @takes_settings(Seg3DSettings)
    def __init__(self, **args):
        """The arguments are the fields of :class:`fedssl.train.seg3d.Seg3DSettings` (documented there), each stored
        verbatim and checked at once; an unknown name is refused."""
        super().__init__()
        self.configure(Seg3DSettings, args)
        self._val: dict = {}

    def build_trainer(self, fl_ctx: FLContext, num_rounds: int) -> Seg3DLocalTrainer:
        site = self.site_name(fl_ctx)
        items = list_items(self.dataset, self.resolve_root(self.data_root, fl_ctx), site)
        patients = sorted({patient_of(i["id"], self.dataset) for i in items})
        train_p, val_p = holdout_patients(patients, self.val_fraction, self.n_labelled,
                                          site_seed(self.split_seed, site))
        pixdim, roi_size = list(self.pixdim), list(self.roi_size)
        volumes = load_volumes(items, self.dataset, pixdim, roi_size, site)
        train = [v for v in volumes if patient_of(v["id"], self.dataset) in train_p]
        val = [v for v in volumes if patient_of(v["id"], self.dataset) in val_p]
        model = build_dynunet(list(self.filters), pixdim, roi_size, len(CLASSES[self.dataset]), seed=self.seed)
        self.log_info(fl_ctx, f"{site}: {len(train_p)} training patients ({len(train)} volumes), {len(val_p)} "
                              f"validation patients {val_p} ({len(val)} volumes), voxels {pixdim} mm, patch {roi_size}")
        return Seg3DLocalTrainer(model, train, val, self.settings, num_rounds=num_rounds, site=site,
                                 device=pick_device(self.device))

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
        self.log_info(fl_ctx, f"test on {metrics['n']} held-out volumes: Dice {metrics['dice']}, HD95 "
                              f"{metrics['hd95']} mm")
        return DXO(data_kind=DataKind.METRICS, data=metrics, meta={"n_test": metrics["n"]}).to_shareable()

    def describe_round(self, stats: RoundStats) -> str:
        return (f"loss {stats.loss:.4f}, global model validation Dice "
                f"{self._val.get('val_dice_global', float('nan')):.3f}, HD95 "
                f"{self._val.get('val_hd95_global', float('nan')):.1f} mm")
