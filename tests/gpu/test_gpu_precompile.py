"""GPU check (skipped without CUDA): the parallel pre-compilation covers every Triton variant of start-up, so the
profile run, the kernel warm-up and the CUDA-graph capture compile nothing more, and the engine's tokens are
the same as without it."""
import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.config import EngineConfig

pytestmark = pytest.mark.gpu


def test_precompile_covers_start_up(tmp_path, tiny_tokenizer, monkeypatch):
    from kestrel.kernels.triton_ops.precompile import CompileCounter
    from kestrel.executor.runner_build import build_runner
    from tests.tiny import make_checkpoint

    # A shape no other test uses: its kernel variants are not yet in this process's in-memory Triton caches.
    path = make_checkpoint("qwen3", tmp_path, tokenizer=tiny_tokenizer, hidden_size=320, intermediate_size=704,
                           num_attention_heads=5, num_key_value_heads=1, head_dim=64)
    # The profile run sizes the cache, as in serving: a share of the card that leaves ~3 GiB past what is in use
    # already (other xdist workers hold memory on the same GPU; a fixed 0.15 of 79 GiB found 14 GiB in use)
    free, total = torch.cuda.mem_get_info()
    cfg = EngineConfig.create(model=str(path), dtype="bfloat16", max_num_seqs=64, max_num_batched_tokens=2048,
                              gpu_memory_utilization=min(0.95, (total - free + 3 * 2**30) / total))
    runner = build_runner(cfg, progress=False)
    with CompileCounter() as ahead:
        runner.precompile_kernels()
    assert ahead.count >= 8, ahead.count  # norms, qk-norm/rope/cache, prefill and decode attention, GEMV, ...
    with CompileCounter() as later:
        runner.allocate_kv_cache(runner.determine_num_blocks())
        runner.setup_after_kv()
    assert runner.graphs is not None
    assert later.count == 0, later.count
    del runner

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[5, 17, 99, 3], list(range(10, 40))]
    a = [o.outputs[0].token_ids for o in LLM(str(path), dtype="bfloat16", progress=False,
                                              num_kv_blocks=512).generate(prompts, params)]
    b = [o.outputs[0].token_ids for o in LLM(str(path), dtype="bfloat16", progress=False, precompile=False,
                                              num_kv_blocks=512).generate(prompts, params)]
    assert a == b
