"""Beam search as vLLM serves it (LLM.beam_search, `use_beam_search`): over the ordinary engine, one token at a
time. Each step asks the engine for one token of every live beam (prompt + the beam's tokens; the prefix cache
keeps the shared part) with the top 2 x beam_width logprobs; every (beam, token) candidate scores by its
cumulative logprob over its length (prompt included) to the power length_penalty; a candidate ending in EOS is
complete (unless ignore_eos), the best beam_width others go on. After max_tokens steps, or once no beam is left,
the best beam_width of the complete and live beams are the result. The search is host-side bookkeeping
(`BeamSearch`); the offline LLM and the server drive it with their own engines."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from kestrel.core.sampling_params import SamplingParams
from kestrel.errors import InvalidRequest
from kestrel.frontend.outputs import CompletionOutput, Logprob, RequestOutput


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def validate(self, max_logprobs: int) -> "BeamSearchParams":
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= max_logprobs // 2:
            raise InvalidRequest(f"beam width (n) must be in [1, {max_logprobs // 2}] (each step reads the top "
                                 f"2 x width logprobs; --max-logprobs {max_logprobs}), got {self.beam_width}",
                                 param="n")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be at least 1, got {self.max_tokens}", param="max_tokens")
        return self

    def step_params(self) -> SamplingParams:
        """One token of one beam, with the logprobs the search ranks."""
        return SamplingParams(max_tokens=1, temperature=self.temperature, logprobs=2 * self.beam_width,
                              ignore_eos=True, detokenize=False)


@dataclass
class BeamSequence:
    tokens: list[int]  # the prompt's and the generated ones (as vLLM's BeamSearchSequence)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)  # per generated token
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop": ended with EOS; "length": max_tokens reached


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSequence]


class BeamSearch:
    """One prompt's search: `pending()` lists the token sequences whose next-token logprobs are needed,
    `advance()` takes them (in that order), `result()` ranks the beams once `done`."""

    def __init__(self, prompt_ids: list[int], params: BeamSearchParams, eos_token_id: int | None):
        self.params, self.eos = params, eos_token_id
        self.prompt_len = len(prompt_ids)
        self.beams = [BeamSequence(list(prompt_ids))]
        self.completed: list[BeamSequence] = []
        self.steps = 0

    @property
    def done(self) -> bool:
        return self.steps >= self.params.max_tokens or not self.beams

    def pending(self) -> list[list[int]]:
        return [] if self.done else [b.tokens for b in self.beams]

    def score(self, beam: BeamSequence) -> float:
        length = len(beam.tokens) - (1 if beam.finish_reason == "stop" else 0)
        return beam.cum_logprob / (length ** self.params.length_penalty)

    def advance(self, next_logprobs: list[dict[int, Logprob]]) -> None:
        """`next_logprobs[i]`: the top next tokens of beam i (pending order) with their logprobs."""
        candidates = []
        for beam, top in zip(self.beams, next_logprobs):
            for token, lp in top.items():
                ends = token == self.eos and not self.params.ignore_eos
                new = BeamSequence(beam.tokens + [token], beam.logprobs + [top], beam.cum_logprob + lp.logprob,
                                   finish_reason="stop" if ends else None)
                (self.completed if ends else candidates).append(new)
        candidates.sort(key=self.score, reverse=True)
        self.beams = candidates[:self.params.beam_width]
        self.steps += 1

    def result(self, tokenizer=None) -> BeamSearchOutput:
        for b in self.beams:
            b.finish_reason = "length"
        best = sorted(self.completed + self.beams, key=self.score, reverse=True)[:self.params.beam_width]
        if tokenizer is not None:
            for b in best:
                b.text = tokenizer.decode(b.tokens)
        return BeamSearchOutput(best)


async def search_async(generate, prompt_ids: list[int], params: BeamSearchParams, eos_token_id: int | None,
                       tokenizer, request_id: str, want_logprobs: bool = False,
                       deadline: float | None = None) -> RequestOutput:
    """One prompt's search over an async engine: `generate(ids, params, request_id)` is AsyncEngine.generate.
    Returns the finished RequestOutput: one CompletionOutput per beam, best first, holding its generated tokens
    only (their text and deltas included, so that a stream sends it as one chunk). `deadline` (time.monotonic()):
    then the step in flight is aborted and the beams so far are the result, those still live ending as a timed-out
    plain request does (finish_reason "abort", stop_reason "timeout")."""
    search, step = BeamSearch(prompt_ids, params, eos_token_id), params.step_params()

    async def next_logprobs(ids: list[int], k: int) -> dict[int, Logprob]:
        last = None
        async for last in generate(ids, step, f"{request_id}-s{search.steps}-b{k}"):
            pass
        return last.outputs[0].logprobs[0]

    loop = asyncio.get_running_loop()
    timed_out = False
    try:
        async with asyncio.timeout_at(None if deadline is None else loop.time() + deadline - time.monotonic()):
            while not search.done:
                search.advance(list(await asyncio.gather(*(next_logprobs(ids, k)
                                                           for k, ids in enumerate(search.pending())))))
    except TimeoutError:
        timed_out = True  # the step's requests were aborted as their streams were cancelled
    live = {id(b) for b in search.beams}
    outputs = []
    for i, beam in enumerate(search.result().sequences):
        new = beam.tokens[len(prompt_ids):]
        text = tokenizer.decode(new, skip_special_tokens=True) if tokenizer is not None else ""
        lps = beam.logprobs if want_logprobs else None
        reason, stop = ("abort", "timeout") if timed_out and id(beam) in live else (beam.finish_reason, None)
        outputs.append(CompletionOutput(i, text, new, lps, beam.cum_logprob, reason, stop, text_delta=text,
                                        token_ids_delta=list(new), logprobs_delta=lps))
    return RequestOutput(request_id, None, list(prompt_ids), outputs, finished=True)
