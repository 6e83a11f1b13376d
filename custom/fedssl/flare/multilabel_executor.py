"""Client executor for class-heterogeneous multi-label chest X-ray (surgical aggregation, Kulkarni et al., ML4H 2024).

Maths: :class:`fedssl.train.multilabel.MultiLabelLocalTrainer`; round protocol: ``TrainerExecutor``.  Tasks:
``declare_classes`` (the site's class list ``C_k``, from ``classes`` or the site config, and its training-set size);
``train`` (from round 1 the received model's validation BCE / AUROC goes back as ``initial_metrics``, paper sec. 2.5;
the reply carries the class list and the backbone header); ``test`` (per-class AUROC, bootstrap CIs, own + external).
"""

from __future__ import annotations

import math
import time

import numpy as np
from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.apis.signal import Signal

from fedssl.core.checks import takes_settings
from fedssl.core.surgical import HEAD_WEIGHT, check_class_list, classes_from_meta, classes_to_meta
from fedssl.core.trainer import RoundStats
from fedssl.data.site_config import resolve_site_setting
from fedssl.flare.constants import (BACKBONE_HEADER, BACKBONE_KEY, BACKBONES, CLASSES_KEY, DECLARE_TASK,
                                    GLOBAL_CLASSES_KEY, METHOD_KEY, METHODS)
from fedssl.flare.site_executor import pick_device
from fedssl.flare.trainer_executor import TrainerExecutor
from fedssl.train.multilabel import (FULL_HEAD_METHODS, GLOBAL_HEAD_METHODS, MultiLabelLocalTrainer, MultiLabelSettings,
                                     check_run_switches, load_splits)


