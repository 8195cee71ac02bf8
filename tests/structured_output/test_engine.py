"""Constrained generation through the real engine on a tiny random-weight model (whose unconstrained output is
noise, so every constraint that holds is the mask's doing): sync and pipelined decode, n > 1, stop strings, and a
request waiting for its compile while others run."""
import json
import re
import threading
import time

import jsonschema
import pytest

from kestrel import LLM, SamplingParams
from kestrel.engine.messages import EngineCoreRequest
from kestrel.core.sampling_params import StructuredOutputsParams as SO

SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "tag": {"enum": ["fox", "dog"]}, "xs": {"type": "array", "items": {"type": "integer", "maximum": 9}, "maxItems": 2}},
    "required": ["ok", "n", "tag", "xs"], "additionalProperties": False}


@pytest.fixture(scope="module", params=["off", "on"], ids=["sync", "pipelined"])
def llm(request, tiny_llama):
    return LLM(str(tiny_llama), progress=False, num_kv_blocks=128, max_model_len=256,
               async_scheduling=request.param)


def test_constraints_hold(llm):
    regex = r"[0-9]{2}-(fox|dog)"
    params = [SamplingParams(max_tokens=90, temperature=1.0, seed=i, structured_outputs=SO(json=SCHEMA))
              for i in range(4)]
    params += [SamplingParams(max_tokens=12, temperature=1.0, n=3, seed=7, structured_outputs=SO(regex=regex)),
               SamplingParams(max_tokens=8, temperature=0, structured_outputs=SO(choice=["stop", "end", "fox"])),
               SamplingParams(max_tokens=12, temperature=1.0, seed=3)]  # unconstrained in the same batch
    outs = llm.generate(["The quick brown fox"] * len(params), params)
    for o in outs[:4]:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
        assert o.outputs[0].finish_reason == "stop"
    assert len(outs[4].outputs) == 3
    for c in outs[4].outputs:
        assert re.fullmatch(regex, c.text), c.text
    assert outs[5].outputs[0].text in ("stop", "end", "fox")
    assert not re.fullmatch(regex, outs[6].outputs[0].text)


def test_stop_string_inside_a_constrained_output(llm):
    p = SamplingParams(max_tokens=20, temperature=0, stop=["o"], structured_outputs=SO(regex="(fox|dog)+"))
    out = llm.generate(["Hello"], p)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "o"
    assert out.text in ("f", "d")


def test_pipelined_equals_sync(tiny_llama, llm):
    other = LLM(str(tiny_llama), progress=False, num_kv_blocks=128, max_model_len=256,
                async_scheduling="off" if llm.engine.core.pipelined else "on")
    p = [SamplingParams(max_tokens=90, temperature=0, structured_outputs=SO(json=SCHEMA)),
         SamplingParams(max_tokens=10, temperature=0, structured_outputs=SO(regex="[a-z]{3,9}"))]
    a = [o.outputs[0].token_ids for o in llm.generate(["Paris is", "Hello"], p)]
    b = [o.outputs[0].token_ids for o in other.generate(["Paris is", "Hello"], p)]
    assert a == b


def test_a_compiling_request_does_not_block_others(llm, monkeypatch):
    engine = llm.engine
    manager = engine.core.grammars.manager
    release = threading.Event()
    real = manager._compile

    def slow_compile(kind, spec):
        assert release.wait(30)
        return real(kind, spec)

    monkeypatch.setattr(manager, "_compile", slow_compile)
    slow = engine.add_request("Hello", SamplingParams(max_tokens=6, temperature=0,
                                                      structured_outputs=SO(regex="(ab){3}[0-9]{2}")))
    fast = engine.add_request("Hello", SamplingParams(max_tokens=6, temperature=0))
    done = {}
    for _ in range(200):
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
        if fast in done:
            break
    assert fast in done and slow not in done  # the unconstrained request ran to the end meanwhile
    release.set()
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    assert done[slow].outputs[0].text == "ababab" or re.fullmatch(r"(ab){3}[0-9]{0,2}", done[slow].outputs[0].text)


def test_a_grammar_that_fails_in_the_core_aborts_only_its_request(llm):
    core = llm.engine.core
    bad = SamplingParams(max_tokens=4, structured_outputs=SO(grammar="root ::= nowhere"))  # never validated here
    core.add_request(EngineCoreRequest("bad", [1, 5, 7], bad, 4, 0.0))
    core.add_request(EngineCoreRequest("good", [1, 5, 7], SamplingParams(max_tokens=4, temperature=0), 4, 0.0))
    finished = {}
    for _ in range(100):
        for o in core.step().outputs:
            if o.finish_reason:
                finished[o.request_id] = o
        if not core.has_unfinished_requests():
            break
    assert finished["bad"].finish_reason == "abort" and "structured output failed" in finished["bad"].stop_reason
    assert finished["good"].finish_reason == "length"


