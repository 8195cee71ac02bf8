"""Runs one scheduled step on the model. It keeps its own batch state from the scheduler's per-step deltas
(kestrel/core/step.py), lays the batch into persistent input buffers, asks each KV-cache group's backend to build
that group's attention metadata, runs the forward (or replays a CUDA graph) and samples. Per-request features
(LoRA, images, a bidirectional prefix, grammar bitmasks) are add-ons (kestrel/worker/addons/): the runner calls
their hooks and knows none by name."""
from __future__ import annotations

import logging

import numpy as np
import torch

from kestrel.attention.backend import CommonAttentionMetadata
from kestrel.attention.layer import ForwardContext
from kestrel.config import EngineConfig
from kestrel.core.device import pick_device, to_device
from kestrel.core.kv_spec import cdiv
from kestrel.core.pooling import pooling_task
from kestrel.core.step import RunnerOutput, ScheduledChunk, StepInput
from kestrel.loader import LoadedModel, load_model
from kestrel.spec_decode.config import SpeculativeConfig, model_refusals, refuse
from kestrel.spec_decode.verify import logits_positions
from kestrel.structured_output.bitmask import StepBitmask
from kestrel.worker import kv_allocation, memory_profile
from kestrel.worker.addons import HOOKS, build_addons, lora_manager, overriding
from kestrel.worker.addons.pooling import POOLED_TOKEN
from kestrel.worker.attention_binding import bind_attention
from kestrel.worker.input_batch import BlockTableRows, InputBuffers, RequestState
from kestrel.worker.step_outputs import InFlight, StepOutputs
from kestrel.worker.warm_up import precompile_kernels, set_up_after_kv
from kestrel.worker.drafters import build_drafter
from kestrel.core.progress import count_forwards

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, progress: bool = True, parallel=None):
        """`parallel` (kestrel.distributed.ParallelInfo): this tensor-parallel rank's place; None: one process."""
        self.config = config
        self.device = pick_device(config.model.device)
        if self.device.type == "cuda":
            try:
                from kestrel.kernels.triton_ops.pdl import configure_pdl
                configure_pdl(config.compilation.pdl)
            except ImportError:  # no triton: no Triton kernels to launch
                pass
        torch.manual_seed(config.model.seed)
        self.loaded: LoadedModel = load_model(config.model, self.device, config.kernel, progress, parallel)
        self.model = self.loaded.model
        self.model_config = self.loaded.config
        self.hf_config = self.model_config.text  # the decoder's HF config
        self.dtype = self.loaded.dtype
        self.block_size = config.cache.block_size
        self.max_model_len = self.model_config.max_model_len
        m = config.model
        self.pooling_task = pooling_task(self.model_config.architecture, m.runner, m.convert)
        self.addons = build_addons(self.model, config, self.device, self.dtype, self.pooling_task,
                                   self.model_config.pooling_method)
        self.spec = spec = SpeculativeConfig.from_dict(config.scheduler.speculative_config)
        # the draft model (speculative_config method "mtp" or "eagle3"), fed the target's hidden states; built
        # before the binding, so that an EAGLE-3 draft's attention layer joins the target's KV group
        self.drafter = build_drafter(spec, self.model, self.hf_config, self.loaded.context, self.loaded.path,
                                     self.device, self.dtype, self.max_step_tokens)
        # the attention layers grouped by cache spec, a backend and a metadata builder per group
        self.kv_cache_groups, self.backends, self.builders = bind_attention(self.loaded.context, config, self.addons,
                                                                            self.dtype, self.device)
        if spec is not None:
            refuse(model_refusals(self.model, self.kv_cache_groups))
        if self.device.type == "cpu":  # a long CPU step reads as work in progress to the hang watchdog
            count_forwards(self.model)
        self._hooks = {h: overriding(self.addons, h) for h in HOOKS}
        # the LoRAManager (None without --enable-lora): adapter add/remove/list reach it through the runner
        self.lora = lora_manager(self.addons)
        self.requests: dict[str, RequestState] = {}
        self.block_rows = BlockTableRows(len(self.kv_cache_groups), cdiv(self.max_model_len, self.block_size),
                                         config.scheduler.max_num_seqs)
        if self.drafter is not None:
            self.drafter.bind(self.builders, self.block_rows)
        # a verify step (speculative decoding) samples 1 + k rows per request
        k = spec.num_speculative_tokens if spec is not None else 0
        self.max_sample_rows = config.scheduler.max_num_seqs * (1 + k)
        self.outputs = StepOutputs(config.model.seed, self.max_sample_rows, self.device, self._hooks["before_sample"])
        self.graphs = None
        self.verify_graphs = None  # speculative decoding's verify steps (kestrel/worker/verify_graphs.py)
        self.prefill_graphs = None  # one request's small prefill step (kestrel/worker/prefill_graphs.py)
        self.graph_capture_seconds = 0.0
        self._copy_done = None
        self._num_fills = 0
        self.buffers = None

    @property
    def backend(self):
        """The first group's backend (the only one for single-kind models)."""
        return self.backends[0]

    # ---- KV cache
    @property
    def bytes_per_block(self) -> int:
        """One block id holds a row in each cache slot (kestrel/worker/kv_allocation.py)."""
        return kv_allocation.bytes_per_block(self.kv_cache_groups)

    def determine_num_blocks(self) -> int:
        """The blocks the KV cache gets (kestrel/worker/memory_profile.py)."""
        return memory_profile.determine_num_blocks(self)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = kv_allocation.allocate_kv_cache(self.kv_cache_groups, self.loaded.context.attention_layers,
                                                         num_blocks, self.device)
        self.num_blocks = num_blocks

    def free_kv_cache(self) -> None:
        for layer in self.loaded.context.attention_layers.values():
            layer.kv_cache = None
        self.kv_caches = []

    # ---- metadata
    def metadata(self, num_tokens: int, num_reqs: int, num_decodes: int, max_query_len: int, max_seq_len: int,
                 width: int, qsl_cpu=None, sl_cpu=None, capture: bool = False, **fields) -> ForwardContext:
        """Every group's attention metadata over the buffers' first rows, from its backend's builder. `fields`:
        the add-ons' extra common fields (attention_fields)."""
        buf = self.buffers
        common = CommonAttentionMetadata(num_tokens, num_reqs, num_decodes, max_query_len, max_seq_len,
                                         buf.query_start_loc[:num_reqs + 1], buf.seq_lens[:num_reqs], qsl_cpu, sl_cpu,
                                         **fields)
        metas = []
        for g, builder in enumerate(self.builders):
            build = builder.build_for_capture if capture else builder.build
            metas.append(build(common, buf.block_tables[g, :num_reqs, :width], buf.slot_mapping[g, :num_tokens]))
        return ForwardContext(metas)

    @property
    def max_step_tokens(self) -> int:
        """The most tokens of one step's forward (the persistent buffers' size)."""
        sc = self.config.scheduler
        return max(sc.max_num_batched_tokens, sc.max_num_seqs)

    def _new_buffers(self, max_tokens: int | None = None, max_reqs: int = 0) -> InputBuffers:
        sc = self.config.scheduler
        return InputBuffers(max_tokens or self.max_step_tokens, max(max_reqs, sc.max_num_seqs),
                            cdiv(self.max_model_len, self.block_size), self.device, self.block_size,
                            len(self.kv_cache_groups))

    # ---- start-up after the KV cache (kestrel/worker/warm_up.py)
    def setup_after_kv(self) -> None:
        """Persistent buffers, the kernel warm-up, then (where on) the CUDA graphs."""
        set_up_after_kv(self)

    def precompile_kernels(self) -> None:
        """Parallel Triton compilation of what start-up will launch (CUDA; --no-precompile skips it)."""
        precompile_kernels(self)

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
        if self.drafter is not None:
            self.drafter.forget(st.request_id)
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
        if self.drafter is not None:  # its capture's buffer was filled by the forward or the graph replay
            inf.target_hidden = (self.drafter.capture.rows(meta.num_tokens), list(qsl), chunks)
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
        hidden = self.model(self.buffers.input_ids[:meta.num_tokens], self.buffers.positions[:meta.num_tokens],
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
        """The logits of a step that a CUDA graph serves (every row a decode: a decode graph; every row verifying
        k drafts: a verify graph; one prefill chunk alone: a prefill graph, logits at its last token), else None."""
        padded = (self.graphs.padded_size(meta.num_reqs) if self.graphs and meta.num_decodes == meta.num_reqs
                  else None)
        if padded is not None:
            return self.graphs.replay(meta.num_reqs, padded)  # every decode row samples
        vg = self.verify_graphs.select(chunks) if self.verify_graphs else None
        verify_padded = vg.padded_size(meta.num_reqs) if vg is not None else None
        if verify_padded is not None:  # every row verifies k drafts: its logits at all tokens, then the rows
            return vg.replay(meta.num_reqs, verify_padded)[
                to_device(logits_positions(chunks, meta.query_start_loc_cpu), torch.int64, self.device)]
        pg = self.prefill_graphs
        bucket = pg.padded_size(meta.num_tokens) if pg is not None and pg.fits(chunks, states, meta) else None
        return pg.replay(meta.num_tokens, bucket) if bucket is not None else None

    def sample(self, inf: InFlight, bitmask: StepBitmask | None = None) -> None:
        """Queue the sampling of a launched step. `bitmask` (the host masks of the constrained rows, by their
        row in inf.rows order) masks the logits on the device first (the grammar add-on)."""
        self.outputs.sample(inf, bitmask)

    def collect(self, inf: InFlight) -> RunnerOutput:
        """Wait for a launched step's sampled tokens (and record them in the batch state)."""
        out = self.outputs.collect(inf, self.requests)
        if self.drafter is not None:
            self.drafter.after_step(inf, out, self.requests)
        return out
