"""Request schemas of the OpenAI-compatible API (pydantic v2), with vLLM's sampling extras.

Unknown fields are ignored, except the parameters in UNSUPPORTED_PARAMS, which are refused with a 400 naming
them (ignoring them would silently change what the client asked for). A field of the wrong type, a NaN or
infinite number, an integer beyond 64 bits, a string where a boolean belongs ("stream": "yes") or a lone
surrogate in any string is a 400 naming the field."""
from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, StrictInt, model_validator

from kestrel.core.sampling_params import (MAX_LOGIT_BIAS, SamplingParams, StructuredOutputsParams,
                                          check_bad_words)
from kestrel.frontend.beam_search import BeamSearchParams
from kestrel.errors import InvalidRequest

Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
TokenIds = list[StrictInt]  # a JSON true is not a token id
MAX_CLIENT_REQUEST_ID = 256

# Parameters Kestrel does not implement yet -> the values that mean "not used" (accepted and ignored).
# Each entry is removed when its feature lands (structured outputs and tool calling: issue 18).
UNSUPPORTED_PARAMS: dict[str, tuple] = {
    "guided_decoding_backend": (None,), "guided_whitespace_pattern": (None,),
    "functions": (None, []), "function_call": (None, "none"),
    "prompt_embeds": (None,), "lora_request": (None,),
    "suffix": (None, ""), "documents": (None,),
}


def _find_lone_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_find_lone_surrogate(k) or _find_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_find_lone_surrogate(v) for v in value)
    return False


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    # this route's own parameters that are not implemented yet (as UNSUPPORTED_PARAMS: name -> unused values)
    _unsupported_here: ClassVar[dict[str, tuple]] = {}
    # UNSUPPORTED_PARAMS names that this route implements (a rerank body's `documents`)
    _served_here: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _refuse_unusable(cls, data: Any) -> Any:
        """Raised as InvalidRequest (a ValueError): the app's validation handler reports its param."""
        if isinstance(data, dict):
            for name, value in data.items():
                if _find_lone_surrogate(value):
                    raise InvalidRequest(f"{name} contains a lone UTF-16 surrogate; send valid Unicode",
                                         param=str(name))
                unused = (None if name in cls._served_here else UNSUPPORTED_PARAMS.get(name)
                          ) or cls._unsupported_here.get(name)
                if unused is not None and not any(value == u and isinstance(value, bool) == isinstance(u, bool)
                                                   for u in unused):
                    raise InvalidRequest(f"{name} is not supported by this server", param=name)
        return data


class StreamOptions(_Base):
    include_usage: StrictBool = False


