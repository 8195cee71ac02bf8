"""Qwen2.5-VL's native-resolution vision tower. An image arrives as its processor made it: patches of
3 x temporal_patch x patch x patch pixels [N, C*T*P*P], in an order where each 2x2 merge block's patches are
consecutive, and its patch grid (t, h, w). The tower embeds them (a conv3d whose stride is its kernel: one matmul),
rotates q/k by each patch's (row, column) (2-D RoPE: half the frequencies per axis), runs RMSNorm/SwiGLU blocks
whose attention covers either a window of merged tokens or a whole frame (variable-length attention over the
segments, PyTorch SDPA on equal-length segments batched), and merges each 2x2 block into one decoder embedding.
The windowed blocks read the patches reordered window by window; the merger's output is put back in raster
order."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.layers.activation import gated_activation
from kestrel.layers.norm import RMSNorm
from kestrel.models.vision.encoder import vision_linear


def patch_positions(t: int, h: int, w: int, merge: int) -> torch.Tensor:
    """[t*h*w, 2] (row, column) of each patch in the processor's order (2x2 merge blocks consecutive)."""
    rows = torch.arange(h)[:, None].expand(h, w)
    cols = torch.arange(w)[None, :].expand(h, w)
    blocks = lambda x: x.reshape(h // merge, merge, w // merge, merge).transpose(1, 2).flatten()  # noqa: E731
    return torch.stack([blocks(rows), blocks(cols)], dim=-1).repeat(t, 1)


def axial_inv_freq(cfg) -> torch.Tensor:
    """The 2-D RoPE's frequencies: a quarter of the head each for rows and columns."""
    half = cfg.hidden_size // cfg.num_heads // 2
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return 1.0 / theta ** (torch.arange(0, half, 2, dtype=torch.float) / half)


def patch_angles(t: int, h: int, w: int, merge: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """[t*h*w, half] rotary angles of each patch: its row's frequencies, then its column's."""
    return (patch_positions(t, h, w, merge).to(inv_freq.device, torch.float)[..., None] * inv_freq).flatten(1)


def cos_sin(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox cos / sin [N, 1, head_dim] (broadcast over heads) from [N, head_dim / 2] angles."""
    emb = torch.cat([angles, angles], dim=-1)[:, None, :]
    return emb.cos(), emb.sin()


def window_order(t: int, h: int, w: int, merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """The merged tokens' order window by window (frames, then windows of `window` x `window` merged tokens in
    raster order, each in raster order) and the windows' lengths in patches."""
    gh, gw = h // merge, w // merge
    index = torch.arange(t * gh * gw).reshape(t, gh, gw)
    order, lengths = [], []
    for f in range(t):
        for r in range(0, gh, window):
            for c in range(0, gw, window):
                block = index[f, r:r + window, c:c + window].flatten()
                order.append(block)
                lengths.append(block.numel() * merge * merge)
    return torch.cat(order), lengths


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Bidirectional attention within each segment of `lengths` consecutive rows; q, k, v [N, H, D]. Segments of
    one length go through SDPA together."""
    out = torch.empty_like(q)
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    by_len: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        by_len.setdefault(n, []).append(starts[i])
    for n, firsts in by_len.items():
        rows = (torch.tensor(firsts, device=q.device)[:, None] + torch.arange(n, device=q.device)).flatten()
        sel = [x.index_select(0, rows).view(len(firsts), n, *x.shape[1:]).transpose(1, 2) for x in (q, k, v)]
        o = F.scaled_dot_product_attention(*sel)  # [segments, H, n, D]
        out.index_copy_(0, rows, o.transpose(1, 2).reshape(-1, *q.shape[1:]))
    return out


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox rotary in float32 (transformers' vision rounding), back to x's dtype."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


class GatedMLP(nn.Module):
    def __init__(self, ctx, prefix: str, cfg, inter: int | None = None, bias: bool = True):
        """`inter`: the hidden width (the config's intermediate_size by default)."""
        super().__init__()
        h, inter = cfg.hidden_size, inter or cfg.intermediate_size
        self.gate_up_proj = vision_linear(ctx, h, [inter] * 2, f"{prefix}.gate_up_proj", bias)
        self.down_proj = vision_linear(ctx, inter, h, f"{prefix}.down_proj", bias)
        self.act = gated_activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class VisionBlock(nn.Module):
    """Pre-norm attention over the segments, then the MLP; Qwen2.5-VL's norms and MLP (RMSNorm, SwiGLU) and
    biases, which a tower of another family replaces (`norm`, `mlp_cls`, `qkv_bias`, `proj_bias`)."""
    mlp_cls = GatedMLP
    proj_bias = True

    def qkv_bias(self, cfg) -> bool:
        return True

    def norm(self, ctx, size: int, cfg) -> nn.Module:
        return RMSNorm(size, 1e-6, ctx.dtype)

    def __init__(self, ctx, prefix: str, cfg):
        super().__init__()
        h = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_heads, h // cfg.num_heads
        self.norm1, self.norm2 = self.norm(ctx, h, cfg), self.norm(ctx, h, cfg)
        self.attn = nn.Module()
        self.attn.qkv = vision_linear(ctx, h, 3 * h, f"{prefix}.attn.qkv", self.qkv_bias(cfg))
        self.attn.proj = vision_linear(ctx, h, h, f"{prefix}.attn.proj", self.proj_bias)
        self.mlp = self.mlp_cls(ctx, f"{prefix}.mlp", cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.attn.qkv(self.norm1(x)).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        o = varlen_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, lengths)
        x = x + self.attn.proj(o.reshape(n, -1))
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, ctx, prefix: str, cfg):
        super().__init__()
        width = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.ln_q = RMSNorm(cfg.hidden_size, 1e-6, ctx.dtype)
        self.mlp = nn.ModuleList([vision_linear(ctx, width, width, f"{prefix}.mlp.0"), nn.GELU(),
                                  vision_linear(ctx, width, cfg.out_hidden_size, f"{prefix}.mlp.2")])
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_q(x).view(-1, self.width)
        for m in self.mlp:
            x = m(x)
        return x


class Qwen2_5VisionTransformer(nn.Module):
    def __init__(self, ctx, prefix: str, cfg):
        super().__init__()
        self.cfg = cfg
        self.merge = cfg.spatial_merge_size
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, bias=False, dtype=ctx.dtype,
                                          kernel_size=(cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size))
        self.patch_embed.proj.requires_grad_(False)
        self.register_buffer("inv_freq", axial_inv_freq(cfg), persistent=False)
        self.blocks = nn.ModuleList(VisionBlock(ctx, f"{prefix}.blocks.{i}", cfg) for i in range(cfg.depth))
        self.full_attention = set(cfg.fullatt_block_indexes)
        self.window = cfg.window_size // self.merge // cfg.patch_size  # in merged tokens
        self.merger = PatchMerger(ctx, f"{prefix}.merger", cfg)

    def forward(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image's (or video's) patches [t*h*w, C*T*P*P] and patch grid (t, h, w) -> [t*h*w / merge^2,
        out_hidden_size]."""
        t, h, w = grid
        mm = self.merge ** 2
        weight = self.patch_embed.proj.weight
        x = F.linear(pixels.to(weight.dtype), weight.view(weight.shape[0], -1))
        n, c = x.shape
        order, window_lengths = window_order(t, h, w, self.merge, self.window)
        order = order.to(x.device)
        x = x.view(n // mm, mm, c)[order].view(n, c)
        angles = patch_angles(t, h, w, self.merge, self.inv_freq).view(n // mm, mm, -1)[order].view(n, -1)
        cos, sin = cos_sin(angles)
        frames = [h * w] * t
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames if i in self.full_attention else window_lengths)
        return self.merger(x)[torch.argsort(order)]
