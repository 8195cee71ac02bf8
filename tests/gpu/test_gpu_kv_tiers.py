"""GPU checks of the KV tiers (skipped without CUDA): the host tier's memory pinned, its copies between the
device and the host in order with CUDA graphs and pipelined decode (on by default on CUDA), the disk tier under
it, a state-snapshot unit (Kimi Linear in bf16): prompt A, prompts that evict it, A again (and A from disk in a
fresh engine) give A's greedy tokens with A's full blocks reported cached."""
import pytest

from kestrel import LLM, SamplingParams
from kestrel.core.kv_connector import ROWS

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
A = [(7 * i + 3) % 90 + 5 for i in range(40)]  # 2 full blocks of 16 before the last token
OTHERS = [[(11 * i + 13 * j + 1) % 90 + 5 for i in range(60)] for j in range(1, 4)]


def a_twice(llm):
    first = llm.generate([A], GREEDY)[0]
    for p in OTHERS:
        llm.generate([p], GREEDY)
    return first, llm.generate([A], GREEDY)[0]


def test_host_and_disk_tiers_on_cuda_with_graphs_and_pipelining(tiny_llama, tmp_path):
    kw = dict(progress=False, num_kv_blocks=8, max_model_len=128, kv_offloading_size=0.001,
              kv_offloading_disk_path=str(tmp_path), kv_offloading_disk_size=0.01)
    llm = LLM(str(tiny_llama), **kw)
    core = llm.engine.core
    assert core.pipelined
    worker = core.executor.runner.kv_connector
    assert all(t.is_pinned() for t in worker.host[ROWS])
    first, second = a_twice(llm)
    assert second.num_cached_tokens == 32 and second.outputs[0].token_ids == first.outputs[0].token_ids
    worker.wait_for_save()
    fresh = LLM(str(tiny_llama), **kw)
    out = fresh.generate([A], GREEDY)[0]
    assert out.num_cached_tokens == 32 and out.outputs[0].token_ids == first.outputs[0].token_ids
    assert fresh.engine.core.get_stats()["disk_kv_read_blocks"] == 2
    for engine in (llm, fresh):
        assert engine.engine.core.kv.num_free_blocks == engine.engine.core.kv.num_blocks


def test_kimi_linear_snapshots_through_the_host_tier_on_cuda(tmp_path, tiny_tokenizer):
    from tests.tiny import kimi_linear_bf16_checkpoint

    path = kimi_linear_bf16_checkpoint(tmp_path, tokenizer=tiny_tokenizer)
    kw = dict(progress=False, num_kv_blocks=8, max_model_len=128, num_state_snapshots=1)
    first, _ = a_twice(LLM(str(path), **kw))
    llm = LLM(str(path), kv_offloading_size=0.01, **kw)
    t1, t2 = a_twice(llm)
    assert t2.num_cached_tokens == 32
    assert t1.outputs[0].token_ids == t2.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.engine.core.kv_offload.connector.loaded_blocks == 3  # 2 latent blocks + the snapshot


def test_preemption_by_offload_on_cuda_with_the_side_stream(tiny_llama):
    """Forced preemption (12 blocks), pipelined: the preempted requests' blocks go to pinned host memory on the
    copy stream and come back; greedy tokens as without preemption, fewer tokens recomputed."""
    prompts = [list(range(3, 48))] + [[5 + i] * 40 for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(tiny_llama), progress=False).generate(prompts, params)]
    runs = {}
    for name, kw in (("off", {}), ("on", dict(kv_offloading_size=0.001, kv_offloading_preempt_min_tokens=16))):
        llm = LLM(str(tiny_llama), progress=False, num_kv_blocks=12, scheduling_policy="priority", **kw)
        outs = llm.generate(prompts, params, priority=[10, 0, 0, 0])
        assert [o.outputs[0].token_ids for o in outs] == want
        runs[name] = llm.engine.core.get_stats()
        assert llm.engine.core.kv.num_free_blocks == 12
    assert llm.engine.core.executor.runner.kv_connector.copies.stream is not None
    on, off = runs["on"], runs["off"]
    assert on["num_preemptions"] and on["host_kv_preempt_offloads"] == on["num_preemptions"]
    assert (on["preempted_prefix_queries"] - on["preempted_prefix_hits"]
            < off["preempted_prefix_queries"] - off["preempted_prefix_hits"])