class _SamplingRequest(_Base):
    model: str | None = None
    n: Int64 = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: Int64 | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # vLLM extras
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: StrictBool = False
    min_tokens: Int64 = 0
    stop_token_ids: TokenIds | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    priority: Int64 = 0
    prompt_logprobs: Int64 | None = None
    logit_bias: dict[str, float] | None = None  # OpenAI: token id (JSON keys are text) -> bias in [-100, 100]
    allowed_token_ids: TokenIds | None = None
    bad_words: list[str] | None = None
    use_beam_search: StrictBool = False  # n beams (vLLM's beam search); length_penalty ranks them
    length_penalty: float = 1.0
    truncate_prompt_tokens: Int64 | None = None  # keep the prompt's last k tokens (-1: max_model_len)
    request_id: str | None = Field(None, max_length=MAX_CLIENT_REQUEST_ID)
    timeout: float | None = Field(None, gt=0, description="seconds; then the request is aborted (stop_reason "
                                                          "'timeout') and its KV cache freed")

    # structured outputs: OpenAI's response_format, or vLLM's structured_outputs (and its older guided_* fields)
    _constraint_param: str = PrivateAttr("structured_outputs")  # the field the constraint came from
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured(self) -> StructuredOutputsParams | None:
        """The request's output constraint, validated (a bad one is a 400 naming the field it came from)."""
        sources = []
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type", "text") if isinstance(rf, dict) else None
            if kind == "json_object":
                sources.append(("response_format", {"json_object": True}))
            elif kind == "json_schema":
                js = rf.get("json_schema")
                schema = js.get("schema") if isinstance(js, dict) else None
                if not isinstance(schema, dict):
                    raise InvalidRequest("response_format.json_schema.schema must be a JSON schema object",
                                         param="response_format")
                sources.append(("response_format", {"json": schema}))
            elif kind != "text":
                raise InvalidRequest(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                                     param="response_format")
        if self.structured_outputs is not None:
            sources.append(("structured_outputs", self.structured_outputs))
        guided = {k: getattr(self, f"guided_{k}") for k in ("json", "regex", "choice", "grammar")
                  if getattr(self, f"guided_{k}") is not None}
        if guided:
            sources.append((f"guided_{next(iter(guided))}", guided))
        if not sources:
            return None
        if len(sources) > 1:
            raise InvalidRequest(f"give one output constraint, not {' and '.join(n for n, _ in sources)}",
                                 param=sources[1][0])
        param, spec = sources[0]
        self._constraint_param = param
        known = {"json", "regex", "choice", "grammar", "json_object"}
        if not isinstance(spec, dict) or set(spec) - known:
            raise InvalidRequest(f"{param} takes the fields {sorted(known)}", param=param)
        return StructuredOutputsParams(**spec).validate(param, parse=False)  # parsed off the loop: grammar_check.py

    @property
    def constraint_param(self) -> str:
        """The field the output constraint came from (after sampling_params())."""
        return self._constraint_param

    def _sampling(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None,
                  defaults: dict | None = None, structured: StructuredOutputsParams | None = None) -> SamplingParams:
        """``defaults``: sampling defaults of the model's generation_config.json, used where the client is silent;
        ``structured``: the request's output constraint."""
        if max_tokens is not None and max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        if self.stream and self.prompt_logprobs is not None:
            raise InvalidRequest("prompt_logprobs is not available with stream=true", param="prompt_logprobs")
        check_bad_words(self.bad_words)  # sizes before any per-item work (MAX_BAD_WORDS, MAX_LOGIT_BIAS)
        d = {k: v for k, v in (defaults or {}).items() if getattr(self, k, None) is None}

        def pick(name: str, fallback):
            value = getattr(self, name)
            return value if value is not None else d.get(name, fallback)

        return SamplingParams(
            structured_outputs=structured,
            n=self.n, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0), top_k=pick("top_k", 0) or 0,
            min_p=pick("min_p", 0.0), repetition_penalty=pick("repetition_penalty", 1.0),
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty, seed=self.seed,
            max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids or [],
            include_stop_str_in_output=self.include_stop_str_in_output, ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs if self.prompt_logprobs is None else self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens, logit_bias=self._logit_bias(),
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens)

    def beam_search_params(self, max_tokens: int | None, sampling: SamplingParams) -> BeamSearchParams | None:
        """With use_beam_search: the search's parameters (beam width n), from the validated `sampling`."""
        if not self.use_beam_search:
            return None
        clash = next((name for name, on in (("stream", self.stream), ("structured outputs",
                      sampling.structured_outputs is not None), ("prompt_logprobs", self.prompt_logprobs is not None),
                      ("logit changes", sampling.changes_logits or bool(sampling.bad_words)),
                      ("truncate_prompt_tokens", self.truncate_prompt_tokens is not None)) if on), None)
        if clash:
            raise InvalidRequest(f"use_beam_search cannot be combined with {clash}", param="use_beam_search")
        return BeamSearchParams(self.n, max_tokens, self.ignore_eos, sampling.temperature, self.length_penalty,
                                self.include_stop_str_in_output)  # max_tokens None: resolved per prompt

    def _logit_bias(self) -> dict[int, float] | None:
        """Token ids from the JSON keys; biases clamped to [-100, 100] as vLLM does."""
        if not self.logit_bias:
            return None
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequest(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS} are "
                                 f"allowed", param="logit_bias")
        out = {}
        for key, bias in self.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                raise InvalidRequest(f"logit_bias keys must be token ids (integers), got {key!r}",
                                     param="logit_bias") from None
            out[token] = min(max(bias, -100.0), 100.0)
        return out


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: Int64 | None = 16
    best_of: Int64 | None = None
    logprobs: Int64 | None = None
    echo: StrictBool = False

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequest("the prompt is empty", param="prompt")
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)

    def sampling_params(self, defaults: dict | None = None) -> SamplingParams:
        if self.n < 1:
            raise InvalidRequest(f"n must be at least 1, got {self.n}", param="n")
        best_of = self.best_of if self.best_of is not None else self.n
        if best_of < self.n:
            raise InvalidRequest(f"best_of ({best_of}) must be at least n ({self.n})", param="best_of")
        if best_of > self.n and self.stream:
            raise InvalidRequest("best_of > n is not supported with stream=true", param="best_of")
        p = self._sampling(self.max_tokens, self.logprobs, self.logprobs if self.echo and self.logprobs is not None
                           else None, defaults, self.structured())
        if best_of > self.n:  # ranking by cumulative logprob needs the sampled tokens' logprobs
            p = p.clone(n=best_of, logprobs=p.logprobs if p.logprobs is not None else 0)
        return p


