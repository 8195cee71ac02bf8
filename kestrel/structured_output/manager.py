"""StructuredOutputManager: owned by the engine core. Compiles grammars on worker threads, off the engine loop
(a request waits for its compile without holding up others; one compile per distinct constraint, cached), gives
each request its own matcher, advances the matchers by a step's sampled tokens, and fills the token bitmask of a
step's constrained rows on the host.

The fill is the expensive part (xgrammar checks every token whose fate depends on the parser's stack: inside a
JSON string, thousands a row). start_step() advances the grammars by the step's tokens itself, in one batch call,
then hands the fill to a pool of threads, each filling a slice of the rows in one call into xgrammar (which
releases the GIL); it returns at once, so the engine loop goes on with its own work (outputs, scheduling, the
next step's inputs) while the rows fill, and waits for the job only where the step samples."""
from __future__ import annotations

import logging
import os
import sys
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kestrel.core.sampling_params import StructuredOutputsParams
from kestrel.structured_output.bitmask import StepBitmask, bitmask_width
from kestrel.structured_output.compile_lanes import CompileLanes, CompileTimeout
from kestrel.core.grammar import build_grammar

logger = logging.getLogger(__name__)

CACHE_SIZE = 1024  # compiled grammars kept (least recently used out)
MIN_SLICE_ROWS = 4  # a fill thread's share of a step's rows is at least this (a row costs ~20-100 us)


