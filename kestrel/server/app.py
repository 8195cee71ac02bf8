"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) over an AsyncEngine whose engine cores run in their own
processes. `kestrel serve MODEL` calls run_server(args); docs/serving.md describes the endpoints and flags."""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import signal
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
import uvicorn

import kestrel
from kestrel.config import EngineConfig, ServerConfig
from kestrel.frontend.async_engine import AsyncEngine
from kestrel.frontend.processor import ProcessedPrompt
from kestrel.ipc.utility import UtilityError, UtilityFanoutError
from kestrel.errors import ConfigError, InvalidRequest, KestrelError, NotFound
from kestrel.server.chat import create_chat_completion, render_prompt
from kestrel.server.common import ClientDisconnected, ServerState
from kestrel.server.completions import create_completion
from kestrel.server.lora_routes import lora_model_cards, lora_router
from kestrel.server.metrics import ServerMetrics
from kestrel.server.stats_log import StatsLog
from kestrel.server.reasoning import get_reasoning_parser
from kestrel.server.tool_parsers import get_tool_parser
from kestrel.server.responses import ResponsesRequest, create_response, get_response
from kestrel.server.pooling_api import PoolingRequest, create_pooling
from kestrel.server.pooling import (ClassificationRequest, EmbeddingRequest, RerankRequest, ScoreRequest,
                                    create_classification, create_embedding, create_rerank, create_score)
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


def _state(request: Request) -> ServerState:
    return request.app.state.kestrel


# ------------------------------------------------------------------------------ errors: the OpenAI error body
async def _on_validation(request: Request, exc: RequestValidationError):
    errs = exc.errors()
    e = errs[0] if errs else {"loc": (), "msg": "invalid request", "type": ""}
    cause = (e.get("ctx") or {}).get("error")
    if isinstance(cause, InvalidRequest):  # raised by our own validators
        return _error(400, cause.message, cause.error_type, cause.param)
    if e.get("type") == "json_invalid":
        return _error(400, f"malformed JSON body: {(e.get('ctx') or {}).get('error', e.get('msg'))}",
                      "invalid_request_error")
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    if not loc:  # the body as a whole: say so when it is not JSON at all (e.g. no JSON content type)
        try:
            json.loads(await request.body() or b"null")
        except ValueError as je:
            return _error(400, f"malformed JSON body: {je}", "invalid_request_error")
    where = ".".join(loc) or "body"
    return _error(400, f"{where}: {e.get('msg')}", "invalid_request_error", loc[0] if loc else None)


async def _on_kestrel(request: Request, exc: KestrelError):
    if exc.status_code >= 500:
        logger.error("%s %s failed: %s", request.method, request.url.path, exc)
    return _error(exc.status_code, str(exc), exc.error_type, getattr(exc, "param", None), getattr(exc, "code", None))


async def _on_utility(request: Request, exc: UtilityError):
    logger.error("%s %s failed: %s", request.method, request.url.path, exc)
    failed = exc.failed_engines if isinstance(exc, UtilityFanoutError) else [exc.engine_index]
    return _error(500, f"{exc.method} failed on engine(s) {failed}; see the server log", "utility_error")


async def _on_http(request: Request, exc: StarletteHTTPException):
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return _error(exc.status_code, str(exc.detail), kind)


async def _on_disconnected(request: Request, exc: ClientDisconnected):
    return Response(status_code=499)  # nginx's "client closed request"; nobody reads it


async def _on_internal(request: Request, exc: Exception):
    logger.exception("%s %s failed", request.method, request.url.path)
    return _error(500, "internal server error; see the server log", "internal_error")


class _Unauthorized(Exception):
    pass


async def _on_unauthorized(request: Request, exc: _Unauthorized):
    return _error(401, "invalid or missing API key (send 'Authorization: Bearer KEY')", "authentication_error",
                  None, "invalid_api_key")


def install_error_handlers(app: FastAPI) -> None:
    for exc_type, handler in ((RequestValidationError, _on_validation), (KestrelError, _on_kestrel),
                              (UtilityError, _on_utility), (StarletteHTTPException, _on_http),
                              (_Unauthorized, _on_unauthorized), (ClientDisconnected, _on_disconnected),
                              (Exception, _on_internal)):
        app.add_exception_handler(exc_type, handler)


# ------------------------------------------------------------------------------ access
async def check_key(request: Request):
    key = _state(request).api_key
    if key and not secrets.compare_digest(request.headers.get("authorization", "").encode(), f"Bearer {key}".encode()):
        raise _Unauthorized()


async def check_admin(request: Request):
    if not _state(request).server.enable_admin_api:
        raise NotFound("admin endpoints are off; start the server with --enable-admin-api")


def _alive(state: ServerState) -> None:
    if state.engine.is_dead:
        raise state.engine.unavailable()


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes gets 413 (by Content-Length, or while it streams)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            return await _error(413, f"request body is larger than {self.limit} bytes (--max-request-body-bytes)",
                                "invalid_request_error")(scope, receive, send)
        seen = 0
        t0 = time.perf_counter()
        metrics = getattr(getattr(scope.get("app"), "state", None), "kestrel", None)
        metrics = getattr(metrics, "metrics", None)

        async def limited_receive():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if metrics is not None and message.get("type") == "http.request" and not message.get("more_body"):
                metrics.on_frontend("receive", time.perf_counter() - t0)
            if seen > self.limit:  # FastAPI passes an HTTPException from the body read through unchanged
                raise StarletteHTTPException(413, f"request body is larger than {self.limit} bytes "
                                                  f"(--max-request-body-bytes)")
            return message

        await self.app(scope, limited_receive, send)


def json_only(app):
    """ASGI middleware: a POST with a body must say it is JSON (application/json or a +json type), else 415. A
    browser posts text/plain across origins without a CORS preflight; no route of this server takes it."""
    async def middleware(scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = dict(scope["headers"])
            has_body = headers.get(b"content-length", b"0") not in (b"", b"0") or b"transfer-encoding" in headers
            kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if has_body and kind != b"application/json" and not kind.endswith(b"+json"):
                shown = kind.decode("latin-1") or "none"
                return await _error(415, f"the body must be JSON (Content-Type: application/json), not {shown}",
                                    "invalid_request_error")(scope, receive, send)
        return await app(scope, receive, send)

    return middleware


# ------------------------------------------------------------------------------ routes
open_routes = APIRouter()
api = APIRouter(dependencies=[Depends(check_key)])
admin = APIRouter(dependencies=[Depends(check_key), Depends(check_admin)])


@open_routes.get("/health")
async def health(request: Request):
    """200 while some engine core can serve; each engine's state (ready, unresponsive, restarting, dead)."""
    client = _state(request).engine.client
    down = client.out_of_service()
    engines = [{"index": i, "state": client.engine_state(i), **({"error": str(down[i])} if i in down else {})}
               for i in range(client.num_engines)]
    if client.is_dead:
        body = error_body("no engine core can serve: " + "; ".join(str(e) for e in down.values()),
                          "engine_dead", None, 503)
        return JSONResponse({**body, "engines": engines}, status_code=503)
    return {"status": "ok", "engines": engines}


