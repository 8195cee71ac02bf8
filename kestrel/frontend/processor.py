"""Frontend halves shared by the sync and async engines: requests in (tokenize, validate, fan out n) and
outputs back (detokenize, stop strings, merge the n samples of one request)."""
from __future__ import annotations

import os
import time

import msgspec
from dataclasses import dataclass, field
from typing import Callable

from kestrel.frontend.detokenizer import IncrementalDetokenizer
from kestrel.frontend.outputs import CompletionOutput, Logprob, RequestOutput
from kestrel.engine.messages import EngineCoreOutput, EngineCoreRequest
from kestrel.core.extras import NO_EXTRAS, RequestExtras
from kestrel.core.positions import ONE_D, PositionScheme
from kestrel.core.pooling import PoolingParams
from kestrel.frontend.pooling import check_request_kind
from kestrel.frontend.truncation import special_token_span, truncate_prompt
from kestrel.core.sampling_params import SamplingParams, check_bad_words
from kestrel.errors import InvalidRequest


RESERVED_TEMPLATE_ARGS = frozenset({"conversation", "messages", "chat_template", "tokenize", "add_generation_prompt",
                                    "return_dict", "return_tensors", "tokenizer_kwargs", "tools", "documents",
                                    "continue_final_message", "padding", "truncation", "max_length"})


def child_id(parent_id: str, index: int, n: int) -> str:
    return parent_id if n == 1 else f"{parent_id}#{index}"


def split_prompt(prompt) -> tuple[str | list[int], list]:
    """A prompt as LLM.generate and the server take it: a string, token ids, or vLLM's dict form
    {"prompt": str | "prompt_token_ids": [...], "multi_modal_data": {"image": image | [images]}}."""
    if not isinstance(prompt, dict):
        return prompt, []
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise InvalidRequest("a prompt dict needs exactly one of 'prompt' and 'prompt_token_ids'", param="prompt")
    text = prompt["prompt"] if "prompt" in prompt else list(prompt["prompt_token_ids"])
    mm = prompt.get("multi_modal_data") or {}
    unknown = set(mm) - {"image", "video"}
    if unknown:
        raise InvalidRequest(f"unsupported modalities {sorted(unknown)}; only 'image' and 'video'",
                             param="multi_modal_data")
    images = mm.get("image")
    if images is None:
        return text, []
    from kestrel.frontend.mm_processor import as_image_list
    return text, as_image_list(images)


def prompt_videos(prompt) -> list:
    """A prompt dict's videos as [(frames, metadata or None)] (vLLM's `multi_modal_data: {"video": ...}`)."""
    videos = (prompt.get("multi_modal_data") or {}).get("video") if isinstance(prompt, dict) else None
    if videos is None:
        return []
    from kestrel.frontend.mm_processor import as_video_list
    return as_video_list(videos)


@dataclass
class ProcessedPrompt:
    """A prompt whose images the image processor has already expanded: token ids with one placeholder run per
    image, and the request's extras (the images' features in prompt order, the bidirectional prefix length). The
    server's render threads build it (InputProcessor.process_images) so that image work never runs on the event
    loop."""
    token_ids: list[int]
    extras: RequestExtras = NO_EXTRAS
    text: str | None = None


def display_prompt(prompt) -> str | None:
    if isinstance(prompt, ProcessedPrompt):
        return prompt.text
    if isinstance(prompt, dict):
        prompt = prompt.get("prompt")
    return prompt if isinstance(prompt, str) else None


def check_fits_kv_cache(num_prompt_tokens: int, max_prompt_tokens: int) -> None:
    """The frontend's side of the one admission rule: the engine announces the longest prompt its KV cache
    admits (engine facts "max_prompt_tokens", from the scheduler's own rule over every KV-cache group)."""
    if num_prompt_tokens > max_prompt_tokens:
        raise InvalidRequest(f"the prompt has {num_prompt_tokens} tokens; the KV cache admits prompts of at most "
                             f"{max_prompt_tokens} tokens", param="prompt", code="context_length_exceeded")


