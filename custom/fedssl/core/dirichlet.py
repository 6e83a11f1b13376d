"""Seeded partitioners for image classification: Dirichlet label skew and real-site (SSL-FL (Yan et al., IEEE TMI
2023)), and IID random shards (FedMAE-KS (Wu et al.), section V-B).

:func:`dirichlet_split` has the semantics of SSL-FL's public splitter (``data/data_split.py``,
``non_iid_split_dirichlet``, itself the NIID-Bench "distribution-based label imbalance" splitter):

    repeat
        for each class k (in increasing label order):
            shuffle the indices of class k
            draw p ~ Dir_N(alpha)                                  (N = n_sites)
            p_j = 0 for every site j already holding >= len(labels) / N images   (capacity cap)
            renormalise p, split the class's indices at the cumulative proportions
    until the smallest site holds >= min_per_site images           (SSL-FL: min_require_size = 10)

alpha = 100 / 1.0 / 0.5 give SSL-FL's Split-1 (IID) / Split-2 (moderate) / Split-3 (severe non-IID).
Differences from the original, all deliberate: the random generator is ``np.random.default_rng(seed)``
instead of the global ``np.random.seed(2022)``; the number of redraws is bounded (``max_redraws``) and
an impossible ``min_per_site`` raises ``ValueError`` instead of looping forever; each site's index list
is returned sorted (the original shuffles it; order carries no information); if, for a tiny alpha, every
non-capped site's share underflows to exactly 0, the class goes to the non-capped sites in equal shares
(the original divides 0 by 0 and crashes).

:func:`real_site_split` groups records by their real source site (COVID-FL) and cuts the sources named in
``sub_sites`` into disjoint random sub-clients, as SSL-FL's released split does (``12_clients/split_real``:
RSNA cut into ``rsna-0`` .. ``rsna-4``, the other 7 sources whole: 8 real sites -> 12 clients).

:func:`iid_split` is FedMAE-KS's split: "We randomly split the training set into 10 partitions and each of
the 10 clients is assigned one partition" (section V-B): a seeded random permutation cut into near-equal
shards (sizes differ by at most one), independent of the labels.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

__all__ = ["dirichlet_split", "iid_split", "real_site_split", "class_counts", "MAX_REDRAWS", "SSLFL_COVIDFL_SUB_SITES"]

#: default bound on the number of full redraws before :func:`dirichlet_split` gives up
MAX_REDRAWS = 1000


def _check_labels(labels: Sequence[int]) -> np.ndarray:
    y = np.asarray(labels)
    if y.ndim != 1:
        raise ValueError(f"labels must be a 1-D sequence of integer class ids, got shape {y.shape}")
    if y.size and not np.issubdtype(y.dtype, np.integer):
        if not np.all(np.equal(np.mod(y, 1), 0)):
            raise ValueError("labels must be integer class ids (got non-integer values)")
        y = y.astype(np.int64)
    if y.size and y.min() < 0:
        raise ValueError(f"labels must be non-negative class ids, got {int(y.min())}")
    return y.astype(np.int64)


def dirichlet_split(
    labels: Sequence[int],
    n_sites: int,
    alpha: float,
    seed: int,
    min_per_site: int = 10,
    max_redraws: int = MAX_REDRAWS,
) -> list[list[int]]:
    """Split the indices ``0..len(labels)-1`` into ``n_sites`` disjoint lists with Dirichlet label skew.

    Args:
        labels: integer class id of every image.
        n_sites: number of sites N (SSL-FL: 5).
        alpha: Dirichlet concentration (> 0); smaller = more heterogeneous.
        seed: seed of ``np.random.default_rng``; the same arguments always give the same split.
        min_per_site: redraw until every site holds at least this many images (SSL-FL: 10).
        max_redraws: give up (``ValueError``) after this many full draws.

    Returns:
        ``n_sites`` sorted index lists; every index appears in exactly one of them.

    Raises:
        ValueError: bad arguments, ``n_sites * min_per_site > len(labels)``, or no draw met
            ``min_per_site`` within ``max_redraws`` attempts.
    """
    y = _check_labels(labels)
    if isinstance(n_sites, bool) or not isinstance(n_sites, (int, np.integer)) or n_sites < 1:
        raise ValueError(f"n_sites={n_sites!r}: must be a positive integer (SSL-FL uses 5)")
    if not (isinstance(alpha, (int, float, np.floating)) and np.isfinite(alpha) and alpha > 0):
        raise ValueError(f"alpha={alpha!r}: must be a finite number > 0 (SSL-FL: 100, 1.0, 0.5)")
    if isinstance(min_per_site, bool) or not isinstance(min_per_site, (int, np.integer)) or min_per_site < 0:
        raise ValueError(f"min_per_site={min_per_site!r}: must be an integer >= 0 (SSL-FL: 10)")
    if not isinstance(max_redraws, (int, np.integer)) or max_redraws < 1:
        raise ValueError(f"max_redraws={max_redraws!r}: must be a positive integer")
    n = int(y.size)
    if n_sites * min_per_site > n:
        raise ValueError(
            f"cannot give each of n_sites={n_sites} sites min_per_site={min_per_site} images: only {n} images "
            f"({n_sites} x {min_per_site} = {n_sites * min_per_site} > {n}); lower min_per_site or n_sites, "
            "or use more images"
        )
    rng = np.random.default_rng(seed)
    classes = np.unique(y)
    cap = n / n_sites
    min_size = -1
    for _ in range(int(max_redraws)):
        idx_batch: list[list[int]] = [[] for _ in range(n_sites)]
        for k in classes:
            idx_k = np.flatnonzero(y == k)
            rng.shuffle(idx_k)
            p = rng.dirichlet(np.full(n_sites, float(alpha)))
            open_sites = np.array([len(b) < cap for b in idx_batch])
            p = p * open_sites
            if p.sum() <= 0.0:  # every open site's share underflowed (tiny alpha): share equally
                p = open_sites.astype(float)
            p = p / p.sum()
            cuts = (np.cumsum(p) * len(idx_k)).astype(int)[:-1]
            idx_batch = [b + part.tolist() for b, part in zip(idx_batch, np.split(idx_k, cuts))]
        min_size = min(len(b) for b in idx_batch)
        if min_size >= min_per_site:
            return [sorted(int(i) for i in b) for b in idx_batch]
    raise ValueError(
        f"dirichlet_split: no draw in {max_redraws} attempts gave every one of the {n_sites} sites at least "
        f"min_per_site={min_per_site} images (alpha={alpha}, {n} images, last smallest site: {min_size}); "
        "lower min_per_site, raise alpha, use fewer sites or more images"
    )


def iid_split(n_items: int, n_sites: int, seed: int) -> list[list[int]]:
    """Split the indices ``0..n_items-1`` into ``n_sites`` random, disjoint, near-equal shards (FedMAE-KS, V-B).

    The shards take ``np.random.default_rng(seed).permutation(n_items)`` in consecutive chunks whose sizes differ
    by at most one (the first ``n_items % n_sites`` shards hold one more); labels play no part, so every shard's
    class mix is the global one up to sampling noise.

    Returns:
        ``n_sites`` sorted index lists; every index appears in exactly one of them.

    Raises:
        ValueError: ``n_sites`` not a positive integer, or fewer items than sites (a shard would be empty).
    """
    if isinstance(n_sites, bool) or not isinstance(n_sites, (int, np.integer)) or n_sites < 1:
        raise ValueError(f"n_sites={n_sites!r}: must be a positive integer (FedMAE-KS uses 10)")
    if isinstance(n_items, bool) or not isinstance(n_items, (int, np.integer)) or n_items < n_sites:
        raise ValueError(f"iid_split: n_items={n_items!r} cannot fill n_sites={n_sites} non-empty shards; "
                         "use fewer sites or more images")
    order = np.random.default_rng(seed).permutation(int(n_items))
    return [sorted(int(i) for i in chunk) for chunk in np.array_split(order, int(n_sites))]


#: SSL-FL's COVID-FL clients (``data/README.md`` of rui-yan/SSL-FL, ``12_clients/split_real``): RSNA in 5 parts
SSLFL_COVIDFL_SUB_SITES = {"rsna": 5}


def real_site_split(
    sources: Sequence[str], sub_sites: Mapping[str, int] | None = None, seed: int = 0
) -> list[tuple[str, list[int]]]:
    """Group record indices by their real source site (COVID-FL), in sorted source-name order.

    A source ``s`` named in ``sub_sites`` is cut into ``sub_sites[s]`` disjoint random parts of near-equal
    size, named ``s-0``, ``s-1``, ... as in SSL-FL's split files (``rsna-0`` .. ``rsna-4``); the other
    sources stay whole, under their own name.

    Returns:
        ``[(name, sorted indices), ...]``.

    Raises:
        ValueError: an empty source name, a ``sub_sites`` entry naming no source or not a positive integer,
            or a cut that would leave a sub-site empty.
    """
    src = [str(s) for s in sources]
    if any(not s for s in src):
        raise ValueError("real_site_split: every record needs a non-empty source site name")
    names = sorted(set(src))
    if not names:
        raise ValueError("real_site_split: no records")
    cuts = dict(sub_sites or {})
    for s, k in cuts.items():
        if s not in names:
            raise ValueError(f"real_site_split: sub_sites names {s!r}, which is not a source here "
                             f"({', '.join(names)}); "
                             "remove it or fix the name")
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"real_site_split: sub_sites[{s!r}]={k!r} must be a positive integer (SSL-FL: rsna 5)")
    groups = {s: [i for i, x in enumerate(src) if x == s] for s in names}
    rng = np.random.default_rng(seed)
    out: list[tuple[str, list[int]]] = []
    for s in names:
        k = int(cuts.get(s, 1))
        if k == 1:
            out.append((s, groups[s]))
            continue
        if len(groups[s]) < k:
            raise ValueError(f"real_site_split: cannot cut source {s!r} ({len(groups[s])} records) into {k} "
                             "non-empty sub-sites; lower sub_sites or add records")
        idx = np.array(groups[s])[rng.permutation(len(groups[s]))]
        for j, chunk in enumerate(np.array_split(idx, k)):
            out.append((f"{s}-{j}", sorted(int(i) for i in chunk)))
    return out


def class_counts(labels: Sequence[int], parts: Sequence[Sequence[int]], n_classes: int) -> np.ndarray:
    """``[len(parts), n_classes]`` matrix of per-part class counts."""
    y = _check_labels(labels)
    m = np.zeros((len(parts), n_classes), dtype=np.int64)
    for i, p in enumerate(parts):
        if len(p):
            m[i] = np.bincount(y[np.asarray(p, dtype=np.int64)], minlength=n_classes)[:n_classes]
    return m
