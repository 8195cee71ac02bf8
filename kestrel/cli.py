"""kestrel serve | generate | chat | bench"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from kestrel.config import ServerConfig, add_cli_args, add_section_args, from_cli_args

USAGE_ERROR = 2  # the exit status of every CLI mistake and start-up refusal (argparse's own)


class OneLineParser(argparse.ArgumentParser):
    """A flag mistake is one line on stderr (argparse prints the whole usage first)."""

    def error(self, message: str):
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default: 256)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0)")
    g.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens; 0 = off")
    g.add_argument("--seed", dest="sampling_seed", type=int, default=None, help="per-request seed for sampling")


def _params(args):
    from kestrel.core.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.sampling_seed)


def _engine(args):
    from kestrel.frontend.sync_engine import LLMEngine

    return LLMEngine(from_cli_args(args))


def cmd_generate(args) -> int:
    from kestrel.entrypoints import LLM

    llm = LLM.from_config(from_cli_args(args))
    prompts = args.prompt or ["The capital of France is"]
    if args.chat_template:
        prompts = [llm.engine.input_processor.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    for out in llm.generate(prompts, _params(args)):
        print(out.outputs[0].text)
    return 0


def cmd_chat(args) -> int:
    engine = _engine(args)
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    inputs = iter(args.message) if args.message else None
    print("Kestrel chat: type a message, Ctrl-D or /exit to quit.", file=sys.stderr)
    while True:
        try:
            user = next(inputs) if inputs is not None else input("> ")
        except (EOFError, StopIteration):
            return 0
        if user.strip() in ("/exit", "/quit"):
            return 0
        messages.append({"role": "user", "content": user})
        prompt = engine.input_processor.apply_chat_template(messages)
        rid = engine.add_request(prompt, _params(args), stream=True)
        reply = ""
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == rid:
                    delta = out.outputs[0].text_delta
                    reply += delta
                    print(delta, end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": reply})


def cmd_serve(args) -> int:
    from kestrel.server.app import run_server

    args.api_key = resolve_api_key(one_api_key(args.api_key), args.api_key_file)
    return run_server(args)


def one_api_key(keys: list[str] | str | None) -> str | None:
    """vLLM's --api-key takes several keys; one is served here."""
    from kestrel.errors import ConfigError

    if isinstance(keys, list):
        if len(keys) > 1:
            raise ConfigError(f"--api-key: {len(keys)} keys given; one key is served (several keys are not "
                              f"implemented)")
        return keys[0]
    return keys


def resolve_api_key(key: str | None, key_file: str | None) -> str | None:
    """--api-key, else --api-key-file, else $KESTREL_API_KEY, else vLLM's $VLLM_API_KEY. A key on the command
    line is visible to every user of the machine (ps, /proc/PID/cmdline); the file and the environment are not."""
    from kestrel.errors import ConfigError

    if key is not None and not key.strip():
        raise ConfigError("--api-key is empty: give a key, or leave the flag out (a server without a key lets "
                          "anyone in)")
    if key and key_file:
        raise ConfigError("give --api-key or --api-key-file, not both")
    if key_file:
        try:
            key = open(key_file).read().strip()
        except OSError as e:
            raise ConfigError(f"--api-key-file {key_file}: {e.strerror}") from e
        if not key:
            raise ConfigError(f"--api-key-file {key_file} is empty")
        return key
    return key or os.environ.get("KESTREL_API_KEY") or os.environ.get("VLLM_API_KEY") or None


def cmd_bench(args) -> int:
    from kestrel.bench.offline import run

    return run(args.which, args)


def check_args(args) -> None:
    """Checks that fail in a second with one clear line instead of after minutes of start-up."""
    from kestrel.errors import ConfigError

    from kestrel.hub_cache import resolve_model_path

    check_ranges(args)
    for field in ("model", "tokenizer"):
        check_model_path(getattr(args, field, None), field)
    keep_hub_id_as_served_name(args)
    for field in ("model", "tokenizer"):
        if getattr(args, field, None) is not None:
            setattr(args, field, resolve_model_path(getattr(args, field), field, args.revision, args.download_dir))
    task = None  # the pooling task of a pooling model (None: it generates)
    if getattr(args, "model", None) is not None and os.path.isdir(args.model):
        task = check_model_folder(args.model, getattr(args, "runner", "auto"), getattr(args, "convert", "auto"),
                                  getattr(args, "quantization", None))
    if hasattr(args, "enable_lora"):
        check_lora_args(from_cli_args(args).lora)
    from kestrel.vllm_flags import check_compat_args, fold_shorthands

    shorthands = fold_shorthands(args)
    check_speculative_config(getattr(args, "speculative_config", None), shorthands, task)
    check_compat_args(args)
    from kestrel.attention.selector import backend_candidates
    from kestrel.kernels import backend_names

    names = {"attention_backend": ["auto"] + [b.name for b in backend_candidates()],
             "linear_backend": backend_names("linear"), "moe_backend": backend_names("moe")}
    for field, valid in names.items():
        value = getattr(args, field, "auto")
        if value not in valid:
            flag = "--" + field.replace("_", "-")
            raise ConfigError(f"{flag} {value!r} is not one of {', '.join(valid)}")
    if getattr(args, "tool_call_parser", None) or getattr(args, "reasoning_parser", None):
        from kestrel.server.reasoning import get_reasoning_parser
        from kestrel.server.tool_parsers import get_tool_parser

        try:
            get_tool_parser(args.tool_call_parser)
            get_reasoning_parser(args.reasoning_parser)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    check_generation_overrides(getattr(args, "override_generation_config", None))


