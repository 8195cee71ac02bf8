"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) over an AsyncEngine whose engine cores run in their own
processes. `kestrel serve MODEL` calls run_server(args)."""
from __future__ import annotations

import json
import logging
import os
import secrets
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import kestrel
from kestrel.config import EngineConfig, from_cli_args
from kestrel.engine.async_engine import AsyncEngine
from kestrel.engine.utility import UtilityError
from kestrel.errors import ConfigError, EngineDead, InvalidRequest, KestrelError
from kestrel.server.chat import create_chat_completion, render_prompt
from kestrel.server.common import ServerState
from kestrel.server.completions import create_completion
from kestrel.server.lora_routes import lora_model_cards, lora_router
from kestrel.server.metrics import ServerMetrics
from kestrel.server.reasoning import get_reasoning_parser
from kestrel.server.tool_parsers import get_tool_parser
from kestrel.server.openai_protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                            TokenizeRequest, error_body)

logger = logging.getLogger("kestrel.server")


def _error(status: int, message: str, type_: str, param: str | None = None, code=None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code if code is not None else status), status_code=status)


def default_model_name(config: EngineConfig) -> str:
    if config.model.model:
        p = Path(config.model.model)
        return p.stem if p.suffix == ".gguf" else p.name
    return "SmolLM2-135M-Instruct"


def build_app(config: EngineConfig, model_name: str | None = None, api_key: str | None = None,
              log_requests: bool = False, client: str = "mp", tool_call_parser: str | None = None,
              enable_auto_tool_choice: bool = False, reasoning_parser: str | None = None) -> FastAPI:
    model_name = model_name or default_model_name(config)
    if enable_auto_tool_choice and not tool_call_parser:
        raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser")
    try:
        tool_parser, reasoning = get_tool_parser(tool_call_parser), get_reasoning_parser(reasoning_parser)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    metrics = ServerMetrics(model_name)
    engine = AsyncEngine(config, client, metrics=metrics, log_requests=log_requests)
    state = ServerState(engine, model_name, metrics, api_key, tool_parser=tool_parser,
                        enable_auto_tool_choice=enable_auto_tool_choice, reasoning_parser=reasoning)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        logger.info("serving %s (max_model_len %d, %d engine core(s))", model_name, engine.max_model_len,
                    engine.client.num_engines)
        try:
            yield
        finally:
            await engine.shutdown()

    app = FastAPI(title="Kestrel", version=kestrel.__version__, lifespan=lifespan)
    app.state.kestrel = state

    # ---- errors: always the OpenAI error body
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        e = errs[0] if errs else {"loc": (), "msg": "invalid request", "type": ""}
        if e.get("type") == "json_invalid":
            return _error(400, f"malformed JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}",
                          "invalid_request_error")
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        if not loc:  # the body as a whole: say so when it is not JSON at all (e.g. no JSON content type)
            try:
                json.loads(await request.body() or b"null")
            except ValueError as je:
                return _error(400, f"malformed JSON body: {je}", "invalid_request_error")
        param = loc[0] if loc else None
        where = ".".join(loc) or "body"
        return _error(400, f"{where}: {e.get('msg')}", "invalid_request_error", param)

    @app.exception_handler(KestrelError)
    async def _kestrel(request: Request, exc: KestrelError):
        if exc.status_code >= 500:
            logger.error("%s %s failed: %s", request.method, request.url.path, exc)
        return _error(exc.status_code, str(exc), exc.error_type, getattr(exc, "param", None),
                      getattr(exc, "code", None))

    @app.exception_handler(UtilityError)
    async def _utility(request: Request, exc: UtilityError):
        logger.error("%s %s failed: %s", request.method, request.url.path, exc)
        return _error(500, str(exc), "utility_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        logger.exception("%s %s failed", request.method, request.url.path)
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error")

    # ---- auth: everything but /health needs the key when one is set
    async def check_key(request: Request):
        if not api_key:
            return
        got = request.headers.get("authorization", "")
        if not secrets.compare_digest(got.encode(), f"Bearer {api_key}".encode()):
            raise _Unauthorized()

    @app.exception_handler(_Unauthorized)
    async def _unauth(request: Request, exc):
        return _error(401, "invalid or missing API key (send 'Authorization: Bearer KEY')", "authentication_error",
                      None, "invalid_api_key")

    @app.get("/health")
    async def health():
        info = engine.client.engine_info
        dead = engine.dead_engines
        engines = [{"index": i, "pid": info[i].get("pid") if i < len(info) else None, "alive": i not in dead,
                    **({"error": str(dead[i])} if i in dead else {})} for i in range(engine.client.num_engines)]
        if dead:
            body = error_body("; ".join(str(e) for e in dead.values()), "engine_dead", None, 503)
            body["engines"] = engines
            return JSONResponse(body, status_code=503)
        return {"status": "ok", "engines": engines}

    api = APIRouter(dependencies=[Depends(check_key)])

    @api.get("/version")
    async def version():
        return {"version": kestrel.__version__}

    @api.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": state.created,
                                            "owned_by": "kestrel", "root": config.model.model,
                                            "max_model_len": engine.max_model_len}] + lora_model_cards(state)}

    @api.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        _alive(engine)
        return await create_completion(state, req, raw)

    @api.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request):
        _alive(engine)
        return await create_chat_completion(state, req, raw)

    @api.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        state.check_model(req.model)
        if req.messages:
            ids = render_prompt(state, req)
        elif req.prompt is not None:
            ids = engine.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            raise InvalidRequest("give a prompt or messages", param="prompt")
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @api.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        state.check_model(req.model)
        vocab = engine.input_processor.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise InvalidRequest(f"tokens must be ids in [0, {vocab})", param="tokens")
        return {"prompt": engine.tokenizer.decode(req.tokens)}

    @api.get("/metrics")
    async def metrics_endpoint():
        return Response(metrics.render(engine), media_type="text/plain; version=0.0.4; charset=utf-8")

    # ---- fan-out to every engine core
    @api.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        _alive(engine)
        return {"ok": await engine.reset_prefix_cache()}

    @api.post("/sleep")
    async def sleep(level: int = 1):
        _alive(engine)
        return {"ok": await engine.sleep(level)}

    @api.post("/wake_up")
    async def wake_up():
        _alive(engine)
        return {"ok": await engine.wake_up()}

    @api.get("/is_sleeping")
    async def is_sleeping():
        _alive(engine)
        return {"is_sleeping": await engine.is_sleeping()}

    app.include_router(api)
    if config.lora.enable_lora:  # admin routes: behind the API key, like the other engine-wide mutations
        app.include_router(lora_router(state, [Depends(check_key)]))
    return app


class _Unauthorized(Exception):
    pass


def _alive(engine: AsyncEngine) -> None:
    if engine.is_dead:
        raise next(iter(engine.dead_engines.values()), EngineDead("the engine is dead"))


def run_server(args) -> int:
    import uvicorn

    config = from_cli_args(args)
    api_key = getattr(args, "api_key", None) or os.environ.get("KESTREL_API_KEY") or None
    app = build_app(config, getattr(args, "served_model_name", None), api_key, getattr(args, "log_requests", False),
                    tool_call_parser=getattr(args, "tool_call_parser", None),
                    enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
                    reasoning_parser=getattr(args, "reasoning_parser", None))
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                                           timeout_graceful_shutdown=5))
    server.run()
    return 0 if server.started else 1
