"""One gate table for the optional KDA kernels: on fake platforms (CUDA sm_80, sm_90, sm_100, ROCm gfx942, the
CPU) the start-up compile list, the runtime choice and the GPU tests' skip condition are all read from the rows
GATES["triton_kda_fused_decode"] (the fused decode: the backend choice) and GATES["fla_chunk_kda"] (the batched
prefill through fla-core: the KDA impl's prefill choice, which also needs fla-core installed at the pinned version)
and agree; a consumer with a gate of its own (a runtime check that only knows sm_90, as vLLM's three hand-kept
gates once were, or one that forgets the fla-core requirement) is caught."""
import pytest
import torch

pytest.importorskip("triton")

from kestrel.attention.backends.triton_kda import KERNEL, TritonKDABackend  # noqa: E402
from kestrel.attention.kda import GDN_PREFILL_KERNEL, PREFILL_KERNEL, KDAImpl, startup_kernels  # noqa: E402
from kestrel.attention.selector import select_attention_backend  # noqa: E402
from kestrel.core.kv_spec import KDAStateSpec  # noqa: E402
from kestrel.platform import capabilities  # noqa: E402
from kestrel.platform.capabilities import FLA_CORE_VERSION, ArchRule  # noqa: E402
from kestrel.platform.testing import requires_kernel, use_platform  # noqa: E402

SPEC = KDAStateSpec(torch.bfloat16, num_heads=32, head_dim=128, conv_width=4, num_slots=9)  # Kimi-Linear-48B
# the table's answer, as declared in kestrel/platform/capabilities.py TRITON_KDA_DECODE_ARCHS
EXPECTED = {"sm_80": True, "sm_90": True, "sm_100": True, "gfx942": False, "cpu": False}


def consumers(arch: str, kernel: str = KERNEL) -> dict[str, bool]:
    """Whether each consumer would use `kernel` (the fused decode or the batched prefill) on `arch`."""
    with use_platform(arch) as p:
        skip = requires_kernel(kernel).args[0]
        backend = select_attention_backend(SPEC, 16, platform=p)
        chosen = (backend.name == TritonKDABackend.name if kernel == KERNEL else
                  backend.impl_cls.gdn_prefill_kernel(p, SPEC.dtype) == GDN_PREFILL_KERNEL
                  if kernel == GDN_PREFILL_KERNEL else backend.impl_cls.prefill_kernel(p, SPEC.dtype) == PREFILL_KERNEL)
        return {"start-up compile": kernel in startup_kernels(p, SPEC.dtype),
                "runtime choice": chosen,
                "GPU tests run": not skip}


def assert_consumers_agree(arch: str, kernel: str = KERNEL) -> bool:
    seen = consumers(arch, kernel)
    assert len(set(seen.values())) == 1, f"{arch}: the gate's consumers disagree: {seen}"
    return next(iter(seen.values()))


@pytest.mark.parametrize("arch", list(EXPECTED))
def test_consumers_agree(arch):
    assert assert_consumers_agree(arch) is EXPECTED[arch]


@pytest.fixture
def fla_installed(monkeypatch):
    """Pretend fla-core `version` is installed (None: not installed): the row reads its package metadata."""
    def install(version):
        monkeypatch.setattr(capabilities, "installed_fla_core", lambda: version)

    return install


# where fla-core is installed at the pinned version the batched prefill runs where the fused decode does (CUDA
# sm_80+); without it, or at another version, nowhere
@pytest.mark.parametrize("kernel", [PREFILL_KERNEL, GDN_PREFILL_KERNEL])  # KDA's chunk_kda; GDN's own
@pytest.mark.parametrize("fla", [FLA_CORE_VERSION, None, "0.5.0"])
@pytest.mark.parametrize("arch", list(EXPECTED))
def test_prefill_consumers_agree(arch, fla, kernel, fla_installed):
    fla_installed(fla)
    assert assert_consumers_agree(arch, kernel) is (EXPECTED[arch] and fla == FLA_CORE_VERSION)


def test_prefill_skip_reason_names_fla_core(fla_installed):
    fla_installed(None)
    with use_platform("sm_90"):
        assert "fla-core is not installed" in requires_kernel(PREFILL_KERNEL).kwargs["reason"]
    fla_installed("0.5.0")
    with use_platform("sm_90"):
        assert f"fla-core {FLA_CORE_VERSION} is not installed (found 0.5.0)" in requires_kernel(
            PREFILL_KERNEL).kwargs["reason"]


def test_a_consumer_with_its_own_gate_is_caught(monkeypatch):
    sm90_only = ArchRule(cuda=("sm_90",))

    def validate(cls, platform, dtype, head_size, block_size):
        ok, why = sm90_only.check(platform)
        return (True, "") if ok else (False, why)

    monkeypatch.setattr(TritonKDABackend, "validate", classmethod(validate))
    assert assert_consumers_agree("sm_90") is True  # where the private gate happens to match the table
    with pytest.raises(AssertionError, match=r"sm_100: the gate's consumers disagree: .*'runtime choice': False"):
        assert_consumers_agree("sm_100")


def test_a_prefill_choice_with_its_own_gate_is_caught(monkeypatch, fla_installed):
    """Two private gates the table would catch: an arch list of its own, and one that forgets fla-core."""
    fla_installed(FLA_CORE_VERSION)

    def sm90_only(cls, platform, dtype):
        return PREFILL_KERNEL if ArchRule(cuda=("sm_90",)).check(platform)[0] else None

    monkeypatch.setattr(KDAImpl, "prefill_kernel", classmethod(sm90_only))
    assert assert_consumers_agree("sm_90", PREFILL_KERNEL) is True
    with pytest.raises(AssertionError, match=r"sm_100: the gate's consumers disagree: .*'runtime choice': False"):
        assert_consumers_agree("sm_100", PREFILL_KERNEL)

    def any_cuda(cls, platform, dtype):  # the arch rule alone, without the fla-core requirement
        return PREFILL_KERNEL if capabilities.FLA_CHUNK_KDA_ARCHS.check(platform)[0] else None

    monkeypatch.setattr(KDAImpl, "prefill_kernel", classmethod(any_cuda))
    fla_installed(None)
    with pytest.raises(AssertionError, match=r"sm_90: the gate's consumers disagree: .*'runtime choice': True"):
        assert_consumers_agree("sm_90", PREFILL_KERNEL)
