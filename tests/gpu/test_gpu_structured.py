"""Structured outputs on CUDA: the device-side bitmask equals the CPU one, and constrained generation holds with
pipelined decode (on by default on CUDA), where the bitmask is filled while the forward runs."""
import json
import re

import jsonschema
import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.core.sampling_params import StructuredOutputsParams as SO
from kestrel.structured_output.bitmask import apply_token_bitmask, bitmask_width

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitmask_on_cuda_matches_cpu(dtype, monkeypatch):
    """The Triton apply (the one chosen on CUDA) refuses exactly what the CPU path refuses: a subset of the
    rows, with a model vocabulary wider than the grammar's (the 152k / 100k shape of benchmarks/structured.py)."""
    from kestrel.kernels.triton_ops import token_bitmask

    calls = []
    real = token_bitmask.apply_token_bitmask_triton
    monkeypatch.setattr(token_bitmask, "apply_token_bitmask_triton", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 151936, generator=g)
    rows = list(range(63, 0, -3))
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(rows), bitmask_width(100000)), generator=g,
                            dtype=torch.int64).to(torch.int32)
    ref = apply_token_bitmask(logits.clone(), bitmask, rows)
    got = apply_token_bitmask(logits.cuda().to(dtype), bitmask.pin_memory(), rows)
    assert calls == [1]
    assert torch.equal(torch.isinf(got.float().cpu()), torch.isinf(ref))


def test_constrained_generation_pipelined(tiny_llama, caplog):
    llm = LLM(str(tiny_llama), progress=False, num_kv_blocks=256, max_model_len=256, enforce_eager=False)
    assert llm.engine.core.pipelined
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["fox", "dog"]}},
              "required": ["ok", "tag"], "additionalProperties": False}
    params = [SamplingParams(max_tokens=60, temperature=1.0, seed=i, structured_outputs=SO(json=schema))
              for i in range(16)]
    params += [SamplingParams(max_tokens=12, temperature=1.0, seed=i, n=2, structured_outputs=SO(regex="[0-9]{4}"))
               for i in range(8)]
    params += [SamplingParams(max_tokens=20, temperature=1.0, seed=i) for i in range(8)]
    outs = llm.generate(["The quick brown fox"] * len(params), params)
    for o in outs[:16]:
        jsonschema.validate(json.loads(o.outputs[0].text), schema)
    for o in outs[16:24]:
        assert all(re.fullmatch("[0-9]{4}", c.text) for c in o.outputs)
    assert llm.engine.core.grammars.manager.num_compiles == 2
    assert "rejected by the grammar" not in caplog.text  # every sampled token was one the mask allowed
