"""The bitmask: xgrammar's fill through the manager (cache, per-request matchers) and our device-side apply."""
import re
import threading

import pytest
import torch

from kestrel.engine.sampling_params import StructuredOutputsParams as SO
from kestrel.structured_output.bitmask import allowed_tokens, apply_token_bitmask, bitmask_width
from kestrel.structured_output.manager import StructuredOutputManager

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
