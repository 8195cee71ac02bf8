"""GPU checks for the Gated DeltaNet hybrids (skipped without CUDA): tiny Qwen3-Next, Qwen3.5 and Qwen3.5-MoE
checkpoints with Qwen3.5's head sizes (GDN D_k = D_v = 128, key heads repeated to value heads; attention heads of
256 with partial RoPE) in bf16, the fused Triton decode (its GDN form) selected by the gate table, teacher-forced
against transformers (float32, on weights bf16 holds exactly: the exact model) at >= 30 of 32 tokens with CUDA
graphs on and off; the batched prefill by each gate row (fla chunk_gated_delta_rule, fla chunk_kda with the
broadcast decay, PyTorch per request); graph replay equal to eager; and a prefix-cache hit from a GDN state
snapshot giving the tokens of a run that computed the whole prompt. Mirrors tests/gpu/test_gpu_kimi_linear.py.

The MoE kinds (Qwen3-Next, Qwen3.5-MoE) are held to transformers' own bf16 run instead (tests/agreement.py's
MOE_BAR, checked on the CPU by tests/models/test_bf16_beside_transformers.py): their router near-ties flip with bf16
rounding, and transformers' bf16 run agrees with its float32 run at only 22-31 of 32 tokens per prompt (CPU, seeds
0-5), with logprob errors up to 3.0."""
import pytest

from kestrel import LLM, SamplingParams
from kestrel.attention.kda import GDN_PREFILL_KERNEL, PREFILL_KERNEL, KDAImpl
from kestrel.platform.testing import requires_kernel
from tests.agreement import (MIXED_PROMPTS, MOE_BAR, assert_graph_replay_equals_eager,
                             assert_no_worse_than_transformers_bf16, assert_teacher_forced, import_without_fla)

pytestmark = [pytest.mark.gpu, requires_kernel("triton_kda_fused_decode")]
KV_BLOCKS = 2048
KINDS = ["qwen3_next", "qwen3_5", "qwen3_5_moe"]
MOE = {"qwen3_next", "qwen3_5_moe"}

for _module in ("qwen3_next.modeling_qwen3_next", "qwen3_5.modeling_qwen3_5", "qwen3_5_moe.modeling_qwen3_5_moe"):
    import_without_fla(f"transformers.models.{_module}",
                       ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"))


@pytest.fixture(scope="module", params=KINDS)
def gdn(request, tmp_path_factory, tiny_tokenizer):
    from tests.tiny import gdn_bf16_checkpoint

    return gdn_bf16_checkpoint(request.param, tmp_path_factory.mktemp(f"gpu_{request.param}"),
                               tokenizer=tiny_tokenizer)


def prefill_kernels(llm) -> set:
    """The batched prefill kernel each GDN layer resolved (None: per request)."""
    layers = llm.engine.core.executor.runner.loaded.context.attention_layers.values()
    return {layer.impl.varlen_delta_rule for layer in layers if isinstance(layer.impl, KDAImpl)}


def assert_agrees(llm, path) -> None:
    """Teacher-forced against transformers in float32: the dense kind >= 30/32 with at most one position's logprob
    beyond the bf16 tolerance; the MoE kinds no worse than transformers' own bf16 run."""
    if path.name in MOE:
        assert_no_worse_than_transformers_bf16(llm, path, MIXED_PROMPTS, device="cuda", **MOE_BAR)
    else:
        assert_teacher_forced(llm, path, MIXED_PROMPTS, n=32, spare=1, device="cuda")


def engine(path, **kw) -> LLM:
    return LLM(str(path), dtype="bfloat16", progress=False, num_kv_blocks=KV_BLOCKS, max_model_len=512, **kw)


@pytest.mark.parametrize("eager", [False, True])
def test_bf16_teacher_forced(gdn, eager):
    llm = engine(gdn, enforce_eager=eager)
    runner = llm.engine.core.executor.runner
    assert {"triton_kda", "triton"} <= {b.name for b in runner.backends}
    assert (runner.graphs is None) == eager
    assert_agrees(llm, gdn)


GDN_ROW = pytest.param("fla_gdn", marks=requires_kernel(GDN_PREFILL_KERNEL))
KDA_ROW = pytest.param("fla_kda", marks=requires_kernel(PREFILL_KERNEL))


@pytest.mark.parametrize("prefill", [GDN_ROW, KDA_ROW, "torch"])
def test_bf16_teacher_forced_by_prefill_row(gdn, prefill, monkeypatch):
    """The batched prefill through each gate row's kernel (graphs on), the others taken as closed."""
    from kestrel.kernels import fla_kda

    if prefill != "fla_gdn":
        monkeypatch.setattr(KDAImpl, "gdn_prefill_kernel", classmethod(lambda cls, platform, dtype: None))
    if prefill == "torch":
        monkeypatch.setattr(KDAImpl, "prefill_kernel", classmethod(lambda cls, platform, dtype: None))
    llm = engine(gdn)
    assert_agrees(llm, gdn)
    want = {"fla_gdn": fla_kda.chunk_gdn_varlen, "fla_kda": fla_kda.chunk_kda_varlen, "torch": None}[prefill]
    assert prefill_kernels(llm) == {want}


def test_cuda_graph_replay_equals_eager(gdn):
    # 12 requests: graphs padded to 16 rows on the null slot
    assert_graph_replay_equals_eager(gdn, MIXED_PROMPTS, KV_BLOCKS, max_model_len=512)


def test_prefix_hit_from_a_snapshot_equals_a_fresh_run(gdn):
    """A next turn hits the first prompt's GDN snapshot at its last full block (32 of 33 tokens, blocks of 16),
    restored into its slot on the GPU; its tokens equal a fresh engine's."""
    first = [(7 * i + 3) % 300 + 20 for i in range(33)]
    extended = first + [11, 12, 13]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    warm = engine(gdn)
    assert warm.engine.core.executor.runner.graphs is not None and warm.engine.core.kv.enable_prefix_caching
    warm.generate([first], params)
    hit = warm.generate([extended], params)[0]
    assert hit.num_cached_tokens == 32 and warm.engine.core.kv.prefix_hits >= 32
    fresh = engine(gdn).generate([extended], params)[0]
    assert fresh.num_cached_tokens == 0
    assert hit.outputs[0].token_ids == fresh.outputs[0].token_ids
