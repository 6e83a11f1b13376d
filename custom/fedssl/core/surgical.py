"""Surgical aggregation (surgical aggregation (Kulkarni et al., ML4H 2024), Kulkarni et al., ML4H 2024):
class-name-bound classifier heads.

Pure numpy/torch (no FLARE import); the FLARE aggregator and the per-site task-data filter call these.

Notation (paper section 2.1.1): site ``k`` declares an ordered list of its classes ``C_k``; the global
model predicts ``C`` (the union, in a stable order).  The classification head is the last fully
connected layer ``classifier`` with ``W [C, F]`` (PyTorch ``nn.Linear`` layout: one *row* per class; the
paper's column vector ``w_c`` is row ``c`` here) and bias ``b [C]``.

Head update (eq. 2-3): for every class ``c`` of ``C``, the global row and bias are the mean over only the
sites that hold ``c``; a class held by one site is copied from it.  The mean is *unweighted*, as in the
public code (``np.mean`` over the sites holding the class); a sample-count weighting is available by the
``weights`` argument.  A class held by no site of the round keeps its previous global row (``global_head``).
With identical class lists this is exactly FedAvg of the heads: the arithmetic below is the same as
:func:`fedssl.core.state_dict.weighted_average` (normalised weights, float64 sum in site order).

Backbone update (eq. 1, the "strategy"), as in the public code (``Strategies`` in ``src/federated.py``):

- ``"fedavg"``: every non-head tensor is averaged, batch-norm included.
- ``"fedbn"`` (Li et al., 2021): batch-norm tensors (affine weight/bias and running statistics) are never
  averaged; each site keeps its own, starting from the server's initial ones (round 0).  The server's global model keeps
  its previous (initial) BN tensors.
- ``"fedbn_plus"`` (FedBN+, Kulkarni et al., 2023): batch-norm layers are *frozen at the pre-trained
  (ImageNet) values* at every site: their affine weight/bias get no gradient and the layers run in
  inference mode (normalising with the pre-trained running mean/var, which are therefore never updated).
  BN is never averaged (the public code aggregates FedBN+ exactly like FedBN); the server's round-0
  broadcast carries the pre-trained BN tensors to every site once (``fedssl.flare.backbone_exclusion``), so
  with frozen layers they are identical at every site and on the server.  Everything else is averaged as in
  FedAvg.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Sequence

import numpy as np
import torch

from fedssl.core.state_dict import to_numpy, weighted_average

__all__ = [
    "STRATEGIES",
    "HEAD_WEIGHT",
    "HEAD_BIAS",
    "check_class_list",
    "union_classes",
    "class_index",
    "merge_heads",
    "slice_head",
    "slice_head_state",
    "is_head_key",
    "aggregated_keys",
    "local_keys",
    "frozen_keys",
    "surgical_merge",
]

#: Backbone strategies (public code: FedAvg, FedBN, FedBNplus).
STRATEGIES: tuple[str, ...] = ("fedavg", "fedbn", "fedbn_plus")
#: State-dict keys of the classification head (``torchvision`` DenseNet's ``classifier`` layer).
HEAD_WEIGHT = "classifier.weight"
HEAD_BIAS = "classifier.bias"


def _site(site: object) -> str:
    return str(site) if site not in (None, "") else "<unnamed site>"


def classes_to_meta(classes) -> np.ndarray:
    """Class lists travel in DXO meta as numpy string arrays (design rule: arrays, not lists)."""
    return np.asarray(list(classes), dtype=str)


def classes_from_meta(value, site: str = "?") -> list[str]:
    """The class list of a DXO meta value (``fedssl.flare.constants.CLASSES_KEY`` = "classes")."""
    if value is None:
        raise ValueError(f"{site} sent no class list (meta 'classes'); the site must run "
                         "fedssl.flare.multilabel_executor.MultiLabelExecutor")
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise ValueError(f"{site} sent a class list of shape {arr.shape}; expected a flat list of names")
    return [str(c) for c in arr.tolist()]


def check_class_list(classes: object, site: object = "?", allowed: Sequence[str] | None = None) -> list[str]:
    """Validate one site's ordered class list and return it as a list of names.

    Rejected (``ValueError`` naming the site): not a list/tuple, empty list, a name that is not a string,
    an empty or blank name, a name with leading/trailing blanks, duplicates, and, when ``allowed`` (the
    configured global class list) is given, a name outside it.
    """
    who = f"site {_site(site)}"
    if isinstance(classes, (str, bytes)) or not isinstance(classes, (list, tuple)):
        raise ValueError(f"{who}: class list {classes!r} must be a list of class names, e.g. "
                         "[\"Atelectasis\", \"Cardiomegaly\"]")
    if len(classes) == 0:
        raise ValueError(f"{who}: class list is empty; declare the site's classes in its order")
    for i, c in enumerate(classes):
        if not isinstance(c, str):
            raise ValueError(f"{who}: class #{i} {c!r} is a {type(c).__name__}, not a string name")
        if not c.strip():
            raise ValueError(f"{who}: class #{i} is an empty name")
        if c != c.strip():
            raise ValueError(f"{who}: class #{i} {c!r} has leading/trailing blanks; write {c.strip()!r}")
    seen: dict[str, int] = {}
    for i, c in enumerate(classes):
        if c in seen:
            raise ValueError(f"{who}: class {c!r} is listed twice (#{seen[c]} and #{i}); each class once")
        seen[c] = i
    if allowed is not None:
        allowed_set = set(allowed)
        unknown = [c for c in classes if c not in allowed_set]
        if unknown:
            raise ValueError(f"{who}: classes {unknown} are not in the global class list {list(allowed)}; "
                             "fix the spelling or add them to the global list")
    return list(classes)


def union_classes(class_lists: Mapping[str, Sequence[str]] | Sequence[Sequence[str]],
                  order: Sequence[str] | None = None) -> list[str]:
    """The union of the sites' classes in a stable order.

    ``class_lists``: a dict site -> classes (visited in sorted site-name order) or a list (visited in list
    order).  Without ``order``, classes appear in order of first appearance; with ``order`` (a configured
    global order) the union is returned in that order and a class outside ``order`` is an error.
    """
    if isinstance(class_lists, Mapping):
        items = [(s, class_lists[s]) for s in sorted(class_lists)]
    else:
        items = [(f"#{i}", cl) for i, cl in enumerate(class_lists)]
    out: list[str] = []
    seen: set[str] = set()
    for site, cl in items:
        for c in check_class_list(cl, site, allowed=order):
            if c not in seen:
                seen.add(c)
                out.append(c)
    if order is not None:
        check_class_list(list(order), "<global class list>")
        out = [c for c in order if c in seen]
    return out


def class_index(global_classes: Sequence[str], site_classes: Sequence[str], site: object = "?") -> list[int]:
    """Row ``i`` of the site's head is row ``class_index(...)[i]`` of the global head."""
    pos = {c: j for j, c in enumerate(check_class_list(global_classes, "<global class list>"))}
    idx = []
    for c in check_class_list(site_classes, site):
        if c not in pos:
            raise ValueError(f"site {_site(site)}: class {c!r} is not in the global class list "
                             f"{list(global_classes)}")
        idx.append(pos[c])
    return idx


