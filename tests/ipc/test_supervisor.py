"""The supervised-worker helper (kestrel/core/supervisor.py) with fake processes and an explicit clock: restart
with doubling back-off up to the limit, a failing child killed after its grace, a hung child replaced, a restart
that does not come back, start-up errors, idempotent stop; and one real child that exits with its parent."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from kestrel.core.supervisor import PopenProcess, StartupError, Supervisor


class FakeProc:
    def __init__(self, i: int):
        self.pid = 1000 + i
        self.exitcode = None
        self.killed = False
        self.stop_requested = False

    def is_alive(self) -> bool:
        return self.exitcode is None

    def kill(self) -> None:
        self.killed = True
        self.exitcode = -9

    def join(self, timeout=None) -> None:
        if self.stop_requested and self.exitcode is None:
            self.exitcode = 0


def make(num=2, **kw):
    spawned, died, lost = [], [], []

    def spawn(i):
        p = FakeProc(i)
        spawned.append((i, p))
        return p

    sup = Supervisor("worker", num, spawn, startup_timeout=10.0, on_died=lambda i, why: died.append((i, why)),
                     on_restart_failed=lost.append, **kw)
    sup.start_all()
    for i in range(num):
        assert sup.ready(i)
    sup.started = True
    return sup, spawned, died, lost


def test_restart_with_doubling_backoff_until_the_limit():
    sup, spawned, died, _ = make(restart_limit=2, backoff=(0.5, 30.0))
    t = time.monotonic()
    for k, delay in enumerate([0.5, 1.0]):
        sup.procs[1].exitcode = 3
        sup.watch(t)
        assert died[-1] == (1, "died with exit code 3") and sup.state(1) == "waiting"
        sup.watch(t + delay - 0.01)
        assert sup.state(1) == "waiting"  # still backing off
        sup.watch(t + delay)
        assert sup.state(1) == "starting" and sup.children[1].restarts == k + 1
        assert not sup.ready(0)  # a ready child's stale hand-shake changes nothing
        assert sup.ready(1)
        t += delay
    sup.procs[1].exitcode = 3
    sup.watch(t)
    assert sup.state(1) == "down" and len(spawned) == 4  # 2 starts + 2 restarts, no third
    assert sup.state(0) == "ready"


def test_the_restart_limit_counts_within_its_window():
    """Issue 55: the limit was over a lifetime, so four long prompts (each taken for a hang) left the server dead
    for good; restarts older than the window no longer count."""
    sup, spawned, died, _ = make(restart_limit=2, restart_window=100.0, backoff=(0.0, 0.0))
    t = time.monotonic()
    for k in range(6):  # a death every 60 s: never more than 2 within 100 s
        sup.procs[1].exitcode = 3
        sup.watch(t)
        sup.watch(t)
        assert sup.state(1) == "starting", k
        assert sup.ready(1)
        t += 60
    sup.procs[1].exitcode = 3  # a quick death: the 2nd restart within 100 s
    sup.watch(t)
    sup.watch(t)
    assert sup.ready(1)
    sup.procs[1].exitcode = 3  # and another: a 3rd would be past the limit
    sup.watch(t + 1)
    assert sup.state(1) == "down" and sup.children[1].restarts == 7


def test_failing_child_is_killed_after_its_grace_and_restarted():
    sup, spawned, died, _ = make(exit_grace=5.0)
    t = time.monotonic()
    sup.failing(0, "failed: boom")
    assert died == [(0, "failed: boom")] and sup.state(0) == "exiting"
    proc = sup.procs[0]
    sup.watch(t + 1)
    assert not proc.killed and sup.state(0) == "exiting"
    sup.watch(t + 6)
    assert proc.killed and sup.state(0) == "waiting"
    sup.watch(t + 6)  # back-off 0: spawned again
    assert sup.state(0) == "starting" and sup.procs[0] is not proc
    assert len(died) == 1  # one failure, one report


def test_replace_kills_a_hung_child_and_a_lost_restart_is_reported():
    sup, spawned, died, lost = make()
    hung = sup.procs[1]
    sup.replace(1, "sent no heartbeat for 31 s")
    assert hung.killed and died == [(1, "sent no heartbeat for 31 s")] and sup.state(1) == "waiting"
    t = time.monotonic()
    sup.watch(t)
    assert sup.state(1) == "starting"
    sup.watch(t + 11)  # not ready within the start-up time-out
    assert lost == [1] and sup.procs[1].killed and sup.state(1) == "waiting"
    assert len(died) == 1


def test_wait_ready_names_the_child_that_failed():
    async def run(setup, match):
        sup = Supervisor("worker", 2, FakeProc, startup_timeout=0.3)
        sup.start_all()
        setup(sup)
        with pytest.raises(StartupError, match=match):
            await sup.wait_ready(" (raise the time-out)")

    asyncio.run(run(lambda s: s.start_failed(1, "no such model"), "worker 1 failed to start: no such model"))
    asyncio.run(run(lambda s: setattr(s.procs[0], "exitcode", 2), "worker 0 exited with code 2"))
    asyncio.run(run(lambda s: s.ready(0), r"worker 1 not ready after 0 s \(raise the time-out\)"))


def test_stop_is_idempotent_and_kills_what_does_not_stop():
    sup, _, _, _ = make(num=3)
    procs = sup.procs
    asked = []

    def send_stop(i):
        asked.append(i)
        if i == 2:
            raise OSError("socket gone")  # ignored: that child is killed
        procs[i].stop_requested = True

    sup.stop(send_stop, grace=0.1)
    assert asked == [0, 1, 2]
    assert [p.killed for p in procs] == [False, False, True] and not any(p.is_alive() for p in procs)
    sup.stop(send_stop, grace=0.1)
    assert asked == [0, 1, 2]  # nothing sent twice


def test_popen_child_and_dead_child_sentence():
    sup = Supervisor("rank", 2, lambda i: PopenProcess([sys.executable, "-c", f"import sys; sys.exit({i})"]),
                     startup_timeout=10.0)
    sup.start_all()
    for p in sup.procs:
        p.join(10)
    assert sup.dead_child(exclude=0) == f"rank 1 (pid {sup.procs[1].pid}) died with exit code 1"
    assert sup.dead_child(exclude=1) == f"rank 0 (pid {sup.procs[0].pid}) died with exit code 0"
    sup.stop(None, grace=1.0)


def test_a_child_exits_when_its_parent_is_gone(tmp_path):
    """parent_gone: a grandchild whose parent exits notices within its poll and exits."""
    out = tmp_path / "out"
    child = ("import os, time, sys\n"
             "parent = os.getppid()\n"  # before the import below, which may outlast the parent on a busy machine
             "from kestrel.core.supervisor import parent_gone\n"
             "for _ in range(200):\n"
             "    if parent_gone(parent):\n"
             f"        open({str(out)!r}, 'w').write('gone'); sys.exit(0)\n"
             "    time.sleep(0.05)\n")
    parent = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; subprocess.Popen([sys.executable, "
                                                     f"'-c', {child!r}]); import time; time.sleep(2)"])
    parent.wait(30)
    for _ in range(200):
        if out.exists() and out.read_text():  # created, then written: wait for the word, not the file
            break
        time.sleep(0.05)
    assert out.read_text() == "gone"