def model_class(config, hf_config=None):
    """(checkpoint path, HF config, model class) of the engine's checkpoint; None for a GGUF file."""
    from kestrel.loader import default_model_path, load_hf_config
    from kestrel.models.registry import get_model_class

    m = config.model
    path = m.model or default_model_path()
    if path.endswith(".gguf"):
        return None
    hf_config = hf_config or load_hf_config(path, m.trust_remote_code)
    return path, hf_config, get_model_class((getattr(hf_config, "architectures", None) or ["LlamaForCausalLM"])[0])


def mm_model_class(config, hf_config=None):
    """(checkpoint path, HF config, model class) of a multimodal checkpoint; None for text-only models."""
    from kestrel.models.interfaces import supports_images

    found = model_class(config, hf_config)
    return found if found is not None and supports_images(found[2]) else None


def model_position_scheme(config, hf_config=None) -> PositionScheme:
    """How the engine's model computes a prompt's positions (kestrel/core/positions.py)."""
    from kestrel.models.interfaces import position_scheme

    found = model_class(config, hf_config)
    return ONE_D if found is None else position_scheme(found[2], found[1])


NO_IMAGES = "this model does not take images"


def images_refusal(config, hf_config=None) -> str:
    """Why a text-only engine refuses images: the model class's own reason where it has one (a vision-language
    checkpoint served for its text part: `images_refused`), else that the model takes none."""
    found = model_class(config, hf_config)
    reason = getattr(found[2], "images_refused", None) if found is not None else None
    return f"{NO_IMAGES}: {reason}" if reason else NO_IMAGES


def make_mm_processor(config, hf_config=None):
    """The frontend's image processor for a multimodal checkpoint (None for text-only models)."""
    from kestrel.frontend.mm_processor import MultiModalProcessor

    found = mm_model_class(config, hf_config)
    if found is None:
        return None
    path, hf_config, model_cls = found
    limits = {m: config.multimodal.limit(m) for m in ("image", "video")}
    return MultiModalProcessor(path, hf_config, model_cls, limits,
                               config.model.trust_remote_code, config.multimodal.mm_processor_kwargs)


