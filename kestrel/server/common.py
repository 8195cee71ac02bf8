"""Helpers shared by the completions and chat handlers."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import Request

from kestrel.engine.async_engine import AsyncEngine
from kestrel.engine.outputs import RequestOutput
from kestrel.errors import ModelNotFound


@dataclass
class ServerState:
    engine: AsyncEngine
    model_name: str
    metrics: Any = None
    api_key: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    tool_parser: Any = None  # kestrel.server.tool_parsers.ToolParser (--tool-call-parser)
    enable_auto_tool_choice: bool = False
    reasoning_parser: Any = None  # kestrel.server.reasoning.ReasoningParser (--reasoning-parser)

    def check_model(self, model: str | None):
        """The LoRA adapter that `model` names (a LoRARequest), None for the base model; 404 for anything else."""
        if model is None or model == self.model_name:
            return None
        lora = self.engine.loras.adapters.get(model)
        if lora is None:
            raise ModelNotFound(f"The model `{model}` does not exist; this server serves `{self.model_name}`"
                                + (f" and the adapters {sorted(self.engine.loras.adapters)}."
                                   if self.engine.loras.adapters else "."), param="model", code="model_not_found")
        return lora


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


def sse_chunk(rid: str, obj: str, created: int, model: str, choices: list, usage: dict | None = None) -> str:
    """One streamed chunk of a completion or chat completion."""
    d = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
    if usage is not None:
        d["usage"] = usage
    return sse(d)


async def merge(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several generate() streams; leaving early cancels them all (which aborts their requests)."""
    if len(gens) == 1:
        async for item in gens[0]:
            yield 0, item
        return
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, g):
        try:
            async for item in g:
                q.put_nowait((i, item))
            q.put_nowait((i, done))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            q.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(tasks)
        while left:
            i, item = await q.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def final_outputs(gens: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    last: dict[int, RequestOutput] = {}
    async for i, out in merge(gens):
        last[i] = out
    return [last[i] for i in range(len(gens))]


async def unless_disconnected(request: Request, coro):
    """Run a non-streaming handler's work, cancelling it (and so aborting its requests) if the client leaves."""
    task = asyncio.ensure_future(coro)

    async def watch():
        while not task.done():
            if await request.is_disconnected():
                task.cancel()
                return
            await asyncio.sleep(0.5)

    watcher = asyncio.create_task(watch())
    try:
        return await task
    finally:
        watcher.cancel()
