"""FP8 linear kernels on a GPU: correctness against the dequantized reference, then a GEMM benchmark.

    python -m benchmarks.gpu_fp8            # checks + full table (M = 1 .. 8192, Llama-3.1-8B shapes)
    python -m benchmarks.gpu_fp8 --quick    # fewer M values
    python -m benchmarks.gpu_fp8 --tune     # also sweep a few Triton launch configs and report the best
    python -m benchmarks.gpu_fp8 --cpu-smoke   # no GPU: tiny shapes on a fake sm_90, to check the script itself

Prints markdown to stdout (logs go to stderr). Every kernel runs through kestrel's real selection with a forced
backend, so a path the gate table refuses on this device is reported as skipped with the gate's reason.
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import platform as _py_platform
import sys

if "--cpu-smoke" in sys.argv:
    # the Triton interpreter must be chosen before triton is first imported (torch or transformers may import it)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kestrel.kernels import KernelSelectionError  # noqa: E402
from kestrel.kernels.fp8_quant import (  # noqa: E402
    dequantize_block,
    dequantize_per_token_group,
    fp8_max,
    quantize_per_tensor_dynamic,
    quantize_per_tensor_static,
    quantize_per_token,
    quantize_per_token_group,
    quantize_weight_block,
    quantize_weight_per_channel,
    quantize_weight_per_tensor,
)
from kestrel.layers.linear import Linear  # noqa: E402
from kestrel.layers.quant import get_quant_config  # noqa: E402
from kestrel.platform import current_platform, fp8_dtype, supports_fp8_rowwise_scaled_mm  # noqa: E402
from kestrel.platform.gates import GATES, kernel_gate  # noqa: E402

M_VALUES = (1, 16, 64, 256, 1024, 4096, 8192)
QUICK_M = (1, 64, 1024, 8192)
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
CHECK_SHAPES = ((1, 4096, 4096), (77, 6144, 4096), (300, 1000, 1400))  # (M, N, K); the last ends mid-block
TOL = 2e-2
DEVICE = "cuda"

CT = "compressed-tensors"


def _ct(weights: str, acts: dict | None) -> dict:
    group = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": weights, "symmetric": True,
                                                "dynamic": False}, "input_activations": acts}
    return {"quantization_config": {"quant_method": CT, "format": "float-quantized", "config_groups": {"g": group}}}


STATIC_TENSOR = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
DYNAMIC_TOKEN = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
SCHEMES = {
    # name: (config.json, quantization argument)
    "per_tensor_static": (_ct("tensor", STATIC_TENSOR), None),
    "per_channel_token": (_ct("channel", DYNAMIC_TOKEN), None),
    "block128": ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                          "weight_block_size": [128, 128]}}, None),
    "on_load": ({}, "fp8"),
}


# ------------------------------------------------------------------------------------------------ timing
def _bench_events(fn, warmup_ms=25.0, rep_ms=100.0) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        fn()
    end.record()
    torch.cuda.synchronize()
    est = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / est))):
        fn()
    n = max(10, int(rep_ms / est))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    cache = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    for i in range(n):
        cache.zero_()  # flush L2 between runs, as do_bench does
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return times[len(times) // 2]


def _bench_cpu(fn, reps: int = 1) -> float:
    import time

    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def bench_ms(fn) -> float:
    if DEVICE == "cpu":
        return _bench_cpu(fn)
    try:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    except ImportError:
        return _bench_events(fn)


# ------------------------------------------------------------------------------------------------ layers
def _checkpoint(scheme: str, n: int, k: int, gen: torch.Generator) -> tuple[dict, torch.Tensor]:
    """Synthetic checkpoint tensors for one [n, k] layer and the fp32 weight they encode."""
    w = torch.randn(n, k, generator=gen, device=DEVICE) / math.sqrt(k)
    if scheme == "on_load":
        return {"weight": w.to(torch.bfloat16)}, None  # reference: build_layer quantizes like the kernel does
    if scheme == "block128":
        q, s = quantize_weight_block(w, (128, 128))
        return {"weight": q, "weight_scale_inv": s}, dequantize_block(q, s, (128, 128))
    if scheme == "per_channel_token":
        q, s = quantize_weight_per_channel(w)
        return {"weight": q, "weight_scale": s}, q.float() * s
    q, s = quantize_weight_per_tensor(w)
    input_scale = torch.full((1,), 4.0 / fp8_max(), device=DEVICE)
    return {"weight": q, "weight_scale": s.reshape(1), "input_scale": input_scale}, q.float() * s


def build_layer(scheme: str, backend: str, n: int, k: int, seed: int = 0):
    """A Linear with `backend` forced, loaded with synthetic FP8 tensors on the GPU. Returns (layer, w_ref, tensors)."""
    config, quantization = SCHEMES[scheme]
    qcfg = get_quant_config(config, quantization, torch.bfloat16)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    tensors, w_ref = _checkpoint(scheme, n, k, gen)
    with torch.device(DEVICE):
        layer = Linear(k, n, params_dtype=torch.bfloat16, prefix=f"bench.{scheme}", quant_config=qcfg, backend=backend)
    for name, t in tensors.items():
        layer.load_weight(name, t.to(DEVICE))
    if w_ref is None:
        q, s = quantize_weight_per_channel(tensors["weight"].float().to(DEVICE), fp8_dtype())
        w_ref = q.float() * s
    layer.process_weights_after_loading()
    return layer, w_ref.to(DEVICE), tensors


def activation_reference(scheme: str, x: torch.Tensor, tensors: dict) -> torch.Tensor:
    dt = fp8_dtype()
    if scheme == "per_tensor_static":
        s = tensors["input_scale"].to(DEVICE).reshape(())
        if dt == torch.float8_e4m3fnuz:
            s = s * 2
        return quantize_per_tensor_static(x, s, dt).float() * s
    if scheme == "block128":
        q, s = quantize_per_token_group(x, 128, dt)
        return dequantize_per_token_group(q, s, 128)
    q, s = quantize_per_token(x, dt)
    return q.float() * s


def rel_err(y, ref) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm())


# ------------------------------------------------------------------------------------------------ sections
def header() -> None:
    p = current_platform()
    print("# Kestrel FP8 linear kernels on GPU\n")
    name = torch.cuda.get_device_name(0) if DEVICE == "cuda" else f"CPU smoke run on {p.device_name}"
    print(f"- device: {name} ({p.kind}, {p.arch_name})")
    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = "not installed"
    print(f"- torch {torch.__version__}, triton {tv}, python {_py_platform.python_version()}, "
          f"CUDA {torch.version.cuda or '-'}, HIP {getattr(torch.version, 'hip', None) or '-'}")
    print(f"- fp8 dtype: {fp8_dtype()}; row-wise _scaled_mm: {supports_fp8_rowwise_scaled_mm()}")
    for name in GATES:
        ok, why = kernel_gate(name)
        print(f"- gate `{name}`: {'yes' if ok else 'no (' + why + ')'}")
    print()


CHECKS = [
    ("torch_scaled_mm", "per_tensor_static"),
    ("torch_scaled_mm", "per_channel_token"),
    ("torch_scaled_mm", "on_load"),
    ("triton_fp8_block", "block128"),
    ("fp8_dequant_fallback", "block128"),
    ("fp8_dequant_fallback", "per_channel_token"),
]


def correctness() -> bool:
    print("## Correctness (relative error norm vs the float32 dequantized GEMM)\n")
    print("| kernel | scheme | M | N | K | rel err | result |")
    print("|---|---|---:|---:|---:|---:|---|")
    all_ok = True
    for backend, scheme in CHECKS:
        for m, n, k in CHECK_SHAPES:
            if backend == "torch_scaled_mm" and (n % 16 or k % 16):
                continue
            try:
                layer, w_ref, tensors = build_layer(scheme, backend, n, k)
            except KernelSelectionError as e:
                print(f"| {backend} | {scheme} | {m} | {n} | {k} | - | skipped: {str(e).split(': ', 1)[-1]} |")
                break
            gen = torch.Generator(device=DEVICE).manual_seed(m)
            x = torch.randn(m, k, generator=gen, device=DEVICE).to(torch.bfloat16)
            y = layer(x)
            if backend == "fp8_dequant_fallback":
                ref = x.float() @ w_ref.T
            else:
                ref = activation_reference(scheme, x, tensors) @ w_ref.T
            err = rel_err(y, ref)
            ok = err < TOL and bool(torch.isfinite(y).all())
            all_ok &= ok
            print(f"| {backend} | {scheme} | {m} | {n} | {k} | {err:.2e} | {'ok' if ok else 'FAIL'} |")
    print()
    return all_ok


def _tflops(m, n, k, ms) -> float:
    return 2.0 * m * n * k / (ms * 1e-3) / 1e12


def _fmt(tflops: float) -> str:
    return f"{tflops:.1f}" if tflops >= 10 else f"{tflops:.3g}"


def _cell(m, n, k, ms, base_ms) -> str:
    if ms is None:
        return "-"
    return f"{_fmt(_tflops(m, n, k, ms))} ({base_ms / ms:.2f}x)"


def gemm_benchmark(m_values, tune: bool) -> None:
    dt = fp8_dtype()
    has_tsm = kernel_gate("torch_scaled_mm")[0]
    has_rowwise = has_tsm and supports_fp8_rowwise_scaled_mm()
    has_triton = kernel_gate("triton_fp8_block")[0]
    ops = None
    if has_triton:
        from kestrel.kernels.triton_ops import fp8_block as ops

    print("## GEMM only (activations already quantized): TFLOP/s (speedup vs bf16 torch.matmul)\n")
    cols = ["bf16 matmul", "_scaled_mm per-tensor", "_scaled_mm row-wise", "triton block 128x128"]
    if tune and has_triton:
        cols.append("triton block (best config)")
    print("| shape | M | N | K | " + " | ".join(cols) + " |")
    print("|---|---:|---:|---:|" + "---:|" * len(cols))
    for sname, (n, k) in SHAPES.items():
        gen = torch.Generator(device=DEVICE).manual_seed(0)
        w = (torch.randn(n, k, generator=gen, device=DEVICE) / math.sqrt(k)).to(torch.bfloat16)
        wq_t, ws_t = quantize_weight_per_tensor(w, dt)
        wq_c, ws_c = quantize_weight_per_channel(w, dt)
        ws_row = ws_c.reshape(1, -1).contiguous()
        wq_b, ws_b = quantize_weight_block(w, (128, 128), dt)
        for m in m_values:
            x = torch.randn(m, k, generator=gen, device=DEVICE).to(torch.bfloat16)
            base = bench_ms(lambda: torch.matmul(x, w.t()))
            cells = [f"{_fmt(_tflops(m, n, k, base))} (1.00x)"]
            if has_tsm:
                xq, xs = quantize_per_tensor_dynamic(x, dt)
                xs0 = xs.reshape(())
                t = bench_ms(lambda: torch._scaled_mm(xq, wq_t.t(), scale_a=xs0, scale_b=ws_t.reshape(()), out_dtype=torch.bfloat16))
                cells.append(_cell(m, n, k, t, base))
            else:
                cells.append("-")
            if has_rowwise:
                xq, xs = quantize_per_token(x, dt)
                t = bench_ms(lambda: torch._scaled_mm(xq, wq_c.t(), scale_a=xs, scale_b=ws_row, out_dtype=torch.bfloat16))
                cells.append(_cell(m, n, k, t, base))
            else:
                cells.append("-")
            if has_triton:
                xq, xs = ops.per_token_group_quant_fp8(x, 128, dt)
                t = bench_ms(lambda: ops.fp8_block_gemm(xq, xs, wq_b, ws_b, 128, 128, torch.bfloat16))
                cells.append(_cell(m, n, k, t, base))
                if tune:
                    best = min(
                        bench_ms(lambda c=c: ops.fp8_block_gemm(xq, xs, wq_b, ws_b, 128, 128, torch.bfloat16, config=c))
                        for c in _tune_configs(m)
                    )
                    cells.append(_cell(m, n, k, best, base))
            else:
                cells.append("-")
            print(f"| {sname} | {m} | {n} | {k} | " + " | ".join(cells) + " |")
            sys.stdout.flush()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    print()


def layer_benchmark(m_values) -> None:
    """Linear.forward through the selected kernels, activation quantization included."""
    print("## Layer forward (Linear.forward incl. activation quantization): TFLOP/s (speedup vs bf16)\n")
    kernels = [("torch_scaled_mm", "per_tensor_static"), ("torch_scaled_mm", "per_channel_token"),
               ("triton_fp8_block", "block128")]
    print("| shape | M | N | K | bf16 | " + " | ".join(f"{b} {s}" for b, s in kernels) + " |")
    print("|---|---:|---:|---:|---:|" + "---:|" * len(kernels))
    for sname, (n, k) in SHAPES.items():
        layers = {}
        for b, s in kernels:
            try:
                layers[(b, s)] = build_layer(s, b, n, k)[0]
            except KernelSelectionError:
                layers[(b, s)] = None
        gen = torch.Generator(device=DEVICE).manual_seed(0)
        w = (torch.randn(n, k, generator=gen, device=DEVICE) / math.sqrt(k)).to(torch.bfloat16)
        for m in m_values:
            x = torch.randn(m, k, generator=gen, device=DEVICE).to(torch.bfloat16)
            base = bench_ms(lambda: F.linear(x, w))
            cells = [_fmt(_tflops(m, n, k, base))]
            for key in kernels:
                layer = layers[key]
                cells.append("-" if layer is None else _cell(m, n, k, bench_ms(lambda: layer(x)), base))
            print(f"| {sname} | {m} | {n} | {k} | " + " | ".join(cells) + " |")
            sys.stdout.flush()
        del layers
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    print()


def _tune_configs(m: int) -> list[dict]:
    is_rocm = bool(getattr(torch.version, "hip", None))
    out = []
    for bm in (16, 32, 64, 128):
        if bm > 16 and bm > 2 * max(m, 16):
            continue
        for bn in (64, 128):
            for warps in (4, 8):
                for stages in ((2,) if is_rocm else (3, 4)):
                    out.append({"BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": 8, "num_warps": warps, "num_stages": stages})
    return out


def _setup_cpu_smoke() -> None:
    """No GPU: a fake sm_90 whose kernels run on the CPU (torch._scaled_mm has CPU kernels; Triton, when installed,
    runs in its interpreter). Checks the script's plumbing, not performance."""
    global DEVICE, SHAPES, CHECK_SHAPES
    import importlib.util

    from kestrel.platform import fake_platform, set_platform_for_testing

    DEVICE = "cpu"
    SHAPES = {"qkv": (384, 256), "down": (256, 448)}
    CHECK_SHAPES = ((1, 256, 256), (7, 384, 256), (30, 200, 300))
    has_triton = importlib.util.find_spec("triton") is not None
    if has_triton:
        from kestrel.kernels.triton_ops import fp8_block as ops

        # The Triton 3.6 interpreter mis-rounds fp32 -> fp8 casts; quantize activations with the torch helper here.
        ops.per_token_group_quant_fp8 = quantize_per_token_group
    set_platform_for_testing(fake_platform("sm_90", triton_available=has_triton))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"M in {QUICK_M} only")
    parser.add_argument("--tune", action="store_true", help="also sweep Triton launch configs")
    parser.add_argument("--no-check", action="store_true", help="skip the correctness section")
    parser.add_argument("--no-layer", action="store_true", help="skip the layer-forward table")
    parser.add_argument("--cpu-smoke", action="store_true", help="run every code path on the CPU with tiny shapes")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.cpu_smoke:
        _setup_cpu_smoke()
    elif not torch.cuda.is_available():
        print("benchmarks/gpu_fp8.py needs a CUDA or ROCm GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    header()
    ok = True if args.no_check else correctness()
    m_values = (1, 5) if args.cpu_smoke else QUICK_M if args.quick else M_VALUES
    gemm_benchmark(m_values, args.tune)
    if not args.no_layer:
        layer_benchmark(m_values)
    print(f"correctness: {'all ok' if ok else 'FAILURES above'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
