"""Runs one scheduled step on the model. It keeps its own batch state from the scheduler's per-step deltas
(kestrel/core/step.py), lays the batch into persistent input buffers, asks each KV-cache group's backend to build
that group's attention metadata, runs the forward (or replays a CUDA graph) and samples. Per-request features
(LoRA, images, a bidirectional prefix, grammar bitmasks) are add-ons (kestrel/worker/addons/): the runner calls
their hooks and knows none by name; a feature package above the worker adds its own (speculative decoding's verify
steps and drafter, kestrel/spec_decode/runner_addon.py, given by kestrel/executor/runner_build.py). The runner is
built from frozen parts in an explicit order (kestrel/worker/build.py)."""
from __future__ import annotations

import logging

import numpy as np
import torch

from kestrel.attention.layer import ForwardContext
from kestrel.core.device import to_device
from kestrel.core.progress import count_forwards
from kestrel.core.step import RunnerOutput, ScheduledChunk, StepInput, logits_positions
from kestrel.structured_output.bitmask import StepBitmask
from kestrel.worker import kv_allocation, memory_profile
from kestrel.worker.kv_host_tier import build_connector_worker, readers_of
from kestrel.worker.addons import StepAddon, lora_manager
from kestrel.worker.addons.pooling import POOLED_TOKEN
from kestrel.worker.attention_binding import step_metadata
from kestrel.worker.build import RunnerParts
from kestrel.worker.input_batch import InputBuffers, RequestState
from kestrel.worker.step_outputs import InFlight, StepOutputs
from kestrel.worker.warm_up import Started, precompile_kernels, set_up_after_kv

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, parts: RunnerParts):
        """Built from the build's parts (kestrel/worker/build.py build_parts); start-up (build.start_up, or the
        executor's stage calls below) gives it the KV cache, the buffers and the graph sets."""
        self.parts = parts
        self.config, self.device, self.loaded = parts.config, parts.device, parts.loaded
        self.model = self.loaded.model
        self.model_config = self.loaded.config
        self.hf_config = self.model_config.text  # the decoder's HF config
        self.dtype = self.loaded.dtype
        self.block_size, self.max_model_len = parts.block_size, parts.max_model_len
        self.pooling_task = parts.pooling_task
        self.addons = list(parts.addons)
        self.kv_cache_groups, self.backends, self.builders = parts.kv_cache_groups, parts.backends, parts.builders
        self._hooks = self.hooks = parts.hooks  # hook name -> the overriding add-ons' methods (the parts' dict)
        if self.device.type == "cpu":  # a long CPU step reads as work in progress to the hang watchdog
            count_forwards(self.model)
        # the LoRAManager (None without --enable-lora): adapter add/remove/list reach it through the runner
        self.lora = lora_manager(self.addons)
        self.requests: dict[str, RequestState] = {}
        self.block_rows = parts.block_rows
        self.max_sample_rows = parts.max_sample_rows
        self.outputs = StepOutputs(self.config.model.seed, self.max_sample_rows, self.device,
                                   self._hooks["before_sample"])
        self.graphs = None  # the decode graphs (kestrel/worker/cuda_graphs.py)
        self.graph_sets: list = []  # the graph sets that serve steps, tried in order (decode first; GraphSet)
        self.graph_capture_seconds = 0.0
        self._copy_done = None
        self._num_fills = 0
        self.buffers = None
        self.kv_caches, self.num_blocks = [], 0
        self.kv_connector = None  # a KV tier's worker side (kestrel/core/kv_connector.py), over kv_caches

    def __getattr__(self, name: str):
        """An add-on by its name (runner.<name>, e.g. runner.drafter; None where no such add-on was built)."""
        if name.startswith("_") or "addons" not in self.__dict__:
            raise AttributeError(name)
        found = next((a for a in self.__dict__["addons"] if a.name == name), None)
        if found is None and name not in StepAddon.names:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return found

    def _bind_kv_connector(self) -> None:
        """A KV tier's worker side (--kv-offloading-size), beside the KV cache just allocated."""
        self.kv_connector = build_connector_worker(self.config, self.kv_cache_groups, self.kv_caches, self.num_blocks)

    @property
    def backend(self):
        """The first group's backend (the only one for single-kind models)."""
        return self.backends[0]

    @property
    def max_step_tokens(self) -> int:
        return self.parts.max_step_tokens

    @property
    def bytes_per_block(self) -> int:
        return self.parts.bytes_per_block

    def metadata(self, *args, **kw) -> ForwardContext:
        """Every group's attention metadata over the buffers' first rows (attention_binding.step_metadata)."""
        return step_metadata(self.builders, self.buffers, *args, **kw)

    def new_buffers(self, max_tokens: int | None = None, max_reqs: int = 0) -> InputBuffers:
        return self.parts.new_buffers(max_tokens, max_reqs)

    # ---- start-up stages, one by one (kestrel/worker/build.py start_up runs them in order in every executor;
    # these serve tests that look between the stages)
    def precompile_kernels(self) -> None:
        """Parallel Triton compilation of what start-up will launch (CUDA; --no-precompile skips it)."""
        precompile_kernels(self.parts)

    def determine_num_blocks(self) -> int:
        """The blocks the KV cache gets (kestrel/worker/memory_profile.py)."""
        return memory_profile.determine_num_blocks(self.parts)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches, self.num_blocks = self.parts.allocate_kv_cache(num_blocks), num_blocks
        self._bind_kv_connector()

    def free_kv_cache(self) -> None:
        self.parts.free_kv_cache()
        self.kv_caches = []
        self.kv_connector = None

    def setup_after_kv(self) -> None:
        """Persistent buffers, the kernel warm-up, then (where on) the CUDA graphs."""
        self.adopt(set_up_after_kv(self.parts))

    def adopt(self, started: Started) -> None:
        """Take what start-up made."""
        if started.num_blocks:
            self.kv_caches, self.num_blocks = started.kv_caches, started.num_blocks
            self._bind_kv_connector()
        self.buffers, self.graphs, self.graph_sets = started.buffers, started.graphs, started.graph_sets
        self.graph_capture_seconds = started.graph_capture_seconds

    # ---- batch state from the scheduler's deltas
    def _update_states(self, step: StepInput) -> None:
        for rid in step.finished_ids:
            st = self.requests.pop(rid, None)
            if st is not None:
                self._forget(st)
            self.outputs.prompt_logprobs_done.pop(rid, None)
        for r in step.new_requests:
            old = self.requests.get(r.request_id)
            if old is not None:
                self._forget(old)
            self.requests[r.request_id] = st = RequestState.from_new(r, self.block_rows.add(r.block_ids))
            for add in self._hooks["add_request"]:
                add(st)
        for c in step.chunks:
            if c.new_block_ids:
                self.block_rows.append(self.requests[c.request_id].table_row, c.new_block_ids)

    def _forget(self, st: RequestState) -> None:
        self.block_rows.free(st.table_row)
        for remove in self._hooks["remove_request"]:
            remove(st)

    # ---- one step
    def _prepare(self, chunks: list[ScheduledChunk], states: list[RequestState],
                 prev: InFlight | None) -> ForwardContext:
        """Flatten the batch into the persistent buffers (numpy on the host, one copy each to the device)."""
        buf = self.buffers
        if self._copy_done is not None:
            self._copy_done.synchronize()  # the last step's host->device copies have left the staging buffers
        n_tok = sum(c.num_new_tokens for c in chunks)
        if n_tok > buf.max_tokens or len(chunks) > buf.max_reqs:
            raise RuntimeError(f"batch of {n_tok} tokens / {len(chunks)} requests exceeds the runner's buffers")
        nr = len(chunks)
        req_rows = np.fromiter((st.table_row for st in states), dtype=np.intp, count=nr)
        width = max(1, int(self.block_rows.lens[req_rows].max()))
        t, num_decodes, self._num_fills = buf.stage_tokens(chunks, states, prev.rows if prev is not None else None)
        qsl, sl, pos = buf.qsl_np, buf.sl_np, buf.pos_np
        tables = buf.stage_block_tables(self.block_rows, req_rows, width)
        buf.stage_slots(tables, qsl[:nr + 1], pos[:t])
        for prepare in self._hooks["prepare"]:
            prepare(chunks, states)
        buf.copy_to_device(t, nr, width)
        if self._num_fills:
            buf.copy_fills(self._num_fills)
        if self.device.type == "cuda":
            self._copy_done = torch.cuda.Event()
            self._copy_done.record()
        fields = {}
        for attention_fields in self._hooks["attention_fields"]:
            fields.update(attention_fields(chunks, states))
        return self.metadata(t, nr, num_decodes, max(c.num_new_tokens for c in chunks), int(sl[:nr].max()), width,
                             qsl[:nr + 1].tolist(), sl[:nr].tolist(), **fields)

    @torch.inference_mode()
    def launch(self, step: StepInput, prev: InFlight | None = None, sample: bool = True,
               before_forward=None) -> InFlight:
        """Queue a step on the device and return without waiting for it. Decode rows whose input token is a
        placeholder take it from `prev`'s sampled tokens, on the device (pipelined decode). With sample=False
        only the forward (to the logits) is queued: the caller fills a token bitmask on the host meanwhile, then
        calls sample() (structured outputs). `before_forward()` runs once the inputs are staged, before anything
        reads `prev`'s tokens: where `prev` still waits for its bitmask, the caller samples it there."""
        inf = InFlight(RunnerOutput())
        self._update_states(step)
        if self.kv_connector is not None:  # a KV tier's saves (blocks evicted this step), then its loads
            failures = self.kv_connector.start_load_kv(step.kv_connector_meta, step)
            if failures:  # the engine drops them and recomputes the requests that read them
                failures.requests = readers_of(failures, step, self.requests, self.block_rows)
                inf.out.kv_failures = failures
        if step.is_empty:
            return inf
        chunks = step.chunks  # decode rows first (the scheduler's order: StepInput.chunks)
        states = [self.requests[c.request_id] for c in chunks]
        ctx = self._prepare(chunks, states, prev)
        layers = self.loaded.context.attention_layers
        if step.state_restores:  # prefix hits start from a snapshot of their state
            kv_allocation.copy_state_slots(self.kv_cache_groups, layers, step.state_restores)
        for failed in self._hooks["failed_requests"]:
            inf.out.failed.update(failed(chunks, states))
        if before_forward is not None:
            before_forward()
        if self._num_fills:
            k, buf = self._num_fills, self.buffers
            buf.input_ids.index_copy_(0, buf.fill_dst[:k], prev.tokens[buf.fill_src[:k]].to(torch.int64))
        logits, hidden = self._forward(chunks, states, ctx, inf.out)
        samplers = [(c, st) for c, st in zip(chunks, states) if c.samples and c.request_id not in inf.out.pooled]
        meta = ctx.attn_metadata[0]
        qsl = meta.query_start_loc_cpu
        for after in self._hooks["after_forward"]:
            after(inf, meta, chunks)
        if step.state_saves:  # states at block boundaries, from the slots the forward (or graph) just wrote
            kv_allocation.copy_state_slots(self.kv_cache_groups, layers, step.state_saves)
        if samplers:
            inf.rows = {c.request_id: i for i, (c, _) in enumerate(samplers)}
            inf.drafts = {c.request_id: c.draft_token_ids for c, _ in samplers if c.draft_token_ids}
            inf.states = [st for _, st in samplers]
            inf.logits, inf.sample_pending = logits, True
        if hidden is not None:
            for b, (c, st) in enumerate(zip(chunks, states)):
                if st.sampling_params.prompt_logprobs is not None:
                    self.outputs.prompt_logprobs(self.model, c, st, hidden[qsl[b]:qsl[b + 1]], inf.out)
        if sample and inf.sample_pending:
            self.sample(inf)
        return inf

    def _forward(self, chunks: list[ScheduledChunk], states: list[RequestState], ctx: ForwardContext,
                 out: RunnerOutput) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The step's forward: a CUDA graph's replay where one serves the step, else the model run eagerly, whose
        rows that end in a pooler go to `out.pooled`. Returns (the logits at the sampling rows, None where no row
        samples; the final hidden states of an eager forward, else None)."""
        meta = ctx.attn_metadata[0]
        qsl = meta.query_start_loc_cpu
        inputs_embeds = None
        for embeds in self._hooks["inputs_embeds"]:
            embedded = embeds(chunks, states, self.buffers.input_ids[:meta.num_tokens])
            inputs_embeds = embedded if embedded is not None else inputs_embeds
        if all(ok() for ok in self._hooks["step_graph_ok"]):
            logits = self._replay_graph(chunks, states, meta)
            if logits is not None:
                return logits, None
        hidden = self.model(self.buffers.input_ids[:meta.num_tokens], self.buffers.positions[..., :meta.num_tokens],
                            ctx, inputs_embeds=inputs_embeds)
        for pool in self._hooks["pool"]:  # rows that end in a pooler, not the sampler
            out.pooled.update(pool(chunks, states, hidden, qsl))
        for rid in out.pooled:
            out.sampled[rid] = POOLED_TOKEN
        sample_idx = logits_positions(chunks, qsl, skip=out.pooled)  # empty where no row samples
        logits = (self.model.compute_logits(hidden[to_device(sample_idx, torch.int64, self.device)])
                  if sample_idx else None)
        return logits, hidden

    def _replay_graph(self, chunks: list[ScheduledChunk], states: list[RequestState], meta) -> torch.Tensor | None:
        """The logits of a step that a CUDA graph set serves (every row a decode: the decode graphs; then the
        add-ons' sets, e.g. every row verifying k drafts; one prefill chunk alone: a prefill graph), else None."""
        for graphs in self.graph_sets:
            key = graphs.step_key(chunks, states, meta)
            if key is not None:
                return graphs.step_logits(chunks, meta, key)
        return None

    def sample(self, inf: InFlight, bitmask: StepBitmask | None = None) -> None:
        """Queue the sampling of a launched step. `bitmask` (the host masks of the constrained rows, by their
        row in inf.rows order) masks the logits on the device first (the grammar add-on)."""
        self.outputs.sample(inf, bitmask)

    def collect(self, inf: InFlight) -> RunnerOutput:
        """Wait for a launched step's sampled tokens (and record them in the batch state)."""
        out = self.outputs.collect(inf, self.requests)
        for after in self._hooks["after_collect"]:
            after(inf, out, self.requests)
        return out
