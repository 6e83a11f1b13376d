"""In-domain image-text retrieval and image-text embedding similarity of a vision-language model (FedDRA).

FedDRA: Z. Shuai, C. Wu, Z. Tang, L. Shen, "Distributionally Robust Alignment for Medical Federated Vision-Language
Pre-training Under Data Heterogeneity", TMLR.  Sec. 5.1 (3) and appendix A.1.2 "Image retrieval": on the validation
splits of the clients, "For each text in a batch of image-text pairs, we calculate similarities with images in the
batch, then rank these similarities and retrieve the top-1 and top-5 images.  If the corresponding image of the
text is in the selected set, it is correctly retrieved."  Tables 2-3 report the recall averaged over clients
(Rec.@k) and the worst client's (Wst.@k): :func:`client_summary`.

- :func:`text_to_image_recall`: R@k of text -> image retrieval by cosine similarity, over the whole split
  (``batch_size=0``) or within consecutive batches of ``batch_size`` pairs (the paper's protocol).
- :func:`worst_client_floor`: the mean-minus-worst gap clients that are all alike would show from the size of their
  test sets alone, the yardstick for a measured worst-client gap (H6 of issue 44).
- :func:`key_recall_ceiling`: the recall of a retriever that tells pairs apart only by a discrete key each image
  shares with its text: a ceiling for a client whose pairs share nothing else (H6 of issue 44).
- :func:`matched_cosine`: mean cosine of the matched pairs, of the unmatched pairs, and their gap (the image-text
  embedding similarity of the paper's Fig. 4(d-f)).

Ranking rule (both modes): the rank of text ``i`` is the number of *other* images ``j`` in its gallery (the split or
its batch) with ``cos(t_i, v_j) >= cos(t_i, v_i) - TIE_TOL``; a hit at k when that rank is < k.  Ties count against
the hit (pessimistic), so an encoder that maps everything to one vector scores R@k = 0 whenever its gallery holds
more than k images.  A gallery of B <= k images always contains the text's own image among its "top k" (k is in
effect clipped to the gallery size), so such texts are hits: this is what the paper's protocol gives for a final
batch smaller than k; pass ``drop_last=True`` to leave a final partial batch out instead.

Similarities are computed in float64; the embeddings may be unnormalised (each row is L2-normalised first; a zero
row has no direction and is an error).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from fractions import Fraction

import numpy as np
import torch

from fedssl.core.checks import require, require_int

__all__ = ["TIE_TOL", "text_to_image_recall", "chance_recall", "key_recall_ceiling", "matched_cosine",
           "client_summary", "worst_client_floor"]

#: cosines closer than this to the matched pair's count as ties (against the hit): float noise is not a win
TIE_TOL = 1e-9
#: :func:`worst_client_floor` walks every attainable proportion: at most this many test pairs over all clients
MAX_FLOOR_PAIRS = 200_000
_CHUNK = 1024  # texts ranked at once (keeps the similarity block at most 1024 x gallery)


def _unit_pairs(component: str, z_img, z_txt) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate (N, D) matched embeddings and return them L2-normalised, float64, on the CPU."""
    img = torch.as_tensor(z_img).detach().to("cpu", torch.float64)
    txt = torch.as_tensor(z_txt).detach().to("cpu", torch.float64)
    require(img.dim() == 2 and img.shape[0] >= 1 and img.shape[1] >= 1, component, "z_img", tuple(img.shape),
            "pass image embeddings of shape (N, D), one row per image-text pair")
    require(txt.shape == img.shape, component, "z_txt", tuple(txt.shape),
            f"pass text embeddings of the image embeddings' shape {tuple(img.shape)}: row i of both is pair i")
    for name, z in (("z_img", img), ("z_txt", txt)):
        require(bool(torch.isfinite(z).all()), component, name, "non-finite values",
                "the embeddings contain NaN/Inf; check the encoder's output")
        norms = z.norm(dim=1)
        zero = torch.nonzero(norms == 0).flatten().tolist()
        require(not zero, component, name, f"zero rows {zero[:5]}",
                "a zero embedding has no cosine similarity; check the encoder's output for those rows")
    return img / img.norm(dim=1, keepdim=True), txt / txt.norm(dim=1, keepdim=True)


def _check_ks(component: str, ks) -> tuple[int, ...]:
    ks = tuple(ks)
    require(len(ks) > 0 and len(set(ks)) == len(ks), component, "ks", ks, "pass distinct positive ints, e.g. (1, 5)")
    for k in ks:
        require_int(component, "ks", k, 1, "every k must be a positive int, e.g. ks=(1, 5)")
    return ks


