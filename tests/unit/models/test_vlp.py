"""FedDRA's dual encoder (fedssl.models.vlp): shapes and norms, the stage-1 prefix contract with hand-counted
parameters, one alignment block per modality, the text attention mask, seeding, and local pre-trained weights."""

from __future__ import annotations

import json

import pytest
import torch
from timm.models.vision_transformer import Block
from transformers import BertConfig, BertModel
from transformers.models.bert.modeling_bert import BertLayer

from fedssl.models.vlp import (
    ALIGNMENT_PREFIXES,
    VLP_PRESETS,
    VisionLanguageModel,
    build_vlp_model,
    check_model_args,
    vlp_model_from_args,
    vlp_param_counts,
)

# tiny preset: ViT width 32, 1 block, 16 patches of 8 x 8 x 3; BERT hidden 32, 1 layer, intermediate 64,
# 64 positions, 128 words; projections to 128.
D, H, FF, V, P = 32, 32, 64, 128, 128
VIT_BLOCK = 12 * D * D + 13 * D  # qkv 3D^2+3D, proj D^2+D, fc1 4D^2+4D, fc2 4D^2+D, 2 LayerNorms 4D
BERT_LAYER = 4 * H * H + 4 * H + 2 * H * FF + FF + H + 4 * H  # q,k,v,out; fc in/out; 2 LayerNorms


@pytest.fixture(scope="module")
def tiny():
    return build_vlp_model("tiny", seed=0).eval()


def _text(batch: int = 2, length: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, V, (batch, length), generator=g)
    ids[:, 0], ids[:, -1] = 2, 3  # [CLS] ... [SEP]
    return ids, torch.ones(batch, length, dtype=torch.long)


def test_outputs_have_the_right_shapes_and_unit_norm(tiny):
    images = torch.randn(3, 3, 32, 32)
    ids, mask = _text(3)
    with torch.no_grad():
        z_img, z_txt = tiny(images, ids, mask)
        feats = tiny.image_features(images)
    assert z_img.shape == (3, P) and z_txt.shape == (3, P) and feats.shape == (3, D)
    assert torch.allclose(z_img.norm(dim=1), torch.ones(3), atol=1e-5)
    assert torch.allclose(z_txt.norm(dim=1), torch.ones(3), atol=1e-5)
    small_proj = build_vlp_model("tiny", proj_dim=16)
    assert small_proj.encode_image(images).shape == (3, 16)


def test_stage1_prefixes_cover_exactly_the_alignment_blocks_and_projections(tiny):
    by_prefix = {prefix: 0 for prefix in ALIGNMENT_PREFIXES}
    rest = {}
    for name, p in tiny.named_parameters():
        hit = [prefix for prefix in ALIGNMENT_PREFIXES if name.startswith(prefix)]
        if hit:
            by_prefix[hit[0]] += p.numel()
        else:
            top = name.split(".")[0]
            rest[top] = rest.get(top, 0) + p.numel()
    assert by_prefix == {"image_align.": VIT_BLOCK + 2 * D, "text_align.": BERT_LAYER,
                         "image_proj.": D * P + P, "text_proj.": H * P + P}
    # everything else is an encoder: patch embedding, class token, 1 + 16 positions, 1 block, final norm ...
    image_encoder = 3 * 8 * 8 * D + D + D + 17 * D + VIT_BLOCK + 2 * D
    # ... word / position / type embeddings, embedding LayerNorm, 1 layer
    text_encoder = V * H + 64 * H + 2 * H + 2 * H + BERT_LAYER
    assert rest == {"image_encoder": image_encoder, "text_encoder": text_encoder}
    counts = vlp_param_counts(tiny)
    assert counts["alignment"] == sum(by_prefix.values()) == 29760
    assert counts["encoders"] == image_encoder + text_encoder == 34336
    assert counts["total"] == counts["encoders"] + counts["alignment"]
    assert tiny.alignment_parameter_names() == [n for n, _ in tiny.named_parameters()
                                                if n.split(".")[0] in ("image_align", "text_align", "image_proj",
                                                                       "text_proj")]


