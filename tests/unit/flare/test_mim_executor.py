"""MIMExecutor on a tiny ViT and synthetic retina images: train tasks, the knowledge-split loading rules,
client restarts, and the Fed-BEiT tokenizer tasks (local codebook and the federated k-means exchanges)."""

import json
import math
import os

import numpy as np
import pytest
import torch
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.signal import Signal

from fedssl.core.tokenizer import PatchTokenizer, load_tokenizer
from fedssl.data.image_synthetic import write_synthetic_images
from fedssl.flare.constants import (EXCLUDED_META, KMEANS_INIT, KMEANS_STEP, LOCAL_TOKENIZER_KEY, SET_TOKENIZER,
                                    SITE_RECORD_META)
from fedssl.flare.mim_executor import MIMExecutor
from fedssl.models.vit import TINY_DECODER, TINY_VIT, BEiTViT, MAEViT
from tests.unit.flare.fakes import CountingSignal, FakeEngine, context

N_IMAGES = 12
VOCAB = 16
ARGS = dict(image_size=32, patch_size=4, embed_dim=48, depth=2, num_heads=3, decoder_embed_dim=32, decoder_depth=1,
            decoder_num_heads=2, vocab_size=VOCAB, batch_size=4, max_steps_per_round=2, lr=1e-3, lr_per_256=False,
            warmup_rounds=1, device="cpu", share_kmeans_statistics=True)
CLS = "encoder.cls_token"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("retina")
    write_synthetic_images(root, "retina", n_images=N_IMAGES, seed=0, image_size=40)
    return str(root)


def global_weights(method="mae", **overrides):
    model = (MAEViT(**TINY_VIT, **TINY_DECODER, seed=0) if method == "mae"
             else BEiTViT(**TINY_VIT, vocab_size=VOCAB, seed=0))
    w = {k: v.numpy() for k, v in model.state_dict().items()}
    w.update(overrides)
    return w


def task(weights, round_idx=0, num_rounds=3, meta=None):
    s = DXO(DataKind.WEIGHTS, data=weights, meta=meta or {}).to_shareable()
    s.set_header("current_round", round_idx)
    s.set_header("num_rounds", num_rounds)
    return s


def run(executor, run_dir, shareable, task_name="train", site="site-1"):
    return executor.execute(task_name, shareable, context(site=site, engine=FakeEngine(run_dir)), Signal())


def metrics(run_dir):
    return [json.loads(line) for line in open(os.path.join(run_dir, "mim_metrics.jsonl"))]


@pytest.mark.parametrize("kw, needle", [
    ({"method": "simclr"}, "method='simclr'"),
    ({"dataset": "cifar"}, "dataset='cifar'"),
    ({"image_size": 30, "patch_size": 4}, "image_size=30"),
    ({"embed_dim": 50, "num_heads": 3}, "embed_dim=50"),
    ({"decoder_embed_dim": 30, "decoder_num_heads": 4}, "decoder_embed_dim=30"),
    ({"mask_ratio": 1.0}, "mask_ratio=1.0"),
    ({"lr": 0}, "lr=0"),
    ({"lr_per_256": 1}, "lr_per_256=1"),
    ({"min_lr": -1e-5}, "min_lr=-1e-05"),
    ({"min_lr": 2e-3, "lr": 1e-3}, "min_lr=0.002 is invalid; use 0 <= min_lr <= the peak lr 0.001"),
    ({"batch_size": 0}, "batch_size=0"),
    ({"local_epochs": 0}, "local_epochs=0"),
    ({"warmup_rounds": -1}, "warmup_rounds=-1"),
    ({"max_steps_per_round": 1.5}, "max_steps_per_round=1.5"),
    ({"clip_grad": -1}, "clip_grad=-1"),
    ({"tokenizer_path": "/t.pt"}, "tokenizer_path='/t.pt'"),  # MAE has no tokenizer
    ({"device": "tpu"}, "device='tpu'"),
    ({"vocab_size": 1}, "vocab_size=1"),
    ({"min_cluster_size": 1}, "min_cluster_size=1"),
])
def test_bad_args_name_the_argument(kw, needle):
    with pytest.raises(ValueError, match="MIMExecutor: argument " + needle.replace("(", r"\(").replace(".", r"\.")):
        MIMExecutor(**kw)


