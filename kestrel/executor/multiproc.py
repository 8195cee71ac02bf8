"""Executors with one worker per tensor-parallel rank. Every message goes to all workers at once (one ZeroMQ
PUSH socket per worker, the payload encoded once); replies come back on one PULL socket. While waiting for a
reply the executor also watches the workers themselves: a worker that dies or fails raises WorkerError naming
its rank within a poll interval, and every other worker is stopped (nothing is left waiting in a collective)."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field

import msgspec
import numpy as np
import torch
import zmq

from kestrel.core.step import StepInput
from kestrel.core.supervisor import PopenProcess, Supervisor
from kestrel.executor import messages as M
from kestrel.errors import InvalidRequest
from kestrel.executor.base import ControlCallError, Executor, WorkerError

logger = logging.getLogger(__name__)

POLL_MS = 100
ERR_GRACE_S = 1.0  # after a worker's error, how long to look for a dead peer that caused it


@dataclass
class StepHandle:
    seq: int
    samples: bool
    rows: dict[str, int] = field(default_factory=dict)  # request id -> sampling row (the runner's order)
    pending: bytes | None = None  # the encoded step, held back until sample() brings its bitmask

    @property
    def sample_pending(self) -> bool:
        return self.pending is not None


def sampling_order(step: StepInput) -> list[str]:
    """The request ids that sample, in the runner's row order (the step's chunk order: StepInput.chunks)."""
    return [c.request_id for c in step.chunks if c.samples]


class MultiWorkerExecutor(Executor):
    """Sockets, broadcast and replies; subclasses start the workers and say which one is dead."""

    def __init__(self, config, progress: bool = True):
        from kestrel.distributed import check_divisible
        from kestrel.loader import load_model_info

        self.config = config
        self.size = config.parallel.tensor_parallel_size
        self.model_config, self.tokenizer = load_model_info(config.model)
        check_divisible(self.model_config.text, self.size)
        self._zmq = zmq.Context()
        self._outs: list[zmq.Socket] = []
        self._reply = self._zmq.socket(zmq.PULL)
        self._sent = self._received = 0  # step messages sent / answered
        self._early: deque[bytes] = deque()  # rank 0's step replies read by a control call, for `collect`
        self.dead: str | None = None
        self._closed = False
        try:
            self._start(config)
            info = self._call_all(M.DESCRIBE)
            self.kv_cache_groups = M.decode_groups(info[0]["kv_cache_groups"])
            self.bytes_per_block = info[0]["bytes_per_block"]
            self.device = torch.device(info[0]["device"])
            self.worker_pids = [i["pid"] for i in info]
            self.bytes_read = [i["bytes_read"] for i in info]
            self.dist_backend = info[0]["dist_backend"]  # nccl on CUDA, gloo on the CPU
            self.cuda_graph_sizes: list[list[int]] = [[] for _ in info]  # per rank, once the cache is set up
        except BaseException:
            self.shutdown()
            raise

    # ---- to implement
    def _start(self, config) -> None:
        """Bind the sockets (self._bind) and start the workers."""
        raise NotImplementedError

    def _dead_worker(self, wait_s: float = 0.0, exclude: int | None = None) -> str | None:
        """A sentence naming a worker that is gone (waiting up to `wait_s` for one; not rank `exclude`), or None."""
        deadline = time.monotonic() + wait_s
        while True:
            dead = self._find_dead(exclude)
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.05)

    def _find_dead(self, exclude: int | None = None) -> str | None:
        raise NotImplementedError

    def _stop_workers(self) -> None:
        raise NotImplementedError

    # ---- sockets
    def _bind(self, addr_of) -> tuple[list[str], str]:
        """Bind one PUSH socket per rank and the reply PULL socket; `addr_of(name)` gives a bind address."""
        inputs = []
        for rank in range(self.size):
            s = self._zmq.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            inputs.append(self._bind_one(s, addr_of(f"in{rank}")))
            self._outs.append(s)
        self._reply.setsockopt(zmq.LINGER, 0)
        return inputs, self._bind_one(self._reply, addr_of("out"))

    @staticmethod
    def _bind_one(sock: zmq.Socket, addr: str) -> str:
        if addr.startswith("tcp://") and addr.endswith(":0"):
            port = sock.bind_to_random_port(addr.rsplit(":", 1)[0])
            return f"{addr.rsplit(':', 1)[0]}:{port}"
        sock.bind(addr)
        return addr

    def _broadcast(self, method: bytes, payload: bytes = b"") -> None:
        self._send_all([method, payload])

    def _send_all(self, frames: list) -> None:
        """Send `frames` to every rank. A worker that died is named now (WorkerError), never waited for: a PUSH
        socket whose one peer is gone blocks its sender, so a step sent just after a worker died (the engine idle
        meanwhile) waited for the engine's hang timeout (issue 55 item 12)."""
        if self.dead:
            raise WorkerError(self.dead)
        dead = self._dead_worker()
        if dead:
            self._fail(dead)
        for s in self._outs:
            while True:
                try:
                    s.send_multipart(frames, zmq.NOBLOCK, copy=False)
                    break
                except zmq.Again:  # no peer (it died or has not connected yet) or a full queue
                    s.poll(POLL_MS, zmq.POLLOUT)
                    dead = self._dead_worker()
                    if dead:
                        self._fail(dead)

    def _recv(self, deadline: float | None = None) -> tuple[int, bytes, bytes] | None:
        """The next reply (rank, status, payload), None once `deadline` (monotonic) passed; raises WorkerError when a
        worker failed or died."""
        while True:
            if self._reply.poll(POLL_MS):
                rank_b, status, payload = self._reply.recv_multipart()
                rank = int(rank_b)
                if status == M.ERR:
                    # a peer's death shows up first as a broken collective on the survivors: name the dead one
                    self._fail(self._dead_worker(wait_s=ERR_GRACE_S, exclude=rank) or
                               f"tensor-parallel worker rank {rank} failed: {M.any_decoder.decode(payload)}")
                return rank, status, payload
            dead = self._dead_worker()
            if dead:
                self._fail(dead)
            if deadline is not None and time.monotonic() > deadline:
                return None

    def _fail(self, why: str):
        logger.error("%s; stopping the other workers", why)
        self.dead = why
        self.shutdown()
        raise WorkerError(why)

    def _call_all(self, method: bytes, arg=None) -> list:
        """Send a control message to every worker and return each rank's decoded reply (in rank order)."""
        if self._sent != self._received:
            raise RuntimeError("control message while steps are in flight")
        self._broadcast(method, M.encoder.encode(arg))
        replies: dict[int, object] = {}
        while len(replies) < self.size:
            rank, _, payload = self._recv()
            replies[rank] = M.any_decoder.decode(payload)
        return [replies[r] for r in range(self.size)]

    def call_all(self, method: str, *args, timeout: float | None = None) -> list:
        """Steps may be in flight (pipelined decode): each worker runs the call after them, and rank 0's step
        replies that arrive first are kept for `collect`."""
        self._broadcast(M.CONTROL, M.encoder.encode([method, list(args)]))
        deadline = None if timeout is None else time.monotonic() + timeout
        outcomes: dict[int, object] = {}
        while len(outcomes) < self.size:
            got = self._recv(deadline)
            if got is None:
                missing = [r for r in range(self.size) if r not in outcomes]
                self._fail(f"control call {method!r}: tensor-parallel rank(s) {missing} did not answer within "
                           f"{timeout} s")
            rank, status, payload = got
            if status == M.OK and rank == 0 and self._received + len(self._early) < self._sent:
                self._early.append(payload)
            elif status == M.CTL_OK:
                outcomes[rank] = M.any_decoder.decode(payload)
            elif status == M.CTL_FAIL:
                bad_input, message = M.any_decoder.decode(payload)
                outcomes[rank] = (InvalidRequest if bad_input else RuntimeError)(message)
            else:
                raise RuntimeError(f"unexpected {status!r} reply from tensor-parallel rank {rank} to {method!r}")
        results = [outcomes[r] for r in range(self.size)]
        if any(isinstance(o, BaseException) for o in results):
            raise ControlCallError(method, results)
        return results

    # ---- the Executor interface
    def start_up(self) -> int:
        """Every rank runs kestrel/worker/build.py's start_up, agreeing on the block count by an all-reduce."""
        replies = self._call_all(M.START_UP)
        blocks = {r["num_blocks"] for r in replies}
        if len(blocks) != 1:
            raise RuntimeError(f"tensor-parallel ranks allocated different KV block counts: {sorted(blocks)}")
        self.cuda_graph_sizes = [r["graph_sizes"] for r in replies]
        return blocks.pop()

    def launch(self, step: StepInput, prev=None, sample: bool = True, before_forward=None) -> StepHandle:
        """Steps reach the workers in launch order; one whose sampling waits for a grammar bitmask is sent by
        `sample`, with the mask (the workers run it whole: forward, mask, sample)."""
        if before_forward is not None:
            before_forward()  # sends `prev` if it was held back for its bitmask
        rows = {rid: i for i, rid in enumerate(sampling_order(step))}
        self._sent += 1
        handle = StepHandle(self._sent, bool(rows), rows)
        payload = M.encoder.encode(step)
        if sample or not rows:
            self._broadcast(M.STEP, payload)
        else:
            handle.pending = payload
        return handle

    def sample(self, handle: StepHandle, bitmask=None) -> None:
        payload, handle.pending = handle.pending, None
        if payload is None:
            return
        frames = [M.STEP, payload]
        if bitmask is not None:  # a StepBitmask: the masks, then the sampling rows they constrain
            frames += [bitmask.mask.numpy().astype("int32").tobytes(),
                       np.asarray(bitmask.rows, dtype=np.int32).tobytes()]
        self._send_all(frames)

    def collect(self, handle: StepHandle):
        """Replies arrive in launch order (rank 0 answers every step)."""
        while self._received < handle.seq:
            if self._early:  # read by a control call while this step was in flight
                payload = self._early.popleft()
            else:
                rank, status, payload = self._recv()
                if rank != 0 or status != M.OK:
                    raise RuntimeError(f"unexpected {status!r} reply from tensor-parallel rank {rank} to a step")
            self._received += 1
            out = M.output_decoder.decode(payload)
        return out

    def check_health(self) -> None:
        if self.dead:
            raise WorkerError(self.dead)
        dead = self._dead_worker()
        if dead:
            self._fail(dead)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.dead:
            try:
                for s in self._outs:
                    s.send_multipart([M.SHUTDOWN, b""], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self._stop_workers()
        for s in self._outs:
            s.close(linger=0)
        self._reply.close(linger=0)
        self._zmq.term()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass


class MPExecutor(MultiWorkerExecutor):
    """One local worker process per rank (a fresh interpreter: `python -m kestrel.executor.worker`, the config as
    JSON on stdin), sockets over ipc, the process group over tcp on 127.0.0.1. The processes are supervised by
    kestrel.core.supervisor without restarts: a rank cannot rejoin a running process group, so a dead worker fails
    the engine core, which its own supervisor restarts whole."""

    STOP_GRACE_S = 3.0

    def _start(self, config) -> None:
        from kestrel.distributed import free_port

        self._dir = tempfile.mkdtemp(prefix="kestrel-tp-")
        inputs, output = self._bind(lambda name: f"ipc://{self._dir}/{name}")
        init = f"tcp://127.0.0.1:{free_port()}"
        cfg = msgspec.json.encode(config.to_dict())
        level = logging.getLogger("kestrel").getEffectiveLevel() or 20

        def spawn(rank: int) -> PopenProcess:
            p = PopenProcess([sys.executable, "-m", "kestrel.executor.worker", "--rank", str(rank), "--size",
                              str(self.size), "--init-method", init, "--input", inputs[rank], "--output", output,
                              "--parent-pid", str(os.getpid()), "--log-level", str(level)], stdin=subprocess.PIPE)
            p.stdin.write(cfg)
            p.stdin.close()
            return p

        self._sup = Supervisor("tensor-parallel worker rank", self.size, spawn, startup_timeout=float("inf"),
                               restart_limit=0)
        self._sup.start_all()

    @property
    def _procs(self) -> list:
        return self._sup.procs if hasattr(self, "_sup") else []

    def _find_dead(self, exclude: int | None = None) -> str | None:
        return self._sup.dead_child(exclude)

    def _stop_workers(self) -> None:
        import shutil

        if hasattr(self, "_sup"):
            self._sup.stop(None, 0 if self.dead else self.STOP_GRACE_S)
        if getattr(self, "_dir", None):
            shutil.rmtree(self._dir, ignore_errors=True)
