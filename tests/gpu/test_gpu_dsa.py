"""GPU checks for DSA (skipped without CUDA): tiny DeepSeek-V3.2 and GLM-5 in bf16 on the Triton sparse MLA backend
against transformers in float32, teacher-forced (prompt logprobs: prefills), and the decode CUDA graphs (one per
route a decode step takes) against enforce_eager, teacher-forced on the graphs' own decoded tokens.

With index_topk above every context, the selection is every visible token whatever the rounding: the sparse route
(indexer scores, top-k, sparse attention) and the dense routes must each agree >= 30/32. With index_topk 8 the
k-th best score is a near-tie at many positions, and bf16 rounding flips the pick: transformers' own bf16 run
agrees with its float32 run at only 17 of 32 positions on a 48-token prompt (CPU, tiny V3.2). There the yardstick
is that run: ours must agree at least 0.8 times as often (a wrong selection drops far below)."""
import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.attention.sparse_mla import DENSE, SPARSE, SparseMLAAttention
from tests.agreement import MIXED_PROMPTS, assert_no_worse_than_transformers_bf16, beside_transformers_bf16

pytestmark = pytest.mark.gpu
PROMPTS = MIXED_PROMPTS + [[100 + (13 * i) % 211 for i in range(48)]]


@pytest.fixture(scope="module")
def dsa(tmp_path_factory, tiny_tokenizer):
    """(kind, index_topk) -> a checkpoint: latent 64 + rope 16 and a 16-head x 32 indexer (the kernels' powers of
    two)."""
    from tests.tiny import make_checkpoint

    root, built = tmp_path_factory.mktemp("gpu_dsa"), {}

    def get(kind, topk):
        if (kind, topk) not in built:
            built[kind, topk] = make_checkpoint(kind, root, tokenizer=tiny_tokenizer, name=f"{kind}_{topk}",
                                                hidden_size=256, intermediate_size=512, kv_lora_rank=64,
                                                qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                                                q_lora_rank=64, index_topk=topk, logit_scale=4.0)
        return built[kind, topk]
    return get


def _llm(path, **kw):
    """The engine on the Triton backend, decode graphs captured (batch sizes up to 8: PROMPTS pad to 8) unless
    enforce_eager."""
    kw.setdefault("cuda_graph_sizes", [1, 2, 4, 8])
    llm = LLM(str(path), dtype="bfloat16", progress=False, num_kv_blocks=512, **kw)
    runner = llm.engine.core.executor.runner
    assert runner.backend.name == "triton_sparse_mla"
    assert (runner.graphs is None) == bool(kw.get("enforce_eager")), runner.graphs
    return llm


def _graph_replays(llm) -> dict:
    """Decode-graph replays per route form: {(route,): replays}."""
    graphs = llm.engine.core.executor.runner.graphs
    return {f: g.replays for f, g in getattr(graphs, "by_form", {(SPARSE,): graphs}).items()}


def _decode_agreement(graphs, eager, prompts, n: int = 32) -> list[int]:
    """Teacher-forced on the graphs engine's own decode steps: it generates n greedy tokens after every prompt in
    one batch (decode steps replay graphs, padded to a captured size); the eager engine scores each resulting
    sequence (prompt logprobs) -> per prompt, how many of the n tokens are also the eager engine's argmax."""
    outs = graphs.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    agree = []
    for p, o in zip(prompts, outs):
        seq = p + list(o.outputs[0].token_ids)
        scored = eager.generate([seq], SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0))[0]
        top1 = [next(t for t, lp in scored.prompt_logprobs[j].items() if lp.rank == 1)
                for j in range(len(p), len(seq))]
        agree.append(sum(a == b for a, b in zip(top1, seq[len(p):])))
    return agree


@pytest.mark.parametrize("layer_dense,key_dtype", [(False, "bf16"), (True, "bf16"), (False, "fp8")])
def test_decode_graphs_equal_eager(dsa, monkeypatch, layer_dense, key_dtype):
    """index_topk above every context: the selection is every token. layer_dense False: every decode step replays
    the SPARSE graph (scores at the static width, radix top-k reading lengths on the device, sparse attention);
    True: the contexts are within index_topk, so the DENSE graph (MLA decode + the indexer-key write). Each
    prompt's 32 graph-decoded tokens agree with the eager engine's argmax >= 30 times."""
    monkeypatch.setattr(SparseMLAAttention, "supports_dense_mha_prefill", layer_dense)
    path = dsa("deepseek_v32", 2048)
    graphs = _llm(path, indexer_key_dtype=key_dtype)
    eager = _llm(path, indexer_key_dtype=key_dtype, enforce_eager=True)
    agree = _decode_agreement(graphs, eager, PROMPTS)
    assert min(agree) >= 30, agree
    replays = _graph_replays(graphs)
    assert replays[(DENSE,) if layer_dense else (SPARSE,)] > 0, replays


