"""EngineCore: owns the scheduler, the KV manager and the executor (the model runner in-process, or tensor-parallel
workers); step() = schedule -> execute -> update. Features hook in as engine add-ons (kestrel/engine/addons/):
the core calls their hooks and knows none by name.
Runs in-process (LLM.generate) or in its own process driven over ZeroMQ (ipc/core_proc.py)."""
from __future__ import annotations

import logging
import time

from kestrel.config import EngineConfig
from kestrel.engine.addons import EngineAddons, check_config
from kestrel.engine.core_control import CORE_UTILITY_METHODS, CoreControl
from kestrel.engine.core_parts import log_ready, scheduler_stats, start_executor, step_outputs
from kestrel.engine.kv import KVCacheManager
from kestrel.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from kestrel.engine.request import Request
from kestrel.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


class EngineCore(CoreControl):
    def __init__(self, config: EngineConfig, engine_index: int = 0, progress: bool = True):
        t0 = time.perf_counter()
        self.config, self.engine_index = config, engine_index
        check_config(config)  # before the model loads
        self.executor, num_blocks = start_executor(config, progress)
        self.model_config, self.tokenizer, self.device = (self.executor.model_config, self.executor.tokenizer,
                                                          self.executor.device)
        self.max_model_len, self.eos_token_id = self.model_config.max_model_len, self.model_config.eos_token_id
        # an encoder's pooler reads every prompt token's hidden state: a cached prefix would skip them
        self.kv = KVCacheManager(num_blocks, enable_prefix_caching=config.cache.enable_prefix_caching
                                 and not self.model_config.encoder_only, groups=self.executor.kv_cache_groups)
        self.addons = EngineAddons(self)
        self._hooks = self.addons.hooks
        self.UTILITY_METHODS = CORE_UTILITY_METHODS | self.addons.utility.keys()
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len, self.addons.lookahead_slots,
                                   self._hooks["can_schedule"])
        self._sleeping = self._paused = False
        mode = config.scheduler.async_scheduling
        self.pipelined = mode == "on" or (mode == "auto" and self.device.type == "cuda")
        self._inflight = None
        self._rejected: list[EngineCoreOutput] = []  # finished before they could run (an add-on refused them)
        log_ready(self.executor, self.scheduler, num_blocks, config.cache.block_size, t0)

    def __getattr__(self, name: str):
        """An add-on by its name (core.<name>; None where its feature is off), or an add-on's utility method."""
        if name.startswith("_") or "addons" not in self.__dict__:
            raise AttributeError(name)
        return self.__dict__["addons"].get(name)

    # ---- requests
    def add_request(self, r: EngineCoreRequest) -> None:
        req = Request(r.request_id, list(r.prompt_token_ids), r.sampling_params, self.eos_token_id, r.max_tokens,
                      r.priority, r.arrival_time, extras=r.extras, group_id=r.group_id)
        why = next((why for admit in self._hooks["admit"] if (why := admit(req)) is not None), None)
        if why is not None:
            return self._refuse(r.request_id, why)
        if self._hooks["hold"] and req.request_id in self.scheduler.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        if not any(hold(req) for hold in self._hooks["hold"]):
            self.scheduler.add_request(req)

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        held = [rid for abort in self._hooks["abort"] for rid in abort(set(request_ids))]
        return held + [r.request_id for r in self.scheduler.abort_requests(request_ids)]

    def has_unfinished_requests(self) -> bool:
        """Whether step() has work now. Asleep or paused, only what is owed (the step in flight, requests that
        finished before running): the queued ones wait, and the engine loop idles (issue 33: /health took 30 s)."""
        if self._paused or self._sleeping:
            return self._inflight is not None or bool(self._rejected)
        return (self.scheduler.has_unfinished() or self._inflight is not None or bool(self._rejected)
                or any(held() for held in self._hooks["held"]))

    # ---- one step
    def _pipeline_ok(self) -> bool:
        """Pipelined decode (schedule and launch step N+1 before step N's tokens are read) is on when the
        device runs asynchronously, no live request needs its previous tokens on the host to sample (penalties)
        or asks for logprobs, and every add-on allows it."""
        return (self.pipelined and self.scheduler.num_sync_requests == 0
                and all(ok() for ok in self._hooks["allows_pipelining"]))

    def step(self) -> EngineCoreOutputs:
        """Schedule, launch, collect. Pipelined (see _pipeline_ok), step N+1 is scheduled and launched before
        step N's tokens are collected; an add-on may have a step sample late (its `sample` hook)."""
        hooks = self._hooks
        idle = not self.scheduler.has_unfinished() and self._inflight is None
        self._rejected += [EngineCoreOutput(rid, [], finish_reason="abort", stop_reason=why)
                           for release in hooks["release"] for rid, why in release(idle)]
        if self._inflight is not None:
            prev_sched, prev = self._inflight
            self._inflight = None
            if self._pipeline_ok() and not (self._paused or self._sleeping):
                sched = self._schedule()
                inf = self._launch(sched, prev)  # an empty step still delivers finished ids
                if not sched.is_empty:
                    self._inflight = (sched, inf)
                    self.scheduler.on_launch(sched)
            self._sample(prev)
            result = self.executor.collect(prev)
            for after in hooks["after_collect"]:
                after(prev_sched, result, self._inflight)
            return self._outputs(prev_sched, result)
        if self._paused or self._sleeping:
            return EngineCoreOutputs(self.engine_index, self._take_rejected(), self.stats())
        proposed = {}
        for propose in hooks["propose"]:
            proposed.update(propose(self.scheduler.running))
        sched = self._schedule(proposed)
        inf = self._launch(sched)
        self.scheduler.on_launch(sched)
        for after in hooks["after_launch"]:
            after(sched, inf)
        self._sample(inf)
        if self._pipeline_ok() and inf.samples:
            self._inflight = (sched, inf)
            return EngineCoreOutputs(self.engine_index, self._take_rejected(), self.stats())
        result = self.executor.collect(inf)
        for after in hooks["after_collect"]:
            after(sched, result, None)
        return self._outputs(sched, result)

    def _schedule(self, proposed: dict | None = None):
        """The scheduler's next step; the requests it finished "length" (outgrown the KV pool) are reported."""
        sched = self.scheduler.schedule(proposed) if proposed else self.scheduler.schedule()
        self._rejected += [EngineCoreOutput(r.request_id, [], finish_reason=r.status.value,
                                            num_cached_tokens=max(r.num_cached_tokens, 0)) for r in sched.cut]
        return sched

    def _launch(self, sched, prev=None):
        """Queue the forward; a step that an add-on samples later samples once `sample` is called. `prev` samples
        before this step's forward, which reads its tokens."""
        later = any(samples_later(sched) for samples_later in self._hooks["samples_later"])
        before = (lambda: self._sample(prev)) if prev is not None and self._hooks["sample"] else None
        return self.executor.launch(sched.step, prev, sample=not later, before_forward=before)

    def _sample(self, inf) -> None:
        for sample in self._hooks["sample"]:
            sample(inf)

    def _refuse(self, rid: str, why: str) -> None:
        logger.warning("request %s: %s; aborted", rid, why)
        self._rejected.append(EngineCoreOutput(rid, [], finish_reason="abort", stop_reason=why))

    def _take_rejected(self) -> list[EngineCoreOutput]:
        out, self._rejected = self._rejected, []
        return out

    def _outputs(self, sched, result) -> EngineCoreOutputs:
        for rid, why in result.failed.items():  # the runner could not serve them (an adapter became unreadable)
            if self.scheduler.abort_requests([rid]):  # not finished or aborted meanwhile
                self._refuse(rid, why)
        finished = {r.request_id for r in self.scheduler.on_result(sched, result.sampled, result.more_sampled)}
        outputs = self._take_rejected()
        prompt_tokens, generated = step_outputs(sched, result, finished, outputs)
        for complete in self._hooks["outputs"]:
            complete(outputs, result)
        return EngineCoreOutputs(self.engine_index, outputs, self.stats(prompt_tokens, generated))

    def stats(self, step_prompt_tokens: int = 0, step_generation_tokens: int = 0) -> SchedulerStats:
        """The scheduler's state; the step counts belong to the step whose outputs they come with."""
        stats = scheduler_stats(self.scheduler, self.kv, step_prompt_tokens, step_generation_tokens)
        for fill in self._hooks["stats"]:
            fill(stats)
        return stats

    def shutdown(self) -> None:
        """Stop the add-ons' threads and the workers (tensor parallelism); the in-process runner needs nothing."""
        for stop in self._hooks["shutdown"]:
            stop()
        self.executor.shutdown()

    UTILITY_METHODS = CORE_UTILITY_METHODS  # an instance adds its add-ons' utility_methods
