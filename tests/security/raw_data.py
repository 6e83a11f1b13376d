"""What a site holds, and a scan of what it uploads for any of it.

References (:class:`SiteData`) are rows of one width L each: every input image of the site as the model sees
it (``[C, H, W]`` flattened, and ``[H, W, C]``), its patches (``p x p x C`` in MAE's (p, q, c) order and in a
conv filter's (c, p, q) order, and the tokenizer's per-patch-normalised vectors), and every image file as
stored (raw pixel values, also scaled to [0, 1]; NIfTI volumes slice by slice).  Rows that carry no
individual's data are dropped: constant rows (a flat patch, an all-zero bias would match them) and rows the
site holds at least ``COMMON`` times (a background patch shared by many images, which the mean of a large
cluster of it rightly equals).

:func:`leaks` reshapes every uploaded array to ``[-1, L]`` for each reference width L that divides its size
and looks for a row within ``np.allclose`` tolerance of a reference row (nearest neighbour, then the test);
and it looks for every reference row, as float32 bytes, anywhere in the raw flat array (any offset).
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any, Iterator

import numpy as np
import torch
from PIL import Image

from fedssl.core.patches import patchify
from fedssl.core.tokenizer import patch_vectors
from fedssl.data.acdc import load_nifti

#: a row held at least this many times at one site is common (the default min_cluster_size of the k-means)
COMMON = 5
RTOL, ATOL = 1e-5, 1e-6
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg")


class SiteData:
    """Reference rows of one site, grouped by width."""

    def __init__(self, site: str):
        self.site = site
        self._rows: dict[int, list[np.ndarray]] = defaultdict(list)
        self.groups: dict[int, np.ndarray] = {}

    def add(self, rows: Any, what: str) -> None:
        rows = np.asarray(rows, dtype=np.float32)
        rows = rows.reshape(rows.shape[0], -1) if rows.ndim > 1 else rows.reshape(1, -1)
        if rows.shape[1] < 2:
            raise ValueError(f"{what}: reference rows need at least 2 values")
        self._rows[rows.shape[1]].append(rows)

    def add_images(self, images: torch.Tensor, patch_size: int | None = None) -> None:
        """Model-input images ``[B, C, H, W]``: whole images (CHW and HWC) and, with a patch size, their patches."""
        images = images.float()
        self.add(images.flatten(1), "images CHW")
        self.add(images.permute(0, 2, 3, 1).flatten(1), "images HWC")
        if patch_size:
            p, c = patch_size, images.shape[1]
            pqc = patchify(images, p)  # [B, L, p*p*C] in (p, q, c) order
            self.add(pqc.reshape(-1, p * p * c), "patches (p, q, c)")
            cpq = pqc.reshape(*pqc.shape[:2], p, p, c).permute(0, 1, 4, 2, 3)
            self.add(cpq.reshape(-1, p * p * c), "patches (c, p, q)")
            if c == 3:
                self.add(patch_vectors(images, p).reshape(-1, p * p * c), "tokenizer patch vectors")

    def add_files(self, folder: str) -> None:
        """Every image file under ``folder`` as stored: 8-bit pictures (values and /255) and NIfTI slices."""
        for dirpath, _, names in os.walk(folder):
            for name in sorted(names):
                path = os.path.join(dirpath, name)
                if name.lower().endswith(IMAGE_EXTENSIONS):
                    with Image.open(path) as im:
                        pixels = np.asarray(im).astype(np.float32)
                    self.add(pixels.reshape(1, -1), path)
                    self.add(pixels.reshape(1, -1) / 255.0, path)
                elif name.endswith((".nii", ".nii.gz")):
                    data, _ = load_nifti(path)
                    vol = np.asarray(data, dtype=np.float32)
                    slices = np.moveaxis(vol.reshape(*vol.shape[:2], -1), -1, 0)  # every (z[, t]) slice [H, W]
                    self.add(slices.reshape(slices.shape[0], -1), path)

    def freeze(self) -> "SiteData":
        """Group the rows by width, dropping constant rows and rows held ``COMMON`` times or more."""
        for width, parts in self._rows.items():
            rows = np.concatenate(parts)
            rows = rows[np.ptp(rows, axis=1) > 0]
            _, first, counts = np.unique(rows, axis=0, return_index=True, return_counts=True)
            self.groups[width] = rows[np.sort(first[counts < COMMON])]
        return self

    @property
    def n_rows(self) -> int:
        return sum(len(g) for g in self.groups.values())


def numeric_arrays(obj: Any, path: str = "") -> Iterator[tuple[str, np.ndarray]]:
    """Every numeric array (numpy, torch, list of numbers) in ``obj`` (dicts, lists, tuples: recursively),
    flattened to float32, with its path; scalars are skipped (no row of >= 2 values fits in them)."""
    if isinstance(obj, torch.Tensor):
        obj = obj.detach().cpu().numpy()
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from numeric_arrays(v, f"{path}/{k}")
        return
    if isinstance(obj, (list, tuple)):
        try:
            arr = np.asarray(obj)
        except ValueError:  # ragged
            arr = np.asarray([], dtype=object)
        if arr.dtype.kind not in "fiub":
            for i, v in enumerate(obj):
                yield from numeric_arrays(v, f"{path}[{i}]")
            return
        obj = arr
    if isinstance(obj, np.ndarray) and obj.dtype.kind in "fiub" and obj.size >= 2:
        with np.errstate(over="ignore", invalid="ignore"):
            yield path, obj.astype(np.float32).ravel()


def _close_rows(flat: dict[str, np.ndarray], refs: np.ndarray) -> list[str]:
    """Rows of width L = refs.shape[1] (arrays whose size L divides) within tolerance of a reference row."""
    width, hits = refs.shape[1], []
    r64 = refs.astype(np.float64)
    r_sq = (r64 ** 2).sum(axis=1)
    for path, arr in flat.items():
        if arr.size % width or not np.all(np.isfinite(arr)):
            continue
        rows = arr.reshape(-1, width).astype(np.float64)
        for start in range(0, len(rows), 2048):
            block = rows[start:start + 2048]
            d2 = (block ** 2).sum(axis=1)[:, None] + r_sq[None, :] - 2.0 * block @ r64.T
            nearest = d2.argmin(axis=1)
            close = np.all(np.abs(block - r64[nearest]) <= ATOL + RTOL * np.abs(r64[nearest]), axis=1)
            hits += [f"{path} row {start + i} (width {width}) equals a site row" for i in np.nonzero(close)[0]]
    return hits


def _anchor(row: np.ndarray) -> int | None:
    """First j with two distinct non-zero values at j, j+1 (bits): where an exact search keys the row."""
    ok = (row[:-1] != row[1:]) & (row[:-1] != 0) & (row[1:] != 0)
    idx = np.flatnonzero(ok)
    return int(idx[0]) if idx.size else None


def _contained(flat: dict[str, np.ndarray], data: SiteData) -> list[str]:
    """Reference rows found as exact float32 bytes at any offset of an uploaded array."""
    keyed: dict[int, list[tuple[np.ndarray, int]]] = defaultdict(list)
    for refs in data.groups.values():
        bits = refs.view(np.uint32)
        for row in bits:
            j = _anchor(row)
            if j is not None:
                keyed[(int(row[j]) << 32) | int(row[j + 1])].append((row, j))
    keys = np.fromiter(keyed, dtype=np.uint64, count=len(keyed))
    hits = []
    for path, arr in flat.items():
        u = arr.view(np.uint32)
        pairs = (u[:-1].astype(np.uint64) << np.uint64(32)) | u[1:].astype(np.uint64)
        for pos in np.flatnonzero(np.isin(pairs, keys)):
            for row, j in keyed[int(pairs[pos])]:
                start = int(pos) - j
                if start >= 0 and start + row.size <= u.size and np.array_equal(u[start:start + row.size], row):
                    hits.append(f"{path} holds a site row of width {row.size} at offset {start}")
    return hits


def leaks(uploads: list[tuple[str, Any]], data: SiteData) -> list[str]:
    """Every place where one of ``uploads`` ((name, payload) pairs) holds a row of the site's data."""
    flat = {f"{name}{path}": arr for name, payload in uploads for path, arr in numeric_arrays(payload)}
    hits = []
    for refs in data.groups.values():
        if len(refs):
            hits += _close_rows(flat, refs)
    return hits + _contained(flat, data)
