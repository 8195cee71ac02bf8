"""A caller that waits for the whole answer (a non-streamed API request) gets only the final output: a request of
many sequences then costs each step what its new tokens cost, not a snapshot of all its sequences (issue 33: one
request of 12,800 sequences starved the server's event loop). The per-step token counts the metrics need come
from `progress` either way."""
from __future__ import annotations

from kestrel.core.sampling_params import SamplingParams
from kestrel.engine.messages import EngineCoreOutput, EngineCoreRequest
from kestrel.frontend.processor import OutputProcessor


def _add(proc: OutputProcessor, rid: str, n: int, stream: bool) -> list[str]:
    params = SamplingParams(n=n, max_tokens=3, detokenize=False)
    children = [EngineCoreRequest(f"{rid}-{i}", [1, 2], params, 3, 0.0, 0) for i in range(n)]
    proc.add_request(rid, None, [1, 2], params, children, stream=stream)
    return [c.request_id for c in children]


def test_final_only_request_yields_once_with_every_sequence_and_reports_progress():
    proc = OutputProcessor(tokenizer=None)
    final_only, streamed = _add(proc, "a", 4, stream=False), _add(proc, "b", 2, stream=True)
    for step in range(3):
        reason = "length" if step == 2 else None
        outs, _ = proc.process([EngineCoreOutput(c, [10 + step], finish_reason=reason)
                                for c in final_only + streamed[:1]])
        assert sorted(proc.progress) == [("a", 4), ("b", 1)]
        if step < 2:
            assert [o.request_id for o in outs] == ["b"]  # the streamed one, at every step
            assert [len(c.token_ids_delta) for c in outs[0].outputs] == [1, 0]
    (final,) = [o for o in outs if o.request_id == "a"]
    assert final.finished and [c.token_ids for c in final.outputs] == [[10, 11, 12]] * 4
    assert "a" not in proc.requests and "b" in proc.requests  # b's second sequence still runs
