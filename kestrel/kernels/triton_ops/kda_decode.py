"""The fused Kimi Delta Attention decode step in Triton: one launch per KDA layer and step does what the unfused
chain (kestrel/attention/kda.py KDAImpl.forward_decode) does in ~20 small kernels.

One program per (request, head). It reads the request's slot, then for the head's q, k and v channels: the short
convolution over the slot's last K - 1 inputs and this token (+ SiLU), shifting the conv state in place; q and k
L2-normalised (q scaled by D^-1/2); the per-channel forget gate -exp(A_log) softplus(f + dt_bias) and beta =
sigmoid(b); the delta-rule step on the head's D x D float32 state held in registers (written back in place); and
the output RMSNorm over D times the norm weight times sigmoid(gate). Padding rows of a CUDA graph point at the
null slot 0, whose contents are never read as a real state; a request's first token (seq_len 1) reads a zero
state instead of its slot's. Grids depend on shapes only (graph-capturable)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels.triton_ops.pdl import pdl_launch, pdl_prologue
from kestrel.platform.triton_gates import interpreter_mode


def num_warps(head_dim: int) -> int:
    """A program holds the head's D x D float32 state: 128 x 128 is 64 registers a thread over 8 warps."""
    return 8 if head_dim >= 128 else 4


@triton.jit
def _conv_silu(QKV, CONV, W, row, conv_row, c, cols, fresh, K: tl.constexpr):
    """Channels `c` of this token: conv over [conv state (K - 1 columns; zeros if `fresh`) | x] + SiLU; shifts the
    state by one."""
    x = tl.load(QKV + row + c).to(tl.float32)
    in_state = (cols[None, :] < K - 1) & (fresh == 0)
    st = tl.load(CONV + conv_row + c[:, None] * (K - 1) + cols[None, :], mask=in_state, other=0.0)
    win = tl.where(cols[None, :] == K - 1, x[:, None], st.to(tl.float32))
    w = tl.load(W + c[:, None] * K + cols[None, :], mask=cols[None, :] < K, other=0.0).to(tl.float32)
    y = tl.sum(win * w, axis=1)
    tl.debug_barrier()  # every thread has read the old state before any shifted column is written
    shifted = (cols[None, :] >= 1) & (cols[None, :] < K)
    tl.store(CONV + conv_row + c[:, None] * (K - 1) + cols[None, :] - 1, win.to(CONV.dtype.element_ty), mask=shifted)
    return y * tl.sigmoid(y)


@triton.jit
def _kda_decode_kernel(
    QKV, F, BETA, GATE, W_CONV, A_LOG, DT_BIAS, W_NORM, REC, CONV, SLOTS, SEQ_LENS, OUT,
    stride_qkv, stride_f, stride_beta, stride_gate, stride_slot, stride_rec, stride_conv, stride_out,
    eps, HD, H: tl.constexpr, D: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(SLOTS + b * stride_slot).to(tl.int64)
    fresh = (tl.load(SEQ_LENS + b) == 1).to(tl.int32)  # the request's first token: a zero state
    d = tl.arange(0, D)
    cols = tl.arange(0, KP)
    row = b.to(tl.int64) * stride_qkv
    conv_row = slot * stride_conv
    # the token's q, k, v after the short convolution, kept float32 (as the unfused chain and prefill keep them)
    q = _conv_silu(QKV, CONV, W_CONV, row, conv_row, h * D + d, cols, fresh, K)
    k = _conv_silu(QKV, CONV, W_CONV, row, conv_row, HD + h * D + d, cols, fresh, K)
    v = _conv_silu(QKV, CONV, W_CONV, row, conv_row, 2 * HD + h * D + d, cols, fresh, K)
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * (1.0 / tl.sqrt(D * 1.0))
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    # gates: per-channel decay (log space) and the head's beta
    x = tl.load(F + b * stride_f + h * D + d).to(tl.float32) + tl.load(DT_BIAS + h * D + d).to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
    g = -tl.exp(tl.load(A_LOG + h).to(tl.float32)) * softplus
    beta = tl.sigmoid(tl.load(BETA + b * stride_beta + h).to(tl.float32))
    # the delta rule on the head's state S [D_k, D_v]
    s_ptr = REC + slot * stride_rec + h * D * D + d[:, None] * D + d[None, :]
    s = tl.load(s_ptr, mask=(d[:, None] < D) & (fresh == 0), other=0.0) * tl.exp(g)[:, None]
    delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
    s = s + k[:, None] * delta[None, :]
    o = tl.sum(s * q[:, None], axis=0)
    tl.store(s_ptr, s)
    # gated RMSNorm over the head
    o = o * (1.0 / tl.sqrt(tl.sum(o * o, axis=0) / D + eps)) * tl.load(W_NORM + d).to(tl.float32)
    o = o * tl.sigmoid(tl.load(GATE + b * stride_gate + h * D + d).to(tl.float32))
    tl.store(OUT + b * stride_out + h * D + d, o.to(OUT.dtype.element_ty))


def kda_fused_decode(qkv, f, beta_logits, gate, conv_weight, a_log, dt_bias, norm_weight, norm_eps: float,
                     recurrent, conv, slots, seq_lens) -> torch.Tensor:
    """One token per request: qkv [B, 3HD] (before the convolution), f [B, HD], beta_logits [B, H], gate [B, HD],
    conv_weight [3HD, K], a_log [H], dt_bias [HD], norm_weight [D]; the state slots recurrent [S, H, D, D]
    float32 and conv [S, 3HD, K - 1] (both updated in place at `slots` [B]); seq_lens [B]: a row of seq_len 1 is
    its request's first token and starts from a zero state -> [B, HD] in qkv's dtype."""
    B = qkv.shape[0]
    _, H, D, _ = recurrent.shape
    K = conv_weight.shape[1]
    out = torch.empty(B, H * D, dtype=qkv.dtype, device=qkv.device)
    if B == 0:
        return out
    if D & (D - 1) or recurrent.dtype != torch.float32 or not recurrent[0].is_contiguous():
        raise ValueError(f"kda_fused_decode: head_dim {D} must be a power of two and the state float32, contiguous")
    for name, t in (("qkv", qkv), ("f", f), ("beta_logits", beta_logits), ("gate", gate), ("conv", conv)):
        if t.stride(-1) != 1:
            raise ValueError(f"kda_fused_decode: {name} needs a contiguous last dim")
    if conv.stride(1) != K - 1 or not conv_weight.is_contiguous():
        raise ValueError("kda_fused_decode: conv state rows [3HD, K - 1] and the conv weight must be contiguous")
    _kda_decode_kernel[(B, H)](
        qkv, f, beta_logits, gate, conv_weight, a_log, dt_bias, norm_weight, recurrent, conv, slots, seq_lens,
        out,
        qkv.stride(0), f.stride(0), beta_logits.stride(0), gate.stride(0), slots.stride(0), recurrent.stride(0),
        conv.stride(0), out.stride(0), float(norm_eps), H * D,
        H=H, D=D, K=K, KP=triton.next_power_of_2(K), **pdl_launch(B),
        **({} if interpreter_mode() else {"num_warps": num_warps(D)}),
    )
    return out