@open_routes.api_route("/ping", methods=["GET", "POST"])
async def ping(request: Request):
    """SageMaker's health check, as vLLM serves it: the answer of /health."""
    return await health(request)


@api.post("/invocations")
async def invocations(raw: Request):
    """SageMaker's one endpoint, as vLLM routes it: the body goes to the first API whose request it is (a chat
    completion, then a completion; on a pooling model, an embedding or classification body)."""
    try:
        body = json.loads(await raw.body() or b"null")
    except ValueError as e:
        raise InvalidRequest(f"malformed JSON body: {e}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    routes = ((ChatCompletionRequest, chat, "messages"), (CompletionRequest, completions, "prompt"))
    pooling = _state(raw).engine.pooling
    if pooling is not None:  # a pooling model: its own API takes the body
        routes = ((EmbeddingRequest, embeddings, "input") if pooling["task"] == "embed"
                  else (ClassificationRequest, classify, "input"),)
    for request_type, endpoint, _ in routes:
        try:
            req = request_type.model_validate(body)
        except ValidationError:
            continue
        return await endpoint(req, raw)
    for request_type, _, key in routes:  # the API the body was meant for: its own 400 names the bad field
        if key in body:
            try:
                request_type.model_validate(body)
            except ValidationError as e:
                raise RequestValidationError(e.errors()) from None
    if pooling is not None:
        raise InvalidRequest(f"/invocations on this pooling model ({pooling['task']}) takes a body with `input`")
    raise InvalidRequest("/invocations takes a chat completion body (messages) or a completion body (prompt)"
                         + ("; embeddings need a pooling model" if "input" in body else ""))


@api.get("/openapi.json", include_in_schema=False)
async def openapi_schema(request: Request):
    """Behind the key when one is set (FastAPI's own route answers anyone)."""
    return JSONResponse(request.app.openapi())


@api.get("/docs", include_in_schema=False)
async def docs_page(request: Request):
    """Swagger UI; with an API key, the page's own fetch of /openapi.json needs the key too (use a client that
    sends it, or read /openapi.json with the header)."""
    from fastapi.openapi.docs import get_swagger_ui_html

    return get_swagger_ui_html(openapi_url="/openapi.json", title="Kestrel")


@api.get("/version")
async def version():
    return {"version": kestrel.__version__}


@api.get("/v1/models")
async def models(request: Request):
    state = _state(request)
    return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                        "owned_by": "kestrel", "root": state.engine.config.model.model,
                                        "max_model_len": state.engine.max_model_len}] + lora_model_cards(state)}


