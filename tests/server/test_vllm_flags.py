"""Issue 36: a `vllm serve` launch script starts Kestrel or stops with one line naming the flag and why (exit 2,
no traceback). Each flag is tried through main() with the server start replaced, so the whole path (parsing,
checks, the config the engine would get) runs without starting 57 servers; a few start a real one below."""
from __future__ import annotations

import json
import time

import pytest

from conftest import Server, http

# (flags after `serve MODEL`, a check on (args, EngineConfig) of what the flag must have set)
ACCEPTED = [
    (["--host", "0.0.0.0"], lambda a, c: a.host == "0.0.0.0"),
    (["--port", "8123"], lambda a, c: a.port == 8123),
    (["--api-key", "k"], lambda a, c: a.api_key == "k"),
    (["--served-model-name", "m1", "m2"], lambda a, c: a.served_model_name == ["m1", "m2"]),
    (["--max-model-len", "32k"], lambda a, c: c.model.max_model_len == 32000),
    (["--max-model-len", "4096"], lambda a, c: c.model.max_model_len == 4096),
    (["--gpu-memory-utilization", "0.8"], lambda a, c: c.cache.gpu_memory_utilization == 0.8),
    (["--tensor-parallel-size", "2"], lambda a, c: c.parallel.tensor_parallel_size == 2),
    (["-tp", "2"], lambda a, c: c.parallel.tensor_parallel_size == 2),
    (["--pipeline-parallel-size", "1"], lambda a, c: True),
    (["--data-parallel-size", "2"], lambda a, c: c.parallel.data_parallel_size == 2),
    (["--dtype", "auto"], lambda a, c: c.model.dtype == "auto"),
    (["--dtype", "half"], lambda a, c: c.model.dtype == "float16"),
    (["--dtype", "float16"], lambda a, c: c.model.dtype == "float16"),
    (["--dtype", "bfloat16"], lambda a, c: c.model.dtype == "bfloat16"),
    (["--dtype", "float32"], lambda a, c: c.model.dtype == "float32"),
    (["--dtype", "float"], lambda a, c: c.model.dtype == "float32"),
    (["--kv-cache-dtype", "auto"], lambda a, c: c.cache.kv_cache_dtype == "auto"),
    (["--kv-cache-dtype", "fp8"], lambda a, c: c.cache.kv_cache_dtype == "fp8"),
    (["--kv-cache-dtype", "fp8_e5m2", "--calculate-kv-scales"],
     lambda a, c: c.cache.kv_cache_dtype == "fp8_e5m2" and c.cache.calculate_kv_scales),
    (["--max-num-seqs", "64"], lambda a, c: c.scheduler.max_num_seqs == 64),
    (["--max-num-batched-tokens", "4096"], lambda a, c: c.scheduler.max_num_batched_tokens == 4096),
    (["--enable-chunked-prefill"], lambda a, c: c.scheduler.enable_chunked_prefill),
    (["--enable-prefix-caching"], lambda a, c: c.cache.enable_prefix_caching),
    (["--no-enable-prefix-caching"], lambda a, c: not c.cache.enable_prefix_caching),
    (["--disable-log-requests"], lambda a, c: a.disable_log_requests),
    (["--enable-log-requests"], lambda a, c: a.log_requests),
    (["--disable-log-stats"], lambda a, c: a.disable_log_stats),
    (["--enable-sleep-mode"], lambda a, c: True),
    (["--limit-mm-per-prompt", '{"image": 2}'], lambda a, c: (c.multimodal.limit("image"), c.multimodal.limit("video"))
     == (2, 4)),
    (["--limit-mm-per-prompt", '{"image": 3, "video": 0}'], lambda a, c: c.multimodal.limit_mm_per_prompt
     == {"image": 3, "video": 0}),
    (["--limit-mm-per-prompt", '{"image": 2, "video": 1}'], lambda a, c: c.multimodal.limit_mm_per_prompt
     == {"image": 2, "video": 1}),
    (["--limit-mm-per-prompt", "3"], lambda a, c: (c.multimodal.limit("image"), c.multimodal.limit("video")) == (3, 3)),
    (["--media-io-kwargs", '{"video": {"num_frames": 8}}'], lambda a, c: c.multimodal.video_num_frames() == 8),
    (["--media-io-kwargs", '{}'], lambda a, c: c.multimodal.video_num_frames() == 32),
    (["--swap-space", "4"], lambda a, c: True),
    (["--trust-remote-code"], lambda a, c: c.model.trust_remote_code),
    (["--seed", "7"], lambda a, c: c.model.seed == 7),
    (["--enforce-eager"], lambda a, c: c.compilation.enforce_eager),
    (["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"],
     lambda a, c: c.lora.enable_lora and c.lora.max_loras == 2 and c.lora.max_lora_rank == 8),
    (["--chat-template", "{{ messages }}"], lambda a, c: a.chat_template == "{{ messages }}"),
    (["--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
     lambda a, c: a.enable_auto_tool_choice and a.tool_call_parser == "hermes"),
    (["--reasoning-parser", "qwen3"], lambda a, c: a.reasoning_parser == "qwen3"),
    (["--enable-auto-tool-choice", "--tool-call-parser", "mistral", "--reasoning-parser", "mistral"],
     lambda a, c: a.tool_call_parser == "mistral" and a.reasoning_parser == "mistral"),
    (["--tool-call-parser", "openai", "--reasoning-parser", "openai_gptoss"],
     lambda a, c: a.tool_call_parser == "openai" and a.reasoning_parser == "openai_gptoss"),
    (["--generation-config", "vllm"], lambda a, c: a.generation_config == "vllm"),
    (["--uvicorn-log-level", "warning"], lambda a, c: a.uvicorn_log_level == "warning"),
    (["--allowed-origins", '["*"]'], lambda a, c: a.allowed_origins == ["*"]),
    (["--allowed-origins", "https://a.example"], lambda a, c: a.allowed_origins == ["https://a.example"]),
    (["--root-path", "/llm"], lambda a, c: a.root_path == "/llm"),
    (["--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem"], lambda a, c: a.ssl_keyfile == "k.pem"),
    (["--block-size", "32"], lambda a, c: c.cache.block_size == 32),
    (["--quantization", "fp8"], lambda a, c: c.model.quantization == "fp8"),
    (["--load-format", "dummy"], lambda a, c: c.model.load_format == "dummy"),
    (["--load-format", "safetensors"], lambda a, c: c.model.load_format == "auto"),
    (["--max-logprobs", "5"], lambda a, c: c.model.max_logprobs == 5),
    (["--disable-custom-all-reduce"], lambda a, c: True),
    (["--distributed-executor-backend", "mp"], lambda a, c: c.parallel.distributed_executor_backend == "mp"),
    (["--scheduling-policy", "priority"], lambda a, c: c.scheduler.scheduling_policy == "priority"),
    (["--guided-decoding-backend", "xgrammar"], lambda a, c: True),
    (["--structured-outputs-config", '{"backend": "xgrammar"}'], lambda a, c: True),
    (["--async-scheduling"], lambda a, c: c.scheduler.async_scheduling == "on"),
    (["--num-gpu-blocks-override", "64"], lambda a, c: c.cache.num_kv_blocks == 64),
    (["--kv-offloading-size", "4", "--kv-offloading-backend", "native"],
     lambda a, c: c.cache.kv_offloading_size == 4.0 and c.cache.kv_offloading_backend == "native"),
    (["--kv-offloading-size", "4", "--kv-offloading-disk-path", "/tmp/kv", "--kv-offloading-disk-size", "8"],
     lambda a, c: c.cache.kv_offloading_disk_path == "/tmp/kv" and c.cache.kv_offloading_disk_size == 8.0),
    (["--compilation-config", '{"level": 3}'], lambda a, c: True),
    (["-O3"], lambda a, c: True),
    (["--hf-token", "hf_x"], lambda a, c: True),
    (["--tokenizer-mode", "auto"], lambda a, c: True),
    (["--disable-frontend-multiprocessing"], lambda a, c: True),
    (["--api-server-count", "1"], lambda a, c: True),
    (["--max-cpu-loras", "8"], lambda a, c: c.lora.max_cpu_loras == 8),
    (["--revision", "main"], lambda a, c: c.model.revision == "main"),
    (["--download-dir", "/srv/hf"], lambda a, c: c.model.download_dir == "/srv/hf"),
    (["--tokenizer", "{model}"], lambda a, c: c.model.tokenizer is not None),
    (["--runner", "pooling"], lambda a, c: c.model.runner == "pooling"),
    # issue 54: vLLM's own command-line forms
    (["--max-model-len", "-1"], lambda a, c: c.model.max_model_len is None),
    (["--max-model-len", "auto"], lambda a, c: c.model.max_model_len is None),
    (["--max_model_len", "4096"], lambda a, c: c.model.max_model_len == 4096),
    (["--max-model-len=2k"], lambda a, c: c.model.max_model_len == 2000),
    (["--limit-mm-per-prompt.image", "2"], lambda a, c: c.multimodal.limit("image") == 2),
    (["--limit-mm-per-prompt.image=3", "--limit-mm-per-prompt.video", "0"],
     lambda a, c: c.multimodal.limit_mm_per_prompt == {"image": 3, "video": 0}),
    (["--limit-mm-per-prompt.video", "1"], lambda a, c: (c.multimodal.limit("image"), c.multimodal.limit("video"))
     == (4, 1)),
    (["--speculative-config.method", "ngram", "--speculative_config.num_speculative_tokens", "3"],
     lambda a, c: c.scheduler.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}),
    (["--compilation-config.cudagraph_capture_sizes+", "1,2", "--compilation-config.mode", "3"], lambda a, c: True),
    (["-O", "3"], lambda a, c: True),
    (["-O=0"], lambda a, c: True),
    (["-q", "fp8"], lambda a, c: c.model.quantization == "fp8"),
    (["-sc", '{"method": "ngram", "num_speculative_tokens": 2}'],
     lambda a, c: c.scheduler.num_proposed_tokens == 2),
    (["--cudagraph-capture-sizes", "1", "2", "4"], lambda a, c: c.compilation.cuda_graph_sizes == [1, 2, 4]),
    (["--no-async-scheduling"], lambda a, c: c.scheduler.async_scheduling == "off"),
    (["--no-enable-log-requests"], lambda a, c: not a.log_requests),
    (["--override-generation-config", '{"temperature": 0.5, "max_new_tokens": 64}'],
     lambda a, c: a.override_generation_config == {"temperature": 0.5, "max_new_tokens": 64}),
    (["--allowed-origins", "https://a.example", "--allow-credentials"], lambda a, c: a.allow_credentials),
    (["--disable-uvicorn-access-log"], lambda a, c: a.disable_uvicorn_access_log),
    (["--max-seq-len-to-capture", "8192"], lambda a, c: True),
    (["--api-key", "only-one"], lambda a, c: a.api_key == "only-one"),
    (["--language-model-only"], lambda a, c: c.multimodal.limit_mm_per_prompt == 0),
    (["--no-language-model-only"], lambda a, c: c.multimodal.limit_mm_per_prompt == 4),
    (["--default-chat-template-kwargs", '{"enable_thinking": false}'],
     lambda a, c: a.default_chat_template_kwargs == {"enable_thinking": False}),
    # older vLLM versions' flags that launch scripts still carry
    (["--limit-mm-per-prompt", "image=2,video=0"], lambda a, c: c.multimodal.limit_mm_per_prompt
     == {"image": 2, "video": 0}),
    (["--limit-mm-per-prompt", "image=2,video=1"], lambda a, c: c.multimodal.limit("video") == 1),
    (["--use-v2-block-manager", "--num-scheduler-steps", "1", "--disable-async-output-proc", "--enable-reasoning",
      "--disable-mm-preprocessor-cache", "--preemption-mode", "recompute", "--tokenizer-pool-size", "0"],
     lambda a, c: True),
    (["--lora-dtype", "auto"], lambda a, c: True),
    (["--dtype", "float16", "--lora-dtype", "float16"], lambda a, c: c.model.dtype == "float16"),
    (["--chat-template-content-format", "string"], lambda a, c: True),
    (["--spec-method", "ngram", "--spec-tokens", "3"],
     lambda a, c: c.scheduler.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}),
    (["--speculative-config", '{"method": "ngram"}', "--spec-tokens", "2"],
     lambda a, c: c.scheduler.speculative_config == {"method": "ngram", "num_speculative_tokens": 2}),
]

