"""Start-up work of the model parts after the KV cache exists: the persistent input buffers, the kernel warm-up
(the variants mixed steps use), the add-ons' warm-up (an image model's encoder), the decode, verify, prefill and
draft CUDA graphs, FP8 scale calibration armed for the first real batch; and the parallel Triton precompile that
runs the same forwards once, before, with launches turned into compilations. Every stage takes the build's frozen
parts (kestrel/worker/build.py RunnerParts), never the parts, and returns what it made."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kestrel.attention import kv_quant
from kestrel.core.kv_spec import cdiv
from kestrel.worker.cuda_graphs import DecodeGraphForms, DecodeGraphs, decode_graphs, default_graph_sizes
from kestrel.worker.memory_profile import dummy_prefill_batch, profile_forward
from kestrel.worker.prefill_graphs import PrefillGraphs, capture_prefill_graphs, prefill_graph_sizes


@dataclass
class Started:
    """What start-up made after the build's parts: the KV cache, the persistent buffers and the graph sets."""
    num_blocks: int = 0
    kv_caches: list = field(default_factory=list)
    buffers: object = None  # InputBuffers
    graphs: object = None  # the decode graphs (or None)
    graph_sets: list = field(default_factory=list)  # every GraphSet that serves steps, in the order tried
    graph_capture_seconds: float = 0.0


def set_up_after_kv(parts) -> Started:
    """Persistent buffers, the kernel warm-up, then (where on) the decode CUDA graphs and the graph sets built on
    them: the add-ons' (verify steps; a drafter's chain), then the one-request prefill graphs."""
    parts = parts.with_buffers(parts.new_buffers())
    decode = capture_graphs(parts)
    sets = [decode] if decode is not None else []
    for graph_sets in parts.hooks["graph_sets"]:
        sets += graph_sets(parts, decode)
    prefill = capture_prefill_graphs(parts, decode)
    sets += [prefill] if prefill is not None else []
    if parts.config.cache.calculate_kv_scales:  # from the first real batch (the warm-ups above write no K/V)
        for g in parts.kv_cache_groups:
            for name in g.layer_names if kv_quant.is_fp8(g.spec.dtype) else ():
                parts.loaded.context.attention_layers[name].calibrate_kv_scales = True
    seconds = sum(getattr(g, "capture_seconds", 0.0) for g in sets)
    return Started(buffers=parts.buffers, graphs=decode, graph_sets=sets, graph_capture_seconds=seconds)


def graph_sizes(parts) -> list[int]:
    """Decode batch sizes to capture; empty where graphs are off (CPU, --enforce-eager, a backend or an add-on
    without them, e.g. LoRA's PyTorch reference)."""
    comp, sc = parts.config.compilation, parts.config.scheduler
    if parts.device.type != "cuda" or comp.enforce_eager or not all(b.supports_cuda_graphs for b in parts.backends):
        return []
    if not all(a.supports_graphs() for a in parts.addons):
        return []
    return [s for s in (comp.cuda_graph_sizes or default_graph_sizes(sc.max_num_seqs)) if s <= sc.max_num_seqs]


def capture_graphs(parts) -> DecodeGraphs | DecodeGraphForms | None:
    """Warm the kernels up (CUDA), then capture the decode graphs where they are on."""
    if parts.device.type == "cuda":
        warm_up_kernels(parts)
    sizes = graph_sizes(parts)
    if not sizes:
        return None
    graphs = decode_graphs(parts, sizes)
    graphs.capture()
    return graphs


def precompile_kernels(parts) -> None:
    """Compile, in parallel, every Triton variant that the profile run, the kernel warm-up and the graph capture
    will launch: the same forwards run once with launches turned into compilations (see
    kestrel/kernels/triton_ops/precompile.py). Decode forwards read only the layout of the KV cache, so the
    profile batch's small cache serves them. CUDA only; --no-precompile skips it."""
    if parts.device.type != "cuda" or not parts.config.compilation.precompile:
        return
    try:
        from kestrel.kernels.triton_ops.precompile import precompile
    except ImportError:  # no triton: nothing to compile
        return

    def dry_run():
        ids, positions, ctx = dummy_prefill_batch(parts, parts.config.scheduler.max_num_batched_tokens)
        profile_forward(parts, ids, positions, ctx)
        staged = parts.with_buffers(parts.new_buffers())
        warm_up_kernels(staged)
        graphs = decode_graphs(staged, graph_sizes(staged))
        for b in graphs.sizes:
            graphs.run(b)
        prefill = PrefillGraphs(staged, prefill_graph_sizes(staged) if graphs.sizes else [])
        for q in prefill.sizes:
            prefill._prepare_capture(q)
            prefill.run(q)

    try:
        precompile(dry_run)
    finally:
        parts.free_kv_cache()
        torch.cuda.empty_cache()


@torch.inference_mode()
def warm_up_kernels(parts) -> None:
    """Compile, at start-up, the kernel variants that mixed prefill/decode steps use (short and long query tiles,
    decode rows by batch size), so that the first requests do not wait ~1 s per Triton compilation. The batches
    read block 0 and write nothing (slots -1)."""
    buf = parts.buffers
    for q_len in (min(24, buf.max_tokens // 2), 4):  # two prefills each
        hidden = _forward(parts, 2, q_len)
        parts.model.compute_logits(hidden[[q_len - 1, 2 * q_len - 1]])
    # Decode rows outside the graphs (mixed steps): one-token contexts, so the unsplit variants of each batch size
    # class's decode kernel (the graphs compile the split ones); else each compiles in the first mixed steps of a
    # run, ~1 s apiece.
    for b in sorted({min(x, buf.max_reqs) for x in (1, 2, 4, 8, 16, 32, 64, 128, 256, buf.max_reqs)}):
        _forward(parts, b, 1, decodes=True)
    for addon in parts.addons:
        addon.warm_up()
    torch.cuda.synchronize()


def _forward(parts, num_reqs: int, q_len: int, decodes: bool = False) -> torch.Tensor:
    """A forward of num_reqs requests of q_len new tokens each, their whole contexts (decodes: one token each,
    sent as decode rows)."""
    buf = parts.buffers
    n = num_reqs * q_len
    width = cdiv(q_len, parts.block_size)
    qsl = list(range(0, n + 1, q_len))
    buf.qsl_np[:num_reqs + 1] = qsl
    buf.sl_np[:num_reqs] = q_len
    buf.ids_np[:n] = 0
    buf.pos_np[:n] = np.tile(np.arange(q_len), num_reqs)
    buf.index_positions(n)
    buf.staged_slots(n)[:] = -1
    buf.staged_block_tables(num_reqs, width)[:] = 0
    buf.copy_to_device(n, num_reqs, width)
    ctx = parts.metadata(n, num_reqs, num_reqs if decodes else 0, q_len, q_len, width, qsl, [q_len] * num_reqs)
    return parts.model(buf.input_ids[:n], buf.positions[..., :n], ctx)
