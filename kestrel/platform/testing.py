"""Test helpers that read the same gate tables as runtime selection (imported by tests only)."""
from __future__ import annotations

import contextlib
import importlib.util

import pytest

from kestrel.platform import Platform, current_platform, fake_platform, set_platform_for_testing
from kestrel.platform.gates import GATES, kernel_gate


def requires_kernel(name: str):
    """Skip marker: the test needs kernel `name` to run on this machine's real device (per GATES[name])."""
    if name not in GATES:
        raise KeyError(f"no gate table row for kernel {name!r}; known: {', '.join(GATES)}")
    ok, why = kernel_gate(name, current_platform())
    return pytest.mark.skipif(not ok, reason=f"{name} is unavailable here: {why}")


def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


requires_triton_interpreter = pytest.mark.skipif(
    not triton_importable(), reason="triton is not installed (the Triton interpreter tests need it)"
)

requires_cuda = pytest.mark.skipif(not current_platform().is_cuda_alike, reason="needs a CUDA/ROCm device")


@contextlib.contextmanager
def use_platform(platform: Platform | str):
    """Install a fake device (an arch name or a Platform) for the duration of the block."""
    import kestrel.platform as _platform_module

    previous = _platform_module._override
    p = fake_platform(platform) if isinstance(platform, str) else platform
    set_platform_for_testing(p)
    try:
        yield p
    finally:
        set_platform_for_testing(previous)
