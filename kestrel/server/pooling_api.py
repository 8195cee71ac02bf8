"""POST /pooling, vLLM's generic pooling endpoint: a completion-style body (`input`: text(s) or token ids) or a
chat-style one (`messages`, rendered by the chat template), pooled by the model's own task; each result is
`{"index", "object": "pooling", "data": [...]}` (an embedding, or class probabilities; base64 float32 with
encoding_format "base64"). Per-token tasks (token_embed, token_classify) are refused by name."""
from __future__ import annotations

import time
from typing import Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import StrictBool, StrictStr, model_validator

from kestrel.core.pooling import PoolingParams
from kestrel.errors import InvalidRequest
from kestrel.frontend.pooling import PER_TOKEN_TASKS, check_request_kind
from kestrel.server.chat import render_prompt
from kestrel.server.common import ServerState
from kestrel.server.openai_protocol import ChatMessage, Int64, _ChatRendering
from kestrel.server.pooling import PoolingInput, _usage, encode_base64, pool_all, prompt_list

SEQUENCE_TASKS = ("embed", "classify")


class PoolingRequest(_ChatRendering):
    model: str | None = None
    input: PoolingInput | None = None
    messages: list[ChatMessage] | None = None
    task: StrictStr | None = None  # the model's own task (embed | classify); None: that task
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int64 | None = None
    normalize: StrictBool | None = None  # embed: L2-normalise (default true)
    activation: StrictBool | None = None  # classify: softmax / sigmoid (default true); vLLM's older name
    use_activation: StrictBool | None = None  # vLLM's newer name of `activation`
    truncate_prompt_tokens: Int64 | None = None
    add_special_tokens: StrictBool = True
    user: str | None = None
    request_id: str | None = None
    priority: Int64 = 0

    @model_validator(mode="after")
    def _one_input(self):
        if (self.input is None) == (self.messages is None):
            raise InvalidRequest("give `input` (a completion-style body) or `messages` (a chat-style body), not both "
                                 "and not neither", param="input" if self.input is None else "messages")
        if self.messages is not None and not self.messages:
            raise InvalidRequest("messages is empty", param="messages")
        return self


def pooling_params(req: PoolingRequest, facts: dict | None) -> PoolingParams:
    """The request's pooling, by the model's task (a generative model is refused by check_request_kind later)."""
    own = facts["task"] if facts else "embed"
    task = req.task or own
    if task in PER_TOKEN_TASKS:
        raise InvalidRequest(f"task {task!r}: per-token pooling is not implemented (this model pools one vector per "
                             f"prompt: task {own})", param="task")
    if task not in SEQUENCE_TASKS:
        raise InvalidRequest(f"task {task!r} is not one of {', '.join(SEQUENCE_TASKS)}", param="task")
    if req.dimensions is not None and req.dimensions < 1:
        raise InvalidRequest(f"dimensions must be at least 1, got {req.dimensions}", param="dimensions")
    activation = req.use_activation if req.use_activation is not None else req.activation
    if task == "embed":
        if activation is not None:
            raise InvalidRequest("activation applies to classification; an embedding takes `normalize`",
                                 param="activation")
        return PoolingParams(task="embed", normalize=req.normalize is not False, dimensions=req.dimensions or 0)
    if req.dimensions is not None or req.normalize is not None:
        raise InvalidRequest("dimensions and normalize apply to embeddings; class scores take `activation`",
                             param="dimensions" if req.dimensions is not None else "normalize")
    return PoolingParams(task="classify", activation=activation is not False)


async def create_pooling(state: ServerState, req: PoolingRequest, raw: Request) -> JSONResponse:
    pooling = pooling_params(req, state.engine.pooling)
    state.check_model(req.model)
    check_request_kind(state.engine.pooling, pooling)  # before any rendering
    if req.messages is not None:
        if any(m.has_non_text_parts() for m in req.messages):
            raise InvalidRequest("/pooling takes text messages only", param="messages")
        prompts = [await render_prompt(state, req)]
    elif isinstance(req.input, str) and not req.add_special_tokens:
        engine = state.engine
        prompts = [await engine.run_tokenizer(engine.tokenizer.encode, req.input, add_special_tokens=False)]
    else:
        prompts = prompt_list(req.input)
    public_id, outs = await pool_all(state, raw, req, prompts, pooling, "pool")
    data = [{"index": i, "object": "pooling",
             "data": encode_base64(o.pooled) if req.encoding_format == "base64" else o.pooled}
            for i, o in enumerate(outs)]
    return JSONResponse({"id": public_id, "object": "list", "created": int(time.time()), "model": state.model_name,
                         "data": data, "usage": _usage(outs)})