def _ranks(img: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
    """Pessimistic rank (0 = first) of each text's own image among the gallery ``img`` (row i matches text i)."""
    out = []
    for s in range(0, txt.shape[0], _CHUNK):
        sims = txt[s:s + _CHUNK] @ img.T  # (c, G)
        rows = torch.arange(sims.shape[0])
        own = sims[rows, rows + s]
        ahead = sims >= (own - TIE_TOL)[:, None]  # includes the own image itself
        out.append(ahead.sum(dim=1) - 1)
    return torch.cat(out)


def text_to_image_recall(z_img, z_txt, ks: Sequence[int] = (1, 5), batch_size: int = 0, *,
                         drop_last: bool = False) -> dict[str, float]:
    """Text -> image recall at each k: the fraction of texts whose own image is among the k images most
    cosine-similar to it.  ``{"R@1": ..., "R@5": ...}``, fractions in [0, 1].

    ``batch_size=0``: every text is ranked against all N images of the split.  ``batch_size=B > 0`` (the paper's
    protocol): the pairs are cut, in the given order, into consecutive batches of B, and each text is ranked
    against the images of its own batch only; the final partial batch (N mod B pairs) is ranked within itself, or
    left out with ``drop_last=True``.  Ties and galleries smaller than k: see the module docstring."""
    component = "text_to_image_recall"
    img, txt = _unit_pairs(component, z_img, z_txt)
    ks = _check_ks(component, ks)
    require_int(component, "batch_size", batch_size, 0,
                "use 0 to rank over the whole split or a positive batch size (the paper ranks within batches)")
    n = img.shape[0]
    size = batch_size or n
    stops = [s for s in range(0, n, size) if not (drop_last and batch_size and s + size > n)]
    require(bool(stops), component, "batch_size", batch_size,
            f"with drop_last=True a batch size above the {n} pairs leaves nothing to rank; lower it or keep the "
            "last batch")
    ranks = torch.cat([_ranks(img[s:s + size], txt[s:s + size]) for s in stops])
    return {f"R@{k}": float((ranks < k).double().mean()) for k in ks}


def chance_recall(n_pairs: int, k: int, batch_size: int = 0, *, drop_last: bool = False) -> float:
    """The recall at ``k`` that :func:`text_to_image_recall` gives, in expectation, to embeddings that carry nothing
    about the pairing (each text's own image equally likely at every rank of its gallery): its loss-at-chance
    level.  A batch of ``b`` pairs then holds ``min(k, b)`` hits on average, so with batches of 100 it is 1 % at
    R@1 and 5 % at R@5, and more for a short last batch (338 pairs: 4 / 338 at R@1).  A client whose measured
    recall sits at this level has learned nothing its test pairs can show, whatever its weight."""
    component = "chance_recall"
    require_int(component, "n_pairs", n_pairs, 1, "give the number of test pairs ranked (at least 1)")
    require_int(component, "k", k, 1, "use a rank cut-off k >= 1, e.g. 1 or 5")
    require_int(component, "batch_size", batch_size, 0,
                "use 0 to rank over the whole split or a positive batch size (the paper ranks within batches)")
    size = batch_size or n_pairs
    batches = [min(size, n_pairs - s) for s in range(0, n_pairs, size)]
    if drop_last and batch_size:
        batches = [b for b in batches if b == size]
    require(bool(batches), component, "batch_size", batch_size,
            f"with drop_last=True a batch size above the {n_pairs} pairs leaves nothing to rank")
    return sum(min(k, b) for b in batches) / sum(batches)


def key_recall_ceiling(keys: Sequence[Hashable], k: int, batch_size: int = 0, *, drop_last: bool = False) -> float:
    """The expected recall at ``k`` of a retriever that tells the pairs apart only by a discrete key each image
    shares with its text (``keys[i]`` of pair ``i``; ties broken at random), ranked as
    :func:`text_to_image_recall` ranks: a text whose key ``m`` images of its gallery carry (its own included) finds
    its image at a uniform rank among those ``m``, a hit with probability ``min(k, m) / m``.  When the key is all
    an image and its text share, no encoder can do better: e.g. keys ``a a b c`` in one gallery give R@1 3/4."""
    component = "key_recall_ceiling"
    keys = list(keys)
    require(bool(keys), component, "keys", keys, "give one key per test pair")
    require_int(component, "k", k, 1, "use a rank cut-off k >= 1, e.g. 1 or 5")
    require_int(component, "batch_size", batch_size, 0,
                "use 0 to rank over the whole split or a positive batch size (the paper ranks within batches)")
    size = batch_size or len(keys)
    galleries = [keys[s:s + size] for s in range(0, len(keys), size)]
    if drop_last and batch_size:
        galleries = [g for g in galleries if len(g) == size]
    require(bool(galleries), component, "batch_size", batch_size,
            f"with drop_last=True a batch size above the {len(keys)} pairs leaves nothing to rank")
    hits = Fraction(0)
    for g in galleries:
        count = Counter(g)
        hits += sum(Fraction(min(k, count[key]), count[key]) for key in g)
    return float(hits / sum(len(g) for g in galleries))


def matched_cosine(z_img, z_txt) -> dict[str, float]:
    """``{"matched", "unmatched", "gap"}``: the mean cosine of the N matched pairs (row i of both), the mean over the
    N (N - 1) unmatched pairs (text i, image j != i), and matched - unmatched (FedDRA Fig. 4(d-f): "the average
    cosine similarity between image and text embeddings").  Needs N >= 2.  O(N D): the sum over all pairs is
    ``(sum_i t_i) . (sum_j v_j)`` of the unit vectors."""
    component = "matched_cosine"
    img, txt = _unit_pairs(component, z_img, z_txt)
    n = img.shape[0]
    require(n >= 2, component, "z_img", tuple(img.shape), "pass at least 2 pairs: one pair has no unmatched pairs")
    diag = (img * txt).sum(dim=1).sum()
    total = txt.sum(dim=0) @ img.sum(dim=0)
    matched = float(diag / n)
    unmatched = float((total - diag) / (n * (n - 1)))
    return {"matched": matched, "unmatched": unmatched, "gap": matched - unmatched}


def client_summary(per_client: Mapping[str, Mapping[str, float]], keys: Sequence[str] = ("R@1", "R@5"), *,
                   anonymous: bool = False) -> dict:
    """Average over clients and the worst (lowest) client's value per key, as the paper's Rec.@k / Wst.@k:
    ``{"avg_R@1", "worst_R@1", ..., "n_clients"}``, plus ``"worst_client_R@1"`` ... (the worst client's name, the
    first in sorted name order on a tie) unless ``anonymous``.  Higher must be better for every key."""
    component = "client_summary"
    require(isinstance(per_client, Mapping) and len(per_client) > 0, component, "per_client", per_client,
            "pass a non-empty dict client -> {metric: value}, e.g. text_to_image_recall per client")
    keys = tuple(keys)
    require(len(keys) > 0, component, "keys", keys, "name at least one metric, e.g. ('R@1', 'R@5')")
    names = sorted(per_client, key=str)
    out: dict = {}
    for key in keys:
        values = []
        for name in names:
            metrics = per_client[name]
            require(key in metrics, component, "per_client", f"{name}: keys {sorted(metrics)}",
                    f"every client needs {key!r} (or drop it from keys)")
            value = float(metrics[key])
            require(math.isfinite(value), component, "per_client", f"{name}[{key!r}]={value}", "values must be finite")
            values.append(value)
        worst = int(np.argmin(values))
        out[f"avg_{key}"] = float(np.mean(values))
        out[f"worst_{key}"] = values[worst]
        if not anonymous:
            out[f"worst_client_{key}"] = names[worst]
    out["n_clients"] = len(names)
    return out


def worst_client_floor(recall: float, sizes: Sequence[int]) -> float:
    """The mean-minus-worst recall gap of clients that are all alike, from the size of their test sets alone.

    Each client's recall is taken as the proportion ``X_i / n_i`` of hits among its ``n_i = sizes[i]`` test texts,
    ``X_i ~ Binomial(n_i, recall)`` with the same true ``recall`` for every client (hits independent); returned is
    ``recall - E[min_i X_i / n_i]``, computed exactly over the grid of attainable proportions (no sampling).  A
    measured worst-client gap near this floor says the clients' test sets are too small to show any heterogeneity:
    with 5 clients of 51-63 pairs and R@1 = 5 % the floor is about 3 points."""
    component = "worst_client_floor"
    r = float(recall)
    require(math.isfinite(r) and 0.0 <= r <= 1.0, component, "recall", recall, "use a fraction in [0, 1]")
    sizes = list(sizes)
    require(len(sizes) > 0, component, "sizes", sizes, "give each client's number of test pairs")
    for n in sizes:
        require_int(component, "sizes", n, 1, "every client needs at least one test pair")
    require(sum(sizes) <= MAX_FLOOR_PAIRS, component, "sizes", f"{sum(sizes)} pairs in all",
            f"the exact grid is for at most {MAX_FLOOR_PAIRS:,} pairs; at that size the floor is near 0")
    grid = sorted({Fraction(k, n) for n in sizes for k in range(n + 1)})
    tails = [_binomial_tail(n, r) for n in sizes]  # tails[i][k] = P(X_i >= k)
    expected_min = 0.0
    for lo, hi in zip(grid, grid[1:]):  # min > s for s in [lo, hi) exactly when every X_i / n_i >= hi
        expected_min += float(hi - lo) * math.prod(t[math.ceil(hi * n)] for t, n in zip(tails, sizes))
    return r - expected_min


def _binomial_tail(n: int, p: float) -> list[float]:
    """``P(X >= k)`` for ``k = 0 .. n + 1`` of ``X ~ Binomial(n, p)``."""
    if p in (0.0, 1.0):
        pmf = [1.0 if (k == n if p == 1.0 else k == 0) else 0.0 for k in range(n + 1)]
    else:
        pmf = [math.exp(math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * math.log(p)
                        + (n - k) * math.log1p(-p)) for k in range(n + 1)]
    tail = [0.0] * (n + 2)
    for k in range(n, -1, -1):
        tail[k] = tail[k + 1] + pmf[k]
    return tail
