"""Image chat requests rendered in worker processes: an image model's server sends each chat request's messages
(image parts still URLs) to one of N render processes (--image-render-processes), which renders the chat template,
loads the images (base64 / file / allowed host), runs the HF image processor and hashes the pixels, and sends back
the token ids and image features.

Why processes: in the server process the render threads and the event loop share one GIL, and an image request
holds it for tens of milliseconds (PNG bytes to arrays, the processor's Python and tensor conversions, the Jinja
template), so under load every request waited for the others' rendering. A worker has its own GIL; the server's
event loop only moves bytes. Messages are msgspec over a local ZeroMQ socket (never pickle); a worker that dies
fails its own requests with a 500 and is started again, and it exits when the server process is gone."""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import shutil
import signal
import tempfile
import time
import traceback
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from kestrel.core.extras import NO_EXTRAS, RequestExtras
from kestrel.core.supervisor import StartupError, Supervisor, spawn_process, wait_while_parent_lives
from kestrel.ipc.core_proc import dealer_socket, router_socket
from kestrel.errors import InvalidRequest, KestrelError

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 300.0
PARENT_POLL_MS = 1000


class RenderJob(msgspec.Struct, array_like=True):
    job_id: int
    messages: list[dict]  # OpenAI chat messages, content parts as sent (image_url parts hold their URLs)
    add_generation_prompt: bool
    chat_template: str | None  # the request's or the server's template; None: the tokenizer's own
    template_kwargs: dict
    tools: list[dict] | None
    pixel_dtype: str | None  # the engine's model dtype (pixels are sent in it), None: the processor's own
    continue_final_message: bool = False  # the text ends inside the final message (an assistant prefill)


class RenderStatus(msgspec.Struct, tag="status"):
    """A worker's first message: ready, or why it could not start."""
    ok: bool
    message: str = ""


class RenderResult(msgspec.Struct, omit_defaults=True, tag="result"):
    job_id: int
    prompt: str = ""  # the chat template's text
    token_ids: list[int] = []
    extras: RequestExtras = NO_EXTRAS  # the images' features and the bidirectional prefix length
    seconds: float = 0.0  # the worker's time on the job
    error: str | None = None
    error_param: str | None = None
    internal: bool = False  # the worker failed (500), not the request (400)


_encoder = msgspec.msgpack.Encoder()
_job_decoder = msgspec.msgpack.Decoder(RenderJob)
_reply_decoder = msgspec.msgpack.Decoder(RenderStatus | RenderResult)


class RenderWorkerDied(KestrelError):
    """The render process working on a request died; the server starts another (HTTP 500)."""


