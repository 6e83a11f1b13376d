"""FedDRAExecutor on a tiny synthetic MIMIC-CXR site: the vocabulary exchange (what leaves the site), the DRO weight
a task must carry, the stage order of a turn, and the retrieval test."""

from __future__ import annotations

import json

import pytest
import torch
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.signal import Signal

from fedssl.data.vlp import load_mimic_vlp, write_client_manifests
from fedssl.data.vocab import build_wordpiece_vocab
from fedssl.flare.constants import (ALIGN_TASK, DRO_LOSS_KEY, DRO_ON_KEY, DRO_SITES_KEY, DRO_WEIGHT_KEY, MIN_COUNT_KEY,
                                    SET_VOCAB_TASK, STAGE_KEY, VOCAB_KEY, WORD_COUNTS_KEY, WORD_COUNTS_TASK)
from fedssl.flare.feddra_executor import FedDRAExecutor
from fedssl.models.vlp import VisionLanguageModel
from tests.unit.flare.fakes import FakeEngine, context

torch.set_num_threads(1)
SHAPE = dict(preset="tiny", vocab_size=128)
ARGS = dict(SHAPE, batch_size=4, align_steps=1, steps=2, lr=1e-3, max_text_len=32, min_word_count=2, device="cpu")


@pytest.fixture(scope="module")
def site_dir(tmp_path_factory):
    from fedssl.data.vlp_synthetic import write_synthetic_mimic

    root = tmp_path_factory.mktemp("feddra")
    write_synthetic_mimic(str(root / "raw"), n_patients=30, image_px=32, seed=1)
    records, _ = load_mimic_vlp(str(root / "raw"), site="x")
    write_client_manifests(records, str(root / "sites"), n_clients=1, alpha=1.0, seed=0, min_per_client=1)
    return str(root / "sites" / "site-1")


def call(ex, task, data, tmp_path, meta=None, round_idx=0):
    s = DXO(DataKind.WEIGHTS if data is not None else DataKind.METRICS, data=data or {}, meta=meta or {}).to_shareable()
    s.set_header("current_round", round_idx)
    s.set_header("num_rounds", 3)
    return ex.execute(task, s, context(site="site-1", engine=FakeEngine(tmp_path)), Signal())


def with_vocab(site_dir, tmp_path, **kw):
    ex = FedDRAExecutor(data_root=site_dir, **{**ARGS, **kw})
    counts = from_shareable(call(ex, WORD_COUNTS_TASK, None, tmp_path, {MIN_COUNT_KEY: 3})).data[WORD_COUNTS_KEY]
    call(ex, SET_VOCAB_TASK, None, tmp_path, {VOCAB_KEY: build_wordpiece_vocab(counts, 128)})
    return ex, counts


def weights():
    return {k: v.numpy() for k, v in VisionLanguageModel(**SHAPE).state_dict().items()}


def test_word_counts_hold_only_frequent_words_and_no_text(site_dir, tmp_path):
    ex, counts = with_vocab(site_dir, tmp_path)
    texts = [r.text.lower() for r in ex.records(context(site="site-1", engine=FakeEngine(tmp_path)))[0]]
    assert counts and all(isinstance(v, int) for v in counts.values())
    for word in counts:  # each shared word appears in at least 3 reports (the server's floor beat the site's 2)
        assert sum(word in t for t in texts) >= 3
    assert not any(t in json.dumps(counts) for t in texts)  # no report is in the payload
    assert (tmp_path / "feddra_vocab.txt").is_file()


def test_a_dro_task_without_this_sites_weight_is_refused(site_dir, tmp_path):
    ex, _ = with_vocab(site_dir, tmp_path)
    reply = call(ex, ALIGN_TASK, weights(), tmp_path, {STAGE_KEY: "align", DRO_ON_KEY: True})
    assert reply.get_return_code() == ReturnCode.EXECUTION_EXCEPTION


def test_the_weight_scales_the_step_and_stage_two_needs_this_turns_stage_one(site_dir, tmp_path):
    ex, _ = with_vocab(site_dir, tmp_path)
    dro = {DRO_ON_KEY: True, DRO_WEIGHT_KEY: 0.5, DRO_SITES_KEY: 3}
    up = from_shareable(call(ex, ALIGN_TASK, weights(), tmp_path, {STAGE_KEY: "align", **dro}))
    assert up.data and all(k.startswith(("image_align.", "text_align.", "image_proj.", "text_proj.")) for k in up.data)
    aligned = {k: v for k, v in weights().items() if k in up.data}
    down = from_shareable(call(ex, "train", aligned, tmp_path, {STAGE_KEY: "full_model", **dro}))
    assert set(down.data) == set(weights()) and down.get_meta_prop(DRO_LOSS_KEY) > 0
    records = [json.loads(x) for x in open(tmp_path / "feddra_metrics.jsonl")]
    assert [r["stage"] for r in records] == ["align", "full_model"]
    assert all(r["lr"] == pytest.approx(1.5e-3) and r["dro_scale"] == pytest.approx(1.5) for r in records)
    # turn 1's stage 2 without turn 1's stage 1: refused (the encoders would be last turn's)
    skipped = call(ex, "train", aligned, tmp_path, {STAGE_KEY: "full_model", **dro}, round_idx=1)
    assert skipped.get_return_code() == ReturnCode.EXECUTION_EXCEPTION


def test_a_task_without_a_stage_is_refused_and_test_reports_retrieval(site_dir, tmp_path):
    ex, _ = with_vocab(site_dir, tmp_path)
    assert call(ex, "train", weights(), tmp_path, {}).get_return_code() == ReturnCode.EXECUTION_EXCEPTION
    metrics = from_shareable(call(ex, "test", weights(), tmp_path)).data
    assert 0 <= metrics["R@1"] <= metrics["R@5"] <= 1 and metrics["n_pairs"] >= 2


def test_missing_vocabulary_is_a_clear_error(site_dir, tmp_path):
    ex = FedDRAExecutor(data_root=site_dir, **ARGS)
    reply = call(ex, "train", weights(), tmp_path, {STAGE_KEY: "fedavg"})
    assert reply.get_return_code() == ReturnCode.EXECUTION_EXCEPTION


def test_loader_workers_reach_the_trainer(site_dir, tmp_path, loader_workers):
    ex, _ = with_vocab(site_dir, tmp_path, workers=1)
    up = from_shareable(call(ex, ALIGN_TASK, weights(), tmp_path, {STAGE_KEY: "align"}))
    assert up.data and loader_workers == [1]  # one DataLoader for the turn's stage-1 batches
