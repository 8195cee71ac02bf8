"""Rotary position embedding with a precomputed cos/sin cache. Frequencies for the scaled variants (linear,
llama3, yarn, longrope) come from transformers' own rope-init functions so they match the reference exactly."""
from __future__ import annotations

import torch
from torch import nn

from kestrel.layers.fused import fused_ops_for


def _rope_params(hf_config, layer_type: str | None = None) -> dict:
    params = getattr(hf_config, "rope_parameters", None)
    if layer_type is not None:  # per layer type (Gemma 3: sliding_attention / full_attention)
        return dict(params[layer_type])
    if params and "rope_type" in params:
        return dict(params)
    legacy = dict(getattr(hf_config, "rope_scaling", None) or {})
    legacy.setdefault("rope_type", legacy.pop("type", "default"))
    legacy.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return legacy


def inv_freq_for(hf_config, head_dim: int, max_positions: int,
                 layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    params = _rope_params(hf_config, layer_type)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default" or (rope_type == "dynamic" and params.get("alpha")):
        # Hunyuan's "dynamic" with `alpha`: NTK-alpha, a fixed base theta * alpha^(d / (d - 2)) (no per-length update)
        base = params["rope_theta"] * params.get("alpha", 1.0) ** (head_dim / (head_dim - 2))
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type == "dynamic":
        # Serving batches many lengths at once, so NTK scaling is fixed at the engine's longest length instead of
        # following each sequence (HF recomputes per forward; the two agree up to the original context length).
        return ROPE_INIT_FUNCTIONS["dynamic"](hf_config, "cpu", seq_len=max_positions)
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    if layer_type is not None:
        return ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu", layer_type=layer_type)
    return ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")


def mrope_rows(sections: list[int], interleaved: bool, half: int) -> torch.Tensor:
    """Which position row (0 time, 1 height, 2 width) drives each of the `half` rotary frequencies under M-RoPE:
    sectioned (Qwen2.5-VL, GLM-4.xV: the first sections[0] frequencies read row 0, the next sections[1] row 1,
    then row 2) or interleaved (Qwen3-VL, Qwen3.5: t, h, w, t, h, w, ... while each row has frequencies left,
    then row 0)."""
    if interleaved:
        rows = [0] * half
        for row in (1, 2):
            for j in range(row, min(3 * sections[row], half), 3):
                rows[j] = row
        return torch.tensor(rows, dtype=torch.int64)
    if sum(sections) != half:
        raise ValueError(f"mrope_section {sections} covers {sum(sections)} of the rotary's {half} frequencies")
    return torch.repeat_interleave(torch.arange(3), torch.tensor(sections))


def mrope_option(hf_config, default: tuple[list[int], bool] | None = None) -> tuple[list[int], bool] | None:
    """(sections, interleaved): the config's `mrope_section` (and `mrope_interleaved`) over the family's default
    (transformers' Qwen-VL classes fall back to theirs where the config has none); None: not M-RoPE."""
    params = _rope_params(hf_config)
    sections = params.get("mrope_section")
    if not sections:
        return default
    return list(sections), bool(params.get("mrope_interleaved", default[1] if default else False))


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) rotary embedding, the HF Llama/Qwen convention; `interleaved` rotates adjacent
    pairs (x0, x1), (x2, x3), ... instead (GPT-J style, DeepSeek's MLA).

    `mrope` (sections, interleaved): multimodal RoPE. Positions may then be [3, T] (time, height, width rows;
    kestrel/core/positions.py) and each frequency takes its angle from its row (mrope_rows); [T] positions are
    the three rows equal, i.e. plain RoPE."""

    def __init__(self, hf_config, head_dim: int, max_positions: int, dtype: torch.dtype,
                 layer_type: str | None = None, interleaved: bool = False,
                 mrope: tuple[list[int], bool] | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.interleaved = interleaved
        inv_freq, scaling = inv_freq_for(hf_config, head_dim, max_positions, layer_type)
        inv_freq = inv_freq.to(torch.get_default_device())  # rope-init functions build on the CPU
        self.rot_dim = inv_freq.numel() * 2
        t = torch.arange(max_positions, dtype=torch.float, device=inv_freq.device)
        freqs = torch.outer(t, inv_freq)
        cache = torch.cat([freqs.cos() * scaling, freqs.sin() * scaling], dim=-1)  # [max_pos, rot_dim]
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        self.dtype = dtype
        self.mrope = mrope
        self._last = (None, None)  # the last [3, T] positions tensor and its (index, table)
        if mrope is not None:
            rows = mrope_rows(mrope[0], mrope[1], self.rot_dim // 2).to(inv_freq.device)
            self.register_buffer("_mrope_rows", torch.cat([rows, rows])[None, :], persistent=False)

    def cos_sin_for(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions, table) such that table[positions] is each token's cos|sin row, the form the fused kernels
        read: the shared cache itself for [T] positions; for [3, T] M-RoPE positions, each token's own row
        gathered from its three (the kernels then index it by 0..T-1)."""
        if positions.dim() == 1:
            return positions, self.cos_sin_cache
        if positions is self._last[0]:  # the layers of one forward share this rotary and its positions tensor
            return self._last[1]
        rows = self.cos_sin_cache[positions]  # [3, T, rot_dim]
        t = positions.shape[1]
        table = rows.gather(0, self._mrope_rows.expand(t, -1)[None]).squeeze(0)
        self._last = (positions, (torch.arange(t, device=positions.device), table))
        return self._last[1]

    def _rotate_pairs(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., : self.rot_dim].float(), x[..., self.rot_dim:]
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2).to(x.dtype)
        return torch.cat([out, rest], dim=-1) if rest.numel() else out

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., : self.rot_dim], x[..., self.rot_dim:]
        x1, x2 = rot.chunk(2, dim=-1)
        rotated = torch.cat([-x2, x1], dim=-1)
        out = (rot * cos + rotated * sin).to(x.dtype)
        return torch.cat([out, rest], dim=-1) if rest.numel() else out

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, Hq, D], k [T, Hkv, D] -> rotated (in place on CUDA, copies elsewhere)."""
        ops = fused_ops_for(q)
        if ops is not None and q.stride(-1) == 1 and k.stride(-1) == 1:
            index, table = self.cos_sin_for(positions)
            ops.rotary_embedding_(index, q, k, table, self.rot_dim, not self.interleaved)
            return q, k
        return self.rotate_copies(positions, q, k)

    def rotate_copies(self, positions: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rotated copies of any number of [T, H, D] tensors (also one alone: a key without its query)."""
        index, table = self.cos_sin_for(positions)
        cs = table[index]
        cos, sin = cs.chunk(2, dim=-1)
        if self.interleaved:
            cos, sin = cos[:, None, :], sin[:, None, :]
            return tuple(self._rotate_pairs(x, cos, sin) for x in xs)
        cos = torch.cat([cos, cos], dim=-1)[:, None, :].to(xs[0].dtype)
        sin = torch.cat([sin, sin], dim=-1)[:, None, :].to(xs[0].dtype)
        return tuple(self._rotate(x, cos, sin) for x in xs)


