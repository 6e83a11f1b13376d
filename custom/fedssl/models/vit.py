"""ViT models of SSL-FL (Yan et al., IEEE TMI 2023) and FedMAE (Wu et al., "Federated Self-Supervised Learning for
Dermatological Disease Diagnosis" section IV), built from timm's VisionTransformer blocks.

* :class:`MAEViT` - MAE (He et al. 2022): random masking of patch tokens, the ViT encoder sees only the
  visible tokens (+ class token), a lightweight ViT decoder gets the encoded tokens, a learnable mask token
  and position embeddings, and regresses the pixels of every patch; MSE on the masked patches only
  (SSL-FL (Yan et al., IEEE TMI 2023) eq. 4).
* :class:`BEiTViT` - BEiT (Bao et al. 2022): the embeddings of masked patches are replaced by a learnable
  mask embedding, the encoder sees all tokens, a linear head predicts the visual-token id of each masked
  patch (SSL-FL (Yan et al., IEEE TMI 2023) eq. 3).  ``rel_pos_bias`` adds BEiT's relative position bias
  (issue 47): SSL-FL's Fed-BEiT pre-trains with ONE table shared by every block (rui-yan/SSL-FL
  ``code/fed_beit/run_beit_pretrain_FedAvg.py``: ``--rel_pos_bias`` default true, passed as
  ``use_shared_rel_pos_bias``) and fine-tunes with one table per block (``run_class_finetune_FedAvg.py``:
  ``use_rel_pos_bias``), each initialised from the shared one (``code/util/FedAvg_utils.py``); jobs/sslfl_beit_retina
  sets ``"shared"``, the Fed-BEiT fine-tuning ``"per_layer"`` (:func:`load_encoder_state` copies the table).  The
  learned absolute position embedding is kept (the reference code has none: ``--abs_pos_emb`` default false), so
  the encoder's keys stay those of every other pre-training here.
* :class:`ViTClassifier` - the fine-tuning network: the same encoder, average-pooled patch tokens ->
  ``fc_norm`` -> linear ``head`` (SSL-FL (Yan et al., IEEE TMI 2023) section III-D).

Parameter names are a contract with the FLARE glue (FedMAE knowledge split and Table V of Wu et al., "Federated
Self-Supervised Learning for Dermatological Disease Diagnosis" select tensors by pattern):

* ``encoder.cls_token`` - the class embedding (the "local knowledge" of FedMAE-KS),
* ``encoder.pos_embed``, ``encoder.patch_embed.proj.{weight,bias}`` ("patch projection", the linear
  projection at the encoder's input), ``encoder.blocks.<i>.*``, ``encoder.norm.*``,
* MAE decoder: ``decoder.embed.*`` ("decoder projection", the linear projection at the decoder's input,
  encoder width -> decoder width), ``decoder.mask_token``, ``decoder.pos_embed``, ``decoder.blocks.*``,
  ``decoder.norm.*``, ``decoder.pred.*`` (decoder width -> p*p*3 pixels),
* BEiT: ``mask_token``, ``lm_head.*``; classifier: ``fc_norm.*``, ``head.*``,
* relative position bias (:class:`RelativePositionBias`, ``rel_pos_bias`` not "none"): the shared table
  ``encoder.rel_pos_bias.relative_position_bias_table``, or per block
  ``encoder.blocks.<i>.attn.rel_pos_bias.relative_position_bias_table`` (``[(2H-1)(2W-1)+3, heads]``; the index
  that maps token pairs to its rows is a non-persistent buffer: never in a state dict, never averaged).

The classifier has no ``encoder.norm``: with average pooling the final norm is replaced by ``fc_norm``
(MAE and BEiT fine-tuning code), so a pre-trained ``encoder.norm`` is reported as ignored.
"""

from __future__ import annotations

import inspect
import os
from typing import Mapping

import torch
from timm.layers import LayerNorm, resample_abs_pos_embed, trunc_normal_
from timm.models.vision_transformer import Block, VisionTransformer
from torch import nn

from fedssl.core.safe_load import safe_load
from fedssl.core.masking import random_masking
from fedssl.core.mim import mae_loss
from fedssl.core.patches import patchify
from fedssl.models.seeding import seeded

#: Tiny twin for unit tests and quick CPU runs: 32 px images, 4 px patches (8 x 8 grid).
TINY_VIT: dict = {"image_size": 32, "patch_size": 4, "embed_dim": 48, "depth": 2, "num_heads": 3}
TINY_DECODER: dict = {"decoder_embed_dim": 32, "decoder_depth": 1, "decoder_num_heads": 2}
TINY_VOCAB = 64

POS_EMBED_TYPES = ("sincos", "learned")

