"""fedssl.eval.retrieval: ranks, recall, matched cosine and client summaries against hand-computed values."""

import math

import numpy as np
import pytest
import torch

from fedssl.eval.retrieval import chance_recall, client_summary, key_recall_ceiling, matched_cosine, \
    text_to_image_recall, worst_client_floor

# images on the four axes; texts hand-placed (unnormalised on purpose)
IMG = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]], dtype=torch.float64)
TXT = torch.tensor([
    [1.0, 0.1],   # own i0 first                                  -> rank 0 (whole), 0 (batch {0,1})
    [1.0, 0.5],   # i0 beats own i1                               -> rank 1 (whole), 1 (batch {0,1})
    [0.1, -1.0],  # i3 and i0 beat own i2                         -> rank 2 (whole), 1 (batch {2,3}: only i3)
    [2.0, -2.0],  # own i3 ties i0 (cos 0.7071): counts against   -> rank 1 (whole), 0 (batch {2,3})
], dtype=torch.float64)


def test_whole_split_recall_by_hand():
    # ranks [0, 1, 2, 1]
    r = text_to_image_recall(IMG, TXT, ks=(1, 2, 3, 5))
    assert r == {"R@1": 0.25, "R@2": 0.75, "R@3": 1.0, "R@5": 1.0}


def test_batches_of_two_differ_from_whole_split():
    # batches {0,1}, {2,3}: ranks [0, 1, 1, 0]
    assert text_to_image_recall(IMG, TXT, ks=(1, 2), batch_size=2) == {"R@1": 0.5, "R@2": 1.0}
    assert text_to_image_recall(IMG, TXT, ks=(1, 5), batch_size=2)["R@1"] != text_to_image_recall(IMG, TXT)["R@1"]


def test_final_partial_batch_ranked_within_itself_or_dropped():
    # batches {0,1,2}, {3}: ranks [0, 1, 1] and text 3 alone -> a hit at any k
    assert text_to_image_recall(IMG, TXT, ks=(1,), batch_size=3) == {"R@1": 0.5}
    assert text_to_image_recall(IMG, TXT, ks=(1,), batch_size=3, drop_last=True) == {"R@1": pytest.approx(1 / 3)}
    # batch_size >= N is the whole split
    assert text_to_image_recall(IMG, TXT, ks=(1, 2), batch_size=4) == text_to_image_recall(IMG, TXT, ks=(1, 2))
    assert text_to_image_recall(IMG, TXT, ks=(1, 2), batch_size=9) == text_to_image_recall(IMG, TXT, ks=(1, 2))


def test_constant_embedding_cannot_score_ties_are_pessimistic():
    z = torch.ones(6, 3)
    r = text_to_image_recall(z, z, ks=(1, 5, 6))
    assert r == {"R@1": 0.0, "R@5": 0.0, "R@6": 1.0}  # every image ties: rank N - 1 = 5, a hit only when k >= N
    assert text_to_image_recall(z, z, ks=(1, 2), batch_size=2) == {"R@1": 0.0, "R@2": 1.0}  # gallery of 2 <= k


def test_scale_invariant_and_perfect_alignment():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(10, 4, generator=g)
    assert text_to_image_recall(z, 3.0 * z, ks=(1,)) == {"R@1": 1.0}
    assert text_to_image_recall(np.asarray(IMG) * 7.0, TXT, ks=(1,)) == {"R@1": 0.25}  # numpy accepted


def test_matched_cosine_by_hand():
    # cos(t_i, v_j) with unit t: t0=(1,.1)/|.|, t1=(1,.5)/|.|, t2=(.1,-1)/|.|, t3=(1,-1)/sqrt2
    a, b, c = 1 / math.sqrt(1.01), 1 / math.sqrt(1.25), 1 / math.sqrt(2)
    cos = np.array([
        [a, 0.1 * a, -a, -0.1 * a],
        [b, 0.5 * b, -b, -0.5 * b],
        [0.1 * a, -a, -0.1 * a, a],
        [c, -c, -c, c],
    ])
    out = matched_cosine(IMG, TXT)
    matched = np.trace(cos) / 4
    unmatched = (cos.sum() - np.trace(cos)) / 12
    assert out["matched"] == pytest.approx(matched, abs=1e-12)
    assert out["unmatched"] == pytest.approx(unmatched, abs=1e-12)
    assert out["gap"] == pytest.approx(matched - unmatched, abs=1e-12)
    # numbers written out: matched = (a + .5b - .1a + c) / 4
    assert out["matched"] == pytest.approx((0.9 * a + 0.5 * b + c) / 4, abs=1e-12)


