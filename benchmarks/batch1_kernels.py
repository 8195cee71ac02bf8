"""The kernel choices that set batch-1 decode latency, timed on the GPU as CUDA-graph replays (median of 5 runs
of 20 launches) and checked against float64 / reference results:

  1. decode attention at batch 1 in a graph-sized launch (64 splits, as CUDA graphs capture for max_model_len)
     for several shortest-split lengths (MIN_SPLIT), against the split count chosen for the actual context;
  2. RMSNorm (+ residual) before a projection: norm kernel + cuBLAS, norm kernel + skinny GEMM, and the skinny
     GEMM with the norm fused into its input load, with a small tile sweep of the fused kernel;
  3. SiLU-and-mul before down_proj: activation kernel + cuBLAS / skinny, and fused.

    python benchmarks/batch1_kernels.py"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gemv_check import graph_time_us  # noqa: E402
from kestrel.attention.ops import fused_ops, reference as ref, triton_attention as ta  # noqa: E402
from kestrel.kernels.triton_ops import skinny_gemm as sg  # noqa: E402

PAGE = 16


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def decode_section():
    print("\n### Decode attention, batch 1, graph launch of 64 splits (us)\n")
    shapes = {"0.6b (16q/8kv)": (16, 8), "8b (32q/8kv)": (32, 8)}
    mins = (64, 128, 256, 512)
    print("| heads | context | chosen splits | chosen us | " + " | ".join(f"64 splits, min {m}" for m in mins)
          + " | max rel err |")
    print("|---|---|---|---|" + "---|" * len(mins) + "---|")
    gen = torch.Generator().manual_seed(0)
    for name, (hq, hkv) in shapes.items():
        for ctx in (128, 384, 1024, 4096, 32768):
            nb = -(-ctx // PAGE) + 1
            kc = torch.randn(nb, PAGE, hkv, 128, generator=gen).to("cuda", torch.bfloat16)
            vc = torch.randn(nb, PAGE, hkv, 128, generator=gen).to("cuda", torch.bfloat16)
            bt = torch.randperm(nb, generator=gen)[: nb - 1].to("cuda", torch.int32)[None, :]
            sl = torch.tensor([ctx], dtype=torch.int32, device="cuda")
            q = torch.randn(1, hq, 128, device="cuda", dtype=torch.bfloat16)
            out = torch.empty_like(q)
            expect = ref.decode_attention_ref(q.float(), kc.float(), vc.float(), bt, sl, 128 ** -0.5)
            chosen = ta.choose_num_splits(1, hkv, ctx)
            t_chosen = graph_time_us(lambda: ta.decode_attention(q, kc, vc, bt, sl, 128 ** -0.5, out=out))
            err = rel(out, expect)
            cells = []
            for m in mins:
                cfg = {"MIN_SPLIT": m}
                t = graph_time_us(lambda: ta.decode_attention(q, kc, vc, bt, sl, 128 ** -0.5, out=out, num_splits=64,
                                                              _config=cfg))
                err = max(err, rel(out, expect))
                cells.append(f"{t:.1f}")
            print(f"| {name} | {ctx} | {chosen} | {t_chosen:.1f} | " + " | ".join(cells) + f" | {err:.1e} |",
                  flush=True)


def norm_section():
    print("\n### RMSNorm + residual, then the projection, batch 1 (us)\n")
    print("| shape | N | K | norm + cuBLAS | norm + skinny | fused skinny | best fused config | rel err |")
    print("|---|---|---|---|---|---|---|---|")
    shapes = {"0.6b qkv": (4096, 1024), "0.6b gate_up": (6144, 1024), "8b qkv": (6144, 4096),
              "8b gate_up": (28672, 4096)}
    for name, (n, k) in shapes.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(3)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        res = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        nw = (1 + 0.1 * torch.randn(k, device="cuda")).to(torch.bfloat16)
        h, _ = fused_ops.rms_norm(x, nw, 1e-6, res)
        ref_y = h.double() @ ws[0].double().T
        y, _ = sg.skinny_rms_norm_gemm(x, nw, 1e-6, ws[0], residual=res)
        err = rel(y, ref_y)
        i = [0]

        def rot(f):
            def g():
                i[0] = (i[0] + 1) % 3
                f(ws[i[0]])
            return g
        t_cublas = graph_time_us(rot(lambda w: F.linear(fused_ops.rms_norm(x, nw, 1e-6, res)[0], w)))
        t_skinny = graph_time_us(rot(lambda w: sg.skinny_gemm(fused_ops.rms_norm(x, nw, 1e-6, res)[0], w)))
        t_fused = graph_time_us(rot(lambda w: sg.skinny_rms_norm_gemm(x, nw, 1e-6, w, residual=res)))
        cands = []
        for bn in (32, 64):
            for sk in (1, 2, 4, 8):
                cfg = {"BLOCK_N": bn, "BLOCK_K": 128, "SPLIT_K": sk}
                try:
                    t = graph_time_us(rot(lambda w: sg.skinny_rms_norm_gemm(x, nw, 1e-6, w, residual=res,
                                                                            _config=cfg)), 10)
                    cands.append((t, f"BN{bn}/SK{sk}"))
                except Exception as e:  # noqa: BLE001
                    print("config failed", cfg, type(e).__name__, file=sys.stderr)
        bt, bc = min(cands)
        print(f"| {name} | {n} | {k} | {t_cublas:.1f} | {t_skinny:.1f} | {t_fused:.1f} | {bt:.1f} {bc} | {err:.1e} |",
              flush=True)


def silu_section():
    print("\n### SiLU-and-mul, then down_proj, batch 1 (us)\n")
    print("| shape | N | K | act + cuBLAS | act + skinny | fused skinny | best fused config | rel err |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (n, k) in {"0.6b down": (1024, 3072), "8b down": (4096, 14336)}.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(3)]
        gu = torch.randn(1, 2 * k, device="cuda", dtype=torch.bfloat16)
        g, u = gu.double().chunk(2, dim=-1)
        ref_y = (g * torch.sigmoid(g) * u) @ ws[0].double().T
        err = rel(sg.skinny_silu_mul_gemm(gu, ws[0]), ref_y)
        i = [0]

        def rot(f):
            def gfn():
                i[0] = (i[0] + 1) % 3
                f(ws[i[0]])
            return gfn
        t_cublas = graph_time_us(rot(lambda w: F.linear(fused_ops.silu_and_mul(gu), w)))
        t_skinny = graph_time_us(rot(lambda w: sg.skinny_gemm(fused_ops.silu_and_mul(gu), w)))
        t_fused = graph_time_us(rot(lambda w: sg.skinny_silu_mul_gemm(gu, w)))
        cands = []
        for bn in (32, 64):
            for sk in (1, 2, 4, 8):
                cfg = {"BLOCK_N": bn, "BLOCK_K": 128, "SPLIT_K": sk}
                try:
                    cands.append((graph_time_us(rot(lambda w: sg.skinny_silu_mul_gemm(gu, w, _config=cfg)), 10),
                                  f"BN{bn}/SK{sk}"))
                except Exception as e:  # noqa: BLE001
                    print("config failed", cfg, type(e).__name__, file=sys.stderr)
        bt, bc = min(cands)
        print(f"| {name} | {n} | {k} | {t_cublas:.1f} | {t_skinny:.1f} | {t_fused:.1f} | {bt:.1f} {bc} | {err:.1e} |",
              flush=True)


def main():
    torch.manual_seed(0)
    print(torch.cuda.get_device_name())
    decode_section()
    norm_section()
    silu_section()


if __name__ == "__main__":
    main()
