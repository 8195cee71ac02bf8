"""Multi-LoRA over HTTP: `kestrel serve --enable-lora --lora-modules name=path`; the request's `model` picks the
adapter (outputs equal the offline engine's with that adapter), /v1/models lists adapters with their parent, and
/v1/load_lora_adapter + /v1/unload_lora_adapter change them at run time with OpenAI error bodies on failure;
/metrics has vLLM's vllm:lora_requests_info."""
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



def test_bad_adapters_and_unload_in_use_leave_the_engine_alive(lora_server, adapters, tmp_path):
    """Issue 33 item 3: a corrupted or unreadable adapter folder fails its load (400 naming the problem); unloading
    an adapter that a stream is using is refused (400); through all of it the engine core keeps its pid and other
    users' streams complete."""
    import shutil

    u = lora_server.url
    pid = lora_server.engine_pids()
    client = openai.OpenAI(base_url=u + "/v1", api_key="x", max_retries=0, timeout=60)

    def stream(model):
        s = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=300, temperature=0,
                                      stream=True, extra_body={"ignore_eos": True})
        it = iter(s)
        return [next(it)], it

    other, other_rest = stream("llama")  # another user's stream, running through every case below
    truncated = shutil.copytree(adapters["ad1"], tmp_path / "truncated")
    (truncated / "adapter_model.safetensors").write_bytes(b"\x01" * 64)
    status, body = http("POST", u + "/v1/load_lora_adapter", {"lora_name": "t", "lora_path": str(truncated)})
    assert status == 400 and "cannot read adapter_model.safetensors" in body["error"]["message"]
    unreadable = shutil.copytree(adapters["ad1"], tmp_path / "unreadable")
    (unreadable / "adapter_config.json").unlink()
    (unreadable / "adapter_config.json").mkdir()  # there, but not a file
    status, body = http("POST", u + "/v1/load_lora_adapter", {"lora_name": "u", "lora_path": str(unreadable)})
    assert status == 400 and "no adapter_config.json" in body["error"]["message"]

    mine, mine_rest = stream("ad1")
    status, body = http("POST", u + "/v1/unload_lora_adapter", {"lora_name": "ad1"})
    assert status == 400 and "in use by 1 request" in body["error"]["message"]
    for first, rest in ((other, other_rest), (mine, mine_rest)):
        chunks = first + list(rest)
        assert chunks[-1].choices[0].finish_reason == "length"
        assert "".join(c.choices[0].text for c in chunks) != ""
    assert {m["id"] for m in http("GET", u + "/v1/models")[1]["data"]} == {"llama", "ad1"}
    assert lora_server.engine_pids() == pid

def test_lora_requests_info_metric(lora_server):
    """vLLM's vllm:lora_requests_info: max_lora and the running / waiting adapters as labels; an adapter's stream
    shows as running while it generates."""
    import re

    u = lora_server.url
    client = openai.OpenAI(base_url=u + "/v1", api_key="x", max_retries=0, timeout=60)

    def sample() -> dict:
        text = http("GET", u + "/metrics")[1]
        m = re.search(r"^vllm:lora_requests_info\{([^}]*)\} (\S+)$", text, re.M)
        assert m is not None, text[-2000:]
        return dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))

    assert sample()["max_lora"] == "4"  # --max-loras' default
    s = client.completions.create(model="ad1", prompt="The quick brown fox", max_tokens=300, temperature=0,
                                  stream=True, extra_body={"ignore_eos": True})
    it = iter(s)
    next(it), next(it)
    labels = sample()
    assert labels["running_lora_adapters"] == "ad1" and labels["waiting_lora_adapters"] == "", labels
    assert list(it)[-1].choices[0].finish_reason == "length"


def test_lora_at_tensor_parallel_2(server_model, adapters, tmp_path):
    """`--enable-lora --tensor-parallel-size 2`: a load and an unload reach both workers (each logs it), a request
    with the adapter gives the TP = 1 engine's text, a bad adapter is a 400 from every rank, and the engine core
    (its pid) and the workers survive all of it."""
    import re

    log = tmp_path / "server.log"
    s = Server(server_model, log, extra=["--tensor-parallel-size", "2", "--enable-lora", "--enable-admin-api",
                                         "--max-lora-rank", "16"]).wait_ready()
    try:
        u = s.url
        pid = s.engine_pids()
        client = openai.OpenAI(base_url=u + "/v1", api_key="x", max_retries=0, timeout=60)
        prompt = "The quick brown fox"

        def complete(model):
            return client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text

        llm = LLM(str(server_model), progress=False, num_kv_blocks=96, max_model_len=512, enable_lora=True,
                  max_lora_rank=16)
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        tp1 = {n: llm.generate(prompt, params, lora_request=llm.load_lora(n, str(adapters[n])) if n else None)[0]
               .outputs[0].text for n in ("ad2", None)}

        status, _ = http("POST", u + "/v1/load_lora_adapter", {"lora_name": "ad2", "lora_path": str(adapters["ad2"])})
        assert status == 200
        loaded = re.findall(r"tp(\d): LoRA adapter 'ad2' \(id (\d+)\) loaded", log.read_text())
        assert sorted(loaded) == [("0", "1"), ("1", "1")]  # both ranks, once each
        assert complete("ad2") == tp1["ad2"] != tp1[None] == complete("llama")

        status, body = http("POST", u + "/v1/load_lora_adapter", {"lora_name": "big",
                                                                  "lora_path": str(adapters["big"])})
        assert status == 400 and "rank 32" in body["error"]["message"]
        assert "on every tensor-parallel rank" in body["error"]["message"]

        assert http("POST", u + "/v1/unload_lora_adapter", {"lora_name": "ad2"})[0] == 200
        assert sorted(re.findall(r"tp(\d): LoRA adapter id 1 removed", log.read_text())) == ["0", "1"]
        with pytest.raises(openai.NotFoundError):
            complete("ad2")
        assert complete("llama") == tp1[None] and s.engine_pids() == pid
    finally:
        s.stop()
