"""Triton MLA for CUDA: the absorbed split-K decode kernel over the paged latent cache (attention/ops/triton_mla.py)
and the dense prefill through the varlen Triton attention (attention/ops/triton_attention.py): each prefill's
context is expanded into per-head K/V laid out block-aligned per request, padded to a power-of-two head dim
(DeepSeek's 192-dim keys and 128-dim values both to 256; zero dims change neither scores nor outputs).
Importing fails without Triton, and the selector then skips this backend."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kestrel.attention.mla import MLABackend, MLAImpl, MLAMetadata
from kestrel.platform import triton_gates as gates

_ok, _why = gates.triton_importable()
if not _ok:
    raise ImportError(_why)

from kestrel.attention.ops.triton_attention import prefill_attention  # noqa: E402
from kestrel.attention.ops.triton_mla import mla_decode_attention, write_latent  # noqa: E402
from kestrel.core.kv_spec import MLASpec  # noqa: E402


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


class TritonMLAImpl(MLAImpl):
    def write_latent(self, kv_c, k_pe, cache, slot_mapping) -> None:
        write_latent(kv_c, k_pe, cache, slot_mapping)  # row strides are kernel arguments

    def attend_latent(self, q_lat, q_pe, cache, meta: MLAMetadata) -> torch.Tensor:
        # with dense prefill declared, the absorbed part is the decodes: one query token per request
        nr = meta.num_absorbed_reqs
        return mla_decode_attention(q_lat, q_pe, cache, meta.block_tables[:nr],
                                    meta.seq_lens[:nr], self.scale, max_seq_len=meta.max_seq_len)

    def attend_dense(self, q_nope, q_pe, cache, meta: MLAMetadata, layer) -> torch.Tensor:
        k_nope, k_pe, v = self.expand_contexts(cache, meta, layer)
        H, nope, R, vd = layer.num_heads, layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.v_head_dim
        d = _pow2(max(nope + R, vd))
        bs = cache.shape[1]
        rows = meta.dense_num_blocks * bs
        kbuf = q_nope.new_zeros(rows, H, d)
        vbuf = q_nope.new_zeros(rows, H, d)
        r = meta.dense_ctx_rows
        kbuf[r, :, :nope] = k_nope
        kbuf[r, :, nope:nope + R] = k_pe.to(kbuf.dtype)[:, None, :]
        vbuf[r, :, :vd] = v
        q = F.pad(torch.cat([q_nope, q_pe], dim=-1), (0, d - nope - R))
        na, nr = meta.num_absorbed_reqs, meta.num_reqs
        qsl = meta.query_start_loc[na:nr + 1] - meta.num_absorbed_tokens
        qsl_cpu, sl_cpu = meta.query_start_loc_cpu, meta.seq_lens_cpu
        out = prefill_attention(q, kbuf.view(-1, bs, H, d), vbuf.view(-1, bs, H, d), meta.dense_block_table, qsl,
                                meta.dense_seq_lens, self.scale,
                                max_query_len=max(qsl_cpu[b + 1] - qsl_cpu[b] for b in range(na, nr)),
                                max_seq_len=max(sl_cpu[na:nr]))
        return out[..., :vd]


class TritonMLABackend(MLABackend):
    name = "triton_mla"
    devices = ("cuda",)
    dtypes = (torch.bfloat16, torch.float16)
    supports_cuda_graphs = True
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
