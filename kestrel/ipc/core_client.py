"""Core clients: how the async frontend talks to engine cores.

- InprocClient: the EngineCore in this process, stepped on a worker thread (tests, offline use).
- MPClient: engine-core processes over ZeroMQ (ipc/core_proc.py); one engine, or several for data parallel.
- DPClient: MPClient over N engines that routes each new request to the least-loaded engine.

Every client delivers EngineCoreOutputs to `on_outputs` (on the event loop) and reports a dead engine through
`on_engine_dead(exc, child_request_ids)`, where exc is kestrel.errors.EngineDead naming the engine. An engine
the client restarts gets the server's run-time state back (`on_engine_restarted(index, serve)`: the LoRA adapters
loaded so far) before it serves: until that hook calls `serve()`, the engine stays out of `live_engines` and gets
no requests, but utility calls reach it (`restoring`)."""
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
from typing import Awaitable, Callable

import msgspec
import zmq
import zmq.asyncio

from kestrel.config import EngineConfig
from kestrel.ipc import protocol as P
from kestrel.ipc.core_proc import engine_facts, engine_identity, router_socket, run_engine_core, run_utility
from kestrel.ipc.utility import UtilityClient
from kestrel.errors import EngineDead, KestrelError

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.2
EXIT_GRACE_S = 5.0  # an engine core that reported its failure is killed if it has not exited by then
RESTART_BACKOFF_S = (0.5, 30.0)  # first delay, cap; doubles per restart of the same engine


class EngineStartupError(KestrelError, RuntimeError):
    """An engine core did not come up (its error, exit code or a time-out)."""


OutputHandler = Callable[[P.EngineCoreOutputs], None]
DeadHandler = Callable[[EngineDead, list[str] | None], None]
RestartHandler = Callable[[int, Callable[[], None]], Awaitable[None]]


class EngineCoreClient:
    """Interface shared by the clients. ``dead`` is the one record of engines that cannot serve now (dead,
    restarting, or given up); the utility client reads it too."""

    num_engines = 1

    def __init__(self):
        self.on_outputs: OutputHandler = lambda o: None
        self.on_engine_dead: DeadHandler = lambda exc, ids: None
        self.engine_info: list[dict] = []
        self.stats: list[P.SchedulerStats | None] = []
        self.dead: dict[int, EngineDead] = {}
        self.restoring: set[int] = set()  # restarted engines (still in `dead`) getting their state back
        self.on_engine_restarted: RestartHandler | None = None
        self.utility = UtilityClient(self)

    @property
    def is_dead(self) -> bool:
        """True when no engine can serve."""
        return len(self.dead) >= self.num_engines

    @property
    def live_engines(self) -> list[int]:
        return [i for i in range(self.num_engines) if i not in self.dead]

    def engine_state(self, i: int) -> str:
        return "dead" if i in self.dead else "ready"

    async def start(self) -> None: ...
    def add_request(self, request: P.EngineCoreRequest) -> int: ...
    def abort_requests(self, request_ids: list[str]) -> None: ...
    async def shutdown(self) -> None: ...

    # ---- the UtilityTransport half (ipc/utility.py): encode + send; replies come back through deliver
    def encode(self, engine_index: int, call_id: int, method: str, args: tuple) -> bytes:
        return P.encoder.encode(P.UtilityRequest(call_id, method, list(args)))

    async def send(self, engine_index: int, payload: bytes) -> None:
        raise NotImplementedError

    def _deliver_utility(self, engine: int, u: P.UtilityOutput) -> None:
        self.utility.deliver(u.call_id, u.ok, u.result if u.ok else u.failure_message, engine_index=engine)


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

    async def start(self) -> None:
        from kestrel.engine.core import EngineCore

        loop = asyncio.get_running_loop()
        self.core = await loop.run_in_executor(self._pool, lambda: EngineCore(self.config, progress=False))
        self.engine_info = [engine_facts(self.core, 0)]
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
            try:
                outs = await loop.run_in_executor(self._pool, self._run_cmds_and_step)
            except Exception as e:  # a failed step (a tensor-parallel worker died): the engine is dead
                self._failed(e)
                return
            self.stats = [outs.stats]
            try:
                self.on_outputs(outs)
            except Exception:
                logger.exception("output handler failed")

    def _failed(self, e: Exception) -> None:
        exc = EngineDead(f"engine core 0 failed: {type(e).__name__}: {e}")
        exc.engine_index = 0
        logger.error("%s; failing its requests", exc)
        self.dead[0] = exc
        self.utility.fail_engine(0, exc)
        try:
            self.on_engine_dead(exc, None)
        except Exception:
            logger.exception("engine-dead handler failed")
        self._pool.submit(self.core.shutdown)

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
            reply = run_utility(self.core, P.utility_decoder.decode(payload))
            loop.call_soon_threadsafe(self._deliver_utility, 0, reply)

        self._queue(run)

    async def shutdown(self) -> None:
        self._closed = True
        self.utility.fail_engine(None, EngineDead("the engine client was shut down"))
        if self._wake is not None:
            self._wake.set()
        if self._task is not None:
            self._task.cancel()
        if self.core is not None:
            self._pool.submit(self.core.shutdown)  # stops tensor-parallel workers
        self._pool.shutdown(wait=False)


