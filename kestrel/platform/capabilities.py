"""Capability questions, one answer each, decided from architecture names.

Every table below is data; the functions read it. A CUDA-style numeric capability is never compared across vendors:
CUDA architectures are compared as `sm_NN` numbers among themselves, ROCm architectures are matched by name or by a
family pattern (`gfx12??`), and generic aliases such as `gfx12-generic` match nothing.

Where the framework has its own query (a `torch.cuda.is_scaled_mm_supported`-like function), it is preferred, but
only for the device that detection actually found; fake devices (tests) and older torch builds use the tables.
"""
from __future__ import annotations

import importlib.metadata
import re
from dataclasses import dataclass

import torch

from kestrel.platform import Platform, cuda_sm_number, current_platform

# '?' in a pattern stands for one hex digit: 'gfx12??' matches gfx1200, gfx1201, gfx1250 but not gfx12-generic.
_WILDCARD = "[0-9a-f]"


def _pattern_regex(pattern: str) -> re.Pattern:
    return re.compile("^" + re.escape(pattern).replace(r"\?", _WILDCARD) + "$")


@dataclass(frozen=True)
class ArchRule:
    """Which architectures have a feature: CUDA by minimum sm number and/or name patterns, ROCm by names/patterns."""

    cuda_min_sm: int | None = None  # "sm_89 and newer"
    cuda: tuple[str, ...] = ()  # explicit CUDA names/patterns ("sm_89", "sm_9?", "sm_10?")
    rocm: tuple[str, ...] = ()  # ROCm names/patterns ("gfx942", "gfx12??")
    cpu: bool = False

    def check(self, platform: Platform) -> tuple[bool, str]:
        arch = platform.arch_name
        if platform.kind == "cpu":
            return (True, "") if self.cpu else (False, "not available on the CPU")
        if platform.kind == "cuda":
            sm = cuda_sm_number(arch)
            if sm is None:
                return False, f"unrecognized CUDA architecture {arch!r}"
            if self.cuda_min_sm is not None and sm >= self.cuda_min_sm:
                return True, ""
            if any(_pattern_regex(p).match(arch) for p in self.cuda):
                return True, ""
            return False, f"{arch} is not in {self.describe_cuda()}"
        if platform.kind == "rocm":
            if any(_pattern_regex(p).match(arch) for p in self.rocm):
                return True, ""
            allowed = ", ".join(self.rocm) or "no ROCm architecture"
            return False, f"{arch} is not one of {allowed}"
        return False, f"unknown platform kind {platform.kind!r}"

    def describe_cuda(self) -> str:
        parts = []
        if self.cuda_min_sm is not None:
            parts.append(f"sm_{self.cuda_min_sm}+")
        parts.extend(self.cuda)
        return ", ".join(parts) if parts else "no CUDA architecture"


# ---------------------------------------------------------------------------------------------- the tables
# torch._scaled_mm with per-tensor scales. Mirrors PyTorch's own arch gate: CUDA sm_89 and newer; ROCm gfx942 (MI300),
# gfx950 (MI350) and RDNA4/gfx12 parts. gfx90a (MI200) and gfx1100 (RDNA3) have no FP8 matrix units.
FP8_SCALED_MM_ARCHS = ArchRule(cuda_min_sm=89, rocm=("gfx942", "gfx950", "gfx12??"))

# torch._scaled_mm with row-wise scales (scale_a [M,1], scale_b [1,N]). CUDA: torch's CUTLASS row-wise kernels exist
# for sm_89, sm_9x and sm_10x only (sm_120 falls outside them). ROCm: hipBLASLt row-wise on MI300/MI350.
FP8_ROWWISE_SCALED_MM_ARCHS = ArchRule(cuda=("sm_89", "sm_9?", "sm_10?"), rocm=("gfx942", "gfx950"))

# Triton itself (any kernel). Triton 3.x targets sm_80+ on CUDA and CDNA2+/RDNA3+ on ROCm.
TRITON_ARCHS = ArchRule(cuda_min_sm=80, rocm=("gfx90a", "gfx942", "gfx950", "gfx11??", "gfx12??"))

# Triton tl.dot on FP8 operands (hardware FP8 MMA): CUDA sm_89+; ROCm gfx942 (fnuz), gfx950, gfx12xx.
TRITON_FP8_ARCHS = ArchRule(cuda_min_sm=89, rocm=("gfx942", "gfx950", "gfx12??"))

