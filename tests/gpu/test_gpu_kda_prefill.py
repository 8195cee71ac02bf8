"""GPU checks for the batched KDA prefill through fla-core's chunk_kda (skipped where the gate row fla_chunk_kda is
closed: no CUDA, or no fla-core at the pinned version): fla's varlen call against our reference (kda_ref's
chunked delta rule per request) on the same inputs, and a KDA layer's mixed bf16 step (decodes, fresh prompts,
continued chunks, chunks across fla's 64-token chunk boundaries) through fla against the per-request PyTorch
path, at Kimi-Linear's head size 128. The tiny model's teacher-forced run with the fla prefill on is in
tests/gpu/test_gpu_kimi_linear.py."""
import pytest
import torch

from kestrel.attention.kda import KDAImpl
from kestrel.kernels import kda_ref
from kestrel.platform.testing import requires_kernel
from tests.kernels.test_kda_varlen import layer_case

pytestmark = [pytest.mark.gpu, requires_kernel("fla_chunk_kda")]

H, D = 4, 128  # Kimi-Linear-48B: 32 x 128
LENS = [1, 63, 64, 65, 200, 1000, 7]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def test_fla_varlen_equals_reference():
    """fla's chunk_kda_varlen and kda_ref.delta_rule_varlen (the contract) on the dtypes a bf16 layer passes (the
    convolution's output stays float32): float32 q, k (before their L2 norm) and v, the forget gate's log decay,
    post-sigmoid beta, float32 initial states; per request, outputs and final states within 1e-2 relative error,
    across fla's 64-token chunk boundaries (63, 64, 65 tokens) and from zero and nonzero states."""
    from kestrel.kernels.fla_kda import chunk_kda_varlen

    gen = torch.Generator().manual_seed(0)
    t = sum(LENS)
    q, k, v = (torch.randn(t, H, D, generator=gen).cuda() for _ in range(3))
    f = torch.randn(t, H * D, generator=gen).cuda()
    g = kda_ref.forget_gate(f, torch.rand(H, generator=gen).cuda(), torch.randn(H * D, generator=gen).cuda() - 2, D)
    beta = torch.rand(t, H, generator=gen).cuda()
    initial = torch.randn(len(LENS), H, D, D, generator=gen).cuda() * 0.1
    initial[0] = 0  # a fresh request
    cu_cpu = torch.tensor([0] + torch.tensor(LENS).cumsum(0).tolist())
    cu = cu_cpu.cuda()
    got, got_final = chunk_kda_varlen(q, k, v, g, beta, initial, cu, cu_cpu, D ** -0.5)
    want, want_final = kda_ref.delta_rule_varlen(q, k, v, g, beta, initial, cu, cu_cpu, D ** -0.5)
    assert got.shape == want.shape and got_final.dtype == torch.float32
    for b, (s, e) in enumerate(zip(cu_cpu[:-1].tolist(), cu_cpu[1:].tolist())):
        assert rel_err(got[s:e], want[s:e]) < 1e-2, (b, LENS[b])
        assert rel_err(got_final[b], want_final[b]) < 1e-2, (b, LENS[b])


def test_layer_step_through_fla_equals_per_request():
    """A mixed bf16 step of a KDA layer: one fla call for the prefills and chunks (states gathered from and written
    back to the slots), against the per-request PyTorch path on the same caches."""
    from kestrel.kernels.fla_kda import chunk_kda_varlen

    batch = [(1, 40), (1, 2), (300, 300), (65, 130), (64, 64), (5, 70), (2, 2)]
    slots = [3, 5, 1, 2, 4, 6, 7]
    w, inputs, cache, meta = layer_case(torch.bfloat16, h=H, d=D, batch=batch, slots=slots, device="cuda")
    fla, per_request = KDAImpl(H, D, D ** -0.5, H), KDAImpl(H, D, D ** -0.5, H)
    fla.resolve_prefill(torch.bfloat16)
    assert fla.varlen_delta_rule is chunk_kda_varlen  # the gate row is open here: the runtime picks fla
    per_request.varlen_delta_rule = None
    got_cache, want_cache = tuple(c.clone() for c in cache), tuple(c.clone() for c in cache)
    got = fla.forward_kda(w, *inputs, got_cache, meta)
    want = per_request.forward_kda(w, *inputs, want_cache, meta)
    qsl = meta.query_start_loc_cpu
    for b in range(len(batch)):
        s, e = qsl[b], qsl[b + 1]
        assert rel_err(got[s:e], want[s:e]) < 1e-2, (b, batch[b])
        assert rel_err(got_cache[0][slots[b]], want_cache[0][slots[b]]) < 1e-2, (b, batch[b])
    assert torch.equal(got_cache[1], want_cache[1])  # conv states: the inputs themselves
    assert torch.equal(got_cache[0][0], cache[0][0])  # the null slot untouched
