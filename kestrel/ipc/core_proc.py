"""The engine core in its own process, driven over ZeroMQ ipc sockets with msgspec msgpack frames (never pickle).

Sockets (the client binds, the engine connects):
  input : client ROUTER -> engine DEALER (identity = engine index, 2 bytes little-endian);
          frames [RequestType byte, msgpack payload]
  output: engine PUSH -> client PULL; one msgpack EngineCoreOutputs per message

Hand-shake: after the model is loaded the engine sends one frame on its DEALER socket:
msgpack {"status": "ready", ...engine facts} or {"status": "error", "message": ...} when start-up failed.

Loop: while requests are unfinished, drain the input without blocking, step, send the outputs (each carries the
scheduler stats); when idle, block on the input (and check the tensor-parallel workers each second). A bad message
is logged and dropped (a utility call gets a failure reply); only SHUTDOWN, a dead parent or a failed step ends the
process. A step that raises (a worker died: WorkerError names its rank) or a worker found dead while idle is
reported at once in a last EngineCoreOutputs with `engine_error` set; the workers are stopped and the process exits,
so the client fails the in-flight requests without waiting for the exit.

Heartbeat: once ready, a thread of the process sends EngineCoreOutputs(heartbeat=steps finished so far,
work=work done so far) every HEARTBEAT_INTERVAL_S on its own PUSH socket. A thread, not the loop, so that a long
step (a big prefill, a first CUDA-graph capture) is not silence; the work count (kestrel/core/progress.py: the
CPU runner's module forwards) moves while a long step computes. The client tells a stopped or frozen process (no
heartbeat) from a loop that is stuck (heartbeats whose step count and work do not move while it has requests)
from one that is working, see MPClient._check_engines."""
from __future__ import annotations

import logging
import os
import signal
import threading
import traceback

import msgspec
import zmq

from kestrel.core import progress
from kestrel.core.pooling import pooling_facts
from kestrel.core.supervisor import parent_gone
from kestrel.errors import KestrelError
from kestrel.ipc import protocol as P

logger = logging.getLogger("kestrel.ipc.core_proc")

IDLE_POLL_MS = 1000  # how often an idle engine checks that its parent is still alive
HEARTBEAT_INTERVAL_S = 1.0


def router_socket(ctx, addr: str):
    """The parent's end toward its worker processes (engine cores, render processes): a ROUTER bound at ``addr``
    that fails a send to a worker not connected, and lets a restarted worker take over its identity."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(addr)
    return sock


def dealer_socket(ctx, addr: str, identity: bytes, linger_ms: int):
    """A worker's end toward the parent's router_socket."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, linger_ms)
    sock.connect(addr)
    return sock


def engine_identity(index: int) -> bytes:
    return index.to_bytes(2, "little")


