"""Pooling models over the server, as vLLM serves them: /v1/embeddings with the real openai client (its default
base64 encoding and floats), /classify, /score, /rerank and /v1/rerank with vLLM's bodies; every vector equals
transformers' on the same weights (CPU float32, atol 1e-5). Bad input and generation requests get a 400 with
the OpenAI error body. vLLM's /pooling (an `input` or a `messages` body, `data[].data`) and
`truncate_prompt_tokens` on the pooling endpoints (the prompt's last k tokens) share these servers."""
from __future__ import annotations

import base64
import struct

import openai
import pytest
import torch

from tests.pooling_tiny import hf_class_logits, hf_embedding, make_classifier, make_embedder
from tests.server.conftest import Server, http

ATOL = 1e-5
DOCS = ["the capital is paris", "cats sleep a lot", "paris is a city"]


@pytest.fixture(scope="module")
def embedder(tmp_path_factory, tiny_tokenizer):
    return make_embedder(tmp_path_factory.mktemp("emb"), tiny_tokenizer, matryoshka_dimensions=[16, 32])


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory, tiny_tokenizer):
    return make_classifier(tmp_path_factory.mktemp("ce"), tiny_tokenizer, num_labels=1, seed=3)


@pytest.fixture(scope="module")
def embed_server(embedder, tmp_path_factory):
    s = Server(embedder, tmp_path_factory.mktemp("logs") / "embed.log").wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def rerank_server(cross_encoder, tmp_path_factory):
    s = Server(cross_encoder, tmp_path_factory.mktemp("logs") / "rerank.log").wait_ready()
    yield s
    s.stop()


def _ids(tok, *texts):
    return list(tok(*texts)["input_ids"])


def _close(got, ref):
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float32), ref.float(), atol=ATOL, rtol=0)


