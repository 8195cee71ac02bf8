"""Helpers shared by the completions and chat handlers."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import Request

from kestrel.config import ServerConfig
from kestrel.frontend.async_engine import AsyncEngine
from kestrel.frontend.outputs import RequestOutput
from kestrel.errors import InvalidRequest, KestrelError, ModelNotFound
from kestrel.server.grammar_check import GrammarCheck
from kestrel.server.openai_protocol import MAX_CLIENT_REQUEST_ID, error_body
from kestrel.server.response_store import ResponseStore

logger = logging.getLogger("kestrel.server")


@dataclass
class ServerState:
    engine: AsyncEngine
    model_name: str
    metrics: Any = None
    api_key: str | None = None
    server: ServerConfig = field(default_factory=ServerConfig)
    sampling_defaults: dict = field(default_factory=dict)  # from generation_config.json
    created: int = field(default_factory=lambda: int(time.time()))
    tool_parser: Any = None  # kestrel.server.tool_parsers.ToolParser (--tool-call-parser)
    enable_auto_tool_choice: bool = False
    reasoning_parser: Any = None  # kestrel.server.reasoning.ReasoningParser (--reasoning-parser)
    grammar: GrammarCheck = None  # parses output constraints off the event loop (--grammar-parse-timeout)
    model_aliases: tuple[str, ...] = ()  # more names of the base model (--served-model-name A B ...)

    responses: ResponseStore = None  # /v1/responses kept for previous_response_id (--responses-store-size)

    def __post_init__(self):
        if self.grammar is None:
            self.grammar = GrammarCheck(self.server.grammar_parse_timeout)
        if self.responses is None:
            self.responses = ResponseStore(self.server.responses_store_size, self.server.responses_store_bytes)

    def check_model(self, model: str | None):
        """The LoRA adapter that `model` names (a LoRARequest), None for the base model; 404 for anything else."""
        if model is None or model == self.model_name or model in self.model_aliases:
            return None
        lora = self.engine.loras.adapters.get(model)
        if lora is None:
            raise ModelNotFound(f"The model `{model}` does not exist; this server serves `{self.model_name}`"
                                + (f" and the adapters {sorted(self.engine.loras.adapters)}."
                                   if self.engine.loras.adapters else "."), param="model", code="model_not_found")
        return lora

    def timeout(self, req) -> float | None:
        return req.timeout if req.timeout is not None else self.server.request_timeout

    def template_kwargs(self, req) -> dict:
        """The chat template's extra variables: --default-chat-template-kwargs under the request's own."""
        return {**(self.server.default_chat_template_kwargs or {}), **(req.chat_template_kwargs or {})}

    def chat_template(self, req) -> str | None:
        """The request's own template, if it brings one and the server trusts request templates."""
        kwargs = req.chat_template_kwargs or {}
        template = req.chat_template or kwargs.get("chat_template")
        if template is not None and not self.server.trust_request_chat_template:
            raise InvalidRequest("this server does not accept chat templates from requests "
                                 "(start it with --trust-request-chat-template)", param="chat_template")
        return template


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def request_ids(prefix: str, body_id: str | None, raw: Request, echo: bool = True) -> tuple[str, str]:
    """(engine request id, id shown to the client). The engine's id is always generated here, so a client can
    never address another request; the client's own id (body ``request_id`` or ``X-Request-Id``) is only
    echoed (``echo``: not for ids that name something kept, such as a stored response) and logged."""
    client_id = body_id if body_id is not None else raw.headers.get("x-request-id")
    internal = new_id(prefix)
    if client_id is None:
        return internal, internal
    if len(client_id) > MAX_CLIENT_REQUEST_ID:
        raise InvalidRequest(f"request_id is longer than {MAX_CLIENT_REQUEST_ID} characters", param="request_id")
    logger.info("request %s: client request id %r", internal, client_id)
    return internal, f"{prefix}-{client_id}" if echo else internal