def run_engine_core(config_dict: dict, input_addr: str, output_addr: str, engine_index: int = 0,
                    parent_pid: int | None = None, visible_device: str | None = None,
                    log_level: int = logging.INFO) -> None:
    """Process entry point (multiprocessing spawn target)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle: it shuts the engines down
    if visible_device is not None:  # before torch initialises CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_device
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s engine{engine_index}: %(message)s",
                        datefmt="%H:%M:%S")
    ctx = zmq.Context()
    inp = dealer_socket(ctx, input_addr, engine_identity(engine_index), 1000)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 1000)
    out.connect(output_addr)
    try:
        try:
            from kestrel.config import EngineConfig
            from kestrel.engine.core import EngineCore

            config = EngineConfig.from_dict(config_dict)
            from kestrel.platform.cpu_threads import apply_cpu_threads, engine_core_threads

            apply_cpu_threads(config, engine_core_threads)
            core = EngineCore(config, engine_index=engine_index, progress=engine_index == 0)  # one bar, not N
        except BaseException as e:  # report why start-up failed, then exit non-zero
            msg = str(e) if isinstance(e, KestrelError) else f"{type(e).__name__}: {e}"
            if not isinstance(e, KestrelError):  # a refusal (ConfigError) is the server's one line; a crash is not
                logger.error("engine core %d failed to start: %s\n%s", engine_index, msg, traceback.format_exc())
            inp.send(P.encoder.encode({"status": "error", "message": msg}))
            raise SystemExit(1)
        inp.send(P.encoder.encode({"status": "ready", **engine_facts(core, engine_index)}))
        loop = EngineCoreLoop(core, inp, out, engine_index, parent_pid)
        heartbeat = Heartbeat(ctx, output_addr, engine_index, lambda: loop.steps)
        heartbeat.start()
        try:
            loop.run()
        finally:
            heartbeat.stop()
    finally:
        inp.close()
        out.close()
        ctx.term()
    if loop.failed:
        # reported, workers stopped, sockets flushed: skip the interpreter's teardown (seconds with torch loaded),
        # which would only delay the restart
        logging.shutdown()
        os._exit(1)


class Heartbeat(threading.Thread):
    """Sends EngineCoreOutputs(heartbeat=steps(), work=progress.work_done()) every HEARTBEAT_INTERVAL_S until
    stop()."""

    def __init__(self, ctx, output_addr: str, engine_index: int, steps):
        super().__init__(name="kestrel-heartbeat", daemon=True)
        self.sock = ctx.socket(zmq.PUSH)  # its own socket: ZeroMQ sockets are not shared between threads
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(output_addr)
        self.engine_index = engine_index
        self.steps = steps
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(HEARTBEAT_INTERVAL_S):
            try:
                beat = P.EngineCoreOutputs(self.engine_index, heartbeat=self.steps(), work=progress.work_done())
                self.sock.send(P.encoder.encode(beat), zmq.NOBLOCK)
            except zmq.ZMQError:  # the client is not reading: nothing to tell it
                pass

    def stop(self) -> None:
        self.stopped.set()
        self.join(2 * HEARTBEAT_INTERVAL_S)
        self.sock.close(0)


class EngineCoreLoop:
    def __init__(self, core, inp: zmq.Socket, out: zmq.Socket, engine_index: int, parent_pid: int | None):
        self.core = core
        self.inp = inp
        self.out = out
        self.engine_index = engine_index
        self.parent_pid = parent_pid
        self.poller = zmq.Poller()
        self.poller.register(inp, zmq.POLLIN)
        self.running = True
        self.stats_dirty = False
        self.failed: str | None = None
        self.steps = 0  # steps finished: the heartbeat reports it

    def send(self, outputs: P.EngineCoreOutputs) -> None:
        self.out.send(P.encoder.encode(outputs), copy=False)

    def run(self) -> None:
        logger.info("engine core %d ready (pid %d)", self.engine_index, os.getpid())
        while self.running:
            busy = self.core.has_unfinished_requests()
            events = dict(self.poller.poll(0 if busy else IDLE_POLL_MS))
            while events.get(self.inp) and self.running:  # drain everything that is queued
                self.handle(self.inp.recv_multipart(copy=False))
                events = dict(self.poller.poll(0))
            if not self.running:
                break
            if parent_gone(self.parent_pid):
                logger.warning("parent process %d is gone; engine core %d exits", self.parent_pid, self.engine_index)
                break
            if self.core.has_unfinished_requests():
                try:
                    outputs = self.core.step()
                except Exception as e:
                    self.fail(e)
                    break
                self.steps += 1
                self.send(outputs)
                self.stats_dirty = False
            elif self.stats_dirty:  # e.g. the last request was aborted: tell the client the engine is idle
                self.send(P.EngineCoreOutputs(self.engine_index, [], self.core.stats()))
                self.stats_dirty = False
            elif not events and not self.healthy():  # idle: a worker that died is reported now, not at the next step
                break

    def healthy(self) -> bool:
        from kestrel.executor import WorkerError

        try:
            self.core.executor.check_health()
            return True
        except WorkerError as e:
            self.fail(e)
            return False

    def fail(self, e: Exception) -> None:
        """The last words: why this engine core cannot go on; then the workers are stopped and the loop ends."""
        from kestrel.executor import WorkerError

        self.failed = msg = f"{type(e).__name__}: {e}"
        trace = "" if isinstance(e, WorkerError) else "\n" + traceback.format_exc()  # the worker logged its own
        logger.error("engine core %d failed: %s%s", self.engine_index, msg, trace)
        try:
            self.send(P.EngineCoreOutputs(self.engine_index, engine_error=msg))
        finally:
            self.running = False
            self.core.shutdown()

    def handle(self, frames) -> None:
        if len(frames) != 2:
            logger.warning("dropping a message with %d frames (expected 2)", len(frames))
            return
        kind, payload = frames[0].bytes, frames[1].bytes
        try:
            rtype = P.RequestType(kind)
        except ValueError:
            logger.warning("dropping a message of unknown type %r", kind[:4])
            return
        if rtype is P.RequestType.UTILITY:
            self.handle_utility(payload)
            return
        try:
            if rtype is P.RequestType.ADD:
                self.core.add_request(P.add_decoder.decode(payload))
            elif rtype is P.RequestType.ABORT:
                self.core.abort_requests(P.abort_decoder.decode(payload))
            elif rtype is P.RequestType.SHUTDOWN:
                logger.info("engine core %d shutting down", self.engine_index)
                self.running = False
            self.stats_dirty = True
        except Exception as e:  # a bad message must not kill the engine
            logger.warning("dropping a bad %s message: %s: %s", rtype.name, type(e).__name__, e)
            if rtype is P.RequestType.ADD:  # tell the client so its stream does not hang
                rid = _request_id_of(payload)
                if rid is not None:
                    self.send(P.EngineCoreOutputs(self.engine_index, [P.EngineCoreOutput(
                        rid, [], finish_reason="abort", stop_reason=f"rejected by the engine: {e}")],
                        self.core.stats()))

    def handle_utility(self, payload: bytes) -> None:
        try:
            call = P.utility_decoder.decode(payload)
        except Exception as e:
            logger.warning("dropping an undecodable utility call: %s", e)
            return
        reply = run_utility(self.core, call)
        self.stats_dirty = True
        self.out.send(P.encoder.encode(P.EngineCoreOutputs(self.engine_index, utility_output=reply)), copy=False)


def run_utility(core, call: P.UtilityRequest) -> P.UtilityOutput:
    """The one dispatch table of utility calls: only the core's UTILITY_METHODS are callable by name."""
    try:
        if call.method not in core.UTILITY_METHODS:
            raise AttributeError(f"{call.method!r} is not a utility method of the engine core")
        result = getattr(core, call.method)(*call.args)
        P.encoder.encode(result)  # a result that cannot cross the wire is this call's failure, not the loop's
        return P.UtilityOutput(call.call_id, True, result)
    except Exception as e:
        return P.UtilityOutput(call.call_id, False, None, f"Call to {call.method} method failed: "
                                                          f"{type(e).__name__}: {e}")


def engine_facts(core, engine_index: int) -> dict:
    """What the client learns about an engine when it is ready (the hand-shake)."""
    return {"engine_index": engine_index, "max_model_len": core.max_model_len,
            "vocab_size": int(core.model_config.vocab_size),
            "num_kv_blocks": core.kv.num_blocks, "block_size": core.config.cache.block_size,
            "max_prompt_tokens": core.scheduler.max_prompt_tokens, "device": str(core.device),
            "pooling": pooling_facts(core.model_config, core.config.model)}


def _request_id_of(payload: bytes) -> str | None:
    try:
        obj = msgspec.msgpack.decode(payload)
        rid = obj.get("request_id") if isinstance(obj, dict) else None
        return rid if isinstance(rid, str) else None
    except Exception:
        return None
