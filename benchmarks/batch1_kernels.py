"""The kernel choices that set batch-1 decode latency, timed on the GPU as CUDA-graph replays (median of 5 runs
of 20 launches) and checked against float64 / reference results:

  1. decode attention at batch 1 in a graph-sized launch (64 splits, as CUDA graphs capture for max_model_len)
     for several shortest-split lengths (MIN_SPLIT), against the split count chosen for the actual context;
  2. decode attention launch configs at batch 1 (tile, warps, pipeline stages);
  3. each projection of the 0.6B and 8B shapes: cuBLAS, the skinny tensor-core GEMM and the GEMV (with a tile
     sweep), and the chains norm -> projection (-> SiLU-and-mul) unfused against the fused GEMV.

    python -m benchmarks.batch1_kernels"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from benchmarks.gemv_check import graph_time_us
from kestrel.attention.ops import reference as ref, triton_attention as ta
from kestrel.kernels.triton_ops import fused_ops
from kestrel.kernels.triton_ops import gemv as gv, skinny_gemm as sg

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


SHAPES = {  # name: (N, K, what runs before it at batch 1)
    "0.6b qkv": (4096, 1024, "norm"), "0.6b o": (1024, 2048, None), "0.6b gate_up": (3072, 1024, "norm+silu"),
    "0.6b down": (1024, 3072, None),
    "8b qkv": (6144, 4096, "norm"), "8b o": (4096, 4096, None), "8b gate_up": (14336, 4096, "norm+silu"),
    "8b down": (4096, 14336, None),
}


def gemv_section():
    print("\n### Projections at batch 1 (us): alone, and with the norm / activation they need\n")
    print("| shape | N | K | weight floor | cuBLAS | skinny | gemv | best gemv config | chain unfused (norm/act "
          "kernels + cuBLAS) | chain fused gemv | rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    bw = 4.26e12
    for name, (n, k, pre) in SHAPES.items():
        rows = 2 * n if pre == "norm+silu" else n
        ws = [torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(3)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        res = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        nw = (1 + 0.1 * torch.randn(k, device="cuda")).to(torch.bfloat16)
        i = [0]

        def rot(f):
            def g():
                i[0] = (i[0] + 1) % 3
                f(ws[i[0]])
            return g
        err = rel(gv.gemv(x, ws[0]), x.double() @ ws[0].double().T)
        t_cublas = graph_time_us(rot(lambda w: F.linear(x, w)))
        t_skinny = graph_time_us(rot(lambda w: sg.skinny_gemm(x, w))) if rows <= 8192 else float("nan")
        t_gemv = graph_time_us(rot(lambda w: gv.gemv(x, w)))
        cands = []
        for tile in (2048, 4096, 8192):
            for warps in (4, 8):
                for stages in (1, 2, 3):
                    cfg = {"TILE": tile, "num_warps": warps, "num_stages": stages}
                    try:
                        cands.append((graph_time_us(rot(lambda w: gv.gemv(x, w, _config=cfg)), 10),
                                      f"T{tile}/W{warps}/S{stages}"))
                    except Exception as e:  # noqa: BLE001
                        print("config failed", cfg, type(e).__name__, file=sys.stderr)
        bt, bc = min(cands)
        chain_u = chain_f = float("nan")
        if pre == "norm":
            h, _ = fused_ops.rms_norm(x, nw, 1e-6, res)
            err = max(err, rel(gv.gemv(x, ws[0], norm_weight=nw, eps=1e-6, residual=res)[0],
                               h.double() @ ws[0].double().T))
            chain_u = graph_time_us(rot(lambda w: F.linear(fused_ops.rms_norm(x, nw, 1e-6, res)[0], w)))
            chain_f = graph_time_us(rot(lambda w: gv.gemv(x, w, norm_weight=nw, eps=1e-6, residual=res)))
        elif pre == "norm+silu":
            h, _ = fused_ops.rms_norm(x, nw, 1e-6, res)
            gu = (h.double() @ ws[0].double().T)
            gg, uu = gu[:, :n], gu[:, n:]
            err = max(err, rel(gv.gemv(x, ws[0], norm_weight=nw, eps=1e-6, residual=res, silu_out=True)[0],
                               gg * torch.sigmoid(gg) * uu))
            chain_u = graph_time_us(rot(lambda w: fused_ops.silu_and_mul(
                F.linear(fused_ops.rms_norm(x, nw, 1e-6, res)[0], w))))
            chain_f = graph_time_us(rot(lambda w: gv.gemv(x, w, norm_weight=nw, eps=1e-6, residual=res,
                                                          silu_out=True)))
        floor = rows * k * 2 / bw * 1e6
        print(f"| {name} | {rows} | {k} | {floor:.1f} | {t_cublas:.1f} | {t_skinny:.1f} | {t_gemv:.1f} | {bt:.1f} {bc} "
              f"| {chain_u:.1f} | {chain_f:.1f} | {err:.1e} |", flush=True)


def decode_config_section():
    print("\n### Decode attention configs at batch 1, 16q/8kv, d 128 (us)\n")
    gen = torch.Generator().manual_seed(1)
    rows = []
    for ctx in (384, 1024):
        nb = -(-ctx // PAGE) + 1
        kc = torch.randn(nb, PAGE, 8, 128, generator=gen).to("cuda", torch.bfloat16)
        vc = torch.randn(nb, PAGE, 8, 128, generator=gen).to("cuda", torch.bfloat16)
        bt = torch.randperm(nb, generator=gen)[: nb - 1].to("cuda", torch.int32)[None, :]
        sl = torch.tensor([ctx], dtype=torch.int32, device="cuda")
        q = torch.randn(1, 16, 128, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        for splits, min_split in ((1, 256), (64, 128), (64, 256)):
            for bn in (32, 64, 128):
                for warps in (4, 8):
                    for stages in (1, 2, 3, 4):
                        cfg = {"BLOCK_N": bn, "num_warps": warps, "num_stages": stages, "MIN_SPLIT": min_split}
                        try:
                            t = graph_time_us(lambda: ta.decode_attention(q, kc, vc, bt, sl, 0.088, out=out,
                                                                          num_splits=splits, _config=cfg), 10)
                            rows.append((ctx, splits, min_split, t, f"BN{bn}/W{warps}/S{stages}"))
                        except Exception as e:  # noqa: BLE001
                            print("config failed", cfg, type(e).__name__, file=sys.stderr)
    print("| context | splits | min split | best us | config | default us |")
    print("|---|---|---|---|---|---|")
    for ctx in (384, 1024):
        for splits, min_split in ((1, 256), (64, 128), (64, 256)):
            sel = [r for r in rows if r[0] == ctx and r[1] == splits and r[2] == min_split]
            best = min(sel, key=lambda r: r[3])
            dflt = [r for r in sel if r[4] == "BN64/W4/S3"]
            print(f"| {ctx} | {splits} | {min_split} | {best[3]:.1f} | {best[4]} | {dflt[0][3] if dflt else float('nan'):.1f} |")


def main():
    torch.manual_seed(0)
    print(torch.cuda.get_device_name())
    decode_section()
    decode_config_section()
    gemv_section()


if __name__ == "__main__":
    main()
