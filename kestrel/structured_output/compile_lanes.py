"""Grammar compiles on their own threads, a few at a time, each within a time budget (--grammar-compile-timeout;
the server's parse check uses the same lanes with --grammar-parse-timeout).

xgrammar cannot be interrupted: a compile past its budget fails its future at once (CompileTimeout, so the
request ends with that reason) and stops counting against the lanes, so the next compile starts while the
runaway one finishes in the background. At most MAX_OVERDUE runaways at a time: past that, new compiles wait
for one of them to end (a flood of hostile grammars cannot start unbounded threads). With several lanes, a
small grammar compiles next to slow ones instead of queueing behind them (the OS shares the cores)."""
from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError

LANES = 4
MAX_OVERDUE = 8
SHUTDOWN_WAIT_S = 10.0  # a thread still inside xgrammar when the interpreter finalizes can crash the exit


class CompileTimeout(TimeoutError):
    pass


class _Job:
    def __init__(self, future: Future, fn, args):
        self.future, self.fn, self.args = future, fn, args
        self.overdue = False
        self.finished = False


class CompileLanes:
    def __init__(self, budget: float, flag: str = "--grammar-compile-timeout", lanes: int = LANES,
                 max_overdue: int = MAX_OVERDUE):
        self.budget, self.flag, self.lanes, self.max_overdue = budget, flag, lanes, max_overdue
        self._lock = threading.Lock()
        self._queue: deque[_Job] = deque()
        self._running = 0  # compiles within their budget
        self._overdue = 0  # compiles past it, still running
        self._threads: set[threading.Thread] = set()
        self._closed = False

    def submit(self, fn, *args) -> Future:
        job = _Job(Future(), fn, args)
        with self._lock:
            self._queue.append(job)
            self._start_next()
        return job.future

    def _start_next(self) -> None:  # holds the lock
        while (self._queue and not self._closed and self._running < self.lanes
               and self._overdue < self.max_overdue):
            job = self._queue.popleft()
            if not job.future.set_running_or_notify_cancel():
                continue
            self._running += 1
            timer = threading.Timer(self.budget, self._expire, (job,))
            timer.daemon = True
            thread = threading.Thread(target=self._run, args=(job, timer), daemon=True, name="kestrel-grammar")
            self._threads.add(thread)
            thread.start()
            timer.start()

    def _run(self, job: _Job, timer: threading.Timer) -> None:
        try:
            result, error = job.fn(*job.args), None
        except BaseException as e:  # noqa: BLE001 - handed to the request through its future
            result, error = None, e
        timer.cancel()
        with self._lock:
            job.finished = True
            self._threads.discard(threading.current_thread())
            if job.overdue:
                self._overdue -= 1
            else:
                self._running -= 1
            self._start_next()
        try:
            job.future.set_exception(error) if error is not None else job.future.set_result(result)
        except InvalidStateError:  # already failed by its budget
            pass

    def _expire(self, job: _Job) -> None:
        with self._lock:
            if job.finished:
                return
            job.overdue = True
            self._running -= 1
            self._overdue += 1
            self._start_next()
        try:
            job.future.set_exception(CompileTimeout(f"the grammar did not compile within the {self.budget:g} s "
                                                    f"budget ({self.flag})"))
        except InvalidStateError:
            pass

    def shutdown(self, wait_s: float = SHUTDOWN_WAIT_S) -> None:
        """Cancel the queued compiles and wait (at most ``wait_s``) for the running ones, overdue included: a
        process that exits while xgrammar still works on a thread may abort instead of exiting cleanly."""
        with self._lock:
            self._closed = True
            queued, self._queue = list(self._queue), deque()
            running = list(self._threads)
        for job in queued:
            job.future.cancel()
        deadline = time.monotonic() + wait_s
        for thread in running:
            thread.join(max(0.0, deadline - time.monotonic()))
