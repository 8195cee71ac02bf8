"""Random LoRA adapters in PEFT's folder format (adapter_model.safetensors + adapter_config.json), written without
peft: for benchmarks and tests of --enable-lora on Llama-like models."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import torch

PEFT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def projection_dims(config: Mapping) -> dict[str, tuple[int, int]]:
    """(in, out) features of each attention and MLP projection, from a config.json's fields."""
    h, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or h // heads
    inter = config["intermediate_size"]
    return {"q_proj": (h, heads * hd), "k_proj": (h, kv * hd), "v_proj": (h, kv * hd), "o_proj": (heads * hd, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def write_random_adapter(out: Path, config: Mapping, rank: int, seed: int, targets=PEFT_TARGETS,
                         a_scale: float | None = 0.1, b_scale: float = 0.1, dtype: torch.dtype = torch.float32) -> Path:
    """Random A (times a_scale; None: 1 / sqrt(in features)) and B (times b_scale) for `targets` of every layer
    of the model whose config.json fields `config` holds; lora_alpha = 2 * rank."""
    dims = projection_dims(config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for t in targets:
            prefix = f"base_model.model.model.layers.{layer}.{'mlp' if t in _MLP else 'self_attn'}.{t}"
            din, dout = dims[t]
            scale_a = din ** -0.5 if a_scale is None else a_scale
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, din, generator=gen) * scale_a).to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(dout, rank, generator=gen) * b_scale).to(dtype)
    return save_adapter(out, tensors, rank, list(targets), task_type="CAUSAL_LM")


def save_adapter(out: Path, tensors: dict[str, torch.Tensor], rank: int, target_modules, **config) -> Path:
    """A PEFT LoRA folder: `tensors` (PEFT's names) and its adapter_config.json (lora_alpha = 2 * rank, no dropout,
    no bias; `config`: further fields)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": target_modules, "bias": "none",
        "lora_dropout": 0.0, **config}))
    return out