def test_embeddings_openai_client(embed_server, embedder, tiny_tokenizer):
    client = openai.OpenAI(base_url=embed_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    texts = ["hello world", "the cat sat on the mat"]
    res = client.embeddings.create(model="qwen3_embed", input=texts)  # the client asks for base64
    assert [d.index for d in res.data] == [0, 1]
    for d, t in zip(res.data, texts):
        _close(d.embedding, hf_embedding(embedder, _ids(tiny_tokenizer, t)))
    assert res.usage.prompt_tokens == sum(len(_ids(tiny_tokenizer, t)) for t in texts)
    floats = client.embeddings.create(model="qwen3_embed", input=texts[0], encoding_format="float")
    _close(floats.data[0].embedding, hf_embedding(embedder, _ids(tiny_tokenizer, texts[0])))


def test_embeddings_bodies(embed_server, embedder, tiny_tokenizer):
    ids = _ids(tiny_tokenizer, "a prompt given as token ids")
    status, body = http("POST", embed_server.url + "/v1/embeddings", {"input": [ids, ids[:3]],
                                                                       "encoding_format": "base64"})
    assert status == 200, body
    vec = struct.unpack(f"<{64}f", base64.b64decode(body["data"][0]["embedding"]))
    _close(list(vec), hf_embedding(embedder, ids))
    _close(list(struct.unpack("<64f", base64.b64decode(body["data"][1]["embedding"]))),
           hf_embedding(embedder, ids[:3]))
    status, body = http("POST", embed_server.url + "/v1/embeddings", {"input": "hello", "dimensions": 16})
    assert status == 200 and len(body["data"][0]["embedding"]) == 16
    assert sum(x * x for x in body["data"][0]["embedding"]) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("path,body,param,message", [
    ("/v1/embeddings", {"input": "hi", "dimensions": 20}, "dimensions", "dimensions 20 is not one"),
    ("/v1/embeddings", {"input": 5}, "input", "input"),
    ("/v1/embeddings", {"input": []}, "input", "input is empty"),
    ("/v1/embeddings", {"input": "hi", "encoding_format": "int8"}, "encoding_format", "encoding_format"),
    ("/v1/embeddings", {"input": [[10**9]]}, "prompt", "prompt token ids must be integers"),
    ("/v1/completions", {"prompt": "hi"}, "model", "this server runs a pooling model (embed): it does not "
                                                   "generate text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model", "does not generate"),
    ("/classify", {"input": "hi"}, "model", "pooling task is embed, not classify"),
])
def test_embed_server_refusals(embed_server, path, body, param, message):
    status, res = http("POST", embed_server.url + path, body)
    assert status == 400, res
    assert res["error"]["type"] == "invalid_request_error" and message in res["error"]["message"]
    assert res["error"]["param"] == param
    assert embed_server.health()[0] == 200  # the engine lives on


def test_score_on_embedder_is_cosine(embed_server, embedder, tiny_tokenizer):
    status, body = http("POST", embed_server.url + "/score", {"text_1": "what is the capital", "text_2": DOCS})
    assert status == 200, body
    q = hf_embedding(embedder, _ids(tiny_tokenizer, "what is the capital"))
    refs = [float(q @ hf_embedding(embedder, _ids(tiny_tokenizer, d))) for d in DOCS]
    assert [d["score"] for d in body["data"]] == pytest.approx(refs, abs=ATOL)


def _pair_scores(cross_encoder, tok, query, docs):
    return [float(hf_class_logits(cross_encoder, _ids(tok, query, d)).sigmoid()[0]) for d in docs]


def test_score_and_rerank(rerank_server, cross_encoder, tiny_tokenizer):
    refs = _pair_scores(cross_encoder, tiny_tokenizer, "what is the capital", DOCS)
    status, body = http("POST", rerank_server.url + "/score", {"text_1": "what is the capital", "text_2": DOCS})
    assert status == 200, body
    assert body["object"] == "list" and [d["object"] for d in body["data"]] == ["score"] * 3
    assert [d["score"] for d in body["data"]] == pytest.approx(refs, abs=ATOL)
    for path in ("/rerank", "/v1/rerank"):
        status, body = http("POST", rerank_server.url + path, {"query": "what is the capital", "documents": DOCS,
                                                               "top_n": 2})
        assert status == 200, body
        order = sorted(range(3), key=lambda i: refs[i], reverse=True)[:2]
        assert [r["index"] for r in body["results"]] == order
        assert [r["relevance_score"] for r in body["results"]] == pytest.approx([refs[i] for i in order], abs=ATOL)
        assert [r["document"]["text"] for r in body["results"]] == [DOCS[i] for i in order]
    status, body = http("POST", rerank_server.url + "/v1/rerank", {"query": "q", "documents": DOCS,
                                                                   "return_documents": False})
    assert status == 200 and len(body["results"]) == 3 and "document" not in body["results"][0]


def test_classify(rerank_server, cross_encoder, tiny_tokenizer):
    status, body = http("POST", rerank_server.url + "/classify", {"input": ["hello world", "cats"]})
    assert status == 200, body
    for d, t in zip(body["data"], ["hello world", "cats"]):
        assert d["label"] == "class_0" and d["num_classes"] == 1
        _close(d["probs"], hf_class_logits(cross_encoder, _ids(tiny_tokenizer, t)).sigmoid())


@pytest.mark.parametrize("path,body,message", [
    ("/v1/embeddings", {"input": "hi"}, "pooling task is classify, not embed"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "2 queries for 3 documents"),
    ("/rerank", {"query": "q", "documents": []}, "no documents to score"),
    ("/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "top_n must be 0"),
    ("/v1/completions", {"prompt": "hi"}, "use /classify, /score or /rerank"),
])
def test_rerank_server_refusals(rerank_server, path, body, message):
    status, res = http("POST", rerank_server.url + path, body)
    assert status == 400, res
    assert message in res["error"]["message"]


def test_generation_server_refuses_pooling(server):
    for path, body in (("/v1/embeddings", {"input": "hi"}), ("/rerank", {"query": "q", "documents": ["d"]})):
        status, res = http("POST", server.url + path, body)
        assert status == 400 and "this model generates text" in res["error"]["message"], res


def test_inputs_and_documents_are_capped(embed_server, rerank_server):
    """Issue 55 item 7: the number of pooling inputs, documents and score texts is capped (a 400 naming the field
    and the limit, before any tokenizing)."""
    from kestrel.server.pooling import MAX_POOLING_INPUTS

    over = ["x"] * (MAX_POOLING_INPUTS + 1)
    for url, path, body, param in (
            (embed_server.url, "/v1/embeddings", {"input": over}, "input"),
            (rerank_server.url, "/classify", {"input": over}, "input"),
            (rerank_server.url, "/rerank", {"query": "q", "documents": over}, "documents"),
            (rerank_server.url, "/v1/rerank", {"query": "q", "documents": over}, "documents"),
            (rerank_server.url, "/score", {"text_1": "q", "text_2": over}, "text_2"),
            (embed_server.url, "/score", {"text_1": over, "text_2": over}, "text_1")):
        status, res = http("POST", url + path, body)
        assert status == 400 and res["error"]["param"] == param, (path, res)
        assert f"at most {MAX_POOLING_INPUTS}" in res["error"]["message"], res
    status, body = http("POST", embed_server.url + "/score", {"text_1": "q", "text_2": ["d"] * 40})
    assert status == 200 and len(body["data"]) == 40, body


@pytest.mark.serial  # health latency: make test runs it alone
def test_health_answers_while_long_inputs_tokenize(embed_server, rerank_server):
    """Issue 55 item 7: pooling inputs were tokenized on the event loop (and a cross-encoder's pairs in one
    render-thread call): many long texts stalled /health. Now they are tokenized off the loop, in chunks."""
    import threading
    import time

    text = " ".join(f"word{i}" for i in range(3000))
    for url, path, body in ((embed_server.url, "/v1/embeddings", {"input": [text] * 256}),
                            (rerank_server.url, "/rerank", {"query": text, "documents": [text] * 256})):
        server = embed_server if url == embed_server.url else rerank_server
        lat = []
        # the client leaves after 1 s: its work stops (answered or not, health must stay quick)
        worker = threading.Thread(target=_post_and_leave, args=(url + path, body, 1.0))
        worker.start()
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            t0 = time.perf_counter()
            assert server.health()[0] == 200
            lat.append(time.perf_counter() - t0)
            time.sleep(0.02)
        worker.join(60)
        lat.sort()
        print(path, "health median", lat[len(lat) // 2], "worst", lat[-1])
        assert lat[len(lat) // 2] < 0.1 and lat[-1] < 0.5, (path, lat[-5:])


def _post_and_leave(url: str, body: dict, after: float) -> None:
    import json as _json
    import socket
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, _json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=after).read()
    except (urllib.error.URLError, socket.timeout, TimeoutError):
        pass

TEXT = "the cat sat on the mat and looked at the door"


def test_pooling_input_on_an_embedder(embed_server, embedder, tiny_tokenizer):
    status, body = http("POST", embed_server.url + "/pooling", {"model": "qwen3_embed", "input": [TEXT, "hello"]})
    assert status == 200, body
    assert body["object"] == "list" and body["model"] == "qwen3_embed" and body["id"].startswith("pool")
    assert [(d["index"], d["object"]) for d in body["data"]] == [(0, "pooling"), (1, "pooling")]
    for d, t in zip(body["data"], [TEXT, "hello"]):
        _close(d["data"], hf_embedding(embedder, _ids(tiny_tokenizer, t)))
    assert body["usage"]["prompt_tokens"] == len(_ids(tiny_tokenizer, TEXT)) + len(_ids(tiny_tokenizer, "hello"))
    status, body = http("POST", embed_server.url + "/pooling", {"input": TEXT, "encoding_format": "base64",
                                                                 "truncate_prompt_tokens": 3})
    assert status == 200, body
    vec = struct.unpack("<64f", base64.b64decode(body["data"][0]["data"]))
    _close(list(vec), hf_embedding(embedder, _ids(tiny_tokenizer, TEXT)[-3:]))
    assert body["usage"]["prompt_tokens"] == 3


def test_pooling_messages(embed_server, embedder, tiny_tokenizer):
    messages = [{"role": "user", "content": "vLLM is great!"}]
    status, body = http("POST", embed_server.url + "/pooling", {"messages": messages})
    assert status == 200, body
    text = tiny_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    assert body["usage"]["prompt_tokens"] == len(ids)
    _close(body["data"][0]["data"], hf_embedding(embedder, ids))


def test_pooling_on_a_cross_encoder_and_truncation(rerank_server, cross_encoder, tiny_tokenizer):
    status, body = http("POST", rerank_server.url + "/pooling", {"input": TEXT})
    assert status == 200, body
    _close(body["data"][0]["data"], hf_class_logits(cross_encoder, _ids(tiny_tokenizer, TEXT)).sigmoid())
    status, body = http("POST", rerank_server.url + "/pooling", {"input": TEXT, "use_activation": False})
    _close(body["data"][0]["data"], hf_class_logits(cross_encoder, _ids(tiny_tokenizer, TEXT)))
    status, body = http("POST", rerank_server.url + "/classify", {"input": TEXT, "truncate_prompt_tokens": 4})
    assert status == 200 and body["usage"]["prompt_tokens"] == 4, body
    _close(body["data"][0]["probs"], hf_class_logits(cross_encoder, _ids(tiny_tokenizer, TEXT)[-4:]).sigmoid())
    status, body = http("POST", rerank_server.url + "/rerank", {"query": "q", "documents": [TEXT],
                                                                "truncate_prompt_tokens": 5})
    assert status == 200 and body["usage"]["total_tokens"] == 5, body


@pytest.mark.parametrize("body,param,message", [
    ({"input": "hi", "task": "token_embed"}, "task", "per-token pooling is not implemented"),
    ({"input": "hi", "task": "classify"}, "model", "pooling task is embed, not classify"),
    ({"input": "hi", "messages": [{"role": "user", "content": "hi"}]}, "messages", "not both"),
    ({}, "input", "not both and not neither"),
    ({"input": "hi", "activation": True}, "activation", "an embedding takes `normalize`"),
    ({"input": "hi", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens", "must be a positive integer"),
])
def test_pooling_refusals(embed_server, body, param, message):
    status, res = http("POST", embed_server.url + "/pooling", body)
    assert status == 400, res
    assert res["error"]["param"] == param and message in res["error"]["message"], res


def test_pooling_on_a_generative_model(server):
    status, res = http("POST", server.url + "/pooling", {"input": "hi"})
    assert status == 400 and "this model generates text" in res["error"]["message"], res


def test_speculation_is_refused_for_pooling_models_by_name(embedder, cross_encoder):
    """Issue 55 (the hostile cases with speculation on and off): a pooling request is one forward with no tokens
    to draft for, so --speculative-config on a pooling model was accepted and silently did nothing. Now it is
    refused by name: at parse time by `kestrel serve` (one line, exit 2, no engine started), and by the engine
    itself where the CLI is not in the way (the offline LLM). The pooling servers above are therefore the
    speculation-off runs of their hostile cases, and there is no speculation-on run to make."""
    import json
    import os
    import subprocess
    import sys

    from kestrel import LLM
    from kestrel.errors import ConfigError
    from tests.server.conftest import NGRAM_SPEC, ROOT, free_port

    run = subprocess.run([sys.executable, "-m", "kestrel.cli", "serve", str(embedder), "--port", str(free_port()),
                          "--speculative-config", json.dumps(NGRAM_SPEC)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}, cwd=ROOT, timeout=90)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("kestrel") and "--speculative-config" in last and \
        "does not support pooling models (this one serves embed" in last, run.stderr[-3000:]
    with pytest.raises(ConfigError, match=r"does not support pooling models \(this one serves classify"):
        LLM(str(cross_encoder), progress=False, num_kv_blocks=32, max_model_len=128, speculative_config=NGRAM_SPEC)
