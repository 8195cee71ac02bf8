"""GLM-4.1V / 4.5V / 4.6V's vision tower: Qwen2.5-VL's blocks (kestrel/models/vision/qwen_vit.py: 2-D RoPE,
full attention per frame, RMSNorm at the config's eps, a SwiGLU MLP as wide as out_hidden_size, no biases but
the optional qkv one) after a conv3d patch embedding with bias and an RMSNorm, plus learned position embeddings (a
square grid sampled bicubically at each patch's centre, borders clamped); after the blocks an RMSNorm, a 2x2
convolution that merges each block of patches (the processor keeps them consecutive) into out_hidden_size, and the
merger: a projection, LayerNorm, GELU, then a SwiGLU of intermediate_size."""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.layers.norm import RMSNorm
from kestrel.models.vision.encoder import vision_linear
from kestrel.models.vision.qwen_vit import (GatedMLP, VisionBlock, axial_inv_freq, cos_sin, patch_angles,
                                            patch_positions)


class Glm4vVisionBlock(VisionBlock):
    proj_bias = False

    @staticmethod
    def mlp_cls(ctx, prefix: str, cfg) -> nn.Module:
        return GatedMLP(ctx, prefix, cfg, inter=cfg.out_hidden_size, bias=False)

    def qkv_bias(self, cfg) -> bool:
        return bool(getattr(cfg, "attention_bias", False))

    def norm(self, ctx, size: int, cfg) -> nn.Module:
        return RMSNorm(size, cfg.rms_norm_eps, ctx.dtype)


class Glm4vPatchMerger(GatedMLP):
    """proj -> LayerNorm -> GELU -> the SwiGLU (gate/up/down under the merger's own name)."""

    def __init__(self, ctx, prefix: str, cfg):
        dim = cfg.out_hidden_size
        shape = SimpleNamespace(hidden_size=dim, intermediate_size=cfg.intermediate_size, hidden_act=cfg.hidden_act)
        super().__init__(ctx, prefix, shape, bias=False)
        self.proj = vision_linear(ctx, dim, dim, f"{prefix}.proj", bias=False)
        self.post_projection_norm = nn.LayerNorm(dim, dtype=ctx.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.gelu(self.post_projection_norm(self.proj(x))))


class Glm4vVisionTransformer(nn.Module):
    def __init__(self, ctx, prefix: str, cfg):
        super().__init__()
        self.merge = cfg.spatial_merge_size
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, bias=True, dtype=ctx.dtype,
                                          kernel_size=(cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size))
        self.post_conv_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)
        self.embeddings = nn.Module()
        self.embeddings.position_embedding = nn.Embedding((cfg.image_size // cfg.patch_size) ** 2, cfg.hidden_size,
                                                          dtype=ctx.dtype)
        self.side = cfg.image_size // cfg.patch_size
        self.register_buffer("inv_freq", axial_inv_freq(cfg), persistent=False)
        self.blocks = nn.ModuleList(Glm4vVisionBlock(ctx, f"{prefix}.blocks.{i}", cfg) for i in range(cfg.depth))
        self.post_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)
        self.downsample = nn.Conv2d(cfg.hidden_size, cfg.out_hidden_size, kernel_size=self.merge, stride=self.merge,
                                    dtype=ctx.dtype)
        self.merger = Glm4vPatchMerger(ctx, f"{prefix}.merger", cfg)
        self.requires_grad_(False)

    def position_embeddings(self, t: int, h: int, w: int) -> torch.Tensor:
        """The learned grid sampled (bicubic, corners not aligned, borders clamped) at each patch's centre."""
        weight = self.embeddings.position_embedding.weight
        grid = weight.view(self.side, self.side, -1).permute(2, 0, 1)[None].float()
        rows, cols = patch_positions(1, h, w, self.merge).to(weight.device, torch.float).unbind(-1)
        at = torch.stack([(cols + 0.5) / w * 2 - 1, (rows + 0.5) / h * 2 - 1], dim=-1)[None, :, None]
        out = F.grid_sample(grid, at, mode="bicubic", align_corners=False, padding_mode="border")
        return out[0, :, :, 0].t().to(weight.dtype).repeat(t, 1)

    def forward(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image's patches [t*h*w, C*T*P*P] and patch grid -> [t*h*w / merge^2, out_hidden_size]."""
        t, h, w = grid
        proj = self.patch_embed.proj
        x = F.linear(pixels.to(proj.weight.dtype), proj.weight.view(proj.weight.shape[0], -1), proj.bias)
        x = self.post_conv_layernorm(x)
        cos, sin = cos_sin(patch_angles(t, h, w, self.merge, self.inv_freq))
        x = x + self.position_embeddings(t, h, w).to(x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin, [h * w] * t)
        x = self.post_layernorm(x).view(-1, self.merge, self.merge, x.shape[-1]).permute(0, 3, 1, 2)
        return self.merger(self.downsample(x).flatten(1))
