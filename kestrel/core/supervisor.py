"""Supervised worker processes: the one helper behind the engine-core client (ipc/core_client.py), the image render
processes (frontend/render_proc.py) and the tensor-parallel executor (executor/multiproc.py).

A Supervisor owns N numbered children and knows each one's state:

  starting -> ready          the child's hand-shake came (the user reads it on its own socket and calls ready(i))
  ready    -> (died)         found dead by watch(): on_died(i, why), then a restart is scheduled
  ready    -> exiting        the child reported its failure (failing(i, ...)): killed if not gone after a grace
  any      -> (replaced)     replace(i, why): killed now (a hung child), on_died, restart scheduled
  waiting  -> starting       the back-off is over: spawned again (restart k of restart_limit)
  down                       the restart limit is spent (restart_limit restarts within restart_window
                             seconds); it stays down

watch() is one pass over the children: the asyncio users call it from a task (`run_watch`), the synchronous
tensor-parallel executor while it waits for a reply. The supervisor never reads the children's sockets: the wire
formats stay with their users. stop() is idempotent: a stop message to each live child, a grace period, then kill.

Children learn that their parent died with parent_gone(parent_pid) (polled from their idle loops): orphaned they
exit instead of holding GPU memory and sockets."""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

logger = logging.getLogger(__name__)


class Process(Protocol):
    pid: int | None

    def is_alive(self) -> bool: ...
    @property
    def exitcode(self) -> int | None: ...
    def kill(self) -> None: ...
    def join(self, timeout: float | None = None) -> None: ...


class PopenProcess(subprocess.Popen):
    """A subprocess with multiprocessing.Process's supervision methods (for children started as a fresh
    interpreter with arguments and stdin, like the tensor-parallel workers)."""

    def is_alive(self) -> bool:
        return self.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self.poll()

    def join(self, timeout: float | None = None) -> None:
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            pass


def spawn_process(target, name: str, args: tuple) -> multiprocessing.Process:
    """A daemon child in a fresh interpreter (spawn: no forked CUDA or ZeroMQ state)."""
    p = multiprocessing.get_context("spawn").Process(target=target, name=name, daemon=True, args=args)
    p.start()
    return p


def parent_gone(parent_pid: int | None) -> bool:
    """For a child: True when the process that started it has exited (it was re-parented)."""
    return parent_pid is not None and os.getppid() != parent_pid


def wait_while_parent_lives(poll, parent_pid: int | None, timeout_ms: int) -> bool:
    """For a child's receive loop: block until `poll(timeout_ms)` reports a message (True), or the process that
    started it has exited (False: the child should exit too)."""
    while not poll(timeout_ms):
        if parent_gone(parent_pid):
            return False
    return True


def die_with_parent() -> None:
    """For a child on Linux: the kernel kills it when its parent exits, even while it waits in a collective. (The
    signal follows the parent *thread* that started it: only for children started from a thread that lives as
    long as the parent, like the engine core's main thread starting its tensor-parallel workers.)"""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


class StartupError(RuntimeError):
    """A child did not come up: the error it reported, its exit code, or a time-out."""


@dataclass
class Child:
    proc: Process | None = None
    state: str = "starting"  # starting | ready | exiting | waiting | down
    deadline: float = 0.0  # starting: ready by; exiting: killed at; waiting: spawned at
    restarts: int = 0  # in all (for the logs)
    restart_times: list[float] = field(default_factory=list)  # when it was restarted, within the restart window
    start_error: str | None = None  # what the child reported when its start failed


