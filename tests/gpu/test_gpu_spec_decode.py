"""GPU checks of speculative decoding (skipped without CUDA), bf16 on the Triton backend with decode CUDA graphs:
the speculative engine's greedy output, teacher-forced through the plain engine, is its argmax at >= 30 of 32
positions (a near-tie may flip between the decode and the verify kernels; after a flip a free-running
comparison would differ everywhere); the replay proposer at alpha 1 is accepted in full; seeded sampling (the
fused Gumbel sampler) agrees with plain decoding on most requests; with a runner drafter (MTP here, EAGLE-3 in
test_gpu_spec_eagle3.py) CUDA graphs are captured and replayed, and tokens and drafts match enforce_eager."""
import pytest

from kestrel import LLM, SamplingParams
from tests.agreement import MIXED_PROMPTS

pytestmark = pytest.mark.gpu
KV_BLOCKS = 2048
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def model(tmp_path_factory, tiny_tokenizer):
    from tests.tiny import make_checkpoint

    return make_checkpoint("qwen3", tmp_path_factory.mktemp("gpu_spec"), tokenizer=tiny_tokenizer, head_dim=64,
                           hidden_size=256, intermediate_size=512, logit_scale=4.0)


@pytest.fixture(scope="module")
def plain(model):
    llm = LLM(str(model), dtype="bfloat16", progress=False, num_kv_blocks=KV_BLOCKS)
    assert llm.engine.core.executor.runner.graphs is not None
    return llm


def teacher_forced_agree(plain, prompt, tokens) -> int:
    out = plain.generate([prompt + tokens], SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0))[0]
    agree = 0
    for j, tok in enumerate(tokens):
        entry = out.prompt_logprobs[len(prompt) + j]
        agree += next(t for t, lp in entry.items() if lp.rank == 1) == tok
    return agree


def test_greedy_teacher_forced(model, plain):
    llm = LLM(str(model), dtype="bfloat16", progress=False, num_kv_blocks=KV_BLOCKS, speculative_config=NGRAM)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate(MIXED_PROMPTS * 3, params)
    for p, o in zip(MIXED_PROMPTS * 3, outs):
        assert teacher_forced_agree(plain, p, o.outputs[0].token_ids) >= 30, p
    assert llm.engine.core.speculation.num_accepted_tokens > 0


def test_replay_alpha_one_accepts_everything(model, plain):
    params = SamplingParams(temperature=0, max_tokens=33, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in plain.generate(MIXED_PROMPTS, params)]
    llm = LLM(str(model), dtype="bfloat16", progress=False, num_kv_blocks=KV_BLOCKS,
              speculative_config={"method": "replay", "num_speculative_tokens": 4, "alpha": 1.0,
                                  "replay_references": [[p, r] for p, r in zip(MIXED_PROMPTS, ref)]})
    got = [o.outputs[0].token_ids for o in llm.generate(MIXED_PROMPTS, params)]
    sp = llm.engine.core.speculation
    # a flip between the kernels would make the later replayed drafts wrong: allow one prompt to diverge
    assert sum(g == r for g, r in zip(got, ref)) >= len(ref) - 1
    assert sp.num_accepted_tokens >= 0.8 * sp.num_draft_tokens


def test_seeded_sampling_mostly_identical(model, plain):
    params = [SamplingParams(temperature=0.8, seed=100 + i, max_tokens=24, ignore_eos=True) for i in range(16)]
    prompts = [MIXED_PROMPTS[i % 4] for i in range(16)]
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    llm = LLM(str(model), dtype="bfloat16", progress=False, num_kv_blocks=KV_BLOCKS, speculative_config=NGRAM)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert sum(g == r for g, r in zip(got, ref)) >= 14