def default_fill_threads() -> int:
    """The CPUs this process may use, less two (the engine loop and the device driver's own threads), 1..16."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(16, cpus - 2))


class RequestGrammar:
    """One request's matcher: accepts its sampled tokens, and knows when the grammar is complete (its stop token
    accepted; nothing else ends a matcher)."""

    def __init__(self, matcher):
        self.matcher = matcher
        self.stop_ids = frozenset(matcher.stop_token_ids)
        self.terminated = False
        self.num_rejected = 0

    def accept(self, token: int) -> bool:
        if self.terminated:
            return True  # finished (stop token accepted): later tokens of a step in flight are not constrained
        ok = self.matcher.accept_token(token)
        self.accepted(token, ok)
        return ok

    def accepted(self, token: int, ok: bool) -> None:
        if not ok:
            self.num_rejected += 1
            logger.warning("structured output: token %d rejected by the grammar", token)
        elif token in self.stop_ids:
            self.terminated = self.matcher.is_terminated()


class FillJob:
    """A step's bitmask being filled by the pool; result() waits for it."""

    def __init__(self, bitmask: StepBitmask, futures: list[Future], tail: int):
        self._bitmask = bitmask
        self._futures = futures
        self._tail = tail

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def result(self) -> StepBitmask:
        for f in self._futures:
            f.result()
        if self._tail:  # xgrammar may leave the bits past the vocabulary's end set: those ids are no tokens
            self._bitmask.mask[:, -1] &= self._tail
            self._tail = 0
        return self._bitmask


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None, max_rows: int, pin: bool = False,
                 fill_threads: int = 0, compile_timeout: float = 30.0):
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        # The grammar's vocabulary: the tokenizer's ids, not the model's padding beyond them (xgrammar would treat
        # each padding id as a special token, which makes every fill far slower; bitmask.py masks them instead).
        real = len(tokenizer) if tokenizer is not None else vocab_size
        self.vocab_size = min(vocab_size, max(real, (eos_token_id or 0) + 1))
        self.width = bitmask_width(self.vocab_size)
        self.fill_threads = fill_threads or default_fill_threads()
        self._max_rows = max_rows
        self._pin = pin
        self._lanes = CompileLanes(compile_timeout)
        self._compiler = None
        self._compiler_lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._buffers: list[torch.Tensor] = []
        self._flip = 0
        self._pool: ThreadPoolExecutor | None = None
        self._local = threading.local()
        self.num_compiles = 0

    # ---- compile (worker threads)
    def _get_compiler(self):
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                if self.tokenizer is None:
                    raise ValueError("structured outputs need the model's tokenizer")
                stop = [self.eos_token_id] if self.eos_token_id is not None else None
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=stop)
                self._compiler = xgr.GrammarCompiler(info, max_threads=min(8, os.cpu_count() or 1),
                                                     cache_enabled=False)
            return self._compiler

    def _compile(self, kind: str, spec: str):
        compiled = self._get_compiler().compile_grammar(build_grammar(kind, spec))
        self.num_compiles += 1
        return compiled

    def submit(self, params: StructuredOutputsParams) -> Future:
        """The compiled grammar of a constraint, as a future (the same future for the same constraint; one that
        ran out of its compile budget stays failed, so sending it again costs no thread)."""
        key = (params.kind, params.spec)
        fut = self._cache.get(key)
        error = fut.exception() if fut is not None and fut.done() else None
        if fut is None or (error is not None and not isinstance(error, CompileTimeout)):
            fut = self._cache[key] = self._lanes.submit(self._compile, *key)
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return fut

    def new_request_grammar(self, compiled, eos_token_id: int | None) -> RequestGrammar:
        import xgrammar as xgr

        stop = [eos_token_id] if eos_token_id is not None and eos_token_id != self.eos_token_id else None
        return RequestGrammar(xgr.GrammarMatcher(compiled, override_stop_tokens=stop))

    # ---- a step's tokens and bitmask (engine loop)
    def start_step(self, accepts: list[tuple[RequestGrammar, int]],
                   rows: list[tuple[int, RequestGrammar]]) -> FillJob | None:
        """Advance each grammar by its request's sampled token (`accepts`, here), then fill the bitmask of a step's
        constrained rows ((sampling row, grammar) pairs) on the pool: each thread fills a slice of the rows in one
        xgrammar call, the GIL free. Returns with the fill still running (None when no row is to be filled); the
        grammars must not be touched until the job is done. A grammar that takes its stop token is complete: it
        fills no row, and takes no more tokens (later tokens of a step in flight are free). The host buffer
        stays valid until the next start_step but one."""
        accepts = [(g, t) for g, t in accepts if not g.terminated]
        ending = {id(g) for g, t in accepts if t in g.stop_ids}
        live = [(r, g) for r, g in rows if not g.terminated and id(g) not in ending]
        if len(live) > self._max_rows:
            raise RuntimeError(f"{len(live)} constrained rows exceed the bitmask's {self._max_rows}")
        self._accept(accepts)
        if not live:
            return None
        if self._pool is None:
            self._buffers = [torch.empty((self._max_rows, self.width), dtype=torch.int32, pin_memory=self._pin)
                             for _ in range(2)]
            self._pool = ThreadPoolExecutor(self.fill_threads, thread_name_prefix="kestrel-bitmask")
            # a fill thread needs the GIL for a moment to start its xgrammar call; with the default 5 ms switch
            # interval it can wait that long behind the engine loop's Python, longer than a decode step
            sys.setswitchinterval(min(sys.getswitchinterval(), 5e-4))
        buf = self._buffers[self._flip]
        self._flip ^= 1
        n = len(live)
        slices = min(self.fill_threads, max(1, n // MIN_SLICE_ROWS))
        bounds = [n * i // slices for i in range(slices + 1)]
        futures = [self._pool.submit(self._fill_slice, [g.matcher for _, g in live[a:b]], buf, list(range(a, b)))
                   for a, b in zip(bounds, bounds[1:])]
        return FillJob(StepBitmask(buf[:n], [r for r, _ in live]), futures, (1 << (self.vocab_size % 32)) - 1)

    @staticmethod
    def _accept(accepts: list[tuple[RequestGrammar, int]]) -> None:
        """The step's tokens into their grammars, here on the engine loop, in one xgrammar call (~4 us a
        grammar): done by the pool, every slice would need the GIL back from this loop to report it, and that
        hand-over cost ~3 ms a step with 14 threads (H200, session 6)."""
        if len(accepts) == 1:
            accepts[0][0].accept(accepts[0][1])
        elif accepts:
            import xgrammar as xgr

            ok = xgr.BatchGrammarMatcher.batch_accept_token([g.matcher for g, _ in accepts], [t for _, t in accepts])
            for (g, t), accepted in zip(accepts, ok):
                g.accepted(t, accepted)

    def _fill_slice(self, matchers: list, buf: torch.Tensor, index: list[int]) -> None:
        import xgrammar as xgr

        batch = getattr(self._local, "batch", None)
        if batch is None:
            batch = self._local.batch = xgr.BatchGrammarMatcher(1)  # this thread fills its slice itself
        batch.batch_fill_next_token_bitmask(matchers, buf, index)

    def fill_bitmask(self, grammars: list[RequestGrammar | None]) -> StepBitmask | None:
        """The bitmask of sampling rows 0..len-1 (None: an unconstrained row), filled now."""
        job = self.start_step([], [(i, g) for i, g in enumerate(grammars) if g is not None])
        return job.result() if job is not None else None

    def shutdown(self) -> None:
        self._lanes.shutdown()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
