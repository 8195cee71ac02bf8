"""POST /v1/responses (and GET /v1/responses/{id}): the subset of OpenAI's Responses API that vLLM serves for
text and images. `instructions`, the stored conversation of `previous_response_id` and `input` (a string, or
message (with input_image parts), reasoning, function_call and function_call_output items) become a chat conversation
(kestrel/server/response_items.py), which runs on the chat path: the model's chat template (`reasoning.effort` is
its reasoning_effort), function `tools` and `tool_choice` through the chat tool-calling machinery
(kestrel/server/tool_calls.py), the --reasoning-parser, `text.format` as the chat API's response_format
(structured output). The reply comes back as output items (a reasoning item
when the parser found reasoning, a message, and one function_call per tool call), whole or as response.*
server-sent events; with `store` (the default) it is kept in the bounded response store
(kestrel/server/response_store.py) for the next request's previous_response_id."""
from __future__ import annotations

import json
import time
from typing import Any, AsyncIterator, ClassVar

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field, StrictBool, StrictStr, field_validator

from kestrel.errors import InvalidRequest
from kestrel.frontend.outputs import RequestOutput
from kestrel.server.chat import render_prompt
from kestrel.server.common import (ServerState, client_of, final_outputs, request_ids, stream_error,
                                   unless_disconnected)
from kestrel.server.openai_protocol import REASONING_EFFORTS, ChatCompletionRequest, Int64, _Base
from kestrel.server.response_items import (assistant_message, chat_tool_choice, chat_tools, function_call_item,
                                           input_messages, message_item, new_item_id, output_items, reasoning_item,
                                           text_response_format)
from kestrel.server.response_store import response_owner
from kestrel.server.tool_calls import MessageStream, ToolPlan, build_message, plan_tools

MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's metadata limits
MAX_USER_CHARS = 256


class ResponsesRequest(_Base):
    # not implemented: refused unless unused
    _unsupported_here: ClassVar[dict[str, tuple]] = {"background": (None, False),
                                                     "conversation": (None,), "top_logprobs": (None, 0)}
    model: str | None = None
    input: StrictStr | list[dict[str, Any]]
    instructions: StrictStr | None = None
    previous_response_id: StrictStr | None = None
    max_output_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    tools: list | None = None  # function tools: {"type": "function", "name", "description", "parameters"}
    tool_choice: str | dict | None = None  # auto (with tools; needs --enable-auto-tool-choice) | none | required | named
    parallel_tool_calls: StrictBool = True
    stream: StrictBool = False
    store: StrictBool = True  # keep the response for previous_response_id (--responses-store-size)
    metadata: dict[str, Any] | None = None  # OpenAI's limits: MAX_METADATA_PAIRS pairs, short string values
    user: str | None = Field(None, max_length=MAX_USER_CHARS)  # with the API key, who owns the stored response
    request_id: str | None = None  # logged only: the response's id is the server's (response_store.py)
    priority: Int64 = 0
    reasoning: dict[str, Any] | None = None  # {"effort": E}: the chat template's reasoning_effort
    include_reasoning: StrictBool = True  # false: the reasoning is generated, its item left out (vLLM's extension)
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extensions, as chat completions take them
    structured_outputs: dict | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "json_schema", "name", "schema", "strict"}}: structured

    @field_validator("reasoning")
    @classmethod
    def _reasoning(cls, v):
        """effort reaches the template; no summaries are written, so only summary "auto" (the model's choice)."""
        if v is None:
            return v
        unknown = set(v) - {"effort", "summary", "generate_summary"}
        if unknown:
            raise InvalidRequest(f"reasoning.{sorted(unknown)[0]} is not supported", param="reasoning")
        if v.get("effort") not in (None, *REASONING_EFFORTS):
            raise InvalidRequest(f"reasoning.effort must be one of {', '.join(REASONING_EFFORTS)}", param="reasoning")
        for key in ("summary", "generate_summary"):
            if v.get(key) not in (None, "auto"):
                raise InvalidRequest(f"reasoning.{key} {v[key]!r} is not supported: reasoning comes back as "
                                     f"reasoning_text, not summarised", param="reasoning")
        return v

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, v):
        """OpenAI's metadata: at most 16 pairs, keys of at most 64 characters, string values of at most 512."""
        if v is None:
            return v
        if len(v) > MAX_METADATA_PAIRS:
            raise InvalidRequest(f"metadata has {len(v)} pairs; at most {MAX_METADATA_PAIRS} are allowed",
                                 param="metadata")
        for key, value in v.items():
            if len(key) > MAX_METADATA_KEY_CHARS:
                raise InvalidRequest(f"metadata keys must have at most {MAX_METADATA_KEY_CHARS} characters",
                                     param="metadata")
            if not isinstance(value, str) or len(value) > MAX_METADATA_VALUE_CHARS:
                raise InvalidRequest(f"metadata values must be strings of at most {MAX_METADATA_VALUE_CHARS} "
                                     f"characters", param="metadata")
        return v


