"""Runs one scheduled step on the model: builds input tensors and attention metadata, runs the forward, samples."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from kestrel.attention.backend import AttentionMetadata
from kestrel.attention.layer import ForwardContext
from kestrel.attention.selector import select_attention_backend
from kestrel.config import EngineConfig
from kestrel.engine.scheduler import ScheduledRequest, SchedulerOutput
from kestrel.loader import LoadedModel, load_model
from kestrel.worker.sampler import Sampler, SamplingRow, compute_logprobs

logger = logging.getLogger(__name__)


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
            budget = total * cc.gpu_memory_utilization - (total - free) - self._profile_peak_bytes()
            return max(1, int(budget // self.bytes_per_block))
        return max(1, cc.kv_cache_memory // self.bytes_per_block)

    def _profile_peak_bytes(self) -> int:
        """Activation memory of one forward at the full token budget (GPU only)."""
        n = self.config.scheduler.max_num_batched_tokens
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        self.allocate_kv_cache(1)
        meta = AttentionMetadata(n, 1, 0, n, n, torch.tensor([0, n], dtype=torch.int32, device=self.device),
                                 torch.tensor([n], dtype=torch.int32, device=self.device),
                                 torch.zeros(1, 1, dtype=torch.int32, device=self.device),
                                 torch.full((n,), -1, dtype=torch.int64, device=self.device), [0, n], [n])
        with torch.inference_mode():
            hidden = self.model(torch.zeros(n, dtype=torch.long, device=self.device),
                                torch.arange(n, device=self.device), ForwardContext(meta, self.kv_caches))
            self.model.compute_logits(hidden[-min(n, self.config.scheduler.max_num_seqs):])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        self.kv_caches = []
        torch.cuda.empty_cache()
        return int(peak * 1.1)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in range(self.num_layers)]

    # ---- one step
    def _prepare(self, batch: list[ScheduledRequest]):
        bs = self.block_size
        ids, pos, slots, qsl, seq_lens, tables = [], [], [], [0], [], []
        for s in batch:
            c, n, req = s.num_computed_tokens, s.num_new_tokens, s.request
            ids.extend(req.tokens_slice(c, c + n))
            pos.extend(range(c, c + n))
            blocks = s.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(c, c + n))
            qsl.append(qsl[-1] + n)
            seq_lens.append(c + n)
            tables.append(blocks)
        width = max(len(t) for t in tables)
        table = torch.zeros(len(tables), width, dtype=torch.int32)
        for i, t in enumerate(tables):
            table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        dev = self.device
        num_decodes = 0
        for s in batch:
            if s.num_new_tokens != 1:
                break
            num_decodes += 1
        meta = AttentionMetadata(
            num_tokens=len(ids), num_reqs=len(batch), num_decodes=num_decodes,
            max_query_len=max(s.num_new_tokens for s in batch), max_seq_len=max(seq_lens),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=table.to(dev), slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
        )
        return (torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(pos, dtype=torch.long, device=dev),
                meta)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, eos_token_id: int | None) -> RunnerOutput:
        out = RunnerOutput()
        for rid in sched.finished_ids:
            self.prompt_logprobs_done.pop(rid, None)
        if sched.is_empty:
            return out
        batch = sorted(sched.scheduled, key=lambda s: s.num_new_tokens != 1)  # decodes first
        input_ids, positions, meta = self._prepare(batch)
        hidden = self.model(input_ids, positions, ForwardContext(meta, self.kv_caches))

        qsl = meta.query_start_loc_cpu
        sample_idx = [qsl[b + 1] - 1 for b, s in enumerate(batch) if s.samples]
        samplers = [s for s in batch if s.samples]
        if samplers:
            logits = self.model.compute_logits(hidden[sample_idx])
            rows = [SamplingRow(s.request.sampling_params, s.request.prompt_token_ids, s.request.output_token_ids,
                                ([eos_token_id] if eos_token_id is not None and not s.request.sampling_params.ignore_eos
                                 else []) + s.request.sampling_params.stop_token_ids)
                    for s in samplers]
            res = self.sampler(logits, rows)
            for s, tok, lp in zip(samplers, res.token_ids, res.logprobs):
                out.sampled[s.request.request_id] = tok
                if lp is not None:
                    out.logprobs[s.request.request_id] = lp
        for b, s in enumerate(batch):
            if s.request.sampling_params.prompt_logprobs is not None:
                self._prompt_logprobs(s, hidden[qsl[b]:qsl[b + 1]], out)
        return out

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
