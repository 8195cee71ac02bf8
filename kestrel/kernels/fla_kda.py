"""The batched KDA prefill through fla-core's `chunk_kda` (a GPU-only optional dependency, pinned in
kestrel/platform/capabilities.py FLA_CORE_VERSION; gate row `fla_chunk_kda`). Same contract as
kda_ref.delta_rule_varlen, the reference it is tested against.

fla-core 0.6.0's conventions, read in its source (fla/ops/kda/chunk.py) and checked against kda_ref under the
Triton interpreter: g is the log-space per-channel decay as kda_ref.forget_gate computes it
(use_gate_in_kernel=False), beta is post-sigmoid, the state is [N, H, D_k, D_v] float32 (our slot layout),
`use_qk_l2norm_in_kernel` applies the same eps-under-the-root L2 norm as kda_ref.l2norm, and `scale` multiplies q
after it. Varlen batches are one row (B = 1) with cu_seqlens; the output has q's dtype.

Gated DeltaNet layers (one decay per head) take `chunk_gdn_varlen` where its own gate row
`fla_chunk_gated_delta_rule` is open: fla's chunk_gated_delta_rule, g [B, T, H] (the broadcast column of ours),
otherwise the same conventions; else chunk_kda with the broadcast decay (the same recurrence)."""
from __future__ import annotations

import torch


def chunk_kda_varlen(q, k, v, g, beta, initial_state: torch.Tensor, cu_seqlens: torch.Tensor,
                     cu_seqlens_cpu: torch.Tensor, scale: float):
    from fla.ops.kda import chunk_kda  # imported at the first prefill, never on the CPU path

    o, final = chunk_kda(q.unsqueeze(0).contiguous(), k.unsqueeze(0).contiguous(), v.unsqueeze(0).contiguous(),
                         g.unsqueeze(0).contiguous(), beta.unsqueeze(0).contiguous(), scale=scale,
                         initial_state=initial_state.float().contiguous(), output_final_state=True,
                         use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
    return o[0], final


def chunk_gdn_varlen(q, k, v, g, beta, initial_state: torch.Tensor, cu_seqlens: torch.Tensor,
                     cu_seqlens_cpu: torch.Tensor, scale: float):
    """chunk_kda_varlen's contract for a per-head decay: g [T, H, D_k] is one value per head broadcast over D_k
    (kda_ref.DeltaOptions.decay); fla reads its first column. v may have its own head size (D_v)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # imported at the first prefill, never on the CPU

    o, final = chunk_gated_delta_rule(q.unsqueeze(0).contiguous(), k.unsqueeze(0).contiguous(),
                                      v.unsqueeze(0).contiguous(), g[..., 0].unsqueeze(0).contiguous(),
                                      beta.unsqueeze(0).contiguous(), scale=scale,
                                      initial_state=initial_state.float().contiguous(), output_final_state=True,
                                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)
    return o[0], final
