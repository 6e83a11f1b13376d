"""Client executor for federated fine-tuning of a ViT classifier (SSL-FL (Yan et al., IEEE TMI 2023) sec. III-D;
FedMAE-KS, Wu et al., "Federated Self-Supervised Learning for Dermatological Disease Diagnosis").

Task ``train`` (TrainerExecutor's round protocol, every round of ScatterAndGather):

1. load the received global model (strict on shapes; keys a PartialModelExclusion download filter held back and
   declared keep this site's own values);
2. evaluate it on the site's VALIDATION split (carved from the site's training pool with ``train_val_split``,
   never the test data) and put the metrics in the result meta under ``MetaKey.INITIAL_METRICS``
   (``val_accuracy``, ``val_balanced_accuracy``, ``val_auc``, ...), so FLARE's IntimeModelSelector picks the best
   global model on validation data.  Round 0 receives an initial model whose head was never trained: no
   validation then (IntimeModelSelector skips round 0 as well);
3. fine-tune with :class:`fedssl.train.classifier.ClassifierLocalTrainer` and upload the weights with
   ``num_samples`` = number of labelled images |D_l^k| (SSL-FL weights aggregation by labelled images).

Task ``test`` (FinalEvaluation, after training): evaluate the received model on the site's test data
(``test_root``; default: the ``test`` folder beside the site folder, as ``fedssl sslfl partition`` writes it) and
return the metrics as a ``DataKind.METRICS`` DXO.  A model whose head was never trained is refused.
"""

from __future__ import annotations

import os

from nvflare.apis.dxo import DXO, DataKind, MetaKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.apis.signal import Signal

from fedssl.core.checks import takes_settings
from fedssl.core.classification import flat_metrics
from fedssl.core.trainer import RoundStats
from fedssl.data.images import load_image_records
from fedssl.data.site_config import resolve_data_root
from fedssl.flare.site_executor import pick_device
from fedssl.flare.trainer_executor import TrainerExecutor
from fedssl.train.classifier import ClassifierLocalTrainer, ClassifierSettings

#: validation metrics in the train result meta are prefixed so IntimeModelSelector's key_metric reads "val_accuracy"
VAL_PREFIX = "val_"


class ClassifierExecutor(TrainerExecutor):
    task_handlers = {"train": "train", "test": "test"}
    checkpoint_name = "cls_client_state.pt"
    metrics_name = "cls_metrics.jsonl"

    @takes_settings(ClassifierSettings)
    def __init__(self, **args):
        """The arguments are the fields of :class:`fedssl.train.classifier.ClassifierSettings` (paper settings as
        defaults: SSL-FL fine-tuning, 100 rounds, lr 3e-3, batch 256, 64 for COVID-FL; documented there), each stored
        verbatim and checked at once; an unknown name is refused."""
        super().__init__()
        self.configure(ClassifierSettings, args)
        self.val_metrics: dict | None = None  # validation of the global model received this round

    def build_trainer(self, fl_ctx: FLContext, num_rounds: int) -> ClassifierLocalTrainer:
        site = self.site_name(fl_ctx)
        records = load_image_records(self.resolve_root(self.data_root, fl_ctx), self.dataset, site=site)
        trainer = ClassifierLocalTrainer(records, self.settings, num_rounds=num_rounds, site=site,
                                         device=pick_device(self.device))
        self.log_info(fl_ctx, f"{site}: {trainer.summary}")
        return trainer

    def receive(self, dxo: DXO, fl_ctx: FLContext, round_idx: int) -> dict:
        """Load the global model, then validate it (once its head was trained) for the server's model selection."""
        extra = super().receive(dxo, fl_ctx, round_idx)
        self.val_metrics = None
        if self.trainer.head_trained:
            metrics = self.trainer.evaluate("val", source=f"global model of round {round_idx}")
            self.val_metrics = flat_metrics(metrics, prefix=VAL_PREFIX)
        return {**extra, **(self.val_metrics or {})}

    def result_meta(self, stats: RoundStats, dxo: DXO, fl_ctx: FLContext) -> dict:
        return {} if self.val_metrics is None else {MetaKey.INITIAL_METRICS: self.val_metrics}

    def describe_round(self, stats: RoundStats) -> str:
        val = self.val_metrics
        msg = ("global head not trained yet, no validation" if val is None else
               f"global model validation accuracy {val['val_accuracy']:.3f}, balanced "
               f"{val['val_balanced_accuracy']:.3f}")
        return f"loss {stats.loss:.4f} on {stats.samples} labelled images; {msg}"

    # ------------------------------------------------------------------ task: test
    def test_dir(self, fl_ctx: FLContext) -> str:
        site = self.site_name(fl_ctx)
        if self.test_root:
            return resolve_data_root(self.test_root, site)
        root = os.path.join(os.path.dirname(self.resolve_root(self.data_root, fl_ctx)), "test")
        if not os.path.isdir(root):
            raise ValueError(f"{site}: no test data: test_root is empty and {root} (the partition's test folder beside "
                             "the site folder) does not exist; set test_root of the executor to the site's test "
                             "folder")
        return root

    def test(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        site = self.site_name(fl_ctx)
        trainer = self.ensure_trainer(shareable, fl_ctx)
        if trainer.test_set is None:
            trainer.set_test_records(load_image_records(self.test_dir(fl_ctx), self.dataset, site=site))
        dxo = self.received_weights(shareable, fl_ctx, "test")
        trainer.load_global(dxo.data or {}, keep_local=self.declared_local(dxo))
        source = dxo.get_meta_prop("model_source") or "the model sent for testing"
        metrics = trainer.evaluate("test", source=source)
        flat = flat_metrics(metrics, prefix="test_")
        self.append_metrics(fl_ctx, {"task": "test", "model_source": source, **flat})
        self.stream_scalars(fl_ctx, flat, step=self.last_round + 1)
        self.log_info(fl_ctx, f"test on {metrics['n']} images ({source}): accuracy {metrics['accuracy']:.3f}, "
                              f"balanced accuracy {metrics['balanced_accuracy']:.3f}")
        return DXO(data_kind=DataKind.METRICS, data=metrics, meta={"n_test": metrics["n"]}).to_shareable()
