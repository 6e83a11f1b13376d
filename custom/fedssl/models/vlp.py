"""Dual-encoder vision-language model of FedDRA (Shuai, Wu, Tang & Shen, "Distributionally Robust Alignment for
Medical Federated Vision-Language Pre-training Under Data Heterogeneity", TMLR), sections 4.2 and 5.1.3.

* ``image_encoder``: a timm ViT (Dosovitskiy et al., "An Image is Worth 16x16 Words: Transformers for Image Recognition
  at Scale", ICLR 2021) without classification head, returning all tokens ``[B, 1 + L, D]`` (final norm included);
* ``text_encoder``: a Hugging Face ``BertModel`` without pooler (Devlin et al., "BERT: Pre-training of Deep
  Bidirectional Transformers for Language Understanding", NAACL 2019), returning the last hidden states;
* ``image_align`` / ``text_align``: the "alignment modules" f_Psi, f_Phi of section 4.2: ONE extra transformer block
  per modality ("we employ an extra transformer block from ViT-base and Bert-base as the alignment module", 5.1.3):
  a timm ``Block`` of the encoder's width + a final LayerNorm on all image tokens, a ``BertLayer`` on the text
  encoder's last hidden states with the attention mask; the class token ([CLS]) of each is the feature;
* ``image_proj`` / ``text_proj``: linear maps to the shared space Z (``proj_dim``, default 128 as the reference code's
  ``emb_dim``); ``encode_image`` / ``encode_text`` return L2-normalised embeddings for an InfoNCE loss (the
  temperature, 0.07 fixed in the reference code, belongs to the loss).

Stage 1 of FedDRA's two-stage schema trains only the parameters under :data:`ALIGNMENT_PREFIXES` (alignment blocks and
projections) with frozen encoders; stage 2 trains everything.  The FLARE glue selects the stage-1 tensors by these
prefixes, so the submodule names are a contract.

Documented departures from the reference code (BioMed-AI-Lab-U-Michgan/TMLR_FedDRA, built on MGCA):

* the projections are single ``Linear`` layers instead of MGCA's Linear-BatchNorm-ReLU-Linear-BatchNorm "global
  embedding" (no BatchNorm statistics to federate, any batch size works);
* the text alignment layer receives the attention mask (the reference code calls it without one, so [CLS] also
  attends the padding); padded and unpadded copies of a sentence therefore embed identically here;
* the image alignment block is followed by a LayerNorm (timm ViTs are pre-norm; the reference code has none);
* alignment blocks are freshly initialised (the reference code also builds them from a randomly initialised
  ``BertModel(config)`` / ``ViTModel(config)``), with BERT's / timm's initialisation, from ``seed``.

Pre-trained encoders come from local files only (no download): ``text_weights`` is a Hugging Face BERT folder
(``config.json`` + weights, e.g. ``bert-base-uncased`` or Bio_ClinicalBERT saved with ``save_pretrained``) and fixes
the text width, depth and vocabulary; ``image_weights`` is a timm ViT state-dict file (``.pth`` / ``.bin`` /
``.safetensors``, DeiT / ``vit_base_patch16_224``; a Fed-MAE ``FL_global_model.pt``'s ``encoder.*`` also fits), read
with ``weights_only=True``.
"""

from __future__ import annotations

import os
from typing import Mapping

import torch
import torch.nn.functional as F
from timm.layers import LayerNorm, resample_abs_pos_embed
from timm.models import adapt_input_conv
from timm.models.vision_transformer import Block, VisionTransformer, init_weights_vit_timm
from torch import nn
from transformers import BertConfig, BertModel
from transformers.masking_utils import create_bidirectional_mask
from transformers.models.bert.modeling_bert import BertLayer

from fedssl.core.checks import require, require_choice, require_int
from fedssl.models.seeding import seeded
from fedssl.models.vit import check_vit_args, read_state_dict

_COMPONENT = "VisionLanguageModel"

