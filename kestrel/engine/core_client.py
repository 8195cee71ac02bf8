"""Core clients: how the async frontend talks to engine cores.

- InprocClient: the EngineCore in this process, stepped on a worker thread (tests, offline use).
- MPClient: engine-core processes over ZeroMQ (engine/core_proc.py); one engine, or several for data parallel.
- DPClient: MPClient over N engines that routes each new request to the least-loaded engine.

Every client delivers EngineCoreOutputs to `on_outputs` (on the event loop) and reports a dead engine through
`on_engine_dead(exc, child_request_ids)`, where exc is kestrel.errors.EngineDead naming the engine."""
from __future__ import annotations

import asyncio
import collections
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import msgspec
import zmq
import zmq.asyncio

from kestrel.config import EngineConfig
from kestrel.engine import protocol as P
from kestrel.engine.core_proc import engine_identity, run_engine_core
from kestrel.engine.utility import FanoutResult, UtilityClient
from kestrel.errors import EngineDead, KestrelError

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.2
STARTUP_TIMEOUT_S = float(os.environ.get("KESTREL_ENGINE_STARTUP_TIMEOUT", "600"))


class EngineStartupError(KestrelError, RuntimeError):
    """An engine core did not come up (its error, exit code or a time-out)."""


OutputHandler = Callable[[P.EngineCoreOutputs], None]
DeadHandler = Callable[[EngineDead, list[str] | None], None]


class EngineCoreClient:
    """Interface shared by the clients."""

    num_engines = 1

    def __init__(self):
        self.on_outputs: OutputHandler = lambda o: None
        self.on_engine_dead: DeadHandler = lambda exc, ids: None
        self.engine_info: list[dict] = []
        self.stats: list[P.SchedulerStats | None] = []
        self.dead: dict[int, EngineDead] = {}

    @property
    def is_dead(self) -> bool:
        """True when no engine is left to serve."""
        return len(self.dead) >= self.num_engines

    async def start(self) -> None: ...
    def add_request(self, request: P.EngineCoreRequest) -> int: ...
    def abort_requests(self, request_ids: list[str]) -> None: ...
    async def shutdown(self) -> None: ...

    # ---- utility calls: all of them go through engine/utility.py's UtilityClient (self.utility), for which
    # the client is the transport (num_engines, encode, send)
    def encode(self, engine_index: int, call_id: int, method: str, args: tuple) -> bytes:
        return P.encoder.encode(P.UtilityRequest(call_id, method, list(args)))

    async def send(self, engine_index: int, payload: bytes) -> None:
        raise NotImplementedError

    def _deliver_utility(self, engine: int, u: P.UtilityOutput) -> None:
        self.utility.deliver(u.call_id, u.ok, u.result if u.ok else u.failure_message, engine_index=engine)

    async def call_utility(self, method: str, *args, engine: int = 0) -> Any:
        return await self.utility.call_utility(engine, method, *args)

    async def call_utility_all(self, method: str, *args, timeout: float | None = None) -> FanoutResult:
        """Every engine's outcome, in engine order, after all settled (never raises by itself)."""
        return await self.utility.call_utility_all(method, *args, timeout=timeout)

    async def call_utility_all_or_undo(self, method: str, args, undo_method: str, undo_args_fn=None,
                                       timeout: float | None = None) -> FanoutResult:
        """A mutating fan-out: applied everywhere, or undone on the engines where it succeeded."""
        return await self.utility.call_utility_all_or_undo(method, args, undo_method, undo_args_fn, timeout=timeout)