def test_the_fill_runs_while_the_engine_loop_stages_the_next_step(tiny_llama):
    """Pipelined, a step's bitmask fills on the pool while the engine loop returns the previous step's outputs and
    stages the next step's inputs: each fill slice here waits until the next step's inputs are staged, which
    would never happen (within the timeout) if the loop waited for the fill first."""
    llm = LLM(str(tiny_llama), progress=False, num_kv_blocks=128, max_model_len=256, async_scheduling="on")
    core = llm.engine.core
    staged = threading.Condition()
    count = {"prepared": 0, "fills": 0, "overlapped": 0}
    real_prepare, real_slice = core.executor.runner._prepare, core.grammars.manager._fill_slice

    def prepare(chunks, states, prev):
        out = real_prepare(chunks, states, prev)
        with staged:
            count["prepared"] += 1
            staged.notify_all()
        return out

    real_start = core.grammars.manager.start_step

    def start_step(accepts, rows):  # returns with the fill submitted
        with staged:
            count["at_start"] = count["prepared"]
        return real_start(accepts, rows)

    def fill_slice(matchers, buf, index):
        with staged:
            before = count["at_start"]
            count["fills"] += 1
            if staged.wait_for(lambda: count["prepared"] > before, timeout=0.5):
                count["overlapped"] += 1
        real_slice(matchers, buf, index)

    core.executor.runner._prepare, core.grammars.manager._fill_slice = prepare, fill_slice
    core.grammars.manager.start_step = start_step
    p = SamplingParams(max_tokens=40, temperature=0, structured_outputs=SO(regex="[a-z]{20}"))
    out = llm.generate(["Hello"], p)[0].outputs[0]
    assert re.fullmatch("[a-z]{20}", out.text) and out.finish_reason == "stop"
    # one fill a token; the first step samples at once (nothing in flight to overlap with), every later one overlaps
    assert count["fills"] == len(out.token_ids) > 3 and count["overlapped"] == count["fills"] - 1


def test_slow_compiles_time_out_and_do_not_starve_a_small_grammar(tiny_llama):
    """Issue 33: two hostile constraints (a pattern xgrammar parses for seconds; sent to the core directly, past
    the frontend's limits) used to hold both compile threads while a trivial structured request waited 251 s.
    Now the small one compiles beside them and answers at once, and each slow one fails its own request with
    the budget as the reason when the budget runs out, on a thread that no longer counts."""
    llm = LLM(str(tiny_llama), progress=False, num_kv_blocks=128, max_model_len=256, grammar_compile_timeout=1.0)
    core = llm.engine.core
    slow = [SamplingParams(max_tokens=4, structured_outputs=SO(json={"type": "string", "pattern": f"a{{{n}}}"}))
            for n in (8000, 8001)]  # ~3 s each to parse
    for i, p in enumerate(slow):
        core.add_request(EngineCoreRequest(f"slow{i}", [1, 5, 7], p, 4, 0.0))
    small = SamplingParams(max_tokens=3, temperature=0, structured_outputs=SO(choice=["yes", "no"]))
    t0 = time.monotonic()
    core.add_request(EngineCoreRequest("small", [1, 5, 7], small, 3, 0.0))
    finished = {}
    while len(finished) < 3 and time.monotonic() - t0 < 20:
        for o in core.step().outputs:
            if o.finish_reason:
                finished[o.request_id] = (o, time.monotonic() - t0)
    small_out, small_s = finished["small"]
    assert small_out.finish_reason == "stop" and small_s < 2.0
    for i in range(2):
        out, seconds = finished[f"slow{i}"]
        assert out.finish_reason == "abort" and "--grammar-compile-timeout" in out.stop_reason
        assert seconds < 5.0
    # the same hostile constraint again fails at once, without a new compile thread
    t1 = time.monotonic()
    core.add_request(EngineCoreRequest("again", [1, 5, 7], slow[0], 4, 0.0))
    out = next(o for _ in range(100) for o in core.step().outputs if o.finish_reason)
    assert out.request_id == "again" and "budget" in out.stop_reason and time.monotonic() - t1 < 0.5
    core.grammars.manager.shutdown()