def default_image_render_workers() -> int:
    """Render processes (or threads) of an image model's server: half the CPUs, at most 8, keep up with many image
    requests and leave the rest to the event loop and the engine cores."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return max(1, min(8, cpus // 2))


class InputProcessor:
    """``default_max_tokens``: the cap for a request without max_tokens (None: the rest of the context);
    ``chat_template``: used instead of the tokenizer's own when set; ``mm``: the MultiModalProcessor of an
    image-text model (None: text only); ``max_num_batched_tokens``: the step budget a bidirectional prefix must
    fit."""

    def __init__(self, tokenizer, max_model_len: int, vocab_size: int, max_logprobs: int = 20, default_max_tokens: int | None = None, chat_template: str | None = None,
                 mm=None, max_num_batched_tokens: int | None = None, pooling: dict | None = None,
                 max_prompt_tokens: int | None = None, images_refused: Callable[[], str] = lambda: NO_IMAGES,
                 positions: PositionScheme = ONE_D):
        """`pooling`: a pooling engine's facts (kestrel/core/pooling.py pooling_facts; None: a generative one).
        `max_prompt_tokens`: the longest prompt the engine's KV cache admits (None: not checked here).
        `positions`: the model's position scheme, which computes a prompt's positions with it."""
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        self.pooling = pooling
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_logprobs = max_logprobs
        self.default_max_tokens = default_max_tokens
        self.chat_template = chat_template
        self.mm = mm
        self.images_refused = images_refused  # the 400's message for images to a text-only model (asked then)
        self.positions = positions
        self._specials: tuple[int, int] | None = None  # special tokens before / after a text (truncation keeps them)

    @classmethod
    def for_engine(cls, config, tokenizer, max_model_len: int, vocab_size: int, max_prompt_tokens: int, mm=None,
                   pooling: dict | None = None, hf_config=None) -> "InputProcessor":
        """The input processor of an engine (the sync or the async one) with these facts, under its config."""
        return cls(tokenizer, max_model_len, vocab_size, config.model.max_logprobs, mm=mm,
                   max_num_batched_tokens=config.scheduler.max_num_batched_tokens, pooling=pooling,
                   max_prompt_tokens=max_prompt_tokens, images_refused=lambda: images_refusal(config, hf_config),
                   positions=model_position_scheme(config, hf_config))

    def tokenize(self, prompt: str, add_special_tokens: bool = True, truncate_prompt_tokens: int | None = None
                 ) -> list[int]:
        """`truncate_prompt_tokens`: the text's last k tokens, its special tokens ([CLS], [SEP], a BOS) kept."""
        if self.tokenizer is None:
            raise InvalidRequest("this model has no tokenizer (random weights from a config.json alone): send "
                                 "token ids", param="prompt")
        ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        if truncate_prompt_tokens is None:
            return ids
        if add_special_tokens and self._specials is None:  # asked once (a race computes the same twice)
            self._specials = special_token_span(self.tokenizer)
        return truncate_prompt(ids, truncate_prompt_tokens, self.max_model_len,
                               specials=self._specials if add_special_tokens else (0, 0))

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word's token ids as it would start the text and, where they differ, as it would follow a
        space (a word mid-text usually tokenizes with its leading space)."""
        check_bad_words(words)  # the count first: at most MAX_BAD_WORDS words are tokenized
        seen: dict[tuple[int, ...], None] = {}  # in order, without repeats (a set lookup, not a list scan)
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenize(text, add_special_tokens=False)
                if ids:
                    seen.setdefault(tuple(ids), None)
        return [list(ids) for ids in seen]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None, template_kwargs: dict | None = None,
                            tools: list[dict] | None = None, continue_final_message: bool = False) -> str:
        """``template_kwargs``: extra template variables (chat_template_kwargs); they may not repeat our arguments.
        ``tools``: the request's tool definitions, handed to the template as ``tools``. ``continue_final_message``:
        the text ends inside the final message (an assistant prefill the model continues), not after its end."""
        kw = template_kwargs or {}
        template = chat_template or self.chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise InvalidRequest("this model has no chat template; use the completions API or start the server "
                                 "with --chat-template", param="messages")
        clash = sorted(set(kw) & RESERVED_TEMPLATE_ARGS)
        if clash:
            raise InvalidRequest(f"chat_template_kwargs may not set {clash}: they are request fields of their own",
                                 param="chat_template_kwargs")
        try:
            text = self.tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=continue_final_message,
                                                      **({"tools": tools} if tools else {}), **kw)
        except Exception as e:  # template errors are the caller's input problem
            import jinja2  # the template's own errors (raise_exception) are for the client; nothing else is

            why = f"{type(e).__name__}: {e}" if isinstance(e, jinja2.TemplateError) else type(e).__name__
            raise InvalidRequest(f"chat template failed: {why}", param="messages") from e
        if not isinstance(text, str):
            raise InvalidRequest("the chat template did not render text", param="messages")
        return text

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, chat_template: str | None = None,
                    template_kwargs: dict | None = None, tools: list[dict] | None = None,
                    continue_final_message: bool = False) -> str | dict:
        """Messages (content a string or parts: {"type": "text", "text"} / {"type": "image", "image": PIL image} /
        {"type": "video", "video": frames}) -> the chat template's text, or with images or videos a prompt dict
        whose text places one image (video) token per image (video) (the processor expands them)."""
        media: dict[str, list] = {"image": [], "video": []}
        conv = []
        for m in messages:
            content = m.get("content")
            if isinstance(content, list):
                found = [p for p in content if p.get("type") in media]
                for p in found:
                    media[p["type"]].append(p[p["type"]])
                text = [{"type": "text", "text": p.get("text") or ""} for p in content if p.get("type") == "text"]
                content = ([{"type": p["type"]} if p.get("type") in media else {"type": "text", "text": p["text"]}
                            for p in content] if found else "".join(t["text"] for t in text))
            conv.append({**m, "content": content if content is not None else ""})
        images, videos = media["image"], media["video"]
        if videos and (self.mm is None or not self.mm.takes_videos):
            name = self.mm.model_name if self.mm is not None else "this model"
            raise InvalidRequest(f"{name} does not take videos (video inputs are served for Qwen2.5-VL, Qwen3-VL "
                                 f"and Qwen3.5)", param="messages")
        if (images or videos) and self.mm is None:
            raise InvalidRequest(self.images_refused(), param="messages")
        text = self.apply_chat_template(conv, add_generation_prompt, chat_template, template_kwargs, tools,
                                        continue_final_message)
        if not images and not videos:
            return text
        for kind, items, token in (("image", images, self.mm.image_token), ("video", videos, self.mm.video_token)):
            if items and text.count(token) != len(items):
                raise InvalidRequest(f"the chat template placed {text.count(token)} {kind} tokens for "
                                     f"{len(items)} {kind}s", param="messages")
        data = {k: v for k, v in media.items() if v}
        # the template already holds the special tokens
        return {"prompt": text, "multi_modal_data": data, "add_special_tokens": False}

    def process_images(self, prompt: str | list[int] | dict | ProcessedPrompt
                       ) -> str | list[int] | dict | ProcessedPrompt:
        """Run the image processor on a prompt dict with images -> ProcessedPrompt (on the calling thread; the
        server calls this on a render thread); any other prompt comes back as it is."""
        if not isinstance(prompt, dict):
            return prompt
        add_special_tokens = prompt.get("add_special_tokens", True)
        text, images = split_prompt(prompt)
        videos = prompt_videos(prompt)
        if not images and not videos:
            return prompt
        if self.mm is None:
            raise InvalidRequest(self.images_refused(), param="multi_modal_data")
        if not isinstance(text, str):
            raise InvalidRequest("images need a text prompt (the processor places their tokens)", param="prompt")
        ids, extras = self.mm.process(text, images, add_special_tokens, videos=videos)
        if self.max_num_batched_tokens:  # the engine's rule, checked here too to answer 400 before sending
            extras.check_step_budget(self.max_num_batched_tokens)
        return ProcessedPrompt(ids, extras, text)

    def process(self, request_id: str, prompt: str | list[int] | dict | ProcessedPrompt, params: SamplingParams,
                priority: int = 0, arrival_time: float | None = None, lora_id: int = 0,
                pooling: PoolingParams | None = None, group_id: str = "") -> tuple[list[int], list[EngineCoreRequest]]:
        """`pooling`: a pooling request (embedding, class scores; its params are pooling_sampling()). `group_id`:
        the API request these sequences belong to, shared with its other prompts ("": this request's id)."""
        check_request_kind(self.pooling, pooling)
        params.validate(self.vocab_size, self.max_logprobs)
        if params.bad_words and params.bad_words_token_ids is None:  # the server tokenized them off the loop
            params = params.clone(bad_words_token_ids=self.bad_words_token_ids(params.bad_words))
            params.validate(self.vocab_size, self.max_logprobs)  # the words' ids are in the model's vocabulary
        prompt = self.process_images(prompt)
        extras = NO_EXTRAS
        if isinstance(prompt, ProcessedPrompt):
            ids, extras = prompt.token_ids, prompt.extras
            prompt = prompt.text or ""  # the processor's ids: not re-checked as client token ids below
        else:
            add_special_tokens = prompt.get("add_special_tokens", True) if isinstance(prompt, dict) else True
            prompt, _ = split_prompt(prompt)
            if isinstance(prompt, str):
                ids = self.tokenize(prompt, add_special_tokens, params.truncate_prompt_tokens)
            else:
                ids = list(prompt)
                if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in ids):
                    raise InvalidRequest(f"prompt token ids must be integers in [0, {self.vocab_size})",
                                         param="prompt")
        if params.truncate_prompt_tokens is not None:
            ids = truncate_prompt(ids, params.truncate_prompt_tokens, self.max_model_len, bool(extras.mm_features))
        if not ids:
            raise InvalidRequest("the prompt is empty", param="prompt")
        if self.mm is not None and not extras.mm_features and self.mm.image_token_id in ids:
            raise InvalidRequest(f"the prompt holds image placeholder tokens ({self.mm.image_token!r}) but no image",
                                 param="prompt")
        room = self.max_model_len - len(ids)
        if room < 1:
            raise InvalidRequest(f"the prompt has {len(ids)} tokens; this model's context is {self.max_model_len} "
                                 f"tokens, leaving no room to generate", param="prompt", code="context_length_exceeded")
        if not isinstance(prompt, str) and any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in ids):
            raise InvalidRequest(f"prompt token ids must be integers in [0, {self.vocab_size})", param="prompt")
        if params.max_tokens is not None and params.max_tokens > room:
            raise InvalidRequest(f"max_tokens ({params.max_tokens}) + prompt ({len(ids)} tokens) exceeds the context "
                                 f"length {self.max_model_len}", param="max_tokens", code="context_length_exceeded")
        max_tokens = params.max_tokens if params.max_tokens is not None else min(room, self.default_max_tokens or room)
        if lora_id:
            extras = msgspec.structs.replace(extras, lora_id=lora_id)
        if pooling is not None:
            extras = msgspec.structs.replace(extras, pooling=pooling)
            if self.pooling.get("encoder_only"):  # every token attends to the whole prompt: one step computes it
                extras = msgspec.structs.replace(extras, bidirectional_len=len(ids))
                if self.max_num_batched_tokens:  # the engine's rule, checked here to answer 400 before sending
                    extras.check_step_budget(self.max_num_batched_tokens)
        if self.max_prompt_tokens is not None:
            check_fits_kv_cache(len(ids), self.max_prompt_tokens)
        positions = self.positions.prompt_positions(ids, extras.mm_features)
        if positions is not None:
            extras = msgspec.structs.replace(extras, positions=positions)
        arrival = arrival_time or time.monotonic()
        reqs = []
        for i in range(params.n):
            p = params if params.n == 1 else params.clone(n=1, seed=None if params.seed is None else params.seed + i)
            reqs.append(EngineCoreRequest(child_id(request_id, i, params.n), ids, p, max_tokens,
                                          arrival, priority, extras, group_id or request_id))
        return ids, reqs


