"""Multi-LoRA over HTTP: `kestrel serve --enable-lora --lora-modules name=path`; the request's `model` picks the
adapter (outputs equal the offline engine's with that adapter), /v1/models lists adapters with their parent, and
/v1/load_lora_adapter + /v1/unload_lora_adapter change them at run time with OpenAI error bodies on failure."""
from __future__ import annotations

import openai
import pytest

from conftest import Server, http
from kestrel import LLM, SamplingParams
from tests.lora.peft_utils import make_adapter


@pytest.fixture(scope="module")
def adapters(server_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("server_loras")
    return {"ad1": make_adapter(server_model, root / "ad1", 8, seed=1),
            "ad2": make_adapter(server_model, root / "ad2", 16, seed=2),
            "big": make_adapter(server_model, root / "big", 32, seed=3)}


@pytest.fixture(scope="module")
def lora_server(server_model, adapters, tmp_path_factory):
    s = Server(server_model, tmp_path_factory.mktemp("lora") / "server.log",
               extra=["--enable-lora", "--enable-admin-api", "--max-lora-rank", "16", "--lora-modules", f"ad1={adapters['ad1']}"])
    yield s.wait_ready()
    s.stop()


def test_lora_serving(lora_server, server_model, adapters):
    u = lora_server.url
    status, models = http("GET", u + "/v1/models")
    assert status == 200
    cards = {m["id"]: m for m in models["data"]}
    assert set(cards) == {"llama", "ad1"} and cards["ad1"]["parent"] == "llama"

    client = openai.OpenAI(base_url=u + "/v1", api_key="x", max_retries=0, timeout=60)
    prompt = "The quick brown fox"

    def complete(model):
        r = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
        return r.choices[0].text

    llm = LLM(str(server_model), progress=False, num_kv_blocks=96, max_model_len=512, enable_lora=True,
              max_lora_rank=16)
    offline = {n: llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                               lora_request=llm.load_lora(n, str(adapters[n])) if n != "llama" else None)[0]
               .outputs[0].text for n in ("llama", "ad1", "ad2")}
    assert complete("ad1") == offline["ad1"] != offline["llama"] == complete("llama")

    # run-time load: a bad adapter is a 400 naming the engine and the reason; a good one serves at once
    status, body = http("POST", u + "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": str(adapters["big"])})
    assert status == 400 and "engine 0" in body["error"]["message"] and "rank 32" in body["error"]["message"]
    status, _ = http("POST", u + "/v1/load_lora_adapter", {"lora_name": "ad2", "lora_path": str(adapters["ad2"])})
    assert status == 200
    assert complete("ad2") == offline["ad2"]
    status, body = http("POST", u + "/v1/load_lora_adapter", {"lora_name": "ad2", "lora_path": str(adapters["ad2"])})
    assert status == 400 and body["error"]["param"] == "lora_name"
    assert {m["id"] for m in http("GET", u + "/v1/models")[1]["data"]} == {"llama", "ad1", "ad2"}

    # unload; the name is then unknown (404), as is unloading it again
    assert http("POST", u + "/v1/unload_lora_adapter", {"lora_name": "ad2"})[0] == 200
    with pytest.raises(openai.NotFoundError):
        complete("ad2")
    status, body = http("POST", u + "/v1/unload_lora_adapter", {"lora_name": "ad2"})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    status, body = http("POST", u + "/v1/load_lora_adapter", {"lora_name": "x"})
    assert status == 400 and body["error"]["param"] == "lora_path"
