"""Batch-1..8 linear layers (decode at small batch) on the GPU: cuBLAS (torch.nn.functional.linear) against the
Triton skinny GEMM (kestrel/kernels/triton_ops/skinny_gemm.py), each checked against a float64 reference, on the
Qwen3-0.6B and Llama-3.1-8B projection shapes. Times are CUDA-graph replays of 20 launches (median of 5).

    python -m benchmarks.gemv_check [--sweep]"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from kestrel.kernels.triton_ops.skinny_gemm import skinny_gemm

SHAPES = {  # name: (N, K)
    "0.6b qkv": (4096, 1024), "0.6b o": (1024, 2048), "0.6b gate_up": (6144, 1024), "0.6b down": (1024, 3072),
    "0.6b lm_head": (151936, 1024),
    "8b qkv": (6144, 4096), "8b o": (4096, 4096), "8b gate_up": (28672, 4096), "8b down": (4096, 14336),
}


def graph_time_us(fn, reps=20) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return sorted(times)[2]


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sweep", action="store_true", help="also try several tile configs per shape")
    args = ap.parse_args()
    bw = 4.26e12
    rows, bad = [], 0
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(3)]  # > L2 in total
        for m in (1, 2, 4, 8):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = (x.double() @ ws[0].double().T)
            out = skinny_gemm(x, ws[0])
            err = ((out.double() - ref).norm() / ref.norm()).item()
            bad += err > 1e-2
            i = [0]

            def rot(f):
                def g():
                    i[0] = (i[0] + 1) % 3
                    f(ws[i[0]])
                return g
            t_cublas = graph_time_us(rot(lambda w: F.linear(x, w)))
            t_triton = graph_time_us(rot(lambda w: skinny_gemm(x, w)))
            best = ""
            if args.sweep and m == 1:
                cands = []
                for bn in (16, 32, 64):
                    for bk in (128, 256, 512):
                        for sk in (1, 2, 4, 8):
                            cfg = dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk)
                            try:
                                cands.append((graph_time_us(rot(lambda w: skinny_gemm(x, w, _config=cfg)), 10), cfg))
                            except Exception as e:  # noqa: BLE001  (a config the compiler refuses)
                                print("config failed", cfg, type(e).__name__, file=sys.stderr)
                best_t, best_cfg = min(cands, key=lambda c: c[0])
                best = f"{best_t:.1f} {best_cfg}"
            floor = n * k * 2 / bw * 1e6
            rows.append(f"| {name} | {m} | {floor:.1f} | {t_cublas:.1f} | {t_triton:.1f} | {t_cublas / t_triton:.2f}x "
                        f"| {err:.1e} | {best} |")
            print(rows[-1], flush=True)
    print("\n| shape | M | weight-read floor us | cuBLAS us | skinny us | speed-up | rel err | best sweep |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"correctness: {'all ok' if not bad else f'{bad} FAILED'}")


if __name__ == "__main__":
    main()