#: Architectures.  ``vocab_size`` is only the default: pass the size of the vocabulary actually used
#: (``len(fedssl.data.vocab.build_wordpiece_vocab(...))``); a ``text_weights`` folder brings its own.
VLP_PRESETS: dict[str, dict] = {
    # unit tests: 16 patches of 8 px, one block per encoder
    "tiny": {"image_size": 32, "patch_size": 8, "in_chans": 3, "embed_dim": 32, "depth": 1, "num_heads": 2,
             "mlp_ratio": 4.0, "text_hidden": 32, "text_layers": 1, "text_heads": 2, "text_intermediate": 64,
             "max_position": 64, "vocab_size": 128},
    # quick CPU profile (ViT-Tiny width)
    "small": {"image_size": 64, "patch_size": 8, "in_chans": 3, "embed_dim": 192, "depth": 4, "num_heads": 3,
              "mlp_ratio": 4.0, "text_hidden": 192, "text_layers": 4, "text_heads": 3, "text_intermediate": 768,
              "max_position": 128, "vocab_size": 4096},
    # the paper (5.1.3): ViT-B/16 at 224 px and BERT-base (uncased vocabulary size)
    "base": {"image_size": 224, "patch_size": 16, "in_chans": 3, "embed_dim": 768, "depth": 12, "num_heads": 12,
             "mlp_ratio": 4.0, "text_hidden": 768, "text_layers": 12, "text_heads": 12, "text_intermediate": 3072,
             "max_position": 512, "vocab_size": 30522},
}

#: Parameter-name prefixes of the stage-1 trainable set (alignment blocks and projections); everything else is an
#: encoder parameter, frozen in stage 1.
ALIGNMENT_PREFIXES = ("image_align.", "text_align.", "image_proj.", "text_proj.")

#: The JSON arguments of :class:`VisionLanguageModel` (a FLARE component's ``args``).
MODEL_ARGS = ("preset", "vocab_size", "proj_dim", "image_size", "in_chans", "text_weights", "image_weights", "seed")

_PARTS = ("image_encoder", "text_encoder", "image_align", "text_align", "image_proj", "text_proj")


def is_alignment_parameter(name: str) -> bool:
    """True for a parameter / state-dict key of the stage-1 trainable set."""
    return name.startswith(ALIGNMENT_PREFIXES)


class ImageAlignment(nn.Module):
    """f_Psi: one pre-norm ViT ``Block`` over all tokens, then a LayerNorm; keys ``block.*``, ``norm.*``."""

    def __init__(self, width: int, num_heads: int, mlp_ratio: float):
        super().__init__()
        self.block = Block(width, num_heads, mlp_ratio, qkv_bias=True, norm_layer=LayerNorm)
        self.norm = LayerNorm(width)
        self.apply(init_weights_vit_timm)  # timm's ViT init: trunc-normal 0.02 Linear, zero bias, unit LayerNorm

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.norm(self.block(tokens))


