"""Feature spread (fedssl.eval.features, fedssl.core.spread): hand-computed batches, then the encoder helpers
(U-Net projection / pooled bottleneck over a site's slices, ViT mean-pooled patch tokens) against a direct
computation."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedssl.data.volume import Volume
from fedssl.core.discrimination import instance_discrimination, knn_accuracy
from fedssl.data.acdc import PartitionSampleDataset
from fedssl.data.transforms import augment_views
from fedssl.eval.features import (feature_spread, slice_partitions, unet_discrimination, unet_features,
                                  unet_position_knn, unet_spread, vit_spread)
from fedssl.models.unet import TINY_FEATURES, ContrastiveNet, UNetEncoder, fill_batch_statistics
from fedssl.models.vit import TINY_VIT, ViTClassifier

torch.set_num_threads(1)


def test_identical_rows_have_zero_spread():
    z = torch.tensor([[3.0, -1.0, 2.0, 0.5]]).repeat(5, 1)
    value, reference, n = feature_spread(z)
    assert (value, n) == (0.0, 5) and reference == pytest.approx(0.5)  # 1 / sqrt(4)


def test_plus_minus_unit_vectors_by_hand():
    """Rows +-3 e_i in D = 4 (8 rows): after normalisation each coordinate is +1, -1 and six 0s: mean 0, population
    variance 2/8, std 1/2 = 1/sqrt(4), the uniform reference.  Rows e_1, e_2 in D = 2: each coordinate is (1, 0),
    std 1/2, below the reference 1/sqrt(2)."""
    eye = torch.eye(4)
    spread = feature_spread(torch.cat([3 * eye, -3 * eye]))
    assert spread.value == pytest.approx(0.5) and spread.reference == pytest.approx(0.5)
    two = feature_spread(torch.eye(2))
    assert two.value == pytest.approx(0.5) and two.reference == pytest.approx(1 / math.sqrt(2))


def test_gaussian_features_in_64_dimensions_spread_about_one_eighth():
    z = torch.randn(4096, 64, generator=torch.Generator().manual_seed(0)) * 5 + 0.0
    assert feature_spread(z).value == pytest.approx(1 / 8, abs=0.003)


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match=r"\[B, D\], got shape \(4,\)"):
        feature_spread(torch.ones(4))


def volumes(n=2, seed=0):
    rng = np.random.default_rng(seed)
    return [Volume(f"p{i}", "ED", rng.random((3, 32, 32), dtype=np.float32)) for i in range(n)]


def test_unet_spread_of_a_bare_encoder_is_the_bottleneck_pooled_as_the_head_pools_it():
    torch.manual_seed(0)
    enc = UNetEncoder(TINY_FEATURES).train()
    enc(torch.rand(4, 1, 32, 32))  # BatchNorm statistics of one batch: measured with them, as they are
    vols = volumes()
    x = torch.cat([torch.from_numpy(v.image) for v in vols]).unsqueeze(1)  # 6 slices
    enc.eval()
    with torch.no_grad():
        h = enc(x)  # [6, 16, 2, 2] at 32 px: the 2 x 2 grid is the map itself, flattened to 64 features
        expected = F.normalize(h.flatten(1), dim=1).std(dim=0, unbiased=False).mean().item()
    enc.train()
    got = unet_spread(enc, vols, batch_size=4)
    assert got.value == pytest.approx(expected, abs=1e-6) and got.n == 6 and got.reference == pytest.approx(1 / 8)
    assert enc.training  # its mode restored


def test_a_random_batch_norm_encoder_is_measured_with_the_statistics_of_the_slices():
    """Issue 44: a random encoder's BatchNorm layers have no statistics (mean 0, variance 1, so evaluation mode would
    not normalise); it is measured as a copy whose layers hold the statistics of the measured slices, batch by batch
    with equal weights, and the caller's encoder is left as it was."""
    import copy

    from fedssl.models.unet import unset_batch_norms

    torch.manual_seed(0)
    enc = UNetEncoder(TINY_FEATURES)
    vols = volumes()
    x = torch.cat([torch.from_numpy(v.image) for v in vols]).unsqueeze(1)  # 6 slices
    filled = copy.deepcopy(enc)
    assert fill_batch_statistics(filled, [x[:4], x[4:]]) == 10 and not unset_batch_norms(filled)
    bn = filled.conv_0.conv_0.adn.N
    assert int(bn.num_batches_tracked) == 2 and bn.momentum == enc.conv_0.conv_0.adn.N.momentum
    with torch.no_grad():
        conv = enc.conv_0.conv_0.conv
        means = torch.stack([conv(x[:4]).mean(dim=(0, 2, 3)), conv(x[4:]).mean(dim=(0, 2, 3))])
    torch.testing.assert_close(bn.running_mean, means.mean(0))  # equal weights over the 2 batches
    with torch.no_grad():
        expected = F.normalize(filled.eval()(x).flatten(1), dim=1).std(dim=0, unbiased=False).mean().item()
    assert unet_spread(enc, vols, batch_size=4).value == pytest.approx(expected, abs=1e-6)
    assert len(unset_batch_norms(enc)) == 10  # the caller's encoder untouched


