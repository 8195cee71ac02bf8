"""The pooling endpoints, as vLLM serves them for embedding models and classifiers / cross-encoders:
POST /v1/embeddings (OpenAI's body: input as text(s) or token ids, encoding_format float|base64, dimensions for
Matryoshka models), /classify, /score (text_1 x text_2), /rerank and /v1/rerank (Jina / Cohere body: query,
documents, top_n, return_documents). Each prompt is one pooling request (kestrel/frontend/pooling.py)."""
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
from kestrel.frontend.pooling import check_request_kind, plan_scores
from kestrel.server.common import ServerState, request_ids, unless_disconnected
from kestrel.server.openai_protocol import Int64, TokenIds, _Base

PoolingInput = StrictStr | list[StrictStr] | TokenIds | list[TokenIds]


class EmbeddingRequest(_Base):
    model: str | None = None
    input: PoolingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int64 | None = None
    user: str | None = None
    normalize: StrictBool = True  # vLLM's extra
    request_id: str | None = None
    priority: Int64 = 0


class ClassificationRequest(_Base):
    model: str | None = None
    input: PoolingInput
    activation: StrictBool = True  # vLLM's extra: False returns the raw logits
    user: str | None = None
    request_id: str | None = None
    priority: Int64 = 0


class ScoreRequest(_Base):
    model: str | None = None
    text_1: StrictStr | list[StrictStr]
    text_2: StrictStr | list[StrictStr]
    user: str | None = None
    request_id: str | None = None
    priority: Int64 = 0


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


def prompt_list(value) -> list:
    """OpenAI's input forms -> one prompt (text or token ids) per item."""
    if isinstance(value, str):
        return [value]
    if value and all(isinstance(t, int) for t in value):
        return [value]
    if not value:
        raise InvalidRequest("input is empty", param="input")
    return list(value)


async def pool_all(state: ServerState, raw: Request, req, prompts: list, pooling: PoolingParams,
                   prefix: str) -> tuple[str, list[RequestOutput]]:
    """Every prompt as one pooling request (validated before any is sent); (public id, outputs in order)."""
    state.check_model(req.model)
    engine = state.engine
    check_request_kind(engine.pooling, pooling)
    rid, public_id = request_ids(prefix, req.request_id, raw)
    window = engine.admission_window()
    jobs = [engine.encode(p, pooling, f"{rid}-{i}", req.priority, window=window) for i, p in enumerate(prompts)]

    async def gather():
        tasks = [asyncio.ensure_future(j) for j in jobs]
        try:
            return await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()

    return public_id, await unless_disconnected(raw, gather())


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
    plan = await engine.run_tokenizer(plan_scores, engine.pooling, engine.tokenizer, queries, documents)
    public_id, outs = await pool_all(state, raw, req, plan.prompts, plan.pooling, prefix)
    return public_id, plan.scores([o.pooled for o in outs]), outs


async def create_score(state: ServerState, req: ScoreRequest, raw: Request) -> JSONResponse:
    queries = [req.text_1] if isinstance(req.text_1, str) else req.text_1
    documents = [req.text_2] if isinstance(req.text_2, str) else req.text_2
    public_id, scores, outs = await _scores(state, raw, req, queries, documents, "score")
    return JSONResponse({"id": public_id, "object": "list", "created": int(time.time()), "model": state.model_name,
                         "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                         "usage": _usage(outs)})


async def create_rerank(state: ServerState, req: RerankRequest, raw: Request) -> JSONResponse:
    if req.top_n is not None and req.top_n < 0:
        raise InvalidRequest(f"top_n must be 0 (all) or more, got {req.top_n}", param="top_n")
    public_id, scores, outs = await _scores(state, raw, req, [req.query], req.documents, "rerank")
    order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
    if req.top_n:
        order = order[:req.top_n]
    results = [{"index": i, "relevance_score": scores[i],
                **({"document": {"text": req.documents[i]}} if req.return_documents else {})} for i in order]
    return JSONResponse({"id": public_id, "model": state.model_name, "usage": {"total_tokens": _usage(outs)[
        "total_tokens"]}, "results": results})