# ---- the worker process
def run_render_worker(config_dict: dict, addr: str, index: int, parent_pid: int, log_level: int) -> None:
    """Process entry point (multiprocessing spawn target)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server handles Ctrl-C and stops its workers
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s render{index}: %(message)s",
                        datefmt="%H:%M:%S")
    ctx = zmq.Context()
    sock = dealer_socket(ctx, addr, worker_identity(index), 0)
    try:
        try:
            render = _make_renderer(config_dict)
        except BaseException as e:  # noqa: BLE001 - report why start-up failed, then exit non-zero
            logger.error("render process %d failed to start: %s", index, traceback.format_exc())
            sock.send(_encoder.encode(RenderStatus(False, f"{type(e).__name__}: {e}")))
            raise SystemExit(1)
        sock.send(_encoder.encode(RenderStatus(True)))
        logger.info("render process %d ready (pid %d)", index, os.getpid())
        while True:
            if not wait_while_parent_lives(sock.poll, parent_pid, PARENT_POLL_MS):
                logger.warning("server process %d is gone; render process %d exits", parent_pid, index)
                return
            payload = sock.recv()
            if not payload:  # the server's stop message
                return
            sock.send(_encoder.encode(render(_job_decoder.decode(payload))))
    finally:
        sock.close()
        ctx.term()


def _make_renderer(config_dict: dict):
    import torch

    from kestrel.config import EngineConfig
    from kestrel.frontend.media import resolve_image_parts
    from kestrel.frontend.processor import InputProcessor, ProcessedPrompt, make_mm_processor
    from kestrel.loader import default_model_path, tokenizer_or_none

    torch.set_num_threads(1)  # the processes are the parallelism
    config = EngineConfig.from_dict(config_dict)
    mm = make_mm_processor(config)
    if mm is None:
        raise ValueError(f"{config.model.model} is not an image model")
    tokenizer = tokenizer_or_none(config.model, Path(config.model.model or default_model_path()))
    inputs = InputProcessor(tokenizer, 0, 0, mm=mm,
                            max_num_batched_tokens=config.scheduler.max_num_batched_tokens)
    mm.warm_up()  # the processor's lazy imports and first allocations, before the first request

    def render(job: RenderJob) -> RenderResult:
        t0 = time.perf_counter()
        try:
            mm.pixel_dtype = getattr(torch, job.pixel_dtype) if job.pixel_dtype else None
            messages = resolve_image_parts(job.messages, config.multimodal)
            prompt = inputs.render_chat(messages, job.add_generation_prompt, job.chat_template,
                                        job.template_kwargs, job.tools, job.continue_final_message)
            out = inputs.process_images(prompt)
            if not isinstance(out, ProcessedPrompt):  # no image after all: the template's text alone
                out = ProcessedPrompt(inputs.tokenize(out, add_special_tokens=False), text=out)
            return RenderResult(job.job_id, out.text or "", out.token_ids, out.extras, time.perf_counter() - t0)
        except InvalidRequest as e:
            return RenderResult(job.job_id, error=e.message, error_param=e.param)
        except Exception as e:  # noqa: BLE001 - the request fails with a 500; the worker serves the next one
            logger.exception("rendering request %d failed", job.job_id)
            return RenderResult(job.job_id, error=f"{type(e).__name__}: {e}", internal=True)
    return render


def worker_identity(index: int) -> bytes:
    return b"render-%d" % index


# ---- the server side
class RenderProcesses:
    """N render processes behind one ROUTER socket, supervised by kestrel.core.supervisor (restarted at once, with
    no limit). `render` sends a job to the worker with the fewest jobs in flight and awaits its result; one task
    reads results, another watches the workers."""

    def __init__(self, config, num: int):
        self.config = config
        self.num = num
        self.sup = Supervisor("render process", num, self._spawn, startup_timeout=READY_TIMEOUT_S,
                              on_died=self._died)
        self._inflight: dict[int, tuple[int, asyncio.Future]] = {}  # job id -> (worker, its future)
        self._jobs = itertools.count()
        self._tasks: list[asyncio.Task] = []
        self._dir = None
        self._started = False

    @property
    def procs(self) -> list:
        return self.sup.procs

    @property
    def ready(self) -> list[bool]:
        return [self.sup.state(i) == "ready" for i in range(self.num)]

    async def start(self) -> "RenderProcesses":
        t0 = time.perf_counter()
        self._dir = tempfile.mkdtemp(prefix="kestrel-render-")
        self._addr = f"ipc://{self._dir}/render"
        self._ctx = zmq.asyncio.Context()
        self._sock = router_socket(self._ctx, self._addr)  # a restarted worker takes over its identity
        self._started = True
        self.sup.start_all()
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self.sup.run_watch(0.5))]
        try:
            await self.sup.wait_ready()
        except StartupError as e:
            await self.shutdown()
            raise RuntimeError(f"render processes failed to start: {e}") from None
        logger.info("%d render process(es) ready for images in %.1f s", self.num, time.perf_counter() - t0)
        return self

    def _spawn(self, i: int):
        return spawn_process(run_render_worker, f"kestrel-render-{i}",
                             (self.config.to_dict(), self._addr, i, os.getpid(),
                              logging.getLogger("kestrel").getEffectiveLevel()))

    async def render(self, messages: list[dict], add_generation_prompt: bool, chat_template: str | None,
                     template_kwargs: dict, tools: list[dict] | None, pixel_dtype: str | None,
                     continue_final_message: bool = False):
        """-> (RenderResult, seconds from send to result). Raises InvalidRequest for the request's own faults."""
        live = [i for i, ok in enumerate(self.ready) if ok]
        if not live:
            raise RenderWorkerDied("no render process is running (restarting)")
        load = {i: 0 for i in live}
        for w, _ in self._inflight.values():
            if w in load:
                load[w] += 1
        worker = min(live, key=load.__getitem__)
        job_id = next(self._jobs)
        fut = asyncio.get_running_loop().create_future()
        self._inflight[job_id] = (worker, fut)
        t0 = time.perf_counter()
        try:
            try:
                await self._sock.send_multipart([worker_identity(worker), _encoder.encode(
                    RenderJob(job_id, messages, add_generation_prompt, chat_template, template_kwargs, tools,
                              pixel_dtype, continue_final_message))], copy=False)
            except zmq.ZMQError as e:  # the worker's socket is gone: it died just now
                raise RenderWorkerDied(f"render process {worker} is not reachable ({e})") from e
            res: RenderResult = await fut
        finally:
            self._inflight.pop(job_id, None)
        if res.error is not None:
            if res.internal:
                raise KestrelError(f"rendering the images failed: {res.error}")
            raise InvalidRequest(res.error, param=res.error_param)
        return res, time.perf_counter() - t0

    async def _read(self) -> None:
        while True:
            try:
                ident, payload = await self._sock.recv_multipart()
            except (asyncio.CancelledError, zmq.ContextTerminated):
                return
            msg = _reply_decoder.decode(payload)
            if isinstance(msg, RenderStatus):
                i = int(ident.rsplit(b"-", 1)[1])
                if msg.ok:
                    self.sup.ready(i)
                else:  # it exits; the supervisor starts it again (or fails the start)
                    self.sup.start_failed(i, msg.message)
                continue
            entry = self._inflight.get(msg.job_id)
            if entry is not None and not entry[1].done():
                entry[1].set_result(msg)

    def _died(self, i: int, why: str) -> None:
        why = f"render process {i} {why}"
        logger.error("%s; starting another", why)
        for w, fut in list(self._inflight.values()):
            if w == i and not fut.done():
                fut.set_exception(RenderWorkerDied(f"{why} while rendering this request"))

    async def shutdown(self) -> None:
        """Stop the workers (idempotent); a start still waiting for them (the engine cores failed first) gives up
        at once."""
        if not self._started or self.sup.closed:  # never started, or stopped already
            return
        for t in self._tasks:
            t.cancel()
        await self.sup.astop(lambda i: self._sock.send_multipart([worker_identity(i), b""], flags=zmq.NOBLOCK),
                             grace=3.0)
        self._sock.close(0)
        self._ctx.term()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
