"""The attention-backend interface. A backend is a class with declared capabilities (class-level flags), a
metadata builder that turns a step's batch into the metadata its kernels read (also for CUDA-graph capture and
before each replay), and an impl that runs the kernels. Backends are chosen per KV-cache group.

Batch layout every backend receives (built by the model runner): requests are ordered decodes first, then
prefills/chunks. Token i of the flattened batch belongs to request b with query_start_loc[b] <= i <
query_start_loc[b+1]; request b's context (cached prefix + new tokens) is seq_lens[b] tokens long and its new
tokens sit at positions seq_lens[b] - q_len_b ... seq_lens[b] - 1. A full-attention layer's cache is a pair
(k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim]; slot = block * block_size + offset.
Sliding-window layers read only the blocks under their window (the rest may be the null block)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kestrel.core.kv_spec import FullAttentionSpec, KVCacheSpec
from kestrel.platform import Platform


@dataclass
class CommonAttentionMetadata:
    """What every group's metadata shares: the step's shape and the per-request lengths (device + host)."""
    num_tokens: int  # real tokens (the flattened batch may be padded beyond this for CUDA graphs)
    num_reqs: int
    num_decodes: int  # leading requests with exactly one query token
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    query_start_loc_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None
    bidirectional_lens_cpu: list[int] | None = None  # per request: its prefix attended both ways (None: causal)


@dataclass
class AttentionMetadata:
    num_tokens: int
    num_reqs: int
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32, this group's
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = padding
    query_start_loc_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None
    bidirectional_lens_cpu: list[int] | None = None


class AttentionMetadataBuilder:
    """Builds one group's metadata from the common part and the group's block table and slot mapping (views of the
    runner's persistent buffers). The default serves paged backends whose kernels need nothing else."""
    # declared capabilities: the CUDA-graph sets beyond decode whose captured metadata stays valid for this builder
    # ("verify": every row k + 1 queries; "prefill": one request's chunk beside a pad request; the query positions
    # come from query_start_loc and seq_lens on the device). A subclass that builds other metadata declares its own.
    graph_steps: ClassVar[frozenset[str]] = frozenset({"verify", "prefill"})
    # a captured prefill runs each token as a one-query row over its own prefix (a table row per token): its
    # graphs cover contexts up to their bucket size only
    prefill_graph_per_token: ClassVar[bool] = False

    def __init__(self, spec: KVCacheSpec, block_size: int, device: torch.device):
        self.spec, self.block_size, self.device = spec, block_size, device

    def build(self, common: CommonAttentionMetadata, block_table: torch.Tensor,
              slot_mapping: torch.Tensor) -> AttentionMetadata:
        c = common
        return AttentionMetadata(c.num_tokens, c.num_reqs, c.num_decodes, c.max_query_len, c.max_seq_len,
                                 c.query_start_loc, c.seq_lens, block_table, slot_mapping, c.query_start_loc_cpu,
                                 c.seq_lens_cpu, c.bidirectional_lens_cpu)

    def build_for_capture(self, common: CommonAttentionMetadata, block_table: torch.Tensor,
                          slot_mapping: torch.Tensor) -> AttentionMetadata:
        """Metadata a captured decode graph keeps reading: it must point into the persistent buffers only."""
        return self.build(common, block_table, slot_mapping)

    def graph_variants(self) -> tuple[str, ...]:
        """The forms a captured decode step of this group can take; one graph is captured per form (the first is
        what build_for_capture builds). One form unless a builder decides between kernel paths per step."""
        return ("",)

    def captured_variant(self, metadata: AttentionMetadata, variant: str) -> AttentionMetadata:
        """build_for_capture's metadata in another of graph_variants' forms (sharing its buffers)."""
        return metadata

    def step_variant(self) -> str:
        """The form of the step this builder last built (build), which a graph replay of that step must match."""
        return ""

    def update_captured(self, metadata: AttentionMetadata) -> None:
        """Device work at the start of a captured decode forward, recorded into the graph so that every replay
        redoes it: device fields of the captured metadata derived from the persistent buffers (seq_lens). None
        here: paged kernels read the buffers directly."""

    def prepare_replay(self, metadata: AttentionMetadata, num_reqs: int, padded: int) -> None:
        """Before replaying a graph captured for `padded` rows with `num_reqs` real ones: padded rows read no
        context and write nothing (seq_len 0, slot -1), which the kernels treat as empty."""
        if padded > num_reqs:
            metadata.seq_lens[num_reqs:padded].zero_()
            metadata.slot_mapping[num_reqs:padded].fill_(-1)


class AttentionImpl:
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None,
                 attention_chunk_size: int | None = None, sinks: torch.Tensor | None = None):
        """sliding_window W: a query at position p sees keys p-W+1 .. p (None or 0: all of 0 .. p).
        sinks: the layer's per-head sink logits, float32 [num_heads] (gpt-oss; None: none), read at each forward.
        attention_chunk_size C: keys floor(p / C) * C .. p (chunked local attention; None or 0: off).
        logits_soft_cap c: scaled logits s become c * tanh(s / c) (Gemma 2; None or 0: off)."""
        self.num_heads, self.head_dim, self.scale, self.num_kv_heads = num_heads, head_dim, scale, num_kv_heads
        if sliding_window is not None and (int(sliding_window) != sliding_window or sliding_window < 0):
            raise ValueError(f"sliding_window must be a non-negative integer or None, got {sliding_window!r}")
        if logits_soft_cap is not None and not logits_soft_cap >= 0:
            raise ValueError(f"logits_soft_cap must be >= 0 or None, got {logits_soft_cap!r}")
        self.sliding_window = int(sliding_window or 0)
        self.logits_soft_cap = float(logits_soft_cap or 0.0)
        self.attention_chunk_size = int(attention_chunk_size or 0)
        self.sinks = sinks
        # an FP8 cache's per-tensor scales (float32 scalar tensors of the layer; kestrel/attention/kv_quant.py)
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] for the new tokens; writes k/v into the cache, returns [T, Hq, D]."""
        raise NotImplementedError

    def attend(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
               meta: AttentionMetadata) -> torch.Tensor:
        """forward without the cache write: q [T, Hq, D] over what the cache holds (a layer reading another layer's
        cache: core/kv_spec.py SharedKVSpec)."""
        raise NotImplementedError(f"{type(self).__name__} cannot read another layer's KV cache")


class AttentionBackend:
    name: ClassVar[str]
    # declared capabilities
    devices: ClassVar[tuple[str, ...]] = ("cpu",)
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32,)
    head_sizes: ClassVar[tuple[int, ...] | None] = None  # None: any
    cache_specs: ClassVar[tuple[type, ...]] = (FullAttentionSpec,)  # spec classes it reads (subclasses included)
    supports_sliding_window: ClassVar[bool] = False
    supports_chunked_attention: ClassVar[bool] = False
    supports_cuda_graphs: ClassVar[bool] = False
    supports_bidirectional_prefix: ClassVar[bool] = False
    supports_attention_sinks: ClassVar[bool] = False  # a per-head logit in the softmax denominator (gpt-oss)
    kv_cache_dtypes: ClassVar[tuple[torch.dtype, ...]] = ()  # quantised cache dtypes it reads (FP8 KV cache)

    impl_cls: ClassVar[type[AttentionImpl]]
    builder_cls: ClassVar[type[AttentionMetadataBuilder]] = AttentionMetadataBuilder

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

    @classmethod
    def validate_spec(cls, spec: KVCacheSpec) -> tuple[bool, str]:
        if not isinstance(spec, cls.cache_specs):
            return False, f"reads no {type(spec).__name__}"
        if getattr(spec, "sliding_window", 0) and not cls.supports_sliding_window:
            return False, "no sliding window"
        if getattr(spec, "attention_chunk_size", 0) and not cls.supports_chunked_attention:
            return False, "no chunked local attention"
        return True, ""

    @classmethod
    def validate_kv_cache_dtype(cls, platform: Platform, cache_dtype: torch.dtype,
                                dtype: torch.dtype) -> tuple[bool, str]:
        """A cache in the model's dtype, or one of the quantised dtypes the backend reads."""
        if cache_dtype != dtype and cache_dtype not in cls.kv_cache_dtypes:
            return False, f"no {cache_dtype} KV cache"
        return True, ""