# ------------------------------------------------------------------ in-process
class InprocClient(EngineCoreClient):
    """EngineCore in this process. All core calls run on one worker thread, so the core is never touched
    concurrently; the event loop only queues commands."""

    def __init__(self, config: EngineConfig):
        super().__init__()
        self.config = config
        self.core = None
        self._cmds: collections.deque = collections.deque()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kestrel-core")
        self._closed = False
        self.utility = UtilityClient(self)

    async def start(self) -> None:
        from kestrel.engine.core import EngineCore

        loop = asyncio.get_running_loop()
        self.core = await loop.run_in_executor(self._pool, lambda: EngineCore(self.config, progress=False))
        hf = self.core.runner.hf_config
        self.engine_info = [{"engine_index": 0, "pid": os.getpid(), "max_model_len": self.core.max_model_len,
                             "vocab_size": int(hf.vocab_size), "eos_token_id": self.core.eos_token_id,
                             "num_kv_blocks": self.core.kv.num_blocks, "block_size": self.config.cache.block_size}]
        self.stats = [self.core.stats()]
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._loop())

    def _run_cmds_and_step(self) -> P.EngineCoreOutputs | None:
        while self._cmds:
            self._cmds.popleft()()
        return self.core.step() if self.core.has_unfinished_requests() else P.EngineCoreOutputs(0, [], self.core.stats())

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closed:
            if not self._cmds and not self.core.has_unfinished_requests():
                self._wake.clear()
                await self._wake.wait()
                continue
            outs = await loop.run_in_executor(self._pool, self._run_cmds_and_step)
            self.stats = [outs.stats]
            try:
                self.on_outputs(outs)
            except Exception:
                logger.exception("output handler failed")

    def _queue(self, fn) -> None:
        self._cmds.append(fn)
        self._wake.set()

    def add_request(self, request: P.EngineCoreRequest) -> int:
        self._queue(lambda: self.core.add_request(request))
        return 0

    def abort_requests(self, request_ids: list[str]) -> None:
        ids = list(request_ids)
        self._queue(lambda: self.core.abort_requests(ids))

    async def send(self, engine_index: int, payload: bytes) -> None:
        loop = asyncio.get_running_loop()

        def run():  # on the core thread, like the engine-core process's loop
            call = P.utility_decoder.decode(payload)
            try:
                if call.method not in self.core.UTILITY_METHODS:
                    raise AttributeError(f"{call.method!r} is not a utility method of the engine core")
                reply = P.UtilityOutput(call.call_id, True, getattr(self.core, call.method)(*call.args))
            except Exception as e:
                reply = P.UtilityOutput(call.call_id, False, None,
                                        f"Call to {call.method} method failed: {type(e).__name__}: {e}")
            loop.call_soon_threadsafe(self._deliver_utility, 0, reply)

        self._queue(run)

    async def shutdown(self) -> None:
        self._closed = True
        self.utility.fail_all(EngineDead("the engine client was shut down"))
        if self._wake is not None:
            self._wake.set()
        if self._task is not None:
            self._task.cancel()
        self._pool.shutdown(wait=False)


