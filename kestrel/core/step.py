"""What the scheduler sends the model runner each step: deltas, never the engine's live request objects, so the
runner (or, with tensor parallelism, every worker rank) keeps its own batch state from them.

- `new_requests`: requests the runner has not seen (first schedule, or resumed after a preemption, with the
  outputs known so far): tokens, sampling parameters and block ids per KV-cache group.
- `chunks`: every request of this step in batch order (decodes first): how many tokens to compute from where,
  whether the step samples a token for it, and the block ids appended since the last step.
- `finished_ids`: requests finished, aborted or preempted since the last step: the runner drops their state.
- `state_restores` / `state_saves`: state-slot copies (group id, src slot, dst slot) of cache kinds that keep a
  per-request state: a prefix hit's snapshot into the request's slot before the forward, and a slot into a
  snapshot after it (kestrel/engine/kv/managers.py StateSlotManager).
- `kv_connector_meta`: a KV tier's block copies (kestrel/core/kv_connector.py), made before the forward."""
from __future__ import annotations

from dataclasses import dataclass, field

from kestrel.core.extras import NO_EXTRAS, RequestExtras
from kestrel.core.kv_connector import KVConnectorMeta, KVTransferFailures
from kestrel.core.sampling_params import SamplingParams

PLACEHOLDER = -1  # an output token sampled by a step still in flight (pipelined decode)


class TokenSequence:
    """Reads over `prompt_token_ids` + `output_token_ids` (the engine's Request and the runner's RequestState)."""
    prompt_token_ids: list[int]
    output_token_ids: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_at(self, i: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < p else self.output_token_ids[i - p]

    def tokens_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]


@dataclass
class NewRequestData:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # outputs known so far (a request resumed after preemption); no placeholders
    sampling_params: SamplingParams
    min_tokens_stop_ids: list[int]  # eos (unless ignore_eos) + stop ids: masked until min_tokens outputs exist
    block_ids: list[list[int]]  # per KV-cache group
    extras: RequestExtras = NO_EXTRAS  # the request's features, read by the runner's add-ons when it arrives


@dataclass
class ScheduledChunk:
    request_id: str
    num_new_tokens: int
    num_computed_tokens: int  # before this step
    samples: bool  # the step reaches the end of the known tokens, so it samples a new one
    new_block_ids: list[list[int]] | None = None  # per group, appended since the request's last step
    # speculative decoding: the proposed tokens after the last known one, computed in this chunk (its last
    # len(draft_token_ids) tokens) and verified by sampling (kestrel/spec_decode/verify.py)
    draft_token_ids: list[int] = field(default_factory=list)


def logits_positions(chunks: list[ScheduledChunk], query_start_loc, skip=()) -> list[int]:
    """Token indices of a step whose logits are sampled: one row per sampling request (the position after its
    last known token, in batch order), then each request's proposed positions in the same order (the verify rule:
    kestrel/spec_decode/verify.py). Requests in `skip`, which end in a pooler, have none."""
    first, drafted = [], []
    for b, c in enumerate(chunks):
        if not c.samples or c.request_id in skip:
            continue
        end, nd = query_start_loc[b + 1], len(c.draft_token_ids)
        first.append(end - 1 - nd)
        drafted.extend(range(end - nd, end))
    return first + drafted


def accept(first: int, verified: list[int], drafts: list[int]) -> list[int]:
    """The emitted tokens: `first` (y_0), then y_{j+1} = verified[j] for as long as y_j == d_j."""
    out = [first]
    for j, d in enumerate(drafts):
        if out[-1] != d:
            break
        out.append(verified[j])
    return out


@dataclass
class StepInput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    # the batch's rows in the order the runner lays them out: decode rows (one new token) first, then the rest,
    # each in schedule order; decided once by the scheduler, read as is by the runner and the executors
    chunks: list[ScheduledChunk] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)
    state_restores: list[tuple[int, int, int]] = field(default_factory=list)
    state_saves: list[tuple[int, int, int]] = field(default_factory=list)
    kv_connector_meta: KVConnectorMeta | None = None

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)


@dataclass
class RunnerOutput:
    """What a step gives back: per request id, the sampled token (the first one, where drafts were verified),
    its logprobs and this chunk's prompt logprobs."""
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, tuple] = field(default_factory=dict)  # req id -> (logprob, rank, top list)
    prompt_logprobs: dict[str, list] = field(default_factory=dict)  # req id -> entries for this chunk
    failed: dict[str, str] = field(default_factory=dict)  # req id -> why it cannot go on (its adapter is unreadable)
    pooled: dict[str, list[float]] = field(default_factory=dict)  # req id -> its pooled vector (pooling requests)
    # a verify step (speculative decoding): the tokens emitted after `sampled` (accepted drafts, then the target's
    # own token), and their logprobs where asked for
    more_sampled: dict[str, list[int]] = field(default_factory=dict)
    more_logprobs: dict[str, list] = field(default_factory=dict)
    # drafts computed by the runner (speculative_config methods "mtp", "eagle3") for the next step: req id -> (the
    # request's token count they follow, the drafts)
    next_drafts: dict[str, tuple[int, list[int]]] = field(default_factory=dict)
    kv_failures: KVTransferFailures | None = None  # a KV tier's transfers that failed before this step's forward
