"""The bitmask: xgrammar's fill through the manager (cache, per-request matchers) and our device-side apply."""
import re
import threading

import pytest
import torch

from kestrel.core.sampling_params import StructuredOutputsParams as SO
from kestrel.structured_output.bitmask import StepBitmask, allowed_tokens, apply_token_bitmask, bitmask_width
from kestrel.structured_output.manager import FillJob, StructuredOutputManager

VOCAB = 400  # wider than the tokenizer (384), as a model's padded embedding can be
REAL = 384


@pytest.fixture
def manager(tiny_tokenizer):
    m = StructuredOutputManager(tiny_tokenizer, VOCAB, tiny_tokenizer.eos_token_id, max_rows=8)
    yield m
    m.shutdown()


def test_apply_matches_a_plain_loop():
    g = torch.Generator().manual_seed(0)
    rows, vocab = 5, 77
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, bitmask_width(vocab)), generator=g, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(rows, vocab, generator=g)
    ref = logits.clone()
    for r in range(rows):
        for t in range(vocab):
            if not (int(bitmask[r, t // 32]) >> (t % 32)) & 1:
                ref[r, t] = float("-inf")
    assert torch.equal(apply_token_bitmask(logits, bitmask), ref)
    with pytest.raises(ValueError, match="does not match"):
        apply_token_bitmask(torch.zeros(4, 77), bitmask)


def test_padding_ids_beyond_the_bitmask():
    """A model vocabulary wider than the bitmask: a constrained row loses the padding ids."""
    bitmask = torch.tensor([[5, 0]], dtype=torch.int32)  # allows tokens 0 and 2
    out = apply_token_bitmask(torch.zeros(2, 70), bitmask, rows=[0])
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [0, 2]


def test_only_the_listed_rows_are_constrained():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 100, generator=g)
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, bitmask_width(90)), generator=g, dtype=torch.int64).to(torch.int32)
    out = apply_token_bitmask(logits.clone(), bitmask, rows=[4, 1])
    for i in (0, 2, 3, 5):
        assert torch.equal(out[i], logits[i])
    for row, m in ((4, bitmask[0]), (1, bitmask[1])):
        allowed = allowed_tokens(m, 96)  # the mask covers 3 words: tokens 96.. are padding
        assert torch.isfinite(out[row]).nonzero().flatten().tolist() == allowed
        assert torch.equal(out[row, allowed], logits[row, allowed])
    with pytest.raises(ValueError, match="for 3 rows"):
        apply_token_bitmask(logits, bitmask, rows=[0, 1, 2])


def test_compile_cache_is_keyed_by_the_constraint(manager):
    a = manager.submit(SO(regex="[ab]+"))
    assert manager.submit(SO(regex="[ab]+")) is a
    b = manager.submit(SO(regex="[ab]+c"))
    assert b is not a
    a.result(30), b.result(30)
    assert manager.num_compiles == 2


def test_fill_allows_exactly_the_grammar_tokens(manager, tiny_tokenizer):
    grammar = manager.new_request_grammar(manager.submit(SO(choice=["stop", "end"])).result(30),
                                          tiny_tokenizer.eos_token_id)
    mask, rows = manager.fill_bitmask([None, grammar])
    assert rows == [1]  # the unconstrained row 0 has no mask
    assert mask.shape == (1, bitmask_width(REAL))  # the grammar sees the tokenizer's ids, not the padding
    allowed = allowed_tokens(mask[0], REAL)
    vocab = {i: tiny_tokenizer.decode([i]) for i in range(len(tiny_tokenizer))}
    expect = sorted(i for i, s in vocab.items() if s and ("stop".startswith(s) or "end".startswith(s))
                    and i not in tiny_tokenizer.all_special_ids)
    assert allowed == expect
    # walk "end" token by token: at the end only the stop token (eos) is allowed, then the grammar terminates
    for t in tiny_tokenizer.encode("end", add_special_tokens=False):
        assert grammar.accept(t)
    assert allowed_tokens(manager.fill_bitmask([grammar]).mask[0], REAL) == [tiny_tokenizer.eos_token_id]
    assert grammar.accept(tiny_tokenizer.eos_token_id) and grammar.terminated
    assert manager.fill_bitmask([grammar, None]) is None  # nothing left to constrain


def test_each_request_has_its_own_matcher(manager, tiny_tokenizer):
    compiled = manager.submit(SO(regex="(ab)+")).result(30)
    g1 = manager.new_request_grammar(compiled, tiny_tokenizer.eos_token_id)
    g2 = manager.new_request_grammar(compiled, tiny_tokenizer.eos_token_id)
    a = tiny_tokenizer.convert_tokens_to_ids("a")
    assert g1.accept(a)
    assert not g1.accept(a)  # "aa" is not in (ab)+
    assert g1.num_rejected == 1
    assert g2.accept(a)


def test_bad_grammar_fails_its_future_only(manager):
    bad = manager.submit(SO(grammar="root ::= nowhere"))
    good = manager.submit(SO(regex="x"))
    with pytest.raises(Exception):
        bad.result(30)
    assert good.result(30) is not None


def test_the_bits_past_the_vocabulary_are_cleared():
    """xgrammar may set the bits of the ids past the vocabulary's end in the last word (it does inside a JSON
    string): with a vocabulary of 72 ids (2 words + 8 bits) those are ids 72..95 and no token may take them."""
    job = FillJob(StepBitmask(torch.full((2, 3), -1, dtype=torch.int32), [0, 3]), [], tail=(1 << 8) - 1)
    mask, rows = job.result()
    assert rows == [0, 3]
    assert allowed_tokens(mask[0], 96) == allowed_tokens(mask[1], 96) == list(range(72))


def test_a_step_split_over_fill_threads_equals_one_fill(tiny_tokenizer):
    """Rows filled in slices by several threads, each slice after its grammars advanced in one batch call, give
    the masks a row-by-row fill gives."""
    m = StructuredOutputManager(tiny_tokenizer, VOCAB, tiny_tokenizer.eos_token_id, max_rows=16, fill_threads=3)
    try:
        compiled = m.submit(SO(regex="[a-z]{2,6}( [0-9]+)?")).result(30)
        grammars = [m.new_request_grammar(compiled, tiny_tokenizer.eos_token_id) for _ in range(13)]
        texts = ["ab", "abcdef", "a", "qq 1", "xy 12", "", "zz", "abc 9", "k", "mm", "nop", "rr 3", "st"]
        for g, text in zip(grammars, texts):
            for t in tiny_tokenizer.encode(text, add_special_tokens=False)[:-1]:
                assert g.accept(t)
        last = [tiny_tokenizer.encode(t, add_special_tokens=False)[-1] if t else None for t in texts]
        rows = [(2 * i + 1, g) for i, g in enumerate(grammars)]
        job = m.start_step([(g, t) for g, t in zip(grammars, last) if t is not None], rows)  # tokens, then fill
        assert len(job._futures) == 3  # three slices
        mask, where = job.result()
        assert where == [r for r, _ in rows]
        for i, g in enumerate(grammars):
            one = torch.full((1, m.width), -1, dtype=torch.int32)
            g.matcher.fill_next_token_bitmask(one, 0)
            assert torch.equal(mask[i], one[0]), texts[i]
        # a grammar that takes its stop token is complete: no row, no more tokens
        eos = tiny_tokenizer.eos_token_id
        job = m.start_step([(grammars[1], eos)], rows[:2])
        assert grammars[1].terminated and job.result().rows == [rows[0][0]]
        assert m.start_step([(grammars[1], 5)], rows[1:2]) is None and grammars[1].num_rejected == 0
    finally:
        m.shutdown()