def test_alignment_modules_are_one_block_of_the_encoder_width(tiny):
    blocks = [m for m in tiny.image_align.modules() if isinstance(m, Block)]
    assert len(blocks) == 1 and blocks[0].attn.qkv.in_features == tiny.image_encoder.embed_dim == D
    assert isinstance(tiny.text_align, BertLayer)
    assert tiny.text_align.attention.self.query.in_features == tiny.text_encoder.config.hidden_size == H
    # image_features = LayerNorm(Block(encoder tokens))[:, 0]
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        tokens = tiny.image_encoder.forward_features(images)
        manual = tiny.image_align.norm(blocks[0](tokens))[:, 0]
        assert tokens.shape == (2, 17, D)
        assert torch.allclose(tiny.image_features(images), manual, atol=1e-6)


def test_padding_changes_nothing_when_masked_and_matters_when_not(tiny):
    ids, mask = _text(1, 6)
    padded = torch.cat([ids, torch.zeros(1, 4, dtype=torch.long)], dim=1)  # [PAD] = 0
    padded_mask = torch.cat([mask, torch.zeros(1, 4, dtype=torch.long)], dim=1)
    with torch.no_grad():
        alone = tiny.encode_text(ids, mask)
        masked = tiny.encode_text(padded, padded_mask)
        unmasked = tiny.encode_text(padded, torch.ones_like(padded_mask))
    assert torch.allclose(alone, masked, atol=1e-6)  # (0 on CPU)
    assert (alone - unmasked).abs().max() > 1e-4  # attending 4 padding tokens moves the embedding (~1e-3 here)


def test_same_seed_same_weights_different_seed_different_weights():
    a, b, c = (build_vlp_model("tiny", seed=s) for s in (3, 3, 4))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    for key in ["image_encoder.blocks.0.attn.qkv.weight", "text_encoder.embeddings.word_embeddings.weight",
                "image_align.block.attn.qkv.weight", "text_align.attention.self.query.weight", "image_proj.weight",
                "text_proj.weight"]:
        assert not torch.equal(sa[key], sc[key]), key
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    build_vlp_model("tiny", seed=5)
    assert torch.equal(torch.rand(3), expected)  # the global RNG is left alone


def test_a_local_bert_folder_loads_through_text_weights(tmp_path):
    config = BertConfig(vocab_size=50, hidden_size=24, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=48, max_position_embeddings=40)
    torch.manual_seed(0)
    bert = BertModel(config, add_pooling_layer=False)
    folder = tmp_path / "bert"
    bert.save_pretrained(folder)
    model = build_vlp_model("tiny", text_weights=str(folder))
    own, saved = model.text_encoder.state_dict(), bert.state_dict()
    assert own.keys() == saved.keys() and all(torch.equal(own[k], saved[k]) for k in own)
    assert model.vocab_size == 50 and model.text_proj.in_features == 24
    assert model.text_align.attention.self.query.in_features == 24
    ids = torch.tensor([[2, 7, 49, 3]])
    assert model.encode_text(ids, torch.ones_like(ids)).shape == (1, P)
    with pytest.raises(ValueError, match="vocab_size=60"):
        build_vlp_model("tiny", vocab_size=60, text_weights=str(folder))
    with pytest.raises(ValueError, match="text_weights=.*nowhere"):
        build_vlp_model("tiny", text_weights=str(tmp_path / "nowhere"))


def test_image_weights_load_and_a_bad_file_is_named(tmp_path):
    source = build_vlp_model("tiny", seed=1)
    state = {k: v + 1.0 for k, v in source.image_encoder.state_dict().items()}
    good = tmp_path / "vit.pth"
    torch.save({**state, "head.weight": torch.zeros(10, D), "head.bias": torch.zeros(10)}, good)  # head dropped
    model = build_vlp_model("tiny", image_weights=str(good), seed=2)
    own = model.image_encoder.state_dict()
    assert all(torch.equal(own[k], state[k]) for k in state)
    wrong = tmp_path / "other.pth"
    torch.save({"conv1.weight": torch.zeros(8, 3, 3, 3)}, wrong)
    with pytest.raises(ValueError, match="other.pth.*unexpected keys \\['conv1.weight'\\]"):
        build_vlp_model("tiny", image_weights=str(wrong))
    narrow = tmp_path / "narrow.pth"
    torch.save({**state, "norm.weight": torch.ones(16)}, narrow)
    with pytest.raises(ValueError, match="narrow.pth.*'norm.weight' has shape \\(16,\\)"):
        build_vlp_model("tiny", image_weights=str(narrow))
    garbage = tmp_path / "garbage.pth"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="garbage.pth"):
        build_vlp_model("tiny", image_weights=str(garbage))
    with pytest.raises(ValueError, match="image_weights=.*missing.pth"):
        build_vlp_model("tiny", image_weights=str(tmp_path / "missing.pth"))


