"""Start-up work of the model runner after the KV cache exists: the persistent input buffers, the kernel warm-up
(the variants mixed steps use), the add-ons' warm-up (an image model's encoder), the decode, verify, prefill and
draft CUDA graphs, FP8 scale calibration armed for the first real batch; and the parallel Triton precompile that
runs the same forwards once, before, with launches turned into compilations."""
from __future__ import annotations

import numpy as np
import torch

from kestrel.attention import kv_quant
from kestrel.core.kv_spec import cdiv
from kestrel.worker.cuda_graphs import DecodeGraphForms, DecodeGraphs, decode_graphs, default_graph_sizes
from kestrel.worker.memory_profile import dummy_prefill_batch, profile_forward
from kestrel.worker.prefill_graphs import PrefillGraphs, capture_prefill_graphs, prefill_graph_sizes


def set_up_after_kv(runner) -> None:
    """Persistent buffers, the kernel warm-up, then (where on) the decode CUDA graphs and the graph sets built on
    them: the add-ons' (verify steps; a drafter's chain), then the one-request prefill graphs."""
    runner.buffers = runner._new_buffers()
    runner.graphs = decode = capture_graphs(runner)
    sets = [decode] if decode is not None else []
    for graph_sets in runner._hooks["graph_sets"]:
        sets += graph_sets(runner, decode)
    prefill = capture_prefill_graphs(runner, decode)
    runner.graph_sets = sets + ([prefill] if prefill is not None else [])
    if runner.config.cache.calculate_kv_scales:  # from the first real batch (the warm-ups above write no K/V)
        for g in runner.kv_cache_groups:
            for name in g.layer_names if kv_quant.is_fp8(g.spec.dtype) else ():
                runner.loaded.context.attention_layers[name].calibrate_kv_scales = True


def graph_sizes(runner) -> list[int]:
    """Decode batch sizes to capture; empty where graphs are off (CPU, --enforce-eager, a backend or an add-on
    without them, e.g. LoRA's PyTorch reference)."""
    comp, sc = runner.config.compilation, runner.config.scheduler
    if runner.device.type != "cuda" or comp.enforce_eager or not all(b.supports_cuda_graphs for b in runner.backends):
        return []
    if not all(a.supports_graphs() for a in runner.addons):
        return []
    return [s for s in (comp.cuda_graph_sizes or default_graph_sizes(sc.max_num_seqs)) if s <= sc.max_num_seqs]


def capture_graphs(runner) -> DecodeGraphs | DecodeGraphForms | None:
    """Warm the kernels up (CUDA), then capture the decode graphs where they are on."""
    if runner.device.type == "cuda":
        warm_up_kernels(runner)
    sizes = graph_sizes(runner)
    if not sizes:
        return None
    graphs = decode_graphs(runner, sizes)
    runner.graph_capture_seconds = graphs.capture()
    return graphs


def precompile_kernels(runner) -> None:
    """Compile, in parallel, every Triton variant that the profile run, the kernel warm-up and the graph capture
    will launch: the same forwards run once with launches turned into compilations (see
    kestrel/kernels/triton_ops/precompile.py). Decode forwards read only the layout of the KV cache, so the
    profile batch's small cache serves them. CUDA only; --no-precompile skips it."""
    if runner.device.type != "cuda" or not runner.config.compilation.precompile:
        return
    try:
        from kestrel.kernels.triton_ops.precompile import precompile
    except ImportError:  # no triton: nothing to compile
        return

    def dry_run():
        ids, positions, ctx = dummy_prefill_batch(runner, runner.config.scheduler.max_num_batched_tokens)
        profile_forward(runner, ids, positions, ctx)
        runner.buffers = runner._new_buffers()
        warm_up_kernels(runner)
        graphs = decode_graphs(runner, graph_sizes(runner))
        for b in graphs.sizes:
            graphs.run(b)
        prefill = PrefillGraphs(runner, prefill_graph_sizes(runner) if graphs.sizes else [])
        for q in prefill.sizes:
            prefill._prepare_capture(q)
            prefill.run(q)

    try:
        precompile(dry_run)
    finally:
        runner.free_kv_cache()
        runner.buffers = None
        torch.cuda.empty_cache()


@torch.inference_mode()
def warm_up_kernels(runner) -> None:
    """Compile, at start-up, the kernel variants that mixed prefill/decode steps use (short and long query tiles,
    decode rows by batch size), so that the first requests do not wait ~1 s per Triton compilation. The batches
    read block 0 and write nothing (slots -1)."""
    buf = runner.buffers
    for q_len in (min(24, buf.max_tokens // 2), 4):  # two prefills each
        hidden = _forward(runner, 2, q_len)
        runner.model.compute_logits(hidden[[q_len - 1, 2 * q_len - 1]])
    # Decode rows outside the graphs (mixed steps): one-token contexts, so the unsplit variants of each batch size
    # class's decode kernel (the graphs compile the split ones); else each compiles in the first mixed steps of a
    # run, ~1 s apiece.
    for b in sorted({min(x, buf.max_reqs) for x in (1, 2, 4, 8, 16, 32, 64, 128, 256, buf.max_reqs)}):
        _forward(runner, b, 1, decodes=True)
    for addon in runner.addons:
        addon.warm_up()
    torch.cuda.synchronize()


def _forward(runner, num_reqs: int, q_len: int, decodes: bool = False) -> torch.Tensor:
    """A forward of num_reqs requests of q_len new tokens each, their whole contexts (decodes: one token each,
    sent as decode rows)."""
    buf = runner.buffers
    n = num_reqs * q_len
    width = cdiv(q_len, runner.block_size)
    qsl = list(range(0, n + 1, q_len))
    buf.qsl_np[:num_reqs + 1] = qsl
    buf.sl_np[:num_reqs] = q_len
    buf.ids_np[:n] = 0
    buf.pos_np[:n] = np.tile(np.arange(q_len), num_reqs)
    buf.staged_slots(n)[:] = -1
    buf.staged_block_tables(num_reqs, width)[:] = 0
    buf.copy_to_device(n, num_reqs, width)
    ctx = runner.metadata(n, num_reqs, num_reqs if decodes else 0, q_len, q_len, width, qsl, [q_len] * num_reqs)
    return runner.model(buf.input_ids[:n], buf.positions[:n], ctx)
