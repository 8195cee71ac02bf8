"""What the hardware can do. Every platform fact comes from `current_platform()`, which tests replace.

A `Platform` is a frozen description of one device: its kind ("cpu" | "cuda" | "rocm"), its architecture name
("sm_90", "gfx942", ...) and a few facts about the software around it (is Triton importable). Capability
questions ("can torch._scaled_mm run here?") are plain functions of a Platform, answered from architecture-name
tables in `kestrel.platform.capabilities`; per-kernel gates live in `kestrel.platform.gates`. Tests build fake
devices with `fake_platform("gfx1100")` and install them with `set_platform_for_testing`.
"""
from __future__ import annotations

import functools
import importlib.util
import re
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Platform:
    kind: str  # "cpu" | "cuda" | "rocm"
    arch_name: str  # "cpu", "sm_90", "gfx942", ... (normalized: no ROCm feature suffixes)
    device_name: str = ""
    triton_available: bool = False  # `import triton` would succeed
    # True only for the Platform produced by detection on this machine. Framework queries about "the current
    # device" (e.g. torch.cuda.is_scaled_mm_supported) are consulted only then; fake devices use the tables.
    detected: bool = False

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def is_rocm(self) -> bool:
        return self.kind == "rocm"

    @property
    def is_cpu(self) -> bool:
        return self.kind == "cpu"

    @property
    def is_cuda_alike(self) -> bool:
        return self.kind in ("cuda", "rocm")

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cuda" if self.is_cuda_alike else "cpu")

    def describe(self) -> str:
        return self.arch_name if self.kind != "cpu" else "cpu"


_CUDA_ARCH = re.compile(r"^sm_(\d+)[af]?$")


def normalize_rocm_arch(gcn_arch_name: str) -> str:
    """'gfx942:sramecc+:xnack-' -> 'gfx942'. Generic aliases ('gfx12-generic') are kept verbatim, never parsed."""
    return gcn_arch_name.strip().split(":")[0].lower()


def cuda_sm_number(arch_name: str) -> int | None:
    """'sm_89' -> 89, 'sm_100' -> 100, 'sm_90a' -> 90; None for anything that is not a CUDA arch name.

    Only for comparing CUDA architectures with each other; ROCm names are never turned into numbers.
    """
    m = _CUDA_ARCH.match(arch_name)
    return int(m.group(1)) if m else None


def kind_of_arch(arch_name: str) -> str:
    if arch_name == "cpu":
        return "cpu"
    if arch_name.startswith("sm_"):
        return "cuda"
    if arch_name.startswith("gfx"):
        return "rocm"
    raise ValueError(f"unknown architecture name {arch_name!r} (expected 'cpu', 'sm_NN' or 'gfxNNN')")


def fake_platform(arch_name: str, *, triton_available: bool | None = None, device_name: str = "") -> Platform:
    """A fake device for tests: the kind follows from the name; GPUs get Triton by default, the CPU does not."""
    kind = kind_of_arch(arch_name)
    arch = normalize_rocm_arch(arch_name) if kind == "rocm" else arch_name
    if triton_available is None:
        triton_available = kind != "cpu"
    return Platform(kind, arch, device_name or f"fake {arch}", triton_available=triton_available, detected=False)


def _triton_importable() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def _detect() -> Platform:
    triton_ok = _triton_importable()
    if not torch.cuda.is_available():
        return Platform("cpu", "cpu", "cpu", triton_available=triton_ok, detected=True)
    props = torch.cuda.get_device_properties(0)
    if getattr(torch.version, "hip", None):
        return Platform("rocm", normalize_rocm_arch(props.gcnArchName), props.name, triton_ok, detected=True)
    major, minor = torch.cuda.get_device_capability(0)
    return Platform("cuda", f"sm_{major}{minor}", props.name, triton_ok, detected=True)


_override: Platform | None = None


@functools.cache
def _detected() -> Platform:
    return _detect()


def current_platform() -> Platform:
    return _override if _override is not None else _detected()


def set_platform_for_testing(platform: Platform | None) -> None:
    """Replace the detected platform (tests use fake devices); None restores detection."""
    global _override
    _override = platform


from kestrel.platform.capabilities import (  # noqa: E402  (the capability functions need Platform)
    fp8_dtype,
    is_fp8_fnuz,
    supports_fp8_rowwise_scaled_mm,
    supports_fp8_scaled_mm,
    supports_triton,
    supports_triton_fp8,
)

__all__ = [
    "Platform",
    "cuda_sm_number",
    "current_platform",
    "fake_platform",
    "fp8_dtype",
    "is_fp8_fnuz",
    "normalize_rocm_arch",
    "set_platform_for_testing",
    "supports_fp8_rowwise_scaled_mm",
    "supports_fp8_scaled_mm",
    "supports_triton",
    "supports_triton_fp8",
]
