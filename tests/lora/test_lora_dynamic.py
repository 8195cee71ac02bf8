"""Acceptance 2: LoRA adapters loaded and unloaded at run time across 2 engine-core processes (real ZeroMQ).
A load that fails on one engine (fault injected) leaves the adapter loaded nowhere and the error names that engine;
a load that succeeds is visible on both; unloading likewise."""
from __future__ import annotations

import asyncio

import pytest

from kestrel.config import EngineConfig
from kestrel.frontend.async_engine import AsyncEngine
from kestrel.core.sampling_params import SamplingParams
from kestrel.errors import ModelNotFound
from kestrel.frontend.lora_registry import LoRAFanoutError
from tests.lora.peft_utils import make_adapter
from tests.tiny import make_checkpoint

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def lora_files(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("lora_dyn")
    base = make_checkpoint("llama", root, tokenizer=tiny_tokenizer)
    good = make_adapter(base, root / "good", 8, seed=1)
    too_big = make_adapter(base, root / "too_big", 32, seed=2)  # rank 32 > --max-lora-rank 16
    return base, good, too_big


def inject_fault(client, engine: int, method: str, replace):
    """Rewrite `method`'s arguments (or name) for one engine as the client encodes the call."""
    encode = client.encode

    def faulty(engine_index, call_id, m, args):
        if engine_index == engine and m == method:
            m, args = replace(m, args)
        return encode(engine_index, call_id, m, args)

    client.encode = faulty
    return lambda: setattr(client, "encode", encode)


async def loaded(engine: AsyncEngine) -> list[list]:
    """Every engine's adapters (one list per engine)."""
    return (await engine.client.utility.call_all("list_loras")).values_or_raise()


async def test_dynamic_lora_across_two_engines(lora_files):
    base, good, too_big = lora_files
    cfg = EngineConfig.create(model=str(base), data_parallel_size=2, cpu_threads=1, num_kv_blocks=64,
                              max_model_len=256, enable_lora=True, max_lora_rank=16, max_loras=2)
    engine = await AsyncEngine(cfg, "mp").start()
    try:
        assert engine.client.num_engines == 2
        # 1. a load that fails on engine 1 only (it is handed an adapter of rank 32): undone on engine 0
        restore = inject_fault(engine.client, 1, "add_lora", lambda m, a: (m, (a[0], a[1], str(too_big))))
        with pytest.raises(LoRAFanoutError) as err:
            await engine.load_lora_adapter("ad", str(good))
        restore()
        msg = str(err.value)
        assert err.value.failed_engines == [1] and err.value.status_code == 500
        assert "engine 1" in msg and "rank 32" in msg and "undo 'remove_lora': ok on [0]" in msg and "succeeded on engines [0]" in msg
        assert await loaded(engine) == [[], []]
        assert "ad" not in engine.loras.adapters

        # 2. the same load, no fault: visible on both engines, and requests for it run on either
        req = await engine.load_lora_adapter("ad", str(good))
        assert await loaded(engine) == [[[req.lora_id, "ad"]]] * 2
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        outs = {}
        for i, lora in enumerate([req, None, req, None]):  # least-loaded routing spreads them over both engines
            async for o in engine.generate([5, 17, 99, 3], params, f"r{i}", lora_request=lora):
                outs[i] = o.outputs[0].token_ids
        assert outs[0] == outs[2] and outs[1] == outs[3] and outs[0] != outs[1]

        # 3. an unload that fails on engine 0: engine 1's removal is undone (the adapter is read again)
        restore = inject_fault(engine.client, 0, "remove_lora", lambda m, a: ("fault_injected", a))
        with pytest.raises(LoRAFanoutError) as err:
            await engine.unload_lora_adapter("ad")
        restore()
        assert err.value.failed_engines == [0] and "engine 0" in str(err.value)
        assert await loaded(engine) == [[[req.lora_id, "ad"]]] * 2
        assert "ad" in engine.loras.adapters

        # 4. unload: gone from both
        await engine.unload_lora_adapter("ad")
        assert await loaded(engine) == [[], []] and engine.loras.adapters == {}

        # 5. a bad adapter fails everywhere: a 400 naming both engines and the reason
        with pytest.raises(LoRAFanoutError) as err:
            await engine.load_lora_adapter("big", str(too_big))
        assert err.value.failed_engines == [0, 1] and err.value.status_code == 400
        assert await loaded(engine) == [[], []]
    finally:
        await engine.shutdown()


async def wait_for(cond, timeout: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.05)


async def test_restarted_engine_core_gets_the_adapters_back(lora_files, tmp_path, caplog):
    """An engine core that dies and is restarted loads the server's adapters (--lora-modules and run-time loads,
    minus unloads, also one loaded while it was down) with their ids before it serves; an adapter that no longer
    loads is skipped (logged) and dropped from the server, instead of making the engine crash-loop."""
    base, good, _ = lora_files
    other = make_adapter(base, tmp_path / "other", 8, seed=5)
    cfg = EngineConfig.create(model=str(base), data_parallel_size=2, cpu_threads=1, num_kv_blocks=64,
                              max_model_len=256, enable_lora=True, max_lora_rank=16, max_loras=2,
                              lora_modules=[f"boot={good}"], engine_restart_limit=2)
    engine = await AsyncEngine(cfg, "mp").start()
    client = engine.client
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def tokens(rid, lora):
        async for o in engine.generate([5, 17, 99, 3], params, rid, lora_request=lora):
            pass
        return o.outputs[0].token_ids

    try:
        kept = await engine.load_lora_adapter("kept", str(other))
        await engine.load_lora_adapter("gone", str(good))
        await engine.unload_lora_adapter("gone")
        before = await tokens("before", kept)
        pid = client.procs[1].pid
        client.procs[1].kill()
        await wait_for(lambda: 1 in client.dead, 10, "engine 1's death was not noticed")
        late = await engine.load_lora_adapter("late", str(good))  # reaches engine 0 only
        await wait_for(lambda: client.engine_state(1) == "ready", 120, "engine core 1 did not come back")
        assert client.procs[1].pid != pid
        boot = engine.loras.adapters["boot"]
        assert await loaded(engine) == [[[boot.lora_id, "boot"], [kept.lora_id, "kept"], [late.lora_id, "late"]]] * 2
        # least-loaded routing sends some of these to engine 1: none is aborted there for a missing adapter
        assert await asyncio.gather(*(tokens(f"after{i}", kept) for i in range(4))) == [before] * 4

        # an adapter that can no longer be read: the restarted engine skips it (logged) and serves; the server drops
        # it from every engine, so a request naming it is a 404, not an abort on one engine
        other.rename(tmp_path / "moved")
        pid = client.procs[1].pid
        client.procs[1].kill()
        await wait_for(lambda: 1 in client.dead, 10, "engine 1's second death was not noticed")
        await wait_for(lambda: client.engine_state(1) == "ready" and client.procs[1].pid != pid, 120,
                       "engine core 1 did not come back without the unreadable adapter")
        assert "engine core 1: adapter 'kept'" in caplog.text and "no longer loads, dropped" in caplog.text
        assert "kept" not in engine.loras.adapters
        await wait_for(lambda: not client._restores, 10, "the restore (and its unload from engine 0) did not end")
        assert await loaded(engine) == [[[boot.lora_id, "boot"], [late.lora_id, "late"]]] * 2
        with pytest.raises(ModelNotFound, match="'kept' is not loaded"):
            await tokens("kept-gone", kept)
        assert [len(t) for t in await asyncio.gather(*(tokens(f"alone{i}", late) for i in range(4)))] == [8] * 4
    finally:
        await engine.shutdown()
