"""Prefill CUDA graphs (kestrel/worker/prefill_graphs.py) without a captured graph on the CPU: a step of one
request's prefill chunk alone runs the padded bucket (the real request, then a pad request to the bucket's token
count) from the captured metadata, and gives the eager engine's greedy tokens; the steps it serves are exactly the
lone prefill chunks (short prompts, n == bucket, a prefix-cache hit's rest, every chunk of a chunked prefill),
never a step with two requests, a decode row or prompt logprobs. Llama-style paged attention and MLA (captured
all absorbed, against the eager dense prefill)."""
import pytest

from kestrel import LLM, SamplingParams
from kestrel.config import EngineConfig

SIZES = [16, 32, 64, 128]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)


def prompt(first: int, n: int) -> list[int]:
    return [3 + (first + 7 * i) % 370 for i in range(n)]


def install(llm) -> list[tuple[int, int, int]]:
    """Prefill graphs on the engine's runner; returns the (tokens, bucket, context) of every step they serve."""
    from kestrel.worker.prefill_graphs import PrefillGraphs, prefill_graphs_supported

    runner = llm.engine.core.executor.runner
    assert prefill_graphs_supported(runner) and not runner.graph_sets  # not captured on the CPU
    runner.graph_sets = [pg := PrefillGraphs(runner, SIZES)]
    served, replay = [], pg.replay

    def spy(n, q):
        served.append((n, q, int(runner.buffers.seq_lens[0])))
        return replay(n, q)

    pg.replay = spy
    return served


def tokens(llm, prompts, params=GREEDY):
    """Each prompt's greedy tokens and the top logprobs at each (the tiny models' logits are flat: a wrong
    attention may keep the argmax, not the logprobs)."""
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in llm.generate(prompts, params)]


def same(a, b) -> bool:
    """Equal tokens, equal top tokens, their logprobs equal up to float32 rounding."""
    return len(a) == len(b) and all(
        ta == tb and len(la) == len(lb) and all(
            da.keys() == db.keys() and all(abs(da[t] - db[t]) < 1e-4 for t in da) for da, db in zip(la, lb))
        for (ta, la), (tb, lb) in zip(a, b))


@pytest.fixture(scope="module", params=["qwen3", "deepseek_v2"])
def kind(request):
    return request.param


def test_lone_prefill_steps_replay_the_padded_bucket(tiny_models, kind):
    path = str(tiny_models[kind])
    eager, graphs = LLM(path, progress=False), LLM(path, progress=False)
    served = install(graphs)
    long = prompt(50, 100)
    cases = [  # (prompts of one generate call, the prefill steps the graphs serve)
        ([prompt(1, 1)], []),  # one token: a decode row (the decode graphs' step)
        ([prompt(2, 7)], [(7, 16, 7)]),
        ([prompt(3, 16)], [(16, 16, 16)]),  # n == bucket: the pad request is empty
        ([prompt(4, 17)], [(17, 32, 17)]),
        ([long], [(100, 128, 100)]),
        ([long + prompt(9, 20)], [(24, 32, 120)]),  # 96 tokens (6 blocks) from the prefix cache
        ([prompt(5, 9), prompt(6, 12)], []),  # two requests in one step
        ([prompt(7, 130)], []),  # beyond the largest bucket
    ]
    for prompts, expect in cases:
        del served[:]
        assert same(tokens(graphs, prompts), tokens(eager, prompts)), (kind, [len(p) for p in prompts])
        assert served == expect, (kind, [len(p) for p in prompts])
    del served[:]
    lp = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1)
    a, b = graphs.generate([prompt(8, 10)], lp)[0], eager.generate([prompt(8, 10)], lp)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids and served == []  # needs every token's hidden state


def test_every_chunk_of_a_chunked_prefill(tiny_models, kind):
    """Chunks of 32 tokens, then the last 6: each a step of its own, each a bucket (contexts 32, 64, 70)."""
    path = str(tiny_models[kind])
    opts = dict(progress=False, max_num_batched_tokens=32, enable_prefix_caching=False)
    eager, graphs = LLM(path, **opts), LLM(path, **opts)
    served = install(graphs)
    p = [prompt(11, 70)]
    assert same(tokens(graphs, p), tokens(eager, p))
    assert served == [(32, 32, 32), (32, 32, 64), (6, 16, 70)]


def test_mla_graphs_serve_contexts_up_to_the_largest_bucket(tiny_models):
    """Absorbed attention costs each token its whole context: an MLA prefill whose context exceeds the largest
    bucket (a long cached prefix) runs eagerly, the dense path; paged attention has no such limit."""
    for kind, expect in [("deepseek_v2", []), ("qwen3", [(22, 32, 150)])]:
        path = str(tiny_models[kind])
        eager, graphs = LLM(path, progress=False), LLM(path, progress=False)
        served = install(graphs)
        first = [prompt(60, 130)]
        assert same(tokens(graphs, first), tokens(eager, first))
        del served[:]
        hit = [first[0] + prompt(61, 20)]  # 128 tokens (8 blocks) cached, 22 new: context 150
        assert same(tokens(graphs, hit), tokens(eager, hit))
        assert served == expect, kind


def test_prefill_graph_sizes_follow_the_config(tiny_models):
    from kestrel.worker.prefill_graphs import prefill_graph_sizes

    llm = LLM(str(tiny_models["qwen3"]), progress=False, max_num_batched_tokens=100)
    runner = llm.engine.core.executor.runner
    assert runner.buffers.max_tokens == 256  # max_num_seqs
    assert prefill_graph_sizes(runner) == [16, 32, 64, 128]  # 128 holds any step of 100 tokens
    runner.config.compilation.cuda_graph_prefill_max_tokens = 64
    assert prefill_graph_sizes(runner) == [16, 32, 64]
    runner.config.compilation.cuda_graph_prefill_max_tokens = 0
    assert prefill_graph_sizes(runner) == []
    assert EngineConfig().compilation.cuda_graph_prefill_max_tokens == 512


def test_the_step_that_calibrates_kv_scales_runs_eagerly(tiny_models):
    """--calculate-kv-scales sets an FP8 cache's scales in the first eager forward that writes K/V (a graph replay
    would skip it): that prefill runs eagerly, the next ones replay."""
    path = str(tiny_models["qwen3"])
    opts = dict(progress=False, kv_cache_dtype="fp8", calculate_kv_scales=True)
    eager, graphs = LLM(path, **opts), LLM(path, **opts)
    served = install(graphs)
    layers = list(graphs.engine.core.executor.runner.loaded.context.attention_layers.values())
    for p in ([prompt(20, 12)], [prompt(21, 9)]):
        assert same(tokens(graphs, p), tokens(eager, p))
    assert all(x.k_scale.item() != 1.0 and not x.calibrate_kv_scales for x in layers)
    assert served == [(9, 16, 9)]