class MultiLabelExecutor(TrainerExecutor):
    task_handlers = {DECLARE_TASK: "declare", "train": "train", "test": "test"}
    checkpoint_name = "multilabel_client_state.pt"
    metrics_name = "multilabel_metrics.jsonl"

    @takes_settings(MultiLabelSettings)
    def __init__(self, **args):
        """The arguments are the fields of :class:`fedssl.train.multilabel.MultiLabelSettings` (paper defaults,
        documented there), each stored verbatim and checked at once; an unknown name is refused.  ``seed`` is the job
        seed (data side per site: ``site_seed(seed, site)``)."""
        super().__init__()
        self.configure(MultiLabelSettings, args)
        self.classes = self.classes if isinstance(self.classes, dict) else list(self.classes)
        # C_k (configuration), the data splits, the switches (method, backbone), the head's classes, and the
        # received model's validation metrics this round
        self.own_classes = self.splits = self.switches = self.head = self.val = None

    # ------------------------------------------------------------------ configuration and data
    def site_setting(self, value, key: str, fl_ctx: FLContext):
        return resolve_site_setting(value, key, self.site_name(fl_ctx),
                                    fl_ctx.get_engine().get_workspace().get_site_config_dir())

    def site_classes(self, fl_ctx: FLContext) -> list[str]:
        value, source = self.site_setting(self.classes, "classes", fl_ctx)
        try:
            return check_class_list(value, self.site_name(fl_ctx))
        except ValueError as e:
            raise ValueError(f"{e} (from {source})") from None

    def load_data(self, fl_ctx: FLContext) -> dict:
        if self.splits is None:
            root = self.resolve_root(self.data_root, fl_ctx)
            dataset = self.site_setting(self.dataset, "dataset", fl_ctx)[0]
            self.splits = load_splits(root, dataset, self.site_name(fl_ctx), self.own_classes, self.settings)
        return self.splits

    def check_task(self, meta: dict, site: str) -> None:
        registered = classes_from_meta(meta[CLASSES_KEY], "server") if meta.get(CLASSES_KEY) is not None else None
        self.switches = check_run_switches({"method": meta.get(METHOD_KEY), "backbone": meta.get(BACKBONE_KEY)},
                                           self.switches, METHODS, BACKBONES, self.own_classes, registered, site)

    # ------------------------------------------------------------------ the trainer
    def ensure_trainer(self, shareable: Shareable, fl_ctx: FLContext) -> MultiLabelLocalTrainer:
        site, meta = self.site_name(fl_ctx), from_shareable(shareable).get_meta_props()
        self.own_classes = self.own_classes or self.site_classes(fl_ctx)
        self.check_task(meta, site)
        if self.trainer is None:
            full = self.switches["method"] in FULL_HEAD_METHODS
            self.head = (self.network_classes(meta, f"{site}: method {self.switches['method']}") if full
                         else list(self.own_classes))
        return super().ensure_trainer(shareable, fl_ctx)

    def network_classes(self, meta: dict, who: str, fix: str = "") -> list[str]:
        if meta.get(GLOBAL_CLASSES_KEY) is None:
            raise ValueError(f"{who} needs the network's classes (meta {GLOBAL_CLASSES_KEY!r}){fix}")
        return classes_from_meta(meta[GLOBAL_CLASSES_KEY], "server")

    def build_trainer(self, fl_ctx: FLContext, num_rounds: int) -> MultiLabelLocalTrainer:
        site, s = self.site_name(fl_ctx), self.load_data(fl_ctx)
        trainer = MultiLabelLocalTrainer(s, self.own_classes, self.head, **self.switches, site=site,
                                         settings=self.settings, imagenet_path=self.imagenet_path or None,
                                         device=pick_device(self.device), amp=self.amp)
        init = f"ImageNet from {self.imagenet_path}" if self.imagenet_path else "random"
        self.log_info(fl_ctx, f"{site}: {s['dataset']} layout, {s['n_train']}/{s['n_val']}/{s['n_test']} "
                              f"train/val/test images; {self.switches}, head over {len(self.head)} classes "
                              f"({len(self.own_classes)} own); initial weights {init} (replaced by the server's "
                              "round-0 model)")
        return trainer

    def receive(self, dxo: DXO, fl_ctx: FLContext, round_idx: int) -> dict:
        data = dxo.data or {}
        self.trainer.load_global(data, keep_local=self.declared_local(dxo))
        self.val = self.trainer.evaluate("val") if round_idx > 0 and self.switches["method"] != "individual" else None
        extra = {"received_tensors": len(data), **(self.val or {})}
        if HEAD_WEIGHT in data:
            extra["received_head_shape"] = list(np.asarray(data[HEAD_WEIGHT]).shape)
        return extra

    def result_meta(self, stats: RoundStats, dxo: DXO, fl_ctx: FLContext) -> dict:
        return {CLASSES_KEY: classes_to_meta(self.own_classes),
                **({MetaKey.INITIAL_METRICS: self.val} if self.val else {})}

    def result_headers(self, stats: RoundStats, dxo: DXO, fl_ctx: FLContext) -> dict:
        return {BACKBONE_HEADER: self.switches["backbone"]}  # read by the BackboneBNExclusion upload filter

    def describe_round(self, stats: RoundStats) -> str:
        warm, val = stats.metrics.get("warmup_loss"), self.val
        return (f"loss {stats.loss:.4f}" + (f", warm-up loss {warm:.4f}" if warm is not None else "")
                + (f", global model validation BCE {val['val_loss']:.4f} AUROC {val['val_auroc']:.3f}" if val else ""))

    # ------------------------------------------------------------------ the other tasks
    def declare(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        site, meta = self.site_name(fl_ctx), from_shareable(shareable).get_meta_props()
        self.own_classes = self.site_classes(fl_ctx)
        self.check_task(meta, site)
        self.log_info(fl_ctx, f"{site}: declaring {len(self.own_classes)} classes ({self.switches})")
        return DXO(data_kind=DataKind.METRICS, data={"num_classes": len(self.own_classes)},
                   meta={CLASSES_KEY: classes_to_meta(self.own_classes),
                         "num_samples": self.load_data(fl_ctx)["n_train"]}
                   ).to_shareable()

    def test(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        site, trainer, dxo = self.site_name(fl_ctx), self.ensure_trainer(shareable, fl_ctx), from_shareable(shareable)
        meta, data, model = dxo.get_meta_props(), dxo.data or {}, None
        if self.switches["method"] in GLOBAL_HEAD_METHODS:
            fix = "; put HeadSlicer(full_head=true) in the server's task-data filters of the test task"
            model = trainer.global_model(data, self.network_classes(meta, f"{site}: the test task", fix))
        else:
            trainer.load_global(data)  # personalised / individual: the site's own model
        t0, external = (time.time(), self.resolve_root(self.external_test_root, fl_ctx) if self.external_test_root
                        else "")
        result = trainer.evaluate("test", model=model, source="global model" if model is not None else "",
                                  external_root=external)
        means = {"test_mean_auroc": result["mean_auroc"],
                 **{k: result[k] for k in ("external_mean_auroc",) if k in result}}
        means = {k: None if v is None or math.isnan(v) else v for k, v in means.items()}  # NaN: JSON null
        self.append_metrics(fl_ctx, {"task": "test", "time_s": round(time.time() - t0, 2), **means})
        self.log_info(fl_ctx, f"test ({result['model']}): {means}")
        return DXO(DataKind.METRICS, result, {CLASSES_KEY: classes_to_meta(self.own_classes)}).to_shareable()