#: the relative position bias of the encoder's self-attention (BEiT, Bao et al. 2022): "none" (plain ViT: Fed-MAE,
#: scratch, ImageNet), "shared" (one table for every block: SSL-FL's Fed-BEiT pre-training), "per_layer" (a table per
#: block: SSL-FL's Fed-BEiT fine-tuning)
REL_POS_BIAS = ("none", "shared", "per_layer")
#: the shared table's key in a pre-training global model
SHARED_REL_POS_TABLE = "encoder.rel_pos_bias.relative_position_bias_table"
_TABLE = "relative_position_bias_table"


def check_rel_pos_bias(rel_pos_bias: object, what: str = "ViT") -> str:
    """``rel_pos_bias`` is one of :data:`REL_POS_BIAS`; the message names argument, value and fix."""
    if not (isinstance(rel_pos_bias, str) and rel_pos_bias in REL_POS_BIAS):
        raise ValueError(
            f"{what}: argument rel_pos_bias={rel_pos_bias!r} is invalid; use one of {list(REL_POS_BIAS)} (\"none\": "
            "plain ViT, Fed-MAE; \"shared\": Fed-BEiT pre-training; \"per_layer\": Fed-BEiT fine-tuning)"
        )
    return rel_pos_bias


def check_vit_args(image_size: int, patch_size: int, embed_dim: int, num_heads: int, what: str = "ViT") -> int:
    """Validate the geometry; returns the grid side ``image_size // patch_size``."""
    values = (image_size, patch_size, embed_dim, num_heads)
    ok = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values)
    if not ok or image_size % patch_size or image_size // patch_size < 2:
        raise ValueError(
            f"{what}: image_size={image_size!r}, patch_size={patch_size!r} must be positive integers with image_size a "
            "multiple of patch_size and at least 2 x 2 patches (paper: 224 / 16)"
        )
    if embed_dim % num_heads or embed_dim % 4:
        raise ValueError(
            f"{what}: embed_dim={embed_dim} must be divisible by num_heads={num_heads} and by 4 (paper: 768 / 12)"
        )
    return image_size // patch_size


