"""Client executor for FedDRA ("Distributionally Robust Alignment for Medical Federated Vision-Language
Pre-training Under Data Heterogeneity", Shuai, Wu, Tang and Shen, TMLR) and its ablations / FedAvg baseline.

The math is :class:`fedssl.train.feddra.FedDRALocalTrainer`, the round protocol
:class:`fedssl.flare.trainer_executor.TrainerExecutor`.  Tasks:

- ``word_counts`` (before round 0, without a local tokenizer): the site's frequent-word counts
  (:func:`fedssl.data.vocab.site_word_counts`: only words seen at least ``min_word_count`` times on this site; no
  sentence, no rare word, no image); ``set_vocab``: the vocabulary the server built, saved in the run folder;
- ``train_alignment`` (stage 1) and ``train`` (stage 2, or plain FedAvg): the stage comes from the task meta; with
  DRO on, the site's own weight lambda_i and N must be in the meta (put there by the server's DROWeightFilter) and
  scale the step size by N lambda_i; a task without them is refused.  A stage-2 task of a turn whose stage 1 this
  site did not run is refused too (its encoders would not be this turn's).  Stage 2 replies carry v_i;
- ``test``: text-to-image retrieval of the received model on the site's test split (FinalEvaluation).

Data: ``<data_root>/manifest.csv`` (``fedssl feddra split`` writes one per site); paths in it are relative to
``source_root`` (the MIMIC-CXR / retina release folder) or absolute.
"""

from __future__ import annotations

import math
import os

from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.apis.signal import Signal

from fedssl.core.checks import takes_settings
from fedssl.core.trainer import RoundStats
from fedssl.core.vlp import STAGES
from fedssl.data.vocab import make_tokenizer, save_vocab, site_word_counts
from fedssl.flare.constants import (ALIGN_TASK, DRO_LOSS_KEY, DRO_ON_KEY, DRO_SITES_KEY, DRO_WEIGHT_KEY, MIN_COUNT_KEY,
                                    SET_VOCAB_TASK, STAGE_KEY, VOCAB_KEY, WORD_COUNTS_KEY, WORD_COUNTS_TASK)
from fedssl.flare.site_executor import pick_device
from fedssl.flare.trainer_executor import TrainerExecutor, round_headers
from fedssl.train.feddra import FedDRALocalTrainer, FedDRASettings, site_records, site_tokenizer

VOCAB_FILE = "feddra_vocab.txt"


