"""One gate table per optional kernel.

`GATES[name]` lists what a device must have for kernel `name` to run: the capability checks (each answered from the
architecture tables in `kestrel.platform.capabilities`) and the activation dtypes it computes in. Three consumers
read the same row: the kernel's `is_supported` (runtime selection), `requires_kernel(name)` (test skip markers, in
`kestrel.platform.testing`), and the GPU benchmark. Kernels that run everywhere (dense matmul, the FP8 dequant
fallback, the reference MoE) have no row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kestrel.platform import Platform, current_platform
from kestrel.platform.capabilities import (check_fla_chunk_gdn, check_fla_chunk_kda, check_fp8_scaled_mm, check_triton,
                                           check_triton_fp8, check_triton_kda_decode, check_triton_moe, check_triton_w4a16, check_int8_mm,
                                           check_triton_skinny_gemm)

Check = Callable[[Platform], tuple[bool, str]]


@dataclass(frozen=True)
class KernelGate:
    description: str
    requires: tuple[Check, ...]  # every check must pass on the platform
    act_dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)
    # Joint (layer x platform) conditions the kernel checks itself, listed here so the table tells the whole story.
    notes: str = ""


KDA_DECODE_HEAD_DIMS = (16, 32, 64, 128)  # the fused KDA decode's head sizes (Kimi-Linear: 128)

GATES: dict[str, KernelGate] = {
    "torch_scaled_mm": KernelGate(
        description="torch._scaled_mm FP8 GEMM (per-tensor; row-wise where the platform has it)",
        requires=(check_fp8_scaled_mm,),
        notes="row-wise schemes also need supports_fp8_rowwise_scaled_mm; K and N must be multiples of 16",
    ),
    "triton_fp8_block": KernelGate(
        description="Triton block-scaled FP8 GEMM with per-token-group (1x128) activation quantization",
        requires=(check_triton, check_triton_fp8),
        notes="block-wise weights only; activation group size must equal the weight block's K size",
    ),
    "triton_skinny_dense": KernelGate(
        description="unquantized bf16/fp16 linear: Triton split-K skinny GEMM for <= 8 rows x <= 2048 columns (decode at small "
                    "batch), torch matmul above",
        requires=(check_triton_skinny_gemm,),
        act_dtypes=(torch.bfloat16, torch.float16),
    ),
    "triton_w4a16": KernelGate(
        description="Triton W4A16 GEMM: 4-bit weights (GPTQ / AWQ / compressed-tensors pack-quantized, one repacked "
                    "layout) unpacked in the kernel, group scales and zeros, 16-bit activations, fp32 accumulation",
        requires=(check_triton_w4a16,),
        act_dtypes=(torch.bfloat16, torch.float16),
        notes="K a multiple of 8 and of the group size; group size a multiple of 16 or channel-wise",
    ),
    "torch_int8_mm": KernelGate(
        description="W8A8 INT8: per-channel int8 weights x dynamic per-token int8 activations via torch._int_mm",
        requires=(check_int8_mm,),
        act_dtypes=(torch.bfloat16, torch.float16),
        notes="K and N multiples of 8 (else the layer computes with dequantised weights)",
    ),
    "triton_fused_moe": KernelGate(
        description="Triton fused MoE: tokens sorted by expert, one grouped GEMM for gate_up (+SiLU-and-mul), one for "
                    "down (+routing weights)",
        requires=(check_triton_moe,),
        act_dtypes=(torch.bfloat16, torch.float16),
        notes="silu or swigluoai (gpt-oss) experts, expert biases; fused shared experts as extra always-selected "
              "experts",
    ),
    "triton_mxfp4_dequant_moe": KernelGate(
        description="MXFP4 experts dequantised once after loading, then the Triton fused MoE",
        requires=(check_triton_moe,),
        act_dtypes=(torch.bfloat16, torch.float16),
        notes="the first MXFP4 version: bf16/fp16 expert weights in memory (a fused W4A16 kernel comes next)",
    ),
    "triton_fp8_block_moe": KernelGate(
        description="the Triton fused MoE on block-quantized FP8 experts (per-token-group activation quantization)",
        requires=(check_triton_moe, check_triton_fp8),
        act_dtypes=(torch.bfloat16, torch.float16),
        notes="block K 128 = activation group; I and H multiples of the weight block",
    ),
    "triton_kda_fused_decode": KernelGate(
        description="Kimi Delta Attention decode in one Triton launch per layer and step: conv-state update, gates, "
                    "delta-rule step on the float32 state, gated RMSNorm",
        requires=(check_triton_kda_decode,),
        notes=f"head_dim in {KDA_DECODE_HEAD_DIMS} (the D x D state in registers); one token per request",
    ),
    "fla_chunk_kda": KernelGate(
        description="Kimi Delta Attention prefill: every prefill and chunk of a step in one fla-core chunk_kda call "
                    "(varlen cu_seqlens, initial states gathered from the state slots)",
        requires=(check_fla_chunk_kda,),
        act_dtypes=(torch.bfloat16, torch.float16),
        notes="fla-core at the pinned FLA_CORE_VERSION (a GPU-only extra); float32 models keep the PyTorch form",
    ),
    "fla_chunk_gated_delta_rule": KernelGate(
        description="Gated DeltaNet prefill (Qwen3-Next, Qwen3.5: one decay per head): every prefill and chunk of a "
                    "step in one fla-core chunk_gated_delta_rule call (varlen, initial states from the slots)",
        requires=(check_fla_chunk_gdn,),
        act_dtypes=(torch.bfloat16, torch.float16),
        notes="fla-core at the pinned FLA_CORE_VERSION; where it is closed, GDN layers take fla_chunk_kda with the "
              "decay broadcast over the key dim (the same recurrence), else the PyTorch form",
    ),
}


def kernel_gate(name: str, platform: Platform | None = None) -> tuple[bool, str]:
    """(True, "") when every requirement in GATES[name] holds on `platform` (default: the current one)."""
    gate = GATES[name]
    p = platform if platform is not None else current_platform()
    for check in gate.requires:
        ok, why = check(p)
        if not ok:
            return False, why
    return True, ""


def act_dtype_gate(name: str, dtype: torch.dtype) -> tuple[bool, str]:
    """(True, "") when GATES[name] lists `dtype` among the activation dtypes its kernel computes in."""
    dtypes = GATES[name].act_dtypes
    return (True, "") if dtype in dtypes else (False, f"dtype {dtype} not in {dtypes}")


def kernel_available(name: str, platform: Platform | None = None, dtype: torch.dtype | None = None) -> bool:
    ok, _ = kernel_gate(name, platform)
    return ok and (dtype is None or dtype in GATES[name].act_dtypes)
