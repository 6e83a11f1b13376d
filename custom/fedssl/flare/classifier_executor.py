"""Client executor for federated fine-tuning of a ViT classifier (SSL-FL seed 000 sec. III-D; FedMAE-KS seed 001).

Task ``train`` (every round of ScatterAndGather):

1. load the received global model (strict on shapes; keys a PartialModelExclusion download filter removed
   keep this site's own values);
2. evaluate it on the site's VALIDATION split (carved from the site's training pool with ``train_val_split``,
   never the test data) and put the metrics in the result meta under ``MetaKey.INITIAL_METRICS``
   (``val_accuracy``, ``val_balanced_accuracy``, ``val_auc``, ...), so FLARE's IntimeModelSelector picks the best
   global model on validation data.  Round 0 receives an initial model whose head was never trained: no
   validation then (IntimeModelSelector skips round 0 as well);
3. fine-tune on the labelled subset (``select_labelled(train, label_fraction)``) for ``local_epochs`` epochs
   (AdamW, warm-up + cosine by round, optional FedProx against the received weights);
4. upload the weights with ``num_samples`` = number of labelled images |D_l^k| (SSL-FL weights fine-tuning
   aggregation by labelled images).

Task ``test`` (FinalEvaluation, after training): evaluate the received model on the site's test data
(``test_root``; default: the ``test`` folder beside the site folder, as ``fedssl partition`` writes it) and
return the metrics as a ``DataKind.METRICS`` DXO.  A model whose head was never trained is refused.
"""

from __future__ import annotations

import math
import os

from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.apis.signal import Signal
from nvflare.app_common.app_constant import AppConstants

from fedssl.core.classification import ClassifierTrainer, classification_metrics, flat_metrics, predict, require_trained_head
from fedssl.data.images import DATASETS, ImageDataset, batches, class_histogram, class_names, load_image_records, select_labelled, train_val_split
from fedssl.data.site_config import resolve_data_root
from fedssl.flare.site_executor import SiteExecutor, TaskAborted, pick_device
from fedssl.flare.validation import require, require_choice, require_int
from fedssl.vit_finetune import FineTuneViT, check_vit_args, load_into

#: validation metrics in the train result meta are prefixed so IntimeModelSelector's key_metric reads "val_accuracy"
VAL_PREFIX = "val_"


