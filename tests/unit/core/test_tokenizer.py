import warnings

import pytest
import torch

from fedssl.core.patches import normalize_patches, patchify, unpatchify
from fedssl.core.tokenizer import (
    PatchTokenizer,
    ScriptedTokenizer,
    init_codebook,
    kmeans_stats,
    kmeans_update,
    lloyd_step,
    load_tokenizer,
    patch_norm_bound,
    patch_vectors,
    site_kmeans_stats,
    suppress_small_clusters,
)


def test_kmeans_update_hand_computed_two_clusters():
    codebook = torch.tensor([[0.0, 0.0], [10.0, 10.0], [100.0, -100.0]])
    site_a = torch.tensor([[1.0, 0.0], [0.0, 1.0], [9.0, 10.0]])
    site_b = torch.tensor([[11.0, 10.0], [10.0, 13.0]])
    sums_a, counts_a = kmeans_stats(site_a, codebook)
    assert counts_a.tolist() == [2, 1, 0] and sums_a[0].tolist() == [1.0, 1.0] and sums_a[1].tolist() == [9.0, 10.0]
    new = kmeans_update(codebook, [(sums_a, counts_a), kmeans_stats(site_b, codebook)])
    # cluster 0: mean of (1,0), (0,1); cluster 1: mean of (9,10), (11,10), (10,13); cluster 2 empty: kept
    assert torch.allclose(new, torch.tensor([[0.5, 0.5], [10.0, 11.0], [100.0, -100.0]]))
    assert torch.equal(codebook[2], torch.tensor([100.0, -100.0]))  # input not modified


def test_federated_kmeans_equals_centralised_lloyd_step():
    g = torch.Generator().manual_seed(0)
    site_1, site_2 = torch.randn(300, 12, generator=g), torch.randn(200, 12, generator=g) + 1.0
    codebook = init_codebook(torch.cat([site_1, site_2]), 8, generator=g)
    for _ in range(3):
        fed = kmeans_update(codebook, [kmeans_stats(site_1, codebook), kmeans_stats(site_2, codebook)])
        central = lloyd_step(torch.cat([site_1, site_2]), codebook)
        assert torch.allclose(fed, central, atol=1e-6)
        codebook = fed


def test_kmeans_update_rejects_mismatched_statistics():
    codebook = torch.zeros(3, 2)
    with pytest.raises(ValueError, match="shapes"):
        kmeans_update(codebook, [(torch.zeros(2, 2), torch.zeros(2))])
    with pytest.raises(ValueError, match="no site"):
        kmeans_update(codebook, [])
    with pytest.raises(ValueError, match="non-finite"):
        kmeans_update(codebook, [(torch.full((3, 2), float("nan")), torch.ones(3))])


def test_init_codebook_kmeanspp_and_random():
    centres = torch.tensor([[0.0, 0.0], [50.0, 0.0], [0.0, 50.0]])
    pts = torch.cat([c + 0.1 * torch.randn(20, 2, generator=torch.Generator().manual_seed(i))
                     for i, c in enumerate(centres)])
    cb = init_codebook(pts, 3, torch.Generator().manual_seed(1))
    nearest = torch.cdist(cb, centres).argmin(dim=1)
    assert sorted(nearest.tolist()) == [0, 1, 2]  # D^2 sampling picks one seed per well-separated cluster
    rnd = init_codebook(pts, 5, torch.Generator().manual_seed(1), method="random")
    assert all(any(torch.equal(r, p) for p in pts) for r in rnd)
    assert torch.equal(rnd, init_codebook(pts, 5, torch.Generator().manual_seed(1), method="random"))
    with pytest.raises(ValueError, match="K <="):
        init_codebook(pts[:2], 3)


def test_patchify_roundtrip_and_normalisation():
    imgs = torch.randn(2, 3, 8, 12)
    x = patchify(imgs, 4)
    assert x.shape == (2, 6, 48) and torch.equal(unpatchify(x, 4, 2, 3), imgs)
    assert torch.equal(x[0, 1].reshape(4, 4, 3).permute(2, 0, 1), imgs[0, :, 0:4, 4:8])  # (row, col, channel) order
    n = normalize_patches(x)
    assert (torch.allclose(n.mean(-1), torch.zeros(2, 6), atol=1e-5)
            and torch.allclose(n.std(-1), torch.ones(2, 6), atol=1e-3))


