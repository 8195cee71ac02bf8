"""`kestrel serve --speculative-config JSON`: completions (greedy and seeded, through the openai client) equal the
offline engine's without speculation, /metrics carries vLLM's spec-decode counters, and a bad config fails the
start-up naming the problem."""
import json
import re
import subprocess
import sys

import openai
import pytest

from kestrel import LLM, SamplingParams
from tests.server.conftest import ROOT, Server, http

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [20, 21, 22, 23, 20, 21, 22], [9, 9, 9, 9]]


def counter(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M))


def assert_completions_equal_offline(server, model, max_tokens: int) -> None:
    """Greedy and seeded completions of PROMPTS over the server equal the offline engine's without speculation."""
    offline = LLM(str(model), progress=False, num_kv_blocks=96, max_model_len=512)
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    for temperature, seed in [(0.0, None), (0.9, 17)]:
        ref = offline.generate(PROMPTS, SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                                                       ignore_eos=True))
        for p, r in zip(PROMPTS, ref):
            got = c.completions.create(model=c.models.list().data[0].id, prompt=p, max_tokens=max_tokens,
                                       temperature=temperature, seed=seed, extra_body={"ignore_eos": True})
            assert got.choices[0].text == r.outputs[0].text


def test_completions_equal_offline_without_speculation(spec_server, server_model):
    assert_completions_equal_offline(spec_server, server_model, max_tokens=24)
    _, text = http("GET", spec_server.url + "/metrics")
    drafts = counter(text, "vllm:spec_decode_num_draft_tokens_total")
    accepted = counter(text, "vllm:spec_decode_num_accepted_tokens_total")
    assert counter(text, "vllm:spec_decode_num_drafts_total") > 0 and 0 < accepted <= drafts
    assert counter(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total") == accepted
    assert 'position="0"' in text


def test_bad_config_fails_startup_with_the_reason(server_model):
    proc = subprocess.run([sys.executable, "-m", "kestrel.cli", "serve", str(server_model), "--speculative-config",
                           '{"method": "ngram"}', "--num-kv-blocks", "32"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode != 0
    assert "num_speculative_tokens must be an integer" in proc.stdout + proc.stderr


def test_eagle3_completions_equal_offline_without_speculation(tmp_path):
    """method eagle3 through --speculative-config: a draft that copies its bigram target (every greedy draft right)
    in the EAGLE authors' checkpoint layout; completions equal the offline engine's, and drafts are accepted."""
    from tests.spec_decode.eagle3_tiny import eagle3_draft, eagle3_target

    target = eagle3_target(tmp_path, bigram=True)
    spec = {"method": "eagle3", "model": str(eagle3_draft(tmp_path, target, copy=True)), "num_speculative_tokens": 3}
    s = Server(target, tmp_path / "server.log", ["--speculative-config", json.dumps(spec)]).wait_ready()
    try:
        assert_completions_equal_offline(s, target, max_tokens=16)
        _, text = http("GET", s.url + "/metrics")
        assert counter(text, "vllm:spec_decode_num_accepted_tokens_total") >= 3 * len(PROMPTS)
    finally:
        s.stop()
