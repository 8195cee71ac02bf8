"""The reference MoE kernel against a per-token loop."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kestrel.kernels import select
from kestrel.kernels.moe import MoESpec, TorchMoE
from kestrel.platform import fake_platform


def naive_moe(x, w13, w2, topk_w, topk_ids, act):
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            a = F.silu(gate) * up if act == "silu" else F.gelu(gate, approximate="tanh") * up
            out[t] += topk_w[t, j].double() * (w2[e].double() @ a)
    return out


@pytest.mark.parametrize("act", ["silu", "gelu"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_torch_moe_matches_naive(act, dtype, tol):
    e, k, h, i, t = 6, 2, 16, 24, 9
    spec = MoESpec("model.layers.0.mlp.experts", e, k, h, i, dtype, act)
    kernel = select("moe", spec, "torch_moe", fake_platform("cpu"))
    assert type(kernel) is TorchMoE
    layer = nn.Module()
    kernel.create_weights(layer)
    gen = torch.Generator().manual_seed(0)
    layer.w13.data.copy_(torch.randn(e, 2 * i, h, generator=gen) * 0.2)
    layer.w2.data.copy_(torch.randn(e, h, i, generator=gen) * 0.2)
    kernel.process_weights_after_loading(layer)
    x = torch.randn(t, h, generator=gen).to(dtype)
    logits = torch.randn(t, e, generator=gen)
    topk_w, topk_ids = torch.topk(logits.softmax(-1), k, dim=-1)
    y = kernel.apply(layer, x, topk_w, topk_ids)
    ref = naive_moe(x.float(), layer.w13.float(), layer.w2.float(), topk_w, topk_ids, act)
    assert y.shape == (t, h) and y.dtype == dtype
    assert float((y.double() - ref).norm() / ref.norm()) < tol


def test_torch_moe_empty_batch():
    spec = MoESpec("experts", 4, 2, 8, 8, torch.float32)
    kernel = select("moe", spec)
    layer = nn.Module()
    kernel.create_weights(layer)
    y = kernel.apply(layer, torch.empty(0, 8), torch.empty(0, 2), torch.empty(0, 2, dtype=torch.long))
    assert y.shape == (0, 8)
