"""The chunked delta rule (the prefill path) against the token-by-token recurrence: the same outputs and final
state to float32 rounding, for chunks that do and do not divide the length, weak to very strong decay, and from
a nonzero initial state."""
import pytest
import torch

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
