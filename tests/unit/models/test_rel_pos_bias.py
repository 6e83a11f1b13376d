"""BEiT's relative position bias (issue 47, fedssl.models.vit): the index table by hand, the bias added to the
attention logits, "shared" (one table for every block, Fed-BEiT pre-training) and "per_layer" (a table per block,
Fed-BEiT fine-tuning, each a copy of the pre-training's shared table when loaded), and the load errors.

Reference: rui-yan/SSL-FL code/fed_beit/modeling_finetune.py (``RelativePositionBias``, ``Attention``),
code/fed_beit/run_beit_pretrain_FedAvg.py (``use_shared_rel_pos_bias``), code/fed_beit/run_class_finetune_FedAvg.py
(``use_rel_pos_bias``), code/util/FedAvg_utils.py (the shared table copied into every block)."""

import math

import pytest
import torch

from fedssl.models.vit import (
    REL_POS_BIAS,
    SHARED_REL_POS_TABLE,
    TINY_DECODER,
    TINY_VIT,
    BEiTViT,
    MAEViT,
    RelativePositionBias,
    ViTClassifier,
    load_pretrained_encoder,
    relative_position_index,
)
from fedssl.models.vit_classifier import FineTuneViT
from fedssl.train.classifier import ClassifierSettings
from fedssl.train.mim import MIMSettings, build_mim_model

torch.set_num_threads(1)

#: 8 px images, 4 px patches: a 2 x 2 patch grid (patches p0 (0,0), p1 (0,1), p2 (1,0), p3 (1,1)), one head
GRID2 = dict(image_size=8, patch_size=4, embed_dim=4, num_heads=1)
PER_LAYER = "encoder.blocks.{}.attn.rel_pos_bias.relative_position_bias_table"


def tables(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if k.endswith("relative_position_bias_table")}


# ------------------------------------------------------------------------------------------------ the index table
def test_index_table_of_a_2x2_grid_by_hand():
    """T = (2*2-1)(2*2-1) + 3 = 12 rows.  Patch (r, c) -> (r', c'): row (r - r' + 1) * 3 + (c - c' + 1), e.g.
    p0 (0,0) -> p1 (0,1): (0+1)*3 + (-1+1) = 3, p1 -> p0: 3 + 2 = 5, p0 -> p3 (1,1): 0; class token -> patch 9,
    patch -> class token 10, class token -> class token 11 (query = row, key = column, class token first)."""
    expected = torch.tensor([
        [11, 9, 9, 9, 9],
        [10, 4, 3, 1, 0],
        [10, 5, 4, 2, 1],
        [10, 7, 6, 4, 3],
        [10, 8, 7, 5, 4],
    ])
    assert torch.equal(relative_position_index(2, 2), expected)
    bias = RelativePositionBias((2, 2), num_heads=1)
    assert tuple(bias.relative_position_bias_table.shape) == (12, 1)
    assert torch.equal(bias.relative_position_bias_table, torch.zeros(12, 1))  # BEiT: zero at the start


def test_index_table_of_a_2x3_grid_uses_every_row_once_per_offset():
    """(2*2-1)(2*3-1) = 15 relative offsets + 3 class-token rows; two pairs share a row iff they share the offset."""
    index = relative_position_index(2, 3)
    assert index.shape == (7, 7) and sorted(set(index.flatten().tolist())) == list(range(18))
    coords = [(r, c) for r in range(2) for c in range(3)]
    for i, a in enumerate(coords):
        for j, b in enumerate(coords):
            assert index[i + 1, j + 1] == (a[0] - b[0] + 1) * 5 + (a[1] - b[1] + 2)


def test_bias_reads_the_table_per_head_through_the_index():
    bias = RelativePositionBias((2, 2), num_heads=2)
    with torch.no_grad():
        bias.relative_position_bias_table.copy_(torch.arange(24, dtype=torch.float32).reshape(12, 2))
    b = bias()  # [heads, 5, 5]
    index = relative_position_index(2, 2)
    assert b.shape == (2, 5, 5)
    assert torch.equal(b[0], 2.0 * index) and torch.equal(b[1], 2.0 * index + 1)
    assert "relative_position_index" not in bias.state_dict()  # never sent, never averaged


