"""Random MoE problems and their references, shared by the Triton MoE tests (interpreter and GPU)."""
from __future__ import annotations

import torch

from kestrel.kernels.fp8_quant import dequantize_block, dequantize_per_token_group, quantize_per_token_group, \
    quantize_weight_block


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref.double()).norm() / ref.double().norm())


def random_routing(t: int, e: int, k: int, gen: torch.Generator, skew: bool = False):
    """Distinct experts per token; `skew` sends most tokens to a few experts (uneven runs, empty experts)."""
    logits = torch.randn(t, e, generator=gen)
    if skew:
        logits[:, : max(1, e // 8)] += 3.0
    w, ids = logits.softmax(-1).topk(k, dim=-1)
    return w, ids.to(torch.int32)


def make_experts(e: int, h: int, i: int, gen: torch.Generator):
    w13 = torch.randn(e, 2 * i, h, generator=gen) * h ** -0.5
    w2 = torch.randn(e, h, i, generator=gen) * i ** -0.5
    return w13, w2


def reference_moe(x, w13, w2, topk_w, topk_ids, act_quant_group: int | None = None, act_dtype=torch.bfloat16,
                  activation: str = "silu"):
    """float64 loop over experts. act_quant_group: quantize-dequantize the inputs of both GEMMs per token group
    (what the FP8 kernel does to activations), so the FP8 comparison measures the kernel, not FP8 rounding.
    `activation`: the gate's, by its kestrel/kernels/moe.py MOE_ACTIVATIONS name."""
    from kestrel.kernels.moe import MOE_ACTIVATIONS

    x = x.double()
    if act_quant_group:
        x = _qdq(x, act_quant_group)
    out = torch.zeros_like(x)
    flat = topk_ids.long().reshape(-1)
    tok = torch.arange(x.shape[0], device=x.device).repeat_interleave(topk_ids.shape[1])
    wts = topk_w.double().reshape(-1)
    for e in flat.unique().tolist():
        sel = (flat == e).nonzero(as_tuple=True)[0]
        a = MOE_ACTIVATIONS[activation](*(x[tok[sel]] @ w13[e].double().T).chunk(2, dim=-1))
        if act_quant_group:
            a = _qdq(a.to(act_dtype).double(), act_quant_group)
        out.index_add_(0, tok[sel], (a @ w2[e].double().T) * wts[sel, None])
    return out


def _qdq(x: torch.Tensor, group: int) -> torch.Tensor:
    q, s = quantize_per_token_group(x.float(), group)
    return dequantize_per_token_group(q, s, group).double()


def quantize_experts(w13: torch.Tensor, w2: torch.Tensor, block=(128, 128)):
    """Per-expert block quantization -> (w13 fp8, w13 scales, w2 fp8, w2 scales, dequantized w13, w2)."""
    q13, s13, q2, s2 = [], [], [], []
    for e in range(w13.shape[0]):
        q, s = quantize_weight_block(w13[e].float(), block)
        q13.append(q), s13.append(s)
        q, s = quantize_weight_block(w2[e].float(), block)
        q2.append(q), s2.append(s)
    q13, s13, q2, s2 = (torch.stack(v) for v in (q13, s13, q2, s2))
    d13 = torch.stack([dequantize_block(q13[e], s13[e], block) for e in range(w13.shape[0])])
    d2 = torch.stack([dequantize_block(q2[e], s2[e], block) for e in range(w2.shape[0])])
    return q13, s13, q2, s2, d13, d2
