"""GPU checks for the batched delta-rule prefill through fla-core (skipped where the gate rows are closed: no CUDA,
or no fla-core at the pinned version): fla's varlen call against our reference (kda_ref's chunked delta rule per
request) on the same inputs, and a layer's mixed bf16 step (decodes, fresh prompts, continued chunks, chunks
across fla's 64-token chunk boundaries) through fla against the per-request PyTorch path. KDA (chunk_kda, row
fla_chunk_kda) at Kimi-Linear's head size 128; Gated DeltaNet at Qwen3.5's (D_k = D_v = 128, key heads repeated
to value heads, one decay per head) through chunk_gated_delta_rule (row fla_chunk_gated_delta_rule) and through
chunk_kda with the decay broadcast over D_k (its fallback where only fla_chunk_kda is open). The tiny models'
teacher-forced runs: tests/gpu/test_gpu_kimi_linear.py, tests/gpu/test_gpu_gdn_hybrids.py."""
import pytest
import torch

from kestrel.attention.kda import GDN_PREFILL_KERNEL, PREFILL_KERNEL, KDAImpl
from kestrel.kernels import kda_ref
from kestrel.platform.testing import requires_kernel
from tests.kernels.test_kda_varlen import layer_case

pytestmark = [pytest.mark.gpu]

D = 128  # Kimi-Linear-48B: 32 x 128; Qwen3.5 / 3.6: 32 value heads reading 16 key heads, 128 x 128
KDA = kda_ref.DeltaOptions(4, D)
GDN = kda_ref.DeltaOptions(4, D, 2, D, per_head_decay=True, gate_act="silu")
LENS = [1, 63, 64, 65, 200, 1000, 7]
# (layer form, the gate row its prefill takes): KDA's chunk_kda; GDN's chunk_gated_delta_rule, and GDN through
# chunk_kda (its own row taken as closed)
ROWS = [pytest.param(KDA, PREFILL_KERNEL, id="kda", marks=requires_kernel(PREFILL_KERNEL)),
        pytest.param(GDN, GDN_PREFILL_KERNEL, id="gdn", marks=requires_kernel(GDN_PREFILL_KERNEL)),
        pytest.param(GDN, PREFILL_KERNEL, id="gdn-via-kda", marks=requires_kernel(PREFILL_KERNEL))]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def varlen_kernel(row: str):
    from kestrel.kernels import fla_kda

    return fla_kda.chunk_gdn_varlen if row == GDN_PREFILL_KERNEL else fla_kda.chunk_kda_varlen


@pytest.mark.parametrize("options,row", ROWS)
def test_fla_varlen_equals_reference(options, row):
    """fla's varlen call and kda_ref.delta_rule_varlen (the contract) on the dtypes a bf16 layer passes (the
    convolution's output stays float32): float32 q, k (before their L2 norm; GDN: repeated to the value heads) and
    v, the log decay (GDN: one per head, broadcast), post-sigmoid beta, float32 initial states; per request,
    outputs and final states within 1e-2 relative error, across fla's 64-token chunk boundaries (63, 64, 65
    tokens) and from zero and nonzero states."""
    gen = torch.Generator().manual_seed(0)
    t, h = sum(LENS), options.num_heads
    q, k, v = (torch.randn(t, h, D, generator=gen).cuda() for _ in range(3))
    f = torch.randn(t, h if options.per_head_decay else h * D, generator=gen).cuda()
    g = options.decay(f, torch.rand(h, generator=gen).cuda(), torch.randn(f.shape[1], generator=gen).cuda() - 2)
    beta = torch.rand(t, h, generator=gen).cuda()
    initial = torch.randn(len(LENS), h, D, D, generator=gen).cuda() * 0.1
    initial[0] = 0  # a fresh request
    cu_cpu = torch.tensor([0] + torch.tensor(LENS).cumsum(0).tolist())
    cu = cu_cpu.cuda()
    got, got_final = varlen_kernel(row)(q, k, v, g, beta, initial, cu, cu_cpu, D ** -0.5)
    want, want_final = kda_ref.delta_rule_varlen(q, k, v, g, beta, initial, cu, cu_cpu, D ** -0.5)
    assert got.shape == want.shape and got_final.dtype == torch.float32
    for b, (s, e) in enumerate(zip(cu_cpu[:-1].tolist(), cu_cpu[1:].tolist())):
        assert rel_err(got[s:e], want[s:e]) < 1e-2, (b, LENS[b])
        assert rel_err(got_final[b], want_final[b]) < 1e-2, (b, LENS[b])


@pytest.mark.parametrize("options,row", ROWS)
def test_layer_step_through_fla_equals_per_request(options, row, monkeypatch):
    """A mixed bf16 step of a layer: one fla call for the prefills and chunks (states gathered from and written
    back to the slots), against the per-request PyTorch path on the same caches."""
    if row == PREFILL_KERNEL and options.per_head_decay:  # GDN's own row taken as closed
        monkeypatch.setattr(KDAImpl, "gdn_prefill_kernel", classmethod(lambda cls, platform, dtype: None))
    batch = [(1, 40), (1, 2), (300, 300), (65, 130), (64, 64), (5, 70), (2, 2)]
    slots = [3, 5, 1, 2, 4, 6, 7]
    w, inputs, cache, meta = layer_case(torch.bfloat16, batch=batch, slots=slots, device="cuda", options=options)
    h, hk = options.num_heads, options.key_heads
    fla, per_request = KDAImpl(h, D, D ** -0.5, hk), KDAImpl(h, D, D ** -0.5, hk)
    fla.resolve_prefill(torch.bfloat16, options.per_head_decay)
    assert fla.varlen_delta_rule is varlen_kernel(row)  # the gate row is open here: the runtime picks fla
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
