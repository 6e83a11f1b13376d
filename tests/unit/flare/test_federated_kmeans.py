"""FederatedKMeans workflow with FLARE's broadcast faked: on tiny points the codebook is the hand-computed
count-weighted cluster means; the codebook is written once and sent once; and every contribution a site could
forge (overflowing float64, inflated counts or sample, sums beyond the patch-vector norm, clusters below
min_cluster_size, wrong types, shapes, iterations, names) is left out, with the site named, while the others
finish the run: the codebook is then bit for bit the one the honest sites alone give."""

import numpy as np
import pytest
import torch
from nvflare.apis.client import Client
from nvflare.apis.controller_spec import ClientTask
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.shareable import make_reply
from nvflare.apis.signal import Signal

from fedssl.core.patches import normalize_patches
from fedssl.core.tokenizer import (PatchTokenizer, codebook_description, init_codebook, kmeans_stats, kmeans_update,
                                   load_tokenizer, site_kmeans_stats, suppress_small_clusters)
from fedssl.flare.constants import ITER_KEY, K_KEY, KMEANS_INIT, KMEANS_STEP, LOCAL_TOKENIZER_KEY, SET_TOKENIZER
from fedssl.flare.federated_kmeans import FederatedKMeans, KMeansError
from fedssl.flare.run_summary import SUMMARY_RECORD_EVENT
from tests.unit.flare.fakes import FakeEngine, context

torch.set_num_threads(1)
K, D, P = 6, 12, 2  # 6 tokens of 2x2x3 patch vectors
M = 3  # min_cluster_size of these runs
#: image_size = patch_size: one patch per image, so a site's n vectors are n images (cap: images_per_site = 100)
SHAPE = dict(image_size=P, patch_size=P, images_per_site=100)