class ImageURL(_Base):
    url: str
    detail: str | None = None


class ContentPart(_Base):
    type: str = "text"
    text: str | None = None
    image_url: ImageURL | None = None
    video_url: ImageURL | None = None  # vLLM's {"type": "video_url", "video_url": {"url": ...}}


class AssistantFunctionCall(_Base):
    name: str
    arguments: str | dict = "{}"  # OpenAI sends JSON text


class AssistantToolCall(_Base):
    id: str | None = None
    type: str = "function"
    function: AssistantFunctionCall


class ChatMessage(_Base):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool result
    reasoning_content: str | None = None  # an assistant turn's reasoning (vLLM also reads it as `reasoning`)
    reasoning: str | None = None

    def as_dict(self) -> dict:
        c = self.content
        if isinstance(c, list):
            parts = []
            for part in c:
                if part.type != "text":
                    raise InvalidRequest(f"content part type {part.type!r} is not supported", param="messages")
                parts.append(part.text or "")
            c = "".join(parts)
        d = {"role": self.role, "content": c or ""}
        if self.name:
            d["name"] = self.name
        if self.tool_call_id:
            d["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            d["tool_calls"] = [_template_tool_call(c.model_dump(exclude_none=True)) for c in self.tool_calls]
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:  # Qwen3 / DeepSeek templates read reasoning_content, gpt-oss's `thinking`
            d["reasoning_content"] = d["thinking"] = reasoning
        return d

    def has_non_text_parts(self) -> bool:
        return isinstance(self.content, list) and any(p.type != "text" for p in self.content)

    def as_parts(self) -> dict:
        """The message with its content parts as dicts (image parts included)."""
        d = self.model_dump(exclude_none=True)
        d.setdefault("content", "")
        return d


def _template_tool_call(call: dict) -> dict:
    """An OpenAI tool call as chat templates expect it: the arguments as a dict (OpenAI sends JSON text)."""
    fn = dict(call["function"])
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args)
        except ValueError:
            pass
    return {**call, "function": fn}


class _ChatRendering(_Base):
    """How the messages become the prompt. continue_final_message (with add_generation_prompt false): the prompt
    ends inside the final message, which the model continues (an assistant prefill)."""
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_ending(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequest("continue_final_message and add_generation_prompt cannot both be true (set "
                                 "add_generation_prompt to false to continue the final message)",
                                 param="continue_final_message")
        return self


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


class ChatCompletionRequest(_ChatRendering, _SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    reasoning_effort: str | None = None  # the chat template's reasoning_effort (gpt-oss's "Reasoning: high")
    max_completion_tokens: Int64 | None = None
    logprobs: StrictBool = False
    top_logprobs: Int64 | None = None
    echo: StrictBool = False  # the reply starts with the final message's content where it has the reply's role

    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: StrictBool = True

    @model_validator(mode="after")
    def _effort_to_template(self):
        """reasoning_effort reaches the template among its kwargs (where they do not set it themselves)."""
        if self.reasoning_effort is not None:
            if self.reasoning_effort not in REASONING_EFFORTS:
                raise InvalidRequest(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}",
                                     param="reasoning_effort")
            self.chat_template_kwargs = {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}
        return self

    def sampling_params(self, defaults: dict | None = None,
                        structured: StructuredOutputsParams | None = None) -> SamplingParams:
        """`structured`: the constraint that a required or named tool_choice imposes (chat.py)."""
        if self.n < 1:
            raise InvalidRequest(f"n must be at least 1, got {self.n}", param="n")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs=true", param="top_logprobs")
        own = self.structured()
        if own is not None and structured is not None:
            raise InvalidRequest("a required or named tool_choice cannot be combined with another output "
                                 "constraint", param="tool_choice")
        mt = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling(mt, (self.top_logprobs or 0) if self.logprobs else None, None, defaults, own or structured)

    @property
    def response_role(self) -> str:
        """The reply's role, as vLLM answers: assistant after a generation prompt, else the final message's."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    def echoed(self) -> str:
        """What `echo` puts before the reply: the final message's text if it has the reply's role."""
        last = self.messages[-1]
        return last.as_dict()["content"] if self.echo and last.role == self.response_role else ""


class TokenizeRequest(_ChatRendering):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True


class DetokenizeRequest(_Base):
    model: str | None = None
    tokens: TokenIds


def error_body(message: str, type_: str, param: str | None = None, code: int | str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}

