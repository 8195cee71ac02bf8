"""The requests `kestrel bench serve` sends and when: the `random` and `sharegpt` datasets and the arrival times.

random: each prompt is a list of token ids (sent as the completions API's token-id prompt, so its length is exact
on every server, whatever the server's tokenizer would do with text), drawn uniformly from the tokenizer's
vocabulary without its special tokens. Input and output lengths are uniform integers in
[floor(L * (1 - r)), ceil(L * (1 + r))] for the mean length L and the range ratio r (vLLM's definition).
sharegpt: the first two turns of each conversation of a ShareGPT-format JSON file (a list of
{"conversations": [{"value": ...}, ...]}): the first is the prompt, the second's token count the output length.
All draws come from the seed: the same arguments give the same requests."""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass

import numpy as np

SHAREGPT_MIN_LEN = 4  # conversations with a shorter prompt or reply are skipped (as vLLM does)
SHAREGPT_MAX_PROMPT = 1024
SHAREGPT_MAX_TOTAL = 2048


@dataclass
class SampleRequest:
    prompt: str | list[int]
    prompt_len: int
    expected_output_len: int


def length_bounds(mean_len: int, range_ratio: float) -> tuple[int, int]:
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    return max(1, math.floor(mean_len * (1 - range_ratio))), max(1, math.ceil(mean_len * (1 + range_ratio)))


def random_requests(tokenizer, num: int, input_len: int, output_len: int, range_ratio: float,
                    seed: int) -> list[SampleRequest]:
    if input_len < 1 or output_len < 1:
        raise ValueError(f"--random-input-len and --random-output-len must be >= 1 (got {input_len}, {output_len})")
    rng = np.random.default_rng(seed)
    special = set(tokenizer.all_special_ids)
    allowed = np.array([t for t in range(tokenizer.vocab_size) if t not in special])
    in_lo, in_hi = length_bounds(input_len, range_ratio)
    out_lo, out_hi = length_bounds(output_len, range_ratio)
    in_lens = rng.integers(in_lo, in_hi + 1, size=num)
    out_lens = rng.integers(out_lo, out_hi + 1, size=num)
    return [SampleRequest(allowed[rng.integers(0, len(allowed), size=n)].tolist(), int(n), int(o))
            for n, o in zip(in_lens, out_lens)]


def sharegpt_requests(tokenizer, path: str, num: int, output_len: int | None, seed: int) -> list[SampleRequest]:
    with open(path, encoding="utf-8") as f:
        data = [e for e in json.load(f) if len(e.get("conversations", ())) >= 2]
    random.Random(seed).shuffle(data)
    out: list[SampleRequest] = []
    for entry in data:
        if len(out) == num:
            break
        prompt, reply = entry["conversations"][0]["value"], entry["conversations"][1]["value"]
        p_len = len(tokenizer(prompt).input_ids)
        o_len = len(tokenizer(reply).input_ids) if output_len is None else output_len
        if p_len < SHAREGPT_MIN_LEN or (output_len is None and o_len < SHAREGPT_MIN_LEN) \
                or p_len > SHAREGPT_MAX_PROMPT or p_len + o_len > SHAREGPT_MAX_TOTAL:
            continue
        out.append(SampleRequest(prompt, p_len, o_len))
    if len(out) < num:
        raise ValueError(f"{path}: only {len(out)} usable conversations, --num-prompts asks for {num}")
    return out


def arrival_times(num: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds from the start at which each request is sent. inf: all at 0. Otherwise the gaps are
    gamma(shape=burstiness, mean=1/rate) draws (burstiness 1: exponential, a Poisson process; < 1 burstier,
    > 1 more even), scaled so that the last request goes out at num / rate, so that one seed's run and another's
    offer the same load."""
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * num
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num)
    times = np.cumsum(gaps)
    return (times * (num / request_rate / times[-1])).tolist()
