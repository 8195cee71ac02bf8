"""Rendering off the event loop: the render threads (--renderer-num-workers) that run tokenizer, chat-template and
image-processor calls, and an image model's render processes (kestrel/frontend/render_proc.py), so that a huge
prompt or a large image never stalls the server's other clients."""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from kestrel.config import EngineConfig
from kestrel.errors import ConfigError
from kestrel.frontend.processor import ProcessedPrompt, default_image_render_workers, mm_model_class

logger = logging.getLogger(__name__)


class Renderer:
    """`in_process`: the engine core runs in this process (tests, offline), which needs this process's torch
    threads and gets no render processes. `metrics`: a RequestMetricsSink for the frontend stages (or None)."""

    def __init__(self, config: EngineConfig, in_process: bool, metrics=None):
        workers = config.model.renderer_num_workers
        if workers is not None and workers < 1:
            raise ConfigError(f"--renderer-num-workers must be at least 1, got {workers}")
        self.config, self.in_process, self.metrics = config, in_process, metrics
        self.pool = ThreadPoolExecutor(workers or 1, thread_name_prefix="kestrel-render")
        self.procs = None  # an image model's render processes (RenderProcesses), when the server uses them

    def make_processes(self):
        """The render processes an image model's server loads and processes images on (not started yet); None for
        a text model, with --image-render-processes 0, or beside an in-process engine core (tests, offline)."""
        from kestrel.frontend.render_proc import RenderProcesses

        num = self.config.multimodal.image_render_processes
        if num == 0 or self.in_process:
            return None
        try:
            if mm_model_class(self.config) is None:
                return None
        except Exception:  # noqa: BLE001 - an unreadable checkpoint: the engine core's start-up reports it
            return None
        return RenderProcesses(self.config, num if num is not None else default_image_render_workers())

    async def start_images(self, mm, device: str) -> None:
        """Image models: pixels sent in the engine's model dtype, more render threads by default, torch ops in this
        process on one thread each (the render threads are the parallelism; N threads each spreading over every
        core slowed image requests down), and every render thread warmed up with one small image before the
        server takes requests."""
        import torch

        from kestrel.loader import resolve_dtype

        mm.pixel_dtype = resolve_dtype(self.config.model.dtype, torch.device(device))

        workers = self.config.model.renderer_num_workers
        if workers is None:
            workers = default_image_render_workers()
            self.pool.shutdown(wait=False)
            self.pool = ThreadPoolExecutor(workers, thread_name_prefix="kestrel-render")
        if workers > 1 and not self.in_process:  # an in-process engine core needs its threads
            torch.set_num_threads(1)
        if self.procs is not None:  # the render threads only render chat templates
            return
        barrier = threading.Barrier(workers, timeout=60)  # one warm-up on each thread, not several on one

        def warm_up() -> None:
            try:
                barrier.wait()
            except threading.BrokenBarrierError:
                pass
            mm.warm_up()

        t0 = time.perf_counter()
        try:
            await asyncio.gather(*(asyncio.get_running_loop().run_in_executor(self.pool, warm_up)
                                   for _ in range(workers)))
        except Exception as e:  # noqa: BLE001 - the requests will report it; the server still starts
            logger.warning("warming up the image processor failed: %s: %s", type(e).__name__, e)
            return
        logger.info("%d render thread(s) ready for images in %.1f s", workers, time.perf_counter() - t0)

    async def shutdown(self) -> None:
        if self.procs is not None:
            await self.procs.shutdown()
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def run(self, fn: Callable, *args, **kwargs):
        """Run a tokenizer, chat-template or image-processor call on a render thread, off the event loop."""
        stamps = [time.perf_counter()]

        def job():
            stamps.append(time.perf_counter())
            try:
                return fn(*args, **kwargs)
            finally:
                stamps.append(time.perf_counter())
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, job)
        finally:
            if self.metrics is not None and len(stamps) == 3:
                for stage, a, b in (("render_wait", 0, 1), ("render", 1, 2)):
                    self.metrics.on_frontend(stage, stamps[b] - stamps[a])
                self.metrics.on_frontend("resume", time.perf_counter() - stamps[2])

    async def render_chat_images(self, pixel_dtype, default_template: str | None, messages: list[dict],
                                 add_generation_prompt: bool, chat_template: str | None, template_kwargs: dict,
                                 tools: list[dict] | None, continue_final_message: bool) -> ProcessedPrompt:
        """Chat messages with image_url parts -> token ids and image features, rendered by a render process (the
        template, the images and the image processor)."""
        res, seconds = await self.procs.render(
            messages, add_generation_prompt, chat_template or default_template, template_kwargs, tools,
            str(pixel_dtype).removeprefix("torch.") if pixel_dtype is not None else None, continue_final_message)
        if self.metrics is not None:
            self.metrics.on_frontend("render_wait", max(0.0, seconds - res.seconds))
            self.metrics.on_frontend("render", res.seconds)
        return ProcessedPrompt(res.token_ids, res.extras, res.prompt)
