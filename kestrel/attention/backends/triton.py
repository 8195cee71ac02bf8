"""Triton paged attention for CUDA: split-K decode (GQA-grouped) for pure-decode batches, varlen causal
prefill over the paged cache (cached prefixes, chunks) otherwise. Importing fails without Triton, and the
selector then skips this backend."""
from __future__ import annotations

import torch

from kestrel.attention.backend import AttentionBackend, AttentionImpl, AttentionMetadata
from kestrel.platform import triton_gates as gates

_ok, _why = gates.triton_importable()
if not _ok:
    raise ImportError(_why)

from kestrel.kernels.triton_ops.fused_ops import qk_norm_rope_cache  # noqa: E402
from kestrel.attention.ops.triton_attention import decode_attention, prefill_attention, reshape_and_cache  # noqa: E402
from kestrel.platform import Platform, is_fp8_fnuz, supports_triton_fp8  # noqa: E402


class TritonImpl(AttentionImpl):
    fuses_qkv_prologue = True

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        return self.attend(q, kv_cache, meta)

    def forward_qkv(self, qkv, positions, cos_sin_cache, q_norm, k_norm, kv_cache, meta: AttentionMetadata):
        """From the fused qkv projection: q/k RMSNorm (if given), rotary and the cache write in one kernel."""
        k_cache, v_cache = kv_cache
        q = qk_norm_rope_cache(qkv, positions, cos_sin_cache, self.num_heads, self.num_kv_heads, self.head_dim,
                               k_cache, v_cache, meta.slot_mapping,
                               q_norm.weight if q_norm is not None else None,
                               k_norm.weight if k_norm is not None else None,
                               q_norm.eps if q_norm is not None else 1e-6, self.k_scale, self.v_scale)
        return self.attend(q, kv_cache, meta)

    def attend(self, q, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        out = torch.empty_like(q)
        options = {"sliding_window": self.sliding_window, "softcap": self.logits_soft_cap,
                   "attention_chunk_size": self.attention_chunk_size, "sinks": self.sinks,
                   "k_scale": self.k_scale, "v_scale": self.v_scale}
        if meta.num_decodes == meta.num_reqs:
            decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, self.scale, out=out,
                             max_seq_len=meta.max_seq_len, **options)
        else:
            n = meta.num_tokens
            prefill_attention(q[:n], k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                              self.scale, out=out[:n], max_query_len=meta.max_query_len,
                              max_seq_len=meta.max_seq_len, **options)
        return out


class TritonBackend(AttentionBackend):
    name = "triton"
    devices = ("cuda",)
    dtypes = tuple(d for d in gates.GATES["dtypes"] if d != torch.float32)
    head_sizes = gates.GATES["head_dims"]  # the head dims checked (64, 128, 256, 512)
    supports_sliding_window = True
    supports_chunked_attention = True
    supports_cuda_graphs = True
    supports_attention_sinks = True
    kv_cache_dtypes = gates.GATES["kv_cache_dtypes"]
    impl_cls = TritonImpl

    @classmethod
    def validate(cls, platform: Platform, dtype, head_size, block_size):
        ok, why = super().validate(platform, dtype, head_size, block_size)
        if ok:
            ok, why = gates.check_attention(dtype, head_size, block_size)
        return ok, why

    @classmethod
    def validate_kv_cache_dtype(cls, platform: Platform, cache_dtype, dtype):
        ok, why = super().validate_kv_cache_dtype(platform, cache_dtype, dtype)
        if ok and cache_dtype != dtype:
            if not supports_triton_fp8(platform) or is_fp8_fnuz(platform):
                return False, f"a {cache_dtype} KV cache needs Triton float8 conversions (sm_89+), not on " \
                              f"{platform.arch_name}"
        return ok, why