def sincos_pos_embed(embed_dim: int, grid_h: int, grid_w: int, cls_token: bool = True) -> torch.Tensor:
    """MAE's fixed 2D sin-cos position embedding ``[1, (1 +) grid_h*grid_w, D]`` (class-token row = 0).
    Half of the channels encode the column, half the row (MAE ``get_2d_sincos_pos_embed``)."""
    if embed_dim % 4:
        raise ValueError(f"sin-cos position embedding needs embed_dim divisible by 4, got {embed_dim}")

    def one_d(d: int, pos: torch.Tensor) -> torch.Tensor:  # [M] -> [M, d]
        omega = 1.0 / 10000 ** (torch.arange(d // 2, dtype=torch.float64) / (d / 2.0))
        out = pos.reshape(-1, 1).to(torch.float64) * omega[None, :]
        return torch.cat([torch.sin(out), torch.cos(out)], dim=1)

    rows, cols = torch.meshgrid(torch.arange(grid_h), torch.arange(grid_w), indexing="ij")
    emb = torch.cat([one_d(embed_dim // 2, cols), one_d(embed_dim // 2, rows)], dim=1)  # [L, D]
    if cls_token:
        emb = torch.cat([torch.zeros(1, embed_dim, dtype=torch.float64), emb], dim=0)
    return emb.float().unsqueeze(0)


def relative_position_index(grid_h: int, grid_w: int) -> torch.Tensor:
    """BEiT's index of the relative position bias table for the ``1 + grid_h * grid_w`` tokens (class token first,
    patches in row-major order), ``[1 + L, 1 + L]`` (query, key), into a table of ``T = (2 grid_h - 1)(2 grid_w - 1)
    + 3`` rows: patch ``(r, c)`` attending to patch ``(r', c')`` reads row ``(r - r' + grid_h - 1) * (2 grid_w - 1)
    + (c - c' + grid_w - 1)`` (one row per relative offset), the class token attending to a patch row ``T - 3``, a
    patch attending to the class token ``T - 2``, the class token to itself ``T - 1``."""
    rows, cols = torch.meshgrid(torch.arange(grid_h), torch.arange(grid_w), indexing="ij")
    r, c = rows.reshape(-1), cols.reshape(-1)
    offsets = (r[:, None] - r[None, :] + grid_h - 1) * (2 * grid_w - 1) + (c[:, None] - c[None, :] + grid_w - 1)
    size = (2 * grid_h - 1) * (2 * grid_w - 1) + 3
    index = torch.empty(r.numel() + 1, r.numel() + 1, dtype=torch.long)
    index[1:, 1:] = offsets
    index[0, :] = size - 3  # class token -> patch
    index[:, 0] = size - 2  # patch -> class token
    index[0, 0] = size - 1  # class token -> class token
    return index


class RelativePositionBias(nn.Module):
    """A learnable bias per head and relative offset, added to the attention logits (BEiT, Bao et al. 2022):
    ``relative_position_bias_table [(2H-1)(2W-1)+3, heads]``, zero at the start (as BEiT's code), read through
    :func:`relative_position_index` (a non-persistent buffer); ``forward()`` -> ``[heads, 1 + L, 1 + L]``."""

    def __init__(self, grid: tuple[int, int], num_heads: int):
        super().__init__()
        self.grid, self.num_heads = (int(grid[0]), int(grid[1])), int(num_heads)
        index = relative_position_index(*self.grid)
        self.relative_position_bias_table = nn.Parameter(
            torch.zeros((2 * self.grid[0] - 1) * (2 * self.grid[1] - 1) + 3, self.num_heads))
        self.register_buffer("relative_position_index", index, persistent=False)

    def forward(self) -> torch.Tensor:
        n = self.relative_position_index.shape[0]
        bias = self.relative_position_bias_table[self.relative_position_index.reshape(-1)]  # [n*n, heads]
        return bias.reshape(n, n, self.num_heads).permute(2, 0, 1).contiguous()


class ViTEncoder(VisionTransformer):
    """timm's VisionTransformer with BEiT's relative position bias as an option (``rel_pos_bias``, one of
    :data:`REL_POS_BIAS`): "shared" adds one :class:`RelativePositionBias` (``rel_pos_bias``) to the logits of every
    block, "per_layer" gives each block's attention its own (``blocks.<i>.attn.rel_pos_bias``); "none" is timm's ViT
    unchanged.  The bias enters timm's attention as its additive ``attn_mask`` (scaled dot-product attention adds a
    float mask to ``q k^T / sqrt(d)`` before the softmax).  Run the blocks through :meth:`run_blocks` (or
    :meth:`forward_features`): a block called on its own does not see the bias."""

    def __init__(self, rel_pos_bias: str = "none", **kwargs):
        check_rel_pos_bias(rel_pos_bias, "ViTEncoder")
        super().__init__(**kwargs)
        self.rel_pos_bias_type = rel_pos_bias
        grid, heads = tuple(self.patch_embed.grid_size), kwargs["num_heads"]
        if rel_pos_bias != "none" and "attn_mask" not in inspect.signature(type(self.blocks[0]).forward).parameters:
            raise ValueError(f"ViTEncoder: rel_pos_bias={rel_pos_bias!r} needs a timm whose Block.forward takes "
                             "attn_mask (1.0.31 is tested); upgrade timm or use rel_pos_bias=\"none\"")
        self.rel_pos_bias = RelativePositionBias(grid, heads) if rel_pos_bias == "shared" else None
        if rel_pos_bias == "per_layer":
            for blk in self.blocks:
                blk.attn.rel_pos_bias = RelativePositionBias(grid, heads)

    def attention_biases(self) -> list[torch.Tensor | None]:
        """The additive bias of each block's attention logits, ``[1, heads, 1 + L, 1 + L]`` (None: no bias)."""
        if self.rel_pos_bias_type == "none":
            return [None] * len(self.blocks)
        if self.rel_pos_bias is not None:
            return [self.rel_pos_bias().unsqueeze(0)] * len(self.blocks)  # the one shared table, computed once
        return [blk.attn.rel_pos_bias().unsqueeze(0) for blk in self.blocks]

    def run_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """The transformer blocks over the tokens ``[B, 1 + L, D]``, each with its relative position bias."""
        if self.rel_pos_bias_type == "none":
            return self.blocks(x)
        for blk, bias in zip(self.blocks, self.attention_biases()):
            x = blk(x, attn_mask=bias)
        return x

    def forward_features(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None,
                         is_causal: bool = False) -> torch.Tensor:
        if self.rel_pos_bias_type == "none":
            return super().forward_features(x, attn_mask=attn_mask, is_causal=is_causal)
        if attn_mask is not None or is_causal:
            raise ValueError("ViTEncoder: attn_mask / is_causal do not combine with a relative position bias")
        x = self.norm_pre(self.patch_drop(self._pos_embed(self.patch_embed(x))))
        return self.norm(self.run_blocks(x))

    def forward_intermediates(self, *args, **kwargs):
        if self.rel_pos_bias_type != "none":
            raise NotImplementedError("ViTEncoder: timm's forward_intermediates skips the relative position bias; "
                                      "use forward_features")
        return super().forward_intermediates(*args, **kwargs)


def _vit_encoder(
    image_size: int,
    patch_size: int,
    embed_dim: int,
    depth: int,
    num_heads: int,
    mlp_ratio: float,
    drop_path_rate: float = 0.0,
    layer_scale: float | None = None,
    final_norm: bool = True,
    fix_init: bool = False,
    rel_pos_bias: str = "none",
) -> ViTEncoder:
    """A timm ViT without head: state-dict keys cls_token, pos_embed, patch_embed.proj.*, blocks.*, norm.* (and the
    relative position bias tables of ``rel_pos_bias``)."""
    return ViTEncoder(
        rel_pos_bias=rel_pos_bias,
        img_size=image_size,  # timm's name
        patch_size=patch_size,
        in_chans=3,
        num_classes=0,
        global_pool="",
        embed_dim=embed_dim,
        depth=depth,
        num_heads=num_heads,
        mlp_ratio=mlp_ratio,
        qkv_bias=True,
        init_values=layer_scale,
        class_token=True,
        final_norm=final_norm,
        fc_norm=False,
        drop_path_rate=drop_path_rate,
        fix_init=fix_init,
    )


def _init_mae_module(m: nn.Module) -> None:
    """MAE's initialisation: xavier-uniform Linear, zero bias, unit LayerNorm."""
    if isinstance(m, nn.Linear):
        nn.init.xavier_uniform_(m.weight)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.LayerNorm):
        nn.init.ones_(m.weight)
        nn.init.zeros_(m.bias)


class MAEDecoder(nn.Module):
    """MAE's lightweight decoder: ``embed`` (encoder width -> decoder width), mask token, position
    embedding, ViT blocks, norm, ``pred`` (-> p*p*3 pixels per patch)."""

    def __init__(self, num_patches: int, grid: tuple[int, int], patch_size: int, embed_dim: int,
                 decoder_embed_dim: int, depth: int, num_heads: int, mlp_ratio: float, pos_embed_type: str):
        super().__init__()
        self.embed = nn.Linear(embed_dim, decoder_embed_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, decoder_embed_dim))
        learned = pos_embed_type == "learned"
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, decoder_embed_dim), requires_grad=learned)
        self.blocks = nn.Sequential(*[
            Block(decoder_embed_dim, num_heads, mlp_ratio, qkv_bias=True, norm_layer=LayerNorm) for _ in range(depth)
        ])
        self.norm = LayerNorm(decoder_embed_dim)
        self.pred = nn.Linear(decoder_embed_dim, patch_size * patch_size * 3)
        with torch.no_grad():
            if learned:
                trunc_normal_(self.pos_embed, std=0.02)
            else:
                self.pos_embed.copy_(sincos_pos_embed(decoder_embed_dim, *grid))

    def forward(self, latent: torch.Tensor, ids_restore: torch.Tensor) -> torch.Tensor:
        """``latent [B, 1 + V, D]`` (class token first, visible patches in shuffled order), ``ids_restore
        [B, L]`` -> pixel predictions ``[B, L, p*p*3]`` in patch order."""
        x = self.embed(latent)  # [B, 1+V, Dd]
        b, n = ids_restore.shape
        mask_tokens = self.mask_token.expand(b, n + 1 - x.shape[1], -1)
        x_ = torch.cat([x[:, 1:], mask_tokens], dim=1)  # [B, L, Dd] shuffled order
        x_ = torch.gather(x_, 1, ids_restore.unsqueeze(-1).expand(-1, -1, x.shape[2]))  # patch order
        x = torch.cat([x[:, :1], x_], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.pred(x)[:, 1:]


class MAEViT(nn.Module):
    """Masked autoencoder with a ViT encoder (keys ``encoder.*``) and decoder (keys ``decoder.*``).

    ``forward(imgs, mask_ratio)`` -> ``(loss, pred [B, L, p*p*3], mask [B, L] bool, True = masked)``.
    Position embeddings are MAE's fixed sin-cos (``pos_embed_type="sincos"``, not trained) or learned.
    """

    def __init__(
        self,
        image_size: int = 224,
        patch_size: int = 16,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        decoder_embed_dim: int = 512,
        decoder_depth: int = 8,
        decoder_num_heads: int = 16,
        mlp_ratio: float = 4.0,
        norm_pix_loss: bool = False,
        seed: int | None = 0,
        pos_embed_type: str = "sincos",
        drop_path_rate: float = 0.0,
    ):
        super().__init__()
        grid = check_vit_args(image_size, patch_size, embed_dim, num_heads, "MAEViT")
        check_vit_args(image_size, patch_size, decoder_embed_dim, decoder_num_heads, "MAEViT decoder")
        if pos_embed_type not in POS_EMBED_TYPES:
            raise ValueError(f"MAEViT: pos_embed_type={pos_embed_type!r}; use one of {list(POS_EMBED_TYPES)}")
        self.image_size, self.patch_size, self.embed_dim, self.depth, self.num_heads = (
            image_size, patch_size, embed_dim, depth, num_heads)
        self.decoder_embed_dim, self.decoder_depth, self.decoder_num_heads = (
            decoder_embed_dim, decoder_depth, decoder_num_heads)
        self.mlp_ratio, self.norm_pix_loss, self.seed = mlp_ratio, bool(norm_pix_loss), seed
        self.pos_embed_type, self.drop_path_rate = pos_embed_type, drop_path_rate
        self.grid_size = (grid, grid)
        self.num_patches = grid * grid
        with seeded(seed):
            self.encoder = _vit_encoder(image_size, patch_size, embed_dim, depth, num_heads, mlp_ratio, drop_path_rate)
            self.decoder = MAEDecoder(self.num_patches, self.grid_size, patch_size, embed_dim, decoder_embed_dim,
                                      decoder_depth, decoder_num_heads, mlp_ratio, pos_embed_type)
            self._init_weights()

    def _init_weights(self) -> None:
        enc = self.encoder
        with torch.no_grad():
            if self.pos_embed_type == "sincos":
                enc.pos_embed.copy_(sincos_pos_embed(self.embed_dim, *self.grid_size))
                enc.pos_embed.requires_grad_(False)
            w = enc.patch_embed.proj.weight
            nn.init.xavier_uniform_(w.view(w.shape[0], -1))  # like nn.Linear
            nn.init.normal_(enc.cls_token, std=0.02)
            nn.init.normal_(self.decoder.mask_token, std=0.02)
        self.apply(_init_mae_module)

    def forward_encoder(
        self, imgs: torch.Tensor, mask_ratio: float, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> latent ``[B, 1 + V, D]`` (class token + visible patches), mask ``[B, L]``, ids_restore ``[B, L]``."""
        enc = self.encoder
        x = enc.patch_embed(imgs)  # [B, L, D]
        b, n, d = x.shape
        x = x + enc.pos_embed[:, 1:]
        ids_keep, mask, ids_restore = random_masking(b, n, mask_ratio, generator)
        ids_keep, mask, ids_restore = ids_keep.to(x.device), mask.to(x.device), ids_restore.to(x.device)
        x = torch.gather(x, 1, ids_keep.unsqueeze(-1).expand(-1, -1, d))  # [B, V, D]
        cls = (enc.cls_token + enc.pos_embed[:, :1]).expand(b, -1, -1)
        x = torch.cat([cls, x], dim=1)
        x = enc.norm(enc.blocks(x))
        return x, mask, ids_restore

    def forward(
        self, imgs: torch.Tensor, mask_ratio: float = 0.75, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        latent, mask, ids_restore = self.forward_encoder(imgs, mask_ratio, generator)
        pred = self.decoder(latent, ids_restore)  # [B, L, p*p*3]
        loss = mae_loss(pred, patchify(imgs, self.patch_size), mask, norm_pix=self.norm_pix_loss)
        return loss, pred, mask


class BEiTViT(nn.Module):
    """BEiT masked image modelling: ``forward(imgs, bool_masked_pos [B, L])`` -> logits ``[n_masked, vocab]``
    (masked positions in row-major order, sample by sample, as ``token_ids[bool_masked_pos]``).
    ``rel_pos_bias``: see :class:`ViTEncoder` (SSL-FL's Fed-BEiT pre-training: "shared"; the default "none" keeps
    the plain ViT)."""

    def __init__(
        self,
        image_size: int = 224,
        patch_size: int = 16,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        vocab_size: int = 8192,
        seed: int | None = 0,
        mlp_ratio: float = 4.0,
        drop_path_rate: float = 0.1,
        layer_scale: float | None = 0.1,
        rel_pos_bias: str = "none",
    ):
        super().__init__()
        grid = check_vit_args(image_size, patch_size, embed_dim, num_heads, "BEiTViT")
        if not (isinstance(vocab_size, int) and vocab_size >= 2):
            raise ValueError(f"BEiTViT: vocab_size={vocab_size!r} must be an integer >= 2 (DALL-E: 8192)")
        check_rel_pos_bias(rel_pos_bias, "BEiTViT")
        self.image_size, self.patch_size, self.embed_dim, self.depth, self.num_heads = (
            image_size, patch_size, embed_dim, depth, num_heads)
        self.vocab_size, self.seed, self.mlp_ratio = vocab_size, seed, mlp_ratio
        self.drop_path_rate, self.layer_scale, self.rel_pos_bias = drop_path_rate, layer_scale, rel_pos_bias
        self.grid_size = (grid, grid)
        self.num_patches = grid * grid
        with seeded(seed):
            self.encoder = _vit_encoder(image_size, patch_size, embed_dim, depth, num_heads, mlp_ratio,
                                        drop_path_rate, layer_scale, fix_init=True, rel_pos_bias=rel_pos_bias)
            self.mask_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
            self.lm_head = nn.Linear(embed_dim, vocab_size)
            with torch.no_grad():  # BEiT: truncated normal 0.02 for tokens and linear layers
                trunc_normal_(self.encoder.cls_token, std=0.02)
                trunc_normal_(self.mask_token, std=0.02)
                trunc_normal_(self.lm_head.weight, std=0.02)
                nn.init.zeros_(self.lm_head.bias)

    def forward_features(self, imgs: torch.Tensor, bool_masked_pos: torch.Tensor) -> torch.Tensor:
        """Encoded patch tokens ``[B, L, D]`` with masked patches replaced by the mask embedding."""
        enc = self.encoder
        x = enc.patch_embed(imgs)  # [B, L, D]
        b, n, _ = x.shape
        if tuple(bool_masked_pos.shape) != (b, n):
            raise ValueError(f"bool_masked_pos has shape {tuple(bool_masked_pos.shape)}, expected ({b}, {n})")
        w = bool_masked_pos.to(device=x.device, dtype=x.dtype).unsqueeze(-1)
        x = x * (1.0 - w) + self.mask_token.expand(b, n, -1) * w
        x = torch.cat([enc.cls_token.expand(b, -1, -1), x], dim=1) + enc.pos_embed
        x = enc.norm(enc.run_blocks(enc.pos_drop(x)))
        return x[:, 1:]

    def forward(self, imgs: torch.Tensor, bool_masked_pos: torch.Tensor) -> torch.Tensor:
        x = self.forward_features(imgs, bool_masked_pos)
        return self.lm_head(x[bool_masked_pos.to(device=x.device, dtype=torch.bool)])  # [n_masked, vocab]


class ViTClassifier(nn.Module):
    """Fine-tuning ViT: encoder (keys ``encoder.*``, no final norm) -> mean of the patch tokens -> ``fc_norm``
    -> ``head``.  ``layer_scale`` must equal the pre-training encoder's (BEiTViT default 0.1, MAE none);
    ``rel_pos_bias`` (:class:`ViTEncoder`): "none" for a Fed-MAE / ImageNet / scratch encoder, "per_layer" for a
    Fed-BEiT one (SSL-FL's fine-tuning; :func:`load_encoder_state` copies a shared table into every block)."""

    def __init__(
        self,
        num_classes: int,
        image_size: int = 224,
        patch_size: int = 16,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        drop_path_rate: float = 0.1,
        seed: int | None = 0,
        mlp_ratio: float = 4.0,
        layer_scale: float | None = None,
        rel_pos_bias: str = "none",
    ):
        super().__init__()
        grid = check_vit_args(image_size, patch_size, embed_dim, num_heads, "ViTClassifier")
        if not (isinstance(num_classes, int) and not isinstance(num_classes, bool) and num_classes >= 2):
            raise ValueError(f"ViTClassifier: num_classes={num_classes!r} must be an integer >= 2")
        check_rel_pos_bias(rel_pos_bias, "ViTClassifier")
        self.num_classes, self.image_size, self.patch_size, self.embed_dim, self.depth, self.num_heads = (
            num_classes, image_size, patch_size, embed_dim, depth, num_heads)
        self.drop_path_rate, self.seed, self.mlp_ratio, self.layer_scale = drop_path_rate, seed, mlp_ratio, layer_scale
        self.rel_pos_bias = rel_pos_bias
        self.grid_size = (grid, grid)
        self.num_patches = grid * grid
        with seeded(seed):
            self.encoder = _vit_encoder(image_size, patch_size, embed_dim, depth, num_heads, mlp_ratio,
                                        drop_path_rate, layer_scale, final_norm=False, rel_pos_bias=rel_pos_bias)
            self.fc_norm = LayerNorm(embed_dim)
            self.head = nn.Linear(embed_dim, num_classes)
            with torch.no_grad():
                trunc_normal_(self.head.weight, std=0.02)
                nn.init.zeros_(self.head.bias)

    def forward_features(self, imgs: torch.Tensor) -> torch.Tensor:
        """Pooled, normalised representation ``[B, D]``."""
        x = self.encoder.forward_features(imgs)  # [B, 1+L, D]
        return self.fc_norm(x[:, self.encoder.num_prefix_tokens:].mean(dim=1))

    def forward(self, imgs: torch.Tensor) -> torch.Tensor:
        return self.head(self.forward_features(imgs))  # [B, num_classes]


# --------------------------------------------------------------------------- pre-trained weights


def encoder_state(state_dict: Mapping[str, object]) -> dict:
    """The ``encoder.*`` entries (keys unchanged) of a pre-training global model (MAE or BEiT)."""
    enc = {k: v for k, v in state_dict.items() if k.startswith("encoder.")}
    if not enc:
        raise ValueError(
            f"no key starts with 'encoder.' (first keys: {sorted(state_dict)[:3]}); pass the global model of a "
            "Fed-MAE / Fed-BEiT pre-training run (FL_global_model.pt)"
        )
    return enc


def read_state_dict(path: str) -> dict:
    """State dict of a file: FLARE's ``FL_global_model.pt`` / PTFileModelPersistor ``{"model": ...}``, a
    ``{"state_dict": ...}`` checkpoint, a plain state dict, or a ``.safetensors`` file; values as tensors."""
    if not os.path.isfile(path):
        raise ValueError(f"pre-trained model {path} does not exist; pass the FL_global_model.pt of a pre-training run")
    data = safe_load(path)  # UnreadableFile (a ValueError) naming the file: truncated, not weights, a pickle payload
    for key in ("model", "state_dict"):
        if isinstance(data, dict) and isinstance(data.get(key), dict):
            data = data[key]
            break
    if not isinstance(data, dict) or not data:
        raise ValueError(f"{path} holds no state dict (got {type(data).__name__})")
    try:
        return {str(k): torch.as_tensor(v) for k, v in data.items()}
    except (TypeError, RuntimeError) as e:
        raise ValueError(f"{path} is not a state dict of tensors: {e}") from None


def _rel_pos_tables(source: str, own: Mapping[str, torch.Tensor],
                    given: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], str]:
    """Match the relative position bias tables of a pre-trained encoder (``given``) to the classifier's (``own``):
    a shared table is copied into every block's when the classifier has one per block (BEiT's and SSL-FL's
    fine-tuning, rui-yan/SSL-FL ``code/util/FedAvg_utils.py``); tables the checkpoint lacks stay at their zero start
    (no bias, as BEiT's non-strict load).  Returns the adapted ``given`` and what was done, in words."""
    own_tables = sorted(k for k in own if k.startswith("encoder.") and k.endswith(_TABLE))
    given_tables = sorted(k for k in given if k.endswith(_TABLE))
    if not given_tables:
        return given, "none in the checkpoint" + (": the tables start at zero" if own_tables else "")
    if not own_tables:
        raise ValueError(
            f"{source}: the pre-trained encoder has a relative position bias ({given_tables[0]}) but the classifier "
            "has none; build it with rel_pos_bias=\"per_layer\" (Fed-BEiT fine-tuning) and the pre-training's "
            "layer_scale (0.1)")
    shared_given, shared_own = SHARED_REL_POS_TABLE in given, SHARED_REL_POS_TABLE in own
    if shared_given and not shared_own:  # shared -> per layer: one copy per block
        table, want = given.pop(SHARED_REL_POS_TABLE), own[own_tables[0]]
        if tuple(table.shape) != tuple(want.shape):
            raise ValueError(
                f"{source}: {SHARED_REL_POS_TABLE!r} has shape {tuple(table.shape)} but the classifier's tables "
                f"expect {tuple(want.shape)} ((2H-1)(2W-1)+3 rows x heads); use the pre-training image_size / "
                "patch_size / num_heads")
        extra = sorted(k for k in given if k.endswith(_TABLE))
        if extra:
            raise ValueError(f"{source}: the encoder has both a shared and per-block relative position bias "
                             f"({extra[0]}); pass the global model of one pre-training run")
        for k in own_tables:
            given[k] = table.clone()
        return given, f"shared table copied into {len(own_tables)} blocks"
    if not shared_given and shared_own:
        raise ValueError(
            f"{source}: the pre-trained encoder has one relative position bias table per block ({given_tables[0]}) "
            "but the classifier one shared table; build the classifier with rel_pos_bias=\"per_layer\"")
    return given, f"{len(given_tables)} table{'s' if len(given_tables) > 1 else ''} loaded"


def load_encoder_state(classifier: nn.Module, state: Mapping[str, object], source: str = "state dict") -> dict:
    """Load the ``encoder.*`` tensors of ``state`` 1:1 into ``classifier`` (every encoder key by name and
    shape; ``encoder.pos_embed`` is resampled when only the patch grid differs).  Relative position bias
    (:class:`ViTEncoder`): a pre-training's shared table (``encoder.rel_pos_bias.relative_position_bias_table``) is
    copied into every block's table of a ``rel_pos_bias="per_layer"`` classifier, as BEiT's fine-tuning does; a
    checkpoint without tables (Fed-MAE, ImageNet) leaves the classifier's at zero (no bias).

    Returns ``{"loaded": n, "missing": [...], "ignored": [...], "rel_pos_bias": "..."}``: missing = classifier keys
    left at their initial value (``fc_norm.*``, ``head.*``, tables the checkpoint lacks), ignored = keys of
    ``state`` not used (decoder, BEiT head, ``encoder.norm.*``), rel_pos_bias = what was done with the tables.
    Raises ValueError naming ``source`` if no encoder key is present, the encoder architectures differ (keys,
    relative position bias) or a shape differs.
    """
    own = classifier.state_dict()
    own_enc = [k for k in own if k.startswith("encoder.")]
    given = {k: torch.as_tensor(v) for k, v in state.items()
             if k.startswith("encoder.") and not k.endswith("relative_position_index")}
    if not given:
        raise ValueError(
            f"{source}: no 'encoder.*' key matches the classifier (first keys: {sorted(state)[:3]}); pass the "
            "global model of a Fed-MAE / Fed-BEiT pre-training run"
        )
    given, rel_pos = _rel_pos_tables(source, own, given)
    unexpected = sorted(k for k in given if k not in own and not k.startswith("encoder.norm."))
    missing_enc = sorted(k for k in own_enc if k not in given and not k.endswith(_TABLE))
    if unexpected or missing_enc:
        raise ValueError(
            f"{source}: the pre-trained encoder does not match the classifier (unexpected {unexpected[:4]}, "
            f"missing {missing_enc[:4]}); build the classifier with the pre-training depth, embed_dim and "
            "layer_scale (BEiTViT uses layer_scale 0.1)"
        )
    loaded = [k for k in own_enc if k in given]
    for k in loaded:
        v = given[k]
        if k == "encoder.pos_embed" and v.dim() == 3 and v.shape[-1] == own[k].shape[-1] and v.shape != own[k].shape:
            gh, gw = classifier.encoder.patch_embed.grid_size
            v = resample_abs_pos_embed(v.float(), new_size=[gh, gw], num_prefix_tokens=1)
        if tuple(v.shape) != tuple(own[k].shape):
            raise ValueError(
                f"{source}: {k!r} has shape {tuple(v.shape)} but the classifier expects {tuple(own[k].shape)}; "
                "use the pre-training image_size / patch_size / embed_dim / num_heads"
            )
        own[k] = v.to(own[k].dtype)
    classifier.load_state_dict(own)
    copied = SHARED_REL_POS_TABLE not in own and rel_pos.startswith("shared table copied")
    return {
        "loaded": len(loaded),
        "missing": sorted(k for k in own if k not in given),
        "ignored": sorted(k for k in state if k not in own and not (k == SHARED_REL_POS_TABLE and copied)),
        "rel_pos_bias": rel_pos,
    }


def load_pretrained_encoder(classifier: nn.Module, path: str | Mapping[str, object]) -> dict:
    """Initialise the classifier's encoder from a pre-training global model: a path to FLARE's
    ``FL_global_model.pt`` (PTFileModelPersistor format) or a plain state-dict file, or a state dict."""
    if isinstance(path, Mapping):
        return load_encoder_state(classifier, path)
    return load_encoder_state(classifier, read_state_dict(path), source=str(path))


def load_imagenet_weights(classifier: nn.Module, path: str) -> dict:
    """Initialise the encoder from a local timm ViT checkpoint (e.g. ``vit_base_patch16_224``'s
    ``model.safetensors`` / ``pytorch_model.bin``): its keys (``cls_token``, ``blocks.*`` ...) map to
    ``encoder.*``; its ImageNet head is ignored."""
    state = read_state_dict(path)
    if not any(k.startswith("encoder.") for k in state):  # timm names -> encoder.*; ImageNet head kept apart
        state = {("imagenet." if k.startswith(("head.", "fc_norm.")) else "encoder.") + k: v for k, v in state.items()}
    return load_encoder_state(classifier, state, source=path)


__all__ = [
    "REL_POS_BIAS",
    "SHARED_REL_POS_TABLE",
    "TINY_DECODER",
    "TINY_VIT",
    "TINY_VOCAB",
    "BEiTViT",
    "MAEDecoder",
    "MAEViT",
    "RelativePositionBias",
    "ViTClassifier",
    "ViTEncoder",
    "check_rel_pos_bias",
    "encoder_state",
    "load_encoder_state",
    "load_imagenet_weights",
    "load_pretrained_encoder",
    "read_state_dict",
    "relative_position_index",
    "sincos_pos_embed",
]