@api.post("/v1/completions")
async def completions(req: CompletionRequest, raw: Request):
    _alive(_state(raw))
    return await create_completion(_state(raw), req, raw)


@api.post("/v1/chat/completions")
async def chat(req: ChatCompletionRequest, raw: Request):
    _alive(_state(raw))
    return await create_chat_completion(_state(raw), req, raw)


@api.post("/v1/responses")
async def responses(req: ResponsesRequest, raw: Request):
    _alive(_state(raw))
    return await create_response(_state(raw), req, raw)


@api.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, raw: Request):
    return await get_response(_state(raw), response_id, raw)


@api.post("/v1/embeddings")
async def embeddings(req: EmbeddingRequest, raw: Request):
    _alive(_state(raw))
    return await create_embedding(_state(raw), req, raw)


@api.post("/classify")
async def classify(req: ClassificationRequest, raw: Request):
    _alive(_state(raw))
    return await create_classification(_state(raw), req, raw)


@api.post("/score")
@api.post("/v1/score")
async def score(req: ScoreRequest, raw: Request):
    _alive(_state(raw))
    return await create_score(_state(raw), req, raw)


@api.post("/rerank")
@api.post("/v1/rerank")
@api.post("/v2/rerank")
async def rerank(req: RerankRequest, raw: Request):
    _alive(_state(raw))
    return await create_rerank(_state(raw), req, raw)


@api.post("/pooling")
async def pooling(req: PoolingRequest, raw: Request):
    _alive(_state(raw))
    return await create_pooling(_state(raw), req, raw)


@api.post("/tokenize")
async def tokenize(req: TokenizeRequest, raw: Request):
    state = _state(raw)
    engine = state.engine
    state.check_model(req.model)
    if req.messages:
        ids = await render_prompt(state, req)
        ids = ids.token_ids if isinstance(ids, ProcessedPrompt) else ids  # with images: their placeholder tokens
    elif req.prompt is not None:
        ids = await engine.run_tokenizer(engine.tokenizer.encode, req.prompt, add_special_tokens=req.add_special_tokens)
    else:
        raise InvalidRequest("give a prompt or messages", param="prompt")
    return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}


@api.post("/detokenize")
async def detokenize(req: DetokenizeRequest, raw: Request):
    state = _state(raw)
    state.check_model(req.model)
    vocab = state.engine.input_processor.vocab_size
    if any(not 0 <= t < vocab for t in req.tokens):
        raise InvalidRequest(f"tokens must be ids in [0, {vocab})", param="tokens")
    return {"prompt": await state.engine.run_tokenizer(state.engine.tokenizer.decode, req.tokens)}


