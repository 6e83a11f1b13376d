"""The raw-data scan of tests/security/raw_data.py finds a site's image or patch wherever an upload hides it
(aligned rows within tolerance, exact bytes at any offset, inside nested meta), and only those."""

import numpy as np
import torch
from nvflare.apis.dxo import DXO, DataKind

from tests.security.raw_data import COMMON, SiteData, leaks, numeric_arrays

torch.set_num_threads(1)


def site(seed=0):
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(3, 3, 8, 8, generator=g)
    images[0, :, :4, :4] = 0.25  # a flat patch: constant in every order, never a reference
    data = SiteData("site-1")
    data.add_images(images, patch_size=4)
    background = np.linspace(-1, 1, 48, dtype=np.float32)
    data.add(np.tile(background, (COMMON, 1)), "a patch held COMMON times")
    data.add(np.linspace(0, 1, 48, dtype=np.float32)[None] + 5, "a patch held once")
    return images, data.freeze(), background


def upload(**arrays):
    return [("train:", DXO(DataKind.WEIGHTS, data={"w": np.zeros(3, np.float32)}, meta=arrays).to_shareable())]


def test_honest_weights_and_common_or_flat_rows_are_not_flagged():
    images, data, background = site()
    g = np.random.default_rng(0)
    assert data.groups[48].shape[0] == 3 * 4 * 3 - 3 + 1  # 3 images x 4 patches x 3 orders, less 3 flat, + 1
    weights = {"a": g.normal(size=(96, 48)).astype(np.float32), "bias": np.zeros(48, np.float32),
               "ln": np.ones(192, np.float32), "bg": np.tile(background, 2)}
    assert leaks(upload(**weights), data) == []


def test_a_patch_row_in_float64_within_tolerance_is_found():
    images, data, _ = site()
    patch = data.groups[48][7].astype(np.float64) * (1 + 1e-7)
    rows = np.random.default_rng(0).normal(size=(5, 48))
    rows[3] = patch
    hits = leaks(upload(stats={"sums": rows}), data)
    assert hits == ["train:/DXO/meta/stats/sums row 3 (width 48) equals a site row"]


def test_an_image_at_an_unaligned_offset_and_in_a_list_is_found():
    images, data, _ = site()
    flat = np.random.default_rng(0).normal(size=1000).astype(np.float32)
    flat[101:101 + 192] = images[1].flatten().numpy()
    hits = leaks(upload(w=flat), data)
    assert hits == ["train:/DXO/meta/w holds a site row of width 192 at offset 101"]
    as_list = [["text", images[2].permute(1, 2, 0).flatten().tolist()]]  # HWC, nested in a list
    assert leaks(upload(nested=as_list), data) == [
        "train:/DXO/meta/nested[0][1] row 0 (width 192) equals a site row",
        "train:/DXO/meta/nested[0][1] holds a site row of width 192 at offset 0"]


def test_numeric_arrays_walks_data_meta_and_headers():
    s = DXO(DataKind.WEIGHTS, data={"k": torch.ones(2, 2)}, meta={"m": {"x": [1, 2, 3]}, "s": "text", "n": 5})
    s = s.to_shareable()
    s.set_header("h", np.arange(4))
    found = {path: arr.size for path, arr in numeric_arrays(s)}
    assert found == {"/DXO/data/k": 4, "/DXO/meta/m/x": 3, "/__headers__/h": 4}