# ------------------------------------------------------------------ engine-core processes over ZeroMQ
def engine_devices(index: int, tp: int, devices: list[str]) -> str | None:
    """The GPUs of data-parallel engine `index` whose model spans `tp` of them: devices[index*tp .. index*tp+tp-1]
    (its tensor-parallel workers take them in order), wrapping around when the engines need more GPUs than there
    are (then engines share GPUs). None with one device or none: every engine inherits the same."""
    if len(devices) <= 1:
        return None
    return ",".join(devices[(index * tp + k) % len(devices)] for k in range(tp))


class MPClient(EngineCoreClient):
    """One or more engine-core processes. The client binds a ROUTER (input) and a PULL (output) socket on ipc
    paths in a private temporary folder; every engine connects a DEALER and a PUSH.

    An engine that dies fails its in-flight requests at once and is restarted after a back-off, at most
    ``engine_restart_limit`` times; while it is down it is in ``dead`` and gets no traffic."""

    def __init__(self, config: EngineConfig, num_engines: int = 1):
        super().__init__()
        self.config = config
        self.num_engines = num_engines
        self.startup_timeout = config.parallel.engine_startup_timeout
        self.restart_limit = config.parallel.engine_restart_limit
        self.procs: list = [None] * num_engines
        self.engine_info = [{} for _ in range(num_engines)]
        self.stats = [None] * num_engines
        self.routed_since_stats = [0] * num_engines
        self.request_engine: dict[str, int] = {}  # core request id -> engine index
        self.restarts = [0] * num_engines
        self._restart_at: dict[int, float] = {}  # dead engine -> when to spawn it again
        self._starting: dict[int, float] = {}  # spawned after a death, not ready yet -> start-up deadline
        self._exiting: dict[int, float] = {}  # reported its failure, process not gone yet -> when to kill it
        self._tasks: list[asyncio.Task] = []
        self._restores: set[asyncio.Task] = set()
        self._closing = False
        self._dir: str | None = None

    def engine_state(self, i: int) -> str:
        if i not in self.dead:
            return "ready"
        if i in self._starting or i in self._restart_at:
            return "restarting"
        if i in self._exiting and self.restarts[i] < self.restart_limit:
            return "restarting"
        return "dead"

    # ---- start-up
    def _device_for(self, i: int) -> str | None:
        """CUDA_VISIBLE_DEVICES for engine core i (None: inherit this process's)."""
        if self.num_engines == 1:
            return None
        try:
            import torch

            n = torch.cuda.device_count() if self.config.model.device != "cpu" else 0
        except Exception:
            n = 0
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = [d.strip() for d in visible.split(",")][:n] if visible else [str(d) for d in range(n)]
        return engine_devices(i, self.config.parallel.tensor_parallel_size, devices)

    def _spawn(self, i: int) -> None:
        p = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, name=f"kestrel-engine-{i}", daemon=True,
            args=(self.config.to_dict(), self._in_addr, self._out_addr, i, os.getpid(), self._device_for(i),
                  logging.getLogger("kestrel").getEffectiveLevel()))
        p.start()
        self.procs[i] = p

    async def start(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="kestrel-")
        self._in_addr, self._out_addr = f"ipc://{self._dir}/input", f"ipc://{self._dir}/output"
        self._ctx = zmq.Context()
        self._actx = zmq.asyncio.Context()
        self._input = router_socket(self._ctx, self._in_addr)  # a restarted engine takes over its identity
        self._output = self._actx.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(self._out_addr)
        for i in range(self.num_engines):
            self._spawn(i)
        try:
            await self._wait_ready()
        except BaseException:
            await self.shutdown()
            raise
        self._tasks = [asyncio.create_task(self._output_loop(), name="kestrel-output-loop"),
                       asyncio.create_task(self._watch_engines(), name="kestrel-engine-watch")]

    def _handshakes(self):
        """(engine index, hand-shake message) for every hand-shake queued on the input socket."""
        while self._input.poll(0):
            frames = self._input.recv_multipart()
            idx = int.from_bytes(frames[0], "little")
            try:
                msg = msgspec.msgpack.decode(frames[1])
                assert isinstance(msg, dict)
            except Exception:
                msg = {"status": "error", "message": "undecodable hand-shake"}
            yield idx, msg

    async def _wait_ready(self) -> None:
        ready: set[int] = set()
        deadline = time.monotonic() + self.startup_timeout
        while len(ready) < self.num_engines:
            for idx, msg in self._handshakes():
                if msg.get("status") != "ready":
                    raise EngineStartupError(f"engine core {idx} failed to start: {msg.get('message')}")
                self.engine_info[idx] = msg
                ready.add(idx)
            for i, p in enumerate(self.procs):
                if i not in ready and not p.is_alive():
                    raise EngineStartupError(f"engine core {i} exited with code {p.exitcode} before it was ready; "
                                             f"see its log above")
            if time.monotonic() > deadline:
                raise EngineStartupError(f"engine cores not ready after {self.startup_timeout:.0f} s "
                                         f"(ready: {sorted(ready)}); raise --engine-startup-timeout")
            await asyncio.sleep(0.05)

    # ---- sending
    def _send(self, engine: int, rtype: P.RequestType, payload: bytes) -> None:
        if engine in self.dead and not (engine in self.restoring and rtype == P.RequestType.UTILITY):
            raise self.dead[engine]
        try:
            self._input.send_multipart([engine_identity(engine), rtype.value, payload], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            raise EngineDead(f"engine core {engine} is unreachable: {e}") from e

    def _choose_engine(self, request: P.EngineCoreRequest) -> int:
        if 0 in self.dead:
            raise self.dead[0]
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
            if e is not None and e not in self.dead:
                by_engine.setdefault(e, []).append(rid)
        for e, ids in by_engine.items():
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
            if not 0 <= idx < self.num_engines:
                continue
            if idx in self.dead:
                if idx in self.restoring and outs.utility_output is not None:  # its state restore's replies
                    self._deliver_utility(idx, outs.utility_output)
                continue  # a dead engine's last words: its requests have already failed
            if outs.engine_error is not None:  # it failed a step and exits: fail its requests now
                self._engine_died(idx, f"failed: {outs.engine_error}")
                self._exiting[idx] = time.monotonic() + EXIT_GRACE_S
                continue
            if outs.utility_output is not None:
                self._deliver_utility(idx, outs.utility_output)
            if outs.stats is not None:
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

    # ---- deaths and restarts (one task: it alone spawns, reaps and reads hand-shakes after start-up)
    async def _watch_engines(self) -> None:
        try:
            while not self._closing:
                self._watch_once(time.monotonic())
                await asyncio.sleep(WATCH_INTERVAL_S)
        except asyncio.CancelledError:
            return

    def _watch_once(self, now: float) -> None:
        for idx, msg in self._handshakes():
            if idx not in self._starting:
                continue
            if msg.get("status") == "ready":
                self.engine_info[idx] = msg
                if self.on_engine_restarted is None:
                    self._serve_again(idx, self.procs[idx])
                else:
                    self.restoring.add(idx)
                    task = asyncio.create_task(self._restore(idx, self.procs[idx]), name=f"kestrel-restore-{idx}")
                    self._restores.add(task)
                    task.add_done_callback(self._restores.discard)
            else:
                logger.error("engine core %d failed to restart: %s", idx, msg.get("message"))
        for i, p in enumerate(self.procs):
            if i in self._starting:
                if not p.is_alive() or now > self._starting[i]:
                    del self._starting[i]
                    if p.is_alive():
                        p.kill()
                    if i in self.restoring:  # its state restore's calls fail now
                        self.restoring.discard(i)
                        self.utility.fail_engine(i, self.dead[i])
                    logger.error("engine core %d did not come back (exit code %s)", i, p.exitcode)
                    self._schedule_restart(i, now)
            elif i in self._restart_at:
                if now >= self._restart_at[i]:
                    del self._restart_at[i]
                    self.restarts[i] += 1
                    logger.info("restarting engine core %d (%d of %d)", i, self.restarts[i], self.restart_limit)
                    self._spawn(i)
                    self._starting[i] = now + self.startup_timeout
            elif i in self._exiting:
                if not p.is_alive() or now > self._exiting[i]:
                    del self._exiting[i]
                    if p.is_alive():
                        logger.warning("engine core %d did not exit %.0f s after its failure; killed", i,
                                       EXIT_GRACE_S)
                        p.kill()
                    p.join(1)
                    self._schedule_restart(i, now)
            elif i not in self.dead and not p.is_alive():
                self._engine_died(i, f"died with exit code {p.exitcode}")
                self._schedule_restart(i, now)

    async def _restore(self, i: int, proc) -> None:
        """Give a restarted engine the server's state (on_engine_restarted), which calls serve() when done; a
        failure kills the engine, and the watcher restarts it again (within --engine-restart-limit)."""
        try:
            await self.on_engine_restarted(i, lambda: self._serve_again(i, proc))
            problem = "the state restore did not call serve()"
        except Exception as e:
            problem = f"it could not get the server's state back: {e}"
        if self.procs[i] is proc and i in self.restoring:
            logger.error("engine core %d: %s; restarting it", i, problem)
            proc.kill()  # the watcher reaps it and schedules the next restart

    def _serve_again(self, i: int, proc) -> None:
        """A restarted engine (with its state back) joins the live engines."""
        if self.procs[i] is not proc or i not in self._starting:
            raise self.dead.get(i) or EngineDead(f"engine core {i} is not the one that was restarted")
        del self._starting[i]
        self.restoring.discard(i)
        self.stats[i] = None
        self.routed_since_stats[i] = 0
        del self.dead[i]
        logger.info("engine core %d is back (restart %d of %d)", i, self.restarts[i], self.restart_limit)

    def _schedule_restart(self, i: int, now: float) -> None:
        if self.restarts[i] >= self.restart_limit:
            logger.error("engine core %d stays down: it was restarted %d times (--engine-restart-limit)", i,
                         self.restarts[i])
            return
        first, cap = RESTART_BACKOFF_S
        self._restart_at[i] = now + min(cap, first * 2 ** self.restarts[i])

    def _engine_died(self, i: int, why: str) -> None:
        exc = EngineDead(f"engine core {i} {why}")
        exc.engine_index = i
        self.dead[i] = exc
        self.stats[i] = None
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
        for t in [*self._tasks, *self._restores]:
            t.cancel()
        self.utility.fail_engine(None, EngineDead("the engine client was shut down"))
        procs = [p for p in self.procs if p is not None]
        for i, p in enumerate(self.procs):
            if p is not None and p.is_alive():
                try:
                    self._input.send_multipart([engine_identity(i), P.RequestType.SHUTDOWN.value, b""],
                                               flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        deadline = time.monotonic() + 5
        for p in procs:
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
            raise EngineDead("no engine core can serve: " + "; ".join(str(e) for e in self.dead.values()))
        return best


def make_client(config: EngineConfig, kind: str = "mp") -> EngineCoreClient:
    if kind == "inproc":
        return InprocClient(config)
    n = config.parallel.data_parallel_size
    return DPClient(config, n) if n > 1 else MPClient(config, 1)
