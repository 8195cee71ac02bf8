"""Runs one scheduled step on the model. It keeps its own batch state from the scheduler's per-step deltas
(kestrel/core/step.py), lays the batch into persistent input buffers, asks each KV-cache group's backend to build
that group's attention metadata, runs the forward (or replays a CUDA graph) and samples. Per-request features
(LoRA, images, a bidirectional prefix, grammar bitmasks) are add-ons (kestrel/worker/addons/): the runner calls
their hooks and knows none by name."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from kestrel.attention.backend import CommonAttentionMetadata
from kestrel.attention.layer import ForwardContext
from kestrel.attention.selector import select_attention_backend
from kestrel.config import EngineConfig
from kestrel.core.kv_spec import KVCacheGroup, cdiv, group_layers
from kestrel.core.step import PLACEHOLDER, RunnerOutput, ScheduledChunk, StepInput
from kestrel.errors import ConfigError
from kestrel.loader import LoadedModel, load_model
from kestrel.models.interfaces import has_bidirectional_prefix
from kestrel.structured_output.bitmask import StepBitmask
from kestrel.worker.addons import build_addons, lora_manager, overriding
from kestrel.worker.cuda_graphs import DecodeGraphs, default_graph_sizes
from kestrel.worker.input_batch import BlockTableRows, InputBuffers, RequestState
from kestrel.core.device import to_device
from kestrel.worker.sampler import Sampler, SamplingRow, compute_logprobs

logger = logging.getLogger(__name__)


@dataclass
class InFlight:
    """A launched step: its sampled tokens on the device, and where they land on the host."""
    out: "RunnerOutput"
    samplers: list[tuple[str, int]] = field(default_factory=list)  # (request id, index in its outputs)
    tokens: torch.Tensor | None = None
    rows: dict[str, int] = field(default_factory=dict)  # request id -> row of `tokens`
    tokens_host: torch.Tensor | None = None
    event: object = None
    logits: torch.Tensor | None = None  # launched with sample=False: the logits until sample() runs
    sample_pending: bool = False
    states: list = field(default_factory=list)  # the sampling rows' RequestStates (sample() may come after a pop)
    bitmask: StepBitmask | None = None  # structured outputs: the constrained rows' token masks (sample())

    @property
    def samples(self) -> bool:
        return self.tokens is not None


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


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
        self._bind_attention()
        self.addons = build_addons(self.model, config, self.device, self.dtype)
        self._hooks = {h: overriding(self.addons, h) for h in ("add_request", "remove_request", "prepare",
                       "attention_fields", "inputs_embeds", "step_graph_ok", "before_sample")}
        # the LoRAManager (None without --enable-lora): adapter add/remove/list reach it through the runner
        self.lora = lora_manager(self.addons)
        self.requests: dict[str, RequestState] = {}
        self.block_rows = BlockTableRows(len(self.kv_cache_groups), cdiv(self.max_model_len, self.block_size),
                                         config.scheduler.max_num_seqs)
        self.sampler = Sampler(config.model.seed)
        self.prompt_logprobs_done: dict[str, int] = {}
        self.graphs = None
        self.graph_capture_seconds = 0.0
        self._copy_done = None
        self._num_fills = 0
        self.buffers = None

    def _bind_attention(self) -> None:
        """Group the attention layers by cache spec, pick a backend per group and give each layer its impl."""
        ctx = self.loaded.context
        self.kv_cache_groups: list[KVCacheGroup] = group_layers(ctx.kv_cache_specs)
        self.backends, self.builders = [], []
        for g in self.kv_cache_groups:
            what = f"KV group {g.group_id} ({type(g.spec).__name__}, {len(g.layer_names)} layers)"
            backend = select_attention_backend(g.spec, self.block_size, self.config.kernel.attention_backend,
                                               what=what, bidirectional_prefix=has_bidirectional_prefix(self.model))
            self.backends.append(backend)
            self.builders.append(backend.builder_cls(g.spec, self.block_size, self.device))
            for name in g.layer_names:
                layer = ctx.attention_layers[name]
                layer.impl = backend.impl_cls(layer.num_heads, layer.head_dim, layer.scale, layer.num_kv_heads,
                                              sliding_window=layer.sliding_window,
                                              logits_soft_cap=layer.logits_soft_cap)
                layer.group_id = g.group_id
        self.num_cache_slots = max(len(g.layer_names) for g in self.kv_cache_groups)

    @property
    def backend(self):
        """The first group's backend (the only one for single-kind models)."""
        return self.backends[0]

    # ---- KV cache
    @property
    def bytes_per_block(self) -> int:
        """One block id holds a page in each cache slot (layer i of every group shares slot i)."""
        return self.num_cache_slots * self.kv_cache_groups[0].spec.page_bytes(self.block_size)

    def determine_num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_kv_blocks:
            return cache.num_kv_blocks
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info()
            peak = self._profile_peak_bytes()
            budget = total * cache.gpu_memory_utilization - (total - free) - peak
            blocks = int(budget // self.bytes_per_block)
            needed = cdiv(self.max_model_len, self.block_size)
            if blocks < needed:
                raise ConfigError(
                    f"KV cache too small: {max(blocks, 0)} blocks of {self.block_size} tokens fit in "
                    f"--gpu-memory-utilization {cache.gpu_memory_utilization} of {total / 2**30:.0f} GiB "
                    f"({(total - free) / 2**30:.1f} GiB already in use, {peak / 2**30:.1f} GiB activations), "
                    f"one {self.max_model_len}-token sequence needs {needed}; raise the utilization, lower "
                    f"--max-model-len, or set --num-kv-blocks")
            return blocks
        return max(1, cache.kv_cache_memory // self.bytes_per_block)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One byte tensor per cache slot; each layer views its slot through its spec's shape."""
        page = self.kv_cache_groups[0].spec.page_bytes(self.block_size)
        slots = [torch.zeros(num_blocks * page, dtype=torch.uint8, device=self.device)
                 for _ in range(self.num_cache_slots)]
        layers = self.loaded.context.attention_layers
        self.kv_caches = []
        for g in self.kv_cache_groups:
            shape = g.spec.cache_shape(num_blocks, self.block_size)
            for i, name in enumerate(g.layer_names):
                layers[name].kv_cache = g.spec.layer_view(slots[i].view(g.spec.dtype).view(shape))
        self.kv_caches = slots
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

    def _new_buffers(self, max_tokens: int | None = None) -> InputBuffers:
        sc = self.config.scheduler
        return InputBuffers(max_tokens or max(sc.max_num_batched_tokens, sc.max_num_seqs), sc.max_num_seqs,
                            cdiv(self.max_model_len, self.block_size), self.device, self.block_size,
                            len(self.kv_cache_groups))

    def dummy_prefill_batch(self, n: int):
        """A prefill batch of `n` tokens in sequences no longer than the context, with real block tables over a
        freshly allocated cache (memory profiling). Returns (input_ids, positions, forward context)."""
        seq = min(n, self.max_model_len)
        lens = [seq] * (n // seq) + ([n % seq] if n % seq else [])
        per_seq = cdiv(seq, self.block_size)
        self.allocate_kv_cache(per_seq * len(lens))
        if self.buffers is None or self.buffers.max_tokens < n or self.buffers.max_reqs < len(lens):
            self.buffers = self._new_buffers(max(n, self.config.scheduler.max_num_seqs))
        buf = self.buffers
        qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        buf.qsl_np[:len(lens) + 1] = qsl
        buf.sl_np[:len(lens)] = lens
        buf.ids_np[:n] = 0
        buf.pos_np[:n] = np.concatenate([np.arange(length) for length in lens])
        buf.staged_slots(n)[:] = -1
        buf.staged_block_tables(len(lens), per_seq)[:] = np.arange(per_seq * len(lens)).reshape(len(lens), per_seq)
        buf.copy_to_device(n, len(lens), per_seq)
        ctx = self.metadata(n, len(lens), 0, seq, seq, per_seq, qsl.tolist(), lens)
        return buf.input_ids[:n], buf.positions[:n], ctx

    def _profile_peak_bytes(self) -> int:
        """Activation memory of one forward at the full token budget (GPU only)."""
        n = self.config.scheduler.max_num_batched_tokens
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        ids, positions, ctx = self.dummy_prefill_batch(n)
        kv_bytes = torch.cuda.memory_allocated() - before
        image = self._encode_dummy_image()  # kept alive through the forward, as the encoder cache keeps it
        self._profile_forward(ids, positions, ctx)
        torch.cuda.synchronize()
        del image
        peak = torch.cuda.max_memory_allocated() - before - kv_bytes
        self.free_kv_cache()
        self.buffers = None
        torch.cuda.empty_cache()
        return int(peak * 1.1)

    def _encode_dummy_image(self) -> list:
        """Every add-on's start-up warm-up (an image model's encoder on its largest image), so that the memory
        profile counts its activations (the caller keeps the returned list alive through its forward)."""
        return [a.warm_up() for a in self.addons]

    @torch.inference_mode()
    def _profile_forward(self, ids, positions, ctx: ForwardContext) -> None:
        hidden = self.model(ids, positions, ctx)
        self.model.compute_logits(hidden[-min(ids.shape[0], self.config.scheduler.max_num_seqs):])

    # ---- CUDA graphs
    def setup_after_kv(self) -> None:
        """Persistent buffers, then (on CUDA with graph-capable backends) decode graphs."""
        sc = self.config.scheduler
        self.buffers = self._new_buffers()
        self.graphs = None
        if self.device.type == "cuda":
            self._warm_up_kernels()
        sizes = self._graph_sizes()
        if sizes:
            self.graphs = DecodeGraphs(self, sizes)
            self.graph_capture_seconds = self.graphs.capture()
        pin = self.device.type == "cuda"
        self._token_host = [torch.zeros(sc.max_num_seqs, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._token_flip = 0

    def _graph_sizes(self) -> list[int]:
        """Decode batch sizes to capture; empty where graphs are off (CPU, --enforce-eager, a backend without)."""
        comp, sc = self.config.compilation, self.config.scheduler
        if self.device.type != "cuda" or comp.enforce_eager or not all(b.supports_cuda_graphs for b in self.backends):
            return []
        if not all(a.supports_graphs() for a in self.addons):  # e.g. LoRA's PyTorch reference
            return []
        return [s for s in (comp.cuda_graph_sizes or default_graph_sizes(sc.max_num_seqs)) if s <= sc.max_num_seqs]

    def precompile_kernels(self) -> None:
        """Compile, in parallel, every Triton variant that the profile run, the kernel warm-up and the graph
        capture will launch: the same forwards run once with launches turned into compilations (see
        kestrel/kernels/triton_ops/precompile.py). Decode forwards read only the layout of the KV cache, so the
        profile batch's small cache serves them. CUDA only; --no-precompile skips it."""
        if self.device.type != "cuda" or not self.config.compilation.precompile:
            return
        try:
            from kestrel.kernels.triton_ops.precompile import precompile
        except ImportError:  # no triton: nothing to compile
            return

        def dry_run():
            ids, positions, ctx = self.dummy_prefill_batch(self.config.scheduler.max_num_batched_tokens)
            self._profile_forward(ids, positions, ctx)
            self.buffers = self._new_buffers()
            self._warm_up_kernels()
            graphs = DecodeGraphs(self, self._graph_sizes())
            for b in graphs.sizes:
                graphs.run(b)

        try:
            precompile(dry_run)
        finally:
            self.free_kv_cache()
            self.buffers = None
            torch.cuda.empty_cache()

    @torch.inference_mode()
    def _warm_up_kernels(self) -> None:
        """Compile, at start-up, the kernel variants that mixed prefill/decode steps use (short and long query
        tiles, decode rows by batch size), so that the first requests do not wait ~1 s per Triton compilation.
        The batches read block 0 and write nothing (slots -1)."""
        buf = self.buffers
        for q_len in (min(24, buf.max_tokens // 2), 4):  # two prefills each
            hidden = self._warm_up_forward(2, q_len)
            self.model.compute_logits(hidden[[q_len - 1, 2 * q_len - 1]])
        # Decode rows outside the graphs (mixed steps): one-token contexts, so the unsplit variants of each batch
        # size class's decode kernel (the graphs compile the split ones); else each compiles in the first mixed
        # steps of a run, ~1 s apiece.
        for b in sorted({min(x, buf.max_reqs) for x in (1, 2, 4, 8, 16, 32, 64, 128, 256, buf.max_reqs)}):
            self._warm_up_forward(b, 1, decodes=True)
        self._encode_dummy_image()
        torch.cuda.synchronize()

    def _warm_up_forward(self, num_reqs: int, q_len: int, decodes: bool = False) -> torch.Tensor:
        """A forward of num_reqs requests of q_len new tokens each, their whole contexts (decodes: one token
        each, sent as decode rows)."""
        buf = self.buffers
        n = num_reqs * q_len
        width = cdiv(q_len, self.block_size)
        qsl = list(range(0, n + 1, q_len))
        buf.qsl_np[:num_reqs + 1] = qsl
        buf.sl_np[:num_reqs] = q_len
        buf.ids_np[:n] = 0
        buf.pos_np[:n] = np.tile(np.arange(q_len), num_reqs)
        buf.staged_slots(n)[:] = -1
        buf.staged_block_tables(num_reqs, width)[:] = 0
        buf.copy_to_device(n, num_reqs, width)
        ctx = self.metadata(n, num_reqs, num_reqs if decodes else 0, q_len, q_len, width, qsl,
                            [q_len] * num_reqs)
        return self.model(buf.input_ids[:n], buf.positions[:n], ctx)

    # ---- batch state from the scheduler's deltas
    def _update_states(self, step: StepInput) -> None:
        for rid in step.finished_ids:
            st = self.requests.pop(rid, None)
            if st is not None:
                self._forget(st)
            self.prompt_logprobs_done.pop(rid, None)
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
                 prev: "InFlight | None") -> ForwardContext:
        """Flatten the batch into the persistent buffers (numpy on the host, one copy each to the device)."""
        buf = self.buffers
        if self._copy_done is not None:
            self._copy_done.synchronize()  # the last step's host->device copies have left the staging buffers
        fills_dst, fills_src = [], []
        n_tok = sum(c.num_new_tokens for c in chunks)
        if n_tok > buf.max_tokens or len(chunks) > buf.max_reqs:
            raise RuntimeError(f"batch of {n_tok} tokens / {len(chunks)} requests exceeds the runner's buffers")
        qsl, sl, ids, pos = buf.qsl_np, buf.sl_np, buf.ids_np, buf.pos_np
        nr = len(chunks)
        req_rows = np.fromiter((st.table_row for st in states), dtype=np.intp, count=nr)
        width = max(1, int(self.block_rows.lens[req_rows].max()))
        qsl[0] = 0
        t = 0
        num_decodes = 0
        for b, (c, st) in enumerate(zip(chunks, states)):
            start, n = c.num_computed_tokens, c.num_new_tokens
            if n == 1:
                # the token at `start` is sampled by the step in flight (a placeholder, or not there yet where
                # that step samples after this one's inputs are staged): copied on the device before the forward
                tok = st.token_at(start) if start < st.num_prompt_tokens + len(st.output_token_ids) else PLACEHOLDER
                if tok == PLACEHOLDER:
                    fills_dst.append(t)
                    fills_src.append(prev.rows[c.request_id])
                    tok = 0
                ids[t] = tok
                pos[t] = start
                if num_decodes == b:
                    num_decodes += 1
            else:
                ids[t:t + n] = st.tokens_slice(start, start + n)
                pos[t:t + n] = np.arange(start, start + n)
            t += n
            qsl[b + 1] = t
            sl[b] = start + n
        tables = buf.stage_block_tables(self.block_rows, req_rows, width)
        buf.stage_slots(tables, qsl[:nr + 1], pos[:t])
        for prepare in self._hooks["prepare"]:
            prepare(chunks, states)
        buf.copy_to_device(t, nr, width)
        self._num_fills = k = len(fills_dst)
        if k:
            buf.fill_dst_np[:k] = fills_dst
            buf.fill_src_np[:k] = fills_src
            buf.copy_fills(k)
        if self.device.type == "cuda":
            self._copy_done = torch.cuda.Event()
            self._copy_done.record()
        fields = {}
        for attention_fields in self._hooks["attention_fields"]:
            fields.update(attention_fields(chunks, states))
        return self.metadata(t, nr, num_decodes, max(c.num_new_tokens for c in chunks), int(sl[:nr].max()), width,
                             qsl[:nr + 1].tolist(), sl[:nr].tolist(), **fields)

    @torch.inference_mode()
    def launch(self, step: StepInput, prev: "InFlight | None" = None, sample: bool = True,
               before_forward=None) -> "InFlight":
        """Queue a step on the device and return without waiting for it. Decode rows whose input token is a
        placeholder take it from `prev`'s sampled tokens, on the device (pipelined decode). With sample=False
        only the forward (to the logits) is queued: the caller fills a token bitmask on the host meanwhile, then
        calls sample() (structured outputs). `before_forward()` runs once the inputs are staged, before anything
        reads `prev`'s tokens: where `prev` still waits for its bitmask, the caller samples it there."""
        inf = InFlight(RunnerOutput())
        self._update_states(step)
        if step.is_empty:
            return inf
        chunks = sorted(step.chunks, key=lambda c: c.num_new_tokens != 1)  # decodes first
        states = [self.requests[c.request_id] for c in chunks]
        ctx = self._prepare(chunks, states, prev)
        if before_forward is not None:
            before_forward()
        if self._num_fills:
            k, buf = self._num_fills, self.buffers
            buf.input_ids.index_copy_(0, buf.fill_dst[:k], prev.tokens[buf.fill_src[:k]].to(torch.int64))
        meta = ctx.attn_metadata[0]
        qsl = meta.query_start_loc_cpu
        samplers = [c for c in chunks if c.samples]
        hidden = inputs_embeds = None
        for embeds in self._hooks["inputs_embeds"]:
            out = embeds(chunks, states, self.buffers.input_ids[:meta.num_tokens])
            inputs_embeds = out if out is not None else inputs_embeds
        padded = (self.graphs.padded_size(meta.num_reqs) if self.graphs and meta.num_decodes == meta.num_reqs
                  and all(ok() for ok in self._hooks["step_graph_ok"]) else None)
        if padded is not None:
            logits = self.graphs.replay(meta.num_reqs, padded)  # every decode row samples
        else:
            hidden = self.model(self.buffers.input_ids[:meta.num_tokens], self.buffers.positions[:meta.num_tokens],
                                ctx, inputs_embeds=inputs_embeds)
            sample_idx = [qsl[b + 1] - 1 for b, c in enumerate(chunks) if c.samples]
            logits = (self.model.compute_logits(hidden[to_device(sample_idx, torch.int64, self.device)])
                      if samplers else None)
        if samplers:
            inf.rows = {c.request_id: i for i, c in enumerate(samplers)}
            inf.states = [self.requests[c.request_id] for c in samplers]
            inf.logits, inf.sample_pending = logits, True
        if hidden is not None:
            for b, (c, st) in enumerate(zip(chunks, states)):
                if st.sampling_params.prompt_logprobs is not None:
                    self._prompt_logprobs(c, st, hidden[qsl[b]:qsl[b + 1]], inf.out)
        if sample and inf.sample_pending:
            self.sample(inf)
        return inf

    @torch.inference_mode()
    def sample(self, inf: "InFlight", bitmask: StepBitmask | None = None) -> None:
        """Queue the sampling of a launched step. `bitmask` (the host masks of the constrained rows, by their
        row in inf.rows order) masks the logits on the device first (the grammar add-on)."""
        logits, inf.logits, inf.sample_pending, inf.bitmask = inf.logits, None, False, bitmask
        for before_sample in self._hooks["before_sample"]:
            before_sample(logits, inf)
        states = inf.states
        rows = [SamplingRow(st.sampling_params, st.prompt_token_ids, st.output_token_ids, st.min_tokens_stop_ids)
                for st in states]
        res = self.sampler(logits, rows)
        inf.tokens = res.tokens
        for rid, st, lp in zip(inf.rows, states, res.logprobs):
            if lp is not None:
                inf.out.logprobs[rid] = lp
            inf.samplers.append((rid, len(st.output_token_ids)))
            st.output_token_ids.append(PLACEHOLDER)
        if self.device.type == "cuda":
            host = self._token_host[self._token_flip][: len(states)]
            self._token_flip ^= 1
            host.copy_(res.tokens, non_blocking=True)
            inf.tokens_host = host
            inf.event = torch.cuda.Event()
            inf.event.record()

    def collect(self, inf: "InFlight") -> RunnerOutput:
        """Wait for a launched step's sampled tokens (and record them in the batch state)."""
        if inf.tokens is None:
            return inf.out
        if inf.event is not None:
            inf.event.synchronize()
            tokens = inf.tokens_host.tolist()
        else:
            tokens = inf.tokens.tolist()
        for (rid, index), tok in zip(inf.samplers, tokens):
            inf.out.sampled[rid] = tok
            st = self.requests.get(rid)
            if st is not None and index < len(st.output_token_ids):
                st.output_token_ids[index] = tok
        return inf.out

    def _prompt_logprobs(self, c: ScheduledChunk, st: RequestState, hidden: torch.Tensor, out: RunnerOutput) -> None:
        """Logprobs of prompt tokens 1..P-1, each given its prefix; collected chunk by chunk, once."""
        start, n = c.num_computed_tokens, c.num_new_tokens
        done = self.prompt_logprobs_done.get(c.request_id, 0)  # prompt positions (targets) already reported
        first_target = max(start + 1, done + 1)
        last_target = min(start + n, st.num_prompt_tokens - 1)
        if first_target > last_target:
            return
        rows = torch.arange(first_target - 1 - start, last_target - start, device=hidden.device)
        logprobs = self.model.compute_logits(hidden[rows]).float().log_softmax(dim=-1)
        targets = torch.tensor(st.prompt_token_ids[first_target:last_target + 1], device=hidden.device)
        entries = compute_logprobs(logprobs, targets, st.sampling_params.prompt_logprobs)
        out.prompt_logprobs[c.request_id] = [(int(t), *e) for t, e in zip(targets.tolist(), entries)]
        self.prompt_logprobs_done[c.request_id] = last_target
