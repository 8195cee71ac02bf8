"""GPU checks of the prefill CUDA graphs (kestrel/worker/prefill_graphs.py; skipped without CUDA): captured at
start-up for every token bucket, replayed by the steps of one request's prefill alone (short prompts, n == bucket,
a 300-token prompt, a prefix-cache hit's rest) and by no step of two requests, with the tokens and first-token
logprobs of --enforce-eager: Qwen3 and Gemma 3 (six KV-cache groups, sliding windows) on the Triton backend,
DeepSeek-V2-Lite's shape (MLA + MoE) on Triton MLA, whose graphs attend absorbed where eager prefill is dense."""
import pytest

from kestrel import LLM, SamplingParams
from tests.agreement import MIXED_PROMPTS, bf16_logprob_tolerance

pytestmark = pytest.mark.gpu
KV_BLOCKS = 2048
LONG = [3 + (7 * i) % 370 for i in range(300)]
# lone prefills of 4, 13, 30, 7, 16 (a whole bucket), 100 and 300 tokens, then LONG's 288 cached tokens + 32 new
PROMPTS = MIXED_PROMPTS + [list(range(20, 36)), [5 + (3 * i) % 360 for i in range(100)], LONG,
                           LONG + list(range(40, 60))]


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_tokenizer):
    from tests.agreement import decisive_routers
    from tests.tiny import make_checkpoint

    root = tmp_path_factory.mktemp("gpu_prefill_graphs")
    wide = dict(hidden_size=256, intermediate_size=512, logit_scale=4.0)
    paths = {
        "qwen3": make_checkpoint("qwen3", root, tokenizer=tiny_tokenizer, head_dim=64, **wide),
        "gemma3": make_checkpoint("gemma3", root, tokenizer=tiny_tokenizer, head_dim=64, **wide),
        "deepseek_v2_moe": make_checkpoint("deepseek_v2_moe", root, tokenizer=tiny_tokenizer, kv_lora_rank=64,
                                           qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                                           moe_intermediate_size=128, **wide),
    }
    decisive_routers(paths["deepseek_v2_moe"])
    return paths


@pytest.mark.parametrize("kind", ["qwen3", "gemma3", "deepseek_v2_moe"])
def test_prefill_graphs_equal_eager(models, kind):
    path = str(models[kind])
    graphs = LLM(path, dtype="bfloat16", progress=False, num_kv_blocks=KV_BLOCKS)
    runner = graphs.engine.core.executor.runner
    assert runner.backend.name == ("triton_mla" if kind.startswith("deepseek") else "triton")
    pg = runner.prefill_graphs
    assert pg is not None and sorted(pg.graphs) == pg.sizes == [16, 32, 64, 128, 256, 512]
    eager = LLM(path, dtype="bfloat16", progress=False, num_kv_blocks=KV_BLOCKS, enforce_eager=True)
    assert eager.engine.core.executor.runner.prefill_graphs is None
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5)
    mla = kind.startswith("deepseek")
    # the first token's logprobs come from the prefill's logits: on the Triton backend the same kernels as eager
    # over a padded batch; MLA attends absorbed in the graph and dense eagerly (two bf16 roundings apart)
    tol = 2 * bf16_logprob_tolerance(0) if mla else bf16_logprob_tolerance(0)
    same, errors = 0, []
    for p in PROMPTS:  # one request at a time: each prefill step alone
        a, b = graphs.generate([p], params)[0].outputs[0], eager.generate([p], params)[0].outputs[0]
        first_a, first_b = a.logprobs[0], b.logprobs[0]
        shared = first_a.keys() & first_b.keys()
        assert len(shared) >= 4, (kind, len(p))
        errors.append(max(abs(first_a[t].logprob - first_b[t].logprob) for t in shared))
        same += a.token_ids == b.token_ids
    print(kind, "first-token logprob errors", [round(e, 4) for e in errors], "identical", same, "of", len(PROMPTS))
    assert max(errors) < tol, (kind, errors)
    assert pg.replays == len(PROMPTS), (kind, pg.replays)
    assert same >= len(PROMPTS) - (1 if mla else 0), (kind, same)  # MLA: a bf16 near-tie may flip
    both = [[9, 8, 7, 6, 5], [30, 31, 32]]
    assert ([o.outputs[0].token_ids for o in graphs.generate(both, params)] ==
            [o.outputs[0].token_ids for o in eager.generate(both, params)])
    assert pg.replays == len(PROMPTS)  # two requests in one step: eager
