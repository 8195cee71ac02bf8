"""StructuredOutputManager: owned by the engine core. Compiles grammars on worker threads, off the engine loop
(a request waits for its compile without holding up others; one compile per distinct constraint, cached), gives
each request its own matcher, and fills the token bitmask of a step's sampling rows on the host."""
from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kestrel.engine.sampling_params import StructuredOutputsParams
from kestrel.structured_output.bitmask import bitmask_width
from kestrel.structured_output.grammar import build_grammar

logger = logging.getLogger(__name__)

COMPILE_THREADS = 2
CACHE_SIZE = 1024  # compiled grammars kept (least recently used out)
FILL_THREADS = min(8, os.cpu_count() or 1)  # xgrammar batch fill: a step's rows in parallel


class RequestGrammar:
    """One request's matcher: accepts its sampled tokens, and reports when the grammar is complete."""

    def __init__(self, matcher):
        self.matcher = matcher
        self.num_rejected = 0

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def accept(self, token: int) -> bool:
        if self.matcher.is_terminated():
            return True  # finished (stop token accepted): later tokens of a step in flight are not constrained
        ok = self.matcher.accept_token(token)
        if not ok:
            self.num_rejected += 1
            logger.warning("structured output: token %d rejected by the grammar", token)
        return ok


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None, max_rows: int, pin: bool = False):
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        # The grammar's vocabulary: the tokenizer's ids, not the model's padding beyond them (xgrammar would treat
        # each padding id as a special token, which makes every fill far slower; bitmask.py masks them instead).
        real = len(tokenizer) if tokenizer is not None else vocab_size
        self.vocab_size = min(vocab_size, max(real, (eos_token_id or 0) + 1))
        self.width = bitmask_width(self.vocab_size)
        self._max_rows = max_rows
        self._pin = pin
        self._executor: ThreadPoolExecutor | None = None
        self._compiler = None
        self._compiler_lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._buffers: list[torch.Tensor] = []
        self._flip = 0
        self._batch = None
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
                self._compiler = xgr.GrammarCompiler(info, max_threads=FILL_THREADS, cache_enabled=False)
            return self._compiler

    def _compile(self, kind: str, spec: str):
        compiled = self._get_compiler().compile_grammar(build_grammar(kind, spec))
        self.num_compiles += 1
        return compiled

    def submit(self, params: StructuredOutputsParams) -> Future:
        """The compiled grammar of a constraint, as a future (the same future for the same constraint)."""
        key = (params.kind, params.spec)
        fut = self._cache.get(key)
        if fut is None or (fut.done() and fut.exception() is not None):
            if self._executor is None:
                self._executor = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="kestrel-grammar")
            fut = self._cache[key] = self._executor.submit(self._compile, *key)
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return fut

    def new_request_grammar(self, compiled, eos_token_id: int | None) -> RequestGrammar:
        import xgrammar as xgr

        stop = [eos_token_id] if eos_token_id is not None and eos_token_id != self.eos_token_id else None
        return RequestGrammar(xgr.GrammarMatcher(compiled, override_stop_tokens=stop))

    # ---- the step's bitmask (engine loop)
    def fill_bitmask(self, grammars: list[RequestGrammar | None]) -> torch.Tensor | None:
        """One bitmask row per sampling row (all ones where unconstrained); None when nothing is constrained.
        Two host buffers alternate, so a step's mask is not overwritten while its copy to the device is queued."""
        rows = [i for i, g in enumerate(grammars) if g is not None and not g.terminated]
        if not rows:
            return None
        if not self._buffers:
            import xgrammar as xgr

            self._buffers = [torch.empty((self._max_rows, self.width), dtype=torch.int32, pin_memory=self._pin)
                             for _ in range(2)]
            self._batch = xgr.BatchGrammarMatcher(FILL_THREADS)
        if len(grammars) > self._max_rows:
            raise RuntimeError(f"{len(grammars)} sampling rows exceed the bitmask's {self._max_rows}")
        buf = self._buffers[self._flip][:len(grammars)]
        self._flip ^= 1
        buf.fill_(-1)
        matchers = [grammars[i].matcher for i in rows]
        if len(rows) == 1:
            matchers[0].fill_next_token_bitmask(buf, rows[0])
        else:
            self._batch.batch_fill_next_token_bitmask(matchers, buf, rows)
        return buf

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