@api.get("/metrics")
async def metrics_endpoint(request: Request):
    return Response(_state(request).metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


# ---- admin: fan-outs to every live engine core
@admin.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request):
    return {"ok": await _state(request).engine.reset_prefix_cache()}


@admin.post("/sleep")
async def sleep(request: Request, level: int = 1):
    return {"ok": await _state(request).engine.sleep(level)}


@admin.post("/wake_up")
async def wake_up(request: Request):
    return {"ok": await _state(request).engine.wake_up()}


@admin.get("/is_sleeping")
async def is_sleeping(request: Request):
    return {"is_sleeping": await _state(request).engine.is_sleeping()}


# ------------------------------------------------------------------------------ the app
def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file, or the template text itself (as vLLM accepts)."""
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if any(c in value for c in "{%"):
        return value
    raise ConfigError(f"--chat-template {value!r} is neither a file nor a Jinja template")


def load_sampling_defaults(source: str, model_path: str | None, overrides: dict | None = None) -> dict:
    """Sampling defaults from generation_config.json, as vLLM applies them (--generation-config), with
    --override-generation-config's fields over them."""
    defaults = _generation_config_defaults(source, model_path)
    for key, value in (overrides or {}).items():
        defaults["max_tokens" if key == "max_new_tokens" else key] = value
    return defaults


def _generation_config_defaults(source: str, model_path: str | None) -> dict:
    if source == "vllm":
        return {}
    folder = model_path if source == "auto" else source
    if folder is None or not Path(folder).is_dir():
        if source != "auto":
            raise ConfigError(f"--generation-config {source!r} is not a folder")
        return {}
    from transformers import GenerationConfig

    try:
        diff = GenerationConfig.from_pretrained(folder).to_diff_dict()
    except OSError:
        return {}
    defaults = {k: diff[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty") if k in diff}
    if "max_new_tokens" in diff:
        defaults["max_tokens"] = diff["max_new_tokens"]
    return defaults


def build_app(config: EngineConfig, server: ServerConfig | None = None, model_name: str | None = None,
              api_key: str | None = None, log_requests: bool = False, client: str = "mp",
              model_aliases: tuple[str, ...] = (), log_request_lines: bool = True) -> FastAPI:
    server = server or ServerConfig()
    model_name = model_name or default_model_name(config)
    chat_template = load_chat_template(server.chat_template)
    if server.log_stats_interval <= 0:
        raise ConfigError(f"--log-stats-interval must be positive, got {server.log_stats_interval}")
    if server.enable_auto_tool_choice and not server.tool_call_parser:
        raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser")
    try:
        tool_parser = get_tool_parser(server.tool_call_parser)
        reasoning = get_reasoning_parser(server.reasoning_parser)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    metrics = ServerMetrics(model_name)
    engine = AsyncEngine(config, client, metrics=metrics, log_requests=log_requests,
                         log_request_lines=log_request_lines)
    metrics.bind(engine)
    state = ServerState(engine, model_name, metrics, api_key, server, tool_parser=tool_parser,
                        enable_auto_tool_choice=server.enable_auto_tool_choice, reasoning_parser=reasoning,
                        model_aliases=tuple(model_aliases))

    async def start_engine() -> None:
        """Start the engine cores (once); a failure shuts them down again and raises."""
        if engine.input_processor is not None:
            return
        try:
            await engine.start()
            if engine.tokenizer is None:  # random weights from a config.json alone: the engine takes token ids only
                raise ConfigError(f"the server needs a tokenizer and {config.model.model} has none: pass --tokenizer")
        except BaseException:
            await engine.shutdown()
            raise

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await start_engine()
        from kestrel.loader import default_model_path

        state.sampling_defaults = load_sampling_defaults(server.generation_config,
                                                         config.model.model or default_model_path(),
                                                         server.override_generation_config)
        if state.sampling_defaults:
            logger.info("sampling defaults from generation_config.json: %s", state.sampling_defaults)
        ip = engine.input_processor
        ip.default_max_tokens = min(server.default_max_tokens, state.sampling_defaults.pop("max_tokens", 1 << 62))
        ip.chat_template = chat_template or ip.chat_template
        logger.info("serving %s (max_model_len %d, %d engine core(s))", model_name, engine.max_model_len,
                    engine.client.num_engines)
        stats_log = None if server.disable_log_stats else StatsLog(engine.client, server.log_stats_interval)
        metrics.configure(engine.max_model_len, config.cache, stats_log)
        stats_task = asyncio.create_task(stats_log.run()) if stats_log is not None else None
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()
            state.grammar.shutdown()
            await engine.shutdown()

    app = FastAPI(title="Kestrel", version=kestrel.__version__, lifespan=lifespan, openapi_url=None, docs_url=None,
                  redoc_url=None)  # /openapi.json and /docs are served behind the key (routes above)
    app.state.kestrel = state
    app.state.start_engine = start_engine
    install_error_handlers(app)
    for router in (open_routes, api, admin):
        app.include_router(router)
    if config.lora.enable_lora:  # loading and unloading adapters are admin operations
        app.include_router(lora_router(state, [Depends(check_key), Depends(check_admin)]))
    if server.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=server.allowed_origins, allow_methods=["*"],
                           allow_headers=["*"], allow_credentials=server.allow_credentials)
    app.add_middleware(BodyLimit, limit=server.max_request_body_bytes)
    app.add_middleware(json_only)
    return app


def check_port_free(host: str, port: int) -> None:
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(f"--host {host}: {e.strerror}") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            probe.bind(address)
        except OSError as e:
            raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}") from None


