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
from kestrel.core.supervisor import StartupError, Supervisor, spawn_process
from kestrel.ipc import protocol as P
from kestrel.ipc.core_proc import engine_facts, engine_identity, router_socket, run_engine_core, run_utility
from kestrel.ipc.utility import UtilityClient
from kestrel.errors import ConfigError, EngineDead, KestrelError

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.2
EXIT_GRACE_S = 5.0  # an engine core that reported its failure is killed if it has not exited by then
RESTART_BACKOFF_S = (0.5, 30.0)  # first delay, cap; doubles per restart of the same engine
HEALTH_STALE_S = 5.0  # an engine silent this long (no heartbeat) gets no new requests and /health says so
SEND_RETRY_S = 0.002  # how often the sender retries an engine whose input queue is full


class EngineStartupError(KestrelError, RuntimeError):
    """An engine core did not come up (its error, exit code or a time-out)."""


OutputHandler = Callable[[P.EngineCoreOutputs], None]
DeadHandler = Callable[[EngineDead, list[str] | None], None]
RestartHandler = Callable[[int, Callable[[], None]], Awaitable[None]]


class EngineCoreClient:
    """Interface shared by the clients. ``dead`` is the one record of engines that cannot serve now (dead,
    restarting, or given up); the utility client reads it too. ``stalled``: engines alive but not responding (no
    heartbeat lately): no new requests go to them until they answer again or are replaced."""

    num_engines = 1

    def __init__(self):
        self.on_outputs: OutputHandler = lambda o: None
        self.on_engine_dead: DeadHandler = lambda exc, ids: None
        self.engine_info: list[dict] = []
        self.stats: list[P.SchedulerStats | None] = []
        self.dead: dict[int, EngineDead] = {}
        self.stalled: dict[int, EngineDead] = {}
        self.restoring: set[int] = set()  # restarted engines (still in `dead`) getting their state back
        self.on_engine_restarted: RestartHandler | None = None
        self.utility = UtilityClient(self)

    @property
    def is_dead(self) -> bool:
        """True when no engine can serve (each is dead, restarting or stalled)."""
        return len(self.out_of_service()) >= self.num_engines

    @property
    def all_dead(self) -> bool:
        """Every engine is dead or restarting (a stalled one still holds its requests: it may answer again)."""
        return len(self.dead) >= self.num_engines

    def out_of_service(self) -> dict[int, EngineDead]:
        """Engine index -> why it cannot take requests now."""
        return {**self.stalled, **self.dead}

    @property
    def live_engines(self) -> list[int]:
        return [i for i in range(self.num_engines) if i not in self.dead and i not in self.stalled]

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
    paths in a private temporary folder; every engine connects a DEALER and a PUSH. The processes are supervised
    by kestrel.core.supervisor (spawn, hand-shake, watch, restart with back-off, shutdown).

    An engine that dies fails its in-flight requests at once and is restarted after a back-off, at most
    ``engine_restart_limit`` times; while it is down it is in ``dead`` and gets no traffic. An engine that sends no
    heartbeat for HEALTH_STALE_S is ``stalled`` (no new requests, /health says so); one silent, or stuck on a step
    while it has requests, for ``engine_hang_timeout`` seconds is killed and restarted like a dead one.

    Sends never fail because an engine is busy: a message that its socket cannot take now (ZeroMQ's high-water
    mark) waits in that engine's outbox, in order, and a sender task delivers it as the engine reads; an abort
    removes its requests' adds still waiting there."""

    def __init__(self, config: EngineConfig, num_engines: int = 1):
        super().__init__()
        self.config = config
        self.num_engines = num_engines
        self.restart_limit = config.parallel.engine_restart_limit
        self.hang_timeout = config.parallel.engine_hang_timeout
        if self.hang_timeout <= 0:
            raise ConfigError(f"--engine-hang-timeout must be positive, got {self.hang_timeout}")
        self.sup = Supervisor("engine core", num_engines, self._spawn,
                              startup_timeout=config.parallel.engine_startup_timeout,
                              restart_limit=self.restart_limit,
                              restart_window=config.parallel.engine_restart_window, backoff=RESTART_BACKOFF_S, exit_grace=EXIT_GRACE_S,
                              on_died=self._engine_died, on_restart_failed=self._restore_failed)
        self.engine_info = [{} for _ in range(num_engines)]
        self.stats = [None] * num_engines
        self.routed_since_stats = [0] * num_engines
        self.request_engine: dict[str, int] = {}  # core request id -> engine index
        self._outbox: list[collections.deque] = [collections.deque() for _ in range(num_engines)]
        self._outbox_ready: asyncio.Event | None = None
        self._last_seen = [0.0] * num_engines  # when each engine last sent anything (heartbeats included)
        # ((steps finished, work done), when either last moved or it was idle)
        self._progress = [((0, 0), 0.0)] * num_engines
        self._last_check = 0.0
        self._tasks: list[asyncio.Task] = []
        self._restores: set[asyncio.Task] = set()
        self._closing = False
        self._dir: str | None = None

    @property
    def procs(self) -> list:
        return self.sup.procs

    def engine_state(self, i: int) -> str:
        if i in self.stalled:
            return "unresponsive"
        if i not in self.dead:
            return "ready"
        state = self.sup.state(i)
        if state in ("starting", "waiting"):
            return "restarting"
        if state == "exiting" and self.sup.can_restart(i):
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

    def _spawn(self, i: int):
        return spawn_process(run_engine_core, f"kestrel-engine-{i}",
                             (self.config.to_dict(), self._in_addr, self._out_addr, i, os.getpid(),
                              self._device_for(i), logging.getLogger("kestrel").getEffectiveLevel()))

    async def start(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="kestrel-")
        self._in_addr, self._out_addr = f"ipc://{self._dir}/input", f"ipc://{self._dir}/output"
        self._ctx = zmq.Context()
        self._actx = zmq.asyncio.Context()
        self._input = router_socket(self._ctx, self._in_addr)  # a restarted engine takes over its identity
        self._output = self._actx.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(self._out_addr)
        self._outbox_ready = asyncio.Event()
        self.sup.start_all()
        try:
            await self.sup.wait_ready(" (raise --engine-startup-timeout)", poll=self._read_handshakes)
        except StartupError as e:
            await self.shutdown()
            raise EngineStartupError(str(e)) from None
        except BaseException:
            await self.shutdown()
            raise
        now = time.monotonic()
        self._last_seen = [now] * self.num_engines
        self._progress = [((0, 0), now)] * self.num_engines
        self._last_check = now
        self._tasks = [asyncio.create_task(self._output_loop(), name="kestrel-output-loop"),
                       asyncio.create_task(self._send_loop(), name="kestrel-send-loop"),
                       asyncio.create_task(self.sup.run_watch(WATCH_INTERVAL_S, self._before_watch),
                                           name="kestrel-engine-watch")]

    def _read_handshakes(self) -> None:
        """Handle every hand-shake queued on the input socket (msgpack {"status": "ready" | "error", ...})."""
        while self._input.poll(0):
            frames = self._input.recv_multipart()
            idx = int.from_bytes(frames[0], "little")
            try:
                msg = msgspec.msgpack.decode(frames[1])
                assert isinstance(msg, dict)
            except Exception:
                msg = {"status": "error", "message": "undecodable hand-shake"}
            if not 0 <= idx < self.num_engines or self.sup.state(idx) != "starting" or idx in self.restoring:
                continue
            if msg.get("status") != "ready":
                self.sup.start_failed(idx, str(msg.get("message")))
                continue
            self.engine_info[idx] = msg
            if not self.sup.started:  # the first start: every engine serves once all are ready
                self.sup.ready(idx)
            elif self.on_engine_restarted is None:
                self._serve_again(idx, self.procs[idx])
            else:
                self.restoring.add(idx)
                task = asyncio.create_task(self._restore(idx, self.procs[idx]), name=f"kestrel-restore-{idx}")
                self._restores.add(task)
                task.add_done_callback(self._restores.discard)

    # ---- sending
    def _send(self, engine: int, rtype: P.RequestType, payload: bytes, request_id: str | None = None) -> None:
        if engine in self.dead and not (engine in self.restoring and rtype == P.RequestType.UTILITY):
            raise self.dead[engine]
        box = self._outbox[engine]
        if not box:  # nothing waits before it: try now
            try:
                self._input.send_multipart([engine_identity(engine), rtype.value, payload], flags=zmq.NOBLOCK)
                return
            except zmq.Again:  # the engine is busy (its queue is full): the sender task delivers it later
                pass
            except zmq.ZMQError as e:  # not connected: it is dying (the watcher finds out)
                raise EngineDead(f"engine core {engine} is unreachable: {e}") from e
        box.append((rtype, payload, request_id))
        self._outbox_ready.set()

    async def _send_loop(self) -> None:
        """Deliver the outboxes, each in order, as the engines make room."""
        try:
            while not self._closing:
                if not any(self._outbox):
                    self._outbox_ready.clear()
                    await self._outbox_ready.wait()
                    continue
                moved = False
                for engine, box in enumerate(self._outbox):
                    while box:
                        rtype, payload, _ = box[0]
                        try:
                            self._input.send_multipart([engine_identity(engine), rtype.value, payload],
                                                       flags=zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        except zmq.ZMQError as e:  # gone: its death fails these requests
                            logger.warning("engine core %d is unreachable (%s); %d queued message(s) dropped",
                                           engine, e, len(box))
                            box.clear()
                            break
                        box.popleft()
                        moved = True
                if not moved:
                    await asyncio.sleep(SEND_RETRY_S)
        except asyncio.CancelledError:
            return

    def _choose_engine(self, request: P.EngineCoreRequest) -> int:
        if 0 in self.dead:
            raise self.dead[0]
        if 0 in self.stalled:
            raise self.stalled[0]
        return 0

    def add_request(self, request: P.EngineCoreRequest) -> int:
        engine = self._choose_engine(request)
        self.request_engine[request.request_id] = engine
        try:
            self._send(engine, P.RequestType.ADD, P.encoder.encode(request), request.request_id)
        except BaseException:
            self.request_engine.pop(request.request_id, None)
            raise
        self.routed_since_stats[engine] += 1
        return engine

    def abort_requests(self, request_ids: list[str]) -> None:
        by_engine: dict[int, set[str]] = {}
        for rid in request_ids:
            e = self.request_engine.pop(rid, None)
            if e is not None and e not in self.dead:
                by_engine.setdefault(e, set()).add(rid)
        for e, ids in by_engine.items():
            box = self._outbox[e]
            if box:  # adds that never left are dropped, not aborted
                unsent = {m[2] for m in box if m[0] is P.RequestType.ADD and m[2] in ids}
                if unsent:
                    kept = [m for m in box if m[2] not in unsent]
                    box.clear()
                    box.extend(kept)
                    ids -= unsent
            if not ids:
                continue
            try:
                self._send(e, P.RequestType.ABORT, P.encoder.encode(sorted(ids)))
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
            self._last_seen[idx] = time.monotonic()
            if outs.heartbeat is not None:
                self._on_heartbeat(idx, outs.heartbeat, outs.work, self._last_seen[idx])
                continue
            if outs.engine_error is not None:  # it failed a step and exits: fail its requests now
                self.sup.failing(idx, f"failed: {outs.engine_error}")
                continue
            if outs.utility_output is not None:
                self._deliver_utility(idx, outs.utility_output)
            if outs.stats is not None:
                self.stats[idx] = outs.stats
                self.routed_since_stats[idx] = 0
            for o in outs.outputs:
                if o.finished:
                    self.request_engine.pop(o.request_id, None)
            if outs.outputs or (outs.stats is not None and outs.stats.step_tokens):  # a prefill step: its counts
                try:
                    self.on_outputs(outs)
                except Exception:
                    logger.exception("output handler failed")

    # ---- liveness (from the watch task, before each supervisor pass)
    def _on_heartbeat(self, i: int, steps: int, work: int, now: float) -> None:
        """A heartbeat of engine i: progress when a step finished or work was done since the last one."""
        if (steps, work) != self._progress[i][0]:
            self._progress[i] = ((steps, work), now)

    def _before_watch(self, now: float) -> None:
        self._read_handshakes()
        self._check_engines(now)

    def _check_engines(self, now: float) -> None:
        """Stalled (no heartbeat for HEALTH_STALE_S): out of service until it answers. Silent, or busy without
        finishing a step or doing any work (its heartbeats' counts stand still), for engine_hang_timeout: replaced
        (killed and restarted like a dead engine). A long step that computes is work, not a hang."""
        late = now - self._last_check - WATCH_INTERVAL_S
        self._last_check = now
        if late > 1.0:  # this event loop was blocked: the engines' messages wait unread, they are not silent
            self._last_seen = [t + late for t in self._last_seen]
            self._progress = [(s, t + late) for s, t in self._progress]
            return
        busy = set(self.request_engine.values())
        for i in range(self.num_engines):
            if i in self.dead:
                self.stalled.pop(i, None)
                continue
            silent = now - self._last_seen[i]
            steps, since = self._progress[i]
            if i not in busy:
                self._progress[i] = (steps, now)
            if silent > self.hang_timeout:
                self.stalled.pop(i, None)
                self.sup.replace(i, f"sent no heartbeat for {silent:.0f} s (--engine-hang-timeout)")
            elif i in busy and now - since > self.hang_timeout:
                self.stalled.pop(i, None)
                self.sup.replace(i, f"finished no step and did no work for {now - since:.0f} s while it had "
                                    f"requests (--engine-hang-timeout)")
            elif silent > HEALTH_STALE_S:
                if i not in self.stalled:
                    logger.warning("engine core %d sent no heartbeat for %.0f s: no new requests go to it", i,
                                   silent)
                exc = EngineDead(f"engine core {i} is not responding (no heartbeat for {silent:.0f} s)")
                exc.engine_index = i
                self.stalled[i] = exc
            elif self.stalled.pop(i, None) is not None:
                logger.info("engine core %d responds again", i)

    # ---- restarts
    async def _restore(self, i: int, proc) -> None:
        """Give a restarted engine the server's state (on_engine_restarted), which calls serve() when done; a
        failure kills the engine, and the supervisor restarts it again (within --engine-restart-limit)."""
        try:
            await self.on_engine_restarted(i, lambda: self._serve_again(i, proc))
            problem = "the state restore did not call serve()"
        except Exception as e:
            problem = f"it could not get the server's state back: {e}"
        if self.procs[i] is proc and i in self.restoring:
            self.sup.replace(i, problem)

    def _restore_failed(self, i: int) -> None:
        """A restarted engine did not come back: its state restore's calls fail now."""
        if i in self.restoring:
            self.restoring.discard(i)
            self.utility.fail_engine(i, self.dead[i])

    def _serve_again(self, i: int, proc) -> None:
        """A restarted engine (with its state back) joins the live engines."""
        if self.procs[i] is not proc or not self.sup.ready(i):
            raise self.dead.get(i) or EngineDead(f"engine core {i} is not the one that was restarted")
        self.restoring.discard(i)
        self.stats[i] = None
        self.routed_since_stats[i] = 0
        now = time.monotonic()
        self._last_seen[i], self._progress[i] = now, ((0, 0), now)
        del self.dead[i]
        logger.info("engine core %d is back (restart %d of %d within %g s)", i, self.sup.recent_restarts(i),
                    self.restart_limit, self.sup.restart_window)

    def _engine_died(self, i: int, why: str) -> None:
        exc = EngineDead(f"engine core {i} {why}")
        exc.engine_index = i
        self.dead[i] = exc
        self.stats[i] = None
        self._outbox[i].clear()
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
        if hasattr(self, "_input"):
            await self.sup.astop(lambda i: self._input.send_multipart(
                [engine_identity(i), P.RequestType.SHUTDOWN.value, b""], flags=zmq.NOBLOCK), grace=5.0)
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
            if i in self.dead or i in self.stalled:
                continue
            s = self.stats[i]
            load = (s.num_running + s.num_waiting if s is not None else 0) + self.routed_since_stats[i]
            if best_load is None or load < best_load:
                best, best_load = i, load
        if best is None:
            raise EngineDead("no engine core can serve: " + "; ".join(str(e) for e in self.out_of_service().values()))
        return best


def make_client(config: EngineConfig, kind: str = "mp") -> EngineCoreClient:
    if kind == "inproc":
        return InprocClient(config)
    n = config.parallel.data_parallel_size
    return DPClient(config, n) if n > 1 else MPClient(config, 1)
