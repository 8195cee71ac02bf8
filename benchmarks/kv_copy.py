"""The host KV tier's copies on their own (issue 53): N scattered blocks of a model's KV between the device cache
and pinned host slots, both ways, by the Triton row copy (kestrel/kernels/triton_ops/kv_rows.py, the default) and
by one cudaMemcpyAsync per run of consecutive rows (kv_host_tier.copy_runs, what it did before), beside one contiguous copy of the same
bytes (the link's ceiling). GPU ms from events, host ms of the call (what the engine's loop pays), GB/s.

    python -m benchmarks.kv_copy [--shapes qwen3-0.6b,llama-8b] [--blocks 384] [--json out.json]
    python -m benchmarks.kv_copy --sweep     # the kernel's words a program x warps, both ways (tuning)"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchmarks.common import SHAPES, print_table
from kestrel.worker.kv_host_tier import copy_rows, copy_runs

BLOCK_TOKENS = 16


def row_bytes(shape: str) -> tuple[int, int]:
    """(layers, bytes of one block in one layer: K and V, bf16)."""
    c = SHAPES[shape]
    head = c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
    return c["num_hidden_layers"], BLOCK_TOKENS * c["num_key_value_heads"] * head * 2 * 2


def timed(fn, reps: int) -> tuple[float, float]:
    """(median GPU ms, median host ms of the call)."""
    gpu, host = [], []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end))
    return statistics.median(gpu[1:]), statistics.median(host[1:])


def measure(shape: str, blocks: int, reps: int) -> list[dict]:
    layers, row = row_bytes(shape)
    device_blocks, host_slots = 4 * blocks, 8 * blocks
    dev = [torch.randint(0, 255, (device_blocks, row), dtype=torch.uint8, device="cuda") for _ in range(layers)]
    host = [torch.zeros((host_slots, row), dtype=torch.uint8, pin_memory=True) for _ in range(layers)]
    g = torch.Generator().manual_seed(0)
    dev_ids = torch.randperm(device_blocks, generator=g)[:blocks]
    slot_ids = torch.randperm(host_slots, generator=g)[:blocks]
    nbytes = layers * blocks * row
    flat_dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    flat_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    rows = []
    for direction, args in (("save D2H", (host, slot_ids, dev, dev_ids)), ("load H2D", (dev, dev_ids, host, slot_ids))):
        for method, copy in (("kernel", copy_rows), ("runs", copy_runs)):
            gpu, host_ms = timed(lambda: copy(*args), reps)
            rows.append(dict(shape=shape, direction=direction, method=method, blocks=blocks, MB=nbytes / 1e6,
                             gpu_ms=gpu, host_ms=host_ms, GB_s=nbytes / gpu / 1e6))
        dst, src = (flat_host, flat_dev) if direction.startswith("save") else (flat_dev, flat_host)
        gpu, host_ms = timed(lambda: dst.copy_(src, non_blocking=True), reps)
        rows.append(dict(shape=shape, direction=direction, method="one contiguous copy", blocks=blocks,
                         MB=nbytes / 1e6, gpu_ms=gpu, host_ms=host_ms, GB_s=nbytes / gpu / 1e6))
    # the kernel's copies are right
    copy_rows(host, slot_ids, dev, dev_ids)
    torch.cuda.synchronize()
    assert all(torch.equal(h[slot_ids], d[dev_ids].cpu()) for h, d in zip(host, dev)), "kernel copy wrong"
    return rows


def sweep(shape: str, blocks: int, reps: int) -> list[dict]:
    """The row copy at each program size and warp count (the default is BLOCK words, 4 warps)."""
    from kestrel.kernels.triton_ops.kv_rows import copy_rows_triton
    layers, row = row_bytes(shape)
    dev = [torch.randint(0, 255, (4 * blocks, row), dtype=torch.uint8, device="cuda") for _ in range(layers)]
    host = [torch.zeros((8 * blocks, row), dtype=torch.uint8, pin_memory=True) for _ in range(layers)]
    g = torch.Generator().manual_seed(0)
    dev_ids = torch.randperm(4 * blocks, generator=g)[:blocks].cuda()
    slot_ids = torch.randperm(8 * blocks, generator=g)[:blocks].cuda()
    nbytes = layers * blocks * row
    rows = []
    for direction, args in (("save D2H", (host, slot_ids, dev, dev_ids)), ("load H2D", (dev, dev_ids, host, slot_ids))):
        for block in (1024, 2048, 4096, 8192):
            for warps in (2, 4, 8, 16):
                gpu, _ = timed(lambda: copy_rows_triton(*args, block=block, num_warps=warps), reps)
                rows.append(dict(shape=shape, direction=direction, words=block, warps=warps, gpu_ms=gpu,
                                 GB_s=nbytes / gpu / 1e6))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qwen3-0.6b,llama-8b")
    p.add_argument("--blocks", type=int, default=384, help="blocks copied (384: a 6k-token prefix)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--sweep", action="store_true", help="the kernel's program size x warps instead")
    p.add_argument("--json")
    a = p.parse_args()
    run = sweep if a.sweep else measure
    rows = [r for s in a.shapes.split(",") for r in run(s, a.blocks, a.reps)]
    print_table(f"KV tier copies, {torch.cuda.get_device_name()}", rows, digits=2)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