def rope_fraction(hf_config, default: float = 1.0) -> float:
    """The share of each head that rotates (`partial_rotary_factor`, in rope_parameters or the config itself)."""
    return (_rope_params(hf_config).get("partial_rotary_factor") or getattr(hf_config, "partial_rotary_factor", None)
            or default)


class QueryScale(nn.Module):
    """Queries times 1 + alpha * log(1 + floor((position + offset) / period)): Llama 4's attention-temperature tuning
    on its NoPE layers (alpha `attn_scale`, period `floor_scale`, offset 1) and the "llama-4 scaling" of Ministral 3
    and Mistral Small 4 (`llama_4_scaling_beta`, period `original_max_position_embeddings`, offset 0)."""

    def __init__(self, alpha: float, period: float, offset: float = 0.0):
        super().__init__()
        self.alpha, self.period, self.offset = float(alpha), float(period), float(offset)

    @classmethod
    def from_config(cls, hf_config, nope_layer: bool) -> "QueryScale | None":
        params = _rope_params(hf_config)
        beta = params.get("llama_4_scaling_beta")
        if beta:
            return cls(beta, params["original_max_position_embeddings"])
        if nope_layer and getattr(hf_config, "attn_temperature_tuning", False):
            return cls(hf_config.attn_scale, hf_config.floor_scale, 1.0)
        return None

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """[T] positions -> [T, 1, 1] float32 factors."""
        p = positions.float()
        return (1.0 + self.alpha * torch.log1p(torch.floor((p + self.offset) / self.period)))[:, None, None]
