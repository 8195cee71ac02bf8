"""benchmarks/engine_steps.py: prefill_all leaves every request in decode, and decode_ms_per_step takes exactly
warm_up + steps decode steps (one token a request each)."""
from benchmarks.engine_steps import decode_ms_per_step, prefill_all
from kestrel import LLM, SamplingParams


def test_prefill_then_timed_decode(tiny_llama):
    llm = LLM(str(tiny_llama), device="cpu", max_num_batched_tokens=16, progress=False)
    eng = llm.engine
    for n in (40, 7, 23):
        eng.add_request(list(range(1, n + 1)), SamplingParams(max_tokens=20, ignore_eos=True))
    seconds, steps = prefill_all(eng)
    running = eng.core.scheduler.running
    assert steps >= 4 and seconds > 0  # 70 prompt tokens, about 16 a step
    assert len(running) == 3 and not any(r.in_prefill for r in running)
    before = [len(r.output_token_ids) for r in running]
    assert decode_ms_per_step(eng, steps=4, warm_up=2) > 0
    assert [len(r.output_token_ids) - b for r, b in zip(running, before)] == [6, 6, 6]
    llm.shutdown()
