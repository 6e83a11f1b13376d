"""Visual tokenizer for Fed-BEiT (SSL-FL (Yan et al., IEEE TMI 2023) section III-C.3): image -> one discrete token id
per patch.

SSL-FL uses the DALL-E dVAE tokenizer, which cannot be downloaded here.  Two replacements:

* :class:`PatchTokenizer`: a codebook of K centroids of per-patch-normalised pixel vectors
  (``p x p x 3`` values, see :mod:`fedssl.core.patches`); a patch's token is its nearest centroid.  The
  codebook is learnt inside the federation by federated k-means before pre-training: each site computes
  its E-step statistics (:func:`site_kmeans_stats`: per-cluster sums and counts, every cluster of fewer than
  ``min_count`` vectors suppressed, because the "sum" of a one-member cluster is a raw patch), the server runs
  the M-step (:func:`kmeans_update`).  One federated round equals one Lloyd step on the union of the sites'
  patches, less the suppressed clusters' few vectors.
* a TorchScript module from a local path (how a user brings the real DALL-E encoder, wrapped to take the
  same normalised images): :class:`ScriptedTokenizer`.

:func:`load_tokenizer` loads either; ``describe()`` is the line a run summary prints.
"""

from __future__ import annotations

import math
import os
import warnings
import zipfile

import torch

from fedssl.core.patches import normalize_patches, patchify
from fedssl.core.safe_load import load_export_program, safe_load

_CHUNK = 4096  # rows per distance block: 4096 x K floats at a time


#: Variance floor of the tokenizer's per-patch normalisation, in ImageNet-normalised units (a std of 0.1 is
#: about 6 grey levels): near-flat patches map close to the zero vector ("flat" token) instead of having
#: their sensor noise blown up to unit variance (MAE's 1e-6 would).
TOKEN_EPS = 1e-2


def patch_vectors(imgs: torch.Tensor, patch_size: int, eps: float = TOKEN_EPS) -> torch.Tensor:
    """The tokenizer's input space: per-patch-normalised pixel vectors ``[B, L, p*p*C]``."""
    return normalize_patches(patchify(imgs.float(), patch_size), eps=eps)