def _patterned(ids: list[int], patterns: torch.Tensor) -> torch.Tensor:
    """An image [1, 3, 4, 4] of four 2 x 2 patches whose pixel vectors are ``patterns[ids]`` (scaled + shifted)."""
    vecs = torch.stack([patterns[i] * (1.5 + j) + j for j, i in enumerate(ids)])  # brightness/contrast per patch
    return unpatchify(vecs.unsqueeze(0), 2, 2, 2)


def test_encode_gives_the_nearest_centroid_per_patch():
    g = torch.Generator().manual_seed(0)
    patterns = torch.randn(3, 12, generator=g)
    tok = PatchTokenizer(normalize_patches(patterns), patch_size=2)
    imgs = torch.cat([_patterned([0, 1, 2, 0], patterns), _patterned([2, 2, 1, 0], patterns)])
    ids = tok.encode(imgs)
    assert ids.dtype == torch.long and ids.tolist() == [[0, 1, 2, 0], [2, 2, 1, 0]]  # invariant to patch contrast
    assert tok.vocab_size == 3 and tok.describe() == "federated k-means codebook K=3, patch 2"
    assert patch_vectors(imgs, 2).shape == (2, 4, 12)


def test_load_tokenizer_codebook_file_and_errors(tmp_path):
    tok = PatchTokenizer(torch.randn(5, 12), patch_size=2)
    path = tok.save(str(tmp_path / "codebook.pt"))
    loaded = load_tokenizer(path)
    assert isinstance(loaded, PatchTokenizer) and torch.equal(loaded.codebook, tok.codebook)
    assert loaded.describe() == f"local: {path} (codebook K=5, patch 2)"
    assert isinstance(PatchTokenizer.from_file(path), PatchTokenizer)
    with pytest.raises(ValueError, match="nope.pt.*does not exist"):
        load_tokenizer(str(tmp_path / "nope.pt"))
    wrong = tmp_path / "wrong.pt"
    torch.save({"weights": torch.zeros(2)}, wrong)
    with pytest.raises(ValueError, match="wrong.pt.*'codebook'"):
        load_tokenizer(str(wrong))
    shape = tmp_path / "shape.pt"
    torch.save({"codebook": torch.zeros(4, 10), "patch_size": 2}, shape)
    with pytest.raises(ValueError, match="shape.pt.*patch size 2"):
        load_tokenizer(str(shape))
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(b"not a tokenizer")
    with pytest.raises(ValueError, match="garbage.bin"):
        load_tokenizer(str(garbage))


