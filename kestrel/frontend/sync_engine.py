"""LLMEngine: the synchronous frontend over an in-process EngineCore (what LLM.generate uses)."""
from __future__ import annotations

import itertools

from kestrel.config import EngineConfig
from kestrel.engine.core import EngineCore
from kestrel.frontend.outputs import RequestOutput
from kestrel.frontend.processor import InputProcessor, OutputProcessor, make_mm_processor
from kestrel.core.pooling import PoolingParams, pooling_facts
from kestrel.core.sampling_params import SamplingParams
from kestrel.frontend.lora_registry import LoRARequest, parse_lora_modules
from kestrel.platform.cpu_threads import apply_cpu_threads, offline_threads


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: bool = True):
        self.config = config
        apply_cpu_threads(config, offline_threads)
        self.core = EngineCore(config, progress=progress)
        self.tokenizer = self.core.tokenizer
        hf = self.core.model_config.text
        self.input_processor = InputProcessor.for_engine(
            config, self.tokenizer, self.core.max_model_len, hf.vocab_size, self.core.scheduler.max_prompt_tokens,
            mm=make_mm_processor(config, self.core.model_config.hf),
            pooling=pooling_facts(self.core.model_config, config.model), hf_config=self.core.model_config.hf)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self._lora_ids = itertools.count(1)  # never reused: an id salts its adapter's prefix-cache blocks
        for name, path in parse_lora_modules(config.lora):
            self.add_lora(name, path)

    @property
    def loras(self) -> dict[str, LoRARequest]:
        """The loaded adapters by name: the core's LoRA control holds the one registry."""
        ctl = self.core.lora_control
        return {name: LoRARequest(name, i, ctl.paths[i]) for i, name in ctl.loras.items()}

    def add_lora(self, name: str, path: str) -> LoRARequest:
        """Load a PEFT adapter; requests pick it with lora_request (or its name)."""
        if name in self.loras:
            raise ValueError(f"an adapter named {name!r} is already loaded")
        req = LoRARequest(name, next(self._lora_ids), path)
        self.core.add_lora(req.lora_id, name, path)
        return req

    def remove_lora(self, name: str) -> bool:
        req = self.loras.get(name)
        return req is not None and self.core.remove_lora(req.lora_id)  # raises (and keeps it) while in use

    def add_request(self, prompt: str | list[int] | dict, params: SamplingParams, request_id: str | None = None,
                    priority: int = 0, stream: bool = False, lora_request: LoRARequest | str | None = None,
                    pooling: PoolingParams | None = None, group_id: str = "") -> str:
        """`pooling`: a pooling request (params: kestrel.frontend.pooling.pooling_sampling()). `group_id`: the
        request group it belongs to (new_group_id(); "": a group of its own): while more than one group has work,
        the scheduler runs at most --contended-seqs-per-request sequences of each."""
        request_id = request_id or f"req-{next(self._ids)}"
        if isinstance(lora_request, str):
            if lora_request not in self.loras:
                raise ValueError(f"no adapter named {lora_request!r} is loaded")
            lora_request = self.loras[lora_request]
        ids, core_reqs = self.input_processor.process(request_id, prompt, params, priority,
                                                      lora_id=lora_request.lora_id if lora_request else 0,
                                                      pooling=pooling, group_id=group_id)
        self.output_processor.add_request(request_id, prompt, ids, params, core_reqs, stream)
        for r in core_reqs:
            self.core.add_request(r)
        return request_id

    def new_group_id(self) -> str:
        return f"group-{next(self._ids)}"

    def abort_request(self, request_id: str) -> None:
        self.core.abort_requests(self.output_processor.abort(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        core_out = self.core.step()
        outputs, to_stop = self.output_processor.process(core_out.outputs)
        if to_stop:  # stop strings: the frontend has finished these; the core stops generating them
            self.core.abort_requests(to_stop)
        return outputs
