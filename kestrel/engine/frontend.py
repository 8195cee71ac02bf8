"""LLMEngine: the synchronous frontend over an in-process EngineCore (what LLM.generate uses)."""
from __future__ import annotations

import itertools

from kestrel.config import EngineConfig
from kestrel.engine.core import EngineCore
from kestrel.engine.outputs import RequestOutput
from kestrel.engine.processor import InputProcessor, OutputProcessor
from kestrel.engine.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: bool = True):
        self.config = config
        self.core = EngineCore(config, progress=progress)
        self.tokenizer = self.core.runner.loaded.tokenizer
        hf = self.core.runner.hf_config
        self.input_processor = InputProcessor(self.tokenizer, self.core.max_model_len, hf.vocab_size,
                                              self.core.eos_token_id, config.model.max_logprobs)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    priority: int = 0, stream: bool = False) -> str:
        request_id = request_id or f"req-{next(self._ids)}"
        ids, core_reqs = self.input_processor.process(request_id, prompt, params, priority)
        self.output_processor.add_request(request_id, prompt if isinstance(prompt, str) else None, ids, params,
                                          core_reqs, stream)
        for r in core_reqs:
            self.core.add_request(r)
        return request_id

    def abort_request(self, request_id: str) -> None:
        self.core.abort_requests(self.output_processor.abort(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        core_out = self.core.step()
        outputs, to_stop = self.output_processor.process(core_out.outputs)
        if to_stop:
            self.core.finish_requests(to_stop)
        return outputs
