"""kestrel serve | generate | chat | bench"""
from __future__ import annotations

import argparse
import logging
import runpy
import sys
from pathlib import Path

from kestrel.config import add_cli_args, from_cli_args


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default: 256)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0)")
    g.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens; 0 = off")
    g.add_argument("--seed", dest="sampling_seed", type=int, default=None, help="per-request seed for sampling")


def _params(args):
    from kestrel.engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.sampling_seed)


def _engine(args):
    from kestrel.engine.frontend import LLMEngine

    return LLMEngine(from_cli_args(args))


def cmd_generate(args) -> int:
    from kestrel.entrypoints import LLM

    llm = LLM.__new__(LLM)
    llm.config = from_cli_args(args)
    llm.engine = _engine(args)
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

    return run_server(args)


def cmd_bench(args, rest: list[str]) -> int:
    script = Path(__file__).resolve().parent.parent / "benchmarks" / f"{args.which}.py"
    if not script.exists():
        print(f"benchmark script {script} not found (run from a source checkout)", file=sys.stderr)
        return 2
    sys.argv = [str(script), *rest]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kestrel", description="Kestrel: a compact LLM inference and serving engine.")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for prompts (offline, batched)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (also KESTREL_API_KEY)")
    s.add_argument("--served-model-name", default=None, help="model name clients use (default: the path's name)")
    s.add_argument("--log-requests", action="store_true", help="log prompts and outputs (off: ids and sizes only)")
    s.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json"],
                   help="how tool calls appear in this model's output (hermes: <tool_call> JSON, also Qwen)")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model decide to call tools (tool_choice "auto"; needs --tool-call-parser)')
    s.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1"],
                   help="put the <think>...</think> part of the output into reasoning_content")
    add_cli_args(s)

    b = sub.add_parser("bench", help="benchmarks: throughput | latency | serve (extra flags go to the script)")
    b.add_argument("which", choices=["throughput", "latency", "serve"])
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if argv and argv[0] == "bench":
        args, rest = parser.parse_known_args(argv)
        return cmd_bench(args, rest)
    args = parser.parse_args(argv)
    if args.command == "serve" and args.model_tag and not args.model:
        args.model = args.model_tag
    return {"generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