# The skinny bf16/fp16 GEMM (split-K with a per-tile atomic counter, L2-only reads of the partials): checked on
# the H200 (sm_90) only; Ampere and newer CUDA share the instructions it uses. Not offered on ROCm until run there.
TRITON_SKINNY_GEMM_ARCHS = ArchRule(cuda_min_sm=80)

# The fused MoE (grouped GEMMs over expert-sorted tokens, an atomic-cursor layout kernel): written for the H200
# (sm_90); Ampere and newer CUDA share its instructions. Not offered on ROCm until run there.
TRITON_MOE_ARCHS = ArchRule(cuda_min_sm=80)
TRITON_W4A16_ARCHS = ArchRule(cuda_min_sm=80)  # the W4A16 GEMM (bf16 tensor-core dots)
INT8_MM_ARCHS = ArchRule(cuda_min_sm=80)  # torch._int_mm (int8 tensor cores, cuBLASLt)

# The fused Kimi Delta Attention decode (one program per request and head, the D x D float32 state in registers;
# plain Triton, no arch-specific instructions): written for the H200 (sm_90); Ampere and newer CUDA share what it
# uses. Not offered on ROCm until run there (vLLM widened its ROCm twin from gfx950 to gfx942 only once checked).
TRITON_KDA_DECODE_ARCHS = ArchRule(cuda_min_sm=80)

# fla-core's chunked KDA (`fla.ops.kda.chunk_kda`, the batched varlen prefill): plain Triton made for Ampere and newer
# CUDA, run by us on the H200 (sm_90). Not offered on ROCm until run there.
FLA_CHUNK_KDA_ARCHS = ArchRule(cuda_min_sm=80)
# fla-core's chunked Gated DeltaNet (`fla.ops.gated_delta_rule.chunk_gated_delta_rule`: one decay per head, the
# batched varlen prefill of Qwen3-Next / Qwen3.5 layers): the same plain Triton family as chunk_kda, same archs.
FLA_CHUNK_GDN_ARCHS = ArchRule(cuda_min_sm=80)
# The one fla-core release the chunk_kda call is written against (its argument names and conventions were read in
# this version's source: pyproject's `gpu` extra and scripts/device_wheels.sh pin the same).
FLA_CORE_VERSION = "0.6.0"

# Architectures whose FP8 e4m3 is the FNUZ variant (bias 8, no negative zero, max 240). gfx950 uses OCP e4m3fn.
FP8_FNUZ_ARCHS = ArchRule(rocm=("gfx940", "gfx941", "gfx942"))


def _platform(platform: Platform | None) -> Platform:
    return platform if platform is not None else current_platform()


def _torch_scaled_mm_query(platform: Platform) -> bool | None:
    """torch's own answer for the real device, when this torch has such a query; None otherwise."""
    if not (platform.detected and platform.is_cuda_alike):
        return None
    query = getattr(torch.cuda, "is_scaled_mm_supported", None)
    if not callable(query):
        return None
    try:
        answer = query()
    except Exception:  # an unexpected signature or a device error: keep the table's answer
        return None
    if isinstance(answer, tuple):  # a (supported, reason) style answer
        answer = answer[0] if answer else None
    return answer if isinstance(answer, bool) else None


def check_fp8_scaled_mm(platform: Platform | None = None) -> tuple[bool, str]:
    p = _platform(platform)
    answer = _torch_scaled_mm_query(p)
    if answer is not None:
        return answer, "" if answer else f"torch.cuda.is_scaled_mm_supported() is False on {p.describe()}"
    ok, why = FP8_SCALED_MM_ARCHS.check(p)
    return ok, "" if ok else f"no FP8 scaled-MM: {why}"


def _then(base, rule: ArchRule, what: str, platform: Platform | None) -> tuple[bool, str]:
    """`base`'s answer, then `rule`'s: the reason names the first check that failed."""
    p = _platform(platform)
    ok, why = base(p)
    if not ok:
        return ok, why
    ok, why = rule.check(p)
    return ok, "" if ok else f"{what}: {why}"


def check_fp8_rowwise_scaled_mm(platform: Platform | None = None) -> tuple[bool, str]:
    return _then(check_fp8_scaled_mm, FP8_ROWWISE_SCALED_MM_ARCHS, "no row-wise FP8 scaled-MM", platform)


def check_triton(platform: Platform | None = None) -> tuple[bool, str]:
    p = _platform(platform)
    if not p.triton_available:
        return False, "triton is not installed"
    ok, why = TRITON_ARCHS.check(p)
    return ok, "" if ok else f"triton does not target this device: {why}"


