"""Issue 55 item 6: a beam search is one request to the admission window and the engine's fair share. Its step
requests (one per live beam and token) each had a window and a fair-share group of their own, so 1,000 prompts
x width 10 put 10,000 sequences into the engine at once and kept others waiting 95 s; and `timeout` was ignored."""
from __future__ import annotations

import asyncio
import dataclasses

from kestrel.config import EngineConfig
from kestrel.frontend.async_engine import AsyncEngine
from kestrel.frontend.beam_search import BeamSearchParams
from kestrel.ipc.core_client import InprocClient

WINDOW = 4


async def _engine(tiny_llama) -> AsyncEngine:
    cfg = EngineConfig.create(model=str(tiny_llama), num_kv_blocks=64, max_model_len=256, cpu_threads=1,
                              max_seqs_per_request=WINDOW)
    return await AsyncEngine(cfg, InprocClient(cfg)).start()


async def test_beam_steps_share_one_window_and_one_group(tiny_llama):
    engine = await _engine(tiny_llama)
    try:
        sent, most = [], 0
        real_add = engine.client.add_request

        def add_request(r):
            nonlocal most
            sent.append(r.group_id)
            out = real_add(r)
            most = max(most, len(engine._children.windows))
            return out

        engine.client.add_request = add_request
        window = engine.admission_window()
        beam = BeamSearchParams(beam_width=3, max_tokens=3, ignore_eos=True)
        for prompt in ([5, 17, 99, 3], [7, 8, 9]):  # one API request's two prompts
            async for out in engine.beam_search(prompt, dataclasses.replace(beam), f"b{prompt[0]}", window=window):
                assert len(out.outputs) == 3 and all(len(c.token_ids) == 3 for c in out.outputs)
        assert len(sent) > WINDOW and set(sent) == {window.group_id}, set(sent)
        assert most <= WINDOW, most
    finally:
        await engine.shutdown()


async def test_beam_search_timeout_returns_the_beams_so_far(tiny_llama):
    engine = await _engine(tiny_llama)
    try:
        beam = BeamSearchParams(beam_width=2, max_tokens=200, ignore_eos=True)
        (out,) = [o async for o in engine.beam_search([5, 17, 99, 3], beam, "t", timeout=0.3)]
        assert [(c.finish_reason, c.stop_reason) for c in out.outputs] == [("abort", "timeout")] * 2
        assert all(len(c.token_ids) < 200 for c in out.outputs)
        for _ in range(100):  # the step in flight was aborted (the core's thread takes the abort)
            if not engine.client.core.scheduler.requests:
                break
            await asyncio.sleep(0.05)
        assert not engine.client.core.scheduler.requests
    finally:
        await engine.shutdown()