def test_lr_is_the_absolute_rate_of_table_i_unless_per_256_is_asked():
    """SSL-FL Table I: Retina Fed-MAE eta = 1e-3 at B = 128 is the absolute rate (the reference script passes
    blr 2e-3 and computes 2e-3 x 128 / 256 = 1e-3); the old default scaled it again to 5e-4."""
    ex = MIMExecutor(lr=1e-3, batch_size=128)
    assert ex.lr == 1e-3 and ex.batch_size == 128 and ex.lr_per_256 is False and ex.peak_lr == 1e-3
    assert MIMExecutor(lr=2e-3, batch_size=128, lr_per_256=True).peak_lr == pytest.approx(1e-3)  # MAE's blr
    assert MIMExecutor(lr=1.5e-3, batch_size=256, min_lr=1e-5).min_lr == 1e-5  # Fed-BEiT Retina, BEiT's min lr


def test_mae_train_task_returns_weights_image_count_and_loss(data, tmp_path):
    ex = MIMExecutor(method="mae", data_root=data, **ARGS)
    reply = run(ex, tmp_path, task(global_weights()))
    out = from_shareable(reply)
    assert out.data_kind == DataKind.WEIGHTS and set(out.data) == set(global_weights())
    assert out.get_meta_prop("num_samples") == N_IMAGES  # |D_k|: all images of the site, not the steps
    assert np.isfinite(out.get_meta_prop("loss")) and out.get_meta_prop("NUM_STEPS_CURRENT_ROUND") == 2
    assert reply.get_header("current_round") == 0 and reply.get_header("num_rounds") == 3
    qkv = "encoder.blocks.0.attn.qkv.weight"
    assert not np.allclose(out.data[qkv], global_weights()[qkv])
    assert os.path.isfile(tmp_path / "mim_client_state.pt")
    (m,) = metrics(tmp_path)
    assert m["round"] == 0 and m["steps"] == 2 and m["num_samples"] == N_IMAGES and m["kept_local"] == []
    # issue 14 item 4: the summary record carries the round's feature spread, as the trainer measured it; issue 44:
    # and the loss's chance level, MAE on norm-pix targets of 4 x 4 x 3 values: 47 / 48
    assert out.get_meta_prop(SITE_RECORD_META) == {"feature_std": m["feature_std"], "chance_loss": 47 / 48}
    assert 0 < m["feature_std"] < 1 and m["chance_loss"] == 47 / 48


def test_full_epochs_when_steps_are_not_capped(data, tmp_path):
    ex = MIMExecutor(method="mae", data_root=data, **{**ARGS, "max_steps_per_round": 0, "local_epochs": 2})
    out = from_shareable(run(ex, tmp_path, task(global_weights())))
    assert out.get_meta_prop("NUM_STEPS_CURRENT_ROUND") == 2 * 3  # 2 epochs x ceil(12 / 4)


def test_knowledge_split_keeps_the_local_class_token_and_rejects_unexpected_keys(data, tmp_path):
    ex = MIMExecutor(method="mae", data_root=data, **ARGS)
    local_cls = from_shareable(run(ex, tmp_path, task(global_weights()))).data[CLS]
    fresh = global_weights()
    assert not np.allclose(local_cls, fresh[CLS])  # training moved this site's token
    broadcast = {k: v for k, v in fresh.items() if k != CLS}
    # the broadcast without the class token (declared excluded): everything else is loaded, the token stays local
    kept = ex.trainer.load_global(broadcast, [CLS])
    state = ex.trainer.model.state_dict()
    assert kept == [CLS]
    np.testing.assert_array_equal(state[CLS].numpy(), local_cls)
    proj = "encoder.patch_embed.proj.weight"
    np.testing.assert_array_equal(state[proj].numpy(), fresh[proj])
    # a full train task through execute() with the filter's meta: the token stays local, the round goes on
    out = from_shareable(run(ex, tmp_path, task(broadcast, 1, meta={EXCLUDED_META: [CLS]})))
    assert metrics(tmp_path)[-1]["kept_local"] == [CLS] and np.isfinite(out.get_meta_prop("loss"))
    # unexpected keys, or keys missing without an exclusion filter, fail this site's task with a clear message
    with pytest.raises(ValueError, match=r"site-1: the global model has 1 keys .*'decoder.extra'"):
        ex.trainer.load_global({**fresh, "decoder.extra": np.zeros(2, np.float32)}, [])
    with pytest.raises(ValueError, match=r"lacks 1 keys .*\['encoder.cls_token'\]\) that no exclusion filter"):
        ex.trainer.load_global(broadcast, [])
    with pytest.raises(ValueError, match="site-1: the global model: encoder.cls_token has shape"):
        ex.trainer.load_global({**fresh, CLS: np.zeros((1, 1, 8), np.float32)}, [])
    reply = run(ex, tmp_path, task({**fresh, "decoder.extra": np.zeros(2, np.float32)}, 2))
    assert reply.get_return_code() == ReturnCode.EXECUTION_EXCEPTION