# ----------------------------------------------------------------------------------- added to the attention logits
def _manual_block(blk, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """One timm block by hand: logits = q k^T / sqrt(d) + bias, softmax over the keys."""
    attn = blk.attn
    b, n, d = x.shape
    h = attn.num_heads
    qkv = attn.qkv(blk.norm1(x)).reshape(b, n, 3, h, d // h).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    logits = q @ k.transpose(-2, -1) / math.sqrt(d // h) + bias
    y = (logits.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, n, d)
    x = x + blk.ls1(attn.proj(y))
    return x + blk.ls2(blk.mlp(blk.norm2(x)))


@pytest.mark.parametrize("fused", [True, False])
def test_a_known_bias_changes_the_attention_logits_by_exactly_its_value(fused):
    """Row 3 of the table (offset (0, -1): p0 -> p1 and p2 -> p3) set to 0.7: the logits of exactly those two
    (query, key) pairs grow by 0.7; the other direction (row 5) does not."""
    model = ViTClassifier(2, **GRID2, depth=1, drop_path_rate=0.0, rel_pos_bias="shared").eval()
    enc = model.encoder
    for m in enc.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = fused
    with torch.no_grad():
        enc.rel_pos_bias.relative_position_bias_table[3, 0] = 0.7
        enc.blocks[0].attn.proj.weight.mul_(100.0)  # a large attention output: a wrong bias shows at once
    expected_bias = torch.zeros(1, 1, 5, 5)
    expected_bias[0, 0, 1, 2] = expected_bias[0, 0, 3, 4] = 0.7
    assert torch.equal(enc.attention_biases()[0], expected_bias)
    x = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = enc.run_blocks(x)
        torch.testing.assert_close(out, _manual_block(enc.blocks[0], x, expected_bias), atol=1e-4, rtol=1e-5)
        no_bias = _manual_block(enc.blocks[0], x, torch.zeros(1, 1, 5, 5))
        transposed = _manual_block(enc.blocks[0], x, expected_bias.transpose(-2, -1))
    assert (out - no_bias).abs().max() > 1e-2 and (out - transposed).abs().max() > 1e-2
    # forward_features (what ViTClassifier and the feature probes call) runs the same biased blocks
    img = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        tokens = enc.norm_pre(enc._pos_embed(enc.patch_embed(img)))
        torch.testing.assert_close(enc.forward_features(img), enc.norm(_manual_block(enc.blocks[0], tokens,
                                                                                    expected_bias)),
                                   atol=1e-4, rtol=1e-5)


def test_bias_table_learns():
    model = BEiTViT(**GRID2, depth=2, vocab_size=4, drop_path_rate=0.0, rel_pos_bias="shared")
    mask = torch.tensor([[True, False, False, True]] * 2)
    model(torch.randn(2, 3, 8, 8), mask).logsumexp(dim=-1).sum().backward()
    assert model.encoder.rel_pos_bias.relative_position_bias_table.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------- shared / per layer
def _record_masks(enc) -> list:
    seen = []
    for i, blk in enumerate(enc.blocks):
        def forward(x, attn_mask=None, _f=blk.forward, _i=i, **kw):
            seen.append((_i, attn_mask))
            return _f(x, attn_mask=attn_mask, **kw)
        blk.forward = forward
    return seen


def test_shared_is_one_parameter_used_by_every_block():
    model = BEiTViT(**GRID2, depth=3, vocab_size=4, drop_path_rate=0.0, rel_pos_bias="shared")
    names = [n for n, _ in model.named_parameters()]
    assert [n for n in names if "relative_position" in n] == [SHARED_REL_POS_TABLE]
    with torch.no_grad():
        model.encoder.rel_pos_bias.relative_position_bias_table.copy_(torch.linspace(-1, 1, 12).reshape(12, 1))
    seen = _record_masks(model.encoder)
    model(torch.randn(1, 3, 8, 8), torch.tensor([[True, False, False, False]]))
    shared = model.encoder.rel_pos_bias().unsqueeze(0)
    assert [i for i, _ in seen] == [0, 1, 2]
    assert all(m is not None and torch.equal(m, shared) for _, m in seen)


def test_per_layer_gives_each_block_its_own_table():
    model = ViTClassifier(2, **GRID2, depth=3, drop_path_rate=0.0, rel_pos_bias="per_layer")
    assert sorted(tables(model)) == [PER_LAYER.format(i) for i in range(3)]
    with torch.no_grad():
        for i, blk in enumerate(model.encoder.blocks):
            blk.attn.rel_pos_bias.relative_position_bias_table.fill_(float(i + 1))
    seen = _record_masks(model.encoder)
    model(torch.randn(1, 3, 8, 8))
    assert [(i, torch.unique(m).tolist()) for i, m in seen] == [(0, [1.0]), (1, [2.0]), (2, [3.0])]


def test_defaults_stay_the_plain_vit():
    """Fed-MAE and the generic classifier are unaffected: no table, timm's block path."""
    for model in (MAEViT(**TINY_VIT, **TINY_DECODER), BEiTViT(**TINY_VIT, vocab_size=8), ViTClassifier(2, **TINY_VIT)):
        assert tables(model) == {} and model.encoder.rel_pos_bias is None
        assert model.encoder.rel_pos_bias_type == "none"
    plain = ViTClassifier(2, **GRID2, depth=2)
    seen = _record_masks(plain.encoder)
    plain(torch.randn(1, 3, 8, 8))
    assert seen == [(0, None), (1, None)]


def test_the_switch_leaves_the_random_start_of_the_other_weights_alone():
    plain, shared = (BEiTViT(**TINY_VIT, vocab_size=8, rel_pos_bias=r).state_dict() for r in ("none", "shared"))
    assert set(shared) - set(plain) == {SHARED_REL_POS_TABLE}
    assert all(torch.equal(plain[k], shared[k]) for k in plain)


@pytest.mark.parametrize("name, build", [
    ("BEiTViT", lambda v: BEiTViT(**TINY_VIT, vocab_size=8, rel_pos_bias=v)),
    ("ViTClassifier", lambda v: ViTClassifier(2, **TINY_VIT, rel_pos_bias=v)),
    ("FineTuneViT", lambda v: FineTuneViT(num_classes=2, **TINY_VIT, rel_pos_bias=v)),
    ("C", lambda v: ClassifierSettings(rel_pos_bias=v).check("C")),
    ("M", lambda v: MIMSettings(method="beit", rel_pos_bias=v).check("M")),
])
@pytest.mark.parametrize("bad", ["per-layer", "Shared", None, True])
def test_a_bad_switch_names_component_argument_value_and_fix(name, build, bad):
    with pytest.raises(ValueError, match=rf"^{name}: argument rel_pos_bias={bad!r} is invalid; use one of \['none', "):
        build(bad)
    assert REL_POS_BIAS == ("none", "shared", "per_layer")


def test_the_pretraining_settings_build_fed_beit_with_the_shared_table():
    MIMSettings(method="beit", rel_pos_bias="shared").check("M")
    assert SHARED_REL_POS_TABLE in build_mim_model("beit", **TINY_VIT, decoder_embed_dim=32, decoder_depth=1,
                                                   decoder_num_heads=2, norm_pix_loss=True, vocab_size=8, seed=0,
                                                   rel_pos_bias="shared").state_dict()
    with pytest.raises(ValueError, match=r"^M: argument rel_pos_bias='shared' is invalid; use \"none\" for method"):
        MIMSettings(method="mae", rel_pos_bias="shared").check("M")


# ------------------------------------------------------------------------------------ loading a pre-trained encoder
def _pretrained_shared(seed: int = 0) -> dict:
    beit = BEiTViT(**TINY_VIT, vocab_size=8, rel_pos_bias="shared", seed=seed)
    with torch.no_grad():
        beit.encoder.rel_pos_bias.relative_position_bias_table.normal_(generator=torch.Generator().manual_seed(seed))
    return beit.state_dict()


def test_per_layer_fine_tuning_starts_from_copies_of_the_shared_table():
    state = _pretrained_shared()
    clf = ViTClassifier(2, **TINY_VIT, layer_scale=0.1, rel_pos_bias="per_layer")
    report = load_pretrained_encoder(clf, state)
    own = tables(clf)
    assert sorted(own) == [PER_LAYER.format(i) for i in range(TINY_VIT["depth"])]
    assert all(torch.equal(v, state[SHARED_REL_POS_TABLE]) for v in own.values())
    assert report["rel_pos_bias"] == "shared table copied into 2 blocks"
    assert SHARED_REL_POS_TABLE not in report["ignored"] and report["loaded"] == len(
        [k for k in clf.state_dict() if k.startswith("encoder.")])
    b0 = clf.encoder.blocks[0].attn.rel_pos_bias.relative_position_bias_table
    b1 = clf.encoder.blocks[1].attn.rel_pos_bias.relative_position_bias_table
    assert b0.data_ptr() != b1.data_ptr()  # copies: each block's table then learns on its own


def test_shared_into_shared_and_through_a_file(tmp_path):
    state = _pretrained_shared(3)
    torch.save({"model": state}, tmp_path / "FL_global_model.pt")
    clf = FineTuneViT(num_classes=2, **TINY_VIT, layer_scale=0.1, rel_pos_bias="per_layer",
                      pretrained_path=str(tmp_path / "FL_global_model.pt"))
    assert torch.equal(tables(clf)[PER_LAYER.format(1)], state[SHARED_REL_POS_TABLE])
    same = ViTClassifier(2, **TINY_VIT, layer_scale=0.1, rel_pos_bias="shared")
    assert load_pretrained_encoder(same, state)["rel_pos_bias"] == "1 table loaded"
    assert torch.equal(tables(same)[SHARED_REL_POS_TABLE], state[SHARED_REL_POS_TABLE])


def test_an_encoder_without_tables_leaves_them_at_zero():
    """A Fed-MAE / ImageNet encoder in a per-layer classifier: no bias at the start (BEiT's non-strict load)."""
    clf = ViTClassifier(2, **TINY_VIT, rel_pos_bias="per_layer")
    report = load_pretrained_encoder(clf, MAEViT(**TINY_VIT, **TINY_DECODER).state_dict())
    assert all(torch.equal(v, torch.zeros_like(v)) for v in tables(clf).values())
    assert set(tables(clf)) <= set(report["missing"])


def _one_line_error(clf, state, match):
    with pytest.raises(ValueError, match=match) as e:
        load_pretrained_encoder(clf, state)
    assert "\n" not in str(e.value)


def test_load_errors_are_one_line():
    state = _pretrained_shared()
    _one_line_error(ViTClassifier(2, **TINY_VIT, layer_scale=0.1), state,
                    r"has a relative position bias .* build it with rel_pos_bias=\"per_layer\"")
    per_layer = ViTClassifier(2, **TINY_VIT, layer_scale=0.1, rel_pos_bias="per_layer").state_dict()
    _one_line_error(ViTClassifier(2, **TINY_VIT, layer_scale=0.1, rel_pos_bias="shared"), per_layer,
                    r"one relative position bias table per block .* rel_pos_bias=\"per_layer\"")
    other_grid = BEiTViT(**{**TINY_VIT, "image_size": 16}, vocab_size=8, rel_pos_bias="shared").state_dict()
    _one_line_error(ViTClassifier(2, **TINY_VIT, layer_scale=0.1, rel_pos_bias="per_layer"), other_grid,
                    r"'encoder\.rel_pos_bias\.relative_position_bias_table' has shape \(52, 3\) but the classifier's "
                    r"tables expect \(228, 3\)")
    other_heads = BEiTViT(**{**TINY_VIT, "num_heads": 4}, vocab_size=8, rel_pos_bias="shared").state_dict()
    _one_line_error(ViTClassifier(2, **TINY_VIT, layer_scale=0.1, rel_pos_bias="shared"), other_heads,
                    r"'encoder\.rel_pos_bias\.relative_position_bias_table' has shape \(228, 4\) but the classifier "
                    r"expects \(228, 3\)")


def test_index_buffer_follows_the_model_and_stays_out_of_the_state_dict():
    clf = ViTClassifier(2, **TINY_VIT, rel_pos_bias="per_layer").to(torch.float64)
    assert not any("relative_position_index" in k for k in clf.state_dict())
    idx = clf.encoder.blocks[0].attn.rel_pos_bias.relative_position_index
    assert idx.dtype == torch.long and idx.shape == (65, 65)
    assert clf(torch.randn(1, 3, 32, 32, dtype=torch.float64)).dtype == torch.float64


# ---------------------------------------------------------------------------- the sites' trainers build the switch
@pytest.fixture(scope="module")
def records(tmp_path_factory):
    from fedssl.data.image_synthetic import write_synthetic_images
    from fedssl.data.images import load_image_records

    root = tmp_path_factory.mktemp("retina")
    write_synthetic_images(root, "retina", n_images=20, seed=0, image_size=32)
    return load_image_records(str(root), "retina", site="site-1")


def test_the_site_trainers_build_the_jobs_switch(records, tmp_path):
    """A Fed-BEiT site pre-trains with the shared table (jobs/sslfl_beit_retina), a fine-tuning site of a Fed-BEiT
    encoder builds one table per block: what the server's model component has, so the broadcast loads."""
    from fedssl.core.tokenizer import PatchTokenizer
    from fedssl.train.classifier import ClassifierLocalTrainer
    from fedssl.train.mim import MIMLocalTrainer

    codebook = str(tmp_path / "codebook.pt")
    PatchTokenizer(torch.randn(8, 48, generator=torch.Generator().manual_seed(0)), 4).save(codebook)
    mim = MIMLocalTrainer(records, MIMSettings(method="beit", **TINY_VIT, vocab_size=8, batch_size=4, mask_ratio=0.4,
                                               tokenizer_path=codebook, rel_pos_bias="shared", warmup_rounds=0),
                          num_rounds=1)
    server = BEiTViT(**TINY_VIT, vocab_size=8, rel_pos_bias="shared")
    assert sorted(tables(mim.model)) == [SHARED_REL_POS_TABLE] and set(mim.model.state_dict()) == set(
        server.state_dict())
    clf = ClassifierLocalTrainer(records, ClassifierSettings(**TINY_VIT, layer_scale=0.1, rel_pos_bias="per_layer",
                                                             batch_size=4, val_fraction=0.2, warmup_rounds=0),
                                 num_rounds=1)
    assert sorted(tables(clf.model)) == [PER_LAYER.format(i) for i in range(TINY_VIT["depth"])]
    assert set(clf.model.state_dict()) == set(FineTuneViT(num_classes=2, **TINY_VIT, layer_scale=0.1,
                                                          rel_pos_bias="per_layer").state_dict())
