"""Server workflow that builds FedDRA's WordPiece vocabulary before pre-training, without raw text leaving a site.

BERT's tokenizer cannot be downloaded here, and the text encoder starts from random initialisation unless a local
Hugging Face folder is given; its vocabulary is then built inside the federation:

1. ``word_counts``: each site returns the counts of the words (BERT basic tokenisation, lower case) seen at least
   ``min_count`` times in its own training reports (:func:`fedssl.data.vocab.site_word_counts`; the site uses the
   larger of its own ``min_word_count`` and this one).  No sentence, no word order, no image and no word rarer than
   that leaves a site: a word seen once or twice (a name, a date, a rare finding) is never sent.
2. The server checks and sums the counts (:func:`fedssl.data.vocab.merge_word_counts`), builds a vocabulary of
   exactly ``vocab_size`` entries (:func:`fedssl.data.vocab.build_wordpiece_vocab`: special tokens, characters and
   their ``##`` forms, then the most frequent words), and writes it to ``vocab_file`` in its run folder.
3. ``set_vocab``: every site receives the vocabulary once and saves it in its run folder.

A site whose reply is missing or malformed is logged and left out; with no usable reply the run stops.
"""

from __future__ import annotations

import os

from nvflare.apis.controller_spec import Task
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.impl.controller import Controller
from nvflare.apis.signal import Signal

from fedssl.core.checks import require, require_int
from fedssl.data.vocab import build_wordpiece_vocab, merge_word_counts, save_vocab
from fedssl.flare.constants import MIN_COUNT_KEY, SET_VOCAB_TASK, VOCAB_KEY, WORD_COUNTS_KEY, WORD_COUNTS_TASK


class FederatedVocabulary(Controller):
    def __init__(self, vocab_size: int = 30522, min_count: int = 5, vocab_file: str = "vocab.txt", timeout: int = 0):
        """
        Args:
            vocab_size: entries of the vocabulary (= the text encoder's vocab_size; BERT-base: 30522).
            min_count: the fewest occurrences on one site for a word to be counted (>= 2; 5 by default).
            vocab_file: file name in the server's run folder.
            timeout: seconds each task may take (0 = no limit).
        """
        super().__init__()
        name = type(self).__name__
        require_int(name, "vocab_size", vocab_size, 64, "use the text encoder's vocab_size (BERT-base: 30522)")
        require_int(name, "min_count", min_count, 2, "use 2 or more: a word seen once on a site never leaves it")
        require(isinstance(vocab_file, str) and bool(vocab_file) and os.sep not in vocab_file, name, "vocab_file",
                vocab_file, 'use a plain file name, e.g. "vocab.txt"')
        require_int(name, "timeout", timeout, 0, "use 0 (no limit) or a positive number of seconds")
        self.vocab_size, self.min_count, self.vocab_file, self.timeout = vocab_size, min_count, vocab_file, timeout
        self.vocab: list[str] = []

    def start_controller(self, fl_ctx: FLContext) -> None:
        """Nothing to prepare: the vocabulary is built inside control_flow (Controller requires the hook)."""

    def stop_controller(self, fl_ctx: FLContext) -> None:
        """Nothing to release: the vocabulary file is written before the last task (Controller requires the hook)."""

    def process_result_of_unknown_task(self, client, task_name, client_task_id, result, fl_ctx) -> None:
        self.log_warning(fl_ctx, f"late result for task {task_name} from {client.name} ignored")

    def control_flow(self, abort_signal: Signal, fl_ctx: FLContext) -> None:
        data = DXO(data_kind=DataKind.METRICS, data={}, meta={MIN_COUNT_KEY: self.min_count}).to_shareable()
        task = Task(name=WORD_COUNTS_TASK, data=data, props={}, timeout=self.timeout)
        n_clients = len(self._engine.get_clients())
        self.broadcast_and_wait(task=task, fl_ctx=fl_ctx, min_responses=n_clients, abort_signal=abort_signal)
        if abort_signal.triggered:
            return
        counts, sites = [], []
        for ct in task.client_tasks:
            result = ct.result
            rc = result.get_return_code() if result is not None else "no reply"
            if result is None or (rc and rc != ReturnCode.OK):
                self.log_warning(fl_ctx, f"{ct.client.name} returned {rc} for {WORD_COUNTS_TASK}; left out of the "
                                         "vocabulary")
                continue
            try:
                got = from_shareable(result).data.get(WORD_COUNTS_KEY)
                merge_word_counts([got], min_count=self.min_count)  # check this site's counts alone
            except Exception as e:  # noqa: BLE001 -- one site's malformed payload never stops the others
                self.log_warning(fl_ctx, f"{ct.client.name} sent unusable word counts ({type(e).__name__}: "
                                         f"{str(e)[:200]}); left out of the vocabulary")
                continue
            counts.append(got)
            sites.append(ct.client.name)
        if not counts:
            self.system_panic("no site sent usable word counts; cannot build the vocabulary", fl_ctx)
            return
        merged = merge_word_counts(counts, min_count=self.min_count)
        self.vocab = build_wordpiece_vocab(merged, self.vocab_size)
        run_dir = self._engine.get_workspace().get_run_dir(fl_ctx.get_job_id())
        os.makedirs(run_dir, exist_ok=True)
        save_vocab(self.vocab, os.path.join(run_dir, self.vocab_file))
        self.log_info(fl_ctx, f"vocabulary of {len(self.vocab)} tokens from {len(merged)} words of {len(sites)} sites "
                              f"written to {os.path.join(run_dir, self.vocab_file)}")
        data = DXO(data_kind=DataKind.METRICS, data={}, meta={VOCAB_KEY: self.vocab}).to_shareable()
        task = Task(name=SET_VOCAB_TASK, data=data, props={}, timeout=self.timeout)
        self.broadcast_and_wait(task=task, fl_ctx=fl_ctx, min_responses=n_clients, abort_signal=abort_signal)
