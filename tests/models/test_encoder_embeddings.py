"""BERT-style encoder embedding models offline: tiny random BertModel / XLMRobertaModel checkpoints written by
transformers, loaded through our loader, embed as transformers' last hidden states pooled and L2-normalised
(CLS by default, as vLLM's BertModel; mean or CLS when a sentence-transformers config says so), cosine > 0.9999
and atol 1e-5 in CPU float32. sentence-transformers is not installed: the reference pooling is plain torch over
transformers' hidden states (tests/pooling_tiny.py hf_encoder_embedding). Also: an encoder prompt is computed in
one step (never chunked; over the step budget it is refused), nothing is served from the prefix cache, and a
batch of prompts equals each alone."""
from __future__ import annotations

import json

import pytest
import torch

from kestrel.errors import ConfigError, InvalidRequest
from tests.pooling_tiny import hf_encoder_embedding, make_encoder

ATOL = 1e-5
PROMPTS = ["hello world", "the cat sat on the mat and looked at the door", "a", "the cat sat on the mat"]


def _llm(path, **kw):
    from kestrel import LLM

    return LLM(str(path), progress=False, device="cpu", num_kv_blocks=64, **kw)


def _check(outs, path, pooling):
    for o in outs:
        got = torch.tensor(o.outputs.embedding)
        ref = hf_encoder_embedding(path, o.prompt_token_ids, pooling)
        assert torch.nn.functional.cosine_similarity(got, ref, dim=0) > 0.9999
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("model_type,st_pooling,expected", [
    ("bert", None, "cls"),  # no sentence-transformers config: CLS, vLLM's default for BertModel
    ("bert", "mean", "mean"),  # E5 / MiniLM style
    ("bert", "cls", "cls"),  # BGE style
    ("xlm-roberta", "mean", "mean"),  # multilingual E5 style: positions after the padding id
])
def test_encoder_embeddings_equal_transformers(tmp_path, tiny_tokenizer, model_type, st_pooling, expected):
    path = make_encoder(tmp_path, tiny_tokenizer, model_type, st_pooling)
    llm = _llm(path, max_num_batched_tokens=32)  # each prompt fits; the batch does not: steps take several
    core = llm.engine.core
    assert core.model_config.pooling_method == expected and core.model_config.encoder_only
    outs = llm.embed(PROMPTS)
    _check(outs, path, expected)
    again = llm.embed(PROMPTS[1])[0]  # the same prompt again: computed again, never from the prefix cache
    torch.testing.assert_close(torch.tensor(again.outputs.embedding), torch.tensor(outs[1].outputs.embedding),
                               atol=ATOL, rtol=0)
    assert not core.kv.enable_prefix_caching and core.kv.prefix_hits == 0
    assert core.kv.usage == 0.0 and not core.scheduler.requests  # prefill-only: every block is free again


def test_encoder_prompt_is_never_split(tmp_path, tiny_tokenizer):
    """Chunked prefill would let the first tokens miss the later ones: a prompt longer than the step budget is
    refused with a 400-style error, before it reaches the engine."""
    path = make_encoder(tmp_path, tiny_tokenizer)
    llm = _llm(path, max_num_batched_tokens=8)
    long = PROMPTS[1]
    n = len(tiny_tokenizer(long)["input_ids"])
    assert n > 8
    with pytest.raises(InvalidRequest, match=f"bidirectional prefix .*{n} tokens.*--max-num-batched-tokens 8"):
        llm.embed(long)
    _check(llm.embed(PROMPTS[2]), path, "cls")  # a short one still fits


def test_sentence_transformers_pooling_we_lack_is_refused(tmp_path, tiny_tokenizer):
    path = make_encoder(tmp_path, tiny_tokenizer, pooling="mean")
    cfg = path / "1_Pooling" / "config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "pooling_mode_mean_tokens": False,
                               "pooling_mode_max_tokens": True}))
    with pytest.raises(ConfigError, match="asks for pooling \\['pooling_mode_max_tokens'\\]"):
        _llm(path)