def owner(state: ServerState, raw: Request, user: str | None) -> str:
    """The owner of the responses this request stores or reads (response_store.response_owner)."""
    return response_owner(raw.headers.get("authorization"), user, bool(state.api_key))


def conversation(state: ServerState, req: ResponsesRequest, who: str) -> list[dict]:
    """The stored conversation of previous_response_id (404 if unknown or another owner's), then `input`.
    `instructions` are the request's own: a previous response's are not carried over (as OpenAI does)."""
    history = state.responses.get(req.previous_response_id, "previous_response_id", who).messages \
        if req.previous_response_id is not None else []
    return history + input_messages(req.input)


def _chat_request(req: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
    system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    body = {"messages": system + messages, "max_tokens": req.max_output_tokens, "priority": req.priority,
            "chat_template_kwargs": req.chat_template_kwargs, "structured_outputs": req.structured_outputs,
            "response_format": text_response_format(req.text),
            "reasoning_effort": (req.reasoning or {}).get("effort"),
            "tools": chat_tools(req.tools), "parallel_tool_calls": req.parallel_tool_calls,
            # "auto" without tools is vLLM's default: nothing to choose from, so no tool plan
            "tool_choice": chat_tool_choice(None if not req.tools and req.tool_choice == "auto" else req.tool_choice)}
    sampling = ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty", "logit_bias")
    body.update({k: getattr(req, k) for k in sampling if getattr(req, k) is not None})
    return ChatCompletionRequest.model_validate(body)


def _response(req: ResponsesRequest, state: ServerState, rid: str, created: int, status: str, output: list,
              out: RequestOutput | None) -> dict:
    usage = None
    if out is not None:
        n_in, n_out = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
        # reasoning_tokens stays 0: the parsers split text, not tokens
        usage = {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
                 "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": n_in + n_out}
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": state.model_name,
            "output": output, "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls,
            "tool_choice": req.tool_choice or ("auto" if req.tools else "none"), "tools": req.tools or [],
            "text": req.text or {"format": {"type": "text"}}, "previous_response_id": req.previous_response_id,
            "store": req.store and state.responses.max_size > 0, "metadata": req.metadata or {}, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "usage": usage}


def _status(out: RequestOutput | None) -> str:
    return "incomplete" if out is None or out.outputs[0].finish_reason == "length" else "completed"


def _remember(state: ServerState, req: ResponsesRequest, messages: list[dict], reply: dict, body: dict,
              who: str) -> None:
    if req.store and not state.responses.put(body["id"], messages + [assistant_message(reply)], body, who):
        body["store"] = False  # over --responses-store-bytes on its own: not kept


async def create_response(state: ServerState, req: ResponsesRequest, raw: Request):
    lora = state.check_model(req.model)
    who = owner(state, raw, req.user)
    messages = conversation(state, req, who)
    chat_req = _chat_request(req, messages)
    plan = plan_tools(chat_req.tools, chat_req.tool_choice, state.tool_parser, state.enable_auto_tool_choice,
                      chat_req.parallel_tool_calls)
    params = chat_req.sampling_params(state.sampling_defaults, plan.structured)
    reasoning = plan.reasoning_for(state.reasoning_parser, state.template_kwargs(chat_req), params)
    await state.grammar.check(params.structured_outputs, "tools" if plan.structured else "text", client_of(raw))
    rid, public_id = request_ids("resp", req.request_id, raw, echo=False)  # a stored id is the server's
    prompt = await render_prompt(state, chat_req, plan.tools)
    gen = state.engine.generate(prompt, params, rid, req.priority, timeout=state.timeout(chat_req),
                                lora_request=lora, stream=req.stream)
    created = int(time.time())
    if req.stream:
        return StreamingResponse(_stream(state, req, public_id, created, gen, plan, messages, who, reasoning),
                                 media_type="text/event-stream")
    (out,) = await unless_disconnected(raw, final_outputs([gen]))
    status = _status(out)
    reply, _ = build_message(plan, reasoning, out.outputs[0].text, out.outputs[0].finish_reason)
    items = output_items(reply, new_item_id("msg"), "completed" if status == "completed" else "incomplete",
                         req.include_reasoning)
    body = _response(req, state, public_id, created, status, items, out)
    _remember(state, req, messages, reply, body, who)
    return JSONResponse(body)


async def get_response(state: ServerState, response_id: str, raw: Request):
    """GET /v1/responses/{id}: the owner's own only (its key, and `?user=` as the request's `user` field)."""
    user = raw.query_params.get("user")
    return JSONResponse(state.responses.get(response_id, owner=owner(state, raw, user)).body)


