"""How many KV-cache blocks a parts gets: --num-kv-blocks where set; on the CPU, --kv-cache-memory bytes; on a
GPU, what --gpu-memory-utilization leaves after the weights, the state slots and the activations of one forward
at the full token budget, profiled on a dummy prefill batch (which the precompile's dry run and tests reuse).
Each function takes the build's parts (kestrel/worker/build.py RunnerParts), never the parts."""
from __future__ import annotations

import numpy as np
import torch

from kestrel.attention.layer import ForwardContext
from kestrel.core.kv_spec import cdiv
from kestrel.errors import ConfigError
from kestrel.worker import kv_allocation
from kestrel.worker.attention_binding import step_metadata


def available_memory(device: torch.device) -> int:
    """Bytes the KV cache could still take on ``device``: the GPU's free memory; on the CPU the kernel's
    MemAvailable (free + reclaimable), else all physical memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits(parts, nbytes: int, what: str) -> None:
    """A KV cache larger than the device's memory is refused naming the flag that asked for it (before: the
    allocator's error with a traceback, or the kernel's OOM killer)."""
    free = available_memory(parts.device)
    if nbytes > free:
        raise ConfigError(f"{what} needs {nbytes / 2**30:.1f} GiB of KV cache, more than the "
                          f"{free / 2**30:.1f} GiB of {parts.device.type} memory available")


def determine_num_blocks(parts) -> int:
    cache = parts.config.cache
    # per-request state slots beside the pool (kinds with state_parts), allocated whatever the pool size
    state_bytes = kv_allocation.state_bytes(parts.kv_cache_groups)
    if cache.num_kv_blocks:
        check_fits(parts, cache.num_kv_blocks * parts.bytes_per_block + state_bytes,
                   f"--num-kv-blocks {cache.num_kv_blocks} ({parts.bytes_per_block} bytes a block)")
        return cache.num_kv_blocks
    if parts.device.type == "cuda":
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        peak = profile_peak_bytes(parts)
        budget = total * cache.gpu_memory_utilization - (total - free) - peak - state_bytes
        blocks = int(budget // parts.bytes_per_block)
        needed = cdiv(parts.max_model_len, parts.block_size)
        if blocks < needed:
            raise ConfigError(
                f"KV cache too small: {max(blocks, 0)} blocks of {parts.block_size} tokens fit in "
                f"--gpu-memory-utilization {cache.gpu_memory_utilization} of {total / 2**30:.0f} GiB "
                f"({(total - free) / 2**30:.1f} GiB already in use, {peak / 2**30:.1f} GiB activations), "
                f"one {parts.max_model_len}-token sequence needs {needed}; raise the utilization, lower "
                f"--max-model-len, or set --num-kv-blocks")
        return blocks
    check_fits(parts, max(cache.kv_cache_memory, state_bytes + parts.bytes_per_block),
               f"--kv-cache-memory {cache.kv_cache_memory}")
    return max(1, (cache.kv_cache_memory - state_bytes) // parts.bytes_per_block)


def dummy_prefill_batch(parts, n: int):
    """A prefill batch of `n` tokens in sequences no longer than the context, with real block tables over a
    freshly allocated cache (memory profiling). Returns (input_ids, positions, forward context)."""
    seq = min(n, parts.max_model_len)
    lens = [seq] * (n // seq) + ([n % seq] if n % seq else [])
    per_seq = cdiv(seq, parts.block_size)
    parts.allocate_kv_cache(per_seq * len(lens))
    buf = parts.buffers
    if buf is None or buf.max_tokens < n or buf.max_reqs < len(lens):
        buf = parts.new_buffers(max(n, parts.config.scheduler.max_num_seqs), len(lens))
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    buf.qsl_np[:len(lens) + 1] = qsl
    buf.sl_np[:len(lens)] = lens
    buf.ids_np[:n] = 0
    buf.pos_np[:n] = np.concatenate([np.arange(length) for length in lens])
    buf.index_positions(n)
    buf.staged_slots(n)[:] = -1
    buf.staged_block_tables(len(lens), per_seq)[:] = np.arange(per_seq * len(lens)).reshape(len(lens), per_seq)
    buf.copy_to_device(n, len(lens), per_seq)
    ctx = step_metadata(parts.builders, buf, n, len(lens), 0, seq, seq, per_seq, qsl.tolist(), lens)
    return buf.input_ids[:n], buf.positions[..., :n], ctx


def profile_peak_bytes(parts) -> int:
    """Activation memory of one forward at the full token budget, a draft model's after it included (GPU
    only)."""
    n = parts.config.scheduler.max_num_batched_tokens
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    ids, positions, ctx = dummy_prefill_batch(parts, n)
    kv_bytes = torch.cuda.memory_allocated() - before
    # every add-on's start-up warm-up (the image add-on encodes the model's largest image), kept alive through
    # the forward as the encoder cache keeps it, so that the profile counts its activations
    warmed = [a.warm_up() for a in parts.addons]
    profile_forward(parts, ids, positions, ctx)
    torch.cuda.synchronize()
    del warmed
    peak = torch.cuda.max_memory_allocated() - before - kv_bytes
    parts.free_kv_cache()
    torch.cuda.empty_cache()
    return int(peak * 1.1)


@torch.inference_mode()
def profile_forward(parts, ids, positions, ctx: ForwardContext) -> None:
    hidden = parts.model(ids, positions, ctx)
    parts.model.compute_logits(hidden[-min(ids.shape[0], parts.max_sample_rows):])
    for profile in parts.hooks["profile_forward"]:  # e.g. a draft model's first forward over the step's tokens
        profile(ids, positions, ctx)