def site_vectors(seed, n=60):
    """Patch vectors (per-vector normalised, as fedssl.core.tokenizer.patch_vectors) around 4 centres."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(4, D, generator=g) * 3
    return normalize_patches(centres[torch.randint(4, (n,), generator=g)] + 0.3 * torch.randn(n, D, generator=g))


SITES = {"site-1": site_vectors(1), "site-2": site_vectors(2), "site-3": site_vectors(3, n=90)}


class Engine(FakeEngine):
    """The run's clients as FLARE's server engine lists them (Client objects)."""

    def __init__(self, root, names):
        super().__init__(root)
        self.names = names

    def get_clients(self):
        return [Client(name, None) for name in self.names]


def local_means(x, m=M, seed=0):
    """What a site sends in kmeans_init (KMeansPatches.local_centroids, one Lloyd step): cluster means, < m withheld."""
    c = init_codebook(x, K, generator=torch.Generator().manual_seed(seed))
    sums, counts = suppress_small_clusters(*kmeans_stats(x, c), m)
    return (sums / counts.clamp(min=1)[:, None]).float(), counts


def honest_reply(task_name, dxo, x):
    if task_name == KMEANS_INIT and dxo.get_meta_prop("init") == "random":
        return DXO(DataKind.COLLECTION, data={}, meta={"patch_size": P})
    if task_name == KMEANS_INIT:
        c, n = local_means(x, dxo.get_meta_prop("min_cluster_size"))
        return DXO(DataKind.COLLECTION, data={"centroids": c.numpy(), "counts": n.numpy()},
                   meta={"patch_size": P, "n_vectors": x.shape[0]})
    if task_name == KMEANS_STEP:
        m = dxo.get_meta_prop("min_cluster_size")
        sums, counts, sse = site_kmeans_stats(x, torch.as_tensor(dxo.data["codebook"]), m)
        return DXO(DataKind.COLLECTION, data={"sums": sums.float().numpy(), "counts": counts.numpy()},
                   meta={ITER_KEY: dxo.get_meta_prop(ITER_KEY), "sse": sse, "n_vectors": x.shape[0]})
    return DXO(DataKind.METRICS, data={"stored": 1})


def controller(tmp_path, sites=SITES, tamper=None, local_sites=(), intruder=None, reply=honest_reply, **kw):
    """A FederatedKMeans whose broadcast runs the sites' k-means maths in-process (``reply``, by default as
    MIMExecutor does).  ``tamper(site, task_name, dxo)`` may replace a site's reply (a DXO or a Shareable) or
    return None."""
    args = dict(vocab_size=K, n_iters=3, local_iters=1, min_clients=2, seed=5, min_cluster_size=M, **SHAPE)
    args.update(kw)
    ctrl = FederatedKMeans(**args)
    sent, events = [], []

    def fake_broadcast(task, fl_ctx, min_responses, wait_time_after_min_received, abort_signal):
        sent.append(task)
        dxo = from_shareable(task.data)
        assert dxo.get_meta_prop(K_KEY) == ctrl.vocab_size
        answering = {**sites, **({intruder: next(iter(sites.values()))} if intruder else {})}
        for site, x in answering.items():
            ct = ClientTask(Client(site, None), task)
            if task.name == KMEANS_INIT and site in local_sites:
                result = DXO(DataKind.COLLECTION, data={}, meta={LOCAL_TOKENIZER_KEY: "local: /tok.pt"})
            else:
                result = reply(task.name, dxo, x)
            forged = tamper(site, task.name, result) if tamper else None
            result = result if forged is None else forged
            ct.result = result.to_shareable() if isinstance(result, DXO) else result
            task.client_tasks.append(ct)

    ctrl.broadcast_and_wait = fake_broadcast
    ctrl.fire_event = lambda event_type, fl_ctx: events.append((event_type, fl_ctx.get_prop(event_type)))
    return ctrl, sent, events


def run(ctrl, tmp_path, clients=tuple(SITES)):
    ctx = context(engine=Engine(tmp_path, list(clients)), site="server")
    ctrl.start_controller(ctx)
    ctrl.control_flow(Signal(), ctx)
    return ctx


def codebook(tmp_path):
    return load_tokenizer(str(tmp_path / "tokenizer_codebook.pt")).codebook


def point(a, b):
    """A patch vector of D = 12 values that are 0 but the first two: hand-computable centroids."""
    return [a, b] + [0.0] * (D - 2)


#: two groups (x > 0, x < 0) split unevenly between two sites, so the count weighting matters:
#: union of the x > 0 points: (1,0) (2,0) (2,2) (3,1) (3,0) -> sum (11, 3) / 5 = (2.2, 0.6)
#: union of the x < 0 points: (-1,0) (-2,0) (-1,-1) (-3,-1) -> sum (-7, -2) / 4 = (-1.75, -0.5)
#: (the mean of the two sites' x > 0 means, (1.5, 0) and (8/3, 1), unweighted, would be (2.083, 0.5))
HAND_SITES = {
    "site-a": torch.tensor([point(1, 0), point(2, 0), point(-1, 0), point(-2, 0)]),
    "site-b": torch.tensor([point(2, 2), point(3, 1), point(3, 0), point(-1, -1), point(-3, -1)]),
}
#: what each site's local k-means sends in kmeans_init, written by hand: its two group means and their sizes
HAND_LOCAL_MEANS = {
    "site-a": ([point(1.5, 0), point(-1.5, 0)], [2, 2]),
    "site-b": ([point(8 / 3, 1), point(-2, -1)], [3, 2]),
}


def oracle_e_step(x, codebook, m):
    """The E-step by explicit loops (not fedssl's code): nearest centroid, per-cluster sums and counts,
    clusters of fewer than m vectors sent as zero, and the cost of the vectors still reported."""
    k = codebook.shape[0]
    sums, counts, cost = np.zeros((k, D)), np.zeros(k, dtype=np.int64), np.zeros(k)
    for v in x.double().numpy():
        d2 = [float(((v - c) ** 2).sum()) for c in codebook.double().numpy()]
        j = d2.index(min(d2))
        sums[j] += v
        counts[j] += 1
        cost[j] += d2[j]
    small = counts < m
    sums[small], counts[small], cost[small] = 0, 0, 0
    return sums, counts, float(cost.sum())


def hand_reply(task_name, dxo, x):
    site = next(name for name, v in HAND_SITES.items() if v is x)
    if task_name == KMEANS_INIT:
        means, counts = HAND_LOCAL_MEANS[site]
        return DXO(DataKind.COLLECTION, data={"centroids": np.array(means, np.float32), "counts": np.array(counts)},
                   meta={"patch_size": P, "n_vectors": x.shape[0]})
    if task_name == KMEANS_STEP:
        sums, counts, sse = oracle_e_step(x, torch.as_tensor(dxo.data["codebook"]),
                                          dxo.get_meta_prop("min_cluster_size"))
        return DXO(DataKind.COLLECTION, data={"sums": sums.astype(np.float32), "counts": counts},
                   meta={ITER_KEY: dxo.get_meta_prop(ITER_KEY), "sse": sse, "n_vectors": x.shape[0]})
    return DXO(DataKind.METRICS, data={"stored": 1})


def test_federated_lloyd_gives_the_hand_computed_count_weighted_means(tmp_path):
    """Seed 5's k-means++ over the four local means picks (-2, -1) then (1.5, 0): one seed per group, so the first
    step assigns every point to its group and gives the group means (-1.75, -0.5) and (2.2, 0.6), which the second
    step keeps.  Its cost: 1.8 + 0.4 + 2.0 + 0.8 + 1.0 (x > 0) + 0.8125 + 0.3125 + 0.8125 + 1.8125 (x < 0) = 9.75
    over 9 vectors."""
    ctrl, sent, events = controller(tmp_path, sites=HAND_SITES, reply=hand_reply, vocab_size=2, n_iters=2,
                                    min_cluster_size=2)
    run(ctrl, tmp_path, clients=tuple(HAND_SITES))
    expected = torch.tensor([point(-1.75, -0.5), point(2.2, 0.6)])
    tok = load_tokenizer(str(tmp_path / "tokenizer_codebook.pt"))
    assert isinstance(tok, PatchTokenizer) and tok.patch_size == P
    torch.testing.assert_close(tok.codebook, expected, rtol=0, atol=1e-6)
    first_step = from_shareable(sent[1].data).data["codebook"]  # the k-means++ seeds, broadcast in step 0
    np.testing.assert_allclose(first_step, np.array([point(-2, -1), point(1.5, 0)]), rtol=0, atol=1e-6)
    assert ctrl.history[1]["mean_sq_distance"] == pytest.approx(9.75 / 9)
    assert [h["vectors"] for h in ctrl.history] == [9, 9] and ctrl.history[1]["mean_centroid_shift"] == 0.0
    # the exchanges: one init, n_iters steps, the codebook sent once; never an image, only codebooks go down
    assert [t.name for t in sent] == [KMEANS_INIT, KMEANS_STEP, KMEANS_STEP, SET_TOKENIZER]
    first = from_shareable(sent[0].data)
    assert first.data == {} and first.get_meta_prop("min_cluster_size") == 2
    final = from_shareable(sent[-1].data)
    np.testing.assert_allclose(final.data["codebook"], expected.numpy(), rtol=0, atol=1e-6)
    assert final.get_meta_prop("patch_size") == P
    # the run summary learns which tokenizer was used
    (event, record), = events
    assert event == SUMMARY_RECORD_EVENT and record["tokenizer"] == "federated k-means K=2, iters=2"
    details = record["tokenizer_details"]
    assert (details["sites"] == sorted(HAND_SITES) and len(details["iterations"]) == 2
            and details["min_cluster_size"] == 2)
    assert codebook_description(str(tmp_path / "tokenizer_codebook.pt")) == record["tokenizer"]


def test_small_clusters_are_withheld_and_counted(tmp_path):
    """With m = 12 some of the sites' clusters (about 10-20 vectors each) stay home: the server logs how many
    vectors were withheld, and every statistic it received covers >= 12 vectors."""
    seen = []
    ctrl, _, _ = controller(tmp_path, min_cluster_size=12, init="random",
                            tamper=lambda site, name, dxo: seen.append(dxo.data.get("counts")))
    run(ctrl, tmp_path)
    counts = np.concatenate([c for c in seen if c is not None])
    assert counts.size == 3 * 3 * K and counts.max() >= 12 and set(np.unique(counts[counts < 12])) == {0}
    assert all(h["withheld_vectors"] > 0 for h in ctrl.history)


def test_random_init_is_data_free_and_each_step_is_the_count_weighted_mean_of_the_replies(tmp_path):
    """init="random": the sites send only their patch size; every later codebook is, row by row, the sum of the
    sites' sums over the sum of their counts (computed here by explicit loops), a row no site reports unchanged."""
    replies = []
    ctrl, sent, _ = controller(tmp_path, init="random",
                               tamper=lambda site, name, dxo: replies.append((name, dxo.data)) and None)
    run(ctrl, tmp_path)
    assert from_shareable(sent[0].data).get_meta_prop("init") == "random"
    assert [data for name, data in replies if name == KMEANS_INIT] == [{}] * 3  # data-free: no centroid leaves
    steps = [data for name, data in replies if name == KMEANS_STEP]
    codebooks = [from_shareable(t.data).data["codebook"] for t in sent[1:]]  # steps 0..2, then the final one
    for it in range(3):
        old, new = codebooks[it], codebooks[it + 1]
        for k in range(K):
            total = sum(float(r["counts"][k]) for r in steps[3 * it: 3 * it + 3])
            expected = (old[k] if total == 0 else sum(r["sums"][k].astype(np.float64)
                                                      for r in steps[3 * it: 3 * it + 3]) / total)
            np.testing.assert_allclose(new[k], expected, rtol=1e-5, atol=1e-6)


def test_too_few_sites_stops_the_job_with_a_clear_error(tmp_path):
    def failed(site, name, dxo):
        return make_reply(ReturnCode.EXECUTION_EXCEPTION) if site == "site-2" else None

    ctrl, _, _ = controller(tmp_path, tamper=failed, min_clients=3)
    with pytest.raises(KMeansError, match=r"kmeans_init: only 2 of the required 3 sites"):
        run(ctrl, tmp_path)


def test_more_tokens_than_pooled_centroids_is_an_error(tmp_path):
    """One site of 60 vectors in 6 local clusters: fewer than 6 of them hold >= 15 vectors."""
    ctrl, _, _ = controller(tmp_path, sites={"site-1": SITES["site-1"]}, min_clients=1, min_cluster_size=15)
    with pytest.raises(KMeansError, match=r"gave [0-5] centroids of >= 15 vectors in all, fewer than vocab_size K=6"):
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
    ({"local_iters": 0}, "local_iters=0 is invalid; use at least one local Lloyd step"),
    ({"min_cluster_size": 1}, "min_cluster_size=1 is invalid; use an integer >= 2"),
    ({"min_cluster_size": 2.5}, "min_cluster_size=2.5"),
    ({"image_size": 30, "patch_size": 4}, "image_size=30"),
    ({"patch_size": 0}, "patch_size=0"),
])
def test_bad_args_name_the_argument(kw, needle):
    with pytest.raises(ValueError, match="FederatedKMeans: argument " + needle.replace("(", r"\(").replace(".", r"\.")):
        FederatedKMeans(**kw)