@pytest.mark.parametrize("key_dtype", ["bf16", "fp8"])
def test_decode_graphs_follow_the_route(dsa, key_dtype):
    """index_topk 8 with the dense routes declared: decode steps whose contexts are all <= 8 replay the DENSE
    graphs, the others the SPARSE ones (a real selection); both run. The selection's near-ties flip with bf16
    rounding (see the module docstring), so the bar is 0.8 of the tokens (not yet calibrated on the H200)."""
    path = dsa("deepseek_v32", 8)
    graphs = _llm(path, indexer_key_dtype=key_dtype)
    eager = _llm(path, indexer_key_dtype=key_dtype, enforce_eager=True)
    short = [[5, 17, 99, 3], [7, 8]]  # contexts 5.. and 3..: the first steps dense
    agree = _decode_agreement(graphs, eager, short) + _decode_agreement(graphs, eager, PROMPTS)
    assert sum(agree) >= 0.8 * 32 * len(agree), agree
    replays = _graph_replays(graphs)
    assert replays[(SPARSE,)] > 0 and replays[(DENSE,)] > 0, replays


@pytest.mark.parametrize("kind", ["deepseek_v32", "glm_moe_dsa"])
@pytest.mark.parametrize("layer_dense", [False, True])  # False: every step sparse; True: the dense routes
def test_every_token_selected_matches_transformers(dsa, monkeypatch, kind, layer_dense):
    """Every token selected, so the selection cannot tie; the model still can: the tiny DSA models route with
    sigmoid scores, and transformers' own bf16 run agrees with its float32 run only 29 of 32 times on the 7-token
    prompt (both kinds; CPU), while a router near-tie that bf16 flips moves one position's logprob by an expert's
    share (H200: 0.41 against the 0.30 tolerance, the same on both routes). So the bar is that run, per prompt
    (assert_no_worse_than_transformers_bf16). In float32 both routes equal transformers to 1e-5 (CPU, the Triton
    kernels under the interpreter). Checked on the CPU in bf16 (torch backend): both kinds and routes pass, and an
    MLA softmax scale 1.3x off fails (21 of 32 tokens on the first prompt against transformers bf16's 32)."""
    monkeypatch.setattr(SparseMLAAttention, "supports_dense_mha_prefill", layer_dense)
    assert_no_worse_than_transformers_bf16(_llm(dsa(kind, 2048)), dsa(kind, 2048), PROMPTS, device="cuda")


@pytest.mark.parametrize("kind", ["deepseek_v32", "glm_moe_dsa"])
@pytest.mark.parametrize("chunk", [None, 8])  # 8: chunked prefill over cached prefixes
def test_small_topk_no_worse_than_transformers_bf16(dsa, kind, chunk):
    path = dsa(kind, 8)
    llm = _llm(path, **({"max_num_batched_tokens": chunk} if chunk else {}))
    ours, theirs = _agreement_beside_transformers_bf16(llm, path)
    # calibrated on the CPU (tiny V3.2, all MLPs dense, bf16 vs float32, these prompts): transformers bf16 103/128,
    # ours 96, ours with the indexer's rotary layout swapped (a real bug) 43
    assert ours >= 0.8 * theirs, (ours, theirs)


def _agreement_beside_transformers_bf16(llm, path) -> tuple[int, int]:
    """Teacher-forced tokens agreeing with transformers in float32 over PROMPTS x 32: ours, and transformers' own
    bf16 run's."""
    runs = list(beside_transformers_bf16(llm, path, PROMPTS, device="cuda"))
    return sum(ours[0] for _, ours, _ in runs), sum(theirs[0] for _, _, theirs in runs)


@pytest.mark.parametrize("kind", ["deepseek_v32", "glm_moe_dsa"])
def test_fp8_keys_every_token_selected_matches_transformers(dsa, monkeypatch, kind):
    """--indexer-key-dtype fp8 through the Triton kernels (rotation + quantization in the write, fp8 scores): with
    index_topk above every context on the sparse route the selection is every token, so teacher-forced >= 30/32."""
    monkeypatch.setattr(SparseMLAAttention, "supports_dense_mha_prefill", False)
    llm = _llm(dsa(kind, 2048), indexer_key_dtype="fp8")
    assert llm.engine.core.executor.runner.kv_cache_groups[0].spec.index_dtype == torch.float8_e4m3fn
    assert_no_worse_than_transformers_bf16(llm, dsa(kind, 2048), PROMPTS, device="cuda")