def _init_bert_module(module: nn.Module, std: float) -> None:
    """BERT's initialisation (``BertPreTrainedModel._init_weights``)."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


def _vit(image_size: int, patch_size: int, in_chans: int, embed_dim: int, depth: int, num_heads: int,
         mlp_ratio: float) -> VisionTransformer:
    """A timm ViT without head (keys cls_token, pos_embed, patch_embed.proj.*, blocks.*, norm.*), like
    :func:`fedssl.models.vit._vit_encoder` but with ``in_chans`` (grey-scale X-rays need not be tripled)."""
    return VisionTransformer(img_size=image_size, patch_size=patch_size, in_chans=in_chans, num_classes=0,
                             global_pool="", embed_dim=embed_dim, depth=depth, num_heads=num_heads,
                             mlp_ratio=mlp_ratio, qkv_bias=True, class_token=True, final_norm=True, fc_norm=False)


def check_model_args(preset: str = "small", vocab_size: int = 0, proj_dim: int = 128, image_size: int = 0,
                     in_chans: int = 0, text_weights: str = "", image_weights: str = "", seed: int | None = 0) -> None:
    """Validate :class:`VisionLanguageModel`'s arguments without building it: a ValueError naming argument, value and
    fix (unknown preset, non-positive sizes, an image size that is not a multiple of the patch size, a weights path
    that does not exist)."""
    require_choice(_COMPONENT, "preset", preset, tuple(VLP_PRESETS))
    require_int(_COMPONENT, "vocab_size", vocab_size, 0,
                "pass the vocabulary size (len(vocab), at least 5: [PAD] [UNK] [CLS] [SEP] [MASK]) or 0 for the "
                "preset's / text_weights' size")
    require(vocab_size == 0 or vocab_size >= 5, _COMPONENT, "vocab_size", vocab_size,
            "a vocabulary holds at least the 5 special tokens; pass len(vocab) or 0")
    require_int(_COMPONENT, "proj_dim", proj_dim, 1, "pass a positive integer (the paper: 128)")
    require_int(_COMPONENT, "image_size", image_size, 0, "pass the input side in pixels, or 0 for the preset's")
    require_int(_COMPONENT, "in_chans", in_chans, 0,
                "pass the number of image channels (1 or 3), or 0 for the preset's")
    require(isinstance(text_weights, str), _COMPONENT, "text_weights", text_weights,
            "pass a local Hugging Face BERT folder path as a string, or '' for random initialisation")
    require(isinstance(image_weights, str), _COMPONENT, "image_weights", image_weights,
            "pass a local timm ViT state-dict file path as a string, or '' for random initialisation")
    if text_weights:
        require(os.path.isfile(os.path.join(text_weights, "config.json")), _COMPONENT, "text_weights", text_weights,
                "pass a local folder holding config.json and the weights of a BERT model (save_pretrained output); "
                "nothing is downloaded")
    if image_weights:
        require(os.path.isfile(image_weights), _COMPONENT, "image_weights", image_weights,
                "pass an existing timm ViT state-dict file (.pth / .bin / .safetensors); nothing is downloaded")
    require(seed is None or (isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0), _COMPONENT,
            "seed", seed, "pass a non-negative integer (or None for the global RNG)")
    p = VLP_PRESETS[preset]
    check_vit_args(image_size or p["image_size"], p["patch_size"], p["embed_dim"], p["num_heads"],
                   f"{_COMPONENT}({preset!r})")


def _load_bert(path: str, vocab_size: int) -> BertModel:
    try:
        model, info = BertModel.from_pretrained(path, local_files_only=True, add_pooling_layer=False,
                                                output_loading_info=True, dtype=torch.float32)
    except (OSError, ValueError, RuntimeError) as e:
        raise ValueError(f"{_COMPONENT}: text_weights={path!r} cannot be loaded as a BERT model ({e}); pass a "
                         "folder written by BertModel/BertForMaskedLM.save_pretrained") from None
    missing = [k for k in info.get("missing_keys", []) if not k.startswith("pooler.")]
    mismatched = info.get("mismatched_keys", [])
    require(not missing and not mismatched and model.config.model_type == "bert", _COMPONENT, "text_weights", path,
            f"the folder's weights do not fit a BertModel (missing {sorted(missing)[:4]}, mismatched "
            f"{[m[0] if isinstance(m, tuple) else m for m in mismatched][:4]}); pass a BERT checkpoint folder")
    require(vocab_size in (0, model.config.vocab_size), _COMPONENT, "vocab_size", vocab_size,
            f"the BERT in {path!r} has a vocabulary of {model.config.vocab_size}; pass 0 (or that size) and tokenise "
            "with the folder's tokenizer")
    return model.float()


def _image_state(path: str) -> dict:
    """The ViT tensors of a checkpoint file, timm names (prefix ``image_encoder.`` / ``encoder.`` stripped, head
    dropped)."""
    state = read_state_dict(path)  # ValueError naming the file: missing, not weights, a pickle payload, no state dict
    for prefix in ("image_encoder.", "encoder."):
        if any(k.startswith(prefix) for k in state):
            state = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
            break
    return {k: v for k, v in state.items() if not k.startswith(("head.", "head_drop."))}


def _load_vit(encoder: VisionTransformer, path: str) -> None:
    state = _image_state(path)
    own = encoder.state_dict()
    unexpected, missing = sorted(set(state) - set(own)), sorted(set(own) - set(state))
    if unexpected or missing:
        raise ValueError(
            f"{_COMPONENT}: image_weights={path!r} does not fit the image encoder (unexpected keys {unexpected[:4]}, "
            f"missing keys {missing[:4]}); pass a timm ViT state dict of the preset's depth (timm names: cls_token, "
            "pos_embed, patch_embed.proj.*, blocks.<i>.*, norm.*)")
    for k, v in state.items():
        v = v.float()
        if k == "pos_embed" and v.dim() == 3 and v.shape[-1] == own[k].shape[-1] and v.shape != own[k].shape:
            v = resample_abs_pos_embed(v, new_size=list(encoder.patch_embed.grid_size), num_prefix_tokens=1)
        if k == "patch_embed.proj.weight" and v.dim() == 4 and v.shape[1] != own[k].shape[1]:
            v = adapt_input_conv(own[k].shape[1], v)  # RGB filters -> grey-scale (sum) or repeated
        if tuple(v.shape) != tuple(own[k].shape):
            raise ValueError(f"{_COMPONENT}: image_weights={path!r}: {k!r} has shape {tuple(v.shape)}, the image "
                             f"encoder expects {tuple(own[k].shape)}; use the preset of the checkpoint's width / "
                             "patch size")
        own[k] = v
    encoder.load_state_dict(own)


class VisionLanguageModel(nn.Module):
    """FedDRA's dual encoder (see the module docstring); constructible from JSON arguments (a FLARE component).

    ``preset``: a key of :data:`VLP_PRESETS`; ``vocab_size``, ``image_size``, ``in_chans``: 0 = the preset's value;
    ``proj_dim``: width of the shared space; ``text_weights``: a local Hugging Face BERT folder (its config replaces
    the preset's text architecture); ``image_weights``: a local timm ViT state-dict file; ``seed``: initial weights
    (every randomly initialised tensor) drawn from it, the global RNG left untouched.
    """

    def __init__(self, preset: str = "small", vocab_size: int = 0, proj_dim: int = 128, image_size: int = 0,
                 in_chans: int = 0, text_weights: str = "", image_weights: str = "", seed: int | None = 0):
        super().__init__()
        check_model_args(preset, vocab_size, proj_dim, image_size, in_chans, text_weights, image_weights, seed)
        p = VLP_PRESETS[preset]
        image_size, in_chans = image_size or p["image_size"], in_chans or p["in_chans"]
        self.args = {"preset": preset, "vocab_size": vocab_size, "proj_dim": proj_dim, "image_size": image_size,
                     "in_chans": in_chans, "text_weights": text_weights, "image_weights": image_weights, "seed": seed}
        self.preset, self.proj_dim, self.image_size, self.in_chans = preset, proj_dim, image_size, in_chans
        self.text_weights, self.image_weights, self.seed = text_weights, image_weights, seed
        self.patch_size, self.image_width = p["patch_size"], p["embed_dim"]
        with seeded(seed):
            self.image_encoder = _vit(image_size, p["patch_size"], in_chans, p["embed_dim"], p["depth"],
                                      p["num_heads"], p["mlp_ratio"])
            if image_weights:
                _load_vit(self.image_encoder, image_weights)
            if text_weights:
                self.text_encoder = _load_bert(text_weights, vocab_size)
            else:
                config = BertConfig(vocab_size=vocab_size or p["vocab_size"], hidden_size=p["text_hidden"],
                                    num_hidden_layers=p["text_layers"], num_attention_heads=p["text_heads"],
                                    intermediate_size=p["text_intermediate"],
                                    max_position_embeddings=p["max_position"], pad_token_id=0)
                self.text_encoder = BertModel(config, add_pooling_layer=False)
            cfg = self.text_encoder.config
            self.image_align = ImageAlignment(p["embed_dim"], p["num_heads"], p["mlp_ratio"])
            self.text_align = BertLayer(cfg)
            self.text_align.apply(lambda m: _init_bert_module(m, cfg.initializer_range))
            self.image_proj = nn.Linear(p["embed_dim"], proj_dim)
            self.text_proj = nn.Linear(cfg.hidden_size, proj_dim)
        self.text_width, self.vocab_size = cfg.hidden_size, cfg.vocab_size
        self.args["vocab_size"] = cfg.vocab_size  # resolved: the same model again from these JSON args
        self.max_length = cfg.max_position_embeddings

    # ------------------------------------------------------------------ inputs

    def _check_images(self, images: torch.Tensor) -> None:
        expected = (self.in_chans, self.image_size, self.image_size)
        if not (isinstance(images, torch.Tensor) and images.dim() == 4 and tuple(images.shape[1:]) == expected
                and images.shape[0] > 0 and images.is_floating_point()):
            got = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
            raise ValueError(f"{_COMPONENT}: images of shape {got} are invalid; pass a float tensor "
                             f"[B, {self.in_chans}, {self.image_size}, {self.image_size}]")

    def _check_text(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        ok = (isinstance(input_ids, torch.Tensor) and isinstance(attention_mask, torch.Tensor) and input_ids.dim() == 2
              and input_ids.shape == attention_mask.shape and input_ids.shape[0] > 0
              and 0 < input_ids.shape[1] <= self.max_length and not input_ids.is_floating_point())
        if not ok:
            got = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                   for t in (input_ids, attention_mask)]
            raise ValueError(f"{_COMPONENT}: input_ids / attention_mask of shapes {got} are invalid; pass integer "
                             f"tensors [B, T] of equal shape with 0 < T <= {self.max_length} "
                             "(fedssl.data.vocab.tokenize)")
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= self.vocab_size:
            raise ValueError(f"{_COMPONENT}: input_ids span [{lo}, {hi}] outside the vocabulary of {self.vocab_size}; "
                             "build the model with vocab_size=len(vocab) of the tokenizer used")

    # ------------------------------------------------------------------ features

    def image_tokens(self, images: torch.Tensor) -> torch.Tensor:
        """The image encoder's output tokens ``[B, 1 + L, width]`` (the alignment module's input ~z_x)."""
        self._check_images(images)
        return self.image_encoder.forward_features(images)

    def text_tokens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The text encoder's last hidden states ``[B, T, width]`` (the alignment module's input ~z_y)."""
        self._check_text(input_ids, attention_mask)
        return self.text_encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    def image_features(self, images: torch.Tensor) -> torch.Tensor:
        """Class token of the image alignment module ``[B, width]``, before projection (linear-probe features)."""
        return self.image_align(self.image_tokens(images))[:, 0]

    def text_features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[CLS] of the text alignment module ``[B, width]``, before projection; padding is masked out."""
        hidden = self.text_tokens(input_ids, attention_mask)
        mask = create_bidirectional_mask(config=self.text_encoder.config, inputs_embeds=hidden,
                                         attention_mask=attention_mask)
        return self.text_align(hidden, attention_mask=mask)[:, 0]

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        """z_x ``[B, proj_dim]``, unit L2 norm."""
        return F.normalize(self.image_proj(self.image_features(images)), dim=-1)

    def encode_text(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """z_y ``[B, proj_dim]``, unit L2 norm."""
        return F.normalize(self.text_proj(self.text_features(input_ids, attention_mask)), dim=-1)

    def forward(self, images: torch.Tensor, input_ids: torch.Tensor,
                attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.encode_image(images), self.encode_text(input_ids, attention_mask)

    # ------------------------------------------------------------------ token features (GLoRIA / MGCA)

    def encode_image_tokens(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(z_x [B, P] unit, regions [B, L, P], cls_attention [B, L])``: the global embedding as
        :meth:`encode_image`, the L patch tokens of the image alignment block through the same projection
        (GLoRIA's sub-regions, MGCA's patches; not normalised), and the alignment block's [CLS] attention to each
        patch, averaged over heads (no gradient; MGCA's patch importance)."""
        tokens = self.image_tokens(images)
        with torch.no_grad():
            attention = _timm_cls_attention(self.image_align.block, tokens)
        out = self.image_proj(self.image_align(tokens))
        return F.normalize(out[:, 0], dim=-1), out[:, 1:], attention[:, 1:]

    def encode_text_tokens(self, input_ids: torch.Tensor,
                           attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(z_y [B, P] unit, tokens [B, T, P], cls_attention [B, T])``: the global embedding as
        :meth:`encode_text`, every token of the text alignment layer through the same projection (not normalised;
        padding included: mask it with ``attention_mask``), and the layer's [CLS] attention to each token,
        averaged over heads (0 on padding; no gradient)."""
        hidden = self.text_tokens(input_ids, attention_mask)
        mask = create_bidirectional_mask(config=self.text_encoder.config, inputs_embeds=hidden,
                                         attention_mask=attention_mask)
        with torch.no_grad():
            attention = _bert_cls_attention(self.text_align, hidden, attention_mask)
        out = self.text_proj(self.text_align(hidden, attention_mask=mask))
        return F.normalize(out[:, 0], dim=-1), out, attention

    # ------------------------------------------------------------------ bookkeeping

    def alignment_parameter_names(self) -> list[str]:
        """Names of the stage-1 trainable parameters (under :data:`ALIGNMENT_PREFIXES`)."""
        return [n for n, _ in self.named_parameters() if is_alignment_parameter(n)]

    def param_counts(self) -> dict[str, int]:
        return vlp_param_counts(self)


def _timm_cls_attention(block: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """``[B, N]``: the [CLS] row of a timm ``Block``'s attention probabilities on ``tokens``, mean over heads."""
    attn = block.attn
    h = block.norm1(tokens)
    b, n, _ = h.shape
    qkv = attn.qkv(h).reshape(b, n, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4)
    q, k = attn.q_norm(qkv[0]), attn.k_norm(qkv[1])
    scores = (q[:, :, :1] * attn.scale) @ k.transpose(-2, -1)  # [B, H, 1, N]
    return scores.softmax(dim=-1)[:, :, 0].mean(dim=1)


def _bert_cls_attention(layer: nn.Module, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]``: the [CLS] row of a ``BertLayer``'s self-attention probabilities (padding masked), mean over
    heads."""
    sa = layer.attention.self
    b, t, _ = hidden.shape
    heads, dim = sa.num_attention_heads, sa.attention_head_size
    q = sa.query(hidden[:, :1]).view(b, 1, heads, dim).transpose(1, 2)
    k = sa.key(hidden).view(b, t, heads, dim).transpose(1, 2)
    scores = (q @ k.transpose(-2, -1)) / dim ** 0.5  # [B, H, 1, T]
    scores = scores.masked_fill(~attention_mask.bool()[:, None, None, :], float("-inf"))
    return scores.softmax(dim=-1)[:, :, 0].mean(dim=1)


def vlp_param_counts(model: VisionLanguageModel) -> dict[str, int]:
    """Parameter counts per part: each submodule, ``encoders`` (stage-2 only), ``alignment`` (the stage-1 set:
    alignment blocks + projections) and ``total``."""
    counts = {part: sum(p.numel() for p in getattr(model, part).parameters()) for part in _PARTS}
    counts["encoders"] = counts["image_encoder"] + counts["text_encoder"]
    counts["alignment"] = sum(p.numel() for n, p in model.named_parameters() if is_alignment_parameter(n))
    counts["total"] = sum(p.numel() for p in model.parameters())
    return counts


def build_vlp_model(preset: str = "small", vocab_size: int | None = None, proj_dim: int = 128,
                    image_size: int | None = None, in_chans: int | None = None, text_weights: str = "",
                    image_weights: str = "", seed: int | None = 0) -> VisionLanguageModel:
    """:class:`VisionLanguageModel` with ``None`` for "the preset's value" (``text_weights``' vocabulary)."""
    return VisionLanguageModel(preset=preset, vocab_size=0 if vocab_size is None else vocab_size, proj_dim=proj_dim,
                               image_size=0 if image_size is None else image_size,
                               in_chans=0 if in_chans is None else in_chans, text_weights=text_weights,
                               image_weights=image_weights, seed=seed)


def vlp_model_from_args(args: Mapping[str, object] | None = None, **kwargs) -> VisionLanguageModel:
    """The model of a JSON ``args`` object (FLARE component / job config): the keys of :data:`MODEL_ARGS`;
    an unknown key is an error instead of being ignored."""
    merged = {**dict(args or {}), **kwargs}
    unknown = sorted(set(merged) - set(MODEL_ARGS))
    require(not unknown, "vlp_model_from_args", "args", unknown, f"use only the keys {list(MODEL_ARGS)}")
    return VisionLanguageModel(**merged)


__all__ = [
    "ALIGNMENT_PREFIXES",
    "MODEL_ARGS",
    "VLP_PRESETS",
    "ImageAlignment",
    "VisionLanguageModel",
    "build_vlp_model",
    "check_model_args",
    "is_alignment_parameter",
    "vlp_model_from_args",
    "vlp_param_counts",
]
