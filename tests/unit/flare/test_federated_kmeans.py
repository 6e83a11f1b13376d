"""FederatedKMeans workflow with FLARE's broadcast faked: federated Lloyd == centralised Lloyd on the union
of the sites' patch vectors; bad contributions are left out; the codebook is written once and sent once."""

import numpy as np
import pytest
import torch
from nvflare.apis.client import Client
from nvflare.apis.controller_spec import ClientTask
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.shareable import make_reply
from nvflare.apis.signal import Signal

from fedssl.core.tokenizer import (PatchTokenizer, codebook_description, init_codebook, kmeans_stats, kmeans_update,
                                   lloyd_step, load_tokenizer, random_codebook)
from fedssl.flare.constants import ITER_KEY, K_KEY, KMEANS_INIT, KMEANS_STEP, LOCAL_TOKENIZER_KEY, SET_TOKENIZER
from fedssl.flare.federated_kmeans import FederatedKMeans, KMeansError
from fedssl.flare.run_summary import SUMMARY_RECORD_EVENT
from tests.unit.flare.fakes import FakeEngine, context

K, D, P = 6, 12, 2  # 6 tokens of 2x2x3 patch vectors


def site_vectors(seed, n=60):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(4, D, generator=g) * 3
    return centres[torch.randint(4, (n,), generator=g)] + 0.3 * torch.randn(n, D, generator=g)


SITES = {"site-1": site_vectors(1), "site-2": site_vectors(2), "site-3": site_vectors(3, n=90)}


def local_centroids(x, seed=0):
    c = init_codebook(x, K, generator=torch.Generator().manual_seed(seed))
    c = lloyd_step(x, c)
    return c, kmeans_stats(x, c)[1]


def controller(tmp_path, sites=SITES, break_site=None, local_sites=(), **kw):
    """A FederatedKMeans whose broadcast runs the sites' k-means maths in-process (as MIMExecutor does)."""
    args = dict(vocab_size=K, n_iters=3, images_per_site=10, local_iters=1, min_clients=2, seed=5)
    args.update(kw)
    ctrl = FederatedKMeans(**args)
    sent, events = [], []

    def fake_broadcast(task, fl_ctx, min_responses, wait_time_after_min_received, abort_signal):
        sent.append(task)
        dxo = from_shareable(task.data)
        assert dxo.get_meta_prop(K_KEY) == ctrl.vocab_size
        for site, x in sites.items():
            ct = ClientTask(Client(site, None), task)
            if task.name == KMEANS_INIT and site in local_sites:
                result = DXO(DataKind.COLLECTION, data={}, meta={LOCAL_TOKENIZER_KEY: "local: /tok.pt"})
            elif task.name == KMEANS_INIT and dxo.get_meta_prop("init") == "random":
                result = DXO(DataKind.COLLECTION, data={}, meta={"patch_size": P})
            elif task.name == KMEANS_INIT:
                c, n = local_centroids(x)
                result = DXO(DataKind.COLLECTION, data={"centroids": c.numpy(), "counts": n.numpy()},
                             meta={"patch_size": P})
            elif task.name == KMEANS_STEP:
                sums, counts = kmeans_stats(x, torch.as_tensor(dxo.data["codebook"]))
                result = DXO(DataKind.COLLECTION, data={"sums": sums.numpy(), "counts": counts.numpy()},
                             meta={ITER_KEY: dxo.get_meta_prop(ITER_KEY), "sse": 1.0})
            else:
                result = DXO(DataKind.METRICS, data={"stored": 1})
            ct.result = result.to_shareable()
            if site == break_site and task.name == KMEANS_STEP:
                ct.result = DXO(DataKind.COLLECTION, data={"sums": np.full((K, D), np.nan), "counts": np.ones(K)},
                                meta={ITER_KEY: dxo.get_meta_prop(ITER_KEY)}).to_shareable()
            if site == break_site and task.name == KMEANS_INIT:
                ct.result = make_reply(ReturnCode.EXECUTION_EXCEPTION)
            task.client_tasks.append(ct)

    ctrl.broadcast_and_wait = fake_broadcast
    ctrl.fire_event = lambda event_type, fl_ctx: events.append((event_type, fl_ctx.get_prop(event_type)))
    return ctrl, sent, events


def run(ctrl, tmp_path):
    ctx = context(engine=FakeEngine(tmp_path), site="server")
    ctrl.start_controller(ctx)
    ctrl.control_flow(Signal(), ctx)
    return ctx


