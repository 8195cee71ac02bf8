"""A RequestOutput shows the prompt's text whatever form the caller gave it in (a string, vLLM's prompt dict, a
ProcessedPrompt from the render threads), and None for token ids: both engines hand the prompt to
OutputProcessor.add_request as they got it."""
from __future__ import annotations

import pytest

from kestrel.core.sampling_params import SamplingParams
from kestrel.engine.messages import EngineCoreOutput, EngineCoreRequest
from kestrel.frontend.processor import OutputProcessor, ProcessedPrompt


@pytest.mark.parametrize("prompt, shown", [
    ("Hello there", "Hello there"),
    ({"prompt": "A dict prompt"}, "A dict prompt"),
    ({"prompt_token_ids": [1, 2]}, None),
    (ProcessedPrompt([1, 2], text="rendered text"), "rendered text"),
    ([1, 2], None),
])
def test_outputs_show_the_prompt_text(prompt, shown):
    proc = OutputProcessor(tokenizer=None)
    params = SamplingParams(max_tokens=1, detokenize=False)
    proc.add_request("r", prompt, [1, 2], params, [EngineCoreRequest("r", [1, 2], params, 1, 0.0, 0)])
    (out,), _ = proc.process([EngineCoreOutput("r", [7], finish_reason="length")])
    assert out.finished and out.prompt == shown and out.prompt_token_ids == [1, 2]
