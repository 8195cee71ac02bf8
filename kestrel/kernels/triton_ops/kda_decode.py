"""The fused Kimi Delta Attention decode step in Triton: one launch per KDA layer and step does what the unfused
chain (kestrel/attention/kda.py KDAImpl.forward_decode) does in ~20 small kernels.

One program per (request, key head). It reads the request's slot, then for the head's q, k and v channels: the
short convolution over the slot's last K - 1 inputs and this token (+ SiLU), shifting the conv state in place; q
and k L2-normalised (q scaled by D^-1/2); the per-channel forget gate -exp(A_log) softplus(f + dt_bias) and beta =
sigmoid(b); the delta-rule step on the head's D x D float32 state held in registers (written back in place); and
the output RMSNorm over D times the norm weight times sigmoid(gate). Gated DeltaNet (Qwen3-Next, Qwen3.5) runs in
the same kernel by constexpr options: H / HK state heads per key head (the program convolves its q and k once and
loops over them, so no two programs shift the same conv channels), values of D_v, one decay per head, a SiLU gate.
Padding rows of a CUDA graph point at the null slot 0, whose contents are never read as a real state; a request's
first token (seq_len 1) reads a zero state instead of its slot's. Grids depend on shapes only (graph-capturable)."""
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
    eps, HKD, H: tl.constexpr, D: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, PDL: tl.constexpr,
    HK: tl.constexpr, DV: tl.constexpr, PER_HEAD_G: tl.constexpr, SILU_GATE: tl.constexpr,
):
    """One program per (request, key head): the key head's q and k once (their conv state shifted once), then
    each of the H / HK state heads that read them. KDA: HK = H, DV = D, per-channel decay, sigmoid gate."""
    pdl_prologue(PDL)
    R: tl.constexpr = H // HK
    b = tl.program_id(0)
    hk = tl.program_id(1)
    slot = tl.load(SLOTS + b * stride_slot).to(tl.int64)
    fresh = (tl.load(SEQ_LENS + b) == 1).to(tl.int32)  # the request's first token: a zero state
    d = tl.arange(0, D)
    dv = tl.arange(0, DV)
    cols = tl.arange(0, KP)
    row = b.to(tl.int64) * stride_qkv
    conv_row = slot * stride_conv
    # the token's q and k after the short convolution, kept float32 (as the unfused chain and prefill keep them)
    q = _conv_silu(QKV, CONV, W_CONV, row, conv_row, hk * D + d, cols, fresh, K)
    k = _conv_silu(QKV, CONV, W_CONV, row, conv_row, HKD + hk * D + d, cols, fresh, K)
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * (1.0 / tl.sqrt(D * 1.0))
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    for r in tl.static_range(R):
        h = hk * R + r
        v = _conv_silu(QKV, CONV, W_CONV, row, conv_row, 2 * HKD + h * DV + dv, cols, fresh, K)
        # gates: the decay (log space; per channel, or one per head) and the head's beta
        if PER_HEAD_G:
            x = tl.load(F + b * stride_f + h).to(tl.float32) + tl.load(DT_BIAS + h).to(tl.float32)
        else:
            x = tl.load(F + b * stride_f + h * D + d).to(tl.float32) + tl.load(DT_BIAS + h * D + d).to(tl.float32)
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
        g = -tl.exp(tl.load(A_LOG + h).to(tl.float32)) * softplus
        beta = tl.sigmoid(tl.load(BETA + b * stride_beta + h).to(tl.float32))
        # the delta rule on the head's state S [D_k, D_v]
        s_ptr = REC + slot * stride_rec + h * D * DV + d[:, None] * DV + dv[None, :]
        s = tl.load(s_ptr, mask=(d[:, None] < D) & (fresh == 0), other=0.0)
        if PER_HEAD_G:
            s = s * tl.exp(g)
        else:
            s = s * tl.exp(g)[:, None]
        delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(s_ptr, s)
        # gated RMSNorm over the head
        o = o * (1.0 / tl.sqrt(tl.sum(o * o, axis=0) / DV + eps)) * tl.load(W_NORM + dv).to(tl.float32)
        z = tl.load(GATE + b * stride_gate + h * DV + dv).to(tl.float32)
        if SILU_GATE:
            o = o * z * tl.sigmoid(z)
        else:
            o = o * tl.sigmoid(z)
        tl.store(OUT + b * stride_out + h * DV + dv, o.to(OUT.dtype.element_ty))


def kda_fused_decode(qkv, f, beta_logits, gate, conv_weight, a_log, dt_bias, norm_weight, norm_eps: float,
                     recurrent, conv, slots, seq_lens, num_key_heads: int | None = None, per_head_decay: bool = False,
                     gate_act: str = "sigmoid") -> torch.Tensor:
    """One token per request: qkv [B, C] (before the convolution; C = 2 H_k D + H D_v, 3HD for KDA), f [B, HD]
    (per head: [B, H]), beta_logits [B, H], gate [B, H D_v], conv_weight [C, K], a_log [H], dt_bias [HD] (per
    head: [H]), norm_weight [D_v]; the state slots recurrent [S, H, D, D_v] float32 and conv [S, C, K - 1] (both
    updated in place at `slots` [B]); seq_lens [B]: a row of seq_len 1 is its request's first token and starts
    from a zero state. `num_key_heads` (default H), `per_head_decay` and `gate_act` (sigmoid | silu): Gated
    DeltaNet's options (kda_ref.DeltaOptions) -> [B, H D_v] in qkv's dtype."""
    B = qkv.shape[0]
    _, H, D, DV = recurrent.shape
    HK = num_key_heads or H
    K = conv_weight.shape[1]
    out = torch.empty(B, H * DV, dtype=qkv.dtype, device=qkv.device)
    if B == 0:
        return out
    if D & (D - 1) or DV & (DV - 1) or recurrent.dtype != torch.float32 or not recurrent[0].is_contiguous():
        raise ValueError(f"kda_fused_decode: head_dim {D} must be a power of two (so must the value head size, "
                         f"{DV}) and the state float32, contiguous")
    if H % HK:
        raise ValueError(f"kda_fused_decode: {H} heads are not a multiple of {HK} key heads")
    for name, t in (("qkv", qkv), ("f", f), ("beta_logits", beta_logits), ("gate", gate), ("conv", conv)):
        if t.stride(-1) != 1:
            raise ValueError(f"kda_fused_decode: {name} needs a contiguous last dim")
    if conv.stride(1) != K - 1 or not conv_weight.is_contiguous():
        raise ValueError("kda_fused_decode: conv state rows [C, K - 1] and the conv weight must be contiguous")
    _kda_decode_kernel[(B, HK)](
        qkv, f, beta_logits, gate, conv_weight, a_log, dt_bias, norm_weight, recurrent, conv, slots, seq_lens,
        out,
        qkv.stride(0), f.stride(0), beta_logits.stride(0), gate.stride(0), slots.stride(0), recurrent.stride(0),
        conv.stride(0), out.stride(0), float(norm_eps), HK * D,
        H=H, D=D, K=K, KP=triton.next_power_of_2(K), HK=HK, DV=DV, PER_HEAD_G=per_head_decay,
        SILU_GATE=gate_act == "silu", **pdl_launch(B),
        **({} if interpreter_mode() else {"num_warps": num_warps(max(D, DV))}),
    )
    return out
