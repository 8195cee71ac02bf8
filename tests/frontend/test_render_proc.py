"""Render processes (kestrel/frontend/render_proc.py) on a tiny LLaVA-NeXT: a chat request rendered in a worker gives
the token ids and pixels the in-process path gives; a request's own fault comes back as InvalidRequest; a worker
killed while it renders fails that request with RenderWorkerDied, is started again, and serves the next one."""
from __future__ import annotations

import asyncio
import base64
import io
import os
import signal

import pytest
from PIL import Image

from tests.mm_tiny import sample_images


def data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "what is this?"}]}]


def test_render_process_matches_in_process_and_survives_a_kill(tiny_mm_models):
    from kestrel.config import EngineConfig
    from kestrel.frontend.media import resolve_image_parts
    from kestrel.frontend.processor import InputProcessor, make_mm_processor
    from kestrel.frontend.render_proc import RenderProcesses, RenderWorkerDied
    from kestrel.errors import InvalidRequest
    from kestrel.loader import tokenizer_or_none

    config = EngineConfig()
    config.model.model = str(tiny_mm_models["llava_next"])
    config.multimodal.max_image_pixels = 128 * 2**20  # the slow image below must pass the size check
    url = data_url(sample_images()[0])
    # a small PNG that takes about a second to decode and resize: 64 M pixels of a gradient
    big = data_url(Image.linear_gradient("L").resize((8000, 8000)).convert("RGB"))

    local = InputProcessor(tokenizer_or_none(config.model, tiny_mm_models["llava_next"]), 0, 0,
                           mm=make_mm_processor(config))
    expected = local.process_images(local.render_chat(resolve_image_parts(chat(url), config.multimodal)))

    async def run():
        procs = await RenderProcesses(config, 1).start()
        try:
            res, _ = await procs.render(chat(url), True, None, {}, None, None)
            assert res.token_ids == expected.token_ids
            got, want = res.extras.mm_features, expected.extras.mm_features
            assert [f.mm_hash for f in got] == [f.mm_hash for f in want] and got
            assert got[0].data["pixel_values"].data == want[0].data["pixel_values"].data

            with pytest.raises(InvalidRequest) as bad:
                await procs.render(chat("data:image/png;base64,aGVsbG8="), True, None, {}, None, None)
            assert bad.value.param == "messages[0].content[0].image_url"

            pid = procs.procs[0].pid
            slow = asyncio.create_task(procs.render(chat(big), True, None, {}, None, None))
            await asyncio.sleep(0.3)
            assert not slow.done()
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(RenderWorkerDied):
                await asyncio.wait_for(slow, 30)
            for _ in range(600):  # started again
                if procs.ready[0]:
                    break
                await asyncio.sleep(0.1)
            assert procs.procs[0].pid != pid
            again, _ = await procs.render(chat(url), True, None, {}, None, None)
            assert again.token_ids == expected.token_ids
        finally:
            await procs.shutdown()

    asyncio.run(run())
