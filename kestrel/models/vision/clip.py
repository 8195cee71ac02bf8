"""CLIP vision transformer (LLaVA-NeXT's tower): class token + bias-free patch conv + learned positions, a
LayerNorm before the encoder, and the shared pre-norm encoder run up to the layer the connector reads (LLaVA
takes `hidden_states[vision_feature_layer]`, usually the second-to-last, so later layers are not built;
post_layernorm only feeds CLIP's pooled output, which LLaVA never reads)."""
from __future__ import annotations

import torch
from torch import nn

from kestrel.models.vision.encoder import VisionEncoder, layers_for_feature


class CLIPVisionTransformer(nn.Module):
    def __init__(self, ctx, prefix: str, cfg, feature_layer: int = -1):
        super().__init__()
        h = cfg.hidden_size
        self.class_embedding = nn.Parameter(torch.empty(h, dtype=ctx.dtype), requires_grad=False)
        self.patch_embedding = nn.Conv2d(cfg.num_channels, h, cfg.patch_size, cfg.patch_size, bias=False,
                                         dtype=ctx.dtype)
        self.num_positions = (cfg.image_size // cfg.patch_size) ** 2 + 1
        self.position_embedding = nn.Embedding(self.num_positions, h, dtype=ctx.dtype)
        self.pre_layrnorm = nn.LayerNorm(h, eps=cfg.layer_norm_eps, dtype=ctx.dtype)  # (sic: the checkpoint name)
        self.num_layers = layers_for_feature(cfg, feature_layer)
        self.encoder = VisionEncoder(ctx, f"{prefix}.encoder", cfg, self.num_layers)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, 3, H, W] -> [n, 1 + num_patches, hidden] (the class token first)."""
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        x = torch.cat([cls, patches], dim=1) + self.position_embedding.weight[None]
        return self.encoder(self.pre_layrnorm(x))