def test_federated_lloyd_equals_centralised_lloyd_on_the_union(tmp_path):
    ctrl, sent, events = controller(tmp_path)
    run(ctrl, tmp_path)
    # expected: k-means++ over the pooled local centroids, then n_iters Lloyd steps on all vectors together
    pooled = torch.cat([local_centroids(x)[0][local_centroids(x)[1] > 0] for x in SITES.values()])
    expected = init_codebook(pooled, K, generator=torch.Generator().manual_seed(5))
    union = torch.cat(list(SITES.values()))
    for _ in range(3):
        expected = lloyd_step(union, expected)
    tok = load_tokenizer(str(tmp_path / "tokenizer_codebook.pt"))
    assert isinstance(tok, PatchTokenizer) and tok.patch_size == P
    torch.testing.assert_close(tok.codebook, expected.float(), rtol=1e-5, atol=1e-5)
    # the exchanges: one init, n_iters steps, the codebook sent once; never an image, only codebooks go down
    assert [t.name for t in sent] == [KMEANS_INIT, KMEANS_STEP, KMEANS_STEP, KMEANS_STEP, SET_TOKENIZER]
    assert from_shareable(sent[0].data).data == {}
    final = from_shareable(sent[-1].data)
    np.testing.assert_allclose(final.data["codebook"], expected.numpy(), rtol=1e-5, atol=1e-5)
    assert final.get_meta_prop("patch_size") == P
    # the run summary learns which tokenizer was used
    (event, record), = events
    assert event == SUMMARY_RECORD_EVENT and record["tokenizer"] == f"federated k-means K={K}, iters=3"
    details = record["tokenizer_details"]
    assert details["sites"] == sorted(SITES) and len(details["iterations"]) == 3
    assert codebook_description(str(tmp_path / "tokenizer_codebook.pt")) == record["tokenizer"]
    # Lloyd never increases the cost: the centroid shift shrinks to ~0 on this well-separated data
    assert details["iterations"][-1]["mean_centroid_shift"] <= details["iterations"][0]["mean_centroid_shift"] + 1e-9


def test_random_init_is_data_free_and_still_centralised_lloyd(tmp_path):
    ctrl, sent, _ = controller(tmp_path, init="random")
    run(ctrl, tmp_path)
    expected = random_codebook(K, P, torch.Generator().manual_seed(5))
    union = torch.cat(list(SITES.values()))
    for _ in range(3):
        expected = lloyd_step(union, expected)
    torch.testing.assert_close(load_tokenizer(str(tmp_path / "tokenizer_codebook.pt")).codebook, expected.float(),
                               rtol=1e-5, atol=1e-5)
    assert from_shareable(sent[0].data).get_meta_prop("init") == "random"


def test_a_bad_site_is_left_out_and_the_others_go_on(tmp_path, caplog):
    ctrl, _, _ = controller(tmp_path, break_site="site-2")
    run(ctrl, tmp_path)
    assert all(h["sites"] == 2 for h in ctrl.history)
    assert "REJECTED k-means contribution: site-2 sent 'sums'" in caplog.text
    assert "site-2 returned EXECUTION_EXCEPTION for kmeans_init" in caplog.text


def test_too_few_sites_stops_the_job_with_a_clear_error(tmp_path):
    ctrl, _, _ = controller(tmp_path, break_site="site-2", min_clients=3)
    with pytest.raises(KMeansError, match=r"kmeans_init: only 2 of the required 3 sites"):
        run(ctrl, tmp_path)


def test_more_tokens_than_pooled_centroids_is_an_error(tmp_path):
    ctrl, _, _ = controller(tmp_path, sites={"site-1": SITES["site-1"]}, min_clients=1, vocab_size=K)
    ctrl.vocab_size = 7  # the site answers with 6 centroids (K of its own computation above)
    with pytest.raises(KMeansError, match="fewer than vocab_size K=7"):
        run(ctrl, tmp_path)


def test_sites_with_local_tokenizers_skip_the_workflow(tmp_path):
    ctrl, sent, events = controller(tmp_path, local_sites=set(SITES))
    run(ctrl, tmp_path)
    assert [t.name for t in sent] == [KMEANS_INIT]  # nothing learnt, no codebook sent
    assert not (tmp_path / "tokenizer_codebook.pt").exists()
    (event, record), = events
    assert "tokenizer" not in record  # the sites' own "local: <path>" record names the tokenizer
    assert record["tokenizer_details"]["sites"] == {s: "local: /tok.pt" for s in SITES}


def test_a_mix_of_local_and_federated_tokenizers_is_an_error(tmp_path):
    ctrl, _, _ = controller(tmp_path, local_sites={"site-2"})
    with pytest.raises(KMeansError, match=r"sites \['site-2'\] use local tokenizers but \['site-1', 'site-3'\]"):
        run(ctrl, tmp_path)


@pytest.mark.parametrize("kw, needle", [
    ({"vocab_size": 1}, "vocab_size=1"),
    ({"n_iters": 0}, "n_iters=0"),
    ({"images_per_site": -1}, "images_per_site=-1"),
    ({"min_clients": "5"}, "min_clients='5'"),
    ({"codebook_file": "../x.pt"}, "codebook_file='../x.pt'"),
    ({"init": "zeros"}, "init='zeros'"),
])
def test_bad_args_name_the_argument(kw, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        FederatedKMeans(**kw)


def test_update_math_is_the_core_m_step():
    """The controller's M-step is kmeans_update over the sites' statistics: equal to pooling the vectors."""
    c = torch.randn(K, D)
    per_site = kmeans_update(c, [kmeans_stats(x, c) for x in SITES.values()])
    torch.testing.assert_close(per_site, lloyd_step(torch.cat(list(SITES.values())), c))