def keep_hub_id_as_served_name(args) -> None:
    """A model named by its hub id (Org/Name) is served under that id, as vLLM serves it, not under its cache
    snapshot's folder name (--served-model-name still wins). Called before the id is resolved to the folder."""
    from kestrel.hub_cache import is_hub_id

    model = getattr(args, "model", None)
    if model is not None and hasattr(args, "served_model_name") and not args.served_model_name and is_hub_id(model):
        args.served_model_name = [model]


def check_speculative_config(spec: dict | None, shorthands: list[str], task: str | None = None) -> None:
    """At parse time, not after the model loads; the line names the flags that gave it. `task`: the model's
    pooling task (a pooling model is refused by name)."""
    from kestrel.errors import ConfigError
    from kestrel.spec_decode.config import SpeculativeConfig, refuse, task_refusals

    try:
        if SpeculativeConfig.from_dict(spec) is not None:
            refuse(task_refusals(task))
    except ConfigError as e:
        raise ConfigError(f"{'/'.join(shorthands + ['--speculative-config'])}: {e}") from None


def check_generation_overrides(overrides: dict | None) -> None:
    from kestrel.config import GENERATION_OVERRIDE_FIELDS
    from kestrel.errors import ConfigError

    unknown = sorted(set(overrides or {}) - set(GENERATION_OVERRIDE_FIELDS))
    if unknown:
        raise ConfigError(f"--override-generation-config: {', '.join(unknown)} is not a sampling default here "
                          f"(fields: {', '.join(GENERATION_OVERRIDE_FIELDS)})")


# launch values out of range start a server that hangs, forks hundreds of engines, never times out or fails later
# with a traceback: refused at parse time, one line each. field -> (lowest, highest); None: no bound. The upper
# bounds keep each value to what the machine or the engine's buffers can take (a huge --max-num-seqs was an OOM
# kill). Floats must also be finite. tests/server/test_launch_values.py tries every numeric flag at 0, -1, NaN and
# a huge value.
_CPUS = os.cpu_count() or 1
_MAX_SEQS = 2**16  # sequences a step (per-sequence buffers are sized by it)
_MAX_TOKENS = 2**24  # tokens of one context or one step
_INT_RANGES = {"max_num_seqs": (1, _MAX_SEQS), "max_num_batched_tokens": (1, _MAX_TOKENS), "block_size": (1, 1024),
               "max_model_len": (1, _MAX_TOKENS), "port": (0, 65535), "tensor_parallel_size": (1, max(8, _CPUS)),
               "data_parallel_size": (1, _CPUS), "engine_restart_limit": (0, None),
               "default_max_tokens": (1, None), "max_request_body_bytes": (1, None),
               "responses_store_size": (0, None), "responses_store_bytes": (1, None), "max_logprobs": (0, None),
               "num_kv_blocks": (1, None), "max_seqs_per_request": (0, None), "seed": (-(2**63), 2**63 - 1),
               "renderer_num_workers": (1, 1024), "image_render_processes": (0, max(8, _CPUS)),
               "num_state_snapshots": (0, _MAX_SEQS), "structured_output_threads": (0, 1024),
               "contended_seqs_per_request": (-1, None), "cpu_threads": (0, 1024),
               "cuda_graph_sizes": (1, _MAX_SEQS), "cuda_graph_prefill_max_tokens": (0, None),
               "max_lora_rank": (1, 1024), "max_loras": (1, 1024), "max_cpu_loras": (1, None),
               "limit_mm_per_prompt": (0, None), "max_image_bytes": (1, None), "max_image_pixels": (1, None),
               "kv_offloading_preempt_min_tokens": (0, None)}
_WHY = {"data_parallel_size": " (one engine-core process each; this machine has that many CPUs)",
        "tensor_parallel_size": " (one worker process each; this machine has that many CPUs, or 8; more over a Ray "
                                "cluster)",
        "image_render_processes": " (processes; this machine has that many CPUs, or 8)"}