def load_tls(uv_config, keyfile: str | None, certfile: str | None) -> None:
    """Load uvicorn's config now, TLS files included, so that a bad one is a clear line before the model loads."""
    import ssl

    if keyfile and not certfile:
        raise ConfigError("--ssl-keyfile needs --ssl-certfile")
    for flag, path in (("--ssl-keyfile", keyfile), ("--ssl-certfile", certfile)):
        if path and not Path(path).is_file():
            raise ConfigError(f"{flag} {path}: no such file")
    try:
        uv_config.load()
    except (ssl.SSLError, OSError) as e:
        raise ConfigError(f"--ssl-certfile {certfile} / --ssl-keyfile {keyfile}: {e}") from None


class InterruptibleServer(uvicorn.Server):
    """uvicorn's server, remembering a Ctrl-C. After its graceful shutdown uvicorn raises the signal again for
    asyncio.run to turn into KeyboardInterrupt (main() answers it with exit status 130). That can be lost: a
    process that started with SIGINT ignored (a shell's background job) keeps ignoring the re-raised one, and a CI
    run once saw exit status 0 after Ctrl-C. So run_server raises it where asyncio.run did not."""
    interrupted = False

    def handle_exit(self, sig, frame) -> None:
        self.interrupted |= sig == signal.SIGINT
        super().handle_exit(sig, frame)


def run_server(args) -> int:
    from uvicorn._compat import asyncio_run

    from kestrel.config import from_cli_args, section_from_cli_args

    config = from_cli_args(args)
    names = args.served_model_name or [None]
    app = build_app(config, section_from_cli_args(ServerConfig, args), names[0], args.api_key or None,
                    args.log_requests, model_aliases=names[1:], log_request_lines=not args.disable_log_requests)
    uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                               timeout_graceful_shutdown=5, root_path=args.root_path, ssl_keyfile=args.ssl_keyfile,
                               ssl_certfile=args.ssl_certfile,
                               access_log=not getattr(args, "disable_uvicorn_access_log", False))
    server = InterruptibleServer(uv_config)
    check_port_free(args.host, args.port)  # before minutes of model loading, not after
    load_tls(uv_config, args.ssl_keyfile, args.ssl_certfile)

    async def serve() -> None:
        # the engine starts before uvicorn's lifespan (which then finds it started), so that a start-up refusal
        # reaches main() as one line instead of uvicorn's traceback
        await app.state.start_engine()
        await server.serve()

    asyncio_run(serve(), loop_factory=uv_config.get_loop_factory())
    if server.interrupted:  # where asyncio.run did not already raise it
        raise KeyboardInterrupt
    return 0 if server.started else 1
