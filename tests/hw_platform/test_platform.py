"""Platform detection and capability gates, on fake devices (runs on the CPU)."""
from __future__ import annotations

import types

import pytest
import torch

import kestrel.platform as plat
from kestrel.platform import (
    Platform,
    cuda_sm_number,
    fake_platform,
    fp8_dtype,
    normalize_rocm_arch,
    supports_fp8_rowwise_scaled_mm,
    supports_fp8_scaled_mm,
    supports_triton,
    supports_triton_fp8,
)
from kestrel.platform.gates import GATES, kernel_gate
from kestrel.platform.testing import requires_kernel, use_platform

# arch: (fp8 scaled-MM, row-wise scaled-MM, triton FP8 dot, FP8 dtype)
FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz
CAPABILITIES = {
    "sm_75": (False, False, False, FN),
    "sm_80": (False, False, False, FN),
    "sm_86": (False, False, False, FN),
    "sm_89": (True, True, True, FN),
    "sm_90": (True, True, True, FN),
    "sm_100": (True, True, True, FN),
    "sm_120": (True, False, True, FN),
    "gfx90a": (False, False, False, FN),
    "gfx942": (True, True, True, FNUZ),
    "gfx950": (True, True, True, FN),
    "gfx1100": (False, False, False, FN),
    "gfx1201": (True, False, True, FN),
    "gfx12-generic": (False, False, False, FN),
    "cpu": (False, False, False, FN),
}


@pytest.mark.parametrize("arch", list(CAPABILITIES))
def test_capability_table(arch):
    p = fake_platform(arch)
    mm, rowwise, tri_fp8, dtype = CAPABILITIES[arch]
    assert supports_fp8_scaled_mm(p) is mm
    assert supports_fp8_rowwise_scaled_mm(p) is rowwise
    assert supports_triton_fp8(p) is tri_fp8
    assert fp8_dtype(p) == dtype


def test_gfx1100_never_gets_scaled_mm_even_though_its_number_is_large():
    # The vLLM bug: ROCm reported capability 110 >= 89 for RDNA3. Names, not numbers, decide here.
    p = fake_platform("gfx1100")
    assert not supports_fp8_scaled_mm(p)
    assert kernel_gate("torch_scaled_mm", p)[0] is False
    assert "gfx1100" in kernel_gate("torch_scaled_mm", p)[1]


def test_arch_name_normalization():
    assert normalize_rocm_arch("gfx942:sramecc+:xnack-") == "gfx942"
    assert normalize_rocm_arch("gfx90a:sramecc-:xnack+") == "gfx90a"
    assert fake_platform("gfx950:sramecc+:xnack-").arch_name == "gfx950"
    assert cuda_sm_number("sm_89") == 89 and cuda_sm_number("sm_100") == 100 and cuda_sm_number("sm_90a") == 90
    assert cuda_sm_number("gfx942") is None and cuda_sm_number("gfx12-generic") is None
    assert fake_platform("cpu").kind == "cpu" and fake_platform("sm_90").kind == "cuda"
    assert fake_platform("gfx1100").kind == "rocm"
    with pytest.raises(ValueError):
        fake_platform("tpu_v5")


def test_triton_needs_installation_and_a_gpu():
    assert supports_triton(fake_platform("sm_90", triton_available=True))
    assert not supports_triton(fake_platform("sm_90", triton_available=False))
    assert not supports_triton(fake_platform("cpu", triton_available=True))
    assert not supports_triton_fp8(fake_platform("sm_80"))  # Triton runs, but there is no FP8 MMA


def _fake_cuda(monkeypatch, *, hip=None, capability=(9, 0), gcn="", name="GPU"):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: capability)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: types.SimpleNamespace(gcnArchName=gcn, name=name))
    monkeypatch.setattr(torch.version, "hip", hip, raising=False)


def test_detection_cuda(monkeypatch):
    _fake_cuda(monkeypatch, capability=(10, 0), name="B200")
    p = plat._detect()
    assert (p.kind, p.arch_name, p.detected) == ("cuda", "sm_100", True)


def test_detection_rocm_strips_feature_suffixes(monkeypatch):
    _fake_cuda(monkeypatch, hip="6.4", gcn="gfx942:sramecc+:xnack-", name="MI300X", capability=(9, 4))
    p = plat._detect()
    assert (p.kind, p.arch_name) == ("rocm", "gfx942")
    assert fp8_dtype(p) == torch.float8_e4m3fnuz


def test_torch_query_wins_only_for_the_detected_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_scaled_mm_supported", lambda *a: True, raising=False)
    real_sm80 = Platform("cuda", "sm_80", "A100", detected=True)
    assert supports_fp8_scaled_mm(real_sm80) is True  # torch's own answer for the real device
    assert supports_fp8_scaled_mm(fake_platform("sm_80")) is False  # fake devices: the table
    monkeypatch.setattr(torch.cuda, "is_scaled_mm_supported", lambda *a: False, raising=False)
    assert supports_fp8_scaled_mm(Platform("rocm", "gfx942", detected=True)) is False


def test_torch_query_errors_fall_back_to_the_table(monkeypatch):
    def broken(*a):
        raise RuntimeError("no device")

    monkeypatch.setattr(torch.cuda, "is_scaled_mm_supported", broken, raising=False)
    assert supports_fp8_scaled_mm(Platform("cuda", "sm_90", detected=True)) is True
    assert supports_fp8_scaled_mm(Platform("rocm", "gfx1100", detected=True)) is False


def test_use_platform_restores_previous_override():
    with use_platform("sm_90"):
        with use_platform("gfx942") as inner:
            assert plat.current_platform() is inner
        assert plat.current_platform().arch_name == "sm_90"
    assert plat.current_platform().detected


def test_requires_kernel_reads_the_gate_table():
    for name in GATES:
        mark = requires_kernel(name)
        assert mark.args[0] == (not kernel_gate(name)[0])
        assert name in mark.kwargs["reason"]
    with pytest.raises(KeyError):
        requires_kernel("no_such_kernel")
