"""What the hardware can do. Every platform fact comes from `current_platform()`, which tests replace."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Platform:
    kind: str  # "cpu" | "cuda" | "rocm"
    arch_name: str  # "cpu", "sm_90", "gfx942", ...
    device_name: str = ""

    @property
    def is_cuda_alike(self) -> bool:
        return self.kind in ("cuda", "rocm")

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cuda" if self.is_cuda_alike else "cpu")


def _detect() -> Platform:
    if not torch.cuda.is_available():
        return Platform("cpu", "cpu", "cpu")
    props = torch.cuda.get_device_properties(0)
    if getattr(torch.version, "hip", None):
        return Platform("rocm", props.gcnArchName.split(":")[0], props.name)
    major, minor = torch.cuda.get_device_capability(0)
    return Platform("cuda", f"sm_{major}{minor}", props.name)


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