class Supervisor:
    """N children made by `spawn(i)`. `restart_limit` None: restart forever; else at most that many restarts of
    one child within `restart_window` seconds (None: in its lifetime), so that rare deaths over days never use the
    limit up while a crash loop still stops; `backoff` (first, cap) seconds, doubling per recent restart of the
    same child."""

    def __init__(self, what: str, num: int, spawn: Callable[[int], Process], *, startup_timeout: float,
                 restart_limit: int | None = None, restart_window: float | None = None,
                 backoff: tuple[float, float] = (0.0, 0.0),
                 exit_grace: float = 5.0, on_died: Callable[[int, str], None] = lambda i, why: None,
                 on_restart_failed: Callable[[int], None] = lambda i: None):
        self.what = what  # "engine core", "render process", ...: names a child in messages
        self.spawn = spawn
        self.startup_timeout = startup_timeout
        self.restart_limit = restart_limit
        self.restart_window = restart_window
        self.backoff = backoff
        self.exit_grace = exit_grace
        self.on_died = on_died  # a ready child died or was replaced: fail its work (the restart follows)
        self.on_restart_failed = on_restart_failed  # a restarted child did not come back
        self.children = [Child() for _ in range(num)]
        self.started = False  # every child was ready once: later failures restart instead of failing start()
        self.closed = False

    @property
    def procs(self) -> list:
        return [c.proc for c in self.children]

    def state(self, i: int) -> str:
        return self.children[i].state

    # ---- start-up
    def start_all(self) -> None:
        for i in range(len(self.children)):
            self._spawn(i, time.monotonic())

    def _spawn(self, i: int, now: float) -> None:
        c = self.children[i]
        c.proc, c.state, c.deadline, c.start_error = self.spawn(i), "starting", now + self.startup_timeout, None

    async def wait_ready(self, hint: str = "", poll: Callable[[], None] | None = None) -> None:
        """Until every child is ready (`poll()`, called between checks, reads the hand-shakes); StartupError naming
        the first that failed, died or timed out."""
        while True:
            if poll is not None:
                poll()
            if all(c.state == "ready" for c in self.children):
                break
            if self.closed:
                raise StartupError("shut down while starting")
            now = time.monotonic()
            for i, c in enumerate(self.children):
                if c.state != "starting":
                    continue
                if c.start_error is not None:
                    raise StartupError(f"{self.what} {i} failed to start: {c.start_error}")
                if not c.proc.is_alive():
                    raise StartupError(f"{self.what} {i} exited with code {c.proc.exitcode} before it was ready; "
                                       f"see its log above")
                if now > c.deadline:
                    raise StartupError(f"{self.what} {i} not ready after {self.startup_timeout:.0f} s{hint}")
            await asyncio.sleep(0.05)
        self.started = True

    def ready(self, i: int) -> bool:
        """Child i's hand-shake said ready; False if it is not a child being started (a stale message)."""
        c = self.children[i]
        if c.state != "starting":
            return False
        c.state = "ready"
        return True

    def start_failed(self, i: int, message: str) -> None:
        """Child i's hand-shake said its start failed (it exits; watch() schedules the next try)."""
        c = self.children[i]
        if c.state == "starting":
            c.start_error = message
            if self.started:
                logger.error("%s %d failed to restart: %s", self.what, i, message)

    # ---- failures
    def failing(self, i: int, why: str) -> None:
        """A ready child reported that it failed and exits: on_died now; killed if still there after exit_grace."""
        c = self.children[i]
        if c.state != "ready":
            return
        c.state, c.deadline = "exiting", time.monotonic() + self.exit_grace
        self.on_died(i, why)

    def replace(self, i: int, why: str) -> None:
        """Kill child i now (it hangs or cannot get its state back) and restart it like a dead one."""
        c = self.children[i]
        if c.state in ("waiting", "down") or self.closed:
            return
        was_ready = c.state == "ready"
        logger.error("%s %d %s; killing it", self.what, i, why)
        c.proc.kill()
        c.proc.join(1)
        if was_ready:
            self.on_died(i, why)
        elif c.state == "starting":
            self.on_restart_failed(i)
        self._schedule_restart(i, time.monotonic())

    def dead_child(self, exclude: int | None = None) -> str | None:
        """A sentence naming a child that has exited (not `exclude`), or None."""
        for i, c in enumerate(self.children):
            if i != exclude and c.proc is not None and not c.proc.is_alive():
                return f"{self.what} {i} (pid {c.proc.pid}) died with exit code {c.proc.exitcode}"
        return None

    def watch(self, now: float | None = None) -> None:
        """One pass: reap, restart and time out children (after start-up)."""
        now = time.monotonic() if now is None else now
        for i, c in enumerate(self.children):
            alive = c.proc is not None and c.proc.is_alive()
            if c.state == "starting" and self.started and (not alive or now > c.deadline):
                if alive:
                    c.proc.kill()
                logger.error("%s %d did not come back (exit code %s)", self.what, i, c.proc.exitcode)
                self.on_restart_failed(i)
                self._schedule_restart(i, now)
            elif c.state == "waiting" and now >= c.deadline:
                c.restarts += 1
                c.restart_times.append(now)
                limit = "" if self.restart_limit is None else f" ({self.recent_restarts(i, now)} of " \
                    f"{self.restart_limit}{self._window_text()})"
                logger.info("restarting %s %d%s", self.what, i, limit)
                self._spawn(i, now)
            elif c.state == "exiting" and (not alive or now > c.deadline):
                if alive:
                    logger.warning("%s %d did not exit %.0f s after its failure; killed", self.what, i,
                                   self.exit_grace)
                    c.proc.kill()
                c.proc.join(1)
                self._schedule_restart(i, now)
            elif c.state == "ready" and not alive:
                self.on_died(i, f"died with exit code {c.proc.exitcode}")
                self._schedule_restart(i, now)

    def _window_text(self) -> str:
        return "" if self.restart_window is None else f" within {self.restart_window:g} s"

    def recent_restarts(self, i: int, now: float | None = None) -> int:
        """Child i's restarts that count against the limit: those within the restart window."""
        c = self.children[i]
        if self.restart_window is not None:
            now = time.monotonic() if now is None else now
            c.restart_times = [t for t in c.restart_times if now - t < self.restart_window]
        return len(c.restart_times)

    def can_restart(self, i: int, now: float | None = None) -> bool:
        return self.restart_limit is None or self.recent_restarts(i, now) < self.restart_limit

    def _schedule_restart(self, i: int, now: float) -> None:
        c = self.children[i]
        if not self.can_restart(i, now):
            c.state = "down"
            logger.error("%s %d stays down: it was restarted %d times%s", self.what, i, len(c.restart_times),
                         self._window_text())
            return
        first, cap = self.backoff
        c.state, c.deadline = "waiting", now + min(cap, first * 2 ** len(c.restart_times))

    async def run_watch(self, interval: float, also: Callable[[float], None] | None = None) -> None:
        """The asyncio users' watch task: watch() (and `also(now)`) every `interval` seconds until stop()."""
        try:
            while not self.closed:
                now = time.monotonic()
                if also is not None:
                    also(now)
                self.watch(now)
                await asyncio.sleep(interval)
        except asyncio.CancelledError:
            return

    # ---- shutdown
    def stop(self, send_stop: Callable[[int], None] | None, grace: float) -> None:
        """Idempotent. Ask every live child to stop (send_stop(i); its failure is ignored), wait up to `grace`
        seconds in all, kill what is left and reap everything."""
        if self.closed:
            return
        self.closed = True
        self._send_stops(send_stop)
        self._reap(grace)

    async def astop(self, send_stop: Callable[[int], None] | None, grace: float) -> None:
        """stop() for the event loop: the stop messages go from here, the waiting happens on a thread."""
        if self.closed:
            return
        self.closed = True
        self._send_stops(send_stop)
        await asyncio.to_thread(self._reap, grace)

    def _send_stops(self, send_stop: Callable[[int], None] | None) -> None:
        for i, c in enumerate(self.children):
            if send_stop is not None and c.proc is not None and c.proc.is_alive():
                try:
                    send_stop(i)
                except Exception:  # noqa: BLE001 - its socket is gone: it is killed below
                    pass

    def _reap(self, grace: float) -> None:
        deadline = time.monotonic() + grace
        for c in self.children:
            if c.proc is None:
                continue
            c.proc.join(max(0.0, deadline - time.monotonic()))
            if c.proc.is_alive():
                c.proc.kill()
                c.proc.join(1)
