"""logit_bias, allowed_token_ids and bad_words: the runner add-on against the same changes made row by row in plain
torch (a mixed batch where only some rows use them), the real engine path on a tiny model, and their validation."""
from __future__ import annotations

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.errors import InvalidRequest
from kestrel.worker.addons import HOOKS, overriding
from kestrel.worker.addons.logits_bias import LogitsBias
from kestrel.core.step import RunnerOutput
from kestrel.worker.input_batch import RequestState
from kestrel.worker.step_outputs import InFlight

VOCAB = 50
PROMPT = [10, 20, 30, 40, 50]


def _state(rid, output=(), **params):
    return RequestState(rid, [1, 2, 3], list(output), SamplingParams(**params), [])


def _reference(logits: torch.Tensor, states: list[RequestState]) -> torch.Tensor:
    """Each row's changes in plain torch, one request at a time."""
    out = logits.clone()
    for i, st in enumerate(states):
        p = st.sampling_params
        if p.allowed_token_ids is not None:
            mask = torch.ones(out.shape[1], dtype=torch.bool)
            mask[p.allowed_token_ids] = False
            out[i, mask] = float("-inf")
        for tok, bias in (p.logit_bias or {}).items():
            out[i, tok] += bias
        for word in p.bad_words_token_ids or ():
            prefix = word[:-1]
            if not prefix or st.output_token_ids[-len(prefix):] == prefix:
                out[i, word[-1]] = float("-inf")
    return out


def _step(addon, states, logits):
    inf = InFlight(RunnerOutput(), states=states)
    addon.before_sample(logits, inf)
    return logits


def test_mixed_batch_matches_the_plain_torch_reference():
    torch.manual_seed(0)
    states = [
        _state("plain"),
        _state("bias", logit_bias={3: 5.0, 7: -2.5, 49: 0.25}),
        _state("allowed", allowed_token_ids=[4, 9, 11], logit_bias={9: 1.0}),
        _state("plain2", output=[5, 6]),
        # [8] bans 8 always; [5, 6, 12] bans 12 after 5 6 (matches); [6, 13] bans 13 after 6 (matches); [7, 14]: no
        _state("bad", output=[1, 5, 6], bad_words_token_ids=[[8], [5, 6, 12], [6, 13], [7, 14]]),
        _state("short", output=[], bad_words_token_ids=[[5, 6, 12]]),  # a prefix longer than the output
    ]
    addon = LogitsBias()
    for st in states:
        addon.add_request(st)
    assert set(addon.changes) == {"bias", "allowed", "bad", "short"}
    logits = torch.randn(len(states), VOCAB)
    expected = _reference(logits, states)
    got = _step(addon, states, logits.clone())
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert torch.equal(got[0], logits[0]) and torch.equal(got[3], logits[3])  # rows without changes untouched
    assert got[4, 12] == float("-inf") and got[4, 13] == float("-inf") and got[4, 14] == logits[4, 14]


def test_bf16_logits_take_the_bias_in_their_dtype():
    st = _state("a", logit_bias={2: 3.0})
    addon = LogitsBias()
    addon.add_request(st)
    logits = torch.randn(1, VOCAB).to(torch.bfloat16)
    got = _step(addon, [st], logits.clone())
    torch.testing.assert_close(got, _reference(logits.float(), [st]).to(torch.bfloat16), rtol=0, atol=0)


def test_no_live_request_costs_nothing_and_removal_forgets():
    addon = LogitsBias()
    plain, biased = _state("p"), _state("b", logit_bias={1: 1.0})
    addon.add_request(plain)
    assert addon.changes == {}
    addon.add_request(biased)
    addon.remove_request(biased)
    logits = torch.randn(2, VOCAB)
    assert torch.equal(_step(addon, [plain, biased], logits.clone()), logits)
    assert overriding([addon], "before_sample") == [addon.before_sample]
    assert set(h for h in HOOKS if overriding([addon], h)) == {"add_request", "remove_request", "before_sample"}


@pytest.mark.parametrize("field,value,match", [
    ("logit_bias", {10**6: 1.0}, "outside the vocabulary"),
    ("logit_bias", {-1: 1.0}, "outside the vocabulary"),
    ("logit_bias", {1: float("nan")}, "finite"),
    ("allowed_token_ids", [], "non-empty"),
    ("allowed_token_ids", [1, 10**6], "token ids in"),
    ("bad_words", [""], "non-empty strings"),
    ("bad_words_token_ids", [[1, 10**6]], "outside the model's vocabulary"),
])
def test_bad_values_name_the_field(field, value, match):
    with pytest.raises(InvalidRequest, match=match) as e:
        SamplingParams(**{field: value}).validate(vocab_size=1000)
    assert e.value.param == (field if field != "bad_words_token_ids" else "bad_words")


# ---- the real engine path on a tiny model
@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), progress=False)


def _greedy(llm, n=6, **kw):
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=20, **kw)
    return llm.generate([PROMPT], sp)[0].outputs[0]


def _ranked(out, step):
    """The token ids of step `step`'s top-20 logprobs, most likely first, with their logprobs."""
    top = {t: lp.logprob for t, lp in out.logprobs[step].items()}
    return sorted(top, key=lambda t: -top[t]), top