# ------------------------------------------------------------------ engine-core processes over ZeroMQ
class MPClient(EngineCoreClient):
    """One or more engine-core processes. The client binds a ROUTER (input) and a PULL (output) socket on ipc
    paths in a private temporary folder; every engine connects a DEALER and a PUSH."""

    def __init__(self, config: EngineConfig, num_engines: int = 1, startup_timeout: float = STARTUP_TIMEOUT_S):
        super().__init__()
        self.config = config
        self.num_engines = num_engines
        self.startup_timeout = startup_timeout
        self.procs: list = []
        self.stats = [None] * num_engines
        self.routed_since_stats = [0] * num_engines
        self.request_engine: dict[str, int] = {}  # core request id -> engine index
        self.utility = UtilityClient(self)
        self._tasks: list[asyncio.Task] = []
        self._closing = False
        self._dir: str | None = None

    # ---- start-up
    def _device_for(self, i: int) -> str | None:
        if self.num_engines == 1:
            return None
        try:
            import torch

            n = torch.cuda.device_count() if self.config.model.device != "cpu" else 0
        except Exception:
            n = 0
        if n <= 1:
            return None
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = [d.strip() for d in visible.split(",")] if visible else [str(d) for d in range(n)]
        return devices[i % len(devices)]

    async def start(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="kestrel-")
        in_addr, out_addr = f"ipc://{self._dir}/input", f"ipc://{self._dir}/output"
        self._ctx = zmq.Context()
        self._actx = zmq.asyncio.Context()
        self._input = self._ctx.socket(zmq.ROUTER)
        self._input.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.bind(in_addr)
        self._output = self._actx.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(out_addr)
        mp = multiprocessing.get_context("spawn")
        cfg = self.config.to_dict()
        for i in range(self.num_engines):
            p = mp.Process(target=run_engine_core, name=f"kestrel-engine-{i}", daemon=True,
                           args=(cfg, in_addr, out_addr, i, os.getpid(), self._device_for(i),
                                 logging.getLogger("kestrel").getEffectiveLevel()))
            p.start()
            self.procs.append(p)
        try:
            await self._wait_ready()
        except BaseException:
            await self.shutdown()
            raise
        self._tasks = [asyncio.create_task(self._output_loop(), name="kestrel-output-loop"),
                       asyncio.create_task(self._watch_engines(), name="kestrel-engine-watch")]

    async def _wait_ready(self) -> None:
        info: dict[int, dict] = {}
        deadline = time.monotonic() + self.startup_timeout
        while len(info) < self.num_engines:
            while self._input.poll(0):
                ident, payload = self._input.recv_multipart()[:2]
                idx = int.from_bytes(ident, "little")
                try:
                    msg = msgspec.msgpack.decode(payload)
                except Exception:
                    msg = {"status": "error", "message": "undecodable hand-shake"}
                if msg.get("status") != "ready":
                    raise EngineStartupError(f"engine core {idx} failed to start: {msg.get('message')}")
                info[idx] = msg
            for i, p in enumerate(self.procs):
                if i not in info and not p.is_alive():
                    raise EngineStartupError(f"engine core {i} (pid {p.pid}) exited with code {p.exitcode} "
                                             f"before it was ready; see its log above")
            if time.monotonic() > deadline:
                raise EngineStartupError(f"engine cores not ready after {self.startup_timeout:.0f} s "
                                         f"(ready: {sorted(info)})")
            await asyncio.sleep(0.05)
        self.engine_info = [info[i] for i in range(self.num_engines)]

    # ---- sending
    def _send(self, engine: int, rtype: P.RequestType, payload: bytes) -> None:
        if engine in self.dead:
            raise self.dead[engine]
        try:
            self._input.send_multipart([engine_identity(engine), rtype.value, payload], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            raise EngineDead(f"engine core {engine} is unreachable: {e}") from e

    def _choose_engine(self, request: P.EngineCoreRequest) -> int:
        return 0

    def add_request(self, request: P.EngineCoreRequest) -> int:
        engine = self._choose_engine(request)
        self.request_engine[request.request_id] = engine
        try:
            self._send(engine, P.RequestType.ADD, P.encoder.encode(request))
        except BaseException:
            self.request_engine.pop(request.request_id, None)
            raise
        self.routed_since_stats[engine] += 1
        return engine

    def abort_requests(self, request_ids: list[str]) -> None:
        by_engine: dict[int, list[str]] = {}
        for rid in request_ids:
            e = self.request_engine.pop(rid, None)
            if e is not None:
                by_engine.setdefault(e, []).append(rid)
        for e, ids in by_engine.items():
            if e in self.dead:
                continue
            try:
                self._send(e, P.RequestType.ABORT, P.encoder.encode(ids))
            except EngineDead as exc:
                logger.warning("abort not delivered: %s", exc)

    async def send(self, engine_index: int, payload: bytes) -> None:
        self._send(engine_index, P.RequestType.UTILITY, payload)

    # ---- receiving
    async def _output_loop(self) -> None:
        while True:
            try:
                data = await self._output.recv()
            except (asyncio.CancelledError, zmq.ContextTerminated):
                return
            except zmq.ZMQError as e:
                if self._closing:
                    return
                logger.error("output socket error: %s", e)
                await asyncio.sleep(0.05)
                continue
            try:
                outs = P.output_decoder.decode(data)
            except Exception as e:
                logger.warning("dropping an undecodable engine output: %s", e)
                continue
            idx = outs.engine_index
            if outs.utility_output is not None:
                self._deliver_utility(idx, outs.utility_output)
            if 0 <= idx < self.num_engines and outs.stats is not None:
                self.stats[idx] = outs.stats
                self.routed_since_stats[idx] = 0
            for o in outs.outputs:
                if o.finished:
                    self.request_engine.pop(o.request_id, None)
            if outs.outputs:
                try:
                    self.on_outputs(outs)
                except Exception:
                    logger.exception("output handler failed")

    async def _watch_engines(self) -> None:
        try:
            while not self._closing:
                for i, p in enumerate(self.procs):
                    if i not in self.dead and not p.is_alive():
                        self._engine_died(i, p)
                await asyncio.sleep(WATCH_INTERVAL_S)
        except asyncio.CancelledError:
            return

    def _engine_died(self, i: int, p) -> None:
        exc = EngineDead(f"engine core {i} (pid {p.pid}) died with exit code {p.exitcode}")
        exc.engine_index = i
        self.dead[i] = exc
        logger.error("%s; failing its requests", exc)
        self.utility.fail_engine(i, exc)
        ids = [rid for rid, e in self.request_engine.items() if e == i]
        for rid in ids:
            del self.request_engine[rid]
        try:
            self.on_engine_dead(exc, ids)
        except Exception:
            logger.exception("engine-dead handler failed")

    # ---- shutdown
    async def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        for t in self._tasks:
            t.cancel()
        self.utility.fail_all(EngineDead("the engine client was shut down"))
        for i, p in enumerate(self.procs):
            if p.is_alive():
                try:
                    self._input.send_multipart([engine_identity(i), P.RequestType.SHUTDOWN.value, b""],
                                               flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        deadline = time.monotonic() + 5
        for p in self.procs:
            while p.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if p.is_alive():
                p.kill()
            p.join(1)
        for s in (getattr(self, "_input", None), getattr(self, "_output", None)):
            if s is not None:
                s.close(0)
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)


class DPClient(MPClient):
    """N engine cores (data parallel): each new request goes to the least-loaded live engine (running + waiting
    from its latest stats, plus the requests routed to it since those stats); aborts follow the request."""

    def _choose_engine(self, request: P.EngineCoreRequest) -> int:
        best, best_load = None, None
        for i in range(self.num_engines):
            if i in self.dead:
                continue
            s = self.stats[i]
            load = (s.num_running + s.num_waiting if s is not None else 0) + self.routed_since_stats[i]
            if best_load is None or load < best_load:
                best, best_load = i, load
        if best is None:
            raise EngineDead("every engine core is dead")
        return best


def make_client(config: EngineConfig, kind: str = "mp") -> EngineCoreClient:
    if kind == "inproc":
        return InprocClient(config)
    n = config.parallel.data_parallel_size
    return DPClient(config, n) if n > 1 else MPClient(config, 1)