def test_verify_graphs_equal_eager(model, plain):
    """Uniform verify steps (the replay proposer always proposes k drafts) replay a captured graph, padded from 3
    requests to 4: the same tokens as the same engine with --enforce-eager."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = MIXED_PROMPTS[:3]
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    spec = {"method": "replay", "num_speculative_tokens": 3, "alpha": 0.7,
            "replay_references": [[p, r] for p, r in zip(prompts, ref)]}
    graphs = LLM(str(model), dtype="bfloat16", progress=False, num_kv_blocks=KV_BLOCKS, speculative_config=spec)
    vg = next((g for g in graphs.engine.core.executor.runner.graph_sets if type(g).__name__ == "VerifyGraphSet"), None)
    assert vg is not None and vg.by_drafts[3].graphs and set(vg.by_drafts) == {1, 2, 3}
    eager = LLM(str(model), dtype="bfloat16", progress=False, num_kv_blocks=KV_BLOCKS, speculative_config=spec,
                enforce_eager=True)
    a = [o.outputs[0].token_ids for o in graphs.generate(prompts, params)]
    b = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    assert a == b
    assert vg.replays > 5


def drafts_by_sequence(llm) -> dict:
    """Record the runner drafter's proposals: the request's tokens -> the drafts made after them."""
    drafter = llm.engine.core.executor.runner.drafter
    after_step, seen = drafter.after_step, {}

    def recording(inf, out, requests):
        after_step(inf, out, requests)
        for rid, (n, d) in out.next_drafts.items():
            seen[tuple(requests[rid].tokens_slice(0, n))] = d

    drafter.after_step = recording
    return seen


def check_drafter_graphs_equal_eager(path, spec: dict, prompts: list[list[int]]) -> tuple:
    """A runner drafter (MTP, EAGLE-3) with CUDA graphs on, against the same engine with enforce_eager: graphs are
    captured with the drafter loaded and replayed; the greedy tokens, teacher-forced through the eager engine, are
    its argmax at all positions but 2 of each request; the drafts made after the same tokens agree (they read the
    hidden states that graph replays wrote into the capture buffer: stale or missing rows would change them; a
    bf16 near-tie between the graph's and the eager kernels may flip one). Requests end at different lengths, so
    the batch shrinks through `disable_by_batch_size`: decode steps without drafts above it, verify steps below.
    Returns the runner with graphs (to check which graphs replayed)."""
    params = [SamplingParams(temperature=0, max_tokens=12 + 4 * i, ignore_eos=True) for i in range(len(prompts))]
    graphs = LLM(str(path), dtype="bfloat16", progress=False, num_kv_blocks=KV_BLOCKS, speculative_config=spec)
    runner = graphs.engine.core.executor.runner
    assert runner.drafter is not None and runner.graphs is not None
    eager = LLM(str(path), dtype="bfloat16", progress=False, num_kv_blocks=KV_BLOCKS, speculative_config=spec,
                enforce_eager=True)
    assert eager.engine.core.executor.runner.graphs is None
    with_graphs, without = drafts_by_sequence(graphs), drafts_by_sequence(eager)
    outs = graphs.generate(prompts, params)
    eager.generate(prompts, params)
    for p, o in zip(prompts, outs):
        tokens = o.outputs[0].token_ids
        assert teacher_forced_agree(eager, p, tokens) >= len(tokens) - 2, p
    shared = set(with_graphs) & set(without)
    assert len(shared) >= 20
    assert sum(with_graphs[w] == without[w] for w in shared) >= 0.9 * len(shared)
    assert graphs.engine.core.speculation.num_draft_tokens > 0
    return runner


def test_mtp_drafter_with_decode_graphs_equals_eager(tmp_path, tiny_tokenizer):
    """DeepSeek MTP on the MLA backend (verify steps stay eager there: its metadata is not the plain paged one;
    decode steps above disable_by_batch_size replay decode graphs and feed the drafter's windows; the MTP layer
    itself drafts eagerly)."""
    from tests.spec_decode.mtp_tiny import mtp_checkpoint

    # the target dense (first_k_dense_replace) with the MLA kernel's dimensions (tests/gpu/test_gpu_mla.py)
    path = mtp_checkpoint(tmp_path, tokenizer=tiny_tokenizer, hidden_size=256, intermediate_size=512,
                          kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, q_lora_rank=64,
                          first_k_dense_replace=3, logit_scale=4.0)
    spec = {"method": "mtp", "num_speculative_tokens": 2, "disable_by_batch_size": 4}
    runner = check_drafter_graphs_equal_eager(path, spec, MIXED_PROMPTS * 2)
    assert runner.graphs.replays > 10
