"""The `vllm serve` flags that Kestrel's own flags do not cover, so that a vLLM launch script starts or stops with
one line saying why. Each is accepted for the values that change nothing here (and its help says why), or refused
for the others. vLLM's spellings of Kestrel's own options (-tp, --dtype half, --limit-mm-per-prompt '{"image": 2}',
--num-gpu-blocks-override, ...) are aliases in kestrel/config.py; the flags that act (--disable-log-requests,
--root-path, --ssl-*, --uvicorn-log-level, --download-dir, --revision) are ordinary `kestrel serve` flags."""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from typing import Any, Callable

from kestrel.errors import ConfigError


@dataclass(frozen=True)
class CompatFlag:
    names: tuple[str, ...]
    why: str  # what the flag would do here: "no effect: ..." for accepted values, the reason for refused ones
    accepts: Callable[[Any], bool] = lambda value: True  # the values accepted with no effect
    kwargs: dict = field(default_factory=dict)  # argparse keyword arguments (default: one string value)

    @property
    def dest(self) -> str:
        return "vllm_" + self.names[0].lstrip("-").replace("-", "_")


def _backend_of(config: str) -> str:
    try:
        value = json.loads(config)
    except ValueError:
        return "?"
    return str(value.get("backend", "auto")) if isinstance(value, dict) else "?"


_FLAG = dict(action="store_true")
COMPAT_FLAGS = (
    CompatFlag(("--enable-sleep-mode",), "no effect: sleep is always available (/sleep and /wake_up, with "
               "--enable-admin-api)", kwargs=_FLAG),
    CompatFlag(("--swap-space",), "no effect: the KV cache lives on the GPU only; a preempted request recomputes "
               "its KV instead of swapping it to host memory", kwargs=dict(type=float)),
    CompatFlag(("--disable-custom-all-reduce",), "no effect: tensor parallelism uses torch.distributed's "
               "all-reduce", kwargs=_FLAG),
    CompatFlag(("--disable-frontend-multiprocessing",), "no effect: the HTTP server and the engine cores always "
               "run in separate processes", kwargs=_FLAG),
    CompatFlag(("--max-parallel-loading-workers",), "no effect: each rank reads its own shards",
               kwargs=dict(type=int)),
    CompatFlag(("--max-log-len",), "no effect: --log-requests logs prompts whole", kwargs=dict(type=int)),
    CompatFlag(("--hf-token",), "no effect: the hub is not reached (models come from folders or the local cache)",
               kwargs=dict(nargs="?", const="")),
    CompatFlag(("--tokenizer-mode",), "only auto (the checkpoint's fast tokenizer) is implemented",
               lambda v: v in ("auto", "hf")),
    CompatFlag(("--pipeline-parallel-size", "-pp"), "pipeline parallelism is not implemented (use "
               "--tensor-parallel-size or --data-parallel-size)", lambda v: v == 1, dict(type=int)),
    CompatFlag(("--api-server-count",), "one HTTP server process serves all engine cores", lambda v: v == 1,
               dict(type=int)),
    CompatFlag(("--cpu-offload-gb",), "offloading weights to host memory is not implemented", lambda v: v == 0,
               dict(type=float)),
    CompatFlag(("--guided-decoding-backend",), "structured outputs use xgrammar (auto)",
               lambda v: v in ("auto", "xgrammar")),
    CompatFlag(("--structured-outputs-config",), "structured outputs use xgrammar (backend auto or xgrammar)",
               lambda v: _backend_of(v) in ("auto", "xgrammar")),
    CompatFlag(("--task",), "vLLM's old spelling: use --runner pooling --convert embed|classify (generate is the "
               "default)", lambda v: v in ("auto", "generate")),
    CompatFlag(("--compilation-config", "-O"), "no effect: Kestrel does not use torch.compile; CUDA graphs follow "
               "--enforce-eager and --cuda-graph-sizes"),
    CompatFlag(("--enable-expert-parallel",), "expert parallelism is not implemented (MoE experts are split by "
               "--tensor-parallel-size)", lambda v: not v, _FLAG),
    CompatFlag(("--kv-transfer-config",), "disaggregated prefill (KV transfer) is not implemented; for "
               "OffloadingConnector's host and file tiers use --kv-offloading-size and --kv-offloading-disk-path "
               "with --kv-offloading-disk-size", lambda v: False),
    CompatFlag(("--hf-overrides",), "overriding config.json fields is not implemented (edit a copy of the "
               "checkpoint folder)", lambda v: False),
    CompatFlag(("--middleware",), "extra ASGI middleware is not implemented", lambda v: False),
    CompatFlag(("--return-tokens-as-token-ids",), "token ids as logprob tokens are not implemented",
               lambda v: not v, _FLAG),
)


def add_compat_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("vLLM compatibility (flags of `vllm serve` that change nothing here or are "
                                      "refused with a reason)")
    for flag in COMPAT_FLAGS:
        kw = flag.kwargs if "action" in flag.kwargs else {
            "type": str, "metavar": flag.names[0].lstrip("-").upper().replace("-", "_"), **flag.kwargs}
        help_text = flag.why if flag.why.startswith("no effect") else f"refused unless it changes nothing: {flag.why}"
        group.add_argument(*flag.names, dest=flag.dest, default=None, help=help_text, **kw)


def check_compat_args(args: argparse.Namespace) -> None:
    """ConfigError naming the first vLLM flag given with a value Kestrel cannot honour."""
    for flag in COMPAT_FLAGS:
        value = getattr(args, flag.dest, None)
        if value is not None and not flag.accepts(value):
            shown = "" if isinstance(value, bool) else f" {value}"
            raise ConfigError(f"{flag.names[0]}{shown}: {flag.why}")
