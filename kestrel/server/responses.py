"""POST /v1/responses: the subset of OpenAI's Responses API that vLLM serves for text. `input` (a string or a
list of messages) and `instructions` become a chat conversation, rendered by the model's chat template, and the
reply comes back as one output message, whole or as response.* server-sent events. Function tools and
previous_response_id (which needs a response store) are refused with a 400 naming them."""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator, ClassVar

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import StrictBool, StrictStr

from kestrel.errors import InvalidRequest
from kestrel.frontend.outputs import RequestOutput
from kestrel.server.chat import render_prompt
from kestrel.server.common import ServerState, final_outputs, request_ids, stream_error, unless_disconnected
from kestrel.server.openai_protocol import ChatCompletionRequest, Int64, _Base

INPUT_TEXT_TYPES = ("input_text", "output_text", "text")


class ResponsesRequest(_Base):
    # not implemented: refused unless unused (a function-tool round trip and a stored conversation)
    _unsupported_here: ClassVar[dict[str, tuple]] = {"previous_response_id": (None,), "tools": (None, []),
                                                     "tool_choice": (None, "auto", "none"),
                                                     "background": (None, False), "reasoning": (None,),
                                                     "conversation": (None,)}
    model: str | None = None
    input: StrictStr | list[dict[str, Any]]
    instructions: StrictStr | None = None
    max_output_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: StrictBool = False
    store: StrictBool = True  # nothing is stored: previous_response_id is refused
    metadata: dict[str, Any] | None = None
    user: str | None = None
    request_id: str | None = None
    priority: Int64 = 0


def _text_of(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}.content must be a string or a list of text parts", param="input")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in INPUT_TEXT_TYPES or not isinstance(
                part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidRequest(f"{where}: content part {kind!r} is not supported (text parts only)", param="input")
        texts.append(part["text"])
    return "".join(texts)


def chat_messages(req: ResponsesRequest) -> list[dict]:
    """`instructions` + `input` as chat messages (the Responses API's message items: role + text content)."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    if isinstance(req.input, str):
        return messages + [{"role": "user", "content": req.input}]
    if not req.input:
        raise InvalidRequest("input is empty", param="input")
    for i, item in enumerate(req.input):
        kind = item.get("type", "message")
        if kind != "message" or item.get("role") not in ("user", "assistant", "system", "developer"):
            raise InvalidRequest(f"input[{i}]: only message items (role user, assistant, system or developer) are "
                                 f"supported, got type {kind!r}", param="input")
        role = "system" if item["role"] == "developer" else item["role"]
        messages.append({"role": role, "content": _text_of(item.get("content"), f"input[{i}]")})
    return messages


def _chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    body = {"messages": chat_messages(req), "max_tokens": req.max_output_tokens, "priority": req.priority}
    body.update({k: v for k, v in (("temperature", req.temperature), ("top_p", req.top_p)) if v is not None})
    return ChatCompletionRequest.model_validate(body)


def _message(item_id: str, text: str, status: str) -> dict:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status != "in_progress" \
        else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _response(req: ResponsesRequest, state: ServerState, rid: str, created: int, status: str, output: list,
              out: RequestOutput | None) -> dict:
    usage = None
    if out is not None:
        n_in, n_out = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
        usage = {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
                 "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": n_in + n_out}
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": state.model_name,
            "output": output, "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "parallel_tool_calls": True, "tool_choice": "auto",
            "tools": [], "text": {"format": {"type": "text"}}, "previous_response_id": None, "store": False,
            "metadata": req.metadata or {}, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "usage": usage}


def _status(out: RequestOutput) -> str:
    return "incomplete" if out.outputs[0].finish_reason == "length" else "completed"


async def create_response(state: ServerState, req: ResponsesRequest, raw: Request):
    lora = state.check_model(req.model)
    chat_req = _chat_request(req)
    params = chat_req.sampling_params(state.sampling_defaults)
    rid, public_id = request_ids("resp", req.request_id, raw)
    prompt = await render_prompt(state, chat_req)
    gen = state.engine.generate(prompt, params, rid, req.priority, timeout=state.timeout(chat_req),
                                lora_request=lora)
    created, item_id = int(time.time()), f"msg_{uuid.uuid4().hex}"
    if req.stream:
        return StreamingResponse(_stream(state, req, public_id, created, item_id, gen),
                                 media_type="text/event-stream")
    (out,) = await unless_disconnected(raw, final_outputs([gen]))
    status = _status(out)
    message = _message(item_id, out.outputs[0].text, "completed" if status == "completed" else "incomplete")
    return JSONResponse(_response(req, state, public_id, created, status, [message], out))


async def _stream(state: ServerState, req: ResponsesRequest, rid: str, created: int, item_id: str,
                  gen) -> AsyncIterator[str]:
    seq = 0

    def event(kind: str, **fields) -> str:
        nonlocal seq
        seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **fields})}\n\n"

    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    try:
        yield event("response.created", response=_response(req, state, rid, created, "in_progress", [], None))
        yield event("response.in_progress", response=_response(req, state, rid, created, "in_progress", [], None))
        yield event("response.output_item.added", output_index=0, item=_message(item_id, "", "in_progress"))
        yield event("response.content_part.added", **where,
                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        last = None
        async for out in gen:
            last = out
            delta = out.outputs[0].text_delta
            if delta:
                yield event("response.output_text.delta", **where, delta=delta, logprobs=[])
        text = last.outputs[0].text if last is not None else ""
        status = _status(last) if last is not None else "incomplete"
        yield event("response.output_text.done", **where, text=text, logprobs=[])
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        yield event("response.content_part.done", **where, part=part)
        message = _message(item_id, text, "completed" if status == "completed" else "incomplete")
        yield event("response.output_item.done", output_index=0, item=message)
        final = _response(req, state, rid, created, status, [message], last)
        yield event("response.completed" if status == "completed" else "response.incomplete", response=final)
    except Exception as e:
        yield stream_error(e)