def nearest_centroid(x: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Index of the nearest centroid (squared Euclidean) for each row of ``x [N, D]`` -> LongTensor ``[N]``."""
    if x.dim() != 2 or codebook.dim() != 2 or x.shape[1] != codebook.shape[1]:
        raise ValueError(
            f"nearest_centroid: vectors {tuple(x.shape)} and codebook {tuple(codebook.shape)} do not match"
        )
    c = codebook.to(device=x.device, dtype=x.dtype)
    c_sq = (c * c).sum(dim=1)  # [K]
    out = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    for i in range(0, x.shape[0], _CHUNK):
        xb = x[i : i + _CHUNK]
        d = c_sq[None, :] - 2.0 * xb @ c.T  # ||x||^2 is constant per row
        out[i : i + _CHUNK] = d.argmin(dim=1)
    return out


def _assign_and_sum(x: torch.Tensor, codebook: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Nearest centroid of each row of ``x [N, D]`` -> (assignment [N], per-cluster sums [K, D] float64,
    counts [K] int64)."""
    k = codebook.shape[0]
    assign = nearest_centroid(x.float(), codebook.float())
    sums = torch.zeros(k, codebook.shape[1], dtype=torch.float64, device=x.device)
    sums.index_add_(0, assign, x.to(torch.float64))
    return assign, sums, torch.bincount(assign, minlength=k).to(torch.int64)


def kmeans_stats(patch_features: torch.Tensor, codebook: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The E-step: assign each vector of ``patch_features [N, D]`` to its nearest centroid of ``codebook [K, D]``;
    return per-cluster sums ``[K, D]`` (float64) and counts ``[K]`` (int64).  For use on the site only: the sum
    of a one-vector cluster is that vector; what leaves a site is :func:`site_kmeans_stats`."""
    x = patch_features.reshape(-1, codebook.shape[-1]) if patch_features.dim() != 2 else patch_features
    _, sums, counts = _assign_and_sum(x, codebook)
    return sums.cpu(), counts.cpu()


def suppress_small_clusters(sums: torch.Tensor, counts: torch.Tensor,
                            min_count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of ``sums [K, D]`` and ``counts [K]`` with every cluster of fewer than ``min_count`` members set to a
    zero sum and a zero count (the M-step then treats it as empty at this site).  The mean of n vectors is the
    vector itself for n = 1 and, for small n, gives the vectors away to anyone who knows the others;
    ``min_count >= 1`` (1 suppresses nothing)."""
    if isinstance(min_count, bool) or not isinstance(min_count, int) or min_count < 1:
        raise ValueError(f"suppress_small_clusters: min_count={min_count!r}; use an integer >= 1")
    small = counts < min_count
    sums, counts = sums.clone(), counts.clone()
    sums[small] = 0
    counts[small] = 0
    return sums, counts


def site_kmeans_stats(patch_features: torch.Tensor, codebook: torch.Tensor,
                      min_count: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One site's E-step as it may leave the site: :func:`kmeans_stats` with every cluster of fewer than
    ``min_count`` vectors suppressed (:func:`suppress_small_clusters`), and the k-means cost
    ``sum ||x_i - c_a(i)||^2`` of the vectors still reported -> (sums [K, D] float64, counts [K] int64, cost).
    The cost is summed per cluster, ``Q_k - 2 c_k . S_k + n_k ||c_k||^2`` with ``Q_k = sum ||x_i||^2``, so no
    ``[N, K]`` matrix nor a second ``[N, D]`` one is built."""
    x = patch_features.reshape(-1, codebook.shape[-1]) if patch_features.dim() != 2 else patch_features
    assign, sums, counts = _assign_and_sum(x, codebook)
    sq = torch.zeros(codebook.shape[0], dtype=torch.float64, device=x.device)
    sq.index_add_(0, assign, (x.to(torch.float64) ** 2).sum(dim=1))
    c = codebook.to(device=x.device, dtype=torch.float64)
    cost = (sq - 2 * (c * sums).sum(dim=1) + counts.to(torch.float64) * (c ** 2).sum(dim=1)).cpu()
    sums, counts = suppress_small_clusters(sums.cpu(), counts.cpu(), min_count)
    return sums, counts, max(float(cost[counts > 0].sum()), 0.0)


def patch_norm_bound(dim: int) -> float:
    """``sqrt(D - 1)``: every patch vector (:func:`patch_vectors`, per-patch normalised with the unbiased
    variance) has ``||v||^2 = (D - 1) var / (var + eps) < D - 1``, so does every mean of patch vectors (every
    centroid), and a cluster sum of n vectors has ``||S|| < n sqrt(D - 1)``: the server's bound on what a site
    sends."""
    return math.sqrt(max(int(dim) - 1, 1))


def kmeans_update(
    codebook: torch.Tensor, stats_list: list[tuple[torch.Tensor, torch.Tensor]]
) -> torch.Tensor:
    """Server M-step: ``c_k = sum_s sums_s[k] / sum_s counts_s[k]``; a cluster no site assigned anything to
    keeps its centroid.  Returns a new codebook (same dtype as ``codebook``)."""
    if not stats_list:
        raise ValueError("kmeans_update: no site statistics to aggregate")
    k, d = codebook.shape
    total_s = torch.zeros(k, d, dtype=torch.float64)
    total_n = torch.zeros(k, dtype=torch.float64)
    for i, (sums, counts) in enumerate(stats_list):
        sums, counts = torch.as_tensor(sums), torch.as_tensor(counts)
        if tuple(sums.shape) != (k, d) or tuple(counts.shape) != (k,):
            raise ValueError(
                f"kmeans_update: statistics {i} have shapes {tuple(sums.shape)}, {tuple(counts.shape)}; "
                f"expected ({k}, {d}) and ({k},) for this codebook"
            )
        if not torch.isfinite(sums).all() or (counts < 0).any():
            raise ValueError(f"kmeans_update: statistics {i} hold non-finite sums or negative counts")
        total_s += sums.to(torch.float64)
        total_n += counts.to(torch.float64)
    new = codebook.detach().to(torch.float64).clone()
    filled = total_n > 0
    new[filled] = total_s[filled] / total_n[filled, None]
    return new.to(codebook.dtype)


def init_codebook(
    patch_vectors: torch.Tensor, k: int, generator: torch.Generator | None = None, method: str = "kmeans++"
) -> torch.Tensor:
    """Initial centroids from ``patch_vectors [N, D]``: k-means++ (D^2 sampling; cost O(N K D)) or
    ``"random"`` (K distinct vectors drawn uniformly).  Needs N >= K."""
    x = patch_vectors.reshape(-1, patch_vectors.shape[-1]).float()
    n = x.shape[0]
    if int(k) < 1 or n < int(k):
        raise ValueError(f"init_codebook: need 1 <= K <= number of patch vectors, got K={k} and {n} vectors")
    k = int(k)
    if method == "random":
        return x[torch.randperm(n, generator=generator)[:k]].clone()
    if method != "kmeans++":
        raise ValueError(f"init_codebook: method={method!r}; use 'kmeans++' or 'random'")
    centers = torch.empty(k, x.shape[1])
    first = int(torch.randint(n, (), generator=generator))
    centers[0] = x[first]
    d2 = ((x - centers[0]) ** 2).sum(dim=1)  # [N] squared distance to the nearest chosen centre
    for i in range(1, k):
        total = float(d2.sum())
        if total <= 0.0:  # every vector coincides with a centre: fill with random vectors
            idx = int(torch.randint(n, (), generator=generator))
        else:
            idx = int(torch.multinomial(d2 / total, 1, generator=generator))
        centers[i] = x[idx]
        d2 = torch.minimum(d2, ((x - centers[i]) ** 2).sum(dim=1))
    return centers


def random_codebook(k: int, patch_size: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """A data-free initial codebook ``[K, p*p*3]``: Gaussian vectors normalised like patch vectors (zero mean,
    unit variance each), so the server can start federated k-means without any site sharing a patch."""
    if int(k) < 2 or int(patch_size) < 1:
        raise ValueError(f"random_codebook: need K >= 2 and patch_size >= 1, got K={k}, patch_size={patch_size}")
    d = int(patch_size) ** 2 * 3
    return normalize_patches(torch.randn(int(k), d, generator=generator))


def lloyd_step(patch_features: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """One centralised Lloyd iteration (E-step + M-step on one pool of vectors)."""
    return kmeans_update(codebook, [kmeans_stats(patch_features, codebook)])


class PatchTokenizer:
    """Nearest-centroid tokenizer over per-patch-normalised pixel vectors: ``encode(imgs) -> [B, L]``."""

    def __init__(self, codebook: torch.Tensor, patch_size: int, source: str | None = None):
        codebook = torch.as_tensor(codebook).detach().float()
        p = int(patch_size)
        if codebook.dim() != 2 or codebook.shape[0] < 2 or p < 1 or codebook.shape[1] != p * p * 3:
            raise ValueError(
                f"PatchTokenizer: codebook of shape {tuple(codebook.shape)} does not fit patch size {p} "
                f"(expected [K >= 2, {p * p * 3}] = [K, patch x patch x 3])"
            )
        if not torch.isfinite(codebook).all():
            raise ValueError("PatchTokenizer: the codebook holds NaN/Inf values")
        self.codebook = codebook  # [K, p*p*3]
        self.patch_size = p
        self.source = source
        self._on_device: torch.Tensor | None = None  # codebook copy on the images' device (GPU runs)

    @property
    def vocab_size(self) -> int:
        return int(self.codebook.shape[0])

    def encode(self, imgs: torch.Tensor) -> torch.Tensor:
        """Token ids ``LongTensor [B, L]`` of normalised images ``[B, 3, H, W]`` (on the images' device)."""
        if imgs.dim() != 4 or imgs.shape[1] != 3:
            raise ValueError(f"PatchTokenizer.encode expects images [B, 3, H, W], got {tuple(imgs.shape)}")
        v = patch_vectors(imgs, self.patch_size)  # [B, L, D]
        b, n, d = v.shape
        if self._on_device is None or self._on_device.device != v.device:
            self._on_device = self.codebook.to(v.device)
        with torch.no_grad():
            ids = nearest_centroid(v.reshape(b * n, d), self._on_device)
        return ids.reshape(b, n)

    __call__ = encode

    def describe(self) -> str:
        base = f"codebook K={self.vocab_size}, patch {self.patch_size}"
        if self.source:
            return f"local: {self.source} ({base})"
        return f"federated k-means {base}"

    def state_dict(self) -> dict:
        return {"codebook": self.codebook.clone(), "patch_size": self.patch_size}

    def save(self, path: str) -> str:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        torch.save(self.state_dict(), path)
        return path

    @classmethod
    def from_file(cls, path: str) -> "PatchTokenizer":
        tok = load_tokenizer(path)
        if not isinstance(tok, PatchTokenizer):
            raise ValueError(f"{path} is a TorchScript tokenizer, not a patch codebook; use load_tokenizer")
        return tok


class ScriptedTokenizer:
    """A TorchScript module (or a ``torch.export`` program, ``.pt2``) from a local file that maps normalised
    images ``[B, 3, H, W]`` to token ids ``[B, L]`` (integer) or to logits ``[B, K, h, w]`` (argmax over K,
    as the DALL-E encoder's output)."""

    def __init__(self, module: torch.nn.Module, path: str, kind: str = "TorchScript"):
        self.module = module
        self.path = path
        self.kind = kind
        self.patch_size = None
        self.vocab_size = None  # unknown until used; MIMTrainer checks ids < the model's vocabulary

    def encode(self, imgs: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = self.module.to(imgs.device)(imgs)
        if out.dim() == 4 and out.is_floating_point():
            out = out.argmax(dim=1).flatten(1)  # logits [B, K, h, w] -> ids [B, h*w]
        if out.dim() != 2 or out.is_floating_point() or out.shape[0] != imgs.shape[0]:
            raise ValueError(
                f"tokenizer {self.path} returned {tuple(out.shape)} ({out.dtype}); it must return integer ids "
                "[B, L] or logits [B, K, h, w]"
            )
        return out.long()

    __call__ = encode

    def describe(self) -> str:
        return f"local: {self.path} ({self.kind})"


def load_tokenizer(path: str) -> PatchTokenizer | ScriptedTokenizer:
    """A local tokenizer: a ``.pt`` file ``{"codebook": [K, p*p*3], "patch_size": p}`` -> PatchTokenizer, or
    a TorchScript module or a ``torch.export`` program -> ScriptedTokenizer.  Anything else raises ValueError
    naming the path."""
    if not os.path.isfile(path):
        raise ValueError(f"tokenizer file {path} does not exist; give a codebook .pt or a TorchScript encoder")
    names: list[str] = []
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as zf:
            names = [name.split("/", 1)[-1] for name in zf.namelist()]
    if "archive_format" in names:
        try:
            module = load_export_program(path).module()
        except Exception as e:  # noqa: BLE001 - report the file and the reason
            raise ValueError(f"tokenizer {path} looks like a torch.export program but does not load: {e}") from None
        return ScriptedTokenizer(module, path, kind="torch.export")
    if "constants.pkl" in names or any(name.startswith("code/") for name in names):
        try:
            with warnings.catch_warnings():  # torch 2.14 marks TorchScript deprecated; DALL-E ports still use it
                warnings.simplefilter("ignore", FutureWarning)
                module = torch.jit.load(path, map_location="cpu").eval()
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"tokenizer {path} looks like TorchScript but does not load: {e}") from None
        return ScriptedTokenizer(module, path)
    try:
        data = safe_load(path)
    except Exception as e:  # noqa: BLE001
        raise ValueError(
            f"tokenizer {path} is neither a codebook file {{'codebook', 'patch_size'}} nor TorchScript: {e}"
        ) from None
    if not (isinstance(data, dict) and "codebook" in data and "patch_size" in data):
        keys = sorted(data)[:5] if isinstance(data, dict) else type(data).__name__
        raise ValueError(
            f"tokenizer {path} holds {keys}; expected a dict with 'codebook' [K, p*p*3] and 'patch_size' p"
        )
    try:
        return PatchTokenizer(data["codebook"], data["patch_size"], source=path)
    except (ValueError, TypeError) as e:
        raise ValueError(f"tokenizer {path}: {e}") from None


def save_codebook(path: str, codebook: torch.Tensor, patch_size: int, description: str) -> str:
    """Write the codebook in the file format of :func:`load_tokenizer` (plus a description)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    torch.save({"codebook": torch.as_tensor(codebook).detach().float().cpu(), "patch_size": int(patch_size),
                "description": str(description)}, tmp)
    os.replace(tmp, path)
    return path


def codebook_description(path: str) -> str:
    """The description saved with a codebook by :func:`save_codebook` ("" for other tokenizer files)."""
    try:
        data = safe_load(path)
    except Exception:  # noqa: BLE001 - TorchScript or foreign files carry no description
        return ""
    return str(data.get("description", "")) if isinstance(data, dict) else ""
