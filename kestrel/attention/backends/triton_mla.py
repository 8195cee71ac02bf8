"""Triton MLA for CUDA: the absorbed split-K decode kernel over the paged latent cache (attention/ops/triton_mla.py)
and the dense prefill through the varlen Triton attention (attention/ops/triton_attention.py): each prefill's
context is expanded into per-head K/V laid out block-aligned per request, at a power-of-two head dim (DeepSeek's
192-dim keys and 128-dim values in 256-dim rows, written by one kernel, expand_kv); the query goes in unpadded
(the kernel reads its missing lanes as zeros) and only the value lanes of the output are stored.
Importing fails without Triton, and the selector then skips this backend."""
from __future__ import annotations

import torch

from kestrel.attention.mla import MLABackend, MLAImpl, MLAMetadata
from kestrel.platform import triton_gates as gates

_ok, _why = gates.triton_importable()
if not _ok:
    raise ImportError(_why)

from kestrel.attention.ops.triton_attention import prefill_attention  # noqa: E402
from kestrel.attention.ops.triton_mla import expand_kv, mla_decode_attention, write_latent  # noqa: E402
from kestrel.core.kv_spec import MLASpec  # noqa: E402


def dense_row_dim(layer) -> int:
    """The power-of-two width of the expanded K/V rows, the dense prefill's head dim (DeepSeek: 256 for its
    192-dim keys and 128-dim values)."""
    return 1 << (max(layer.qk_nope_head_dim + layer.qk_rope_head_dim, layer.v_head_dim) - 1).bit_length()


class TritonMLAImpl(MLAImpl):
    def write_latent(self, kv_c, k_pe, cache, slot_mapping) -> None:
        write_latent(kv_c, k_pe, cache, slot_mapping)  # block and row strides are kernel arguments

    def attend_latent(self, q_lat, q_pe, cache, meta: MLAMetadata) -> torch.Tensor:
        if meta.token_seq_lens is not None:  # a captured prefill: every token a row of the decode kernel
            return mla_decode_attention(q_lat, q_pe, cache, meta.token_block_tables, meta.token_seq_lens,
                                        self.scale, max_seq_len=meta.max_seq_len)
        # with dense prefill declared, the absorbed part is the decodes: one query token per request
        nr = meta.num_absorbed_reqs
        return mla_decode_attention(q_lat, q_pe, cache, meta.block_tables[:nr],
                                    meta.seq_lens[:nr], self.scale, max_seq_len=meta.max_seq_len)

    def attend_dense(self, q_nope, q_pe, cache, meta: MLAMetadata, layer, out) -> None:
        k_nope, k_pe, v = self.expand_contexts(cache, meta, layer)
        H = layer.num_heads
        d = dense_row_dim(layer)
        bs = cache.shape[1]
        # every context row is written whole (keys zero-padded); the block-alignment rows after each context
        # are never read (the prefill masks keys past seq_len), so no zero fill
        kbuf = q_nope.new_empty(meta.dense_num_blocks * bs, H, d)
        vbuf = torch.empty_like(kbuf)
        expand_kv(k_nope, k_pe, v, meta.dense_ctx_rows, kbuf, vbuf)
        prefill_attention(joined(q_nope, q_pe), kbuf.view(-1, bs, H, d), vbuf.view(-1, bs, H, d),
                          meta.dense_block_table, meta.dense_query_start_loc, meta.dense_seq_lens, self.scale,
                          out=out, max_query_len=meta.dense_max_query_len, max_seq_len=meta.dense_max_seq_len)


def joined(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[a, b] along the last dim: a view where b directly follows a in memory (q_nope and q_pe split from one
    projection output, rotated in place), else a copy."""
    if (a.dtype == b.dtype and a.shape[:-1] == b.shape[:-1] and a.stride() == b.stride() and a.stride(-1) == 1
            and b.data_ptr() == a.data_ptr() + a.shape[-1] * a.element_size()):
        return a.as_strided((*a.shape[:-1], a.shape[-1] + b.shape[-1]), a.stride())
    return torch.cat([a, b], dim=-1)


class TritonMLABackend(MLABackend):
    name = "triton_mla"
    devices = ("cuda",)
    dtypes = (torch.bfloat16, torch.float16)
    supports_cuda_graphs = True
    supports_dense_mha_prefill = True
    impl_cls = TritonMLAImpl

    @classmethod
    def validate(cls, platform, dtype, head_size, block_size):
        ok, why = super().validate(platform, dtype, head_size, block_size)
        if ok and block_size not in gates.GATES["block_sizes"]:
            return False, f"block_size {block_size} not in {gates.GATES['block_sizes']}"
        return ok, why

    @classmethod
    def validate_spec(cls, spec) -> tuple[bool, str]:
        ok, why = super().validate_spec(spec)
        if ok and isinstance(spec, MLASpec):
            L, R = spec.kv_lora_rank, spec.qk_rope_head_dim
            if L & (L - 1) or R & (R - 1) or R < 16:
                return False, f"latent dims {L} + {R}: the kernel needs powers of two and a rope part >= 16"
        return ok, why
