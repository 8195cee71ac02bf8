"""Why vLLM's dummy-weight DeepSeek-V2 runs route every token to the same experts (CPU, a second or two).

vLLM's `load_format="dummy"` fills every floating parameter, norm weights included, with uniform(-1e-3, 1e-3).
The residual stream is then about the token's embedding, the router input is that normalised times a ~1e-3 norm
weight, and the router logits come out ~1e-5. DeepSeek-V2's grouped top-k in vLLM 0.26 takes `torch.softmax` of
the logits in the model dtype (`moe_router_dtype` unset): every score is 1/64 +- ~2e-7, bf16's step at 1/64 is
1.2e-4, so all 64 scores round to exactly 1/64 and top-k returns the same 6 experts for every token. A decode
step then reads 8 of the 66 experts (6 routed + 2 shared) instead of all of them. Transformers computes this
router in float32, where the same logits keep per-token routing. This script replays that arithmetic on vLLM's
init for a batch of 256 tokens and prints distinct expert sets and experts hit for both dtypes.

    python -m benchmarks.router_collapse"""
from __future__ import annotations

import torch


def route(dtype: torch.dtype, tokens: int = 256, hidden: int = 2048, experts: int = 64, top_k: int = 6):
    g = torch.Generator().manual_seed(0)
    u = lambda *shape: torch.rand(*shape, generator=g) * 2e-3 - 1e-3  # noqa: E731  (vLLM's dummy init)
    emb, norm_w, gate = u(tokens, hidden), u(hidden), u(experts, hidden)
    x = (emb * torch.rsqrt(emb.pow(2).mean(-1, keepdim=True)) * norm_w).bfloat16()
    logits = (x @ gate.bfloat16().T).to(dtype)  # the gate GEMM in bf16; float32 = moe_router_dtype="float32"
    scores = torch.softmax(logits, dim=-1)
    ids = torch.topk(scores, top_k, dim=-1).indices
    return dict(router=str(dtype).removeprefix("torch."), logit_std=f"{logits.float().std().item():.1e}",
                distinct_scores=scores.unique().numel(),
                distinct_expert_sets=len({tuple(sorted(r.tolist())) for r in ids}),
                experts_hit=ids.unique().numel())


def main():
    rows = [route(torch.bfloat16), route(torch.float32)]
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(str(r[k]) for k in keys) + " |")


if __name__ == "__main__":
    main()
