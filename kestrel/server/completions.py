"""POST /v1/completions (legacy OpenAI completions, with vLLM extras)."""
from __future__ import annotations

import time
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kestrel.frontend.outputs import Logprob, RequestOutput
from kestrel.server.common import (ServerState, beam_searches, client_of, final_outputs, json_logprob, merge,
                                   prompt_logprobs_json, request_ids, sse_chunk, stream_error, unless_disconnected,
                                   usage_json)
from kestrel.server.openai_protocol import CompletionRequest


class LegacyLogprobs:
    """Builds the OpenAI legacy logprobs object (tokens, token_logprobs, top_logprobs, text_offset)."""

    def __init__(self, num: int, offset: int = 0):
        self.num = num
        self.offset = offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict | None] = []
        self.text_offset: list[int] = []

    def add(self, token: int, entry: dict[int, Logprob] | None, tokenizer) -> None:
        if entry is None or token not in entry:
            text = tokenizer.decode([token])
            self.tokens.append(text)
            self.token_logprobs.append(None)
            self.top_logprobs.append(None)
        else:
            text = entry[token].decoded_token or ""
            self.tokens.append(text)
            self.token_logprobs.append(json_logprob(entry[token].logprob))
            top = sorted((lp for lp in entry.items() if lp[1].rank <= self.num or lp[0] == token),
                         key=lambda kv: kv[1].rank)
            d: dict[str, float] = {}
            for _, lp in top:  # several ids can decode to the same text (e.g. U+FFFD): keep the best-ranked
                d.setdefault(lp.decoded_token or "", json_logprob(lp.logprob))
            self.top_logprobs.append(d)
        self.text_offset.append(self.offset)
        self.offset += len(text)

    def take(self) -> dict:
        d = {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
             "text_offset": self.text_offset}
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return d


def _usage(state: ServerState, outs: list[RequestOutput]) -> dict:
    p = sum(len(o.prompt_token_ids) for o in outs)
    c = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return usage_json(state, p, c, sum(o.num_cached_tokens for o in outs))


async def create_completion(state: ServerState, req: CompletionRequest, raw: Request):
    lora = state.check_model(req.model)
    engine = state.engine
    tok = engine.tokenizer
    params = req.sampling_params(state.sampling_defaults)
    beam = req.beam_search_params(req.max_tokens, params)
    await state.grammar.check(params.structured_outputs, req.constraint_param, client_of(raw))
    params = await engine.tokenize_bad_words(params)  # on a render thread
    prompts = req.prompts()
    rid, public_id = request_ids("cmpl", req.request_id, raw)

    def tokenize_all() -> tuple[list[list[int]], list[str]]:  # on a render thread, off the event loop
        ids = [engine.input_processor.tokenize(p) if isinstance(p, str) else p for p in prompts]
        return ids, [p if isinstance(p, str) else (tok.decode(p) if req.echo else "") for p in prompts]

    prompt_ids, prompt_texts = await engine.run_tokenizer(tokenize_all)
    window = engine.admission_window()  # the prompts' sequences share it: --max-seqs-per-request
    gens = (beam_searches(state, beam, prompt_ids, rid, lora, req.logprobs is not None, req) if beam else
            [engine.generate(ids, params, f"{rid}-{i}", req.priority, timeout=state.timeout(req), lora_request=lora,
                             window=window, stream=req.stream) for i, ids in enumerate(prompt_ids)])
    created = int(time.time())
    n = req.n
    if req.stream:
        return StreamingResponse(_stream(state, req, public_id, created, gens, prompt_texts),
                                 media_type="text/event-stream")
    outs = await unless_disconnected(raw, final_outputs(gens))
    choices = []
    for i, out in enumerate(outs):
        samples = list(out.outputs)
        if len(samples) > n:  # best_of: keep the n with the highest cumulative logprob
            samples.sort(key=lambda c: c.cumulative_logprob if c.cumulative_logprob is not None else float("-inf"),
                         reverse=True)
            samples = samples[:n]
        for k, c in enumerate(samples):
            text = (prompt_texts[i] if req.echo else "") + c.text
            lp = None
            if req.logprobs is not None:
                b = LegacyLogprobs(req.logprobs)
                if req.echo:
                    plps = out.prompt_logprobs or []
                    for pos, t in enumerate(out.prompt_token_ids):
                        b.add(t, plps[pos] if pos < len(plps) else None, tok)
                    b.offset = len(prompt_texts[i])
                for t, entry in zip(c.token_ids, c.logprobs or []):
                    b.add(t, entry, tok)
                lp = b.take()
            choice = {"index": i * n + k, "text": text, "logprobs": lp, "finish_reason": c.finish_reason,
                      "stop_reason": c.stop_reason}
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(out)
            choices.append(choice)
    return JSONResponse({"id": public_id, "object": "text_completion", "created": created, "model": state.model_name,
                         "choices": choices, "usage": _usage(state, outs)})


async def _stream(state: ServerState, req: CompletionRequest, rid: str, created: int, gens,
                  prompt_texts: list[str]) -> AsyncIterator[str]:
    n = req.n
    tok = state.engine.tokenizer
    builders: dict[tuple[int, int], LegacyLogprobs] = {}
    started: set[tuple[int, int]] = set()
    done: set[tuple[int, int]] = set()
    finals: dict[int, RequestOutput] = {}

    def chunk(choices, usage=None):
        return sse_chunk(rid, "text_completion", created, state.model_name, choices, usage)

    try:
        async for i, out in merge(gens):
            for c in out.outputs:
                key = (i, c.index)
                if key in done:
                    continue
                text = c.text_delta
                if key not in started:
                    started.add(key)
                    if req.echo:
                        text = prompt_texts[i] + text
                if not text and not c.token_ids_delta and c.finish_reason is None:
                    continue
                lp = None
                if req.logprobs is not None:
                    b = builders.setdefault(key, LegacyLogprobs(req.logprobs, len(prompt_texts[i]) if req.echo else 0))
                    for t, entry in zip(c.token_ids_delta, c.logprobs_delta or [None] * len(c.token_ids_delta)):
                        b.add(t, entry, tok)
                    lp = b.take()
                if c.finish_reason is not None:
                    done.add(key)
                yield chunk([{"index": i * n + c.index, "text": text, "logprobs": lp,
                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}])
            if out.finished:
                finals[i] = out
        if req.stream_options and req.stream_options.include_usage:
            yield chunk([], _usage(state, list(finals.values())))
        yield "data: [DONE]\n\n"
    except Exception as e:
        yield stream_error(e)
