"""A request's output constraint, parsed by xgrammar before the request is accepted: on threads, off the event
loop (a hostile schema parses for seconds), each parse within a time budget (--grammar-parse-timeout), a few at
a time (the engine core's CompileLanes: a small schema parses beside slow ones, not behind them).

xgrammar cannot be interrupted, so a parse past its budget answers its request with a 400 at once but keeps
its thread until it ends (a bounded number of them: past that, parses wait in the queue, their budget running
from submission, a client at a time in turn); the constraint is remembered as too slow, so sending it
again costs nothing. The repeat-count limit in kestrel/core/grammar.py refuses the known slow constructs before
any parse, which keeps such runaway threads rare; a subprocess could be killed instead, but costs a process
start (or a pool of warm ones, each with its own xgrammar) for every new constraint."""
from __future__ import annotations

import asyncio
from collections import OrderedDict

from kestrel.core.grammar import check_grammar
from kestrel.core.sampling_params import StructuredOutputsParams
from kestrel.errors import InvalidRequest
from kestrel.structured_output.compile_lanes import CompileLanes, CompileTimeout

TOO_SLOW_KEPT = 1024


class GrammarCheck:
    def __init__(self, budget: float):
        self.budget = budget
        self._lanes = CompileLanes(budget, "--grammar-parse-timeout")
        self._too_slow: OrderedDict[tuple[str, str], str] = OrderedDict()

    async def check(self, so: StructuredOutputsParams | None, param: str = "structured_outputs",
                    client=None) -> None:
        """Raise InvalidRequest (a 400) when the constraint does not parse, or not within the budget (counted from
        now: a parse that waits for a lane that long is refused the same way). `client` (client_of): queued
        parses start a client at a time in turn, so one client's flood of slow schemas does not queue others'."""
        if so is None:
            return
        key = (so.kind, so.spec)
        if key in self._too_slow:
            raise InvalidRequest(self._too_slow[key], param=param)
        try:
            await asyncio.wrap_future(self._lanes.submit(check_grammar, so.kind, so.spec, param, client=client))
        except CompileTimeout:
            message = (f"{param}: the {so.kind} constraint did not parse within the {self.budget:g} s budget "
                       f"(--grammar-parse-timeout); simplify it")
            self._too_slow[key] = message
            if len(self._too_slow) > TOO_SLOW_KEPT:
                self._too_slow.popitem(last=False)
            raise InvalidRequest(message, param=param) from None

    def shutdown(self) -> None:
        self._lanes.shutdown()
