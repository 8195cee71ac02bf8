"""Grammar compiles on their own threads, a few at a time, each within a time budget (--grammar-compile-timeout;
the server's parse check uses the same lanes with --grammar-parse-timeout).

xgrammar cannot be interrupted: a compile past its budget fails its future at once (CompileTimeout, so the
request ends with that reason) and stops counting against the lanes, so the next compile starts while the
runaway one finishes in the background. At most MAX_OVERDUE runaways at a time: past that, new compiles wait
for one of them to end (a flood of hostile grammars cannot start unbounded threads). The budget counts from
submission, so a compile that waits that long in the queue fails with the same CompileTimeout and leaves it
(before, once MAX_OVERDUE were overdue, queued compiles waited without a timer). With several lanes, a small
grammar compiles next to slow ones instead of queueing behind them (the OS shares the cores); queued compiles
start a client at a time in turn (`submit(..., client=)`), so one client's flood does not queue the others'."""
from __future__ import annotations

import heapq
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, InvalidStateError

LANES = 4
MAX_OVERDUE = 8
SHUTDOWN_WAIT_S = 10.0  # a thread still inside xgrammar when the interpreter finalizes can crash the exit


class CompileTimeout(TimeoutError):
    pass


class _Deadlines:
    """One thread that calls `fire(job)` at each job's deadline (a Timer thread per queued compile would let a
    flood of requests start as many threads)."""

    def __init__(self, fire):
        self.fire = fire
        self._heap: list[tuple[float, int, object]] = []
        self._cond = threading.Condition()
        self._seq = 0
        self._thread: threading.Thread | None = None

    def add(self, at: float, job) -> None:
        with self._cond:
            self._seq += 1
            heapq.heappush(self._heap, (at, self._seq, job))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True, name="kestrel-grammar-timer")
                self._thread.start()
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    self._cond.wait(None if not self._heap else self._heap[0][0] - time.monotonic())
                _, _, job = heapq.heappop(self._heap)
            self.fire(job)


class _Job:
    def __init__(self, future: Future, fn, args, client):
        self.future, self.fn, self.args, self.client = future, fn, args, client
        self.started = False
        self.overdue = False
        self.finished = False


class CompileLanes:
    def __init__(self, budget: float, flag: str = "--grammar-compile-timeout", lanes: int = LANES,
                 max_overdue: int = MAX_OVERDUE):
        self.budget, self.flag, self.lanes, self.max_overdue = budget, flag, lanes, max_overdue
        self._lock = threading.Lock()
        self._queues: OrderedDict[object, deque[_Job]] = OrderedDict()  # per client, served in turn
        self._running = 0  # compiles within their budget
        self._overdue = 0  # compiles past it, still running
        self._threads: set[threading.Thread] = set()
        self._closed = False
        self._deadlines = _Deadlines(self._expire)

    def submit(self, fn, *args, client=None) -> Future:
        """Compile `fn(*args)` on a lane; its budget counts from now. `client`: whose compile it is (queued compiles
        start a client at a time in turn)."""
        job = _Job(Future(), fn, args, client)
        self._deadlines.add(time.monotonic() + self.budget, job)
        with self._lock:
            self._queues.setdefault(client, deque()).append(job)
            self._start_next()
        return job.future

    def _next_job(self) -> _Job | None:  # holds the lock
        while self._queues:
            client, queue = next(iter(self._queues.items()))
            job = queue.popleft()
            if queue:
                self._queues.move_to_end(client)  # the next client's turn
            else:
                del self._queues[client]
            if job.future.set_running_or_notify_cancel():
                return job
        return None

    def _start_next(self) -> None:  # holds the lock
        while not self._closed and self._running < self.lanes and self._overdue < self.max_overdue:
            job = self._next_job()
            if job is None:
                return
            job.started = True
            self._running += 1
            thread = threading.Thread(target=self._run, args=(job,), daemon=True, name="kestrel-grammar")
            self._threads.add(thread)
            thread.start()

    def _run(self, job: _Job) -> None:
        try:
            result, error = job.fn(*job.args), None
        except BaseException as e:  # noqa: BLE001 - handed to the request through its future
            result, error = None, e
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
            if not job.started:  # still queued: it leaves the queue and never runs
                job.finished = True
                queue = self._queues.get(job.client)
                if queue is not None and job in queue:
                    queue.remove(job)
                    if not queue:
                        del self._queues[job.client]
            else:
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
            queued = [job for queue in self._queues.values() for job in queue]
            self._queues = OrderedDict()
            running = list(self._threads)
        for job in queued:
            job.future.cancel()
        deadline = time.monotonic() + wait_s
        for thread in running:
            thread.join(max(0.0, deadline - time.monotonic()))
