"""A request as the engine core sees it: token ids, sampling parameters and progress."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import hashlib

from kestrel.core.extras import NO_EXTRAS, RequestExtras
from kestrel.core.multimodal import block_extra
from kestrel.core.step import PLACEHOLDER, TokenSequence  # noqa: F401  (PLACEHOLDER re-exported)
from kestrel.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Request(TokenSequence):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    max_tokens: int = 16  # resolved: never None here
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_at: float = 0.0  # when it was first scheduled (0: not yet); the frontend's queue-time metrics
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens served by the prefix cache on first schedule (-1: not yet)
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    block_hashes: list = field(default_factory=list)  # hash chain of this request's full blocks
    extras: RequestExtras = NO_EXTRAS  # per-request features, passed whole to the runner (kestrel/core/extras.py)
    grammar: object = None  # structured outputs (engine-side only): a compile future, then its RequestGrammar
    num_sent_blocks: list[int] | None = None  # per KV group, block ids the model runner already has
    group_id: str = ""  # the API request it belongs to ("": its own); see Scheduler, "fair share"
    _prefix_digest: bytes | None = None

    @property
    def group(self) -> str:
        return self.group_id or self.request_id

    @property
    def lora_id(self) -> int:
        """The request's adapter (0: none): the scheduler's LoRA-slot rule and remove_lora read it."""
        return self.extras.lora_id

    def block_extra(self, start: int, end: int) -> bytes:
        """What the KV of tokens [start, end) depends on beyond the tokens and the earlier blocks: the extras'
        salt (cache salt, adapter, images overlapping it) and for blocks inside a bidirectional prefix the whole
        prefix (its K/V saw every prefix token)."""
        x = self.extras
        extra = x.block_salt(start, end)
        if start < x.bidirectional_len:
            if self._prefix_digest is None:
                h = hashlib.blake2b(repr(self.prompt_token_ids[:x.bidirectional_len]).encode(), digest_size=16)
                h.update(block_extra(x.mm_features, 0, x.bidirectional_len))
                self._prefix_digest = h.digest()
            extra += self._prefix_digest
        return extra

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def in_prefill(self) -> bool:
        """True while tokens already known (prompt, or prompt + outputs after a preemption) are uncomputed."""
        return self.num_computed_tokens < self.num_tokens - 1