_MAX_SECONDS = 10**7  # about 115 days: "never" in practice; threading's waits take nothing above ~9.2e9
_POSITIVE_SECONDS = ("engine_hang_timeout", "engine_startup_timeout", "engine_restart_window", "request_timeout",
                     "grammar_parse_timeout", "grammar_compile_timeout", "media_fetch_timeout", "log_stats_interval")


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _float_ranges() -> dict[str, tuple[float, float, str]]:
    """field -> (above this, at most this, unit): finite floats in (low, high]."""
    gib = round(physical_memory() / 2**30, 1)
    return {"gpu_memory_utilization": (0.0, 1.0, "(a fraction)"),
            "kv_offloading_size": (0.0, gib, "GiB (this machine's memory)"),
            "kv_offloading_disk_size": (0.0, 1e9, "GiB"),
            **{f: (0.0, _MAX_SECONDS, "seconds") for f in _POSITIVE_SECONDS}}


def check_ranges(args) -> None:
    import math

    from kestrel.errors import ConfigError

    ranges = dict(_INT_RANGES, kv_cache_memory=(1, physical_memory()))
    if getattr(args, "distributed_executor_backend", None) == "ray":  # ranks over the cluster's nodes
        ranges["tensor_parallel_size"] = (1, None)
    for field, (low, high) in ranges.items():
        values = getattr(args, field, None)
        for value in (values if isinstance(values, list) else list(values.values()) if isinstance(values, dict)
                      else [values]):  # a dict: --limit-mm-per-prompt's per-modality counts
            if value is None:
                continue
            if value < low or (high is not None and value > high):
                flag = "--" + field.replace("_", "-")
                span = f"at least {low}" if high is None else f"from {low} to {high}"
                raise ConfigError(f"{flag} must be {span}, got {value}{_WHY.get(field, '')}")
    for field, (low, high, unit) in _float_ranges().items():
        value = getattr(args, field, None)
        if value is not None and not (math.isfinite(value) and low < value <= high):
            flag = "--" + field.replace("_", "-")
            if unit == "seconds":
                raise ConfigError(f"{flag} must be a positive number of seconds, got {value} (at most {high:g})")
            raise ConfigError(f"{flag} must be above {low:g} and at most {high:g} {unit}, got {value}")


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def check_model_path(path: str | None, field: str) -> None:
    """A --model or --tokenizer that names something on disk must be a checkpoint folder or a regular file (not a
    device such as /dev/zero), and a --tokenizer folder must hold tokenizer files."""
    from kestrel.errors import ConfigError

    if path is None or not os.path.exists(path):
        return  # a hub id: resolved (or refused) by resolve_model_path
    flag = f"--{field}"
    if not (os.path.isdir(path) or os.path.isfile(path)):
        raise ConfigError(f"{flag} {path} is neither a checkpoint folder nor a file")
    if os.path.isfile(path) and field == "model" and not path.endswith(".gguf"):
        raise ConfigError(f"{flag} {path} is a file but not a GGUF checkpoint (.gguf); give a checkpoint folder")
    if field == "tokenizer" and os.path.isdir(path) and not any(
            os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        raise ConfigError(f"{flag} {path} holds no tokenizer ({', '.join(_TOKENIZER_FILES)})")


def check_model_folder(folder: str, runner: str = "auto", convert: str = "auto",
                       quantization: str | None = None) -> str | None:
    """A checkpoint folder has a config.json naming an architecture Kestrel implements, in a runner it can serve
    (else the engine cores would fail after seconds of start-up, each with its traceback). Returns its pooling
    task (None: a generative model)."""
    import json

    from kestrel.errors import ConfigError
    from kestrel.core.pooling import pooling_task
    from kestrel.models.registry import is_supported, supported_architectures

    try:
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
    except OSError:
        raise ConfigError(f"model folder {folder!r} has no config.json (give a checkpoint folder: config.json + "
                          f"*.safetensors, or a .gguf file)") from None
    except ValueError as e:
        raise ConfigError(f"model folder {folder!r}: config.json is not JSON ({e})") from None
    arch = ((config.get("architectures") if isinstance(config, dict) else None) or ["LlamaForCausalLM"])[0]
    if not is_supported(arch):
        raise ConfigError(f"model architecture {arch!r} ({folder}) is not implemented; supported: "
                          f"{', '.join(supported_architectures())}")
    task = pooling_task(arch, runner or "auto", convert or "auto")  # --runner / --convert fit this model
    check_quantization(config, quantization)
    return task


def check_quantization(config: dict, quantization: str | None) -> None:
    """The checkpoint's quantization_config is one Kestrel reads and --quantization agrees with it (else one line
    naming what is not read, before any engine starts)."""
    from kestrel.errors import ConfigError
    from kestrel.layers.quant import get_quant_config

    try:
        get_quant_config(config, quantization)
    except (NotImplementedError, ValueError) as e:
        raise ConfigError(str(e)) from None


def check_lora_args(cfg) -> None:
    """--lora-modules: name=path pairs (with --enable-lora) naming PEFT adapter folders."""
    from kestrel.errors import ConfigError
    from kestrel.frontend.lora_registry import parse_lora_modules

    for name, path in parse_lora_modules(cfg):
        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            raise ConfigError(f"--lora-modules {name}={path}: not a PEFT adapter folder (no adapter_config.json)")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="kestrel", description="Kestrel: a compact LLM inference and serving engine.")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for prompts (offline, batched)")
    g.add_argument("prompt", nargs="*", help="prompts (default: a demo prompt)")
    g.add_argument("--chat-template", action="store_true", help="wrap each prompt as a user message with the chat template")
    _sampling_args(g)
    add_cli_args(g, skip=("seed",))

    c = sub.add_parser("chat", help="interactive chat, streamed to the terminal")
    c.add_argument("--system", default=None, help="system prompt")
    c.add_argument("--message", action="append", help="send these messages instead of reading stdin (repeatable)")
    _sampling_args(c)
    add_cli_args(c, skip=("seed",))

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    s.add_argument("model_tag", nargs="?", default=None, help="model path (same as --model)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1, loopback only)")
    s.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    s.add_argument("--api-key", nargs="+", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: "
                        "$KESTREL_API_KEY, else $VLLM_API_KEY; one key); other users of the machine can read it from "
                        "the process list: prefer --api-key-file or the environment")
    s.add_argument("--api-key-file", default=None, help="read the API key from this file (its first line)")
    s.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use; the first is the one responses carry (default: the path's name)")
    s.add_argument("--log-requests", "--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                   help="log prompts and outputs (off: ids and sizes only)")
    s.add_argument("--disable-log-requests", action="store_true", help="no log line per request at all")
    s.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"], help="uvicorn's log level")
    s.add_argument("--disable-uvicorn-access-log", action=argparse.BooleanOptionalAction, default=False,
                   help="no uvicorn access-log line per HTTP request")
    s.add_argument("--root-path", default="", help="URL prefix the app sits under behind a path-based proxy")
    s.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (and --ssl-certfile)")
    s.add_argument("--ssl-certfile", default=None, help="the certificate of --ssl-keyfile")
    add_section_args(s, ServerConfig, "server")
    add_cli_args(s)
    from kestrel.vllm_flags import add_compat_args

    add_compat_args(s)

    b = sub.add_parser("bench", help="benchmarks: throughput | latency | serve")
    bsub = b.add_subparsers(dest="which", required=True)
    from kestrel.bench.offline import add_parser

    add_parser(bsub, "throughput")
    add_parser(bsub, "latency")
    bsub.add_parser("serve", help="load an OpenAI-compatible server with streaming clients "
                                  "(kestrel bench serve --help)", add_help=False)  # main() hands its flags over
    return p


def option_strings(parser: argparse.ArgumentParser, command: str) -> set[str]:
    """The option strings of one subcommand's parser."""
    subparsers = parser._subparsers._group_actions if parser._subparsers else []
    sub = next((a.choices.get(command) for a in subparsers), None)
    return {o for a in (sub or parser)._actions for o in a.option_strings}


def main(argv: list[str] | None = None) -> int:
    from kestrel.errors import KestrelError
    from kestrel.vllm_argv import rewrite as rewrite_vllm_argv

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["bench", "serve"]:  # its own parser (kestrel/bench/serve.py)
        from kestrel.bench.serve import main as serve_main

        return serve_main(argv[2:])
    parser = build_parser()
    try:
        argv = rewrite_vllm_argv(argv, option_strings(parser, argv[0] if argv else ""))
    except KestrelError as e:
        print(f"kestrel: error: {one_line(str(e))}", file=sys.stderr)
        return USAGE_ERROR
    args = parser.parse_args(argv)
    if args.command == "serve" and args.model_tag and not args.model:
        args.model = args.model_tag
    try:
        check_args(args)
        return {"generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve, "bench": cmd_bench}[args.command](args)
    except KeyboardInterrupt:
        print("kestrel: interrupted", file=sys.stderr)
        return 130
    except (KestrelError, FileNotFoundError) as e:
        print(f"kestrel: error: {one_line(str(e))}", file=sys.stderr)
        return USAGE_ERROR


def one_line(message: str) -> str:
    return " ".join(message.split())


if __name__ == "__main__":
    sys.exit(main())
