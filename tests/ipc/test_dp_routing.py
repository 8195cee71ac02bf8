"""DPClient routing without processes: least loaded (stats + routed since), stable aborts, dead engines skipped."""
from __future__ import annotations

import pytest

from kestrel.config import EngineConfig
from kestrel.ipc import protocol as P
from kestrel.ipc.core_client import DPClient
from kestrel.core.sampling_params import SamplingParams
from kestrel.errors import EngineDead


def req(i: int) -> P.EngineCoreRequest:
    return P.EngineCoreRequest(f"r{i}", [1, 2, 3], SamplingParams(), 4, 0.0)


@pytest.fixture
def dp():
    c = DPClient(EngineConfig(), 3)
    c.sent = []
    c._send = lambda e, t, payload, request_id=None: c.sent.append((e, t))
    return c


def test_least_loaded_and_stable_abort(dp):
    dp.stats = [P.SchedulerStats(num_running=5), P.SchedulerStats(num_running=1, num_waiting=1),
                P.SchedulerStats(num_running=3)]
    got = [dp.add_request(req(i)) for i in range(4)]
    # loads 5/2/3 -> r0 to 1 (3/3 tie, lowest index wins) -> r1 to 1 -> r2 to 2 (4/4) -> r3 to 1
    assert got == [1, 1, 2, 1]
    dp.sent.clear()
    dp.abort_requests(["r2", "r0", "unknown"])  # each abort goes where its request went
    assert sorted(dp.sent) == [(1, P.RequestType.ABORT), (2, P.RequestType.ABORT)]
    assert "r0" not in dp.request_engine and "r1" in dp.request_engine


def test_dead_engines_are_skipped(dp):
    dp.dead = {0: EngineDead("engine core 0 died"), 1: EngineDead("engine core 1 died")}
    assert dp.add_request(req(0)) == 2
    dp.dead[2] = EngineDead("engine core 2 died")
    with pytest.raises(EngineDead, match="no engine core can serve: engine core 0 died"):
        dp.add_request(req(1))
    assert dp.is_dead


def test_engine_devices_one_gpu_per_rank_then_tp_blocks():
    from kestrel.ipc.core_client import engine_devices

    gpus = [str(i) for i in range(8)]
    assert [engine_devices(r, 1, gpus[:2]) for r in range(2)] == ["0", "1"]
    assert [engine_devices(r, 2, gpus[:4]) for r in range(2)] == ["0,1", "2,3"]
    assert [engine_devices(r, 4, gpus) for r in range(2)] == ["0,1,2,3", "4,5,6,7"]
    assert [engine_devices(r, 1, gpus[:2]) for r in range(3)] == ["0", "1", "0"]  # more engines than GPUs: shared
    assert engine_devices(1, 1, ["0"]) is None and engine_devices(0, 1, []) is None


@pytest.mark.parametrize("visible, want", [(None, ["0", "1"]), ("4,5,6", ["4,5", "6,4"]), ("6, 7", ["6,7", "6,7"])])
def test_device_for_reads_cuda_visible_devices(monkeypatch, visible, want):
    import torch

    count = 3 if visible is None else len(visible.split(","))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    tp = 1 if visible is None else 2
    client = DPClient(EngineConfig.create(tensor_parallel_size=tp, data_parallel_size=2), 2)
    assert [client._device_for(i) for i in range(2)] == want
    assert DPClient(EngineConfig.create(device="cpu", data_parallel_size=2), 2)._device_for(1) is None


def test_stalled_engines_are_skipped_until_they_answer(dp):
    dp.stalled = {1: EngineDead("engine core 1 is not responding (no heartbeat for 6 s)")}
    dp.stats = [P.SchedulerStats(num_running=9), P.SchedulerStats(), P.SchedulerStats(num_running=9)]
    assert dp.add_request(req(0)) in (0, 2)  # engine 1 is idle but silent: routed around it
    assert dp.live_engines == [0, 2] and not dp.is_dead
    dp.dead = {0: EngineDead("engine core 0 died"), 2: EngineDead("engine core 2 died")}
    assert dp.is_dead
    with pytest.raises(EngineDead, match="engine core 1 is not responding"):
        dp.add_request(req(1))
    dp.stalled.clear()
    assert dp.add_request(req(2)) == 1