def test_json_args_build_the_model_and_bad_arguments_are_named():
    args = json.loads('{"preset": "tiny", "vocab_size": 40, "proj_dim": 8, "image_size": 48, "in_chans": 1, "seed": 7}')
    model = vlp_model_from_args(args)
    assert isinstance(model, VisionLanguageModel) and model.args["vocab_size"] == 40
    assert (model.vocab_size, model.proj_dim, model.image_size, model.in_chans) == (40, 8, 48, 1)
    assert model.image_encoder.patch_embed.proj.weight.shape == (D, 1, 8, 8)
    assert model.encode_image(torch.randn(2, 1, 48, 48)).shape == (2, 8)
    twin = VisionLanguageModel(**args)
    assert all(torch.equal(v, twin.state_dict()[k]) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="args=\\['depth'\\]"):
        vlp_model_from_args(args, depth=3)
    with pytest.raises(ValueError, match="preset='huge'.*'tiny', 'small', 'base'"):
        VisionLanguageModel(preset="huge")
    with pytest.raises(ValueError, match="proj_dim=0"):
        VisionLanguageModel(preset="tiny", proj_dim=0)
    with pytest.raises(ValueError, match="image_size=30"):
        VisionLanguageModel(preset="tiny", image_size=30)
    with pytest.raises(ValueError, match="image_size=30"):
        check_model_args(preset="tiny", image_size=30)  # the same checks without building
    check_model_args(**{k: v for k, v in args.items() if k != "seed"})
    with pytest.raises(ValueError, match="images of shape \\(2, 3, 32, 32\\)"):
        model.encode_image(torch.randn(2, 3, 32, 32))
    with pytest.raises(ValueError, match="input_ids span \\[2, 40\\]"):
        model.encode_text(torch.tensor([[2, 40]]), torch.ones(1, 2, dtype=torch.long))


def test_base_preset_is_the_papers_vit_b16_and_bert_base():
    base = VLP_PRESETS["base"]
    assert (base["image_size"], base["patch_size"], base["embed_dim"], base["depth"], base["num_heads"]) == \
        (224, 16, 768, 12, 12)
    assert (base["text_hidden"], base["text_layers"], base["text_heads"], base["text_intermediate"],
            base["max_position"], base["in_chans"]) == (768, 12, 12, 3072, 512, 3)


def test_token_features_share_the_global_embedding_and_expose_cls_attention():
    """GLoRIA / MGCA inputs: region and token features through the same projections, [CLS] attention rows."""
    from fedssl.models.vlp import VisionLanguageModel

    m = VisionLanguageModel(preset="tiny").eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 32, 32, generator=g)
    ids = torch.randint(5, 100, (2, 7), generator=g)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0
    z_img, regions, pa = m.encode_image_tokens(x)
    z_txt, tokens, ta = m.encode_text_tokens(ids, mask)
    a, b = m(x, ids, mask)
    assert torch.allclose(z_img, a, atol=1e-6) and torch.allclose(z_txt, b, atol=1e-6)
    assert regions.shape == (2, 16, m.proj_dim) and tokens.shape == (2, 7, m.proj_dim)
    full = m.image_proj(m.image_align(m.image_tokens(x)))
    assert torch.allclose(regions, full[:, 1:], atol=1e-6)
    assert torch.allclose(ta.sum(1), torch.ones(2), atol=1e-6) and ta[1, 5:].abs().max() == 0
    # the image [CLS] row equals the one timm's block computes
    blk = m.image_align.block
    blk.attn.fused_attn = False
    seen = {}
    blk.attn.attn_drop.register_forward_hook(lambda mod, inp, out: seen.setdefault("a", out))
    blk(m.image_tokens(x))
    assert torch.allclose(seen["a"][:, :, 0, 1:].mean(1), pa, atol=1e-6)
