"""The engine-core process over real ZeroMQ ipc: ready hand-shake, start-up errors, bad messages that must not kill
the engine, the utility allow-list, and abort-on-cancel freeing the KV blocks."""
from __future__ import annotations

import asyncio

import msgspec
import pytest

from kestrel.config import EngineConfig
from kestrel.ipc import protocol as P
from kestrel.frontend.async_engine import AsyncEngine
from kestrel.ipc.core_client import EngineStartupError, MPClient
from kestrel.ipc.core_proc import engine_identity
from kestrel.core.sampling_params import SamplingParams
from kestrel.ipc.utility import UtilityCallError


async def test_startup_error_is_reported(tmp_path):
    client = MPClient(EngineConfig.create(model=str(tmp_path / "missing"), cpu_threads=1, engine_startup_timeout=120))
    with pytest.raises(EngineStartupError, match="engine core 0 failed to start: .*missing"):
        await client.start()
    assert all(not p.is_alive() for p in client.procs)


async def test_engine_survives_bad_messages_and_frees_blocks_on_cancel(tiny_llama):
    cfg = EngineConfig.create(model=str(tiny_llama), num_kv_blocks=32, max_model_len=256, cpu_threads=1)
    engine = await AsyncEngine(cfg, MPClient(cfg)).start()
    client: MPClient = engine.client
    try:
        ident = engine_identity(0)
        bad = [[ident, b"\x09", b"x"], [ident, P.RequestType.ADD.value], [ident, P.RequestType.ADD.value, b"\xc1"],
               [ident, P.RequestType.ABORT.value, P.encoder.encode({"not": "a list"})],
               [ident, P.RequestType.UTILITY.value, b"junk"]]
        for frames in bad:
            client._input.send_multipart(frames)
        got = []
        client.on_outputs, orig = (lambda o: (got.append(o), orig(o))), client.on_outputs
        # an ADD that decodes but is invalid gets an abort output for its id, so no stream hangs
        client._input.send_multipart([ident, P.RequestType.ADD.value,
                                      msgspec.msgpack.encode({"request_id": "bad-1", "prompt_token_ids": "nope"})])
        for name in ("step", "__init__", "add_request"):  # only UTILITY_METHODS are callable
            with pytest.raises(UtilityCallError, match="not a utility method"):
                await engine.call_utility(name)
        assert await engine.call_utility("ping") == "pong"
        for _ in range(50):
            if any(o.request_id == "bad-1" and o.finish_reason == "abort" for x in got for o in x.outputs):
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("no abort output for the undecodable request")
        # still serving
        outs = [o async for o in engine.generate("Hello world", SamplingParams(max_tokens=4, temperature=0))]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
        # leaving a stream early aborts the request in the engine: all blocks come back
        gen = engine.generate("The quick brown fox " * 8, SamplingParams(max_tokens=200, ignore_eos=True))
        n = 0
        async for _ in gen:
            n += 1
            if n == 3:
                break
        await gen.aclose()
        for _ in range(100):
            s = client.stats[0]
            if s.num_running == 0 and s.num_waiting == 0 and s.num_free_kv_blocks == s.num_kv_blocks:
                break
            await asyncio.sleep(0.05)
        assert (s.num_running, s.num_free_kv_blocks) == (0, s.num_kv_blocks), s
        assert client.procs[0].is_alive()
    finally:
        await engine.shutdown()
    assert not client.procs[0].is_alive()


async def test_inproc_client_fails_requests_when_a_step_raises(tiny_llama):
    """In-process engine core: a step that raises (a tensor-parallel worker died) fails the waiting requests with
    the error and leaves the engine dead; nothing hangs."""
    from kestrel.ipc.core_client import InprocClient
    from kestrel.errors import EngineDead
    from kestrel.executor import WorkerError

    cfg = EngineConfig.create(model=str(tiny_llama), num_kv_blocks=32, max_model_len=256, cpu_threads=1)
    engine = await AsyncEngine(cfg, InprocClient(cfg)).start()
    try:
        core, steps = engine.client.core, 0
        real_step = core.step

        def step():
            nonlocal steps
            steps += 1
            if steps == 3:
                raise WorkerError("tensor-parallel worker rank 1 (pid 1) died with exit code -9")
            return real_step()

        core.step = step
        with pytest.raises(EngineDead, match="engine core 0 failed: WorkerError: .*rank 1"):
            async with asyncio.timeout(10):
                async for _ in engine.generate("Hello", SamplingParams(max_tokens=50, ignore_eos=True)):
                    pass
        assert engine.is_dead
        with pytest.raises(EngineDead, match="rank 1"):
            engine.generate("Hello", SamplingParams(max_tokens=2))
    finally:
        await engine.shutdown()