def test_a_restarted_client_resumes_model_optimiser_and_local_tensors(data, tmp_path):
    ex = MIMExecutor(method="mae", data_root=data, **ARGS)
    run(ex, tmp_path, task(global_weights(), 0))
    saved = torch.load(tmp_path / "mim_client_state.pt", weights_only=True)
    assert saved["round"] == 0 and saved["trainer"]["step"] == 2
    broadcast = {k: v for k, v in global_weights().items() if k != CLS}
    run(ex, tmp_path, task(broadcast, 1, meta={EXCLUDED_META: [CLS]}))
    ckpt = torch.load(tmp_path / "mim_client_state.pt", weights_only=True)
    assert ckpt["round"] == 1 and set(ckpt["trainer"]["local"]) == {CLS}
    # a new executor object = a client restart: it continues from the checkpoint, not from scratch
    ex2 = MIMExecutor(method="mae", data_root=data, **ARGS)
    out = from_shareable(run(ex2, tmp_path, task(broadcast, 2, meta={EXCLUDED_META: [CLS]})))
    assert ex2.last_round == 2 and ex2.trainer.trainer.step == 6  # 2 steps in each of rounds 0, 1, 2
    assert ex2.trainer.trainer.optimizer.state_dict()["state"]  # AdamW moments came back
    assert metrics(tmp_path)[-1]["kept_local"] == [CLS]
    # the class token it trained on in round 2 started from its own checkpointed value, not the global one
    assert not np.allclose(out.data[CLS], global_weights()[CLS])


def test_beit_with_a_local_tokenizer_reports_it(data, tmp_path):
    path = str(tmp_path / "codebook.pt")
    PatchTokenizer(torch.randn(VOCAB, 4 * 4 * 3, generator=torch.Generator().manual_seed(0)), 4).save(path)
    ex = MIMExecutor(method="beit", data_root=data, mask_ratio=0.4, tokenizer_path=path, **ARGS)
    out = from_shareable(run(ex, tmp_path, task(global_weights("beit"))))
    assert np.isfinite(out.get_meta_prop("loss")) and out.get_meta_prop("num_samples") == N_IMAGES
    record = out.get_meta_prop(SITE_RECORD_META)
    assert record == {"tokenizer": f"local: {path}", "feature_std": metrics(tmp_path)[-1]["feature_std"],
                      "chance_loss": math.log(VOCAB)}  # uniform over the 16 visual tokens
    # asked for federated k-means, it answers with its local tokenizer (the server then skips the workflow)
    init = from_shareable(run(ex, tmp_path, kmeans_task({}), KMEANS_INIT))
    assert init.data == {} and init.get_meta_prop(LOCAL_TOKENIZER_KEY) == f"local: {path}"
    # a missing local tokenizer fails the site with a clear message
    bad = MIMExecutor(method="beit", data_root=data, tokenizer_path=str(tmp_path / "nope.pt"), **ARGS)
    assert run(bad, tmp_path / "x", task(global_weights("beit"))).get_return_code() == ReturnCode.EXECUTION_EXCEPTION