def test_unet_spread_uses_the_projection_and_sees_a_collapsed_head():
    torch.manual_seed(0)
    net = ContrastiveNet(TINY_FEATURES, proj_dim=8, image_size=32)
    assert unet_features(net, volumes()).shape == (6, 8)
    with torch.no_grad():  # every input -> the same projection (0: the flatten head has no bias): collapse
        net.head[2].weight.zero_()
    assert unet_spread(net, volumes()).value == 0.0


def test_unet_discrimination_views_groups_and_subset_against_a_direct_computation():
    """Two augmented views of each slice from a generator seeded with ``seed``, the projection in eval mode, negatives
    the other patients' slices: 3 patients x 2 phases x 3 slices = 18 slices, each with 12 negatives."""
    torch.manual_seed(0)
    net = ContrastiveNet(TINY_FEATURES, proj_dim=8, image_size=32).train()
    rng = np.random.default_rng(0)
    vols = [Volume(f"p{p}", ph, rng.random((3, 32, 32), dtype=np.float32)) for p in range(3) for ph in ("ED", "ES")]
    x = torch.cat([torch.from_numpy(v.image) for v in vols]).unsqueeze(1)
    fill_batch_statistics(net, [x])  # BatchNorm statistics of the slices: measured with them, as they are
    g = torch.Generator().manual_seed(5)
    v1, v2 = augment_views(x, g), augment_views(x, g)
    with torch.no_grad():
        expected = instance_discrimination(net.eval()(v1), net(v2), 0.1, torch.arange(3).repeat_interleave(6))
    net.train()
    got = unet_discrimination(net, vols, seed=5, batch_size=4)
    assert got.loss == pytest.approx(expected.loss, abs=1e-5) and got.top1 == pytest.approx(expected.top1)
    assert got.n == 18 and got.chance == pytest.approx(math.log(13)) and net.training
    assert unet_discrimination(net, vols, seed=6).loss != pytest.approx(got.loss, abs=1e-6)  # other views
    sub = unet_discrimination(net, vols, seed=5, max_inputs=6)  # slices 0, 3, 7, 10, 14, 17: patients 0 0 1 1 2 2
    assert sub.n == 6 and sub.chance == pytest.approx(math.log(5))
    with torch.no_grad():  # collapsed head: chance exactly
        net.head[2].weight.zero_()
    assert unet_discrimination(net, vols).loss == pytest.approx(math.log(13), abs=1e-5)
    with pytest.raises(ValueError, match="max_inputs=1: must be an integer >= 2"):
        unet_discrimination(net, vols, max_inputs=1)


def test_slice_partitions_are_the_pretraining_partitions():
    """Volumes of 5 and 4 slices, 2 patients: partitions as PartitionSampleDataset splits them (5 -> 2 1 1 1; 4 -> 1 1 1
    1), patients by sorted id."""
    rng = np.random.default_rng(0)
    vols = [Volume("pB", "ED", rng.random((5, 8, 8), dtype=np.float32)),
            Volume("pA", "ED", rng.random((4, 8, 8), dtype=np.float32))]
    part, patient = slice_partitions(vols, 4)
    assert part.tolist() == [0, 0, 1, 2, 3, 0, 1, 2, 3] and patient.tolist() == [1, 1, 1, 1, 1, 0, 0, 0, 0]
    ds = PartitionSampleDataset(vols, 4, seed=0)
    drawn = ds.slice_indices(0)  # one slice from each partition of volume 0
    assert [part[i].item() for i in drawn] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="n_partitions=1: must be an integer >= 2"):
        slice_partitions(vols, 1)


def test_unet_position_knn_against_a_direct_computation():
    torch.manual_seed(0)
    enc = UNetEncoder(TINY_FEATURES)
    rng = np.random.default_rng(1)
    vols = [Volume(f"p{p}", "ED", rng.random((4, 32, 32), dtype=np.float32)) for p in range(4)]
    part, patient = slice_partitions(vols, 4)
    expected = knn_accuracy(unet_features(enc, vols), part, patient, 3)
    assert unet_position_knn(enc, vols, k=3) == pytest.approx(expected)
    # slices whose intensity grows with their position: a bare mean-intensity feature finds the position
    ramp = [Volume(f"p{p}", "ED", np.stack([np.full((32, 32), (z + 1) / 5, np.float32) for z in range(4)]))
            for p in range(4)]

    class Mean(torch.nn.Module):
        def forward(self, x):
            return torch.cat([x.mean(dim=(1, 2, 3)).unsqueeze(1), torch.ones(len(x), 1)], dim=1)

    assert unet_position_knn(Mean(), ramp, k=3) == 1.0


def test_vit_spread_averages_the_patch_tokens_without_the_class_token_in_eval_mode():
    """Eval mode: no drop path (0.1 here), so the spread is a property of the encoder, not of a random draw."""
    model = ViTClassifier(2, **TINY_VIT, drop_path_rate=0.1, seed=0)
    images = torch.randn(6, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        tokens = model.eval().encoder.forward_features(images)  # [6, 1 + 64, 48]
    expected = F.normalize(tokens[:, 1:].mean(dim=1), dim=1).std(dim=0, unbiased=False).mean().item()
    got = vit_spread(model.train(), images, batch_size=4)
    assert got.value == pytest.approx(expected, abs=1e-6) and got.reference == pytest.approx(1 / math.sqrt(48))
    assert model.training
    with pytest.raises(ValueError, match="no ViT 'encoder'"):
        vit_spread(UNetEncoder(TINY_FEATURES), images)