def test_m_step_weights_each_site_by_its_counts_by_hand():
    """Centroid 0: site 1 sends sum (2, 4) of 2 vectors, site 2 sum (4, 4) of 1 -> (6, 8) / 3; centroid 1 has no
    vector anywhere and keeps (5, 5); centroid 2: (8, 0) / 4 = (2, 0).  (Averaging the sites' means instead would
    give (2.5, 3) for centroid 0.)"""
    codebook = torch.tensor([[0.0, 0.0], [5.0, 5.0], [9.0, 9.0]])
    site_1 = (torch.tensor([[2.0, 4.0], [0.0, 0.0], [0.0, 0.0]]), torch.tensor([2, 0, 0]))
    site_2 = (torch.tensor([[4.0, 4.0], [0.0, 0.0], [8.0, 0.0]]), torch.tensor([1, 0, 4]))
    new = kmeans_update(codebook, [site_1, site_2])
    torch.testing.assert_close(new, torch.tensor([[2.0, 8 / 3], [5.0, 5.0], [2.0, 0.0]]), rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------- a malicious site
def _vector_key(data):
    return "centroids" if "centroids" in data else "sums"


def _edit(fn, tasks=(KMEANS_INIT, KMEANS_STEP)):
    """A forgery of site-2's k-means statistics in ``tasks``: ``fn(data, meta)`` edits copies in place."""
    def tamper(site, name, dxo):
        if site != "site-2" or name not in tasks:
            return None
        data = {k: np.array(v, copy=True) for k, v in dxo.data.items()}
        meta = dict(dxo.meta)
        fn(data, meta)
        return DXO(DataKind.COLLECTION, data=data, meta=meta)
    return tamper


def _overflow(data, meta):
    key = _vector_key(data)
    data[key] = data[key].astype(np.float64)
    data[key][int(np.argmax(data["counts"])), 0] = 1e300  # finite in float64, inf in the codebook's float32


def _inflate_counts(data, meta):  # consistent sums, but more vectors than the site has
    data["counts"] = data["counts"] * 10 ** 6
    if "sums" in data:
        data["sums"] = data["sums"] * 10 ** 6


def _inflate_sample(data, meta):  # declares a sample far beyond images_per_site to take the average
    _inflate_counts(data, meta)
    meta["n_vectors"] = meta["n_vectors"] * 10 ** 6


def _beyond_norm(data, meta):
    key = _vector_key(data)
    data[key] = data[key] * 1e3


def _singleton(data, meta):  # a cluster of one: a raw patch vector
    data["counts"][int(np.argmin(data["counts"]))] = 1


def _set(where, key, value):
    def fn(data, meta):
        (data if where == "data" else meta)[key] = value(data, meta) if callable(value) else value
    return fn


def _complex(data, meta):
    key = _vector_key(data)
    data[key] = data[key] * 1j


ATTACKS = {
    "float64 1e300": (_overflow, "non-finite values"),
    "counts x 1e6": (_inflate_counts, "add up to"),
    "n_vectors x 1e6": (_inflate_sample, "n_vectors in kmeans_init=60000000; it must lie in [1, 100]"),
    "sums beyond the norm bound": (_beyond_norm, "patch vectors have norm < sqrt(D - 1)"),
    "a cluster of 1": (_singleton, "a cluster of 1 patch vectors in kmeans_init, fewer than min_cluster_size=3"),
    "float counts": (_set("data", "counts", lambda d, m: d["counts"] + 0.5), "expected integers"),
    "bool counts": (_set("data", "counts", lambda d, m: d["counts"] > 0), "expected integers"),
    "complex vectors": (_complex, "expected real numbers"),
    "no counts": (_set("data", "counts", None), "expected integers"),
    "wrong shape": (_set("data", "counts", lambda d, m: d["counts"][:-1]), "shape (5,), expected (6,)"),
    "string n_vectors": (_set("meta", "n_vectors", "60"), "n_vectors in kmeans_init='60'; a real number"),
    "fractional n_vectors": (_set("meta", "n_vectors", 60.5), "a whole number is required"),
}
INIT_ONLY = {  # meta that only kmeans_init replies carry
    "array patch_size": (_set("meta", "patch_size", np.arange(3)), "reports patch_size=array"),
    "array local_tokenizer": (_set("meta", LOCAL_TOKENIZER_KEY, np.arange(3)), "a description string is required"),
}


def _reference(tmp_path, tamper):
    """The same run with site-2 absent from exactly the exchanges ``tamper`` forges (a failed site)."""
    def absent(site, name, dxo):
        return make_reply(ReturnCode.EXECUTION_EXCEPTION) if tamper(site, name, dxo) is not None else None
    ctrl, _, _ = controller(tmp_path, tamper=absent)
    run(ctrl, tmp_path)
    return codebook(tmp_path), ctrl.history


@pytest.mark.parametrize("attack", list(ATTACKS) + list(INIT_ONLY))
def test_a_forged_contribution_is_refused_naming_the_site_and_the_honest_sites_finish(attack, tmp_path, caplog):
    fn, needle = ATTACKS.get(attack) or INIT_ONLY[attack]
    tamper = _edit(fn) if attack in ATTACKS else _edit(fn, tasks=(KMEANS_INIT,))
    ctrl, _, _ = controller(tmp_path / "attacked", tamper=tamper)
    run(ctrl, tmp_path / "attacked")
    rejected = [r.getMessage() for r in caplog.records if "REJECTED k-means contribution: site-2" in r.getMessage()]
    assert rejected and needle in rejected[0], (needle, rejected)
    assert not any("REJECTED" in r.getMessage() and "site-2" not in r.getMessage() for r in caplog.records)
    attacked = codebook(tmp_path / "attacked")
    expected, history = _reference(tmp_path / "honest", tamper)
    assert torch.isfinite(attacked).all() and torch.equal(attacked, expected)  # bit for bit the honest sites' result
    assert [h["sites"] for h in ctrl.history] == [h["sites"] for h in history]


@pytest.mark.parametrize("meta, needle", [
    ({ITER_KEY: 7}, "site-2 answered k-means iteration 7 during 0"),
    ({ITER_KEY: "0"}, "site-2 answered k-means iteration '0' during 0"),
    ({"sse": "low"}, "site-2 sent sse in kmeans_step 0='low'; a real number is required"),
    ({"sse": 1e30}, "a finite number of magnitude <="),
    ({"sse": -1.0}, "site-2 sent sse=-1.0 in kmeans_step 0; a cost is >= 0"),
    ({"n_vectors": 59}, "site-2 sent n_vectors=59 in kmeans_step 0 after declaring 60"),
])
def test_a_forged_step_meta_value_is_refused(meta, needle, tmp_path, caplog):
    def tamper(site, name, dxo):
        if site == "site-2" and name == KMEANS_STEP:
            return DXO(DataKind.COLLECTION, data=dxo.data, meta={**dxo.meta, **meta})
        return None
    ctrl, _, _ = controller(tmp_path / "attacked", tamper=tamper)
    run(ctrl, tmp_path / "attacked")
    assert needle in caplog.text
    expected, _ = _reference(tmp_path / "honest", tamper)
    assert torch.equal(codebook(tmp_path / "attacked"), expected)
    assert [h["sites"] for h in ctrl.history] == [2, 2, 2]


@pytest.mark.parametrize("reply, needle", [
    (lambda: DXO(DataKind.APP_DEFINED, data=[1, 2]), "site-2 sent kmeans_step data of type list, not a dict"),
    (lambda: make_reply(np.arange(2)), "site-2 returned array([0, 1]) for kmeans_step; left out"),
])
def test_a_malformed_reply_is_left_out_without_ending_the_run(reply, needle, tmp_path, caplog):
    def tamper(site, name, dxo):
        return reply() if site == "site-2" and name == KMEANS_STEP else None

    ctrl, _, _ = controller(tmp_path, tamper=tamper)
    run(ctrl, tmp_path)
    assert needle in caplog.text and [h["sites"] for h in ctrl.history] == [2, 2, 2]


def test_a_contribution_from_a_name_that_is_not_a_client_of_the_run_is_refused(tmp_path, caplog):
    ctrl, _, _ = controller(tmp_path / "a", intruder="site-9")
    run(ctrl, tmp_path / "a")
    assert "REJECTED k-means contribution: 'site-9' is not a client of this run" in caplog.text
    assert all(h["sites"] == 3 for h in ctrl.history)
    honest, _, _ = controller(tmp_path / "b")
    run(honest, tmp_path / "b")
    assert torch.equal(codebook(tmp_path / "a"), codebook(tmp_path / "b"))
