"""A U-Net decoder on FedDRA's frozen ViT image encoder (FedDRA appendix A.1.2: "we employ a U-Net framework with our
pre-trained image encoder as the frozen encoder, while fine-tuning the decoder").

The paper names the decoder only ("a U-Net decoder", after GLoRIA, whose U-Net sits on a ResNet-50).  A ViT has one
resolution (the patch grid, S / p), so the U-Net's skip connections are taken as in UNETR (Hatamizadeh et al.,
WACV 2022): the encoder's outputs at evenly spaced blocks, each brought by transposed convolutions to the scale of
the decoder level it joins, and the image itself at full resolution.  The decoder widths follow MGCA's ViT
segmenter (SETR decoder, ``decode_features=[512, 256, 128, 64]`` for ViT-B/16, four x2 up-samplings); a patch of
``p = 2^n`` px takes n levels, the widths ``64 * 2^(n-1-j)`` unless given.  Each level: x2 transposed convolution,
concatenation with its skip, two 3 x 3 convolution-BatchNorm-ReLU (the U-Net block); a 1 x 1 convolution gives one
logit per pixel.  The encoder runs without gradient and in eval mode.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from fedssl.core.checks import require


def _conv_block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                         nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


def _up(cin: int, cout: int, times: int) -> nn.Sequential:
    """``times`` x2 transposed convolutions (UNETR's skip projection); 0 = a 1 x 1 convolution."""
    if times == 0:
        return nn.Sequential(nn.Conv2d(cin, cout, 1))
    layers: list[nn.Module] = []
    for t in range(times):
        layers.append(nn.ConvTranspose2d(cin if t == 0 else cout, cout, 2, stride=2))
    return nn.Sequential(*layers)


class ViTUNet(nn.Module):
    """``forward(images [B, C, S, S]) -> logits [B, 1, S, S]``; ``encoder``: a timm ``VisionTransformer`` (FedDRA's
    ``image_encoder``), frozen; ``decoder_channels``: one width per level (None: ``64 * 2^(n-1-j)``)."""

    def __init__(self, encoder: nn.Module, patch_size: int, in_chans: int,
                 decoder_channels: Sequence[int] | None = None):
        super().__init__()
        levels = int(round(math.log2(patch_size)))
        require(patch_size >= 2 and 2 ** levels == patch_size, "ViTUNet", "patch_size", patch_size,
                "use a power-of-two patch size (8, 16)")
        chans = list(decoder_channels) if decoder_channels is not None else [64 * 2 ** (levels - 1 - j)
                                                                           for j in range(levels)]
        require(len(chans) == levels and all(isinstance(c, int) and c > 0 for c in chans), "ViTUNet",
                "decoder_channels", decoder_channels, f"pass {levels} positive widths, one per x2 level")
        self.encoder = encoder
        for p in self.encoder.parameters():
            p.requires_grad_(False)
        depth, width = len(encoder.blocks), encoder.embed_dim
        # block outputs used: the last, then `levels - 1` skips at evenly spaced depths (UNETR: 3, 6, 9 of 12)
        self.skip_blocks = [max(0, depth * (k + 1) // levels - 1) for k in range(levels - 1)]
        self.bottom = nn.Conv2d(width, chans[0], 1)
        self.ups, self.skips, self.blocks = nn.ModuleList(), nn.ModuleList(), nn.ModuleList()
        cin = chans[0]
        for j in range(levels):
            cout = chans[j]
            self.ups.append(nn.ConvTranspose2d(cin, cout, 2, stride=2))
            if j < levels - 1:  # a block's tokens, up-sampled j + 1 times to this level's scale
                k = self.skip_blocks[levels - 2 - j]
                self.skips.append(_up(width, cout, j + 1))
                self.register_buffer(f"_skip_index_{j}", torch.tensor(k), persistent=False)
            else:  # full resolution: the image itself
                self.skips.append(_conv_block(in_chans, cout))
            self.blocks.append(_conv_block(2 * cout, cout))
            cin = cout
        self.head = nn.Conv2d(cin, 1, 1)

    def train(self, mode: bool = True) -> ViTUNet:
        super().train(mode)
        self.encoder.eval()  # frozen: no dropout, no statistics
        return self

    def _features(self, images: torch.Tensor) -> list[torch.Tensor]:
        indices = sorted(set(self.skip_blocks + [len(self.encoder.blocks) - 1]))
        with torch.no_grad():
            maps = self.encoder.forward_intermediates(images, indices=indices, norm=False, output_fmt="NCHW",
                                                      intermediates_only=True)
        return [m.detach() for m in maps], indices

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        maps, indices = self._features(images)
        by_block = dict(zip(indices, maps))
        x = self.bottom(by_block[len(self.encoder.blocks) - 1])
        for j, (up, skip, block) in enumerate(zip(self.ups, self.skips, self.blocks)):
            x = up(x)
            if j < len(self.ups) - 1:
                s = skip(by_block[int(getattr(self, f"_skip_index_{j}"))])
            else:
                s = skip(images)
            x = block(torch.cat([x, s], dim=1))
        return self.head(x)

    def decoder_parameters(self) -> list[nn.Parameter]:
        return [p for n, p in self.named_parameters() if not n.startswith("encoder.")]


__all__ = ["ViTUNet"]
