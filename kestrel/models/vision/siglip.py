"""SigLIP vision transformer (PaliGemma's tower): patch conv with bias + learned position embeddings, the shared
pre-norm encoder, and a final LayerNorm. The attention-pooling head (`vision_use_head`, on by default in SigLIP's
config) is never built, whatever the flag: it pools one vector per image and PaliGemma reads every patch, so a
checkpoint's head tensors (under HEAD_PREFIX) are dropped on load."""
from __future__ import annotations

import torch
from torch import nn

from kestrel.models.vision.encoder import VisionEncoder

HEAD_PREFIX = "head."  # the pooling head's tensors, relative to the tower


class SiglipVisionTransformer(nn.Module):
    def __init__(self, ctx, prefix: str, cfg):
        super().__init__()
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, cfg.patch_size,
                                         dtype=ctx.dtype)
        self.num_patches = (cfg.image_size // cfg.patch_size) ** 2
        self.position_embedding = nn.Embedding(self.num_patches, cfg.hidden_size, dtype=ctx.dtype)
        self.encoder = VisionEncoder(ctx, f"{prefix}.encoder", cfg, cfg.num_hidden_layers)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=ctx.dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, 3, H, W] -> [n, num_patches, hidden]."""
        x = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        x = x + self.position_embedding.weight[None, : x.shape[1]]
        return self.post_layernorm(self.encoder(x))
