"""A BERT-style embedding model (tiny random BertModel with a sentence-transformers mean-pooling config, E5
style) behind `kestrel serve`: /v1/embeddings answers the real openai client (base64 and floats) with
transformers' mean-pooled, L2-normalised hidden states (plain torch pooling; cosine > 0.9999, atol 1e-5), and a
prompt longer than the step budget (an encoder prompt is never split) gets an OpenAI-style 400."""
from __future__ import annotations

import openai
import pytest
import torch

from tests.pooling_tiny import hf_encoder_embedding, make_encoder
from tests.server.conftest import Server, http

ATOL = 1e-5


@pytest.fixture(scope="module")
def encoder(tmp_path_factory, tiny_tokenizer):
    return make_encoder(tmp_path_factory.mktemp("enc"), tiny_tokenizer, "bert", pooling="mean")


@pytest.fixture(scope="module")
def server(encoder, tmp_path_factory):
    s = Server(encoder, tmp_path_factory.mktemp("logs") / "bert.log",
               extra=["--max-num-batched-tokens", "16"]).wait_ready()
    yield s
    s.stop()


def test_bert_embeddings_openai_client(server, encoder, tiny_tokenizer):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    texts = ["hello world", "the cat sat on the mat", "a"]
    for fmt in ("base64", "float"):  # the client asks for base64 unless told
        kw = {"encoding_format": fmt} if fmt == "float" else {}
        res = client.embeddings.create(model="bert_mean", input=texts, **kw)
        assert [d.index for d in res.data] == [0, 1, 2]
        for d, t in zip(res.data, texts):
            got = torch.tensor(d.embedding, dtype=torch.float32)
            ref = hf_encoder_embedding(encoder, list(tiny_tokenizer(t)["input_ids"]), "mean")
            assert torch.nn.functional.cosine_similarity(got, ref, dim=0) > 0.9999
            torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
        assert res.usage.prompt_tokens == sum(len(tiny_tokenizer(t)["input_ids"]) for t in texts)


def test_encoder_prompt_over_step_budget_is_400(server):
    status, body = http("POST", server.url + "/v1/embeddings", {"input": list(range(3, 23))})
    assert status == 400, body
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == "prompt"
    assert "20 tokens" in body["error"]["message"] and "--max-num-batched-tokens 16" in body["error"]["message"]
    assert server.health()[0] == 200
