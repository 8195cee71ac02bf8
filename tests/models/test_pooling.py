"""Pooling models offline: a tiny random Qwen3ForSequenceClassification and a bare Qwen3Model (a last-token
embedder) loaded through our loader give transformers' class probabilities and embeddings on the same weights
(CPU float32, atol 1e-5); scores, Matryoshka truncation and the runner/convert rules."""
from __future__ import annotations

import pytest
import torch

from kestrel.core.pooling import pooling_task
from kestrel.errors import ConfigError, InvalidRequest
from tests.pooling_tiny import hf_class_logits, hf_embedding, make_classifier, make_embedder

ATOL = 1e-5
PROMPTS = ["hello world", "the cat sat on the mat and looked at the door", "a"]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory, tiny_tokenizer):
    return make_classifier(tmp_path_factory.mktemp("cls"), tiny_tokenizer, num_labels=3)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory, tiny_tokenizer):
    return make_classifier(tmp_path_factory.mktemp("ce"), tiny_tokenizer, num_labels=1, seed=3)


@pytest.fixture(scope="module")
def embedder(tmp_path_factory, tiny_tokenizer):
    return make_embedder(tmp_path_factory.mktemp("emb"), tiny_tokenizer, matryoshka_dimensions=[16, 32])


def _llm(path, **kw):
    from kestrel import LLM

    return LLM(str(path), progress=False, device="cpu", num_kv_blocks=64, **kw)


def test_classify_equals_transformers(classifier):
    llm = _llm(classifier, max_num_batched_tokens=8)  # the long prompt is prefilled in chunks
    outs = llm.classify(PROMPTS)
    assert len(outs) == len(PROMPTS)
    for o in outs:
        logits = hf_class_logits(classifier, o.prompt_token_ids)
        torch.testing.assert_close(torch.tensor(o.outputs.probs), logits.softmax(-1), atol=ATOL, rtol=0)
    raw = llm.classify(PROMPTS[0], activation=False)[0]
    torch.testing.assert_close(torch.tensor(raw.outputs.probs), hf_class_logits(classifier, raw.prompt_token_ids),
                               atol=ATOL, rtol=0)
    core = llm.engine.core  # prefill-only: every block is free again (cached prefixes are evictable)
    assert core.kv.usage == 0.0 and not core.scheduler.running and not core.scheduler.requests


def test_embed_equals_transformers(embedder):
    llm = _llm(embedder)
    outs = llm.embed(PROMPTS)
    for o in outs:
        ref = hf_embedding(embedder, o.prompt_token_ids)
        assert torch.nn.functional.cosine_similarity(torch.tensor(o.outputs.embedding), ref, dim=0) > 0.9999
        torch.testing.assert_close(torch.tensor(o.outputs.embedding), ref, atol=ATOL, rtol=0)
    short = llm.embed(PROMPTS[1], dimensions=16)[0].outputs.embedding
    assert len(short) == 16
    from transformers import AutoModel  # Matryoshka: the first 16 dims of the raw state, then normalised
    with torch.no_grad():
        model = AutoModel.from_pretrained(embedder, dtype=torch.float32).eval()
        hidden = model(torch.tensor([outs[1].prompt_token_ids])).last_hidden_state[0, -1, :16]
    torch.testing.assert_close(torch.tensor(short), torch.nn.functional.normalize(hidden, dim=-1), atol=ATOL, rtol=0)
    with pytest.raises(InvalidRequest, match="dimensions 20 is not one this model serves"):
        llm.embed(PROMPTS[0], dimensions=20)
    with pytest.raises(InvalidRequest, match="this server runs a pooling model \\(embed\\)"):
        from kestrel import SamplingParams
        llm.generate("hello", SamplingParams(max_tokens=2))


def test_score_cross_encoder_and_cosine(cross_encoder, embedder, tiny_tokenizer):
    llm = _llm(cross_encoder)
    docs = ["the capital is paris", "cats sleep a lot"]
    outs = llm.score("what is the capital", docs)
    for o, d in zip(outs, docs):
        ids = list(tiny_tokenizer("what is the capital", d)["input_ids"])
        ref = hf_class_logits(cross_encoder, ids).sigmoid()[0]
        assert o.outputs.score == pytest.approx(float(ref), abs=ATOL)
    emb = _llm(embedder)
    scores = [o.outputs.score for o in emb.score("what is the capital", docs)]
    q = hf_embedding(embedder, tiny_tokenizer("what is the capital")["input_ids"])
    for s, d in zip(scores, docs):
        assert s == pytest.approx(float(q @ hf_embedding(embedder, tiny_tokenizer(d)["input_ids"])), abs=ATOL)


def test_classifier_with_several_labels_refuses_scores(classifier):
    with pytest.raises(InvalidRequest, match="one output label; this classifier has 3"):
        _llm(classifier).score("q", ["d"])


@pytest.mark.parametrize("arch,runner,convert,task", [
    ("Qwen3ForSequenceClassification", "auto", "auto", "classify"),
    ("LlamaForSequenceClassification", "pooling", "auto", "classify"),
    ("Qwen3Model", "auto", "auto", "embed"),
    ("Qwen3ForCausalLM", "auto", "auto", None),
    ("Qwen3ForCausalLM", "pooling", "auto", "embed"),
    ("Qwen3ForCausalLM", "auto", "embed", "embed"),
])
def test_pooling_task(arch, runner, convert, task):
    assert pooling_task(arch, runner, convert) == task


@pytest.mark.parametrize("arch,runner,convert,why", [
    ("Qwen3ForSequenceClassification", "generate", "auto", "is a pooling model"),
    ("Qwen3ForCausalLM", "pooling", "classify", "has no classification head"),
    ("Qwen3Model", "auto", "classify", "is an embed model"),
    ("Qwen3ForCausalLM", "generate", "embed", "needs --runner pooling"),
    ("Qwen3ForCausalLM", "auto", "reward", "only embed and classify"),
])
def test_pooling_task_refusals(arch, runner, convert, why):
    with pytest.raises(ConfigError, match=why):
        pooling_task(arch, runner, convert)


def test_causal_lm_converted_to_embedder(tmp_path, tiny_tokenizer):
    """--convert embed on a *ForCausalLM: the decoder's last-token state, normalised (the LM head unused)."""
    from transformers import AutoModelForCausalLM

    from tests.tiny import make_checkpoint

    path = make_checkpoint("qwen3", tmp_path, tokenizer=tiny_tokenizer)
    out = _llm(path, convert="embed").embed(PROMPTS[1])[0]
    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        hidden = model.model(torch.tensor([out.prompt_token_ids])).last_hidden_state[0, -1]
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), torch.nn.functional.normalize(hidden, dim=-1),
                               atol=ATOL, rtol=0)
