"""Sampling parameters, matching the OpenAI / vLLM parameter set. `validate()` names the bad field."""
from __future__ import annotations

import json as _json
import math
from dataclasses import dataclass, field, fields, replace

from kestrel.errors import InvalidRequest

_GREEDY_EPS = 1e-5
MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
# Size limits of the request parameters that grow with the request (docs/serving.md "Request size limits"): each
# is checked before any per-item work, so an oversized list costs one len() and a 400 naming the field.
MAX_BAD_WORDS = 1024  # bad_words: words (each tokenized twice, off the event loop)
MAX_BAD_WORD_CHARS = 64 * 1024  # bad_words: characters of all words together
MAX_LOGIT_BIAS = 1024  # logit_bias: entries (OpenAI's own limit is lower)
# allowed_token_ids: at most the vocabulary size (de-duplicated); this where the vocabulary is not known
MAX_ALLOWED_TOKEN_IDS = 1 << 20


@dataclass
class StructuredOutputsParams:
    """Constrain the output (vLLM's StructuredOutputsParams): exactly one of a JSON schema (a dict or its JSON
    text), a regular expression, a list of choices, an EBNF grammar, or any JSON object."""
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    def __post_init__(self):
        if isinstance(self.json, dict):  # one canonical text: the compile cache key
            self.json = _json.dumps(self.json)

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as one string (with `kind`, the grammar cache key)."""
        v = getattr(self, self.kind)
        return _json.dumps(v) if self.kind == "choice" else ("" if self.kind == "json_object" else v)

    def validate(self, param: str = "structured_outputs", parse: bool = True) -> "StructuredOutputsParams":
        """``parse``: also have xgrammar parse it (seconds for a hostile schema); the server passes False and
        parses on a thread with a time budget (kestrel/server/grammar_check.py)."""
        def bad(field_, msg):
            raise InvalidRequest(f"{param}{field_} {msg}", param=param)

        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            bad("", f"must set exactly one of {', '.join(self.KINDS)}; got {', '.join(given) or 'none'}")
        if self.json is not None:
            try:
                schema = _json.loads(self.json) if isinstance(self.json, str) else None
            except ValueError as e:
                bad(".json", f"is not valid JSON: {e}")
            if not isinstance(schema, (dict, bool)):
                bad(".json", "must be a JSON schema (an object)")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            bad(".regex", "must be a non-empty string")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            bad(".grammar", "must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or any(not isinstance(c, str) or not c for c in self.choice)):
            bad(".choice", "must be a non-empty list of non-empty strings")
        from kestrel.core.grammar import check_grammar, check_limits  # xgrammar parses it: a 400, not a crash

        (check_grammar if parse else check_limits)(self.kind, self.spec, param)
        return self


def check_bad_words(words) -> None:
    """bad_words' shape and size (MAX_BAD_WORDS, MAX_BAD_WORD_CHARS): the count before any per-word work."""
    if words is None:
        return
    if not isinstance(words, list):
        raise InvalidRequest("bad_words must be a list of non-empty strings", param="bad_words")
    if len(words) > MAX_BAD_WORDS:
        raise InvalidRequest(f"bad_words has {len(words)} words; at most {MAX_BAD_WORDS} are allowed",
                             param="bad_words")
    if any(not isinstance(w, str) or not w.strip() for w in words):
        raise InvalidRequest("bad_words must be a list of non-empty strings", param="bad_words")
    chars = sum(len(w) for w in words)
    if chars > MAX_BAD_WORD_CHARS:
        raise InvalidRequest(f"bad_words has {chars} characters in all; at most {MAX_BAD_WORD_CHARS} are allowed",
                             param="bad_words")


