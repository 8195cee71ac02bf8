"""Kimi Delta Attention decode on the GPU, fused (one Triton launch per layer and step) against the unfused
PyTorch chain, at Kimi-Linear-48B-A3B's shape (32 heads x 128, conv width 4, bf16, float32 state):

  1. one KDA layer's decode step as a CUDA-graph replay per batch size: time, kernels per call (profiler), the
     state bytes it moves (float32 state read + written, conv state) and the bandwidth that makes;
  2. the whole model at batch 1 (random weights, 128-token prompt, 128 output tokens, CUDA graphs): ms per
     output token with each path, the kernels of one eager decode step, and the 20 KDA layers' share of the
     step (from section 1's batch-1 times; left out with --skip-layer).

The model's bf16 weights take ~98 GB of an H200's 141 (routed experts: 26 layers x 256 x 3 x 2304 x 1024 x 2 B
= 94 GB; embeddings and lm_head 1.5 GB; KDA projections 1.5 GB), so one engine at a time, built after section 1's
tensors are freed, with a batch-1 engine's KV cache (a fixed few blocks, not the profile's fill of the memory
left) and batch sizes: the memory in use is printed before and after each engine.

    python -m benchmarks.kda_decode [--skip-model | --skip-layer] [--output-len 128]"""
from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from benchmarks.common import SHAPES, write_shape
from benchmarks.mla_decode import time_us
from kestrel.kernels.kda_ref import DeltaOptions

H, D, K = 32, 128, 4
PROMPT_LEN = 128
KIMI_LINEAR_48B = SHAPES["kimi-linear-48b"]
NUM_KDA_LAYERS = len(KIMI_LINEAR_48B["linear_attn_config"]["kda_layers"])


def layer_case(batch: int):
    gen = torch.Generator().manual_seed(0)
    hd, dev, bf = H * D, "cuda", torch.bfloat16
    w = SimpleNamespace(conv_weight=(torch.randn(3 * hd, K, generator=gen) * 0.5).to(dev, bf),
                        A_log=torch.rand(H, generator=gen).to(dev), dt_bias=torch.randn(hd, generator=gen).to(dev),
                        o_norm_weight=torch.ones(D, device=dev, dtype=bf), norm_eps=1e-5, delta=DeltaOptions(H, D))
    proj = torch.randn(batch, 3 * hd + H, generator=gen).to(dev, bf)  # the merged projection's q|k|v|beta
    f, gate = (torch.randn(batch, hd, generator=gen).to(dev, bf) for _ in range(2))
    rec = torch.randn(batch + 1, H, D, D, generator=gen).to(dev) * 0.01
    conv = torch.randn(batch + 1, 3 * hd, K - 1, generator=gen).to(dev, bf)
    slots = torch.arange(1, batch + 1, dtype=torch.int32, device=dev)
    seq_lens = torch.full((batch,), 1000, dtype=torch.int32, device=dev)
    return w, (proj[:, :3 * hd], f, proj[:, 3 * hd:], gate), (rec, conv), slots, seq_lens


