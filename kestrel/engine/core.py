"""EngineCore: owns the scheduler, the KV manager and the executor (the model runner in-process, or tensor-parallel
workers); step() = schedule -> execute -> update.
Runs in-process (LLM.generate) or in its own process driven over ZeroMQ (ipc/core_proc.py)."""
from __future__ import annotations

import logging
import time

from kestrel.config import EngineConfig
from kestrel.engine.grammar_steps import GrammarSteps
from kestrel.engine.kv import KVCacheManager
from kestrel.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from kestrel.engine.request import Request
from kestrel.engine.scheduler import Scheduler
from kestrel.engine.speculation import Speculation
from kestrel.errors import InvalidRequest
from kestrel.executor import ControlCallError, make_executor
from kestrel.spec_decode.config import SpeculativeConfig, engine_refusals, refuse
from kestrel.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, engine_index: int = 0, progress: bool = True):
        t0 = time.perf_counter()
        self.config = config
        self.engine_index = engine_index
        spec = SpeculativeConfig.from_dict(config.scheduler.speculative_config)
        if spec is not None:
            refuse(engine_refusals(config))  # before the model loads
        self.executor = ex = make_executor(config, progress)
        self.model_config = ex.model_config
        self.tokenizer = ex.tokenizer
        self.device = ex.device
        self.max_model_len = self.model_config.max_model_len
        try:
            ex.precompile_kernels()
            num_blocks = ex.determine_num_blocks()
            ex.initialize_cache(num_blocks)
        except BaseException:
            ex.shutdown()
            raise
        # an encoder's pooler reads every prompt token's hidden state: a cached prefix would skip them
        self.kv = KVCacheManager(num_blocks, enable_prefix_caching=config.cache.enable_prefix_caching
                                 and not self.model_config.encoder_only,
                                 groups=ex.kv_cache_groups)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len,
                                   config.lora.max_loras if config.lora.enable_lora else 0)
        if self.scheduler.max_prompt_tokens < self.max_model_len - 1:
            logger.warning("the KV cache admits prompts of at most %d tokens (max_model_len %d): longer ones are "
                           "refused", self.scheduler.max_prompt_tokens, self.max_model_len)
        self.eos_token_id = self.model_config.eos_token_id
        # speculative decoding (None: off); its steps are synchronous: drafts are proposed from every known token
        self.speculation = Speculation(spec, self.max_model_len, config.model.seed) if spec is not None else None
        self._sleeping = False
        self._paused = False
        mode = config.scheduler.async_scheduling
        self.pipelined = mode == "on" or (mode == "auto" and self.device.type == "cuda")
        self._inflight = None
        self.structured = StructuredOutputManager(
            self.tokenizer, int(self.model_config.vocab_size), self.eos_token_id,
            config.scheduler.max_num_seqs, pin=self.device.type == "cuda",
            fill_threads=config.scheduler.structured_output_threads,
            compile_timeout=config.scheduler.grammar_compile_timeout)
        self.grammars = GrammarSteps(self.structured, ex)
        self._rejected: list[EngineCoreOutput] = []  # finished before they could run (grammar failed, adapter gone)
        self.loras: dict[int, str] = {}  # lora id -> name: the adapters every rank holds (set when call_all succeeds)
        kv_dtypes = sorted({str(g.spec.dtype).removeprefix("torch.") for g in ex.kv_cache_groups})
        logger.info("KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, %s); ready in %.1f s", num_blocks,
                    config.cache.block_size, num_blocks * config.cache.block_size,
                    num_blocks * ex.bytes_per_block / 2**20, "/".join(kv_dtypes), time.perf_counter() - t0)

    # ---- requests
    def add_request(self, r: EngineCoreRequest) -> None:
        req = Request(r.request_id, list(r.prompt_token_ids), r.sampling_params, self.eos_token_id, r.max_tokens,
                      r.priority, r.arrival_time, extras=r.extras, group_id=r.group_id)
        if req.lora_id:
            if req.lora_id not in self.loras:
                # unloaded while the request was on its way: end it (the frontend sees "abort"), never hang it
                logger.warning("request %s: LoRA id %d is not loaded; aborted", r.request_id, req.lora_id)
                self._rejected.append(EngineCoreOutput(r.request_id, [], finish_reason="abort",
                                                       stop_reason=f"LoRA adapter id {req.lora_id} is not loaded"))
                return
        if r.sampling_params.structured_outputs is None:
            self.scheduler.add_request(req)
            return
        if req.request_id in self.scheduler.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        self.grammars.submit(req)  # scheduled once its grammar compiled

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        compiling = self.grammars.abort(set(request_ids))
        return compiling + [r.request_id for r in self.scheduler.abort_requests(request_ids)]

    def has_unfinished_requests(self) -> bool:
        """Whether step() has work now. Asleep or paused, only what is owed (the step in flight, requests that
        finished before running): the queued ones wait for wake_up, and the engine loop idles instead of
        spinning out empty outputs that flooded the server (issue 33: /health took 30 s)."""
        if self._paused or self._sleeping:
            return self._inflight is not None or bool(self._rejected)
        return (self.scheduler.has_unfinished() or self._inflight is not None or bool(self._rejected)
                or bool(self.grammars.compiling))

    # ---- one step
    def _pipeline_ok(self) -> bool:
        """Pipelined decode (schedule and launch step N+1 before step N's tokens are read) is on when the
        device runs asynchronously and no live request needs its previous tokens on the host to sample
        (penalties) or asks for logprobs."""
        return self.pipelined and self.scheduler.num_sync_requests == 0 and not self._speculating()

    def _speculating(self) -> bool:
        return self.speculation is not None and self.speculation.active(self.scheduler.num_running)

    def step(self) -> EngineCoreOutputs:
        """Schedule, launch, collect. Pipelined (see _pipeline_ok), step N+1 is scheduled and launched before
        step N's tokens are collected; grammar-constrained steps sample late (engine/grammar_steps.py)."""
        grammars = self.grammars
        self._rejected += grammars.admit(self.scheduler, idle=not self.scheduler.has_unfinished()
                                         and self._inflight is None)
        if self._inflight is not None:
            prev_sched, prev = self._inflight
            self._inflight = None
            if self._pipeline_ok() and not (self._paused or self._sleeping):
                sched = self.scheduler.schedule()
                inf = self._launch(sched, prev)  # an empty step still delivers finished ids
                if not sched.is_empty:
                    self._inflight = (sched, inf)
                    self.scheduler.on_launch(sched)
            grammars.sample(prev)
            result = self.executor.collect(prev)
            grammars.advance(prev_sched, result, self._inflight)
            return self._outputs(prev_sched, result)
        if self._paused or self._sleeping:
            return EngineCoreOutputs(self.engine_index, self._take_rejected(), self.stats())
        drafts = self.speculation.propose(self.scheduler.running) if self._speculating() else None
        sched = self.scheduler.schedule(drafts) if drafts else self.scheduler.schedule()
        inf = self._launch(sched)
        self.scheduler.on_launch(sched)
        grammars.advance(None, None, (sched, inf))
        grammars.sample(inf)
        if self._pipeline_ok() and inf.samples:
            self._inflight = (sched, inf)
            return EngineCoreOutputs(self.engine_index, self._take_rejected(), self.stats())
        result = self.executor.collect(inf)
        grammars.advance(sched, result, None)
        return self._outputs(sched, result)

    def _launch(self, sched, prev=None):
        """Queue the forward; a step with grammar-constrained rows samples later, once the host has filled the
        bitmask. `prev` samples before this step's forward, which reads its tokens."""
        if sched.step.new_requests:
            now, requests = time.monotonic(), self.scheduler.requests
            for r in sched.step.new_requests:
                req = requests.get(r.request_id)
                if req is not None and not req.scheduled_at:
                    req.scheduled_at = now
        return self.executor.launch(sched.step, prev, sample=not GrammarSteps.samples_later(sched),
                                    before_forward=(lambda: self.grammars.sample(prev)) if prev is not None else None)

    def _take_rejected(self) -> list[EngineCoreOutput]:
        out, self._rejected = self._rejected, []
        return out

    def _outputs(self, sched, result) -> EngineCoreOutputs:
        self._fail_requests(result.failed)
        finished = {r.request_id for r in self.scheduler.on_result(sched, result.sampled, result.more_sampled)}
        if self.speculation is not None:
            self.speculation.record(sched.scheduled, result.more_sampled, result.next_drafts)
        outputs = self._take_rejected()
        for s in sched.scheduled:
            req = s.request
            rid = req.request_id
            if req.is_finished and rid not in finished:
                continue  # finished or aborted while this step was in flight
            tok = result.sampled.get(rid)
            plp = result.prompt_logprobs.get(rid)
            if tok is None and plp is None:
                continue
            lp = result.logprobs.get(rid)
            new, lps = ([tok] if tok is not None else []), ([lp] if lp is not None else None)
            if rid in result.more_sampled:  # a verify step: the tokens kept (a stop may have cut the rest)
                new += result.more_sampled[rid][:s.num_emitted - 1]
                if lps is not None:
                    lps += result.more_logprobs[rid][:s.num_emitted - 1]
            outputs.append(EngineCoreOutput(
                rid, new, new_logprobs=lps,
                prompt_logprobs=plp,
                finish_reason=req.status.value if rid in finished else None,
                stop_reason=req.stop_reason, num_cached_tokens=max(req.num_cached_tokens, 0),
                pooled=result.pooled.get(rid),
                scheduled_at=req.scheduled_at if tok is not None and s.output_index == 0 else 0.0))
        prompt_tokens = sum(max(0, min(s.num_computed_tokens + s.num_new_tokens, s.request.num_prompt_tokens)
                                - s.num_computed_tokens) for s in sched.scheduled)
        generated = sum(len(o.new_token_ids) for o in outputs)  # a verify step emits several tokens a request
        return EngineCoreOutputs(self.engine_index, outputs, self.stats(prompt_tokens, generated))

    def _fail_requests(self, failed: dict[str, str]) -> None:
        """End the requests the runner could not serve (their adapter became unreadable) as "abort" with the reason;
        the engine goes on."""
        for rid, why in failed.items():
            req = self.scheduler.requests.get(rid)
            if req is None or req.is_finished:
                continue
            logger.warning("request %s: %s; aborted", rid, why)
            self.scheduler.abort_requests([rid])
            self._rejected.append(EngineCoreOutput(rid, [], finish_reason="abort", stop_reason=why))

    def stats(self, step_prompt_tokens: int = 0, step_generation_tokens: int = 0) -> SchedulerStats:
        """The scheduler's state; the step counts belong to the step whose outputs they come with."""
        stats = SchedulerStats(self.scheduler.num_running, self.scheduler.num_waiting, self.kv.usage,
                               self.kv.num_blocks, self.kv.num_free_blocks, self.kv.prefix_queries,
                               self.kv.prefix_hits, self.scheduler.num_preemptions,
                               num_paused_steps=self.scheduler.fair.num_paused_steps,
                               step_prompt_tokens=step_prompt_tokens, step_generation_tokens=step_generation_tokens)
        sp = self.speculation
        if sp is not None:
            stats.spec_num_drafts, stats.spec_num_draft_tokens = sp.num_drafts, sp.num_draft_tokens
            stats.spec_num_accepted_tokens = sp.num_accepted_tokens
            stats.spec_accepted_per_pos = list(sp.accepted_per_pos)
        return stats

    # ---- utility methods (callable over the wire by name)
    def get_stats(self) -> dict:
        import msgspec
        return msgspec.structs.asdict(self.stats())

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def sleep(self, level: int = 1) -> bool:
        """Stop stepping and drop the prefix cache (weights stay; a GPU build could offload them here)."""
        self._sleeping = True
        self.kv.reset_prefix_cache()
        return True

    def wake_up(self) -> bool:
        self._sleeping = False
        return True

    def is_sleeping(self) -> bool:
        return self._sleeping

    def pause(self) -> bool:
        self._paused = True
        return True

    def resume(self) -> bool:
        self._paused = False
        return True

    def is_paused(self) -> bool:
        return self._paused

    def ping(self) -> str:
        self.executor.check_health()
        return "pong"

    # ---- LoRA adapters (utility calls; the frontend fans them out to every engine core, and the executor's
    # control call reaches every tensor-parallel rank)
    def _check_lora_enabled(self) -> None:
        if not self.config.lora.enable_lora:
            raise InvalidRequest("LoRA is not enabled on this engine (start it with --enable-lora)")

    def add_lora(self, lora_id: int, name: str, path: str) -> bool:
        """Every rank reads its shard of the adapter; where some rank failed, the ranks that loaded it drop it."""
        self._check_lora_enabled()
        try:
            added = self.executor.call_all("add_lora", lora_id, name, path)
        except ControlCallError as e:
            if lora_id not in self.loras and any(o is True for o in e.outcomes):
                self._undo_add(lora_id)
            raise
        self.loras[lora_id] = name
        return added[0]

    def _undo_add(self, lora_id: int) -> None:
        try:
            self.executor.call_all("remove_lora", lora_id)
        except ControlCallError as e:
            logger.error("LoRA id %d: could not drop it from the ranks that loaded it: %s", lora_id, e)

    def remove_lora(self, lora_id: int) -> bool:
        """Refused while a request of this engine uses the adapter (its KV and device slot depend on it), counting
        requests still waiting for their grammar (not yet scheduled)."""
        self._check_lora_enabled()
        users = sum(1 for r in (*self.scheduler.requests.values(), *self.grammars.compiling) if r.lora_id == lora_id)
        if users:
            raise InvalidRequest(f"LoRA id {lora_id} is in use by {users} request(s) on engine {self.engine_index}")
        removed = self.executor.call_all("remove_lora", lora_id)
        self.loras.pop(lora_id, None)
        return removed[0]

    def list_loras(self) -> list[list]:
        """[[lora id, name], ...] of the adapters loaded on this engine, asked of every rank (they must agree)."""
        if not self.config.lora.enable_lora:
            return []
        per_rank = self.executor.call_all("list_loras")
        if any(r != per_rank[0] for r in per_rank):
            raise RuntimeError(f"the tensor-parallel ranks hold different adapters: {per_rank}")
        return per_rank[0]

    def shutdown(self) -> None:
        """Stop the workers (tensor parallelism) and the grammar threads; the in-process runner needs nothing."""
        self.structured.shutdown()
        self.executor.shutdown()

    UTILITY_METHODS = frozenset({"get_stats", "reset_prefix_cache", "sleep", "wake_up", "is_sleeping", "pause",
                                 "resume", "is_paused", "ping", "add_lora", "remove_lora",
                                 "list_loras"})