def _token_ids_ok(ids, vocab_size: int | None) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < (vocab_size or 2**63) for t in ids)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs of each sampled token (the sampled one is always included)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # logit changes (the runner's LogitsBias add-on): token id -> added to its logit; only these tokens may be
    # sampled; words never generated (a word's last token is banned where the output ends with the rest of it)
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # bad_words tokenized by the frontend (each word with and without a leading space), what the runner reads
    bad_words_token_ids: list[list[int]] | None = None
    # keep only the last k prompt tokens (-1: the context length; kestrel/frontend/truncation.py), as vLLM's
    truncate_prompt_tokens: int | None = None

    def __post_init__(self):
        if isinstance(self.structured_outputs, dict):
            known = {f.name for f in fields(StructuredOutputsParams)}
            unknown = set(self.structured_outputs) - known
            if unknown:
                raise InvalidRequest(f"structured_outputs has unknown fields {sorted(unknown)}; known: "
                                     f"{sorted(known)}", param="structured_outputs")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]

    @property
    def changes_logits(self) -> bool:
        """Does the request bias or ban tokens (the runner's LogitsBias add-on)?"""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids)

    @property
    def bans_after_prefix(self) -> bool:
        """A multi-token bad word: its ban depends on the previous output tokens (read on the host)."""
        return any(len(w) > 1 for w in self.bad_words_token_ids or ())

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def clone(self, **changes) -> "SamplingParams":
        return replace(self, **changes)

    def validate(self, vocab_size: int | None = None, max_logprobs: int = MAX_LOGPROBS) -> "SamplingParams":
        def bad(param, msg):
            raise InvalidRequest(f"{param} {msg}", param=param)

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                bad(name, f"must be a finite number, got {getattr(self, name)}")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", f"must be at least 1, got {self.n}")
        if self.n > 128:
            bad("n", f"must be at most 128, got {self.n}")
        if self.temperature < 0:
            bad("temperature", f"must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", f"must be 0 or -1 (off) or a positive integer, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", f"must be positive, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            bad("min_tokens", f"must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad("stop", f"has {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "strings must be non-empty")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= max_logprobs:
                bad(name, f"must be in [0, {max_logprobs}] (--max-logprobs), got {v}")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            bad("stop_token_ids", f"must be token ids in [0, {vocab_size})")
        self._validate_logit_changes(vocab_size, bad)
        k = self.truncate_prompt_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or (k < 1 and k != -1)):
            bad("truncate_prompt_tokens", f"must be a positive integer, or -1 for the context length; got {k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**63):
            bad("seed", "must be a 64-bit integer")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                bad("structured_outputs", "must be a StructuredOutputsParams")
            self.structured_outputs.validate()
        return self

    def _validate_logit_changes(self, vocab_size: int | None, bad) -> None:
        vocab = f"in [0, {vocab_size})" if vocab_size is not None else "non-negative"
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad("logit_bias", "must map token ids to numbers")
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                bad("logit_bias", f"has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS} are allowed")
            if not _token_ids_ok(self.logit_bias, vocab_size):
                wrong = [t for t in self.logit_bias if not _token_ids_ok([t], vocab_size)]
                bad("logit_bias", f"has token ids outside the vocabulary: {wrong[:8]} (token ids are {vocab})")
            if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                   for v in self.logit_bias.values()):
                bad("logit_bias", "values must be finite numbers")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                bad("allowed_token_ids", "must be a non-empty list of token ids")
            limit = vocab_size or MAX_ALLOWED_TOKEN_IDS
            if len(self.allowed_token_ids) > limit:  # one len() before any per-id work
                bad("allowed_token_ids", f"has {len(self.allowed_token_ids)} ids; at most {limit} (the vocabulary "
                                         f"size) are allowed")
            if not _token_ids_ok(self.allowed_token_ids, vocab_size):
                bad("allowed_token_ids", f"must be token ids {vocab}")
            unique = list(dict.fromkeys(self.allowed_token_ids))  # de-duplicated, in order
            if len(unique) != len(self.allowed_token_ids):
                self.allowed_token_ids = unique
        check_bad_words(self.bad_words)
        if self.bad_words_token_ids is not None and (
                not isinstance(self.bad_words_token_ids, list)
                or any(not isinstance(w, list) or not w or not _token_ids_ok(w, vocab_size)
                       for w in self.bad_words_token_ids)):
            bad("bad_words", f"tokenize to ids outside the model's vocabulary (token ids are {vocab})")