def test_matched_cosine_aligned_pairs():
    z = torch.eye(3)
    assert matched_cosine(z, 2 * z) == {"matched": 1.0, "unmatched": 0.0, "gap": 1.0}


def test_client_summary_by_hand():
    per = {"b": {"R@1": 0.3, "R@5": 0.7}, "a": {"R@1": 0.1, "R@5": 0.8}, "c": {"R@1": 0.5, "R@5": 0.6}}
    s = client_summary(per)
    assert s["avg_R@1"] == pytest.approx(0.3) and s["avg_R@5"] == pytest.approx(0.7)
    assert s["worst_R@1"] == 0.1 and s["worst_R@5"] == 0.6
    assert s["worst_client_R@1"] == "a" and s["worst_client_R@5"] == "c"
    assert s["n_clients"] == 3
    anon = client_summary(per, anonymous=True)
    assert not any(k.startswith("worst_client") for k in anon) and anon["worst_R@1"] == 0.1


@pytest.mark.parametrize("call, arg", [
    (lambda: text_to_image_recall(IMG, TXT[:3]), "z_txt"),
    (lambda: text_to_image_recall(IMG[0], TXT[0]), "z_img"),
    (lambda: text_to_image_recall(IMG, TXT * float("nan")), "z_txt"),
    (lambda: text_to_image_recall(IMG * 0, TXT), "z_img"),
    (lambda: text_to_image_recall(IMG, TXT, ks=(0,)), "ks"),
    (lambda: text_to_image_recall(IMG, TXT, ks=(1, 1)), "ks"),
    (lambda: text_to_image_recall(IMG, TXT, batch_size=-1), "batch_size"),
    (lambda: text_to_image_recall(IMG, TXT, batch_size=5, drop_last=True), "batch_size"),
    (lambda: matched_cosine(IMG[:1], TXT[:1]), "z_img"),
    (lambda: client_summary({}), "per_client"),
    (lambda: client_summary({"a": {"R@1": 0.1}}), "per_client"),
    (lambda: client_summary({"a": {"R@1": float("nan"), "R@5": 0.2}}), "per_client"),
])
def test_argument_errors_name_the_argument(call, arg):
    with pytest.raises(ValueError, match=f"argument {arg}="):
        call()


def test_the_worst_client_floor_by_hand():
    """Two clients of 2 pairs each at recall 1/2: each scores 0, 1/2, 1 with 1/4, 1/2, 1/4; the lower of the two is
    >= 1/2 with (3/4)^2 and 1 with (1/4)^2, so E[min] = 1/2 * 9/16 + 1/2 * 1/16 = 5/16 and the floor 1/2 - 5/16."""
    assert worst_client_floor(0.5, [2, 2]) == pytest.approx(3 / 16, abs=1e-12)
    assert worst_client_floor(0.5, [1, 1]) == pytest.approx(1 / 4, abs=1e-12)  # min is 1 only when both hit
    # sizes 1 and 2: min = 0 unless the first hits (1/2), then the second's mean 1/2: E[min] = 1/4
    assert worst_client_floor(0.5, [1, 2]) == pytest.approx(1 / 4, abs=1e-12)
    assert worst_client_floor(0.3, [7]) == pytest.approx(0.0, abs=1e-12)  # one client is its own mean
    assert worst_client_floor(0.0, [3, 4]) == 0.0 and worst_client_floor(1.0, [3, 4]) == pytest.approx(0.0)
    # FedDRA's bench clients (51-63 test pairs): about 3 points at R@1 = 5 %, 6 at R@5 = 23 %; 1,000 pairs: 1.7
    assert worst_client_floor(0.052, [51, 55, 57, 60, 63]) == pytest.approx(0.0317, abs=5e-4)
    assert worst_client_floor(0.288, [1000] * 5) == pytest.approx(0.0166, abs=5e-4)


@pytest.mark.parametrize("recall, sizes, word", [(1.5, [3], "recall"), (float("nan"), [3], "recall"),
                                                 (0.5, [], "sizes"), (0.5, [3, 0], "sizes"), (0.5, [2.5], "sizes"),
                                                 (0.5, [150_000, 150_000], "sizes")])
