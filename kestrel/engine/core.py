"""EngineCore: owns the scheduler, the KV manager and the executor (the model runner in-process, or tensor-parallel
workers); step() = schedule -> execute -> update.
Runs in-process (LLM.generate) or in its own process driven over ZeroMQ (ipc/core_proc.py)."""
from __future__ import annotations

import logging
import time

from kestrel.config import EngineConfig
from kestrel.engine.grammar_steps import GrammarSteps
from kestrel.engine.kv_cache import KVCacheManager
from kestrel.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from kestrel.engine.request import Request, RequestStatus
from kestrel.engine.scheduler import Scheduler
from kestrel.executor import make_executor
from kestrel.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, engine_index: int = 0, progress: bool = True):
        t0 = time.perf_counter()
        self.config = config
        self.engine_index = engine_index
        self.executor = ex = make_executor(config, progress)
        self.runner = ex.runner  # the in-process ModelRunner (None with tensor-parallel workers)
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
        self.kv = KVCacheManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
                                 ex.kv_cache_groups)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len,
                                   config.lora.max_loras if config.lora.enable_lora else 0)
        self.eos_token_id = self.model_config.eos_token_id
        self._sleeping = False
        self._paused = False
        mode = config.scheduler.async_scheduling
        self.pipelined = mode == "on" or (mode == "auto" and self.device.type == "cuda")
        self._inflight = None
        self.structured = StructuredOutputManager(
            self.tokenizer, int(self.model_config.vocab_size), self.eos_token_id,
            config.scheduler.max_num_seqs, pin=self.device.type == "cuda",
            fill_threads=config.scheduler.structured_output_threads)
        self.grammars = GrammarSteps(self.structured, ex)
        self._rejected: list[EngineCoreOutput] = []  # finished before they could run (grammar failed, adapter gone)
        logger.info("KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB); ready in %.1f s", num_blocks,
                    config.cache.block_size, num_blocks * config.cache.block_size,
                    num_blocks * ex.bytes_per_block / 2**20, time.perf_counter() - t0)

    # ---- requests
    def add_request(self, r: EngineCoreRequest) -> None:
        req = Request(r.request_id, list(r.prompt_token_ids), r.sampling_params, r.eos_token_id
                      if r.eos_token_id is not None else self.eos_token_id, r.max_tokens, r.priority, r.arrival_time,
                      extras=r.extras)
        if req.lora_id:
            lora = self.runner.lora if self.runner is not None else None
            if lora is None or req.lora_id not in lora.registered:
                # unloaded while the request was on its way: end it (the frontend sees "abort"), never hang it
                logger.warning("request %s: LoRA id %d is not loaded; aborted", r.request_id, req.lora_id)
                self._rejected.append(EngineCoreOutput(r.request_id, [], finish_reason="abort"))
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
        return (self.scheduler.has_unfinished() or self._inflight is not None or bool(self._rejected)
                or bool(self.grammars.compiling))

    # ---- one step
    def _pipeline_ok(self) -> bool:
        """Pipelined decode (schedule and launch step N+1 before step N's tokens are read) is on when the
        device runs asynchronously and no live request needs its previous tokens on the host to sample
        (penalties) or asks for logprobs."""
        return self.pipelined and self.scheduler.num_sync_requests == 0

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
        sched = self.scheduler.schedule()
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
        return self.executor.launch(sched.step, prev, sample=not GrammarSteps.samples_later(sched),
                                    before_forward=(lambda: self.grammars.sample(prev)) if prev is not None else None)

    def _take_rejected(self) -> list[EngineCoreOutput]:
        out, self._rejected = self._rejected, []
        return out

    def _outputs(self, sched, result) -> EngineCoreOutputs:
        finished = {r.request_id for r in self.scheduler.on_result(sched, result.sampled)}
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
            outputs.append(EngineCoreOutput(
                rid, [tok] if tok is not None else [],
                new_logprobs=[lp] if lp is not None else None,
                prompt_logprobs=plp,
                finish_reason=req.status.value if rid in finished else None,
                stop_reason=req.stop_reason, num_cached_tokens=max(req.num_cached_tokens, 0)))
        return EngineCoreOutputs(self.engine_index, outputs, self.stats())

    def stats(self) -> SchedulerStats:
        return SchedulerStats(self.scheduler.num_running, self.scheduler.num_waiting, self.kv.usage,
                              self.kv.num_blocks, self.kv.num_free_blocks, self.kv.prefix_queries,
                              self.kv.prefix_hits, self.scheduler.num_preemptions)

    def finish_requests(self, request_ids: list[str]) -> None:
        """Called by the frontend when a stop string ended a request."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

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

    # ---- LoRA adapters (utility calls; the frontend fans them out to every engine core)
    def _lora_manager(self):
        if self.runner is None or self.runner.lora is None:
            raise ValueError("LoRA is not enabled on this engine (start it with --enable-lora)")
        return self.runner.lora

    def add_lora(self, lora_id: int, name: str, path: str) -> bool:
        return self._lora_manager().add(lora_id, name, path)

    def remove_lora(self, lora_id: int) -> bool:
        """Refused while a request of this engine uses the adapter (its KV and device slot depend on it)."""
        users = sum(1 for r in self.scheduler.requests.values() if r.lora_id == lora_id)
        if users:
            raise ValueError(f"LoRA id {lora_id} is in use by {users} request(s) on engine {self.engine_index}")
        return self._lora_manager().remove(lora_id)

    def list_loras(self) -> list[list]:
        """[[lora id, name], ...] of the adapters loaded on this engine."""
        lora = self.runner.lora if self.runner is not None else None
        return sorted([i, n] for i, n in lora.list().items()) if lora is not None else []

    def shutdown(self) -> None:
        """Stop the workers (tensor parallelism); the in-process runner needs nothing."""
        self.executor.shutdown()

    UTILITY_METHODS = frozenset({"get_stats", "reset_prefix_cache", "sleep", "wake_up", "is_sleeping", "pause",
                                 "resume", "is_paused", "ping", "finish_requests", "add_lora", "remove_lora",
                                 "list_loras"})
