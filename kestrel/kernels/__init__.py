"""Kernel selection as data: an ordered candidate list per layer kind, walked once at model construction.

`select(kind, spec, backend, platform)` returns an instance of the first candidate whose three gates pass
(`is_supported(platform)`, `can_implement(spec)`, `can_implement_on(spec, platform)`). Gates are honest on their
own; the order only expresses preference.

Forcing (`--linear-backend NAME` / `--moe-backend NAME`, i.e. KernelConfig): the walk is restricted to NAME, and a
forced kernel that cannot serve a layer raises `KernelSelectionError` naming the layer and the reason. One
deliberate exception: a backend for quantized weights (family "fp8") does not apply to layers that are not
quantized at all (ignored modules of a mixed checkpoint); those take auto selection among dense kernels, logged
once. Forcing a dense kernel onto a quantized layer raises. No environment variable forces a kernel.
"""
from __future__ import annotations

import logging
from typing import Any

from kestrel.kernels.base import KernelCandidate, LinearKernel, LinearSpec
from kestrel.kernels.dense import TorchDenseLinear, TritonSkinnyDenseLinear
from kestrel.kernels.fp8 import Fp8DequantFallbackLinear, TorchScaledMMLinear, TritonFp8BlockLinear
from kestrel.kernels.int8 import Int8DequantFallbackLinear, TorchInt8MMLinear
from kestrel.kernels.moe import Fp8DequantMoE, MoEKernel, MoESpec, TorchMoE, TritonFp8BlockMoE, TritonFusedMoE
from kestrel.kernels.moe_int4 import Int4DequantMoE, TritonInt4DequantMoE
from kestrel.kernels.mxfp4 import Mxfp4DequantMoE, TritonMxfp4DequantMoE
from kestrel.kernels.w4a16 import TritonW4A16Linear, W4A16DequantLinear
from kestrel.platform import Platform, current_platform

logger = logging.getLogger(__name__)

# Priority order per layer kind. The first candidate that is supported on the platform and can implement the
# layer wins; a candidate's gates never rely on its position here.
CANDIDATES: dict[str, list[type[KernelCandidate]]] = {
    "linear": [
        TorchScaledMMLinear,  # FP8 per-tensor / row-wise via torch._scaled_mm
        TritonFp8BlockLinear,  # FP8 block-wise via Triton
        Fp8DequantFallbackLinear,  # FP8 anywhere: dequantize once, plain matmul
        TritonW4A16Linear,  # 4-bit GPTQ / AWQ / pack-quantized on CUDA: nibbles unpacked in a Triton GEMM
        W4A16DequantLinear,  # 4-bit anywhere: dequantize once, plain matmul
        TorchInt8MMLinear,  # W8A8 INT8 on CUDA: per-token int8 activations, torch._int_mm
        Int8DequantFallbackLinear,  # INT8 weights anywhere: dequantize once, plain matmul
        TritonSkinnyDenseLinear,  # unquantized bf16/fp16 on CUDA: skinny GEMM at small batch
        TorchDenseLinear,  # unquantized, everywhere
    ],
    "moe": [
        TritonFp8BlockMoE,  # FP8 block-quantized experts on CUDA
        TritonFusedMoE,  # bf16/fp16 experts on CUDA: sorted grouped GEMMs
        TritonMxfp4DequantMoE,  # MXFP4 experts (gpt-oss) on CUDA: dequantized once, then the fused MoE
        TritonInt4DequantMoE,  # INT4 pack-quantized experts on CUDA: dequantized once, the Triton fused MoE
        Fp8DequantMoE,  # FP8 block experts anywhere: dequantized once, the reference loop
        Int4DequantMoE,  # INT4 pack-quantized experts anywhere: dequantized once, the reference loop
        Mxfp4DequantMoE,  # MXFP4 experts (gpt-oss) anywhere: dequantized once, the reference loop
        TorchMoE,  # everywhere: the reference loop
    ],
}


class KernelSelectionError(RuntimeError):
    pass


_announced: set[tuple[str, str]] = set()


def reset_selection_log() -> None:
    """Forget which selections were logged at INFO (tests)."""
    _announced.clear()


def backend_names(kind: str) -> list[str]:
    """Valid values for the kind's backend option, 'auto' first (for the CLI's choices/help)."""
    return ["auto"] + [c.name for c in CANDIDATES[kind]]


def _log_selection(kind: str, cls: type, layer: str, skipped: list[str], note: str = "") -> None:
    key = (kind, cls.name)
    level = logging.DEBUG if key in _announced else logging.INFO
    _announced.add(key)
    suffix = f" (skipped: {'; '.join(skipped)})" if skipped else ""
    logger.log(level, "Selected %s for %s%s%s", cls.name, layer, suffix, note)


def _walk(kind, candidates, spec, platform) -> tuple[type | None, list[str]]:
    skipped: list[str] = []
    for cls in candidates:
        ok, why = cls.check(spec, platform)
        if ok:
            return cls, skipped
        skipped.append(f"{cls.name}: {why}")
    return None, skipped


def select(kind: str, spec: Any, backend: str = "auto", platform: Platform | None = None) -> KernelCandidate:
    """Instantiate the first kernel of `kind` that fits `spec`; `backend` restricts the walk to one name."""
    platform = platform or current_platform()
    if kind not in CANDIDATES:
        raise KernelSelectionError(f"unknown kernel kind {kind!r}; known: {', '.join(CANDIDATES)}")
    candidates = list(CANDIDATES[kind])
    layer = getattr(spec, "layer_name", "?")
    layer_family = getattr(spec, "family", "dense")
    note = ""
    if backend not in (None, "", "auto"):
        by_name = {c.name: c for c in candidates}
        if backend not in by_name:
            raise KernelSelectionError(
                f"unknown {kind} backend {backend!r}; choose one of: {', '.join(backend_names(kind))}"
            )
        forced = by_name[backend]
        if forced.family != "dense" and layer_family == "dense":
            # e.g. --linear-backend torch_scaled_mm on a model whose ignored layers are plain bf16
            candidates = [c for c in candidates if c.family == "dense"]
            note = f" (backend {backend!r} is for {forced.family} layers; this layer is not quantized)"
        else:
            candidates = [forced]
    cls, skipped = _walk(kind, candidates, spec, platform)
    if cls is None:
        forced_txt = f" (forced with backend={backend!r})" if backend not in (None, "", "auto") else ""
        raise KernelSelectionError(
            f"no {kind} kernel can serve layer {layer} on {platform.describe()}{forced_txt}: " + "; ".join(skipped)
        )
    _log_selection(kind, cls, layer, skipped, note)
    kernel = cls(spec, platform)
    kernel.skipped = tuple(skipped)
    return kernel


def selection_report(model) -> list[tuple[str, str, tuple[str, ...]]]:
    """(layer name, selected kernel, what was skipped before it) for every module of `model` that holds a kernel."""
    rows = []
    for _, module in model.named_modules():
        kernel = getattr(module, "kernel", None)
        if isinstance(kernel, KernelCandidate):
            rows.append((getattr(kernel.spec, "layer_name", "?"), kernel.name, kernel.skipped))
    return rows


__all__ = [
    "CANDIDATES",
    "KernelCandidate",
    "KernelSelectionError",
    "LinearKernel",
    "LinearSpec",
    "MoEKernel",
    "MoESpec",
    "backend_names",
    "reset_selection_log",
    "select",
    "selection_report",
]
