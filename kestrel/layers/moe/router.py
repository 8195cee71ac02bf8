"""Routers: scores over the experts -> each token's top-k experts and their weights (fp32).

* softmax top-k (Qwen2/3-MoE, Mixtral, DeepSeek-V2): softmax over all experts, top-k, optionally renormalized to
  sum to one (Mixtral always; Qwen by `norm_topk_prob`). Mixtral's "softmax after top-k" is the same numbers: the
  renormalized top-k of a softmax is the softmax of the top-k logits.
* sigmoid with a score-correction bias (DeepSeek-V3, GLM-4-MoE): the bias only steers which experts are chosen
  (grouped top-k: groups ranked by the sum of their two best biased scores, the best `topk_group` groups kept);
  the weights are the unbiased sigmoid scores, renormalized by `norm_topk_prob`, times `routed_scaling_factor`.
* DeepSeek-V2's `group_limited_greedy`: groups ranked by their best softmax score; Mistral Small 4: groups
  ranked by the sum of their two best softmax scores.
* softmax with a correction bias (ERNIE 4.5): the bias steers the choice as for sigmoid routers, the weights are
  the unbiased softmax scores.
* a logit bias (gpt-oss: the router is a linear layer with a bias, `gate.bias`): added to the logits before any
  scoring; with softmax and renormalize it is gpt-oss's softmax over the top-k logits.
* Gemma 4: the router sees RMSNorm(x) (unweighted) * `scale` * hidden^-1/2 (`input_norm`), and each chosen
  expert's weight is multiplied by its `per_expert_scale` after the renormalization.
Torch ops only: the ids are valid expert indices whatever the input (see fused_moe.py on pre-compilation).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.layers.fused import fused_ops_for
from kestrel.layers.norm import L2Norm


@dataclass(frozen=True)
class RouterConfig:
    num_experts: int
    top_k: int
    scoring: str = "softmax"  # "softmax" | "sigmoid"
    renormalize: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    group_score: str = "top2_sum"  # "top2_sum" (DeepSeek-V3 / GLM) | "max" (DeepSeek-V2)
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False  # e_score_correction_bias: steers the choice only
    logit_bias: bool = False  # a bias of the router's linear layer: part of the logits
    input_norm: bool = False  # Gemma 4: logits of RMSNorm(x) * scale * hidden^-1/2
    per_expert_scale: bool = False  # Gemma 4: a learned factor per expert on its routing weight
    eps: float = 1e-6  # input_norm's

    def __post_init__(self):
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"unknown router scoring {self.scoring!r}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be in 1..{self.num_experts}")
        if self.num_experts % self.num_groups or not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(f"{self.num_experts} experts in {self.num_groups} groups (keep {self.topk_groups}) "
                             "do not divide evenly")


def _group_mask(choice: torch.Tensor, cfg: RouterConfig, fill: float) -> torch.Tensor:
    t = choice.shape[0]
    grouped = choice.view(t, cfg.num_groups, -1)
    score = grouped.topk(2, dim=-1)[0].sum(-1) if cfg.group_score == "top2_sum" else grouped.max(-1).values
    keep = torch.zeros_like(score).scatter_(1, score.topk(cfg.topk_groups, dim=-1, sorted=False)[1], 1.0)
    return choice.masked_fill(~keep.bool().unsqueeze(-1).expand_as(grouped).reshape(t, -1), fill)


def select_experts(logits: torch.Tensor, cfg: RouterConfig, bias: torch.Tensor | None = None):
    """logits [T, E] -> (weights fp32 [T, k], ids int64 [T, k])."""
    logits = logits.float()
    if cfg.scoring == "softmax":
        scores = logits.softmax(dim=-1)
        if cfg.num_groups > 1:
            scores = _group_mask(scores, cfg, 0.0)
        if bias is not None:
            ids = (scores + bias).topk(cfg.top_k, dim=-1)[1]
            weights = scores.gather(1, ids)
        else:
            weights, ids = scores.topk(cfg.top_k, dim=-1)
        if cfg.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        scores = logits.sigmoid()
        choice = scores + bias if bias is not None else scores
        if cfg.num_groups > 1:
            choice = _group_mask(choice, cfg, float("-inf"))
        ids = choice.topk(cfg.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if cfg.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if cfg.routed_scaling_factor != 1.0:
        weights = weights * cfg.routed_scaling_factor
    return weights, ids


class Router(nn.Module):
    """The `gate` of an MoE block: `weight` [E, H] (fp32 for sigmoid routers, as their references compute) and,
    for DeepSeek-V3-style routers, `e_score_correction_bias` [E]; with a logit bias, `bias` [E]; Gemma 4's `scale`
    [H] and `per_expert_scale` [E]."""

    def __init__(self, hidden_size: int, cfg: RouterConfig, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        wdtype = torch.float32 if cfg.scoring == "sigmoid" else dtype
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden_size, dtype=wdtype), requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(cfg.num_experts, dtype=wdtype), requires_grad=False)
                     if cfg.logit_bias else None)
        if cfg.correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts), requires_grad=False)
        else:
            self.e_score_correction_bias = None
        self.input_norm = L2Norm(eps=cfg.eps) if cfg.input_norm else None
        if cfg.input_norm:
            self.scale = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        if cfg.per_expert_scale:
            self.per_expert_scale = nn.Parameter(torch.ones(cfg.num_experts, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, shared_slots: int = 0,
                shared_gate: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights fp32 [T, k + shared_slots], ids [T, k + shared_slots]). The last `shared_slots`
        columns select the fused shared experts (ids E, E + 1, ...), weighted 1 or sigmoid(shared_gate [T, 1])."""
        if self.input_norm is not None:
            x = self.input_norm(x) * self.scale * x.shape[-1] ** -0.5
        logits = F.linear(x.to(self.weight.dtype), self.weight, self.bias)
        weights, ids = self._route(x, logits, shared_slots, shared_gate)
        if self.cfg.per_expert_scale:  # the routed columns (any fused shared slots follow them)
            k = self.cfg.top_k
            weights = torch.cat([weights[:, :k] * self.per_expert_scale.float()[ids[:, :k]], weights[:, k:]], 1)
        return weights, ids

    def _route(self, x, logits, shared_slots, shared_gate):
        cfg = self.cfg
        ops = fused_ops_for(logits)
        if ops is not None and cfg.scoring == "softmax" and cfg.num_groups == 1 and not cfg.correction_bias:
            return ops.moe_topk_softmax(logits, cfg.top_k, cfg.renormalize, cfg.routed_scaling_factor,
                                        shared_slots, shared_gate)
        weights, ids = select_experts(logits, cfg, self.e_score_correction_bias)
        if shared_slots:
            t = x.shape[0]
            extra_w = (torch.sigmoid(shared_gate).float().expand(t, shared_slots) if shared_gate is not None
                       else weights.new_ones(t, shared_slots))
            extra_ids = torch.arange(cfg.num_experts, cfg.num_experts + shared_slots, device=ids.device)
            weights = torch.cat([weights, extra_w], dim=1)
            ids = torch.cat([ids, extra_ids.expand(t, shared_slots)], dim=1)
        return weights, ids