def kmeans_task(meta, data=None):
    base = {"vocab_size": VOCAB, "images_per_site": 6, "local_iters": 1, "seed": 0, "min_cluster_size": 2}
    return DXO(DataKind.COLLECTION, data=data or {}, meta={**base, **meta}).to_shareable()


def test_beit_federated_tokenizer_tasks_then_training(data, tmp_path, caplog):
    ex = MIMExecutor(method="beit", data_root=data, mask_ratio=0.4, **ARGS)
    os.makedirs(tmp_path / "a")
    # without the codebook, training refuses with the fix
    reply = run(ex, tmp_path / "a", task(global_weights("beit")))
    assert reply.get_return_code() == ReturnCode.EXECUTION_EXCEPTION
    assert "no federated codebook was received" in caplog.text and "FederatedKMeans" in caplog.text
    ex = MIMExecutor(method="beit", data_root=data, mask_ratio=0.4, **ARGS)
    init = from_shareable(run(ex, tmp_path, kmeans_task({}), KMEANS_INIT))
    c, n = init.data["centroids"], init.data["counts"]
    assert c.shape == (VOCAB, 48) and n.sum() <= 6 * 64  # 6 images x 8x8 patches, only cluster means go up
    assert init.get_meta_prop("n_vectors") == 6 * 64 and set(np.unique(n)) & {1} == set()  # site's m = 5 > 2
    assert init.get_meta_prop("min_cluster_size") == 5 and n[n > 0].min() >= 5
    assert init.get_meta_prop("patch_size") == 4
    random_start = from_shareable(run(ex, tmp_path, kmeans_task({"init": "random"}), KMEANS_INIT))
    assert random_start.data == {} and random_start.get_meta_prop("patch_size") == 4  # data-free: nothing but p
    step = from_shareable(run(ex, tmp_path, kmeans_task({"kmeans_iter": 0}, {"codebook": c}), KMEANS_STEP))
    assert step.data["sums"].shape == (VOCAB, 48) and 0 < step.data["counts"].sum() <= 6 * 64
    assert step.get_meta_prop("kmeans_iter") == 0 and step.get_meta_prop("sse") >= 0
    desc = "federated k-means K=16, iters=1"
    inf = np.where(np.arange(c.size).reshape(c.shape) == 0, np.inf, c)  # never stored, never tokenised with
    reply = run(ex, tmp_path, kmeans_task({"patch_size": 4, "tokenizer": desc}, {"codebook": inf}), SET_TOKENIZER)
    assert reply.get_return_code() == ReturnCode.EXECUTION_EXCEPTION and "codebook with NaN/Inf" in caplog.text
    assert not os.path.exists(tmp_path / "tokenizer_codebook.pt")
    reply = run(ex, tmp_path, kmeans_task({"patch_size": 4, "tokenizer": desc}, {"codebook": c}), SET_TOKENIZER)
    assert reply.get_return_code() in (None, ReturnCode.OK)
    tok = load_tokenizer(str(tmp_path / "tokenizer_codebook.pt"))
    np.testing.assert_allclose(tok.codebook.numpy(), c)
    # a restarted client finds the stored codebook and trains with it
    ex2 = MIMExecutor(method="beit", data_root=data, mask_ratio=0.4, **ARGS)
    out = from_shareable(run(ex2, tmp_path, task(global_weights("beit"))))
    assert np.isfinite(out.get_meta_prop("loss"))
    assert out.get_meta_prop(SITE_RECORD_META) == {"tokenizer": desc,
                                                   "feature_std": metrics(tmp_path)[-1]["feature_std"],
                                                   "chance_loss": math.log(VOCAB)}