def _head_arrays(head: object, site: object) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(head, (tuple, list)) or len(head) != 2:
        raise ValueError(f"site {_site(site)}: a head is a pair (weight [C_k, F], bias [C_k]), got "
                         f"{type(head).__name__}")
    w, b = to_numpy(head[0]), to_numpy(head[1])
    if w.ndim != 2 or b.ndim != 1 or w.shape[0] != b.shape[0]:
        raise ValueError(f"site {_site(site)}: head weight {w.shape} / bias {b.shape} must be [C_k, F] / [C_k]")
    return w, b


def merge_heads(
    heads: Mapping[str, tuple[object, object]],
    site_classes: Mapping[str, Sequence[str]],
    global_classes: Sequence[str],
    global_head: tuple[object, object] | None = None,
    weights: Mapping[str, float] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Surgical head merge (eq. 2-3): ``(W [C, F], b [C])`` over ``global_classes``.

    ``heads[site] = (W_k [C_k, F], b_k [C_k])`` with rows in the order of ``site_classes[site]``.
    Global row ``c`` = mean of the rows of ``c`` over the sites that hold ``c`` (unweighted; with
    ``weights[site]`` a weighted mean over those sites, weights renormalised per class).  A class held by
    no site keeps ``global_head``'s row (required then).  Sites are visited in sorted name order.
    """
    sites = sorted(heads)
    if not sites:
        raise ValueError("merge_heads needs at least one site head")
    gl = check_class_list(list(global_classes), "<global class list>")
    arrays: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    rows: dict[str, list[int]] = {}
    feat = None
    for s in sites:
        if s not in site_classes:
            raise ValueError(f"site {_site(s)}: sent a head but declared no class list")
        w, b = _head_arrays(heads[s], s)
        cl = check_class_list(site_classes[s], s, allowed=gl)
        if w.shape[0] != len(cl):
            raise ValueError(f"site {_site(s)}: head has {w.shape[0]} rows but the site declares {len(cl)} "
                             f"classes {cl}; the head must have one row per declared class")
        if feat is None:
            feat = w.shape[1]
        elif w.shape[1] != feat:
            raise ValueError(f"site {_site(s)}: head has {w.shape[1]} input features, other sites {feat}")
        arrays[s] = (w, b)
        rows[s] = class_index(gl, cl, s)
    if weights is not None:
        for s in sites:
            if s not in weights:
                raise ValueError(f"site {_site(s)}: no weight (sample count) given for the head merge")
    ref_w, ref_b = arrays[sites[0]]
    out_w = np.zeros((len(gl), feat), dtype=ref_w.dtype)
    out_b = np.zeros((len(gl),), dtype=ref_b.dtype)
    gw = gb = None
    if global_head is not None:
        gw, gb = _head_arrays(global_head, "<global model>")
        if gw.shape != (len(gl), feat):
            raise ValueError(f"global head weight {gw.shape} does not match {len(gl)} global classes x {feat} features")
    for j, c in enumerate(gl):
        holders = [(s, rows[s].index(j)) for s in sites if j in rows[s]]
        if not holders:
            if gw is None:
                raise ValueError(f"class {c!r} is held by no site and no previous global head was given")
            out_w[j], out_b[j] = gw[j], gb[j]
            continue
        ws = [1.0] * len(holders) if weights is None else [float(weights[s]) for s, _ in holders]
        avg = weighted_average([{"w": arrays[s][0][i], "b": arrays[s][1][i:i + 1]} for s, i in holders], ws)
        out_w[j], out_b[j] = avg["w"], avg["b"][0]
    return out_w, out_b


def slice_head(weight: object, bias: object, global_classes: Sequence[str], site_classes: Sequence[str],
               site: object = "?") -> tuple[object, object]:
    """The global head cut to the site's classes in the site's order: rows ``class_index(...)``.

    Returns arrays of the input kind (torch in -> torch out, numpy in -> numpy out), always fresh copies.
    """
    idx = class_index(global_classes, site_classes, site)
    if weight.shape[0] != len(global_classes) or bias.shape[0] != len(global_classes):
        raise ValueError(f"global head {tuple(weight.shape)} / {tuple(bias.shape)} does not have one row per "
                         f"global class ({len(global_classes)})")
    if isinstance(weight, torch.Tensor):
        t = torch.as_tensor(idx, dtype=torch.long, device=weight.device)
        return weight.index_select(0, t).clone(), bias.index_select(0, t).clone()
    w, b = np.asarray(weight), np.asarray(bias)
    return w[idx].copy(), b[idx].copy()


def slice_head_state(state: Mapping[str, object], global_classes: Sequence[str], site_classes: Sequence[str],
                     site: object = "?", weight_key: str = HEAD_WEIGHT, bias_key: str = HEAD_BIAS) -> dict:
    """A new state dict: ``state`` with its head cut to the site's classes (other tensors shared, not copied)."""
    for k in (weight_key, bias_key):
        if k not in state:
            raise ValueError(f"site {_site(site)}: model state has no head tensor {k!r}")
    out = dict(state)
    out[weight_key], out[bias_key] = slice_head(state[weight_key], state[bias_key], global_classes, site_classes, site)
    return out


def is_head_key(name: str, head: str = "classifier") -> bool:
    """``classifier.weight`` / ``classifier.bias`` (or any tensor under the ``head`` module)."""
    return name == head or name.startswith(head + ".")


def _check_strategy(strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"backbone strategy {strategy!r} is unknown; use one of {list(STRATEGIES)}")


def aggregated_keys(keys: Iterable[str], strategy: str, is_bn: Callable[[str], bool],
                    head: str = "classifier") -> list[str]:
    """Backbone keys the server averages: all non-head keys (fedavg), minus batch-norm keys (fedbn, fedbn_plus)."""
    _check_strategy(strategy)
    return [k for k in keys if not is_head_key(k, head) and (strategy == "fedavg" or not is_bn(k))]


def local_keys(keys: Iterable[str], strategy: str, is_bn: Callable[[str], bool], head: str = "classifier") -> list[str]:
    """Backbone keys that never leave / are never overwritten at a site: BN keys under fedbn and fedbn_plus."""
    _check_strategy(strategy)
    return [k for k in keys if not is_head_key(k, head) and strategy != "fedavg" and is_bn(k)]


def frozen_keys(keys: Iterable[str], strategy: str, is_bn: Callable[[str], bool]) -> list[str]:
    """Keys frozen at their pre-trained values during local training: every BN key under fedbn_plus."""
    _check_strategy(strategy)
    return [k for k in keys if strategy == "fedbn_plus" and is_bn(k)]


def surgical_merge(
    states: Mapping[str, Mapping[str, object]],
    site_classes: Mapping[str, Sequence[str]],
    global_classes: Sequence[str],
    global_state: Mapping[str, object],
    strategy: str,
    is_bn: Callable[[str], bool],
    weights: Mapping[str, float] | None = None,
    head_weights: Mapping[str, float] | None = None,
    weight_key: str = HEAD_WEIGHT,
    bias_key: str = HEAD_BIAS,
) -> dict[str, np.ndarray]:
    """One server update: a new global state (numpy arrays, every key of ``global_state``).

    ``states[site]``: the site's model, head cut to its own classes.  Backbone keys of ``strategy`` are
    averaged (``weights`` by site, uniform when None, as the public code); local (BN) keys keep their
    ``global_state`` value; the head is merged by :func:`merge_heads` (``head_weights``, uniform when None).
    A site's state may omit its local keys (they never leave the site under fedbn / fedbn_plus).
    """
    sites = sorted(states)
    if not sites:
        raise ValueError("surgical_merge needs at least one site state")
    head = weight_key.rsplit(".", 1)[0]
    agg = aggregated_keys(global_state.keys(), strategy, is_bn, head)
    for s in sites:
        missing = [k for k in agg if k not in states[s]]
        if missing:
            raise ValueError(f"site {_site(s)}: model lacks {len(missing)} backbone tensors, e.g. {missing[:3]}")
    w = [1.0] * len(sites) if weights is None else [float(weights[s]) for s in sites]
    avg = weighted_average([{k: states[s][k] for k in agg} for s in sites], w)
    out = {k: to_numpy(v).copy() for k, v in global_state.items()}
    out.update(avg)
    out[weight_key], out[bias_key] = merge_heads(
        {s: (states[s][weight_key], states[s][bias_key]) for s in sites}, site_classes, global_classes,
        global_head=(global_state[weight_key], global_state[bias_key]), weights=head_weights)
    return out
