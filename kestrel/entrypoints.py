"""The offline API: LLM(model).generate(prompts, params) and LLM.chat(messages); with a pooling model, LLM.embed,
LLM.classify, LLM.score, LLM.encode and LLM.reward; LLM.sleep / wake_up and LLM.get_tokenizer as vLLM's."""
from __future__ import annotations

import gc
import logging
from typing import Sequence, Union

import torch
from tqdm.auto import tqdm

from kestrel.config import EngineConfig
from kestrel.hub_cache import is_hub_id, resolve_model_path
from kestrel.frontend.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from kestrel.frontend.sync_engine import LLMEngine
from kestrel.frontend.truncation import truncation_length
from kestrel.frontend.outputs import RequestOutput
from kestrel.core.pooling import PoolingParams
from kestrel.core.sampling_params import SamplingParams
from kestrel.frontend.pooling import (ClassificationOutput, EmbeddingOutput, PoolingOutput, PoolingRequestOutput,
                                      ScoringOutput, plan_scores, pooling_sampling, resolve_pooling_params)

logger = logging.getLogger(__name__)


PromptType = Union[str, list[int], dict]


def _prompt_of(p: PromptType) -> str | list[int]:
    """vLLM's TextPrompt / TokensPrompt dicts -> what the engine takes."""
    if not isinstance(p, dict):
        return p
    if "multi_modal_data" in p:
        return p  # the input processor takes the dict (kestrel/frontend/processor.py split_prompt)
    unknown = set(p) - {"prompt", "prompt_token_ids"}
    if unknown or len(p) != 1:
        raise ValueError(f"a prompt dict holds exactly one of 'prompt' or 'prompt_token_ids' (got keys {sorted(p)})")
    return p.get("prompt", p.get("prompt_token_ids"))