# (flags, what the one line must say)
REFUSED = [
    (["--kv-cache-dtype", "fp8_inc"], "argument --kv-cache-dtype: invalid choice: 'fp8_inc'"),
    (["--kv-offloading-backend", "lmcache"], "argument --kv-offloading-backend: invalid choice: 'lmcache'"),
    (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size 2: pipeline parallelism is not implemented"),
    (["-pp", "2"], "--pipeline-parallel-size 2: pipeline parallelism"),
    (["--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
    (["--quantization", "bitsandbytes"], "argument --quantization/-q: invalid choice: 'bitsandbytes'"),
    (["--quantization", "awq"], "quantization='awq' but the checkpoint has no quantization_config"),
    (["--load-format", "pt"], "argument --load-format: invalid choice: 'pt'"),
    (["--tool-call-parser", "nope"], "unknown tool-call parser 'nope'; choose from deepseek_v3, deepseek_v31, "),
    (["--reasoning-parser", "nope"], "unknown reasoning parser 'nope'; choose from deepseek_r1, deepseek_v3, "),
    (["--limit-mm-per-prompt", '{"audio": 1}'], "argument --limit-mm-per-prompt: audio is not served here (only "
     "image and video)"),
    (["--limit-mm-per-prompt", '{"video": -1}'], "argument --limit-mm-per-prompt: expected {\"image\": N, "),
    (["--media-io-kwargs", '{"video": {"fps": 2}}'], "argument --media-io-kwargs: video option 'fps' is not "
     "implemented (only num_frames)"),
    (["--media-io-kwargs", '{"image": {"mode": "RGB"}}'], "argument --media-io-kwargs: 'image' loading options are "
     "not implemented"),
    (["--media-io-kwargs", '{"video": {"num_frames": 0}}'], "argument --media-io-kwargs: video num_frames must be "),
    (["--limit-mm-per-prompt", "{image: 2}"], "argument --limit-mm-per-prompt: not JSON"),
    (["--max-model-len", "lots"], "argument --max-model-len: invalid token count 'lots'"),
    (["--guided-decoding-backend", "outlines"], "--guided-decoding-backend outlines: structured outputs use xgrammar"),
    (["--structured-outputs-config", '{"backend": "guidance"}'], "--structured-outputs-config"),
    (["--task", "embed"], "--task embed: vLLM's old spelling: use --runner pooling"),
    (["--convert", "classify"], "--convert classify: LlamaForCausalLM has no classification head"),
    (["--enable-expert-parallel"], "--enable-expert-parallel: expert parallelism is not implemented"),
    (["--api-server-count", "4"], "--api-server-count 4: one HTTP server process"),
    (["--cpu-offload-gb", "10"], "--cpu-offload-gb 10.0: offloading weights"),
    (["--kv-transfer-config", "{}"], "--kv-transfer-config {}: disaggregated prefill (KV transfer) is not "
     "implemented; for OffloadingConnector's host and file tiers use --kv-offloading-size"),
    (["--tokenizer-mode", "mistral"], "--tokenizer-mode mistral"),
    (["--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "just-a-name"], "--lora-modules expects name=path or {"),
    (["--enable-lora", "--lora-modules", '{"name": "sql", "path": "/no/adapter"}'],
     "--lora-modules sql=/no/adapter: not a PEFT adapter folder"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--api-key", "k1", "k2"], "--api-key: 2 keys given; one key is served"),
    (["--override-generation-config", '{"temprature": 0.5}'],
     "--override-generation-config: temprature is not a sampling default here"),
    (["--limit-mm-per-prompt.audio", "1"], "argument --limit-mm-per-prompt: audio is not served here"),
    (["--hf-overrides.rope_theta", "1000000"], '--hf-overrides {"rope_theta": 1000000}: overriding config.json'),
    (["--max-model-len", "-2"], "--max-model-len must be from 1 to 16777216, got -2"),
    (["--config", "/no/such.yaml"], "--config /no/such.yaml: No such file or directory"),
    (["--config", "flags.json"], "--config flags.json: the file must be YAML"),
    (["--config"], "--config needs a YAML file"),
    (["--limit-mm-per-prompt.image"], "--limit-mm-per-prompt.image needs a value"),
    (["--headless"], "--headless: multi-node serving is not implemented"),
    (["--limit-mm-per-prompt", "image=2,video=x"], "argument --limit-mm-per-prompt: expected image=N,video=M"),
    (["--num-scheduler-steps", "8"], "--num-scheduler-steps 8: multi-step scheduling"),
    (["--speculative-model", "/srv/draft"], "--speculative-model /srv/draft: give --speculative-config"),
    (["--rope-scaling", '{"rope_type": "yarn", "factor": 4.0}'], "--rope-scaling"),
    (["--dtype", "bfloat16", "--lora-dtype", "float16"], "--lora-dtype float16: adapters run in the model's dtype"),
    (["--chat-template-content-format", "openai"], "--chat-template-content-format openai: text-only message"),
    (["--spec-method", "ngram"], "--spec-method/--speculative-config: speculative_config num_speculative_tokens "
                                 "must be an integer in 1..16, not None"),
    (["--speculative-config.method", "medusa", "--spec-tokens", "2"],
     "--spec-tokens/--speculative-config: speculative_config method 'medusa' is not supported"),
    (["--speculative-config", '{"method": "ngram"}', "--spec-method", "mtp"],
     "--spec-method and --speculative-config's 'method' are both given"),
    (["--no-scheduler-reserve-full-isl"], "--no-scheduler-reserve-full-isl: changing the admission rule"),
]


@pytest.fixture
def no_server_start(monkeypatch):
    """main(["serve", ...]) runs everything up to the server start, then hands back what it would have served."""
    seen = {}

    def fake_run_server(args):
        from kestrel.config import from_cli_args

        seen["args"], seen["config"] = args, from_cli_args(args)
        return 0

    monkeypatch.setattr("kestrel.server.app.run_server", fake_run_server)
    monkeypatch.delenv("KESTREL_API_KEY", raising=False)
    return seen


def _tried_flags() -> set[str]:
    return {f for argv, *_ in ACCEPTED + REFUSED for f in argv if f.startswith("-") and not f[1:2].isdigit()}


def test_the_launch_script_table_covers_the_common_vllm_flags():
    assert len(_tried_flags()) >= 57, sorted(_tried_flags())


@pytest.mark.parametrize("flags,check", ACCEPTED, ids=[" ".join(a) for a, _ in ACCEPTED])
def test_vllm_flag_is_accepted(flags, check, server_model, no_server_start, capsys):
    from kestrel.cli import main

    flags = [f.replace("{model}", str(server_model)) for f in flags]
    assert main(["serve", str(server_model), *flags]) == 0, capsys.readouterr().err
    assert check(no_server_start["args"], no_server_start["config"]), flags


@pytest.mark.parametrize("flags,words", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_vllm_flag_is_refused_in_one_line(flags, words, server_model, no_server_start, capsys):
    from kestrel.cli import main

    try:
        code = main(["serve", str(server_model), *flags])
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and "args" not in no_server_start, (code, err)
    assert err.splitlines() == [err] and words in err and "Traceback" not in err, err


def test_config_file_as_vllm_reads_it(server_model, no_server_start, tmp_path):
    """--config FILE.yaml: its keys are long flag names (dashes or underscores), true/false booleans, lists and
    nested JSON objects; the command line wins over the file, and a positional model over the file's."""
    from kestrel.cli import main

    path = tmp_path / "serve.yaml"
    path.write_text("model: /not/this/one\nmax_model_len: 2048\nenable-prefix-caching: false\nenforce-eager: true\n"
                    "served-model-name: [a, b]\nport: 9000\n"
                    "speculative-config:\n  method: ngram\n  num_speculative_tokens: 2\n")
    assert main(["serve", str(server_model), "--config", str(path), "--port", "9100"]) == 0
    args, config = no_server_start["args"], no_server_start["config"]
    assert args.port == 9100 and args.served_model_name == ["a", "b"] and config.model.model == str(server_model)
    assert config.model.max_model_len == 2048 and not config.cache.enable_prefix_caching
    assert config.compilation.enforce_eager and config.scheduler.num_proposed_tokens == 2
    path.write_text(f"model: {server_model}\n")  # the model from the file alone
    assert main(["serve", f"--config={path}"]) == 0
    assert no_server_start["config"].model.model == str(server_model)


def test_generation_config_overrides(tmp_path):
    """--override-generation-config: over generation_config.json's defaults, or alone with --generation-config
    vllm; max_new_tokens is the server's max_tokens default."""
    from kestrel.server.app import load_sampling_defaults

    (tmp_path / "generation_config.json").write_text('{"temperature": 0.7, "top_p": 0.9}')
    assert load_sampling_defaults("auto", str(tmp_path)) == {"temperature": 0.7, "top_p": 0.9}
    assert load_sampling_defaults("auto", str(tmp_path), {"temperature": 0.5, "max_new_tokens": 9}) == {
        "temperature": 0.5, "top_p": 0.9, "max_tokens": 9}
    assert load_sampling_defaults("vllm", str(tmp_path), {"top_k": 5}) == {"top_k": 5}


def test_accepted_without_effect_is_said_in_help(capsys):
    from kestrel.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for words in ("--swap-space SWAP_SPACE no effect: the KV cache lives on the GPU only",
                  "--enable-sleep-mode, --no-enable-sleep-mode no effect: sleep is always available",
                  "--disable-log-requests no log line per request", "float16 (or half)"):
        assert words in out, words


def test_llm_takes_dtype_half(server_model):
    import torch

    from kestrel.loader import resolve_dtype

    assert resolve_dtype("half", torch.device("cpu")) is torch.float16
    assert resolve_dtype("float", torch.device("cpu")) is torch.float32


def test_a_launch_script_serves(server_model, tmp_path):
    """vLLM's flags on a real server: the second served name answers, no per-request log lines, images limited
    by the JSON form."""
    s = Server(server_model, tmp_path / "vllm.log",
               ["--served-model-name", "first", "second", "--disable-log-requests", "--disable-log-stats",
                "--limit-mm-per-prompt", '{"image": 2}', "--enable-sleep-mode", "--swap-space", "4",
                "--kv-cache-dtype", "auto", "--dtype", "float", "--uvicorn-log-level", "warning",
                "--enable-prefix-caching", "--disable-custom-all-reduce", "-tp", "1"])
    try:
        s.wait_ready()
        status, body = http("POST", s.url + "/v1/completions",
                            {"model": "second", "prompt": "hello", "max_tokens": 3})
        assert status == 200 and body["model"] == "first", body
        status, body = http("GET", s.url + "/v1/models")
        assert body["data"][0]["id"] == "first"
    finally:
        s.stop()
    log = (tmp_path / "vllm.log").read_text()
    assert "Traceback" not in log and "request cmpl" not in log and "finished (" not in log, log[-3000:]
    assert "serving first" in log, log[-3000:]


def test_a_vllm_026_launch_serves(server_model, tmp_path):
    """vLLM 0.26's forms on a real server: a --config YAML with --override-generation-config (max_new_tokens caps
    a chat reply that sets no max_tokens), CORS with credentials, no uvicorn access log, dotted JSON (a default
    chat-template variable), -O3."""
    import urllib.request

    config = tmp_path / "serve.yaml"
    config.write_text("override-generation-config:\n  max_new_tokens: 2\n  temperature: 0\n"
                      "disable_uvicorn_access_log: true\nallowed-origins: [https://a.example]\n"
                      "allow-credentials: true\n")
    s = Server(server_model, tmp_path / "vllm026.log",
               ["--config", str(config), "--limit-mm-per-prompt.image", "1", "-O3", "--no-async-scheduling",
                "--max_num_seqs", "8", "--prefix-caching-hash-algo", "sha256", "--enable-log-outputs",
                "--chat-template", "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
                "--default-chat-template-kwargs.greeting", "hello hello hello"])
    try:
        s.wait_ready()
        status, body = http("POST", s.url + "/v1/chat/completions",
                            {"model": "llama", "messages": [{"role": "user", "content": "hello"}]})
        assert status == 200 and body["usage"]["completion_tokens"] <= 2, body
        messages = [{"role": "user", "content": "hi"}]  # the server's template variable, unless the request's wins
        _, default = http("POST", s.url + "/tokenize", {"messages": messages})
        _, own = http("POST", s.url + "/tokenize", {"messages": messages, "chat_template_kwargs": {"greeting": ""}})
        assert default["count"] > own["count"] > 0, (default, own)
        req = urllib.request.Request(s.url + "/v1/chat/completions", method="OPTIONS", headers={
            "Origin": "https://a.example", "Access-Control-Request-Method": "POST"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.headers["access-control-allow-credentials"] == "true", dict(r.headers)
            assert r.headers["access-control-allow-origin"] == "https://a.example", dict(r.headers)
    finally:
        s.stop()
    log = (tmp_path / "vllm026.log").read_text()
    assert "Traceback" not in log and 'HTTP/1.1" 200' not in log, log[-3000:]


def test_llm_options_take_vllm_forms():
    from kestrel.config import EngineConfig

    assert EngineConfig.create(limit_mm_per_prompt={"image": 3}).multimodal.limit("image") == 3
    assert EngineConfig.create(limit_mm_per_prompt={"video": 2}).multimodal.limit("video") == 2
    assert EngineConfig.create(limit_mm_per_prompt=2).multimodal.limit("video") == 2
    with pytest.raises(ValueError, match="audio is not served here"):
        EngineConfig.create(limit_mm_per_prompt={"image": 1, "audio": 2})


def test_tls_and_root_path_serve(server_model, tmp_path):
    """--ssl-keyfile/--ssl-certfile serve HTTPS; --root-path is the prefix a proxy strips (the routes answer at /)."""
    import shutil
    import ssl
    import subprocess
    import urllib.request

    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a self-signed certificate")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-keyout", str(tmp_path / "key.pem"), "-out", str(tmp_path / "cert.pem")],
                   check=True, capture_output=True)
    s = Server(server_model, tmp_path / "tls.log", ["--ssl-keyfile", str(tmp_path / "key.pem"), "--ssl-certfile",
                                                    str(tmp_path / "cert.pem"), "--root-path", "/llm"])
    try:
        context = ssl.create_default_context(cafile=str(tmp_path / "cert.pem"))
        context.check_hostname = False
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"https://127.0.0.1:{s.port}/ping", context=context, timeout=2) as r:
                    assert r.status == 200
                    break
            except OSError:
                assert s.proc.poll() is None and time.monotonic() < deadline, (tmp_path / "tls.log").read_text()[-3000:]
                time.sleep(0.3)
        with urllib.request.urlopen(f"https://127.0.0.1:{s.port}/v1/models", context=context, timeout=10) as r:
            assert json.loads(r.read())["data"][0]["id"] == "llama"
        with pytest.raises(OSError):  # plain HTTP is not served
            urllib.request.urlopen(f"http://127.0.0.1:{s.port}/ping", timeout=5)
    finally:
        s.stop()
