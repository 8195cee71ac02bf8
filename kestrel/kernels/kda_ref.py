"""Kimi Delta Attention in plain PyTorch: the reference every KDA kernel is compared with, and the CPU path.

Per head, with state S [D_k, D_v] (float32), a token's normalised q, k (q scaled by D^-1/2), v, its per-channel
decay g [D_k] (log space, <= 0) and its scalar beta:
    S <- Diag(exp(g)) S;  S <- S + beta k (v - S^T k)^T;  o = S^T q.
Before it, q, k and v go through a depthwise causal convolution of width K over the current and the K - 1
previous inputs (the conv state), then SiLU; after it, a per-head RMSNorm gated by sigmoid(gate).

Gated DeltaNet (Qwen3-Next, Qwen3.5) is the same recurrence with one decay value per head, broadcast over the
channels here; its q and k have fewer heads (num_key_heads, repeated to the state's heads after the convolution),
its values their own head size, and its output gate is SiLU. `DeltaOptions` names those differences once; every path
(this reference, the batched prefill, the fused decode) reads them from it."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kestrel.core.device import to_device


@dataclass(frozen=True)
class DeltaOptions:
    """A delta-rule layer's mechanism options. KDA: the defaults (q/k heads = state heads, D_v = D_k, a decay per
    channel, a sigmoid output gate). Gated DeltaNet: `num_key_heads` q/k heads, each read by num_heads /
    num_key_heads consecutive state heads (transformers' repeat_interleave), `value_head_dim`, one decay per head
    (its projection and dt_bias have one value per head), a SiLU output gate. The convolution runs over
    q | k | v before the repeat: 2 * num_key_heads * D_k + num_heads * D_v channels."""
    num_heads: int  # the state's heads (= value heads)
    head_dim: int  # D_k
    num_key_heads: int = 0  # 0: num_heads
    value_head_dim: int = 0  # 0: head_dim
    per_head_decay: bool = False
    gate_act: str = "sigmoid"  # the output gate: sigmoid (KDA) | silu (Gated DeltaNet)

    def __post_init__(self):
        if self.num_heads % self.key_heads:
            raise ValueError(f"{self.num_heads} state heads are not a multiple of {self.key_heads} key heads")
        if self.gate_act not in ("sigmoid", "silu"):
            raise ValueError(f"unknown output gate activation {self.gate_act!r}")

    @property
    def key_heads(self) -> int:
        return self.num_key_heads or self.num_heads

    @property
    def v_dim(self) -> int:
        return self.value_head_dim or self.head_dim

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_heads * self.head_dim + self.num_heads * self.v_dim

    def qkv(self, y: torch.Tensor):
        """Convolved q|k|v [T, C] -> float32 q (normalised, scaled by D_k^-1/2), k (normalised), each [T, H, D_k]
        after the repeat to the state's heads, and v [T, H, D_v]."""
        hk, dk = self.key_heads, self.head_dim
        q, k, v = y.float().split([hk * dk, hk * dk, self.num_heads * self.v_dim], dim=-1)
        q, k = l2norm(q.reshape(-1, hk, dk)) * dk ** -0.5, l2norm(k.reshape(-1, hk, dk))
        if hk != self.num_heads:
            q, k = (x.repeat_interleave(self.num_heads // hk, dim=1) for x in (q, k))
        return q, k, v.reshape(-1, self.num_heads, self.v_dim)

    def decay(self, f: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
        """The forget gate's projection f ([T, H] per head, [T, H * D_k] per channel) -> g [T, H, D_k] float32
        (per head: a broadcast view)."""
        if self.per_head_decay:
            return forget_gate(f, a_log, dt_bias, 1).expand(-1, -1, self.head_dim)
        return forget_gate(f, a_log, dt_bias, self.head_dim)

    def output(self, o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return gated_rms_norm(o, gate, weight, eps, self.gate_act)


def forget_gate(f: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, head_dim: int) -> torch.Tensor:
    """f [T, H * D] (f_b(f_a(x))) -> g [T, H, D] float32: -exp(A_log[h]) * softplus(f + dt_bias)."""
    x = (f.float() + dt_bias.float()).view(f.shape[0], -1, head_dim)
    softplus = torch.where(x > 20.0, x, torch.log1p(torch.exp(x)))
    return -torch.exp(a_log.float().view(1, -1, 1)) * softplus


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (fla's form: eps under the root)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def causal_conv(x: torch.Tensor, conv_state: torch.Tensor | None, weight: torch.Tensor):
    """Depthwise causal conv + SiLU over one request's tokens. x [T, C], conv_state [C, K - 1] (the previous
    inputs, oldest first; None: zeros), weight [C, K] -> (y [T, C] float32, new conv state [C, K - 1] in x's dtype).
    y stays float32 on its way to the L2 norms and the delta rule, as in fla and transformers' float32 model:
    rounding it to bf16 there roughly doubled the bf16 model's teacher-forced logprob error."""
    k = weight.shape[1]
    prev = conv_state if conv_state is not None else x.new_zeros(x.shape[1], k - 1)
    window = torch.cat([prev.to(x.dtype), x.t()], dim=1)  # [C, K - 1 + T]
    y = F.conv1d(window.float().unsqueeze(0), weight.float().unsqueeze(1), groups=weight.shape[0])[0]
    return F.silu(y).t(), window[:, -(k - 1):]


@dataclass
class VarlenConvLayout:
    """Where causal_conv_varlen puts a step's requests: each request's K - 1 previous inputs, then its tokens, one
    request after another along the columns of one input (on the step's device)."""
    tokens: torch.Tensor  # [T] each token's column
    previous: torch.Tensor  # [N * (K - 1)] the previous inputs' columns, request by request, oldest first
    last: torch.Tensor  # [N * (K - 1)] each request's last K - 1 columns (its new conv state)
    width: int  # the columns: T + N * (K - 1)

    @classmethod
    def build(cls, cu_seqlens: list[int], conv_width: int, device) -> "VarlenConvLayout":
        n, k1 = len(cu_seqlens) - 1, conv_width - 1
        cu = torch.tensor(cu_seqlens)
        lens = cu[1:] - cu[:-1]
        tokens = torch.arange(cu_seqlens[-1]) + (torch.repeat_interleave(torch.arange(n), lens) + 1) * k1
        first = cu[:-1] + torch.arange(n) * k1  # request b's oldest previous input
        previous = (first[:, None] + torch.arange(k1)).flatten()
        last = ((first + lens)[:, None] + torch.arange(k1)).flatten()
        return cls(*(to_device(t, torch.long, device) for t in (tokens, previous, last)), cu_seqlens[-1] + n * k1)


def causal_conv_varlen(x: torch.Tensor, layout: VarlenConvLayout, conv_states: torch.Tensor, weight: torch.Tensor):
    """causal_conv over the requests of a step at once (request b: the tokens the layout gives it), request b
    continuing conv_states[b] [C, K - 1] (zeros for a fresh request). One depthwise conv1d runs over the layout's
    input; the outputs whose window reaches into the previous request are never picked. -> (y [T, C] float32,
    new conv states [N, C, K - 1] in x's dtype), each request's equal to causal_conv's."""
    (n, c, k1), k = conv_states.shape, weight.shape[1]
    laid = x.new_empty(c, layout.width)
    laid[:, layout.previous] = conv_states.to(x.dtype).permute(1, 0, 2).reshape(c, n * k1)
    laid[:, layout.tokens] = x.t()
    # column j: the window ending at column j + K - 1
    y = F.conv1d(laid.float().unsqueeze(0), weight.float().unsqueeze(1), groups=c)[0]
    return F.silu(y[:, layout.tokens - (k - 1)]).t(), laid[:, layout.last].view(c, n, k1).permute(1, 0, 2)


def prepare_qkv(qkv: torch.Tensor, num_heads: int, head_dim: int):
    """Convolved q|k|v [T, 3 H D] (float32) -> float32 q (normalised, scaled), k (normalised), v, each [T, H, D]."""
    q, k, v = qkv.float().view(qkv.shape[0], 3, num_heads, head_dim).unbind(1)
    return l2norm(q) * head_dim ** -0.5, l2norm(k), v


def delta_rule(q, k, v, g, beta, state: torch.Tensor):
    """The recurrence over the T tokens of one request, token by token (the reference). q, k, v, g [T, H, D]
    float32, beta [T, H] float32, state [H, D, D] float32 (updated in place) -> o [T, H, D] float32."""
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        state.mul_(g[t].exp().unsqueeze(-1))
        delta = (v[t] - torch.einsum("hkv,hk->hv", state, k[t])) * beta[t].unsqueeze(-1)
        state.add_(k[t].unsqueeze(-1) * delta.unsqueeze(-2))
        out[t] = torch.einsum("hkv,hk->hv", state, q[t])
    return out


def delta_rule_chunked(q, k, v, g, beta, state: torch.Tensor, chunk: int = 32):
    """delta_rule's result `chunk` tokens at a time, with matrix products instead of a token loop (the prefill
    path). Within a chunk, with G the cumulative decay from its start (G_t = g_1 + ... + g_t) and S_0 the state
    before it, the deltas d_t = beta_t (v_t - (Diag(exp(g_t)) S_{t-1})^T k_t) solve the unit lower-triangular
    system (I + Diag(beta) A) D = Diag(beta) (V - (K * exp(G)) S_0), A[t, i] = sum_c k_t k_i exp(G_t - G_i) over
    i < t; then O = (Q * exp(G)) S_0 + B D with B as A over i <= t and queries, and the state after the chunk
    is exp(G_C) * S_0 + (K * exp(G_C - G))^T D. Every exponent is <= 0 (the decay only shrinks)."""
    out = torch.empty_like(v)
    for s in range(0, q.shape[0], chunk):
        e = min(s + chunk, q.shape[0])
        qc, kc, vc = (x[s:e].transpose(0, 1) for x in (q, k, v))  # [H, C, D]
        G = g[s:e].transpose(0, 1).cumsum(1)  # [H, C, D]
        b = beta[s:e].t().unsqueeze(-1)  # [H, C, 1]
        c = e - s
        causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
        diff = (G.unsqueeze(2) - G.unsqueeze(1)).masked_fill(~causal[None, :, :, None], float("-inf"))
        decay = diff.exp()  # [H, C(t), C(i), D]: exp(G_t - G_i) for i <= t, else 0
        a = torch.einsum("htc,hic,htic->hti", kc, kc, decay).tril(-1)
        bq = torch.einsum("htc,hic,htic->hti", qc, kc, decay)
        rhs = b * (vc - (kc * G.exp()) @ state)
        lower = torch.eye(c, device=q.device) + b * a
        delta = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)
        out[s:e] = ((qc * G.exp()) @ state + bq @ delta).transpose(0, 1)
        last = G[:, -1:, :]  # [H, 1, D]
        state.mul_(last.transpose(1, 2).exp()).add_((kc * (last - G).exp()).transpose(1, 2) @ delta)
    return out


def delta_rule_varlen(q, k, v, g, beta, initial_state: torch.Tensor, cu_seqlens: torch.Tensor,
                      cu_seqlens_cpu: torch.Tensor, scale: float):
    """The batched prefill's contract (what kestrel/kernels/fla_kda.py's chunk_kda_varlen computes), here one
    request at a time through delta_rule_chunked: request b owns tokens cu_seqlens[b]:cu_seqlens[b + 1] of q, k, v,
    g [T, H, D] float32 (q and k before their L2 norm; q scaled by `scale` after it) and beta [T, H], and starts
    from initial_state[b] [H, D, D] float32. -> (o [T, H, D] float32, final states [N, H, D, D] float32)."""
    q, k = l2norm(q.float()) * scale, l2norm(k.float())
    out, final = torch.empty_like(v, dtype=torch.float32), initial_state.float().clone()
    bounds = cu_seqlens_cpu.tolist()
    for b, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        out[s:e] = delta_rule_chunked(q[s:e], k[s:e], v[s:e].float(), g[s:e], beta[s:e], final[b])
    return out, final


def delta_rule_step(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """One token of each of B requests: q, k, v, g [B, H, D], beta [B, H], state [B, H, D, D] (updated in place)
    -> o [B, H, D]."""
    state.mul_(g.exp().unsqueeze(-1))
    delta = (v - torch.einsum("bhkv,bhk->bhv", state, k)) * beta.unsqueeze(-1)
    state.add_(k.unsqueeze(-1) * delta.unsqueeze(-2))
    return torch.einsum("bhkv,bhk->bhv", state, q)


def gated_rms_norm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   act: str = "sigmoid") -> torch.Tensor:
    """o [T, H, D], gate [T, H * D] -> [T, H * D] in gate's dtype: RMSNorm over D (float32), times the weight,
    times sigmoid(gate) (KDA) or silu(gate) (Gated DeltaNet)."""
    x = o.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    g = gate.float().reshape(x.shape)
    x = x * (F.silu(g) if act == "silu" else torch.sigmoid(g))
    return x.reshape(o.shape[0], -1).to(gate.dtype)