class _SignTokens(torch.nn.Module):
    """Token 1 where a 4 x 4 patch's mean red value is positive (a stand-in for a dVAE encoder)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.avg_pool2d(x[:, :1], 4).flatten(1).gt(0).long()


def test_load_tokenizer_torchscript(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scripted = torch.jit.trace(_SignTokens(), torch.randn(2, 3, 16, 16))
    path = str(tmp_path / "dvae_encoder.pt")
    scripted.save(path)
    tok = load_tokenizer(path)
    assert isinstance(tok, ScriptedTokenizer) and tok.describe() == f"local: {path} (TorchScript)"
    imgs = torch.randn(3, 3, 16, 16)
    assert torch.equal(tok.encode(imgs), _SignTokens()(imgs))


def test_load_tokenizer_torch_export_program(tmp_path):
    program = torch.export.export(_SignTokens(), (torch.randn(3, 3, 16, 16),))
    path = str(tmp_path / "dvae_encoder.pt2")
    torch.export.save(program, path)
    tok = load_tokenizer(path)
    assert isinstance(tok, ScriptedTokenizer) and tok.describe() == f"local: {path} (torch.export)"
    imgs = torch.randn(3, 3, 16, 16)
    assert torch.equal(tok.encode(imgs), _SignTokens()(imgs))


def test_near_flat_patches_get_the_flat_token():
    codebook = torch.stack([torch.zeros(12), normalize_patches(torch.arange(12.0))])  # "flat" and "ramp" tokens
    tok = PatchTokenizer(codebook, 2)
    noisy_flat = 0.3 + 0.01 * torch.randn(1, 3, 2, 2, generator=torch.Generator().manual_seed(0))
    ramp = unpatchify(torch.arange(12.0).reshape(1, 1, 12), 2, 1, 1)
    assert tok.encode(torch.cat([noisy_flat, ramp])).tolist() == [[0], [1]]


def test_data_free_random_codebook_is_normalised_and_seeded():
    from fedssl.core.tokenizer import random_codebook

    cb = random_codebook(6, 2, torch.Generator().manual_seed(0))
    assert cb.shape == (6, 12) and torch.allclose(cb.mean(1), torch.zeros(6), atol=1e-5)
    assert torch.equal(cb, random_codebook(6, 2, torch.Generator().manual_seed(0)))
    with pytest.raises(ValueError, match="K >= 2"):
        random_codebook(1, 2)


def test_site_stats_cost_matches_the_direct_cost():
    g = torch.Generator().manual_seed(0)
    x, c = torch.randn(50, 6, generator=g), torch.randn(4, 6, generator=g)
    sums, counts, cost = site_kmeans_stats(x, c, 1)  # 1 suppresses nothing: the plain E-step
    ref_sums, ref_counts = kmeans_stats(x, c)
    assert torch.equal(sums, ref_sums) and torch.equal(counts, ref_counts)
    direct = float(torch.cdist(x.double(), c.double()).min(dim=1).values.pow(2).sum())
    assert cost == pytest.approx(direct, rel=1e-9)
    # hand-computed: x = 0, 2 on a line with one centroid at 1 -> cost 1 + 1
    assert site_kmeans_stats(torch.tensor([[0.0], [2.0]]), torch.tensor([[1.0]]), 2)[2] == pytest.approx(2.0)


def test_clusters_below_the_minimum_leave_the_site_as_zero_sum_and_count():
    """Centroids at 0 and 10 on a line: {0, 1, -1} go to the first (3 members), {10} alone to the second."""
    x = torch.tensor([[0.0], [1.0], [-1.0], [10.0]])
    codebook = torch.tensor([[0.0], [10.0]])
    sums, counts, cost = site_kmeans_stats(x, codebook, 2)
    assert counts.tolist() == [3, 0] and sums.flatten().tolist() == [0.0, 0.0]  # 0 + 1 - 1; the lone 10 withheld
    assert cost == pytest.approx(2.0)  # 0 + 1 + 1: the withheld vector adds nothing
    assert site_kmeans_stats(x, codebook, 4)[1].tolist() == [0, 0]  # nothing of 3 or fewer leaves
    # the M-step then keeps the suppressed centroid, as for an empty cluster
    assert kmeans_update(codebook, [(sums, counts)]).flatten().tolist() == [0.0, 10.0]
    kept_sums, kept_counts = suppress_small_clusters(*kmeans_stats(x, codebook), 1)
    assert kept_counts.tolist() == [3, 1] and kept_sums.flatten().tolist() == [0.0, 10.0]  # 1: a raw vector
    for bad in (0, 1.5, True, "2"):
        with pytest.raises(ValueError, match="min_count"):
            suppress_small_clusters(sums, counts, bad)


def test_patch_vectors_and_their_means_lie_within_the_norm_bound():
    g = torch.Generator().manual_seed(0)
    imgs = torch.randn(2, 3, 8, 8, generator=g) * 5
    imgs[0, :, :4, :4] = 0.3  # a flat patch: the zero vector
    v = patch_vectors(imgs, 4).reshape(-1, 48)
    assert patch_norm_bound(48) == pytest.approx(47 ** 0.5)
    assert (v.norm(dim=1) < patch_norm_bound(48)).all() and v.norm(dim=1).max() > 0.99 * patch_norm_bound(48)
    assert v.mean(dim=0).norm() < patch_norm_bound(48)