class ClassifierExecutor(SiteExecutor):
    task_handlers = {"train": "train", "test": "test"}
    checkpoint_name = "cls_client_state.pt"
    metrics_name = "cls_metrics.jsonl"

    def __init__(
        self,
        dataset: str = "retina",
        data_root: str = "",
        test_root: str = "",
        image_size: int = 224,
        patch_size: int = 16,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        drop_path_rate: float = 0.1,
        layer_scale: float | None = None,
        lr: float = 3e-3,
        batch_size: int = 256,
        local_epochs: int = 1,
        warmup_rounds: int = 5,
        min_lr: float = 1e-6,
        weight_decay: float = 0.05,
        label_fraction: float = 1.0,
        val_fraction: float = 0.1,
        fedprox_mu: float = 0.0,
        label_smoothing: float = 0.0,
        layer_decay: float = 0.65,
        max_steps_per_round: int = 0,
        eval_batch_size: int = 256,
        seed: int = 0,
        device: str = "auto",
    ):
        """
        Args (paper settings as defaults: SSL-FL fine-tuning, 100 rounds, lr 3e-3, batch 256, 64 for COVID-FL):
            dataset: "retina", "derm" or "covidfl" (the site folder's layout and the class list).
            data_root: the site's data folder ("" = the site's fedssl_site.json or FEDSSL_DATA_ROOT); ``{site}``
                is replaced by the site name.
            test_root: the test data folder ("" = ``<data_root>/../test``, the partition's held-out test set).
            image_size, patch_size, embed_dim, depth, num_heads, drop_path_rate, layer_scale: the ViT (must match
                the server's model component; layer_scale null for Fed-MAE / scratch, 0.1 for a Fed-BEiT encoder).
            lr, min_lr, warmup_rounds, weight_decay: AdamW with warm-up then cosine, indexed by round.
            batch_size, local_epochs: local training per round (SSL-FL: 1 epoch).
            label_fraction: labelled fraction of the training pool, per class (SSL-FL: 0.1, 0.3, 0.7, 1.0).
            val_fraction: fraction of the site's pool held out (stratified) for validation / model selection.
            fedprox_mu: 0 = FedAvg; SSL-FL's FedProx baseline uses 0.001.
            label_smoothing: cross-entropy label smoothing (0 = none).
            layer_decay: layer-wise lr decay (SSL-FL's fine-tuning scripts: 0.65; 1.0 = one lr for all layers).
            max_steps_per_round: cap on optimiser steps per local epoch (0 = full epoch).
            eval_batch_size: batch size of validation and test passes.
        """
        super().__init__()
        name = type(self).__name__
        require_choice(name, "dataset", dataset, DATASETS)
        require(isinstance(data_root, str), name, "data_root", data_root, "use a path string ({site} allowed) or \"\"")
        require(isinstance(test_root, str), name, "test_root", test_root, "use a path string ({site} allowed) or \"\"")
        check_vit_args(name, image_size, patch_size, embed_dim, depth, num_heads, drop_path_rate, layer_scale)
        require(isinstance(lr, (int, float)) and lr > 0, name, "lr", lr, "use a positive learning rate (paper: 3e-3)")
        require(isinstance(min_lr, (int, float)) and 0 <= min_lr < lr, name, "min_lr", min_lr, "use 0 <= min_lr < lr")
        require_int(name, "batch_size", batch_size, 1, "use a positive batch size (paper: 256; COVID-FL 64)")
        require_int(name, "local_epochs", local_epochs, 1, "use a positive number of epochs per round (paper: 1)")
        require(isinstance(warmup_rounds, (int, float)) and not isinstance(warmup_rounds, bool) and warmup_rounds >= 0,
                name, "warmup_rounds", warmup_rounds, "use a number of rounds >= 0 (paper: 5)")
        require(isinstance(weight_decay, (int, float)) and weight_decay >= 0, name, "weight_decay", weight_decay, "paper: 0.05")
        require(isinstance(label_fraction, (int, float)) and 0 < label_fraction <= 1, name, "label_fraction",
                label_fraction, "use a fraction in (0, 1]; paper: 0.1, 0.3, 0.7 or 1.0")
        require(isinstance(val_fraction, (int, float)) and 0 < val_fraction < 1, name, "val_fraction", val_fraction,
                "use a fraction in (0, 1): model selection needs validation images, e.g. 0.1")
        require(isinstance(fedprox_mu, (int, float)) and fedprox_mu >= 0, name, "fedprox_mu", fedprox_mu,
                "use 0 (FedAvg) or a positive mu (paper's FedProx: 0.001)")
        require(isinstance(label_smoothing, (int, float)) and 0 <= label_smoothing < 1, name, "label_smoothing",
                label_smoothing, "use a value in [0, 1)")
        require(isinstance(layer_decay, (int, float)) and not isinstance(layer_decay, bool) and 0 < layer_decay <= 1, name,
                "layer_decay", layer_decay, "use a factor in (0, 1] (paper: 0.65; 1.0 = no decay)")
        require_int(name, "max_steps_per_round", max_steps_per_round, 0, "use 0 (full epoch) or a positive step count")
        require_int(name, "eval_batch_size", eval_batch_size, 1, "use a positive batch size")
        require_int(name, "seed", seed, 0, "use a non-negative integer")
        require(isinstance(device, str) and device.split(":")[0] in ("auto", "cpu", "cuda"), name, "device", device,
                'use "auto", "cpu" or "cuda[:N]"')
        self.dataset = dataset
        self.data_root = data_root
        self.test_root = test_root
        self.image_size = image_size
        self.patch_size = patch_size
        self.embed_dim = embed_dim
        self.depth = depth
        self.num_heads = num_heads
        self.drop_path_rate = drop_path_rate
        self.layer_scale = layer_scale
        self.lr = lr
        self.batch_size = batch_size
        self.local_epochs = local_epochs
        self.warmup_rounds = warmup_rounds
        self.min_lr = min_lr
        self.weight_decay = weight_decay
        self.label_fraction = label_fraction
        self.val_fraction = val_fraction
        self.fedprox_mu = fedprox_mu
        self.label_smoothing = label_smoothing
        self.layer_decay = layer_decay
        self.max_steps_per_round = max_steps_per_round
        self.eval_batch_size = eval_batch_size
        self.seed = seed
        self.device = device
        self._classes = class_names(dataset)
        self._model: FineTuneViT | None = None
        self._trainer: ClassifierTrainer | None = None
        self._train_set: ImageDataset | None = None
        self._val_set: ImageDataset | None = None
        self._test_set: ImageDataset | None = None

    # ------------------------------------------------------------------ set-up
    def _build_model(self) -> FineTuneViT:
        if self._model is None:
            self._model = FineTuneViT(num_classes=len(self._classes), img_size=self.image_size, patch_size=self.patch_size,
                                      embed_dim=self.embed_dim, depth=self.depth, num_heads=self.num_heads,
                                      drop_path_rate=self.drop_path_rate, layer_scale=self.layer_scale, seed=self.seed)
            self._model.to(pick_device(self.device))
        return self._model

    def _setup_training(self, fl_ctx: FLContext, num_rounds: int) -> None:
        site = self.site_name(fl_ctx)
        root = self.resolve_root(self.data_root, fl_ctx)
        records = load_image_records(root, self.dataset, site=site)
        train, val = train_val_split(records, self.val_fraction, seed=self.seed)
        if not val:
            raise ValueError(f"{site}: val_fraction={self.val_fraction} of {len(records)} images leaves no validation "
                             "image; raise val_fraction or add images")
        labelled = select_labelled(train, self.label_fraction, seed=self.seed)
        self._train_set = ImageDataset(labelled, self.image_size, "finetune", self.dataset, site=site, seed=self.seed)
        self._val_set = ImageDataset(val, self.image_size, "eval", self.dataset, site=site)
        model = self._build_model()
        self._trainer = ClassifierTrainer(
            model, lr=self.lr, total_rounds=num_rounds, warmup_rounds=min(self.warmup_rounds, num_rounds), min_lr=self.min_lr,
            weight_decay=self.weight_decay, fedprox_mu=self.fedprox_mu, label_smoothing=self.label_smoothing,
            layer_decay=self.layer_decay, device=pick_device(self.device), seed=self.seed)
        state = self.load_checkpoint(fl_ctx)
        if state is not None:
            self._trainer.load_state_dict(state["trainer"])
        n = len(self._classes)
        self.log_info(fl_ctx, f"{site}: {len(records)} images -> {len(train)} training pool, {len(val)} validation; "
                              f"{len(labelled)} labelled ({self.label_fraction:g}) per class {class_histogram(labelled, n)}; "
                              f"device {self._trainer.device}")

    def _steps_per_epoch(self) -> int:
        n = math.ceil(len(self._train_set) / self.batch_size)
        return min(n, self.max_steps_per_round) if self.max_steps_per_round else n

    def _load_global(self, shareable: Shareable, fl_ctx: FLContext) -> DXO:
        dxo = from_shareable(shareable)
        if dxo.data_kind != DataKind.WEIGHTS:
            raise ValueError(f"{self.site_name(fl_ctx)}: expected {DataKind.WEIGHTS} from the server, got {dxo.data_kind}")
        load_into(self._build_model(), dxo.data, source=f"the global model sent to {self.site_name(fl_ctx)}")
        return dxo

    def _evaluate(self, dataset: ImageDataset, source: str) -> dict:
        model = self._model
        require_trained_head(model, source)
        device = next(model.parameters()).device
        probs, labels = predict(model, batches(dataset, self.eval_batch_size, seed=self.seed, epoch=0), device)
        return classification_metrics(probs, labels, self._classes)

    # ------------------------------------------------------------------ tasks
    def train(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        round_idx = int(shareable.get_header(AppConstants.CURRENT_ROUND, 0))
        num_rounds = int(shareable.get_header(AppConstants.NUM_ROUNDS, 1))
        site = self.site_name(fl_ctx)
        if self._trainer is None:
            self._setup_training(fl_ctx, num_rounds)
        trainer = self._trainer
        dxo = self._load_global(shareable, fl_ctx)
        val = None
        if int(trainer.model.head_steps) > 0:
            val = flat_metrics(self._evaluate(self._val_set, f"global model of round {round_idx}"), prefix=VAL_PREFIX)
        trainer.set_global(dict(trainer.model.named_parameters()))
        n_steps = self._steps_per_epoch()
        step0, losses = trainer.step, []

        def aborted() -> bool:
            if abort_signal.triggered:
                raise TaskAborted()
            return False

        for epoch in range(self.local_epochs):
            progress = round_idx + epoch / self.local_epochs
            data = batches(self._train_set, self.batch_size, seed=self.seed, epoch=round_idx * self.local_epochs + epoch)
            losses.append(trainer.train_round(data, progress, n_steps=n_steps * self.local_epochs,
                                              max_steps=self.max_steps_per_round or None,
                                              abort=aborted))
        loss = sum(losses) / len(losses)
        self.save_checkpoint(fl_ctx, {"round": round_idx, "trainer": trainer.state_dict()})
        self.append_metrics(fl_ctx, {"round": round_idx, "loss": loss, "steps": trainer.step - step0,
                                     "num_samples": len(self._train_set), **(val or {})})
        if val is None:
            val_msg = "global head not trained yet, no validation"
        else:
            val_msg = (f"global model validation accuracy {val['val_accuracy']:.3f}, balanced "
                       f"{val['val_balanced_accuracy']:.3f}")
        self.log_info(fl_ctx, f"round {round_idx + 1}/{num_rounds}: loss {loss:.4f} on {len(self._train_set)} labelled "
                              f"images; {val_msg}")
        weights = {k: v.detach().cpu().numpy().copy() for k, v in trainer.model.state_dict().items()}  # no alias of live params
        meta = {"num_samples": len(self._train_set), MetaKey.NUM_STEPS_CURRENT_ROUND: trainer.step - step0, "loss": loss}
        if val is not None:
            meta[MetaKey.INITIAL_METRICS] = val
        return DXO(data_kind=DataKind.WEIGHTS, data=weights, meta=meta).to_shareable()

    def _resolve_test_root(self, fl_ctx: FLContext) -> str:
        site = self.site_name(fl_ctx)
        if self.test_root:
            return resolve_data_root(self.test_root, site)
        data_root = self.resolve_root(self.data_root, fl_ctx)
        root = os.path.join(os.path.dirname(data_root), "test")
        if not os.path.isdir(root):
            raise ValueError(f"{site}: no test data: test_root is empty and {root} (the partition's test folder beside "
                             f"the site folder) does not exist; set test_root of the executor to the site's test folder")
        return root

    def test(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        site = self.site_name(fl_ctx)
        if self._test_set is None:
            root = self._resolve_test_root(fl_ctx)
            self._test_set = ImageDataset(load_image_records(root, self.dataset, site=site), self.image_size, "eval",
                                          self.dataset, site=site)
        dxo = self._load_global(shareable, fl_ctx)
        source = dxo.get_meta_prop("model_source") or "the model sent for testing"
        metrics = self._evaluate(self._test_set, source)
        self.append_metrics(fl_ctx, {"task": "test", "model_source": source, **flat_metrics(metrics, prefix="test_")})
        self.log_info(fl_ctx, f"test on {metrics['n']} images ({source}): accuracy {metrics['accuracy']:.3f}, "
                              f"balanced accuracy {metrics['balanced_accuracy']:.3f}")
        return DXO(data_kind=DataKind.METRICS, data=metrics, meta={"n_test": metrics["n"]}).to_shareable()
