"""Beam search (LLM.beam_search, vLLM's algorithm over the engine) equals transformers' num_beams on the same tiny
weights, and the search's own rules (EOS completes a beam, length penalty, width limits) hold."""
from __future__ import annotations

import pytest
import torch

from kestrel import LLM, BeamSearchParams
from kestrel.errors import InvalidRequest
from kestrel.frontend.beam_search import BeamSearch
from kestrel.frontend.outputs import Logprob

PROMPTS = [[10, 20, 30, 40, 50], [7, 8, 9]]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), progress=False, dtype="float32")


@pytest.mark.parametrize("width,steps", [(2, 6), (4, 5)])
def test_equals_transformers_num_beams(llm, tiny_llama, width, steps):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # no beam ends early on either side (ignore_eos below)
    ours = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=width, max_tokens=steps, ignore_eos=True))
    for prompt, out in zip(PROMPTS, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width, do_sample=False,
                              max_new_tokens=steps, length_penalty=1.0, early_stopping=False,
                              output_scores=True, return_dict_in_generate=True, pad_token_id=0)
        ref_seqs = ref.sequences.tolist()
        assert [s.tokens for s in out.sequences] == ref_seqs
        # transformers normalizes by the generated length; ours keeps the sum
        torch.testing.assert_close(torch.tensor([s.cum_logprob / steps for s in out.sequences]),
                                   ref.sequences_scores.float(), rtol=1e-4, atol=1e-4)
        assert all(s.finish_reason == "length" and len(s.logprobs) == steps for s in out.sequences)
        assert out.sequences[0].text == llm.tokenizer.decode(out.sequences[0].tokens)


def _lp(**tops):
    return {int(t[1:]): Logprob(v, 0) for t, v in tops.items()}


def test_eos_completes_a_beam_and_the_length_penalty_ranks_it():
    params = BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=1.0)
    s = BeamSearch([1, 1], params, eos_token_id=2)
    assert s.pending() == [[1, 1]]
    s.advance([_lp(t2=-0.1, t5=-0.5, t6=-0.7)])  # EOS is the best: a complete 3-token beam
    assert [b.tokens for b in s.completed] == [[1, 1, 2]] and [b.tokens for b in s.beams] == [[1, 1, 5], [1, 1, 6]]
    s.advance([_lp(t7=-0.2, t8=-3.0), _lp(t9=-0.1)])
    assert [b.tokens for b in s.beams] == [[1, 1, 5, 7], [1, 1, 6, 9]]
    s.advance([_lp(t3=-0.1), _lp(t4=-0.1)])
    assert s.done and s.pending() == []
    best = s.result().sequences
    # -0.1 over 2 tokens (the EOS does not count) beats -0.8 over 5
    assert [b.tokens for b in best] == [[1, 1, 2], [1, 1, 5, 7, 3]]
    assert [b.finish_reason for b in best] == ["stop", "length"]


@pytest.mark.parametrize("params,match", [
    (BeamSearchParams(beam_width=11, max_tokens=4), "beam width"),
    (BeamSearchParams(beam_width=0, max_tokens=4), "beam width"),
    (BeamSearchParams(beam_width=2, max_tokens=0), "max_tokens"),
])
def test_bad_params(llm, params, match):
    with pytest.raises(InvalidRequest, match=match):
        llm.beam_search([PROMPTS[0]], params)