def stream_error(e: BaseException) -> str:
    """The SSE event that ends a stream which failed after it started."""
    if isinstance(e, KestrelError):
        return sse(error_body(str(e), e.error_type, getattr(e, "param", None), e.status_code))
    logger.error("stream failed", exc_info=e)
    return sse(error_body("internal server error", "internal_error", None, 500))


LOGPROB_FLOOR = -9999.0  # vLLM's: a banned token's -inf (an output constraint, bad_words) is sent as this


def json_logprob(value: float) -> float:
    """A logprob as the API sends it: JSON has no -inf (a 500 whole, -Infinity streamed); vLLM sends -9999.0."""
    return value if value >= LOGPROB_FLOOR else LOGPROB_FLOOR  # NaN too: not >= anything


def prompt_logprobs_json(out: RequestOutput) -> list | None:
    """vLLM's prompt_logprobs: per prompt position None (the first) or {token id: {logprob, rank, decoded_token}}."""
    if out.prompt_logprobs is None:
        return None
    return [None if d is None else {str(t): {"logprob": json_logprob(lp.logprob), "rank": lp.rank,
                                             "decoded_token": lp.decoded_token}
                                    for t, lp in d.items()} for d in out.prompt_logprobs]


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


def usage_json(state: ServerState, prompt: int, completion: int, cached: int = 0) -> dict:
    """A completion's usage; with --enable-prompt-tokens-details, as vLLM, the prompt tokens served from the
    prefix cache (a host KV tier's hits included) where there were some."""
    out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if state.server.enable_prompt_tokens_details and cached:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


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


class ClientDisconnected(Exception):
    """The client of a non-streamed request left; its requests were aborted (and that logged, one line each)."""


async def unless_disconnected(request: Request, coro):
    """Run a non-streaming handler's work, cancelling it (and so aborting its requests) if the client leaves."""
    task = asyncio.ensure_future(coro)
    left = False

    async def watch():
        nonlocal left
        while not task.done():
            if await request.is_disconnected():
                left = True
                task.cancel()
                return
            await asyncio.sleep(0.5)

    watcher = asyncio.create_task(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if left:  # not our own cancellation (a shutdown): nobody is left to answer
            raise ClientDisconnected() from None
        raise
    finally:
        watcher.cancel()


def client_of(raw) -> tuple:
    """Who sent a request, for per-client fairness (the grammar parse queue): its peer address and credentials."""
    return (raw.client.host if raw.client is not None else None, raw.headers.get("authorization"))


def beam_searches(state: ServerState, beam, prompts: list, request_id: str, lora, want_logprobs: bool,
                  req=None) -> list:
    """One beam search (AsyncEngine.beam_search) per prompt of token ids; a missing max_tokens is resolved as for
    a plain request (the context left, capped by --default-max-tokens). The searches are one request: one
    admission window (--max-seqs-per-request step requests in the engine at once, fewer while others are served)
    and one fair-share group for them all, the request's `timeout` (or --request-timeout) and `priority`."""
    engine = state.engine
    window = engine.admission_window()
    timeout = state.timeout(req) if req is not None else None
    priority = getattr(req, "priority", 0) or 0
    gens = []
    for i, ids in enumerate(prompts):
        if not isinstance(ids, list):
            raise InvalidRequest("use_beam_search takes text prompts only (no images)", param="use_beam_search")
        room = engine.max_model_len - len(ids)
        cap = engine.input_processor.default_max_tokens or room
        max_tokens = beam.max_tokens if beam.max_tokens is not None else min(room, cap)
        if max_tokens > room:
            raise InvalidRequest(f"max_tokens ({max_tokens}) + prompt ({len(ids)} tokens) exceeds the context length "
                                 f"{engine.max_model_len}", param="max_tokens", code="context_length_exceeded")
        gens.append(engine.beam_search(ids, dataclasses.replace(beam, max_tokens=max_tokens), f"{request_id}-{i}",
                                       lora, want_logprobs, timeout, window, priority))
    return gens
