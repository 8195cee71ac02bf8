"""The pre-norm ViT encoder that SigLIP and CLIP share: LayerNorm -> bidirectional attention -> residual,
LayerNorm -> MLP -> residual. Inputs are [num_images, num_patches, hidden]."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.layers.linear import Linear


def vision_linear(ctx, input_size: int, output_sizes, prefix: str, bias: bool = True) -> Linear:
    """Vision layers stay unquantized (quantized checkpoints keep their towers in the model dtype)."""
    return Linear(input_size, output_sizes, bias, ctx.dtype, prefix, None, ctx.linear_backend)


def activation(name: str):
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    raise ValueError(f"unsupported vision activation {name!r}")


class VisionAttention(nn.Module):
    def __init__(self, ctx, prefix: str, cfg):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // self.num_heads
        h = cfg.hidden_size
        self.qkv_proj = vision_linear(ctx, h, [h, h, h], f"{prefix}.qkv_proj")
        self.out_proj = vision_linear(ctx, h, h, f"{prefix}.out_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv_proj(x.reshape(b * n, c)).view(b, n, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [b, heads, n, d]
        o = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5)
        return self.out_proj(o.transpose(1, 2).reshape(b * n, c)).view(b, n, c)


class VisionMLP(nn.Module):
    """fc1 -> activation -> fc2 over any leading dims; `names`: the two linears' checkpoint names."""

    def __init__(self, ctx, prefix: str, cfg, names: tuple[str, str] = ("fc1", "fc2")):
        super().__init__()
        self.names = names
        setattr(self, names[0], vision_linear(ctx, cfg.hidden_size, cfg.intermediate_size, f"{prefix}.{names[0]}"))
        setattr(self, names[1], vision_linear(ctx, cfg.intermediate_size, cfg.hidden_size, f"{prefix}.{names[1]}"))
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fc1, fc2 = (getattr(self, n) for n in self.names)
        return fc2(self.act(fc1(x.reshape(-1, x.shape[-1])))).view(x.shape)


class VisionEncoderLayer(nn.Module):
    def __init__(self, ctx, prefix: str, cfg):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=ctx.dtype)
        self.self_attn = VisionAttention(ctx, f"{prefix}.self_attn", cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=ctx.dtype)
        self.mlp = VisionMLP(ctx, f"{prefix}.mlp", cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, ctx, prefix: str, cfg, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(ctx, f"{prefix}.layers.{i}", cfg) for i in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def layers_for_feature(cfg, feature_layer: int) -> int:
    """Encoder layers to run for HF's `hidden_states[feature_layer]` (index 0 = the embeddings)."""
    n = cfg.num_hidden_layers
    k = feature_layer if feature_layer >= 0 else n + 1 + feature_layer
    if not 0 <= k <= n:
        raise ValueError(f"vision_feature_layer {feature_layer} outside a {n}-layer tower")
    return k
