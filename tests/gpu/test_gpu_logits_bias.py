"""logit_bias / allowed_token_ids / bad_words on the GPU (skipped without CUDA): the add-on on bf16 CUDA logits
against the plain-torch reference, and the engine with decode CUDA graphs and pipelined decode."""
import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.worker.addons.logits_bias import LogitsBias
from tests.engine.test_logits_bias import VOCAB, _reference, _state, _step

pytestmark = pytest.mark.gpu


def test_addon_on_cuda_bf16_matches_reference():
    states = [_state("plain"), _state("bias", logit_bias={3: 5.0, 7: -2.5}),
              _state("allowed", allowed_token_ids=[4, 9, 11]),
              _state("bad", output=[1, 5, 6], bad_words_token_ids=[[8], [5, 6, 12], [7, 14]])]
    addon = LogitsBias()
    for st in states:
        addon.add_request(st)
    logits = torch.randn(len(states), VOCAB, device="cuda").to(torch.bfloat16)
    expected = _reference(logits.cpu().float(), states).to(torch.bfloat16)
    torch.testing.assert_close(_step(addon, states, logits.clone()).cpu(), expected, rtol=0, atol=0)


def test_engine_with_graphs_and_pipelining(tiny_llama):
    prompt = [10, 20, 30, 40, 50]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    # CUDA graphs and pipelined decode (both on by default on CUDA), then the eager synchronous engine
    llm = LLM(str(tiny_llama), progress=False, dtype="float32", num_kv_blocks=64)
    base = llm.generate([prompt], greedy)[0].outputs[0].token_ids
    params = [greedy, greedy.clone(logit_bias={base[1]: 100.0}),
              greedy.clone(bad_words_token_ids=[[base[2], base[3]]]), greedy.clone(allowed_token_ids=base[:3])]
    outs = [o.outputs[0].token_ids for o in llm.generate([prompt] * 4, params)]
    assert outs[0] == base
    assert outs[1] == [base[1]] * 12
    assert outs[2][:3] == base[:3] and outs[2][3] != base[3]
    assert set(outs[3]) <= set(base[:3])
    eager = LLM(str(tiny_llama), progress=False, dtype="float32", enforce_eager=True, async_scheduling="off",
                num_kv_blocks=64)
    assert [o.outputs[0].token_ids for o in eager.generate([prompt] * 4, params)] == outs
