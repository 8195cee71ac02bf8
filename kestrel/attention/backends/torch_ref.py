"""Reference paged attention in plain PyTorch (kestrel/attention/ops/reference.py): gathers each request's K/V
through its block table. Slow but simple and exact; the CPU backend and the yardstick for the Triton kernels."""
from __future__ import annotations

import torch

from kestrel.attention.backend import AttentionBackend, AttentionImpl, AttentionMetadata
from kestrel.attention.kv_quant import FP8_KV_DTYPES
from kestrel.attention.ops.reference import paged_attention_ref, reshape_and_cache_ref


class TorchRefImpl(AttentionImpl):
    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        scales = {"k_scale": self.k_scale, "v_scale": self.v_scale}
        reshape_and_cache_ref(k, v, k_cache, v_cache, meta.slot_mapping, **scales)
        return self.attend(q, kv_cache, meta)

    def attend(self, q, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        scales = {"k_scale": self.k_scale, "v_scale": self.v_scale}
        n = meta.num_tokens
        out = torch.zeros_like(q)
        paged_attention_ref(q[:n], k_cache, v_cache, meta.block_tables,
                            meta.query_start_loc_cpu or meta.query_start_loc, meta.seq_lens_cpu or meta.seq_lens,
                            self.scale, out=out[:n], sliding_window=self.sliding_window,
                            softcap=self.logits_soft_cap, bidirectional_lens=meta.bidirectional_lens_cpu,
                            chunk_size=self.attention_chunk_size, sinks=self.sinks, **scales)
        return out


class TorchRefBackend(AttentionBackend):
    name = "torch_ref"
    devices = ("cpu", "cuda")
    dtypes = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    supports_sliding_window = True
    supports_chunked_attention = True
    supports_bidirectional_prefix = True
    supports_attention_sinks = True
    kv_cache_dtypes = FP8_KV_DTYPES
    impl_cls = TorchRefImpl
