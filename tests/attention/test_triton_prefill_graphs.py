"""The prefill-graph path (kestrel/worker/prefill_graphs.py) on the Triton backends, run eagerly on the CPU under
the Triton interpreter (TRITON_INTERPRET=1) from the captured metadata: the padded bucket through the varlen
prefill kernel (a pad request after the real one, empty where n == bucket) and, for MLA, every token a row of the
absorbed decode kernel (MLAMetadataBuilder.update_captured), against the eager engine (MLA: its dense prefill).
On CUDA the same runs are tests/gpu/test_gpu_prefill_graphs.py with real graphs."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kestrel.platform import triton_gates as gates  # noqa: E402

_ok, _why = gates.triton_runnable()
CUDA = torch.cuda.is_available()


@pytest.mark.skipif(not _ok, reason=_why)
@pytest.mark.skipif(CUDA, reason="CPU float32 under the interpreter; tests/gpu/test_gpu_prefill_graphs.py on CUDA")
@pytest.mark.parametrize("backend", ["triton", "triton_mla"])
def test_prefill_graph_path_equals_eager_engine(tmp_path, tiny_tokenizer, monkeypatch, backend):
    from kestrel import LLM, SamplingParams
    from kestrel.worker.prefill_graphs import PrefillGraphs
    from tests.tiny import make_checkpoint

    if backend == "triton":
        from kestrel.attention.backends.triton import TritonBackend as cls
        path = make_checkpoint("qwen3", tmp_path, tokenizer=tiny_tokenizer, head_dim=64)
    else:
        from kestrel.attention.backends.triton_mla import TritonMLABackend as cls
        path = make_checkpoint("deepseek_v2", tmp_path, tokenizer=tiny_tokenizer, kv_lora_rank=64,
                               qk_rope_head_dim=16)
    monkeypatch.setattr(cls, "devices", ("cuda", "cpu"))
    monkeypatch.setattr(cls, "dtypes", (torch.float32,))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=3)  # flat logits: compare these
    first = [3 + (5 * i) % 300 for i in range(40)]
    # n < bucket, n == bucket (an empty pad request), then a prefix-cache hit (32 tokens cached, context 45)
    batches = [[[5, 17, 99, 3, 8, 21, 40]], [list(range(10, 26))], [first], [first + [7, 9, 11, 13, 15]]]
    outs, served = [], []
    for graphs in (False, True):
        llm = LLM(str(path), progress=False, dtype="float32", device="cpu", attention_backend=backend,
                  async_scheduling="off", max_model_len=128)
        runner = llm.engine.core.executor.runner
        assert runner.backend.name == backend
        if graphs:
            runner.graph_sets = [pg := PrefillGraphs(runner, [16, 32, 64])]
            replay = pg.replay
            pg.replay = lambda n, q: served.append((n, q, int(runner.buffers.seq_lens[0]))) or replay(n, q)
        outs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for b in batches for o in llm.generate(b, params)])
    for (ta, la), (tb, lb) in zip(*outs, strict=True):
        assert ta == tb
        for da, db in zip(la, lb, strict=True):
            assert da.keys() == db.keys() and all(abs(da[t].logprob - db[t].logprob) < 1e-4 for t in da)
    assert served == [(7, 16, 7), (16, 16, 16), (40, 64, 40), (13, 16, 45)]