def test_the_worst_client_floor_refuses_what_it_cannot_compute(recall, sizes, word):
    with pytest.raises(ValueError, match=word):
        worst_client_floor(recall, sizes)


def test_chance_recall_by_hand():
    """min(k, b) hits per batch of b: 338 pairs in batches of 100 are 100, 100, 100, 38."""
    assert chance_recall(338, 1, 100) == pytest.approx(4 / 338)
    assert chance_recall(338, 5, 100) == pytest.approx(20 / 338)
    assert chance_recall(338, 1, 100, drop_last=True) == pytest.approx(3 / 300)
    assert chance_recall(10, 1) == pytest.approx(1 / 10)  # the whole split is one gallery
    assert chance_recall(3, 5, 2) == 1.0  # galleries of 2 and 1: every own image is within the top 5
    # what random embeddings score, on average: 200 draws of 40 pairs in batches of 10 -> near 1/10 at R@1
    g = torch.Generator().manual_seed(0)
    got = np.mean([text_to_image_recall(torch.randn(40, 8, generator=g), torch.randn(40, 8, generator=g), ks=(1,),
                                        batch_size=10)["R@1"] for _ in range(200)])
    assert got == pytest.approx(chance_recall(40, 1, 10), abs=0.02)


@pytest.mark.parametrize("args, word", [((0, 1), "n_pairs"), ((5, 0), "k"), ((5, 1, -1), "batch_size"),
                                        ((5, 1, 10, True), "batch_size")])
def test_chance_recall_refuses_what_it_cannot_compute(args, word):
    n, k, *rest = args
    kw = {"batch_size": rest[0]} if rest else {}
    if len(rest) > 1:
        kw["drop_last"] = rest[1]
    with pytest.raises(ValueError, match=word):
        chance_recall(n, k, **kw)


def test_key_recall_ceiling_by_hand():
    assert key_recall_ceiling("aabc", 1) == pytest.approx(3 / 4)  # a: 1/2 each, b and c: 1
    assert key_recall_ceiling("aabc", 5) == 1.0
    assert key_recall_ceiling("abab", 1) == pytest.approx(1 / 2)  # one gallery: each key twice
    assert key_recall_ceiling("abab", 1, batch_size=2) == 1.0  # galleries "ab", "ab": every key once
    assert key_recall_ceiling("aaa", 2) == pytest.approx(2 / 3)
    assert key_recall_ceiling("aab", 1, batch_size=2) == pytest.approx((1 / 2 + 1 / 2 + 1) / 3)
    assert key_recall_ceiling("aab", 1, batch_size=2, drop_last=True) == pytest.approx(1 / 2)
    # one key for all: the chance level, in the protocol's batches
    for n, k in ((338, 1), (338, 5), (57, 5)):
        assert key_recall_ceiling([()] * n, k, batch_size=100) == pytest.approx(chance_recall(n, k, batch_size=100))


def test_key_recall_ceiling_bounds_an_encoder_that_sees_only_the_key():
    """Embeddings that carry the key and noise the pairing cannot see reach the ceiling on average, not above."""
    keys = [i % 3 for i in range(12)] + [7, 8]
    basis = torch.eye(10, dtype=torch.float64)
    rng = np.random.default_rng(0)
    got = []
    for _ in range(200):
        img = basis[keys] + 1e-3 * torch.from_numpy(rng.standard_normal((len(keys), 10)))
        txt = basis[keys] + 1e-3 * torch.from_numpy(rng.standard_normal((len(keys), 10)))
        got.append(text_to_image_recall(img, txt, ks=(1,))["R@1"])
    expected = key_recall_ceiling(keys, 1)  # 12 texts at 1/4, 2 at 1
    assert expected == pytest.approx((12 / 4 + 2) / 14)
    assert float(np.mean(got)) == pytest.approx(expected, abs=0.03)


@pytest.mark.parametrize("args, word", [(([], 1), "keys"), (("ab", 0), "k"), (("ab", 1, -1), "batch_size")])
def test_key_recall_ceiling_refuses_what_it_cannot_compute(args, word):
    with pytest.raises(ValueError, match=word):
        key_recall_ceiling(*args)
