"""The pooling endpoints, as vLLM serves them for embedding models and classifiers / cross-encoders:
POST /v1/embeddings (OpenAI's body: input as text(s) or token ids, encoding_format float|base64, dimensions for
Matryoshka models), /classify, /score (text_1 x text_2), /rerank and /v1/rerank (Jina / Cohere body: query,
documents, top_n, return_documents). Each prompt is one pooling request (kestrel/frontend/pooling.py).

A request has at most MAX_POOLING_INPUTS inputs (texts of /score's text_1 and text_2 each, /rerank's documents;
a 400 naming the field otherwise); its texts (a cross-encoder's text pairs) are tokenized on the render threads,
TOKENIZE_CHUNK at a time so that other requests' rendering goes between the chunks, and all of its work stops
when the client leaves."""
from __future__ import annotations

import asyncio
import base64
import struct
import time
from typing import ClassVar, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import StrictBool, StrictInt, StrictStr

from kestrel.core.pooling import PoolingParams
from kestrel.errors import InvalidRequest
from kestrel.frontend.outputs import RequestOutput
from kestrel.frontend.pooling import check_request_kind, pair_token_ids, plan_scores
from kestrel.frontend.truncation import truncation_length
from kestrel.server.common import ServerState, request_ids, unless_disconnected
from kestrel.server.openai_protocol import Int64, TokenIds, _Base

PoolingInput = StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
MAX_POOLING_INPUTS = 2048  # inputs (embeddings, classify), documents (rerank), texts of text_1 / text_2 (score)
TOKENIZE_CHUNK = 64  # texts tokenized per render-thread call


class EmbeddingRequest(_Base):
    model: str | None = None
    input: PoolingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int64 | None = None
    user: str | None = None
    normalize: StrictBool = True  # vLLM's extra
    request_id: str | None = None
    priority: Int64 = 0
    truncate_prompt_tokens: Int64 | None = None  # vLLM's: keep the last k tokens (-1: max_model_len)


class ClassificationRequest(_Base):
    model: str | None = None
    input: PoolingInput
    activation: StrictBool = True  # vLLM's extra: False returns the raw logits
    user: str | None = None
    request_id: str | None = None
    priority: Int64 = 0
    truncate_prompt_tokens: Int64 | None = None  # vLLM's: keep the last k tokens (-1: max_model_len)


class ScoreRequest(_Base):
    model: str | None = None
    text_1: StrictStr | list[StrictStr]
    text_2: StrictStr | list[StrictStr]
    user: str | None = None
    request_id: str | None = None
    priority: Int64 = 0
    truncate_prompt_tokens: Int64 | None = None  # vLLM's: keep the last k tokens (-1: max_model_len)


class RerankRequest(_Base):
    _served_here: ClassVar[frozenset[str]] = frozenset({"documents"})
    model: str | None = None
    query: StrictStr
    documents: list[StrictStr]
    top_n: StrictInt | None = None
    return_documents: StrictBool = True
    user: str | None = None
    request_id: str | None = None
    priority: Int64 = 0
    truncate_prompt_tokens: Int64 | None = None  # vLLM's: keep the last k tokens (-1: max_model_len)


def prompt_list(value) -> list:
    """OpenAI's input forms -> one prompt (text or token ids) per item."""
    if isinstance(value, str):
        return [value]
    if value and all(isinstance(t, int) for t in value):
        return [value]
    if not value:
        raise InvalidRequest("input is empty", param="input")
    return list(value)


def check_count(items: list, param: str) -> None:
    """At most MAX_POOLING_INPUTS items, counted before any per-item work."""
    if len(items) > MAX_POOLING_INPUTS:
        raise InvalidRequest(f"{param} has {len(items)} items; at most {MAX_POOLING_INPUTS} are allowed", param=param)


async def tokenized(engine, prompts: list, truncate: int | None = None) -> list:
    """Token ids of each prompt (text, a cross-encoder's (query, document) pair, or ids already), tokenized on the
    render threads TOKENIZE_CHUNK at a time; `truncate`: truncate_prompt_tokens, resolved (a text keeps its special
    tokens, a pair is cut by the tokenizer; ids are cut by the input processor)."""
    def chunk_ids(chunk: list) -> list:
        return [engine.input_processor.tokenize(p, truncate_prompt_tokens=truncate) if isinstance(p, str)
                else pair_token_ids(engine.tokenizer, *p, truncate) if isinstance(p, tuple) else p
                for p in chunk]

    out = []
    for i in range(0, len(prompts), TOKENIZE_CHUNK):
        chunk = prompts[i:i + TOKENIZE_CHUNK]
        out += await engine.run_tokenizer(chunk_ids, chunk) if any(not isinstance(p, list) for p in chunk) else chunk
    return out