class LLM:
    """Offline batch inference.

    >>> llm = LLM("path/to/checkpoint")           # or a .gguf file; None = the embedded SmolLM2 default
    >>> llm.generate(["Hello"], SamplingParams(max_tokens=8))[0].outputs[0].text
    """

    def __init__(self, model: str | None = None, progress: bool = True, **engine_options):
        self.config = EngineConfig.create(model=model, **engine_options)
        m = self.config.model
        for field in ("model", "tokenizer"):  # a hub id: its snapshot in the local Hugging Face cache
            if getattr(m, field) is not None and is_hub_id(getattr(m, field)):
                setattr(m, field, resolve_model_path(getattr(m, field), field, m.revision, m.download_dir))
        self.engine = LLMEngine(self.config, progress=progress)

    @classmethod
    def from_config(cls, config: EngineConfig, progress: bool = True) -> "LLM":
        llm = cls.__new__(cls)
        llm.config = config
        llm.engine = LLMEngine(config, progress=progress)
        return llm

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        """vLLM's accessor: the engine's Hugging Face tokenizer."""
        return self.engine.tokenizer

    # ---- sleep mode, as vLLM's LLM.sleep / wake_up: a sleeping engine takes no steps (generate raises until
    # wake_up) and has dropped its prefix cache; its weights stay where they are
    def sleep(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        self.engine.core.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """`tags` (vLLM's "weights" / "kv_cache"): nothing was offloaded here, so any wakes everything."""
        unknown = set(tags or ()) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"wake_up tags are 'weights' and 'kv_cache', not {sorted(unknown)}")
        self.engine.core.wake_up()

    def is_sleeping(self) -> bool:
        return self.engine.core.is_sleeping()

    def shutdown(self) -> None:
        """Stop the engine and give its device memory back now (weights, KV cache, CUDA graphs), so that another
        engine fits in the same process. `del llm` alone is not enough on CUDA: the graph sets and the runner
        refer to each other, and such cycles wait for Python's next full garbage collection. Idempotent; the LLM
        cannot generate afterwards. `with LLM(...) as llm:` calls it on exit."""
        engine = self.__dict__.pop("engine", None)
        if engine is None:
            return
        engine.core.shutdown()  # tensor parallel: the workers exit and free their GPUs
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def __getattr__(self, name: str):  # only reached where normal lookup fails: `engine` after shutdown
        if name == "engine":
            raise RuntimeError("this LLM was shut down: create a new one")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool | None = None,
                 priority: Sequence[int] | None = None, lora_request=None) -> list[RequestOutput]:
        """Prompts in vLLM's forms: a string, a token-id list, {"prompt": str} or {"prompt_token_ids": [...]}
        (with images: {"prompt": str, "multi_modal_data": {"image": PIL image or list}}), or a list of those;
        returns one RequestOutput per prompt, in input order. lora_request: one adapter (a LoRARequest from
        load_lora, or its name) for all prompts, or one per prompt (None: the base model)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = [_prompt_of(p) for p in prompts]
        params = params or SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} sampling params for {len(prompts)} prompts")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(loras)} lora requests for {len(prompts)} prompts")
        ids, group = [], self.engine.new_group_id()  # one call: one request group, never capped against itself
        try:
            for i, (p, sp) in enumerate(zip(prompts, plist)):
                ids.append(self.engine.add_request(p, sp, priority=priority[i] if priority else 0,
                                                   lora_request=loras[i], group_id=group))
        except BaseException:  # a bad prompt (too long, say) fails the call; the prompts before it do not run
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm if use_tqdm is not None else len(ids) > 8)

    # ---- pooling models (kestrel serve --runner pooling): embeddings, class scores, relevance scores
    def embed(self, prompts: PromptType | Sequence[PromptType], dimensions: int | None = None, normalize: bool = True,
              use_tqdm: bool | None = None, truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """One embedding per prompt (outputs.embedding); `dimensions`: Matryoshka truncation where the model
        supports it; `truncate_prompt_tokens`: keep each prompt's last k tokens (-1: max_model_len)."""
        pooling = PoolingParams(task="embed", normalize=normalize, dimensions=dimensions or 0)
        return [PoolingRequestOutput(o.request_id, o.prompt_token_ids, EmbeddingOutput(o.pooled))
                for o in self._pool(prompts, pooling, use_tqdm, truncate_prompt_tokens)]

    def classify(self, prompts: PromptType | Sequence[PromptType], activation: bool = True,
                 use_tqdm: bool | None = None, truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """Class probabilities per prompt (outputs.probs; raw logits with activation=False)."""
        pooling = PoolingParams(task="classify", activation=activation)
        return [PoolingRequestOutput(o.request_id, o.prompt_token_ids, ClassificationOutput(o.pooled))
                for o in self._pool(prompts, pooling, use_tqdm, truncate_prompt_tokens)]

    def encode(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None,
               use_tqdm: bool | None = None, pooling_task: str | None = None,
               truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """vLLM's generic pooling call: per prompt, outputs.data (a float32 tensor) is what the model's pooling task
        gives (an embedding, or class probabilities). `pooling_task` (embed | classify) must be the model's own;
        per-token tasks (token_embed, token_classify) are refused by name (kestrel/frontend/pooling.py)."""
        pooling = resolve_pooling_params(self.engine.input_processor.pooling, pooling_params, pooling_task)
        return [PoolingRequestOutput(o.request_id, o.prompt_token_ids, PoolingOutput.of(o.pooled))
                for o in self._pool(prompts, pooling, use_tqdm, truncate_prompt_tokens)]

    def reward(self, prompts: PromptType | Sequence[PromptType], use_tqdm: bool | None = None,
               truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """A sequence (outcome) reward model's scores, as vLLM serves Skywork-Reward-style *ForSequenceClassification
        checkpoints: outputs.data holds the raw head outputs at the last token (no softmax). Per-token rewards
        (process reward models) are not implemented."""
        facts = self.engine.input_processor.pooling
        if facts is None or facts["task"] != "classify":
            raise ValueError("reward needs a reward model with a classification head (a *ForSequenceClassification "
                             f"checkpoint); this model's task is {facts['task'] if facts else 'generate'}")
        return self.encode(prompts, PoolingParams(task="classify", activation=False), use_tqdm,
                           truncate_prompt_tokens=truncate_prompt_tokens)

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str],
              use_tqdm: bool | None = None, truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """Relevance of each text_2 to text_1 (one query and N documents, or N and N): a cross-encoder's score,
        or the cosine of an embedding model's two embeddings."""
        queries = [text_1] if isinstance(text_1, str) else list(text_1)
        documents = [text_2] if isinstance(text_2, str) else list(text_2)
        processor = self.engine.input_processor
        plan = plan_scores(processor.pooling, self.tokenizer, queries, documents,
                           max_length=truncation_length(truncate_prompt_tokens, processor.max_model_len))
        outs = self._pool(plan.prompts, plan.pooling, use_tqdm, truncate_prompt_tokens)
        return [PoolingRequestOutput(outs[j].request_id, outs[j].prompt_token_ids, ScoringOutput(score))
                for (_, j), score in zip(plan.pairs, plan.scores([o.pooled for o in outs]))]

    def _pool(self, prompts, pooling: PoolingParams, use_tqdm: bool | None,
              truncate_prompt_tokens: int | None = None) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids, group = [], self.engine.new_group_id()
        try:
            for p in prompts:
                ids.append(self.engine.add_request(_prompt_of(p), pooling_sampling(truncate_prompt_tokens),
                                                   pooling=pooling, group_id=group))
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm if use_tqdm is not None else len(ids) > 8)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's beam search (kestrel/frontend/beam_search.py): per prompt, the best `params.beam_width`
        sequences (their tokens and text include the prompt's, as in vLLM)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params.validate(self.config.model.max_logprobs)
        tok = self.tokenizer
        searches = []
        for p in map(_prompt_of, prompts):
            ids = self.engine.input_processor.tokenize(p) if isinstance(p, str) else list(p)
            searches.append(BeamSearch(ids, params, getattr(tok, "eos_token_id", None)))
        step = params.step_params()
        with tqdm(total=params.max_tokens, desc="Beam search", unit="token", disable=not use_tqdm) as bar:
            while any(not s.done for s in searches):
                asked = [(s, s.pending()) for s in searches]
                outs = iter(self.generate([ids for _, seqs in asked for ids in seqs], step, use_tqdm=False))
                for s, seqs in asked:
                    if seqs:
                        s.advance([next(outs).outputs[0].logprobs[0] for _ in seqs])
                bar.update(1)
        return [s.result(tok) for s in searches]

    def load_lora(self, name: str, path: str):
        """Load a PEFT adapter folder (needs enable_lora=True); returns the LoRARequest to pass to generate."""
        return self.engine.add_lora(name, path)

    def unload_lora(self, name: str) -> bool:
        return self.engine.remove_lora(name)

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None,
             use_tqdm: bool | None = None, add_generation_prompt: bool = True, continue_final_message: bool = False,
             **template_kwargs) -> list[RequestOutput]:
        """Messages with string content, or OpenAI content parts: text, {"type": "image", "image": PIL image} and
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}} (local files and remote URLs as
        the engine's media options allow). continue_final_message (with add_generation_prompt=False): the model
        continues the final message (an assistant prefill)."""
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message needs add_generation_prompt=False")
        from kestrel.frontend.media import resolve_image_parts

        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.engine.input_processor.render_chat(resolve_image_parts(c, self.config.multimodal),
                                                           add_generation_prompt, template_kwargs=template_kwargs,
                                                           continue_final_message=continue_final_message)
                   for c in convs]
        return self.generate(prompts, params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        if ids and self.engine.core.is_sleeping():  # it would wait for steps that never come
            for rid in ids:
                self.engine.abort_request(rid)
            raise RuntimeError("this LLM is asleep (LLM.sleep): call wake_up() before generating")
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[i] for i in ids]