class FedDRAExecutor(TrainerExecutor):
    checkpoint_name = "feddra_client_state.pt"
    metrics_name = "feddra_metrics.jsonl"
    task_handlers = {"train": "train", ALIGN_TASK: "train", WORD_COUNTS_TASK: "word_counts",
                     SET_VOCAB_TASK: "set_vocab", "test": "test"}

    @takes_settings(FedDRASettings)
    def __init__(self, **args):
        """The arguments are the fields of :class:`fedssl.train.feddra.FedDRASettings` (paper settings as defaults,
        MIMIC-CXR, sec. 5.1 and appendix; documented there), each stored verbatim and checked at once; an unknown
        name is refused."""
        super().__init__()
        self.configure(FedDRASettings, args)
        self._records = None

    # ------------------------------------------------------------------ data and vocabulary
    def records(self, fl_ctx: FLContext) -> tuple[list, list]:
        if self._records is None:
            root, site = self.resolve_root(self.data_root, fl_ctx), self.site_name(fl_ctx)
            self._records = site_records(root, self.source_root, site)
        return self._records

    def vocab_path(self, fl_ctx: FLContext) -> str:
        return os.path.join(self.run_dir(fl_ctx), VOCAB_FILE)

    def word_counts(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        train, _ = self.records(fl_ctx)
        asked = from_shareable(shareable).get_meta_prop(MIN_COUNT_KEY)
        floor = max(self.min_word_count, asked if isinstance(asked, int) and not isinstance(asked, bool) else 0)
        counts = site_word_counts([r.text for r in train], min_count=floor)
        self.log_info(fl_ctx, f"{self.site_name(fl_ctx)}: sending counts of {len(counts)} words seen >= {floor} times "
                              f"in {len(train)} reports (no text, no rarer word)")
        return DXO(data_kind=DataKind.METRICS, data={WORD_COUNTS_KEY: counts}).to_shareable()

    def set_vocab(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        vocab = from_shareable(shareable).get_meta_prop(VOCAB_KEY)
        if not (isinstance(vocab, list) and vocab and all(isinstance(t, str) for t in vocab)):
            raise ValueError(f"{self.site_name(fl_ctx)}: the set_vocab task carries no vocabulary list")
        make_tokenizer(vocab=vocab)  # refuse a vocabulary the tokenizer cannot use before saving it
        save_vocab(vocab, self.vocab_path(fl_ctx))
        self.log_info(fl_ctx, f"vocabulary of {len(vocab)} tokens saved to {self.vocab_path(fl_ctx)}")
        return DXO(data_kind=DataKind.METRICS, data={"vocab_size": len(vocab)}).to_shareable()

    # ------------------------------------------------------------------ the trainer
    def build_trainer(self, fl_ctx: FLContext, num_rounds: int) -> FedDRALocalTrainer:
        site = self.site_name(fl_ctx)
        train, test = self.records(fl_ctx)
        trainer = FedDRALocalTrainer(train, test, self.settings, site=site,
                                     tokenizer=site_tokenizer(site, self.tokenizer_path, self.vocab_path(fl_ctx)),
                                     device=pick_device(self.device))
        self.log_info(fl_ctx, f"{site}: {len(trainer.fit)} training pairs "
                              f"({0 if trainer.held is None else len(trainer.held)} held out for v_i), {len(test)} "
                              f"test pairs, device {trainer.device}")
        return trainer

    def receive(self, dxo: DXO, fl_ctx: FLContext, round_idx: int) -> dict:
        site = self.site_name(fl_ctx)
        stage = dxo.get_meta_prop(STAGE_KEY)
        if stage not in STAGES:
            raise ValueError(f"{site}: the task names no FedDRA stage (meta {STAGE_KEY}={stage!r}); the server must "
                             "run the FedDRAController")
        scale = 1.0
        if dxo.get_meta_prop(DRO_ON_KEY):
            weight, n = dxo.get_meta_prop(DRO_WEIGHT_KEY), dxo.get_meta_prop(DRO_SITES_KEY)
            ok = (isinstance(weight, float) and math.isfinite(weight) and 0 < weight <= 1
                  and isinstance(n, int) and not isinstance(n, bool) and n >= 1)
            if not ok:
                raise ValueError(f"{site}: DRO is on but the task carries no valid weight for this site "
                                 f"({DRO_WEIGHT_KEY}={weight!r}, {DRO_SITES_KEY}={n!r}); add the DROWeightFilter to "
                                 "the server's task_data_filters for the train and train_alignment tasks")
            scale = n * weight
        if stage == "full_model" and self.trainer.aligned_round != round_idx:
            raise ValueError(f"{site}: stage 2 of turn {round_idx} needs this site's stage 1 of that turn (last: "
                             f"{self.trainer.aligned_round}); it sits this turn out")
        self.trainer.set_stage(stage, float(scale))
        if stage == "align":
            self.trainer.aligned_round = round_idx
        extra = super().receive(dxo, fl_ctx, round_idx)
        return {**extra, "stage": stage, "dro_scale": scale}

    def result_meta(self, stats: RoundStats, dxo: DXO, fl_ctx: FLContext) -> dict:
        v = stats.metrics.get("dro_loss")
        return {DRO_LOSS_KEY: v} if isinstance(v, float) and math.isfinite(v) else {}

    def describe_round(self, stats: RoundStats) -> str:
        m = stats.metrics
        text = f"{m.get('stage')}: loss {stats.loss:.4f} ({stats.steps} steps, lr x{m.get('weight_scale', 1.0):.3f})"
        if "dro_loss" in m:
            text += f", held-out v_i {m['dro_loss']:.4f}"
        return text

    # ------------------------------------------------------------------ test
    def test(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        trainer = self.ensure_trainer(shareable, fl_ctx)
        dxo = self.received_weights(shareable, fl_ctx, task="test")
        trainer.set_stage("fedavg")
        trainer.load_global(dxo.data or {})
        metrics = trainer.evaluate("test")
        round_idx, _ = round_headers(shareable)
        self.append_metrics(fl_ctx, {"task": "test", **metrics})
        self.log_info(fl_ctx, "test: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, float)))
        return DXO(data_kind=DataKind.METRICS, data=metrics).to_shareable()
