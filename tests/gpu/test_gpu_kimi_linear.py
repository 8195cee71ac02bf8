"""GPU checks for Kimi Linear (skipped without CUDA): a tiny checkpoint with Kimi-Linear's KDA head size (128) in
bf16, the fused Triton decode selected by the gate table, teacher-forced against transformers (float32, on weights
bf16 holds exactly: the exact model) with CUDA graphs on and off and with the prefill through fla-core's batched
chunk_kda (where its gate row is open) or PyTorch's per-request form, graph replay (fused decode over the
null-slot padding) equal to eager, and a prefix-cache hit (a state snapshot copied on the GPU, pipelined steps,
graphs on) giving the tokens of a run that computed the whole prompt."""
import pytest

from kestrel import LLM, SamplingParams
from kestrel.attention.kda import PREFILL_KERNEL, KDAImpl
from kestrel.platform.testing import requires_kernel
from tests.agreement import (MIXED_PROMPTS, assert_graph_replay_equals_eager, assert_teacher_forced,
                             import_without_fla)

pytestmark = [pytest.mark.gpu, requires_kernel("triton_kda_fused_decode")]
KV_BLOCKS = 2048


import_without_fla("transformers.models.kimi_linear.modeling_kimi_linear",
                   ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"))


@pytest.fixture(scope="module")
def kimi(tmp_path_factory, tiny_tokenizer):
    from tests.tiny import kimi_linear_bf16_checkpoint

    return kimi_linear_bf16_checkpoint(tmp_path_factory.mktemp("gpu_kimi"), tokenizer=tiny_tokenizer)


FLA = pytest.param("fla", marks=requires_kernel(PREFILL_KERNEL))


def kda_prefill_kernels(llm) -> set:
    """The batched prefill kernel each KDA layer resolved (None: per request)."""
    layers = llm.engine.core.executor.runner.loaded.context.attention_layers.values()
    return {layer.impl.varlen_delta_rule for layer in layers if isinstance(layer.impl, KDAImpl)}


@pytest.mark.parametrize("prefill", [FLA, "torch"])
@pytest.mark.parametrize("eager", [False, True])
def test_bf16_teacher_forced(kimi, eager, prefill, monkeypatch):
    if prefill == "torch":  # the per-request PyTorch prefill, as where the row is closed
        monkeypatch.setattr(KDAImpl, "prefill_kernel", classmethod(lambda cls, platform, dtype: None))
    llm = LLM(str(kimi), dtype="bfloat16", progress=False, num_kv_blocks=KV_BLOCKS, max_model_len=512,
              enforce_eager=eager)
    runner = llm.engine.core.executor.runner
    assert "triton_kda" in {b.name for b in runner.backends}
    assert (runner.graphs is None) == eager
    assert_teacher_forced(llm, kimi, MIXED_PROMPTS, n=32, spare=1, device="cuda")
    if prefill == "fla":
        from kestrel.kernels.fla_kda import chunk_kda_varlen
        assert kda_prefill_kernels(llm) == {chunk_kda_varlen}
    else:
        assert kda_prefill_kernels(llm) == {None}


def test_cuda_graph_replay_equals_eager(kimi):
    # 12 requests: graphs padded to 16 rows on the null slot
    assert_graph_replay_equals_eager(kimi, MIXED_PROMPTS, KV_BLOCKS, max_model_len=512)


def test_prefix_hit_from_a_snapshot_equals_a_fresh_run(kimi):
    """A next turn hits the first prompt's snapshot at its last full block (32 of 33 tokens, blocks of 16),
    restored into its slot on the GPU before the forward; its tokens equal a fresh engine's, which computes the
    same 32-token chunk and tail itself (the chunk rule cuts the same way), decodes through the same graphs."""
    first = [(7 * i + 3) % 300 + 20 for i in range(33)]
    extended = first + [11, 12, 13]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    def engine():
        llm = LLM(str(kimi), dtype="bfloat16", progress=False, num_kv_blocks=KV_BLOCKS, max_model_len=512)
        assert llm.engine.core.executor.runner.graphs is not None and llm.engine.core.kv.enable_prefix_caching
        return llm

    warm = engine()
    warm.generate([first], params)
    hit = warm.generate([extended], params)[0]
    assert hit.num_cached_tokens == 32 and warm.engine.core.kv.prefix_hits >= 32
    fresh = engine().generate([extended], params)[0]
    assert fresh.num_cached_tokens == 0
    assert hit.outputs[0].token_ids == fresh.outputs[0].token_ids