# Programmatic dependent launch (PTX griddepcontrol): a kernel launches while its predecessor runs and waits in
# griddepcontrol.wait, hiding the launch gap between the ~170 small kernels of a batch-1 decode step. CUDA sm_90+.
PDL_ARCHS = ArchRule(cuda_min_sm=90)


def check_pdl(platform: Platform | None = None) -> tuple[bool, str]:
    return _then(check_triton, PDL_ARCHS, "no programmatic dependent launch", platform)


def check_triton_skinny_gemm(platform: Platform | None = None) -> tuple[bool, str]:
    return _then(check_triton, TRITON_SKINNY_GEMM_ARCHS, "skinny GEMM not validated here", platform)


def check_triton_moe(platform: Platform | None = None) -> tuple[bool, str]:
    return _then(check_triton, TRITON_MOE_ARCHS, "fused MoE not validated here", platform)


def check_triton_w4a16(platform: Platform | None = None) -> tuple[bool, str]:
    return _then(check_triton, TRITON_W4A16_ARCHS, "W4A16 GEMM not validated here", platform)


def check_int8_mm(platform: Platform | None = None) -> tuple[bool, str]:
    """torch._int_mm (int8 x int8 -> int32 GEMM): CUDA only here (the CPU gets the dequantised fallback)."""
    p = _platform(platform)
    if not p.is_cuda:
        return False, f"torch._int_mm runs on CUDA here, not {p.describe()}"
    ok, why = INT8_MM_ARCHS.check(p)
    return ok, "" if ok else f"int8 GEMM not validated here: {why}"


def check_triton_kda_decode(platform: Platform | None = None) -> tuple[bool, str]:
    return _then(check_triton, TRITON_KDA_DECODE_ARCHS, "fused KDA decode not validated here", platform)


def installed_fla_core() -> str | None:
    """fla-core's installed version, read from its package metadata (None: not installed). Never imports fla:
    importing it where transformers is loaded rebinds transformers' KDA functions to fla's Triton kernels."""
    try:
        return importlib.metadata.version("fla-core")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_fla_chunk_kda(platform: Platform | None = None) -> tuple[bool, str]:
    ok, why = _then(check_triton, FLA_CHUNK_KDA_ARCHS, "fla chunk_kda not validated here", platform)
    return _fla_core_pinned() if ok else (ok, why)


def check_fla_chunk_gdn(platform: Platform | None = None) -> tuple[bool, str]:
    ok, why = _then(check_triton, FLA_CHUNK_GDN_ARCHS, "fla chunk_gated_delta_rule not validated here", platform)
    return _fla_core_pinned() if ok else (ok, why)


def _fla_core_pinned() -> tuple[bool, str]:
    version = installed_fla_core()
    if version != FLA_CORE_VERSION:
        return False, (f"fla-core {FLA_CORE_VERSION} is not installed (found {version})" if version else
                       f"fla-core is not installed (the GPU extra: pip install fla-core=={FLA_CORE_VERSION})")
    return True, ""


def check_triton_fp8(platform: Platform | None = None) -> tuple[bool, str]:
    return _then(check_triton, TRITON_FP8_ARCHS, "no FP8 tl.dot", platform)


def supports_fp8_scaled_mm(platform: Platform | None = None) -> bool:
    """torch._scaled_mm with per-tensor FP8 scales runs on this device."""
    return check_fp8_scaled_mm(platform)[0]


def supports_fp8_rowwise_scaled_mm(platform: Platform | None = None) -> bool:
    """torch._scaled_mm with row-wise scales (per-token activations x per-channel weights) runs on this device."""
    return check_fp8_rowwise_scaled_mm(platform)[0]


def supports_triton(platform: Platform | None = None) -> bool:
    """Triton is installed and targets this device."""
    return check_triton(platform)[0]


def supports_triton_fp8(platform: Platform | None = None) -> bool:
    """Triton kernels can multiply FP8 tiles on this device (FP8 MMA hardware)."""
    return check_triton_fp8(platform)[0]


def is_fp8_fnuz(platform: Platform | None = None) -> bool:
    return FP8_FNUZ_ARCHS.check(_platform(platform))[0]


def fp8_dtype(platform: Platform | None = None) -> torch.dtype:
    """The FP8 e4m3 dtype the device computes in: float8_e4m3fnuz on gfx94x, float8_e4m3fn elsewhere."""
    return torch.float8_e4m3fnuz if is_fp8_fnuz(platform) else torch.float8_e4m3fn