def cuda_kernels(fn) -> int:
    """CUDA kernels one call of `fn` launches (profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def kernels_per_call(fn) -> int:
    fn()  # compiled and warm first
    torch.cuda.synchronize()
    return cuda_kernels(fn)


def layer_section(batches) -> dict[int, dict]:
    from kestrel.attention.kda import KDAImpl
    from kestrel.attention.backends.triton_kda import TritonKDAImpl

    print("\n### One KDA layer's decode step (32 x 128 heads, bf16, float32 state), CUDA-graph replay\n")
    print("| batch | unfused us | kernels | fused us | kernels | saved us | fused state GB/s | fused / unfused |")
    print("|---|---|---|---|---|---|---|---|")
    fused, unfused = TritonKDAImpl(H, D, D ** -0.5, H), KDAImpl(H, D, D ** -0.5, H)
    out = {}
    for b in batches:
        w, (qkv, f, beta, gate), cache, slots, seq_lens = layer_case(b)
        runs = {name: (lambda impl=impl: impl.forward_decode(w, qkv, f, beta, gate, cache, slots, seq_lens))
                for name, impl in (("unfused", unfused), ("fused", fused))}
        t = {name: time_us(fn) for name, fn in runs.items()}
        n = {name: kernels_per_call(fn) for name, fn in runs.items()}
        moved = b * (H * D * D * 4 * 2 + 3 * H * D * (K - 1) * 2 * 2)  # state and conv state, read + written
        print(f"| {b} | {t['unfused']:.1f} | {n['unfused']} | {t['fused']:.1f} | {n['fused']} | "
              f"{t['unfused'] - t['fused']:.1f} | {moved / t['fused'] / 1e3:.0f} | {t['fused'] / t['unfused']:.2f} |",
              flush=True)
        out[b] = {"unfused_us": t["unfused"], "fused_us": t["fused"], "unfused_kernels": n["unfused"],
                  "fused_kernels": n["fused"]}
    return out


def gpu_in_use(what: str) -> int:
    """Frees what is unreferenced, prints the memory in use and returns the free bytes."""
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    print(f"GPU memory in use {what}: {(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB", flush=True)
    return free


def model_run(model_dir: Path, fused: bool, prompt: list[int], n_out: int) -> dict:
    from kestrel import LLM, SamplingParams
    from kestrel.attention.backends.triton_kda import TritonKDAImpl
    from kestrel.attention.kda import KDAImpl

    saved = TritonKDAImpl.forward_decode
    if not fused:
        TritonKDAImpl.forward_decode = KDAImpl.forward_decode  # the unfused chain, captured in the same graphs
    max_len = len(prompt) + n_out
    try:
        # batch 1: one sequence, its prompt in one step, a KV pool of 64 blocks (MLA pages; the KDA state slots
        # are per sequence) instead of the profile's fill of what the ~98 GB of weights leave
        llm = LLM(str(model_dir), load_format="dummy", dtype="bfloat16", max_num_seqs=1,
                  max_num_batched_tokens=max(len(prompt), 256), max_model_len=max_len, num_kv_blocks=64,
                  progress=False)
        runner = llm.engine.core.executor.runner
        assert "triton_kda" in {b.name for b in runner.backends}
        weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        print(f"{'fused' if fused else 'unfused'} engine: weights {weights / 2**30:.1f} GiB", flush=True)
        pn = SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True)
        p1 = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        llm.generate([prompt], pn, use_tqdm=False)  # warm-up
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            llm.generate([prompt], p1, use_tqdm=False)
            ttft = time.perf_counter() - t
            t = time.perf_counter()
            llm.generate([prompt], pn, use_tqdm=False)
            best = min(best, (time.perf_counter() - t - ttft) / (n_out - 1))
        graphs, runner.graphs = runner.graphs, None  # eager steps for the kernel count: 2 tokens less 1 token
        counts = [cuda_kernels(lambda m=m, gen=llm.generate: gen(
            [prompt], SamplingParams(temperature=0, max_tokens=m, ignore_eos=True), use_tqdm=False)) for m in (1, 2)]
        runner.graphs = graphs
        del runner, graphs
        llm.shutdown()
    finally:
        TritonKDAImpl.forward_decode = saved
    return {"ms_per_token": best * 1e3, "decode_step_kernels": counts[1] - counts[0], "weight_bytes": weights}


def model_section(n_out: int, layer: dict[int, dict] | None) -> dict:
    """`layer`: section 1's results (None when skipped: no KDA-share columns)."""
    d = write_shape("kimi-linear-48b")
    prompt = list(range(1000, 1000 + PROMPT_LEN))
    gpu_in_use("before the model section")
    res = {"unfused": model_run(d, False, prompt, n_out)}
    free = gpu_in_use("after the unfused engine")  # its frame and every reference to it gone
    if free < 1.05 * res["unfused"]["weight_bytes"]:  # a clear stop instead of running out mid-load
        raise RuntimeError(f"the unfused engine left memory behind: {free / 2**30:.1f} GiB free, the weights alone "
                           f"take {res['unfused']['weight_bytes'] / 2**30:.1f} GiB")
    res["fused"] = model_run(d, True, prompt, n_out)
    gpu_in_use("after the fused engine")
    print(f"\n### Kimi-Linear-48B-A3B shape, batch 1, random weights, {PROMPT_LEN}-token prompt, {n_out} tokens, "
          "CUDA graphs\n")
    if layer is None:
        print("| path | ms / token | kernels in one eager decode step |\n|---|---|---|")
        for name, r in res.items():
            print(f"| {name} | {r['ms_per_token']:.2f} | {r['decode_step_kernels']} |")
    else:
        print("| path | ms / token | kernels in one eager decode step | 20 KDA layers (section 1, us) | KDA share of "
              "the step |")
        print("|---|---|---|---|---|")
        for name, r in res.items():
            kda_us = NUM_KDA_LAYERS * layer[1][f"{name}_us"]
            print(f"| {name} | {r['ms_per_token']:.2f} | {r['decode_step_kernels']} | {kda_us:.0f} | "
                  f"{kda_us / (r['ms_per_token'] * 1e3):.0%} |")
    saved = res["unfused"]["ms_per_token"] - res["fused"]["ms_per_token"]
    predicted = "" if layer is None else (
        f"; section 1 predicts {NUM_KDA_LAYERS * (layer[1]['unfused_us'] - layer[1]['fused_us']) / 1e3:.3f} ms")
    print(f"\nfused saves {saved:.3f} ms/token end to end{predicted}")
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    skip = ap.add_mutually_exclusive_group()
    skip.add_argument("--skip-model", action="store_true", help="only the per-layer kernel section")
    skip.add_argument("--skip-layer", action="store_true", help="only the whole-model section")
    ap.add_argument("--output-len", type=int, default=128)
    args = ap.parse_args()
    if args.output_len < 2:
        ap.error("--output-len must be at least 2 (ms per token is measured past the first)")
    layer = None if args.skip_layer else layer_section([1, 16, 64, 256])  # its tensors are freed on return
    if not args.skip_model:
        model_section(args.output_len, layer)


if __name__ == "__main__":
    main()