async def pool_all(state: ServerState, raw: Request, req, prompts: list, pooling: PoolingParams,
                   prefix: str, param: str | None = "input") -> tuple[str, list[RequestOutput]]:
    """Every prompt as one pooling request (validated before any is sent); (public id, outputs in order). The
    texts are tokenized off the event loop; the client leaving stops the tokenizing and aborts the requests."""
    state.check_model(req.model)
    engine = state.engine
    check_request_kind(engine.pooling, pooling)
    truncate = truncation_length(req.truncate_prompt_tokens, engine.max_model_len)
    if param is not None:  # None: the caller counted its fields
        check_count(prompts, param)
    rid, public_id = request_ids(prefix, req.request_id, raw)

    async def run():
        ids = await tokenized(engine, prompts, truncate)
        window = engine.admission_window()
        tasks = [asyncio.ensure_future(engine.encode(p, pooling, f"{rid}-{i}", req.priority, window=window,
                                                     truncate_prompt_tokens=req.truncate_prompt_tokens))
                 for i, p in enumerate(ids)]
        try:
            return await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()

    return public_id, await unless_disconnected(raw, run())


def _usage(outs: list[RequestOutput]) -> dict:
    n = sum(len(o.prompt_token_ids) for o in outs)
    return {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0, "prompt_tokens_details": None}


def encode_base64(vector: list[float]) -> str:
    """OpenAI's base64 embedding: little-endian float32 bytes."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


async def create_embedding(state: ServerState, req: EmbeddingRequest, raw: Request) -> JSONResponse:
    if req.dimensions is not None and req.dimensions < 1:
        raise InvalidRequest(f"dimensions must be at least 1, got {req.dimensions}", param="dimensions")
    pooling = PoolingParams(task="embed", normalize=req.normalize, dimensions=req.dimensions or 0)
    public_id, outs = await pool_all(state, raw, req, prompt_list(req.input), pooling, "embd")
    data = [{"index": i, "object": "embedding",
             "embedding": encode_base64(o.pooled) if req.encoding_format == "base64" else o.pooled}
            for i, o in enumerate(outs)]
    return JSONResponse({"id": public_id, "object": "list", "created": int(time.time()), "model": state.model_name,
                         "data": data, "usage": _usage(outs)})


async def create_classification(state: ServerState, req: ClassificationRequest, raw: Request) -> JSONResponse:
    pooling = PoolingParams(task="classify", activation=req.activation)
    public_id, outs = await pool_all(state, raw, req, prompt_list(req.input), pooling, "classify")
    labels = state.engine.pooling["labels"]
    data = []
    for i, o in enumerate(outs):
        best = max(range(len(o.pooled)), key=o.pooled.__getitem__)
        data.append({"index": i, "label": labels[best] if best < len(labels) else None, "probs": o.pooled,
                     "num_classes": len(o.pooled)})
    return JSONResponse({"id": public_id, "object": "list", "created": int(time.time()), "model": state.model_name,
                         "data": data, "usage": _usage(outs)})


async def _scores(state: ServerState, raw: Request, req, queries: list, documents: list,
                  prefix: str) -> tuple[str, list[float], list[RequestOutput]]:
    engine = state.engine
    plan = plan_scores(engine.pooling, engine.tokenizer, queries, documents, tokenize=False)  # pairs: no per-item work
    public_id, outs = await pool_all(state, raw, req, plan.prompts, plan.pooling, prefix, None)
    return public_id, plan.scores([o.pooled for o in outs]), outs


async def create_score(state: ServerState, req: ScoreRequest, raw: Request) -> JSONResponse:
    queries = [req.text_1] if isinstance(req.text_1, str) else req.text_1
    documents = [req.text_2] if isinstance(req.text_2, str) else req.text_2
    check_count(queries, "text_1")
    check_count(documents, "text_2")
    public_id, scores, outs = await _scores(state, raw, req, queries, documents, "score")
    return JSONResponse({"id": public_id, "object": "list", "created": int(time.time()), "model": state.model_name,
                         "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                         "usage": _usage(outs)})


async def create_rerank(state: ServerState, req: RerankRequest, raw: Request) -> JSONResponse:
    if req.top_n is not None and req.top_n < 0:
        raise InvalidRequest(f"top_n must be 0 (all) or more, got {req.top_n}", param="top_n")
    check_count(req.documents, "documents")
    public_id, scores, outs = await _scores(state, raw, req, [req.query], req.documents, "rerank")
    order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
    if req.top_n:
        order = order[:req.top_n]
    results = [{"index": i, "relevance_score": scores[i],
                **({"document": {"text": req.documents[i]}} if req.return_documents else {})} for i in order]
    return JSONResponse({"id": public_id, "model": state.model_name, "usage": {"total_tokens": _usage(outs)[
        "total_tokens"]}, "results": results})
