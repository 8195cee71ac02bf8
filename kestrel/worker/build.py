"""The runner's build (the explicit start-up order) and the frozen parts every start-up stage takes, never the
runner itself:

    build_parts: device -> load the model -> add-ons (the worker's, then the feature packages': a draft model
                 registers its attention layer here) -> bind the attention layers to KV groups, backends and
                 builders -> block-table rows -> the add-ons' bind
    start_up:    precompile (CUDA) -> profile the memory and size the KV cache (the ranks agree on one size) ->
                 allocate it -> persistent buffers, kernel warm-up, the decode graphs and the graph sets built on
                 them (kestrel/worker/warm_up.py)

The runner is built from the parts (ModelRunner(parts)) and takes what start_up made (Started). Tests use the
same seam: build_parts, then any stage on the parts."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kestrel.attention.layer import ForwardContext
from kestrel.config import EngineConfig
from kestrel.core.device import pick_device
from kestrel.core.kv_spec import cdiv
from kestrel.core.pooling import pooling_task
from kestrel.loader import LoadedModel, load_model
from kestrel.models.interfaces import position_scheme
from kestrel.worker import kv_allocation
from kestrel.worker.addons import HOOKS, build_addons, overriding
from kestrel.worker.attention_binding import bind_attention, max_step_tokens, step_metadata
from kestrel.worker.input_batch import BlockTableRows, InputBuffers
from kestrel.worker.memory_profile import determine_num_blocks
from kestrel.worker.warm_up import Started, precompile_kernels, set_up_after_kv


@dataclass(frozen=True)
class RunnerParts:
    config: EngineConfig
    device: torch.device
    loaded: LoadedModel
    addons: tuple
    hooks: dict  # hook name -> the bound methods of the add-ons that override it
    kv_cache_groups: list
    backends: list
    builders: list
    block_rows: BlockTableRows
    pooling_task: str | None = None
    buffers: InputBuffers | None = None  # the persistent input buffers (a stage that needs others makes its own)

    @property
    def model(self):
        return self.loaded.model

    @property
    def dtype(self):
        return self.loaded.dtype

    @property
    def block_size(self) -> int:
        return self.config.cache.block_size

    @property
    def max_model_len(self) -> int:
        return self.loaded.config.max_model_len

    @property
    def max_step_tokens(self) -> int:
        """The most tokens of one step's forward (the persistent buffers' size)."""
        return max_step_tokens(self.config)

    @property
    def max_sample_rows(self) -> int:
        """A verify step samples 1 + k rows per request (k proposed tokens)."""
        sc = self.config.scheduler
        return sc.max_num_seqs * (1 + sc.num_proposed_tokens)

    @property
    def bytes_per_block(self) -> int:
        """One block id holds a row in each cache slot (kestrel/worker/kv_allocation.py)."""
        return kv_allocation.bytes_per_block(self.kv_cache_groups)

    def with_buffers(self, buffers: InputBuffers | None) -> "RunnerParts":
        return replace(self, buffers=buffers)

    def new_buffers(self, max_tokens: int | None = None, max_reqs: int = 0) -> InputBuffers:
        return InputBuffers(max_tokens or self.max_step_tokens, max(max_reqs, self.config.scheduler.max_num_seqs),
                            cdiv(self.max_model_len, self.block_size), self.device, self.block_size,
                            len(self.kv_cache_groups), self.position_rows)

    @property
    def position_rows(self) -> int:
        """Rows of positions per token the model's rotary reads (its position scheme: kestrel/core/positions.py)."""
        return position_scheme(self.model, self.loaded.config.hf).rows

    def allocate_kv_cache(self, num_blocks: int) -> list:
        """Every layer's cache of `num_blocks` blocks (set on the layers); returns the caches."""
        return kv_allocation.allocate_kv_cache(self.kv_cache_groups, self.loaded.context.attention_layers, num_blocks,
                                               self.device)

    def free_kv_cache(self) -> None:
        for layer in self.loaded.context.attention_layers.values():
            layer.kv_cache = None

    def metadata(self, *args, **kw) -> ForwardContext:
        """Every group's attention metadata over the buffers' first rows (attention_binding.step_metadata)."""
        return step_metadata(self.builders, self.buffers, *args, **kw)


def build_parts(config: EngineConfig, progress: bool = True, parallel=None, feature_addons=()) -> RunnerParts:
    """`parallel` (kestrel.distributed.ParallelInfo): this tensor-parallel rank's place; None: one process.
    `feature_addons`: callables (config, loaded model, device, dtype, max_step_tokens) -> [StepAddon] of feature
    packages above the worker (kestrel/executor/runner_build.py)."""
    device = pick_device(config.model.device)
    if device.type == "cuda":
        try:
            from kestrel.kernels.triton_ops.pdl import configure_pdl
            configure_pdl(config.compilation.pdl)
        except ImportError:  # no triton: no Triton kernels to launch
            pass
    torch.manual_seed(config.model.seed)
    loaded = load_model(config.model, device, config.kernel, progress, parallel)
    m, mc = config.model, loaded.config
    task = pooling_task(mc.architecture, m.runner, m.convert)
    # built before the binding: a draft model's attention layer joins the target's KV group
    addons = build_addons(loaded.model, config, device, loaded.dtype, task, mc.pooling_method)
    for build in feature_addons:
        addons += build(config, loaded, device, loaded.dtype, max_step_tokens(config))
    # the attention layers grouped by cache spec, a backend and a metadata builder per group
    groups, backends, builders = bind_attention(loaded.context, config, addons, loaded.dtype, device)
    hooks = {h: overriding(addons, h) for h in HOOKS}
    rows = BlockTableRows(len(groups), cdiv(mc.max_model_len, config.cache.block_size), config.scheduler.max_num_seqs)
    for bind in hooks["bind"]:
        bind(loaded.model, groups, builders, rows)
    return RunnerParts(config, device, loaded, tuple(addons), hooks, groups, backends, builders, rows, task)


def start_up(parts: RunnerParts, agree=lambda num_blocks: num_blocks) -> Started:
    """The start-up after the build, in order: precompile, size the KV cache (`agree`: the block count every rank
    can hold, from this rank's), allocate it, then buffers, warm-up and graphs. Returns what it made."""
    precompile_kernels(parts)
    num_blocks = agree(determine_num_blocks(parts))
    caches = parts.allocate_kv_cache(num_blocks)
    started = set_up_after_kv(parts)
    started.num_blocks, started.kv_caches = num_blocks, caches
    return started
