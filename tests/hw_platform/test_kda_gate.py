"""One gate table for the fused KDA decode: on fake platforms (CUDA sm_80, sm_90, sm_100, ROCm gfx942, the CPU)
the start-up compile list, the runtime backend choice and the GPU tests' skip condition are all read from
GATES["triton_kda_fused_decode"] and agree; a consumer with a gate of its own (a runtime check that only knows
sm_90, as vLLM's three hand-kept gates once were) is caught."""
import pytest
import torch

pytest.importorskip("triton")

from kestrel.attention.backends.triton_kda import KERNEL, TritonKDABackend  # noqa: E402
from kestrel.attention.kda import startup_kernels  # noqa: E402
from kestrel.attention.selector import select_attention_backend  # noqa: E402
from kestrel.core.kv_spec import KDAStateSpec  # noqa: E402
from kestrel.platform.capabilities import ArchRule  # noqa: E402
from kestrel.platform.testing import requires_kernel, use_platform  # noqa: E402

SPEC = KDAStateSpec(torch.bfloat16, num_heads=32, head_dim=128, conv_width=4, num_slots=9)  # Kimi-Linear-48B
# the table's answer, as declared in kestrel/platform/capabilities.py TRITON_KDA_DECODE_ARCHS
EXPECTED = {"sm_80": True, "sm_90": True, "sm_100": True, "gfx942": False, "cpu": False}


def consumers(arch: str) -> dict[str, bool]:
    """Whether each consumer would use the fused decode on `arch`."""
    with use_platform(arch) as p:
        skip = requires_kernel(KERNEL).args[0]
        return {"start-up compile": KERNEL in startup_kernels(p, SPEC.dtype),
                "runtime choice": select_attention_backend(SPEC, 16, platform=p).name == TritonKDABackend.name,
                "GPU tests run": not skip}


def assert_consumers_agree(arch: str) -> bool:
    seen = consumers(arch)
    assert len(set(seen.values())) == 1, f"{arch}: the gate's consumers disagree: {seen}"
    return next(iter(seen.values()))


@pytest.mark.parametrize("arch", list(EXPECTED))
def test_consumers_agree(arch):
    assert assert_consumers_agree(arch) is EXPECTED[arch]


def test_a_consumer_with_its_own_gate_is_caught(monkeypatch):
    sm90_only = ArchRule(cuda=("sm_90",))

    def validate(cls, platform, dtype, head_size, block_size):
        ok, why = sm90_only.check(platform)
        return (True, "") if ok else (False, why)

    monkeypatch.setattr(TritonKDABackend, "validate", classmethod(validate))
    assert assert_consumers_agree("sm_90") is True  # where the private gate happens to match the table
    with pytest.raises(AssertionError, match=r"sm_100: the gate's consumers disagree: .*'runtime choice': False"):
        assert_consumers_agree("sm_100")
