"""Grammars, an engine add-on: the engine core's side of structured outputs. Constrained requests wait here
until their grammar compiled (the others are not held up); per step, the grammars take the tokens of a collected
step, and the fill pool fills the token bitmask of a launched step whose sampling waits for it, while the engine
loop goes on.

Pipelined, a constrained step N+1 is launched without sampling: once step N's tokens are on the host its grammars
take them and the pool fills N+1's bitmask, while the engine loop returns N's outputs and prepares N+2; N+1
samples when N+2 needs its tokens (the runner's before_forward), after N+2's inputs are staged, so the device
waits for the fill only if the fill outlasts N+1's forward. The runner's grammar add-on applies the bitmask."""
from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED, wait

from kestrel.core.engine_addon import EngineAddon
from kestrel.engine.request import Request
from kestrel.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class Grammars(EngineAddon):
    name = "grammars"

    def __init__(self, manager: StructuredOutputManager, executor, scheduler=lambda: None):
        self.manager, self.executor = manager, executor
        self._scheduler = scheduler  # () -> the engine's Scheduler
        self.compiling: list[Request] = []  # waiting for their grammar
        self._fill = None  # (handle, FillJob): the bitmask being filled for a launched step that samples later

    @classmethod
    def build(cls, core) -> "Grammars":
        sc, mc = core.config.scheduler, core.model_config
        manager = StructuredOutputManager(core.tokenizer, int(mc.vocab_size), mc.eos_token_id, sc.max_num_seqs,
                                          pin=core.device.type == "cuda", fill_threads=sc.structured_output_threads,
                                          compile_timeout=sc.grammar_compile_timeout)
        return cls(manager, core.executor, lambda: core.scheduler)

    def hold(self, req: Request) -> bool:
        if req.sampling_params.structured_outputs is None:
            return False
        self.submit(req)  # scheduled once its grammar compiled
        return True

    def submit(self, req: Request) -> None:
        if any(c.request_id == req.request_id for c in self.compiling):
            raise ValueError(f"duplicate request id {req.request_id!r}")
        req.grammar = self.manager.submit(req.sampling_params.structured_outputs)  # a future until compiled
        self.compiling.append(req)

    def held(self) -> list[Request]:
        return self.compiling

    def release(self, idle: bool) -> list[tuple[str, str]]:
        """Hand requests whose grammar compiled to the scheduler; returns (id, reason) of those that failed.
        `idle` (nothing else to do): wait a moment for a compile instead of spinning."""
        if not self.compiling:
            return []
        scheduler = self._scheduler()
        if idle:
            wait([r.grammar for r in self.compiling], timeout=0.01, return_when=FIRST_COMPLETED)
        waiting, failed = [], []
        for req in self.compiling:
            if not req.grammar.done():
                waiting.append(req)
                continue
            try:
                req.grammar = self.manager.new_request_grammar(req.grammar.result(), req.eos_token_id)
                scheduler.add_request(req)
            except Exception as e:  # noqa: BLE001 - the request fails, the engine goes on
                logger.warning("request %s failed before running: %s", req.request_id, e)
                failed.append((req.request_id, f"structured output failed: {e}"))
        self.compiling = waiting
        return failed

    def abort(self, ids: set[str]) -> list[str]:
        aborted = [r.request_id for r in self.compiling if r.request_id in ids]
        self.compiling = [r for r in self.compiling if r.request_id not in ids]
        return aborted

    def samples_later(self, sched) -> bool:
        """A step with grammar-constrained sampling rows samples once the host filled its bitmask."""
        return any(s.samples and s.request.grammar is not None for s in sched.scheduled)

    def after_launch(self, sched, inf) -> None:
        self.advance(None, None, (sched, inf))

    def after_collect(self, sched, result, pending) -> None:
        self.advance(sched, result, pending)

    def advance(self, done, result, pending) -> None:
        """The grammars take the tokens of a collected step (`done`, its `result`), then the bitmask of `pending`
        (sched, handle: a launched step whose sampling waits for it) starts filling."""
        accepts = []
        if done is not None:
            for s in done.scheduled:
                req = s.request
                if req.grammar is not None and not req.is_finished:  # not finished or aborted meanwhile
                    tok = result.sampled.get(req.request_id)
                    if tok is not None:
                        accepts.append((req.grammar, tok))
        rows = []
        if pending is not None and pending[1].sample_pending:
            sched, inf = pending
            rows = [(inf.rows[s.request.request_id], s.request.grammar) for s in sched.scheduled
                    if s.request.grammar is not None and not s.request.is_finished
                    and s.request.request_id in inf.rows]
        if accepts or rows:
            job = self.manager.start_step(accepts, rows)
            if job is not None:
                self._fill = (pending[1], job)

    def sample(self, inf) -> None:
        """Queue the sampling of a launched step whose sampling waits for its bitmask (no-op otherwise)."""
        if not inf.sample_pending:
            return
        bitmask = None
        if self._fill is not None and self._fill[0] is inf:
            bitmask = self._fill[1].result()
            self._fill = None
        self.executor.sample(inf, bitmask)

    def shutdown(self) -> None:
        self.manager.shutdown()
