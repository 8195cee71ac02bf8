"""The chunked delta rule (the prefill path) against the token-by-token recurrence: the same outputs and final
state to float32 rounding, for chunks that do and do not divide the length, weak to very strong decay, and from
a nonzero initial state. And the layer's bf16 paths (prefill, unfused decode) against the same layer in float32
on the same values: everything between the bf16 projections and the bf16 output is float32, so the only
difference is the output's one rounding."""
from types import SimpleNamespace

import pytest
import torch

from kestrel.attention.kda import KDAImpl
from kestrel.kernels import kda_ref


@pytest.mark.parametrize("length,chunk", [(77, 16), (64, 32), (5, 32)])
def test_chunked_equals_recurrent(length, chunk):
    gen = torch.Generator().manual_seed(length)
    h, d = 3, 16
    q = kda_ref.l2norm(torch.randn(length, h, d, generator=gen)) * d ** -0.5
    k = kda_ref.l2norm(torch.randn(length, h, d, generator=gen))
    v = torch.randn(length, h, d, generator=gen)
    # per head: almost no decay, moderate, and a decay that empties the state within a token
    g = -torch.rand(length, h, d, generator=gen) * torch.tensor([0.01, 1.0, 30.0]).view(1, h, 1)
    beta = torch.rand(length, h, generator=gen)
    initial = torch.randn(h, d, d, generator=gen)
    want_state, got_state = initial.clone(), initial.clone()
    want = kda_ref.delta_rule(q, k, v, g, beta, want_state)
    got = kda_ref.delta_rule_chunked(q, k, v, g, beta, got_state, chunk=chunk)
    assert (got - want).abs().max() < 1e-5 * want.abs().max()
    assert (got_state - want_state).abs().max() < 1e-5 * want_state.abs().max()


def bf16_layer_case(tokens: int, h: int = 2, d: int = 32, k: int = 4):
    """Weights, projections (q|k|v before the conv, f, beta logits, gate) and slot caches, every value
    bf16-representable; returns (bf16 case, the same values in float32)."""
    gen = torch.Generator().manual_seed(tokens)
    hd = h * d
    w = dict(conv_weight=torch.randn(3 * hd, k, generator=gen) * 0.5,
             o_norm_weight=1 + 0.2 * torch.randn(d, generator=gen))
    inputs = [torch.randn(tokens, n, generator=gen) for n in (3 * hd, hd, h, hd)]
    cache = [torch.randn(3, h, d, d, generator=gen) * 0.1, torch.randn(3, 3 * hd, k - 1, generator=gen)]
    fixed = dict(A_log=torch.rand(h, generator=gen), dt_bias=torch.randn(hd, generator=gen) - 2, norm_eps=1e-5,
                 delta=kda_ref.DeltaOptions(h, d))

    def as_dtype(dtype):
        def cast(t):  # through bf16 first: both cases hold the same values
            return t.to(torch.bfloat16).to(dtype)

        return (SimpleNamespace(**{n: cast(t) for n, t in w.items()}, **fixed), [cast(x) for x in inputs],
                (cache[0].clone(), cast(cache[1])))

    return as_dtype(torch.bfloat16), as_dtype(torch.float32)


@pytest.mark.parametrize("has_initial_state", [False, True])
def test_bf16_prefill_is_float32_rounded_once(has_initial_state):
    """The conv output, norms, gates, chunked delta rule and state stay float32 in a bf16 model (as in fla and
    transformers' float32 model): the bf16 output is the float32 output rounded, and the states match."""
    (w16, x16, c16), (w32, x32, c32) = bf16_layer_case(45)
    got = KDAImpl.forward_prefill(None, w16, *x16, c16, 1, has_initial_state)
    want = KDAImpl.forward_prefill(None, w32, *x32, c32, 1, has_initial_state)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want.to(torch.bfloat16))
    assert torch.equal(c16[0], c32[0])  # float32 recurrent state: the same
    assert torch.equal(c16[1].float(), c32[1])  # conv state: the same (bf16-representable) inputs


def test_bf16_unfused_decode_is_float32_rounded_once():
    (w16, x16, c16), (w32, x32, c32) = bf16_layer_case(2)
    slots, seq_lens = torch.tensor([2, 1], dtype=torch.int32), torch.tensor([9, 1], dtype=torch.int32)
    got = KDAImpl.forward_decode(None, w16, *x16, c16, slots, seq_lens)
    want = KDAImpl.forward_decode(None, w32, *x32, c32, slots, seq_lens)
    assert torch.equal(got, want.to(torch.bfloat16))
    assert torch.equal(c16[0], c32[0])