@dataclass
class _Child:
    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer | None
    out: CompletionOutput
    finished: bool = False


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: dict[str, _Child]
    stream: bool
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    pooled: list[float] | None = None

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.children.values())


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestState] = {}
        self.child_to_parent: dict[str, str] = {}
        self.progress: list[tuple[str, int]] = []  # set by process(): (request id, tokens gained) this step

    def add_request(self, request_id: str, prompt, prompt_ids: list[int], params: SamplingParams,
                    core_requests: list[EngineCoreRequest], stream: bool = False) -> None:
        """`prompt`: as the caller gave it (its text, if it has one, is what the outputs show)."""
        children = {}
        for i, r in enumerate(core_requests):
            p = r.sampling_params
            detok = (IncrementalDetokenizer(self.tokenizer, prompt_ids, p.stop, p.include_stop_str_in_output,
                                            p.skip_special_tokens) if p.detokenize and self.tokenizer else None)
            out = CompletionOutput(i, logprobs=[] if p.logprobs is not None else None, cumulative_logprob=None)
            children[r.request_id] = _Child(i, p, detok, out)
            self.child_to_parent[r.request_id] = request_id
        self.requests[request_id] = _RequestState(request_id, display_prompt(prompt), prompt_ids, children, stream,
                                                  [None] if params.prompt_logprobs is not None else None)

    def child_ids(self, request_id: str) -> list[str]:
        st = self.requests.get(request_id)
        return list(st.children) if st else []

    def abort(self, request_id: str) -> list[str]:
        st = self.requests.pop(request_id, None)
        if st is None:
            return []
        for cid in st.children:
            self.child_to_parent.pop(cid, None)
        return list(st.children)

    def finish(self, request_id: str, finish_reason: str, stop_reason: str | None) -> RequestOutput | None:
        """End a request here (e.g. its timeout): unfinished samples get ``finish_reason``; returns the last output."""
        st = self.requests.get(request_id)
        if st is None:
            return None
        for c in st.children.values():
            if not c.finished:
                c.finished = True
                c.out.finish_reason, c.out.stop_reason = finish_reason, stop_reason
                if c.detok is not None:
                    c.out.text = c.detok.text
                    c.out.text_delta += c.detok.take_delta(True)
        out = self._snapshot(st)
        self.abort(request_id)
        return out

    def _logprob_dict(self, entry, token: int) -> dict[int, Logprob]:
        lp, rank, top = entry
        d = {int(t): Logprob(float(v), i + 1) for i, (t, v) in enumerate(top)}
        d[token] = Logprob(float(lp), int(rank))
        if self.tokenizer is not None:
            for t, v in d.items():
                v.decoded_token = self.tokenizer.decode([t])
        return d

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns (RequestOutputs to deliver, child ids the core must stop because a stop string matched). A
        streamed request gets an output at every step that moved it; any other only its final one, so a request
        of many sequences costs a step what its new tokens cost. `progress` then holds, for every request this
        step moved, its id and how many tokens it gained (the metrics' per-step view of every request)."""
        touched: dict[str, _RequestState] = {}
        gained: dict[str, int] = {}
        to_stop: list[str] = []
        for o in outputs:
            parent = self.child_to_parent.get(o.request_id)
            st = self.requests.get(parent) if parent else None
            if st is None:
                continue  # aborted meanwhile
            child = st.children[o.request_id]
            if child.finished:
                continue
            touched[parent] = st
            if st.first_token_time is None and o.new_token_ids:
                st.first_token_time = time.monotonic()
            st.num_cached_tokens = max(st.num_cached_tokens, o.num_cached_tokens)
            if o.pooled is not None:
                st.pooled = o.pooled
            if o.prompt_logprobs and st.prompt_logprobs is not None and child.index == 0:  # same for every sample
                for t, lp, rank, top in o.prompt_logprobs:
                    st.prompt_logprobs.append(self._logprob_dict((lp, rank, top), int(t)))
            out = child.out
            before = len(out.token_ids)
            for k, tok in enumerate(o.new_token_ids):
                out.token_ids.append(tok)
                out.token_ids_delta.append(tok)
                if o.new_logprobs is not None and out.logprobs is not None:
                    d = self._logprob_dict(o.new_logprobs[k], tok)
                    out.logprobs.append(d)
                    out.logprobs_delta = (out.logprobs_delta or []) + [d]
                    out.cumulative_logprob = (out.cumulative_logprob or 0.0) + d[tok].logprob
                if (child.detok is not None and o.finish_reason == "stop" and k == len(o.new_token_ids) - 1
                        and not child.detok.include_stop):
                    break  # the EOS or stop token that ended it: not text (as vLLM), even with special tokens kept
                if child.detok is not None and child.detok.add_token(tok) is not None:
                    out.finish_reason, out.stop_reason = "stop", child.detok.stopped_by
                    to_stop.append(o.request_id)
                    break
            gained[parent] = gained.get(parent, 0) + len(out.token_ids) - before
            if out.finish_reason is None and o.finish_reason is not None:
                out.finish_reason, out.stop_reason = o.finish_reason, o.stop_reason
            child.finished = out.finish_reason is not None
            if child.detok is not None:
                out.text = child.detok.text
                out.text_delta += child.detok.take_delta(child.finished)
        self.progress = list(gained.items())
        results = []
        for rid, st in touched.items():
            if not st.stream and not st.finished:
                continue
            results.append(self._snapshot(st))
            if st.finished:
                self.abort(rid)
        return results, to_stop

    def _snapshot(self, st: _RequestState) -> RequestOutput:
        outs = []
        for c in st.children.values():
            o = c.out
            outs.append(CompletionOutput(o.index, o.text, list(o.token_ids), None if o.logprobs is None else list(o.logprobs),
                                         o.cumulative_logprob, o.finish_reason, o.stop_reason, o.text_delta,
                                         o.token_ids_delta, o.logprobs_delta))
            o.text_delta, o.token_ids_delta, o.logprobs_delta = "", [], None
        return RequestOutput(st.request_id, st.prompt, st.prompt_token_ids, outs, st.finished, st.prompt_logprobs,
                             st.num_cached_tokens, st.pooled)