class _Events:
    """response.* server-sent events, numbered in order."""

    def __init__(self):
        self.seq = 0

    def __call__(self, kind: str, **fields) -> str:
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': self.seq - 1, **fields})}\n\n"


class _TextItem:
    """One streamed text item, opened at its first piece: the message (output_text) or the reasoning
    (reasoning_text), each a single content part."""

    def __init__(self, kind: str, event: _Events, output: list):
        self.kind, self.event, self.output, self.text, self.index = kind, event, output, "", None
        self.id = new_item_id("msg" if kind == "message" else "rs")
        self.part = "output_text" if kind == "message" else "reasoning_text"
        self.extra = {"logprobs": []} if kind == "message" else {}  # output_text's own fields

    def _item(self, status: str) -> dict:
        return (message_item if self.kind == "message" else reasoning_item)(self.id, self.text, status)

    def _part(self) -> dict:
        return {"type": self.part, "text": self.text, **({"annotations": [], "logprobs": []} if self.extra else {})}

    def _where(self) -> dict:
        return {"item_id": self.id, "output_index": self.index, "content_index": 0}

    def open(self) -> list[str]:
        self.index = len(self.output)
        self.output.append(self._item("in_progress"))
        return [self.event("response.output_item.added", output_index=self.index, item=self.output[self.index]),
                self.event("response.content_part.added", **self._where(), part=self._part())]

    def feed(self, piece: str) -> list[str]:
        events = self.open() if self.index is None else []
        self.text += piece
        return events + [self.event(f"response.{self.part}.delta", **self._where(), delta=piece, **self.extra)]

    def close(self, status: str) -> list[str]:
        if self.index is None:
            return []
        self.output[self.index] = self._item(status)
        return [self.event(f"response.{self.part}.done", **self._where(), text=self.text, **self.extra),
                self.event("response.content_part.done", **self._where(), part=self._part()),
                self.event("response.output_item.done", output_index=self.index, item=self.output[self.index])]


async def _stream(state: ServerState, req: ResponsesRequest, rid: str, created: int, gen, plan: ToolPlan,
                  messages: list[dict], who: str, reasoning) -> AsyncIterator[str]:
    """The reasoning and the text stream into a reasoning and a message item, each opened at its first piece; tool
    calls come whole after them, each a function_call item with its arguments in one delta."""
    event, stream, calls, output = _Events(), MessageStream(plan, reasoning), {}, []
    thought, message = _TextItem("reasoning", event, output), _TextItem("message", event, output)
    reasoning_text = None  # kept for the stored history even where include_reasoning leaves its item out
    try:
        yield event("response.created", response=_response(req, state, rid, created, "in_progress", [], None))
        yield event("response.in_progress", response=_response(req, state, rid, created, "in_progress", [], None))
        last = None
        async for out in gen:
            last = out
            c = out.outputs[0]
            delta = stream.feed(c.text_delta, final=c.finish_reason is not None)
            for piece in delta.get("tool_calls", []):
                call = calls.setdefault(piece["index"], {"id": piece.get("id"), "function": {"name": "",
                                                                                           "arguments": ""}})
                fn = piece.get("function", {})
                call["function"]["name"] += fn.get("name") or ""
                call["function"]["arguments"] += fn.get("arguments") or ""
            if delta.get("reasoning_content"):
                reasoning_text = (reasoning_text or "") + delta["reasoning_content"]
                for e in thought.feed(delta["reasoning_content"]) if req.include_reasoning else []:
                    yield e
            for e in message.feed(delta["content"]) if delta.get("content") else []:
                yield e
        status = _status(last)
        done = "completed" if status == "completed" else "incomplete"
        if message.index is None and not calls:  # no text and no call: an empty message, still
            for e in message.open():
                yield e
        for item in sorted((thought, message), key=lambda t: -1 if t.index is None else t.index):
            for e in item.close(done):
                yield e
        for k in sorted(calls):
            index, item = len(output), function_call_item(calls[k])
            yield event("response.output_item.added", output_index=index, item={**item, "arguments": "",
                                                                                 "status": "in_progress"})
            yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                        delta=item["arguments"])
            yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        arguments=item["arguments"])
            output.append(item)
            yield event("response.output_item.done", output_index=index, item=item)
        final = _response(req, state, rid, created, status, output, last)
        reply = {"content": message.text or None, "tool_calls": [calls[k] for k in sorted(calls)],
                 "reasoning_content": reasoning_text}
        _remember(state, req, messages, reply, final, who)
        yield event("response.completed" if status == "completed" else "response.incomplete", response=final)
    except Exception as e:
        yield stream_error(e)