def test_fp8_keys_small_topk_against_deepseek_fp8_indexer(dsa):
    """index_topk 8 with fp8 keys against transformers (float32) scoring with DeepSeek's fp8 indexer
    (tests/models/test_dsa_fp8.py): the same selection rule, so bf16 rounding alone separates them; held to the
    bar of test_small_topk_no_worse_than_transformers_bf16 (>= 0.8 x transformers' own bf16 run)."""
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer

    from tests.models.test_dsa_fp8 import fp8_indexer_forward

    path = dsa("deepseek_v32", 8)
    llm = _llm(path, indexer_key_dtype="fp8")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DeepseekV32Indexer, "forward", fp8_indexer_forward)
        ours, theirs = _agreement_beside_transformers_bf16(llm, path)
    assert ours >= 0.8 * theirs, (ours, theirs)


def _deepseek_index_case(batch: int, ctx: int, device: str = "cuda", dtype=torch.bfloat16, page: int = 16):
    """DeepSeek-V3.2's indexer shapes (64 heads x 128) over a shuffled paged cache: one decode query per request
    at the end of its ctx-token context."""
    gen = torch.Generator().manual_seed(ctx)
    nblk = -(-ctx // page)
    bt = torch.randperm(batch * nblk, generator=gen).view(batch, nblk).int()
    keys = torch.randn(batch * nblk, page, 128, generator=gen).to(dtype)
    q = torch.randn(batch, 64, 128, generator=gen).to(dtype)
    w = torch.rand(batch, 64, generator=gen) * (64 * 128) ** -0.5
    req, pos = torch.arange(batch, dtype=torch.int32), torch.full((batch,), ctx - 1, dtype=torch.int32)
    return [x.to(device) for x in (keys, bt, q, w, req, pos)]


def test_fp8_indexer_kernels_at_deepseek_shapes():
    """The Triton scores with fp8 keys against the reference reading the same fp8 values (relative error < 1e-2,
    top-2048 recall >= 0.99), and the fp8 selection against the bf16 keys' (recall >= 0.95), 4 x 6000 tokens."""
    from kestrel.attention.backends.torch_sparse_mla import select_topk_ref
    from kestrel.attention.indexer_keys import quantize_index_keys, quantize_index_queries
    from kestrel.attention.ops.triton_sparse_mla import indexer_scores, select_topk

    batch, ctx, topk = 4, 6000, 2048
    keys, bt, q, w, req, pos = _deepseek_index_case(batch, ctx)
    k8, ks = quantize_index_keys(keys.view(-1, 128))
    cache = (k8.view(keys.shape), ks.view(*keys.shape[:2], 1))
    q8, w8 = quantize_index_queries(q, w)
    got = indexer_scores(q8, w8, cache, bt, req, pos, ctx)
    mma = indexer_scores(q8, w8, cache, bt, req, pos, ctx, _fp8_dot=True)  # the float8 tiles into the FP8 MMA
    for b in range(batch):
        deq = (cache[0][bt[b].long()].float() * cache[1][bt[b].long()]).flatten(0, 1)[:ctx]
        want = (w8[b, :, None] * (q8[b].float() @ deq.T).relu()).sum(0)
        assert (got[b] - want).norm() / want.norm() < 1e-2
        assert (mma[b] - want).norm() / want.norm() < 1e-2
    qsl, lens = list(range(batch + 1)), [ctx] * batch

    def recall(a, b):
        return sum(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(a.cpu(), b.cpu())) / b.numel()

    sel = select_topk(q8, w8, cache, bt, req, pos, ctx, topk)
    assert recall(sel, select_topk_ref(q8, w8, cache, bt, qsl, lens, topk)) >= 0.99
    assert recall(sel, select_topk_ref(q.float(), w, keys.float(), bt, qsl, lens, topk)) >= 0.95


def test_radix_topk_at_32k():
    """The radix top-k (triton_topk.py) picks torch.topk's set at DeepSeek's k = 2048 over 32k float32 scores, split
    over programs or not."""
    from kestrel.attention.ops.triton_topk import radix_topk

    scores = torch.randn(8, 32768, device="cuda")
    scores[0, 20000:] = float("-inf")
    got = radix_topk(scores, 2048)
    want = scores.topk(2048, dim=-1).indices
    for g, w in zip(got.cpu(), want.cpu()):
        assert set(g.tolist()) == set(w.tolist())
    # the split kernels (radix_plan's choice for one row and for these 8) write the one-program kernel's output
    assert torch.equal(got, radix_topk(scores, 2048, programs_per_row=1))
    assert torch.equal(radix_topk(scores[:1], 2048), radix_topk(scores[:1], 2048, programs_per_row=1))