def test_kmeans_tasks_are_refused_by_mismatched_sites(data, tmp_path, caplog):
    mae = MIMExecutor(method="mae", data_root=data, **ARGS)
    assert run(mae, tmp_path, kmeans_task({}), KMEANS_INIT).get_return_code() == ReturnCode.EXECUTION_EXCEPTION
    assert "remove the FederatedKMeans workflow" in caplog.text
    beit = MIMExecutor(method="beit", data_root=data, **{**ARGS, "vocab_size": 32})
    assert run(beit, tmp_path, kmeans_task({}), KMEANS_INIT).get_return_code() == ReturnCode.EXECUTION_EXCEPTION
    assert "K=16 tokens but this site's vocab_size=32" in caplog.text
    too_many = kmeans_task({"vocab_size": 400, "images_per_site": 2})
    beit400 = MIMExecutor(method="beit", data_root=data, **{**ARGS, "vocab_size": 400})
    assert run(beit400, tmp_path, too_many, KMEANS_INIT).get_return_code() == ReturnCode.EXECUTION_EXCEPTION
    assert "only 128 patch vectors for K=400" in caplog.text
    # a server asking for statistics of single patches, or for no local Lloyd step (the seeds), is refused
    for meta, needle in [({"min_cluster_size": 1}, "min_cluster_size=1; this site sends only means of >= 2"),
                         ({"local_iters": 0}, "local_iters=0; use at least one local Lloyd step")]:
        ok = MIMExecutor(method="beit", data_root=data, **ARGS)
        assert run(ok, tmp_path, kmeans_task(meta), KMEANS_INIT).get_return_code() == ReturnCode.EXECUTION_EXCEPTION
        assert needle in caplog.text


def test_an_abort_during_the_round_stops_within_one_step(data, tmp_path):
    ex = MIMExecutor(method="mae", data_root=data, **ARGS)
    reply = ex.execute("train", task(global_weights()), context(site="site-1", engine=FakeEngine(tmp_path)),
                       CountingSignal(after=2))
    assert reply.get_return_code() == ReturnCode.TASK_ABORTED
    assert ex.trainer.trainer.step == 1  # one step, then the abort
    assert not os.path.exists(tmp_path / "mim_client_state.pt") and not os.path.exists(tmp_path / "mim_metrics.jsonl")


def test_loader_workers_reach_the_trainer(data, tmp_path, loader_workers):
    out = from_shareable(run(MIMExecutor(method="mae", data_root=data, workers=1, **ARGS), tmp_path,
                             task(global_weights())))
    assert np.isfinite(out.get_meta_prop("loss")) and loader_workers and set(loader_workers) == {1}


def test_kmeans_statistics_leave_a_site_only_when_it_agreed(data, tmp_path, caplog):
    """Issue 45 item 5: a server that differences one site's successive Lloyd steps recovers raw patches, so a
    site answers the k-means tasks only with share_kmeans_statistics true; its own fedssl_site.json beats the job."""
    import json as _json

    from fedssl.data.site_config import SITE_CONFIG_FILE

    quiet = {**ARGS, "share_kmeans_statistics": False}
    ex = MIMExecutor(method="beit", data_root=data, **quiet)
    os.makedirs(tmp_path / "job_says_no")
    reply = run(ex, tmp_path / "job_says_no", kmeans_task({}), KMEANS_INIT)
    assert reply.get_return_code() == ReturnCode.EXECUTION_EXCEPTION
    assert "does not share federated k-means statistics (share_kmeans_statistics=False)" in caplog.text
    random_start = from_shareable(run(ex, tmp_path / "job_says_no", kmeans_task({"init": "random"}), KMEANS_INIT))
    assert random_start.data == {}  # the data-free start sends no statistic, so it needs no consent
    c = np.zeros((VOCAB, 48), np.float32)
    step = run(ex, tmp_path / "job_says_no", kmeans_task({"kmeans_iter": 0}, {"codebook": c}), KMEANS_STEP)
    assert step.get_return_code() == ReturnCode.EXECUTION_EXCEPTION
    for job_value, site_value, answers in ((False, True, True), (True, False, False)):
        folder = tmp_path / f"site_{site_value}"
        os.makedirs(folder)
        (folder / SITE_CONFIG_FILE).write_text(_json.dumps({"share_kmeans_statistics": site_value}))
        ex = MIMExecutor(method="beit", data_root=data, **{**ARGS, "share_kmeans_statistics": job_value})
        reply = run(ex, folder, kmeans_task({}), KMEANS_INIT)
        assert (reply.get_return_code() in (None, ReturnCode.OK)) is answers

