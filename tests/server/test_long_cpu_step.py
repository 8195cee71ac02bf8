"""Issue 55: on a CPU server one prompt inside max_model_len killed the engine core. A 7,000-token prompt was one
prefill step of more than 30 s, which the hang detector took for a hang (it killed the core and failed everyone's
requests; four such requests spent the restart limit for good). Now the CPU's step budget (2048 tokens) chunks
the prompt, and the heartbeat's work count (the runner's module forwards) tells a long step that computes from a
stuck one. Here with a random llama large enough that its 7,000-token prefill in one step takes longer than the
hang time-out the test sets (the real SmolLM2-135M takes minutes on one loaded core either way).

The server speculates (n-gram drafts over the 7,000-token context: issue 55 found speculation at long prompts
killed the engine the same way); the long request decodes a few tokens so that its decode steps draft. The same
rule without speculation: test_engine_hang.py (test_a_long_step_that_works_is_not_a_hang, the watchdog's rule;
test_stopped_engine_core_is_unhealthy_then_replaced, a real stuck core over the server) and the CPU step budget
in the engine tests."""
from __future__ import annotations

import json
import threading
import time

from conftest import NGRAM_SPEC, Server, http
from tests.tiny import make_checkpoint

C = "/v1/completions"


def test_a_long_prompt_on_the_cpu_is_work_not_a_hang(tmp_path, tiny_tokenizer):
    model = make_checkpoint("llama", tmp_path, tokenizer=tiny_tokenizer, name="mid_llama", hidden_size=512,
                            intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                            num_key_value_heads=8, max_position_embeddings=8192)
    s = Server(model, tmp_path / "server.log",
               ["--max-model-len", "8192", "--num-kv-blocks", "640", "--engine-hang-timeout", "4",
                "--speculative-config", json.dumps(NGRAM_SPEC)]).wait_ready()
    try:
        (pid,) = s.engine_pids()
        long_prompt = [(i * 7919) % 200 + 10 for i in range(7000)]
        results = {}

        def send_long():
            results["long"] = http("POST", s.url + C, {"prompt": long_prompt, "max_tokens": 6, "ignore_eos": True},
                                   timeout=600)

        t = threading.Thread(target=send_long)
        t.start()
        time.sleep(2.0)  # the long prompt's prefill is under way
        status, r = http("POST", s.url + C, {"prompt": "Hello", "max_tokens": 3}, timeout=600)
        assert status == 200 and r["usage"]["completion_tokens"] == 3, r
        t.join(600)
        status, r = results["long"]
        assert status == 200 and r["usage"]["prompt_tokens"] == 7000 and r["usage"]["completion_tokens"] == 6, r
        _, metrics = http("GET", s.url + "/metrics")
        assert sum(float(ln.split()[-1]) for ln in metrics.splitlines()
                   if ln.startswith("vllm:spec_decode_num_draft_tokens_total")) > 0  # it speculated
        assert s.engine_pids() == [pid] and "killing it" not in s.log_path.read_text()
        assert s.health()[1]["engines"][0]["state"] == "ready"
    finally:
        s.stop()
