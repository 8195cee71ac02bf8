"""How the speculative-decoding benchmarks time a batch and turn it into a table row, for both engines (kestrel's
and vLLM's offline `LLM` take the same prompts, SamplingParams keywords and `generate` call).

ms/token is per request: (generation time - time to first token) / (output tokens - 1), all requests of a batch
running together; tok/s is the batch's output tokens over its generation time."""
from __future__ import annotations

import json
import time


def sync(device: str) -> None:
    if device != "cpu":
        import torch

        torch.cuda.synchronize()


def timed_generate(llm, prompts, n_out, device, reps, params_cls=None, **param_kw):
    """(time to first token, total, token ids per prompt) of generating n_out greedy tokens for every prompt at
    once (best of reps). params_cls: the engine's SamplingParams (kestrel's by default); param_kw: extra keywords
    for it (vLLM without a tokenizer needs detokenize=False)."""
    if params_cls is None:
        from kestrel import SamplingParams as params_cls
    one = params_cls(temperature=0, max_tokens=1, ignore_eos=True, **param_kw)
    full = params_cls(temperature=0, max_tokens=n_out, ignore_eos=True, **param_kw)
    ttft, total, outs = float("inf"), float("inf"), None
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        llm.generate(prompts, one, use_tqdm=False)
        sync(device)
        ttft = min(ttft, time.perf_counter() - t)
        t = time.perf_counter()
        outs = llm.generate(prompts, full, use_tqdm=False)
        sync(device)
        total = min(total, time.perf_counter() - t)
    return ttft, total, [list(o.outputs[0].token_ids) for o in outs]


def mean_accepted_len(drafts: int, accepted: int) -> float | None:
    """1 + accepted draft tokens per verify step that had drafts (vLLM's "mean acceptance length")."""
    return 1 + accepted / drafts if drafts else None


def kestrel_spec_counts(llm) -> tuple[int, int]:
    """(verify steps with drafts, accepted draft tokens) so far; (0, 0) without speculation."""
    sp = llm.engine.core.speculation
    return (sp.num_drafts, sp.num_accepted_tokens) if sp else (0, 0)


def timed_with_acceptance(llm, prompts, n_out, device, reps, counts=None, params_cls=None, **param_kw):
    """timed_generate's (ttft, total, outputs), and the mean accepted length of the drafts made meanwhile
    (`counts()`: the engine's cumulative (verify steps with drafts, accepted tokens); kestrel's by default)."""
    counts = counts or (lambda: kestrel_spec_counts(llm))
    before = counts()
    ttft, total, outs = timed_generate(llm, prompts, n_out, device, reps, params_cls, **param_kw)
    after = counts()
    return ttft, total, outs, mean_accepted_len(after[0] - before[0], after[1] - before[1])


def row_of(label, batch, k, alpha, n_out, ttft, total, mean_accepted=None, **extra):
    """A table row, also printed at once as a JSON line: a run stopped by its time limit still logs its rows.
    extra: more columns (the replay rows' `followed`)."""
    gen = max(total - ttft, 1e-9)
    row = dict(config=label, batch=batch, k=k, alpha=alpha, ms_per_token=gen / (n_out - 1) * 1e3,
               tok_per_s=batch * (n_out - 1) / gen, mean_accepted_len="" if mean_accepted is None
               else f"{mean_accepted:.2f}", **extra)
    print("row", json.dumps(row), flush=True)
    return row
