"""Runs one scheduled step on the model: builds input tensors and attention metadata, runs the forward, samples."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from kestrel.attention.backend import AttentionMetadata
from kestrel.attention.layer import ForwardContext
from kestrel.attention.selector import select_attention_backend
from kestrel.config import EngineConfig
from kestrel.errors import ConfigError
from kestrel.engine.request import PLACEHOLDER
from kestrel.engine.scheduler import ScheduledRequest, SchedulerOutput
from kestrel.loader import LoadedModel, load_model
from kestrel.worker.cuda_graphs import DecodeGraphs, default_graph_sizes
from kestrel.worker.input_batch import InputBuffers
from kestrel.worker.sampler import Sampler, SamplingRow, compute_logprobs, to_device

logger = logging.getLogger(__name__)


@dataclass
class InFlight:
    """A launched step: its sampled tokens on the device, and where they land on the host."""
    out: "RunnerOutput"
    samplers: list = field(default_factory=list)
    tokens: torch.Tensor | None = None
    rows: dict[str, int] = field(default_factory=dict)  # request id -> row of `tokens`
    tokens_host: torch.Tensor | None = None
    event: object = None


@dataclass
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, tuple] = field(default_factory=dict)  # req id -> (logprob, rank, top list)
    prompt_logprobs: dict[str, list] = field(default_factory=dict)  # req id -> entries for this chunk


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class ModelRunner:
    def __init__(self, config: EngineConfig, progress: bool = True):
        self.config = config
        self.device = pick_device(config.model.device)
        if self.device.type == "cuda":
            try:
                from kestrel.kernels.triton_ops.pdl import configure_pdl
                configure_pdl(config.compilation.pdl)
            except ImportError:  # no triton: no Triton kernels to launch
                pass
        torch.manual_seed(config.model.seed)
        self.loaded: LoadedModel = load_model(config.model, self.device, config.model.max_model_len,
                                              config.kernel.linear_backend, progress)
        self.model = self.loaded.model
        self.hf_config = self.loaded.hf_config
        self.dtype = self.loaded.dtype
        self.block_size = config.cache.block_size
        attn_layers = self.model.attention_layers()
        a0 = attn_layers[0]
        self.num_layers, self.num_kv_heads, self.head_dim = len(attn_layers), a0.num_kv_heads, a0.head_dim
        self.backend = select_attention_backend(self.dtype, self.head_dim, self.block_size,
                                                config.kernel.attention_backend,
                                                need_prefix_caching=config.cache.enable_prefix_caching)
        for layer in attn_layers:
            layer.impl = self.backend.impl_cls(layer.num_heads, layer.head_dim, layer.scale, layer.num_kv_heads)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.sampler = Sampler(config.model.seed)
        self.prompt_logprobs_done: dict[str, int] = {}
        self.max_model_len = config.model.max_model_len or self.hf_config.max_position_embeddings
        self.graphs = None
        self.graph_capture_seconds = 0.0
        self._copy_done = None

    # ---- KV cache
    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def determine_num_blocks(self) -> int:
        cc = self.config.cache
        if cc.num_kv_blocks:
            return cc.num_kv_blocks
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info()
            peak = self._profile_peak_bytes()
            budget = total * cc.gpu_memory_utilization - (total - free) - peak
            blocks = int(budget // self.bytes_per_block)
            needed = -(-self.max_model_len // self.block_size)
            if blocks < needed:
                raise ConfigError(
                    f"KV cache too small: {max(blocks, 0)} blocks of {self.block_size} tokens fit in "
                    f"--gpu-memory-utilization {cc.gpu_memory_utilization} of {total / 2**30:.0f} GiB "
                    f"({(total - free) / 2**30:.1f} GiB already in use, {peak / 2**30:.1f} GiB activations), "
                    f"one {self.max_model_len}-token sequence needs {needed}; raise the utilization, lower "
                    f"--max-model-len, or set --num-kv-blocks")
            return blocks
        return max(1, cc.kv_cache_memory // self.bytes_per_block)

    def dummy_prefill_batch(self, n: int):
        """A prefill batch of `n` tokens in sequences no longer than the context, with real block tables over
        a freshly allocated cache (memory profiling). Returns (input_ids, positions, metadata)."""
        seq = min(n, self.max_model_len)
        lens = [seq] * (n // seq) + ([n % seq] if n % seq else [])
        per_seq = -(-seq // self.block_size)
        self.allocate_kv_cache(per_seq * len(lens))
        dev = self.device
        qsl = [0]
        for length in lens:
            qsl.append(qsl[-1] + length)
        meta = AttentionMetadata(
            n, len(lens), 0, seq, seq, torch.tensor(qsl, dtype=torch.int32, device=dev),
            torch.tensor(lens, dtype=torch.int32, device=dev),
            torch.arange(per_seq * len(lens), dtype=torch.int32, device=dev).view(len(lens), per_seq),
            torch.full((n,), -1, dtype=torch.int64, device=dev), qsl, lens)
        positions = torch.cat([torch.arange(length, device=dev) for length in lens])
        return torch.zeros(n, dtype=torch.long, device=dev), positions, meta

    def _profile_peak_bytes(self) -> int:
        """Activation memory of one forward at the full token budget (GPU only)."""
        n = self.config.scheduler.max_num_batched_tokens
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        ids, positions, meta = self.dummy_prefill_batch(n)
        kv_bytes = torch.cuda.memory_allocated() - before
        self._profile_forward(ids, positions, meta)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before - kv_bytes
        self.kv_caches = []
        torch.cuda.empty_cache()
        return int(peak * 1.1)

    @torch.inference_mode()
    def _profile_forward(self, ids, positions, meta) -> None:
        hidden = self.model(ids, positions, ForwardContext(meta, self.kv_caches))
        self.model.compute_logits(hidden[-min(meta.num_tokens, self.config.scheduler.max_num_seqs):])

    def allocate_kv_cache(self, num_blocks: int) -> None:
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in range(self.num_layers)]

    # ---- CUDA graphs
    def setup_after_kv(self) -> None:
        """Persistent buffers, then (on CUDA with a graph-capable backend) decode graphs."""
        sc = self.config.scheduler
        self.buffers = self._new_buffers()
        self.graphs = None
        if self.device.type == "cuda":
            self._warm_up_kernels()
        sizes = self._graph_sizes()
        if sizes:
            self.graphs = DecodeGraphs(self.model, self.buffers, self.kv_caches, sizes, self.max_model_len)
            self.graph_capture_seconds = self.graphs.capture()
        pin = self.device.type == "cuda"
        self._token_host = [torch.zeros(sc.max_num_seqs, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._token_flip = 0

    def _new_buffers(self) -> InputBuffers:
        sc = self.config.scheduler
        max_blocks = -(-self.max_model_len // self.block_size)
        return InputBuffers(max(sc.max_num_batched_tokens, sc.max_num_seqs), sc.max_num_seqs, max_blocks, self.device)

    def _graph_sizes(self) -> list[int]:
        """Decode batch sizes to capture; empty where graphs are off (CPU, --enforce-eager, backend without)."""
        cc, sc = self.config.compilation, self.config.scheduler
        if self.device.type != "cuda" or cc.enforce_eager or not self.backend.supports_cuda_graphs:
            return []
        return [s for s in (cc.cuda_graph_sizes or default_graph_sizes(sc.max_num_seqs)) if s <= sc.max_num_seqs]

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
            ids, positions, meta = self.dummy_prefill_batch(self.config.scheduler.max_num_batched_tokens)
            self._profile_forward(ids, positions, meta)
            self.buffers = self._new_buffers()
            self._warm_up_kernels()
            graphs = DecodeGraphs(self.model, self.buffers, self.kv_caches, self._graph_sizes(), self.max_model_len)
            for b in graphs.sizes:
                graphs.run(b)

        try:
            precompile(dry_run)
        finally:
            self.kv_caches, self.buffers = [], None
            torch.cuda.empty_cache()

    @torch.inference_mode()
    def _warm_up_kernels(self) -> None:
        """Compile, at start-up, the kernel variants that mixed prefill/decode steps use (short and long query
        tiles), so that the first requests do not wait ~1 s per Triton compilation. The batch reads block 0
        and writes nothing (slots -1)."""
        buf = self.buffers
        for q_len in (min(24, buf.max_tokens // 2), 4):
            lens = [q_len, q_len]
            n = sum(lens)
            qsl = [0, q_len, n]
            buf.query_start_loc[:3].copy_(torch.tensor(qsl, dtype=torch.int32))
            buf.seq_lens[:2].fill_(q_len)
            buf.block_tables[:2].zero_()
            buf.slot_mapping[:n].fill_(-1)
            buf.input_ids[:n].zero_()
            buf.positions[:n].copy_(torch.arange(q_len).repeat(2))
            meta = AttentionMetadata(n, 2, 0, q_len, q_len, buf.query_start_loc[:3], buf.seq_lens[:2],
                                     buf.block_tables[:2, :max(1, -(-q_len // self.block_size))],
                                     buf.slot_mapping[:n], qsl, lens)
            hidden = self.model(buf.input_ids[:n], buf.positions[:n], ForwardContext(meta, self.kv_caches))
            self.model.compute_logits(hidden[[q_len - 1, n - 1]])
        torch.cuda.synchronize()

    # ---- one step
    def _prepare(self, batch: list[ScheduledRequest], prev: "InFlight | None" = None) -> AttentionMetadata:
        """Flatten the batch into the persistent buffers (numpy on the host, one copy each to the device)."""
        buf, bs = self.buffers, self.block_size
        if self._copy_done is not None:
            self._copy_done.synchronize()  # the last step's host->device copies have left the staging buffers
        fills_dst, fills_src = [], []
        n_tok = sum(s.num_new_tokens for s in batch)
        if n_tok > buf.max_tokens or len(batch) > buf.max_reqs:
            raise RuntimeError(f"batch of {n_tok} tokens / {len(batch)} requests exceeds the runner's buffers")
        qsl, sl, bt = buf.qsl_np, buf.sl_np, buf.bt_flat_np
        ids, pos, slots = buf.ids_np, buf.pos_np, buf.slot_np
        qsl[0] = 0
        t = 0
        width = max(1, max(len(s.block_ids) for s in batch))
        num_decodes = 0
        for b, s in enumerate(batch):
            c, n, blocks = s.num_computed_tokens, s.num_new_tokens, s.block_ids
            req = s.request
            if n == 1:
                tok = req.token_at(c)
                if tok == PLACEHOLDER:  # sampled by the step in flight: copied on the device below
                    fills_dst.append(t)
                    fills_src.append(prev.rows[req.request_id])
                    tok = 0
                ids[t] = tok
                pos[t] = c
                slots[t] = blocks[c // bs] * bs + c % bs
                if num_decodes == b:
                    num_decodes += 1
            else:
                ids[t:t + n] = req.tokens_slice(c, c + n)
                p = np.arange(c, c + n)
                pos[t:t + n] = p
                slots[t:t + n] = np.asarray(blocks, dtype=np.int64)[p // bs] * bs + p % bs
            t += n
            qsl[b + 1] = t
            sl[b] = c + n
            bt[b * width:b * width + len(blocks)] = blocks
        nr = len(batch)
        buf.copy_to_device(t, nr, width)
        if fills_dst:
            k = len(fills_dst)
            buf.fill_dst_np[:k] = fills_dst
            buf.fill_src_np[:k] = fills_src
            buf.copy_fills(k)
            buf.input_ids.index_copy_(0, buf.fill_dst[:k], prev.tokens[buf.fill_src[:k]].to(torch.int64))
        if self.device.type == "cuda":
            self._copy_done = torch.cuda.Event()
            self._copy_done.record()
        return AttentionMetadata(
            num_tokens=t, num_reqs=nr, num_decodes=num_decodes, max_query_len=max(s.num_new_tokens for s in batch),
            max_seq_len=int(sl[:nr].max()), query_start_loc=buf.query_start_loc[:nr + 1],
            seq_lens=buf.seq_lens[:nr], block_tables=buf.block_tables[:nr, :width],
            slot_mapping=buf.slot_mapping[:t], query_start_loc_cpu=qsl[:nr + 1].tolist(), seq_lens_cpu=sl[:nr].tolist())

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, eos_token_id: int | None, prev: "InFlight | None" = None) -> "InFlight":
        """Queue a step on the device and return without waiting for it. Decode rows whose input token is a
        placeholder take it from `prev`'s sampled tokens, on the device (pipelined decode)."""
        inf = InFlight(RunnerOutput())
        for rid in sched.finished_ids:
            self.prompt_logprobs_done.pop(rid, None)
        if sched.is_empty:
            return inf
        batch = sorted(sched.scheduled, key=lambda s: s.num_new_tokens != 1)  # decodes first
        meta = self._prepare(batch, prev)
        qsl = meta.query_start_loc_cpu
        samplers = [s for s in batch if s.samples]
        hidden = None
        padded = self.graphs.padded_size(meta.num_reqs) if self.graphs and meta.num_decodes == meta.num_reqs else None
        if padded is not None:
            logits = self.graphs.replay(meta.num_reqs, padded)  # every decode row samples
        else:
            hidden = self.model(self.buffers.input_ids[:meta.num_tokens], self.buffers.positions[:meta.num_tokens],
                                ForwardContext(meta, self.kv_caches))
            sample_idx = [qsl[b + 1] - 1 for b, s in enumerate(batch) if s.samples]
            logits = (self.model.compute_logits(hidden[to_device(sample_idx, torch.int64, self.device)])
                      if samplers else None)
        if samplers:
            rows = [SamplingRow(s.request.sampling_params, s.request.prompt_token_ids, s.request.output_token_ids,
                                ([eos_token_id] if eos_token_id is not None and not s.request.sampling_params.ignore_eos
                                 else []) + s.request.sampling_params.stop_token_ids)
                    for s in samplers]
            res = self.sampler(logits, rows)
            inf.samplers = samplers
            inf.tokens = res.tokens
            inf.rows = {s.request.request_id: i for i, s in enumerate(samplers)}
            for s, lp in zip(samplers, res.logprobs):
                if lp is not None:
                    inf.out.logprobs[s.request.request_id] = lp
            if self.device.type == "cuda":
                host = self._token_host[self._token_flip][: len(samplers)]
                self._token_flip ^= 1
                host.copy_(res.tokens, non_blocking=True)
                inf.tokens_host = host
                inf.event = torch.cuda.Event()
                inf.event.record()
        if hidden is not None:
            for b, s in enumerate(batch):
                if s.request.sampling_params.prompt_logprobs is not None:
                    self._prompt_logprobs(s, hidden[qsl[b]:qsl[b + 1]], inf.out)
        return inf

    def collect(self, inf: "InFlight") -> RunnerOutput:
        """Wait for a launched step's sampled tokens."""
        if inf.tokens is None:
            return inf.out
        if inf.event is not None:
            inf.event.synchronize()
            tokens = inf.tokens_host.tolist()
        else:
            tokens = inf.tokens.tolist()
        for s, tok in zip(inf.samplers, tokens):
            inf.out.sampled[s.request.request_id] = tok
        return inf.out

    def _prompt_logprobs(self, s: ScheduledRequest, hidden: torch.Tensor, out: RunnerOutput) -> None:
        """Logprobs of prompt tokens 1..P-1, each given its prefix; collected chunk by chunk, once."""
        req, c, n = s.request, s.num_computed_tokens, s.num_new_tokens
        done = self.prompt_logprobs_done.get(req.request_id, 0)  # prompt positions (targets) already reported
        first_target = max(c + 1, done + 1)
        last_target = min(c + n, req.num_prompt_tokens - 1)
        if first_target > last_target:
            return
        rows = torch.arange(first_target - 1 - c, last_target - c, device=hidden.device)
        logprobs = self.model.compute_logits(hidden[rows]).log_softmax(dim=-1)
        targets = torch.tensor(req.prompt_token_ids[first_target:last_target + 1], device=hidden.device)
        entries = compute_logprobs(logprobs, targets, req.sampling_params.prompt_logprobs)
        out.prompt_logprobs[req.request_id] = [(int(t), *e) for t, e in zip(targets.tolist(), entries)]
        self.prompt_logprobs_done[req.request_id] = last_target
