"""AsyncEngine: the asyncio frontend over a core client (what the HTTP server uses).

generate() validates (InputProcessor), sends the core requests, and yields RequestOutputs with streaming deltas
(OutputProcessor, incremental detokenization and stop strings). Callers tokenize and process images off the event
loop first (run_tokenizer: the render threads, --renderer-num-workers; an image model's image chats on the
render processes, render_chat_images and kestrel/frontend/render_proc.py), so a huge prompt or a large image never
stalls other clients. Leaving the iterator early (client disconnect = cancellation, or a break) aborts the
request in the engine, which frees its KV blocks; so does a request's timeout, after which its stream ends with
finish_reason "abort" and stop_reason "timeout". A stop string found here is sent to the core as an abort so the
engine stops generating. When an engine core dies, every request waiting on it fails with EngineDead.

Its parts, one module each: child_sender.py (core requests in through their admission windows),
request_metrics.py (TTFT, inter-token latency, finished requests), renderer.py (render threads and processes)
and fleet_control.py (the base class: calls on every engine core, LoRA adapters, sleep and wake-up)."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from pathlib import Path
from typing import AsyncIterator, Callable

from kestrel.config import EngineConfig
from kestrel.core.pooling import PoolingParams
from kestrel.core.sampling_params import SamplingParams, check_bad_words
from kestrel.engine.messages import EngineCoreOutputs
from kestrel.errors import ConfigError, EngineDead, EngineSleeping, InvalidRequest, ModelNotFound
from kestrel.frontend.admission import AdmissionWindow
from kestrel.frontend.beam_search import BeamSearchParams, search_async
from kestrel.frontend.child_sender import ChildSender
from kestrel.frontend.fleet_control import FleetControl
from kestrel.frontend.lora_registry import LoRARequest, parse_lora_modules
from kestrel.frontend.outputs import RequestOutput
from kestrel.frontend.pooling import pooling_sampling
from kestrel.frontend.processor import InputProcessor, OutputProcessor, ProcessedPrompt, make_mm_processor
from kestrel.frontend.renderer import Renderer
from kestrel.frontend.request_metrics import RequestMetrics, RequestMetricsSink
from kestrel.ipc.core_client import EngineCoreClient, InprocClient, make_client
from kestrel.ipc.utility import WaiterGuard

logger = logging.getLogger(__name__)


_ABORTED = object()


class AsyncEngine(FleetControl):
    def __init__(self, config: EngineConfig, client: EngineCoreClient | str = "mp",
                 metrics: RequestMetricsSink | None = None, log_requests: bool = False,
                 log_request_lines: bool = True):
        self.config = config
        self.client = client if isinstance(client, EngineCoreClient) else make_client(config, client)
        self.metrics = metrics
        self.log_requests = log_requests
        self.log_request_lines = log_request_lines  # False: no line when a request arrives or finishes
        self.tokenizer = None
        self.input_processor: InputProcessor | None = None
        self.output_processor: OutputProcessor | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._request_metrics = RequestMetrics(metrics)  # each running request's timing
        self._children = ChildSender(self.client, metrics)  # core requests in through their admission windows
        self.max_model_len = 0
        self.num_kv_blocks = 0
        self.max_prompt_tokens = 0  # the engines' admission limit (engine facts)
        self.pooling: dict | None = None  # a pooling model's facts (task, labels, Matryoshka sizes); None: generative
        super().__init__()  # the fleet's state: LoRA adapters, sleep level
        self.renderer = Renderer(config, isinstance(self.client, InprocClient), metrics)  # render threads, processes
        if config.scheduler.max_seqs_per_request < 0:
            raise ConfigError(f"--max-seqs-per-request must be 0 (auto) or positive, got "
                              f"{config.scheduler.max_seqs_per_request}")

    # ---- life cycle
    async def start(self) -> "AsyncEngine":
        from kestrel.loader import default_model_path, light_auto, tokenizer_or_none

        light_auto.import_auto_classes()  # here, before the threads below

        m = self.config.model
        lora_modules = parse_lora_modules(self.config.lora)  # a bad flag fails before any engine starts
        path = m.model or default_model_path()
        self.client.on_outputs = self._on_outputs
        self.client.on_engine_dead = self._on_engine_dead
        self.client.on_engine_restarted = self._restore_engine
        procs = self.renderer.procs = await asyncio.to_thread(self.renderer.make_processes)
        try:  # the render processes start beside the engine cores
            _, self.tokenizer, mm, _ = await asyncio.gather(
                self.client.start(),
                asyncio.to_thread(tokenizer_or_none, m, Path(path)),  # dummy weights without one: token ids only
                asyncio.to_thread(make_mm_processor, self.config),
                procs.start() if procs is not None else asyncio.sleep(0))
        except BaseException:
            if procs is not None:
                await procs.shutdown()
            raise
        info = self.client.engine_info[0]
        self.max_model_len = info["max_model_len"]
        self.num_kv_blocks = min(i["num_kv_blocks"] for i in self.client.engine_info)
        self.max_prompt_tokens = min(i["max_prompt_tokens"] for i in self.client.engine_info)
        self.pooling = info.get("pooling")
        self.input_processor = InputProcessor.for_engine(self.config, self.tokenizer, self.max_model_len,
                                                         info["vocab_size"], self.max_prompt_tokens, mm=mm,
                                                         pooling=self.pooling)
        self.output_processor = OutputProcessor(self.tokenizer)
        if mm is not None:
            await self.renderer.start_images(mm, info["device"])
        for name, lora_path in lora_modules:
            await self.loras.load(name, lora_path)
        return self

    async def shutdown(self) -> None:
        await self.client.shutdown()
        await self.renderer.shutdown()

    @property
    def render_procs(self):
        """An image model's render processes (RenderProcesses), when the server uses them; else None."""
        return self.renderer.procs

    @property
    def stats(self) -> list:
        return list(self.client.stats)

    async def run_tokenizer(self, fn: Callable, *args, **kwargs):
        """Run a tokenizer, chat-template or image-processor call on a render thread, off the event loop."""
        return await self.renderer.run(fn, *args, **kwargs)

    async def render_chat_images(self, messages: list[dict], add_generation_prompt: bool,
                                 chat_template: str | None, template_kwargs: dict, tools: list[dict] | None,
                                 continue_final_message: bool = False) -> ProcessedPrompt:
        """Chat messages with image_url parts -> token ids and image features, rendered by a render process."""
        ip = self.input_processor
        return await self.renderer.render_chat_images(ip.mm.pixel_dtype, ip.chat_template, messages,
                                                      add_generation_prompt, chat_template, template_kwargs, tools,
                                                      continue_final_message)

    # ---- requests
    async def tokenize_bad_words(self, params: SamplingParams) -> SamplingParams:
        """The request's bad_words tokenized on a render thread (generate() would do it on the event loop): at
        most MAX_BAD_WORDS words, counted before any is tokenized."""
        if not params.bad_words or params.bad_words_token_ids is not None:
            return params
        check_bad_words(params.bad_words)
        ids = await self.run_tokenizer(self.input_processor.bad_words_token_ids, params.bad_words)
        return params.clone(bad_words_token_ids=ids)

    def beam_search(self, prompt_ids: list[int], params: BeamSearchParams, request_id: str,
                    lora_request: LoRARequest | None = None, want_logprobs: bool = False,
                    timeout: float | None = None, window: AdmissionWindow | None = None,
                    priority: int = 0) -> AsyncIterator[RequestOutput]:
        """vLLM's beam search over this engine (kestrel/frontend/beam_search.py): validated now, then a stream of
        one finished RequestOutput with the best `params.beam_width` beams. The search is one request: its step
        requests go in through one admission window (`window`, shared by an API request's prompts; by default its
        own) and the engine's fair share counts them as one group; ``timeout`` (seconds from now) ends it as
        generate()'s does, with the beams so far."""
        params.validate(self.config.model.max_logprobs)
        deadline = None if timeout is None else time.monotonic() + timeout
        return self._beam_search(prompt_ids, params, request_id, lora_request, want_logprobs, deadline,
                                 window or self.admission_window(), priority)

    async def _beam_search(self, prompt_ids, params, request_id, lora_request, want_logprobs, deadline, window,
                           priority):
        def generate(ids, step, rid):
            return self.generate(ids, step, rid, priority, lora_request=lora_request, window=window, stream=False)

        yield await search_async(generate, prompt_ids, params, getattr(self.tokenizer, "eos_token_id", None),
                                 self.tokenizer, request_id, want_logprobs, deadline)

    def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                 priority: int = 0, timeout: float | None = None,
                 lora_request: LoRARequest | None = None,
                 window: AdmissionWindow | None = None, stream: bool = True,
                 pooling: PoolingParams | None = None) -> AsyncIterator[RequestOutput]:
        """Validate now (raises InvalidRequest / EngineDead before anything is sent) and return the stream.
        The request reaches the engine when the stream is first iterated; leaving it early aborts the request.
        ``timeout`` (seconds from now): then the request is aborted and its stream ends with finish_reason
        "abort", stop_reason "timeout". ``window``: the admission window shared by the streams of one API
        request (a prompt list), see admission_window(); by default the stream has its own. ``stream=False``:
        only the final output is yielded (what a caller that waits for the whole answer needs; a request of many
        sequences then costs no per-step snapshot of all of them). ``pooling``: a pooling request (see
        encode())."""
        if self.client.is_dead:
            raise self.unavailable()
        if self.sleep_level is not None:
            raise EngineSleeping("the server is sleeping; POST /wake_up wakes it")
        request_id = request_id or uuid.uuid4().hex
        if lora_request is not None and self.loras.adapters.get(lora_request.name) != lora_request:
            raise ModelNotFound(f"the adapter {lora_request.name!r} is not loaded", param="model",
                                code="model_not_found")
        if request_id in self._queues:
            raise InvalidRequest(f"request id {request_id!r} is already running", param="request_id")
        window = window or self.admission_window()
        ids, core_reqs = self.input_processor.process(request_id, prompt, params, priority,
                                                      lora_id=lora_request.lora_id if lora_request else 0,
                                                      pooling=pooling, group_id=window.group_id)
        deadline = None if timeout is None else time.monotonic() + timeout
        return self._stream(request_id, prompt, ids, params, core_reqs, deadline, window, stream)

    async def encode(self, prompt: str | list[int], pooling: PoolingParams, request_id: str | None = None,
                     priority: int = 0, window: AdmissionWindow | None = None,
                     truncate_prompt_tokens: int | None = None) -> RequestOutput:
        """A pooling request (embedding, class scores): its finished output, whose `pooled` holds the vector.
        Raises InvalidRequest (a generative engine, a bad prompt) before anything is sent."""
        stream = self.generate(prompt, pooling_sampling(truncate_prompt_tokens), request_id, priority, window=window, stream=False,
                               pooling=pooling)
        final = None
        async for out in stream:
            final = out
        if final is None or final.pooled is None:
            reason = final.outputs[0].stop_reason if final is not None and final.outputs else None
            raise EngineDead(f"the pooling request ended without a result ({reason or 'aborted'})")
        return final

    def admission_window(self) -> AdmissionWindow:
        """A new window for one API request: --max-seqs-per-request sequences in the engine at once, a quarter of
        that while other requests are being served (kestrel/frontend/admission.py)."""
        s = self.config.scheduler
        return self._children.new_window(s.request_window(), s.contended_window())

    async def _stream(self, request_id, prompt, ids, params, core_reqs, deadline,
                      window: AdmissionWindow, stream: bool) -> AsyncIterator[RequestOutput]:
        if request_id in self._queues:
            raise InvalidRequest(f"request id {request_id!r} is already running", param="request_id")
        if self.client.is_dead:
            raise self.unavailable()
        queue: asyncio.Queue = asyncio.Queue()
        guard = WaiterGuard(self._queues, on_discard=None)  # owns the stream registration on every exit path
        guard.register(request_id, queue)
        timing = self._request_metrics.start(request_id, len(core_reqs), params.max_tokens)
        self.output_processor.add_request(request_id, prompt, ids, params, core_reqs, stream=stream)
        if not self.log_request_lines:
            pass
        elif self.log_requests:
            logger.info("request %s: prompt=%r params=%s", request_id, prompt, params)
        else:
            logger.info("request %s: %d prompt tokens, n=%d, max_tokens=%s", request_id, len(ids), params.n,
                        core_reqs[0].max_tokens)
        finished = False
        sender = None
        try:
            sender = self._children.send(core_reqs, window, timing, queue)
            loop = asyncio.get_running_loop()
            loop_deadline = None if deadline is None else loop.time() + deadline - time.monotonic()
            while True:
                try:
                    async with asyncio.timeout_at(loop_deadline):
                        item = await queue.get()
                except TimeoutError:
                    self.client.abort_requests(self.output_processor.child_ids(request_id))
                    item = self.output_processor.finish(request_id, "abort", "timeout")
                    logger.info("request %s timed out; aborted", request_id)
                    finished = True
                    if item is not None:
                        yield item
                    return
                if item is _ABORTED:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True  # nothing left to abort: the engine is gone
                    raise item
                if item.finished:
                    finished = True
                    if self.log_request_lines:
                        self._log_finished(item)
                yield item
                if finished:
                    return
        finally:
            if sender is not None:
                sender.cancel()
            guard.close()
            self._request_metrics.end(request_id)
            if not finished:  # cancelled (client disconnect) or abandoned: free the engine's blocks
                self.abort(request_id, "its caller went away (client disconnected)")
            else:
                self.output_processor.abort(request_id)
            self._children.leave(r.request_id for r in core_reqs)

    def abort(self, request_id: str, why: str = "") -> None:
        child_ids = self.output_processor.abort(request_id)
        q = self._queues.get(request_id)
        if child_ids and not self.client.all_dead:
            self.client.abort_requests(child_ids)
            logger.info("request %s aborted%s", request_id, f": {why}" if why else "")
        if q is not None:
            q.put_nowait(_ABORTED)  # an external abort ends the stream quietly

    def _log_finished(self, out: RequestOutput) -> None:
        gen = sum(len(c.token_ids) for c in out.outputs)
        reasons = ",".join(str(c.finish_reason) for c in out.outputs)
        if self.log_requests:
            logger.info("request %s finished (%s): %d prompt + %d generated tokens, output=%r", out.request_id,
                        reasons, len(out.prompt_token_ids), gen, [c.text for c in out.outputs])
        else:
            logger.info("request %s finished (%s): %d prompt + %d generated tokens", out.request_id, reasons,
                        len(out.prompt_token_ids), gen)

    # ---- from the core client
    def _on_outputs(self, outs: EngineCoreOutputs) -> None:
        self._request_metrics.observe_engine(outs, self.output_processor.child_to_parent)
        results, to_stop = self.output_processor.process(outs.outputs)
        if to_stop:  # stop strings: the engine must stop generating these
            self.client.abort_requests(to_stop)
            self._children.leave(to_stop)
        self._children.leave(o.request_id for o in outs.outputs if o.finished)
        now = time.monotonic()
        self._request_metrics.observe_progress(self.output_processor.progress, now)
        for ro in results:
            q = self._queues.get(ro.request_id)
            if q is None:
                continue
            if ro.finished:
                self._request_metrics.observe_finished(ro, now)
            q.put_nowait(ro)

    def _on_engine_dead(self, exc: EngineDead, child_ids: list[str] | None) -> None:
        if child_ids is None or self.client.all_dead:
            parents = list(self._queues)
        else:
            parents = {self.output_processor.child_to_parent.get(c) for c in child_ids} - {None}
        for rid in parents:
            self.output_processor.abort(rid)
            q = self._queues.get(rid)
            if q is not None:
                q.put_nowait(exc)
