"""Qwen3-VL's vision tower: Qwen2.5-VL's (kestrel/models/vision/qwen_vit.py) with a conv3d bias, learned position
embeddings (a square grid resampled bilinearly to each image's patch grid) added to the patches, LayerNorm and a
GELU MLP in every block, full attention per frame everywhere (no windows), and DeepStack (not in Qwen3.5's): the
patches after the blocks of `deepstack_visual_indexes` go through mergers of their own (LayerNorm after the 2x2
shuffle), whose outputs the decoder adds to its first layers' outputs at the image's rows."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.models.vision.encoder import VisionMLP, vision_linear
from kestrel.models.vision.qwen_vit import VisionBlock, axial_inv_freq, cos_sin, patch_angles, patch_positions


class Qwen3VisionBlock(VisionBlock):
    @staticmethod
    def mlp_cls(ctx, prefix: str, cfg) -> nn.Module:
        return VisionMLP(ctx, prefix, cfg, ("linear_fc1", "linear_fc2"))

    def norm(self, ctx, size: int, cfg) -> nn.Module:
        return nn.LayerNorm(size, eps=1e-6, dtype=ctx.dtype)


class Qwen3PatchMerger(nn.Module):
    """2x2 blocks of patches -> one decoder row; `postshuffle`: the LayerNorm over the shuffled block (DeepStack's
    mergers) rather than over each patch."""

    def __init__(self, ctx, prefix: str, cfg, postshuffle: bool):
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.width if postshuffle else cfg.hidden_size, eps=1e-6, dtype=ctx.dtype)
        self.linear_fc1 = vision_linear(ctx, self.width, self.width, f"{prefix}.linear_fc1")
        self.linear_fc2 = vision_linear(ctx, self.width, cfg.out_hidden_size, f"{prefix}.linear_fc2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.width)) if self.postshuffle else self.norm(x).view(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VisionTransformer(nn.Module):
    def __init__(self, ctx, prefix: str, cfg):
        super().__init__()
        self.merge = cfg.spatial_merge_size
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, bias=True, dtype=ctx.dtype,
                                          kernel_size=(cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size))
        self.patch_embed.proj.requires_grad_(False)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size, dtype=ctx.dtype)
        self.pos_embed.requires_grad_(False)
        self.side = int(cfg.num_position_embeddings ** 0.5)
        self.register_buffer("inv_freq", axial_inv_freq(cfg), persistent=False)
        self.blocks = nn.ModuleList(Qwen3VisionBlock(ctx, f"{prefix}.blocks.{i}", cfg) for i in range(cfg.depth))
        self.merger = Qwen3PatchMerger(ctx, f"{prefix}.merger", cfg, postshuffle=False)
        self.deepstack_layers = list(getattr(cfg, "deepstack_visual_indexes", None) or [])  # none: Qwen3.5
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3PatchMerger(ctx, f"{prefix}.deepstack_merger_list.{i}", cfg, postshuffle=True)
            for i in range(len(self.deepstack_layers)))

    def position_embeddings(self, t: int, h: int, w: int) -> torch.Tensor:
        """The learned grid resampled to h x w (bilinear, corners aligned), in the patches' order."""
        grid = self.pos_embed.weight.view(self.side, self.side, -1).permute(2, 0, 1)[None].float()
        grid = F.interpolate(grid, size=(h, w), mode="bilinear", align_corners=True)[0].permute(1, 2, 0)
        rows, cols = patch_positions(1, h, w, self.merge).to(grid.device).unbind(-1)
        return grid[rows, cols].repeat(t, 1)

    def forward(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image's patches [t*h*w, C*T*P*P] and patch grid -> [t*h*w / merge^2, out_hidden_size * (1 +
        deepstack levels)]: the merger's rows, then each DeepStack level's."""
        t, h, w = grid
        proj = self.patch_embed.proj
        x = F.linear(pixels.to(proj.weight.dtype), proj.weight.view(proj.weight.shape[0], -1), proj.bias)
        x = x + self.position_embeddings(t, h, w).to(x.dtype)
        cos, sin = cos_sin(patch_angles(t, h, w, self.merge, self.inv_freq))
        frames, deep = [h * w] * t, []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames)
            if i in self.deepstack_layers:
                deep.append(self.deepstack_merger_list[self.deepstack_layers.index(i)](x))
        return torch.cat([self.merger(x)] + deep, dim=-1)
