"""The Triton LoRA shrink/expand (kestrel/kernels/triton_ops/lora.py) against the PyTorch reference on a batch
mixing slots and tokens without an adapter, for a merged (3-shard) and a plain layer, ranks below the slot width.
Runs on CUDA or under the Triton interpreter on the CPU (make kernels-check); skipped otherwise."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from kestrel.platform import triton_gates as gates  # noqa: E402

_ok, _why = gates.triton_runnable()
pytestmark = pytest.mark.skipif(not _ok, reason=_why)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.float16 if DEVICE == "cuda" else torch.float32


@pytest.mark.parametrize("shards,k,rank,num_tokens", [((64, 32, 32), 96, 16, 37), ((80,), 130, 8, 5),
                                                      ((48, 48), 64, 64, 1), ((32,), 64, 16, 70)])
def test_triton_lora_matches_reference(shards, k, rank, num_tokens):
    from kestrel.kernels.triton_ops.lora import lora_expand, lora_shrink
    from kestrel.lora.layers import LoRAMapping, lora_delta_torch

    num_slots = 3
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, k, generator=gen).to(DEVICE, DTYPE)
    a = (torch.randn(num_slots, len(shards) * rank, k, generator=gen) * k ** -0.5).to(DEVICE, DTYPE)
    b = (torch.randn(num_slots, sum(shards), rank, generator=gen) * rank ** -0.5).to(DEVICE, DTYPE)
    b[2, :, rank // 2:] = 0  # a smaller adapter in a wider slot: its extra ranks are zero
    base = torch.randn(num_tokens, sum(shards), generator=gen).to(DEVICE, DTYPE)
    slots = np.random.default_rng(num_tokens).integers(-1, num_slots, num_tokens)

    mapping = LoRAMapping(128, num_slots, torch.device(DEVICE), "torch")
    mapping.set(slots)
    ref = base.clone().double()
    lora_delta_torch(x.double(), ref, a.double(), b.double(), rank, shards, mapping.groups)

    out = base.clone()
    y = lora_shrink(x, a, mapping)
    lora_expand(y, b, out, mapping, rank, shards)
    none = torch.from_numpy(slots < 0).to(DEVICE)
    assert torch.equal(out[none], base[none])  # tokens without an adapter are untouched
    delta, ref_delta = (out.double() - base.double()), ref - base.double()
    assert ref_delta.norm() > 0
    assert ((delta - ref_delta).norm() / ref_delta.norm()).item() < (5e-3 if DTYPE == torch.float16 else 1e-5)


def test_triton_lora_rounds_like_reference_path():
    """In half precision the PyTorch path rounds where the kernels do (x A^T to fp16, the delta in float32, one
    rounding of out + delta), so the two agree to one fp16 ulp: the GPU test compares the Triton path with it.
    (float16: the interpreter does not compute in bfloat16.)"""
    from kestrel.kernels.triton_ops.lora import lora_expand, lora_shrink
    from kestrel.lora.layers import LoRAMapping, lora_delta_torch

    shards, k, rank, num_tokens, num_slots = (64, 32, 32), 96, 16, 45, 3
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(num_tokens, k, generator=gen).to(DEVICE, torch.float16)
    a = (torch.randn(num_slots, len(shards) * rank, k, generator=gen) * k ** -0.5).to(DEVICE, torch.float16)
    b = (torch.randn(num_slots, sum(shards), rank, generator=gen) * rank ** -0.5).to(DEVICE, torch.float16)
    base = torch.randn(num_tokens, sum(shards), generator=gen).to(DEVICE, torch.float16)
    mapping = LoRAMapping(128, num_slots, torch.device(DEVICE), "torch")
    mapping.set(np.random.default_rng(7).integers(-1, num_slots, num_tokens))
    ref = base.clone()
    lora_delta_torch(x, ref, a, b, rank, shards, mapping.groups)
    out = base.clone()
    lora_expand(lora_shrink(x, a, mapping), b, out, mapping, rank, shards)
    assert not torch.equal(ref, base)
    torch.testing.assert_close(out, ref, rtol=2 ** -10, atol=2 ** -14)


@pytest.mark.skipif(DEVICE == "cuda", reason="CPU float32 under the interpreter; tests/gpu/test_gpu_lora.py on CUDA")
def test_engine_with_triton_lora_equals_reference(tmp_path, tiny_tokenizer):
    """The whole engine on the Triton LoRA path gives the PyTorch reference path's tokens (mixed batch)."""
    from kestrel import LLM, SamplingParams
    from tests.lora.peft_utils import write_random_adapter
    from tests.tiny import make_checkpoint

    base = make_checkpoint("qwen2", tmp_path, tokenizer=tiny_tokenizer)  # q/k/v bias, tied embeddings
    adapters = {"a": write_random_adapter(base, tmp_path / "a", 8, seed=1),
                "b": write_random_adapter(base, tmp_path / "b", 16, seed=2, targets=["q_proj", "v_proj", "o_proj"])}
    prompts = [[5, 17, 99, 3], list(range(10, 30)), [7] * 9]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = {}
    for backend in ("triton", "torch"):
        llm = LLM(str(base), progress=False, enable_lora=True, max_lora_rank=16, lora_backend=backend, device=DEVICE)
        assert llm.engine.core.executor.runner.lora.backend == backend
        loras = [llm.load_lora(n, str(p)) for n, p in adapters.items()]
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=loras + [None])]
    assert outs["triton"] == outs["torch"]
