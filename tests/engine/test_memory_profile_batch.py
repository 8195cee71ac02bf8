"""The memory-profiling batch stays inside the context length and the block tables (a batch longer than the
model's positions once read past the rotary cache and the block table on the GPU)."""
import torch

from kestrel.config import EngineConfig
from kestrel.engine.core import EngineCore
from kestrel.worker.memory_profile import dummy_prefill_batch


def test_dummy_prefill_batch_is_valid(tiny_llama):
    core = EngineCore(EngineConfig.create(model=str(tiny_llama), num_kv_blocks=8, max_num_batched_tokens=1200),
                      progress=False)
    runner = core.executor.runner
    ids, positions, ctx = dummy_prefill_batch(runner, 1200)  # context is 512: three sequences
    (meta,) = ctx.attn_metadata
    assert meta.seq_lens_cpu == [512, 512, 176] and int(positions.max()) == 511
    assert meta.block_tables.shape == (3, 32)
    assert int(meta.block_tables.max()) < runner.num_blocks
    with torch.inference_mode():
        hidden = runner.model(ids, positions, ctx)
    assert hidden.shape[0] == 1200 and torch.isfinite(hidden).all()


def test_dummy_prefill_batch_may_hold_more_sequences_than_max_num_seqs(tiny_llama):
    # batch-1 serving (max_num_seqs=1) with a short context: the profile batch still splits the token budget into
    # context-long sequences, more of them than the step buffers hold rows for (this crashed start-up)
    core = EngineCore(EngineConfig.create(model=str(tiny_llama), num_kv_blocks=8, max_num_seqs=1, max_model_len=128,
                                          max_num_batched_tokens=1000), progress=False)
    runner = core.executor.runner
    ids, positions, ctx = dummy_prefill_batch(runner, 1000)
    (meta,) = ctx.attn_metadata
    assert meta.seq_lens_cpu == [128] * 7 + [104] and meta.block_tables.shape[0] == 8
    with torch.inference_mode():
        assert torch.isfinite(runner.model(ids, positions, ctx)).all()