def test_logit_bias_moves_exactly_the_named_token(llm):
    base = _greedy(llm)
    ranked, top = _ranked(base, 0)
    first, second = ranked[0], ranked[1]
    gap = top[first] - top[second]
    assert _greedy(llm, logit_bias={second: gap + 0.05}).token_ids[0] == second
    assert _greedy(llm, logit_bias={second: gap - 0.05}).token_ids[0] == first
    # a batch: the biased request changes, the plain one beside it does not
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([PROMPT, PROMPT], [sp.clone(logit_bias={second: 100.0}), sp])
    assert outs[0].outputs[0].token_ids == [second] * 6
    assert outs[1].outputs[0].token_ids == base.token_ids


def test_allowed_token_ids_pick_the_best_allowed(llm):
    base = _greedy(llm)
    ranked, _ = _ranked(base, 0)
    allowed = [ranked[4], ranked[2], ranked[7]]
    out = _greedy(llm, allowed_token_ids=allowed)
    assert out.token_ids[0] == ranked[2]
    assert set(out.token_ids) <= set(allowed)


def test_multi_token_bad_word_bans_its_last_token_after_the_rest(llm):
    base = _greedy(llm)
    o = base.token_ids
    ranked, _ = _ranked(base, 1)  # step 1's ranking given o[0]
    assert ranked[0] == o[1]
    out = _greedy(llm, bad_words_token_ids=[[o[0], o[1]]])
    assert out.token_ids[:2] == [o[0], ranked[1]]
    # a one-token bad word never appears
    out = _greedy(llm, bad_words_token_ids=[[o[0]]])
    assert o[0] not in out.token_ids


def test_bad_words_tokenize_with_and_without_a_leading_space(llm, tiny_tokenizer):
    ids = llm.engine.input_processor.bad_words_token_ids(["hello", " world"])
    expect = []
    for w in ("hello", " hello", "world", " world"):
        t = tiny_tokenizer.encode(w, add_special_tokens=False)
        if t not in expect:
            expect.append(t)
    assert ids == expect


def test_pipelined_decode_keeps_multi_token_bans(tiny_llama, llm):
    """A multi-token bad word needs the previous token on the host: its request turns pipelining off."""
    o = _greedy(llm, n=8).token_ids
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, bad_words_token_ids=[[o[2], o[3]]])
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={o[5]: -100.0})
    want = [r.outputs[0].token_ids for r in llm.generate([PROMPT, PROMPT], [sp, plain])]
    piped = LLM(str(tiny_llama), progress=False, async_scheduling="on")
    got = [r.outputs[0].token_ids for r in piped.generate([PROMPT, PROMPT], [sp, plain])]
    assert got == want
    assert want[0][:3] == o[:3] and want[0][3] != o[3]
    assert o[5] not in want[1]
    assert piped.engine.core.scheduler.num_sync_requests == 0


def test_allowed_token_ids_over_the_vocabulary_size_and_repeats():
    """Issue 55 item 8: at most the vocabulary size (one len() before any per-id work), repeats dropped."""
    with pytest.raises(InvalidRequest, match=r"has 1001 ids; at most 1000") as e:
        SamplingParams(allowed_token_ids=[1] * 1001).validate(vocab_size=1000)
    assert e.value.param == "allowed_token_ids"
    p = SamplingParams(allowed_token_ids=[5, 3, 5, 3, 9]).validate(vocab_size=1000)
    assert p.allowed_token_ids == [5, 3, 9]


def test_a_requests_sequences_share_one_allowed_list(llm):
    """Issue 55 item 8: each of a request's n sequences arrived with its own decoded copy of allowed_token_ids
    (2M ids x n 64 held 2.4 GB in the engine); now they share one list, and the runner builds one mask for it."""
    from kestrel.ipc.protocol import add_decoder, encoder

    ids, reqs = llm.engine.input_processor.process("share", PROMPT, SamplingParams(
        n=4, temperature=1.0, max_tokens=2, allowed_token_ids=list(range(0, 300, 2))))
    core = llm.engine.core
    wired = [add_decoder.decode(encoder.encode(r)) for r in reqs]  # as the engine-core process receives them
    assert wired[0].sampling_params.allowed_token_ids is not wired[1].sampling_params.allowed_token_ids
    for r in wired:
        core.add_request(r)
    held = {id(core.scheduler.requests[r.request_id].sampling_params.allowed_token_ids) for r in wired}
    assert len(held) == 1
    while core.has_unfinished_requests():
        core.step()
    assert not core.scheduler.requests


def test_one_mask_per_shared_list_forgotten_with_its_last_request():
    allowed = [4, 9, 11]
    states = [_state(f"s{i}", allowed_token_ids=allowed) for i in range(3)] + [_state("o", allowed_token_ids=[7])]
    addon = LogitsBias()
    for st in states:
        addon.add_request(st)
    assert len(addon._masks) == 2
    logits = torch.randn(len(states), VOCAB)
    torch.testing.assert_close(_step(addon, states, logits.clone()), _reference(logits, states), rtol=0, atol=0)
    for st in states[:3]:
        addon.remove_request(st)
    assert list(addon._masks) == [id(states[3].sampling_params.allowed_token_ids)]
