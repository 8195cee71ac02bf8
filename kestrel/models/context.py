"""What every module constructor receives besides its name: the model context. Constructors take
`(ctx, prefix)`; the prefix is the module's dotted name in the checkpoint (layers find their index in it)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from kestrel.core.kv_spec import KVCacheSpec
from kestrel.distributed import ParallelInfo
from kestrel.models.hf_config import HFConfig


@dataclass
class ModelContext:
    config: HFConfig
    dtype: torch.dtype
    quant_config: Any = None  # kestrel.layers.quant config, or None
    linear_backend: str = "auto"
    moe_backend: str = "auto"
    fuse_shared_experts: str = "auto"  # MoE shared experts inside the routed-expert kernel: auto | on | off
    parallel: ParallelInfo = field(default_factory=ParallelInfo)  # tensor-parallel rank and group
    kv_cache_specs: dict[str, KVCacheSpec] = field(default_factory=dict)  # attention layer prefix -> its spec
    attention_layers: dict[str, Any] = field(default_factory=dict)  # attention layer prefix -> the layer
    # of them, a draft model's (speculative decoding), which ride on the model's full-attention KV group
    # (core/kv_spec.py attach_riders)
    draft_layers: list[str] = field(default_factory=list)
    _shared: dict[str, Any] = field(default_factory=dict)

    @property
    def text(self):
        """The decoder's HF config (text_config of multimodal checkpoints)."""
        return self.config.text

    @property
    def max_positions(self) -> int:
        return self.config.max_model_len

    def register_attention(self, prefix: str, layer, spec: KVCacheSpec) -> None:
        if prefix in self.attention_layers:
            raise ValueError(f"two attention layers named {prefix!r}")
        self.attention_layers[prefix] = layer
        self.kv_cache_specs[prefix] = spec

    def shared(self, key: str, build: Callable[[], Any]) -> Any:
        """One instance per model of something many layers use (a rotary cos/sin cache)."""
        if key not in self._shared:
            self._shared[key] = build()
        return self._shared[key]


def layer_index(prefix: str) -> int:
    """'model.layers.7.self_attn' -> 7: the first integer component of a module's name."""
    for part in prefix.split("."):
        if part.isdigit():
            return int(part)
    raise ValueError(f"no layer index in {prefix!r}")
