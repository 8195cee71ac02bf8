"""The attention-backend interface. A backend is a class with declared capabilities (class-level flags), a
metadata builder that turns a scheduled batch into tensors once per step, and an impl that runs the kernels.

Batch layout every backend receives (built by the model runner): requests are ordered decodes first, then
prefills/chunks. Token i of the flattened batch belongs to request b with query_start_loc[b] <= i <
query_start_loc[b+1]; request b's context (cached prefix + new tokens) is seq_lens[b] tokens long and its new
tokens sit at positions seq_lens[b] - q_len_b ... seq_lens[b] - 1. The KV cache of one layer is a pair
(k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim]; slot = block * block_size + offset."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kestrel.platform import Platform


@dataclass
class AttentionMetadata:
    num_tokens: int  # real tokens (the flattened batch may be padded beyond this for CUDA graphs)
    num_reqs: int
    num_decodes: int  # leading requests with exactly one query token
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = padding
    query_start_loc_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None

    @property
    def num_prefills(self) -> int:
        return self.num_reqs - self.num_decodes


class AttentionImpl:
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        self.num_heads, self.head_dim, self.scale, self.num_kv_heads = num_heads, head_dim, scale, num_kv_heads

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] for the new tokens; writes k/v into the cache, returns [T, Hq, D]."""
        raise NotImplementedError


class AttentionBackend:
    name: ClassVar[str]
    # declared capabilities
    devices: ClassVar[tuple[str, ...]] = ("cpu",)
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32,)
    head_sizes: ClassVar[tuple[int, ...] | None] = None  # None: any
    supports_prefix_caching: ClassVar[bool] = True
    supports_chunked_prefill: ClassVar[bool] = True
    supports_cuda_graphs: ClassVar[bool] = False
    supports_mla: ClassVar[bool] = False
    is_sparse: ClassVar[bool] = False
    supports_dense_mha_prefill: ClassVar[bool] = True

    impl_cls: ClassVar[type[AttentionImpl]]

    @classmethod
    def validate(cls, platform: Platform, dtype: torch.dtype, head_size: int, block_size: int) -> tuple[bool, str]:
        device = "cuda" if platform.is_cuda_alike else "cpu"
        if device not in cls.devices:
            return False, f"runs on {'/'.join(cls.devices)}, not {platform.arch_name}"
        if dtype not in cls.dtypes:
            return False, f"dtype {dtype} not in {cls.dtypes}"
        if cls.head_sizes is not None and head_size not in cls.head_sizes:
            return False, f"head size {head_size} not in {cls.head_sizes}"
        if block_size & (block_size - 1):
            return False, f"block size {block_size} is not a power of two"
        return True, ""
