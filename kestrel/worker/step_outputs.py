"""The output side of a step: a launched step (`InFlight`), its sampling (the add-ons' before_sample hooks, e.g.
the grammar bitmask, then the Sampler), the copy of its tokens to the host without a sync, their collection into
the batch state, and prompt logprobs chunk by chunk."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kestrel.core.step import PLACEHOLDER, RunnerOutput, ScheduledChunk, accept
from kestrel.structured_output.bitmask import StepBitmask
from kestrel.worker.input_batch import RequestState
from kestrel.worker.sampler import Sampler, SamplingRow, compute_logprobs


class OutputsWithDrafts(Sequence):
    """A request's outputs followed by some of its drafts, without copying the outputs: a draft position's
    sampling row reads its length (min_tokens, the seeded noise's position) and, with penalties, its tokens."""

    __slots__ = ("outputs", "drafts")

    def __init__(self, outputs: list[int], drafts: list[int]):
        self.outputs, self.drafts = outputs, drafts

    def __len__(self) -> int:
        return len(self.outputs) + len(self.drafts)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [*self][i]
        n = len(self.outputs)
        i = i + len(self) if i < 0 else i
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.outputs[i] if i < n else self.drafts[i - n]

    def __iter__(self):
        yield from self.outputs
        yield from self.drafts


@dataclass
class InFlight:
    """A launched step: its sampled tokens on the device, and where they land on the host."""
    out: RunnerOutput
    samplers: list[tuple[str, int]] = field(default_factory=list)  # (request id, index in its outputs)
    tokens: torch.Tensor | None = None
    rows: dict[str, int] = field(default_factory=dict)  # request id -> row of `tokens`
    tokens_host: torch.Tensor | None = None
    event: object = None
    logits: torch.Tensor | None = None  # launched with sample=False: the logits until sample() runs
    sample_pending: bool = False
    states: list = field(default_factory=list)  # the sampling rows' RequestStates (sample() may come after a pop)
    bitmask: StepBitmask | None = None  # structured outputs: the constrained rows' token masks (sample())
    # speculative decoding: request id -> its drafts; their rows follow the inf.rows ones (spec_decode/verify.py)
    drafts: dict[str, list[int]] = field(default_factory=dict)
    draft_logprobs: list = field(default_factory=list)  # per draft row, where logprobs are asked for
    # runner drafts (mtp, eagle3): (the target's hidden states the drafter captured, query_start_loc, chunks)
    target_hidden: tuple | None = None

    @property
    def samples(self) -> bool:
        return self.tokens is not None


class StepOutputs:
    def __init__(self, seed: int, max_rows: int, device: torch.device, before_sample: list):
        """`max_rows`: the most sampled rows of a step; `before_sample`: the add-ons' hooks that change the
        logits first."""
        self.sampler = Sampler(seed)
        self.device, self.before_sample = device, before_sample
        pin = device.type == "cuda"
        self._token_host = [torch.zeros(max_rows, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._token_flip = 0
        self.prompt_logprobs_done: dict[str, int] = {}  # request id -> prompt positions already reported

    @torch.inference_mode()
    def sample(self, inf: InFlight, bitmask: StepBitmask | None = None) -> None:
        logits, inf.logits, inf.sample_pending, inf.bitmask = inf.logits, None, False, bitmask
        for before_sample in self.before_sample:
            before_sample(logits, inf)
        states = inf.states
        rows = [SamplingRow(st.sampling_params, st.prompt_token_ids, st.output_token_ids, st.min_tokens_stop_ids)
                for st in states]
        if inf.drafts:
            rows += self._draft_rows(inf)
        res = self.sampler(logits, rows)
        inf.tokens = res.tokens
        inf.draft_logprobs = res.logprobs[len(states):]
        for rid, st, lp in zip(inf.rows, states, res.logprobs):
            if lp is not None:
                inf.out.logprobs[rid] = lp
            inf.samplers.append((rid, len(st.output_token_ids)))
            st.output_token_ids.append(PLACEHOLDER)
        if self.device.type == "cuda":
            host = self._token_host[self._token_flip][: len(rows)]
            self._token_flip ^= 1
            host.copy_(res.tokens, non_blocking=True)
            inf.tokens_host = host
            inf.event = torch.cuda.Event()
            inf.event.record()

    @staticmethod
    def _draft_rows(inf: InFlight) -> list[SamplingRow]:
        """The sampling rows of the draft positions: the request's row as if the drafts before the position
        were already its outputs (penalties, min_tokens and the seeded noise's output position read them)."""
        rows = []
        for rid, st in zip(inf.rows, inf.states):
            for j in range(1, len(inf.drafts.get(rid, ())) + 1):
                rows.append(SamplingRow(st.sampling_params, st.prompt_token_ids,
                                        OutputsWithDrafts(st.output_token_ids, inf.drafts[rid][:j]),
                                        st.min_tokens_stop_ids))
        return rows

    def collect(self, inf: InFlight, requests: dict[str, RequestState]) -> RunnerOutput:
        if inf.tokens is None:
            return inf.out
        if inf.event is not None:
            inf.event.synchronize()
            tokens = inf.tokens_host.tolist()
        else:
            tokens = inf.tokens.tolist()
        at = len(inf.samplers)  # the first draft row
        for (rid, index), tok in zip(inf.samplers, tokens):
            inf.out.sampled[rid] = tok
            st = requests.get(rid)
            if st is not None and index < len(st.output_token_ids):
                st.output_token_ids[index] = tok
            drafts = inf.drafts.get(rid)
            if drafts:
                more = accept(tok, tokens[at:at + len(drafts)], drafts)[1:]
                inf.out.more_sampled[rid] = more
                if inf.draft_logprobs and inf.draft_logprobs[at - len(inf.samplers)] is not None:
                    first = at - len(inf.samplers)
                    inf.out.more_logprobs[rid] = inf.draft_logprobs[first:first + len(more)]
                if st is not None:
                    st.output_token_ids += more  # a verify step is never pipelined: nothing follows its token
                at += len(drafts)
        return inf.out

    def prompt_logprobs(self, model, c: ScheduledChunk, st: RequestState, hidden: torch.Tensor,
                        out: RunnerOutput) -> None:
        """Logprobs of prompt tokens 1..P-1, each given its prefix; collected chunk by chunk, once."""
        start, n = c.num_computed_tokens, c.num_new_tokens
        done = self.prompt_logprobs_done.get(c.request_id, 0)  # prompt positions (targets) already reported
        first_target = max(start + 1, done + 1)
        last_target = min(start + n, st.num_prompt_tokens - 1)
        if first_target > last_target:
            return
        rows = torch.arange(first_target - 1 - start, last_target - start, device=hidden.device)
        logprobs = model.compute_logits(hidden[rows]).float().log_softmax(dim=-1)
        targets = torch.tensor(st.prompt_token_ids[first_target:last_target + 1], device=hidden.device)
        entries = compute_logprobs(logprobs, targets, st.sampling_params.prompt_logprobs)
        out.prompt_logprobs[c.request_id] = [(int(t), *e) for t, e in zip(targets.tolist(), entries)]
        self.prompt_logprobs_done[c.request_id] = last_target
