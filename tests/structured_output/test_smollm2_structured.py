"""Acceptance on the real model (the embedded SmolLM2-135M-Instruct GGUF, CPU): 20 JSON-schema requests with
nested objects, enums and arrays all validate, streamed too and with n = 3; regex and choice hold on 20 each.
Everything runs as one batch through the engine, so the model's steps are shared."""
import json
import re

import jsonschema
import pytest

from kestrel import LLM, SamplingParams
from kestrel.core.sampling_params import StructuredOutputsParams as SO

PERSON = {"type": "object", "properties": {
    # (xgrammar 0.2.9 lets "[a-z]{1,12}( [A-Z][a-z]{1,12})?" run past 12 letters in a schema pattern: keep it plain)
    "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["engineer", "doctor", "teacher", "artist"]},
    "skills": {"type": "array", "items": {"enum": ["python", "drawing", "surgery", "teaching"]},
               "minItems": 1, "maxItems": 3},
    "address": {"type": "object", "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,14}$"},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"],
        "additionalProperties": False}},
    "required": ["name", "age", "role", "skills", "address"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {
    "items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "object", "properties": {
        "product": {"enum": ["apple", "bread", "milk"]}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["product", "qty"], "additionalProperties": False}},
    "express": {"type": "boolean"}, "status": {"enum": ["new", "paid", "shipped"]}},
    "required": ["items", "express", "status"], "additionalProperties": False}
SUBJECTS = ["a nurse from Lyon", "a young painter", "a retired teacher", "a software engineer in Berlin",
            "a surgeon from Boston"]
REGEX = r"(Mon|Tue|Wed|Thu|Fri) [0-2][0-9]:[0-5][0-9]"
CHOICES = ["positive", "negative", "neutral"]


def _chat(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)


@pytest.mark.slow
def test_smollm2_structured_outputs():
    llm = LLM(progress=False, max_model_len=1024)
    engine, tok = llm.engine, llm.tokenizer
    jobs = []  # (request id, kind, schema or None, streamed)

    def add(prompt, params, kind, schema=None, stream=False):
        jobs.append((engine.add_request(_chat(tok, prompt), params, stream=stream), kind, schema, stream))

    for i in range(20):  # 20 JSON-schema requests: 10 people, 10 orders; every 4th one streamed
        schema, what = (PERSON, f"Describe {SUBJECTS[i % 5]} as JSON.") if i < 10 else (
            ORDER, f"Write a grocery order #{i} as JSON.")
        add(what, SamplingParams(max_tokens=110, temperature=0.7, seed=i, structured_outputs=SO(json=schema)),
            "json", schema, stream=i % 4 == 0)
    add("Describe a doctor as JSON.", SamplingParams(n=3, max_tokens=110, temperature=0.9, seed=99,
                                                     structured_outputs=SO(json=PERSON)), "json", PERSON, True)
    for i in range(20):
        add(f"When is meeting {i}? Give the day and time.",
            SamplingParams(max_tokens=12, temperature=0.8, seed=i, structured_outputs=SO(regex=REGEX)), "regex")
        add(f"Sentiment of: 'I {['love', 'hate', 'saw'][i % 3]} this movie #{i}'",
            SamplingParams(max_tokens=6, temperature=0.8, seed=i, structured_outputs=SO(choice=CHOICES)), "choice")

    streamed = {rid for rid, _, _, stream in jobs if stream}
    texts: dict[str, dict[int, str]] = {}
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:  # streamed outputs arrive as deltas; the others once, whole
                texts.setdefault(out.request_id, {}).setdefault(c.index, "")
                texts[out.request_id][c.index] += c.text_delta if out.request_id in streamed else ""
            if out.finished:
                finished[out.request_id] = out

    for rid, kind, schema, stream in jobs:
        out = finished[rid]
        for c in out.outputs:
            if stream:
                assert texts[rid][c.index] == c.text  # the deltas add up to the whole text
            if kind == "json":
                assert c.finish_reason == "stop", c.text
                jsonschema.validate(json.loads(c.text), schema)
            elif kind == "regex":
                assert re.fullmatch(REGEX, c.text), c.text
            else:
                assert c.text in CHOICES
    n3 = finished[jobs[20][0]]
    assert len(n3.outputs) == 3 and len({c.text for c in n3.outputs}) > 1  # three distinct samples
    assert sum(1 for j in jobs if j[1] == "json") == 21 and sum(1 for j in jobs if j[1] != "json") == 40
