"""Kimi Delta Attention and Gated DeltaNet (kda_ref.DeltaOptions) with the fused Triton decode
(kestrel/kernels/triton_ops/kda_decode.py: one launch per layer and step) for the decode rows; prefills and chunks
as in every KDA backend (kestrel/attention/kda.py: one batched fla call where its gate row is open, else the
PyTorch chunked form per request). Offered only where the gate table's row `triton_kda_fused_decode`
(kestrel/platform/gates.py) is open: the same row decides what start-up compiles (`startup_kernels`) and which GPU
tests run (requires_kernel)."""
from __future__ import annotations

import torch

from kestrel.attention.kda import GDN_PREFILL_KERNEL, PREFILL_KERNEL, KDABackend, KDAImpl
from kestrel.kernels.triton_ops.kda_decode import kda_fused_decode
from kestrel.platform import Platform
from kestrel.platform.gates import GATES, KDA_DECODE_HEAD_DIMS, kernel_gate

KERNEL = "triton_kda_fused_decode"


class TritonKDAImpl(KDAImpl):
    def forward_decode(self, w, qkv, f, beta_logits, gate, cache, slots, seq_lens):
        recurrent, conv = cache
        o = w.delta
        return kda_fused_decode(qkv, f, beta_logits, gate, w.conv_weight, w.A_log, w.dt_bias, w.o_norm_weight,
                                w.norm_eps, recurrent, conv, slots, seq_lens, o.key_heads, o.per_head_decay,
                                o.gate_act)


class TritonKDABackend(KDABackend):
    name = "triton_kda"
    devices = ("cuda",)
    dtypes = GATES[KERNEL].act_dtypes
    head_sizes = KDA_DECODE_HEAD_DIMS
    supports_cuda_graphs = True
    impl_cls = TritonKDAImpl
    kernels = (KERNEL, PREFILL_KERNEL, GDN_PREFILL_KERNEL)

    @classmethod
    def validate(cls, platform: Platform, dtype: torch.dtype, head_size: int, block_size: int) -> tuple[bool, str]:
        ok, why = kernel_gate(KERNEL, platform)
        if not ok:
            return False, why
        return super().validate(platform, dtype, head_size, block_size)

    @classmethod
    def validate_spec(cls, spec) -> tuple[bool, str]:
        v = getattr(spec, "value_head_dim", None)  # Gated DeltaNet: the value heads' size too
        if v is not None and v not in KDA_DECODE_HEAD_DIMS:
            return False, f"value head size {v} not in {KDA_DECODE_HEAD_DIMS}"
        return super().validate_spec(spec)
