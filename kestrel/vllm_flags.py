"""The `vllm serve` flags that Kestrel's own flags do not cover (vLLM 0.26's whole list, group by group, and older
ones launch scripts still carry), so that a vLLM launch script starts or stops with one line saying why. Each is
accepted for the values that change nothing here (and its help says why), or refused for the others. vLLM's
spellings of Kestrel's own options (-tp, -q, --dtype half, --limit-mm-per-prompt '{"image": 2}',
--num-gpu-blocks-override, --cudagraph-capture-sizes, ...) are aliases in kestrel/config.py; the flags that act
(--disable-log-requests, --root-path, --ssl-*, --uvicorn-log-level, --download-dir, --revision, --allow-credentials,
--override-generation-config, ...) are ordinary `kestrel serve` flags; vLLM's command-line forms (--config YAML,
dotted JSON flags, -O3) are rewritten by kestrel/vllm_argv.py before parsing."""
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
    fits: Callable[[Any, argparse.Namespace], bool] | None = None  # instead of accepts, where other flags count

    @property
    def dest(self) -> str:
        return "vllm_" + self.names[0].lstrip("-").replace("-", "_")


def _backend_of(config: str) -> str:
    try:
        value = json.loads(config)
    except ValueError:
        return "?"
    return str(value.get("backend", "auto")) if isinstance(value, dict) else "?"


_FLAG = dict(action="store_true")  # a flag of older vLLM versions, without a --no- form
_BOOL = dict(action=argparse.BooleanOptionalAction)  # --X and --no-X, as vLLM 0.26's boolean flags
_INT, _FLOAT, _LIST = dict(type=int), dict(type=float), dict(nargs="+")


def _json_equal(expected: Any) -> Callable[[Any], bool]:
    def accepts(value: Any) -> bool:
        try:
            return json.loads(value) == expected
        except (TypeError, ValueError):
            return False
    return accepts


def noop(names: tuple[str, ...], why: str, kwargs: dict | None = None) -> CompatFlag:
    """A flag whose every value changes nothing here."""
    return CompatFlag(names, "no effect: " + why, lambda value: True, kwargs or {})


def only(names: tuple[str, ...], why: str, *values: Any, kwargs: dict | None = None) -> CompatFlag:
    """Accepted for ``values`` (no effect here), refused with ``why`` for any other."""
    return CompatFlag(names, why, lambda value: value in values, kwargs or {})


def off(names: tuple[str, ...], why: str) -> CompatFlag:
    """A boolean vLLM flag that is off by default: --no-X is accepted, --X refused with ``why``."""
    return CompatFlag(names, why, lambda value: not value, _BOOL)


def refused(names: tuple[str, ...], why: str, kwargs: dict | None = None) -> CompatFlag:
    return CompatFlag(names, why, lambda value: False, kwargs or {})


def model_dtype(args: argparse.Namespace) -> str:
    """The dtype the model will run in: --dtype, or auto's choice for the device."""
    from kestrel.config import from_cli_args

    config = from_cli_args(args)
    if config.model.dtype != "auto":
        return config.model.dtype
    return "float32" if config.on_cpu() else "bfloat16"


_MULTI_NODE = "multi-node serving is not implemented: one `kestrel serve` runs on one node"
_NO_EP = "expert parallelism is not used (--enable-expert-parallel is refused)"
_NO_DP_LB = ("one `kestrel serve` balances requests over its own --data-parallel-size engine cores; external "
             "or hybrid load balancing over several servers is not implemented")
_NO_RECURRENT_OPTS = "Kestrel's recurrent-state layers keep their state in the model's dtype with its own kernels"

COMPAT_FLAGS = (
    # flags of older vLLM versions that launch scripts still carry
    CompatFlag(("--swap-space",), "no effect: the KV cache lives on the GPU only; a preempted request recomputes "
               "its KV instead of swapping it to host memory", kwargs=dict(type=float)),
    CompatFlag(("--disable-frontend-multiprocessing",), "no effect: the HTTP server and the engine cores always "
               "run in separate processes", kwargs=_FLAG),
    CompatFlag(("--guided-decoding-backend",), "structured outputs use xgrammar (auto)",
               lambda v: v in ("auto", "xgrammar")),
    CompatFlag(("--task",), "vLLM's old spelling: use --runner pooling --convert embed|classify (generate is the "
               "default)", lambda v: v in ("auto", "generate")),
    noop(("--max-seq-len-to-capture",), "decode CUDA graphs are captured by batch size (--cuda-graph-sizes) "
         "whatever the context length, prefill graphs up to --cuda-graph-prefill-max-tokens", _INT),
    noop(("--use-v2-block-manager",), "the KV cache is paged in blocks (--block-size)", _FLAG),
    only(("--num-scheduler-steps",), "multi-step scheduling is gone from vLLM too; one step is scheduled at a time",
         1, kwargs=_INT),
    noop(("--disable-async-output-proc",), "outputs are processed by the engine core's own loop", _FLAG),
    noop(("--enable-reasoning",), "--reasoning-parser alone turns reasoning parsing on", _FLAG),
    noop(("--disable-mm-preprocessor-cache",), "Kestrel keeps no cache of processed multimodal inputs of this kind",
         _FLAG),
    only(("--preemption-mode",), "a preempted request recomputes its KV (recompute)", "recompute"),
    only(("--tokenizer-pool-size",), "the server's render threads tokenize (--renderer-num-workers)", 0,
         kwargs=_INT),
    refused(("--speculative-model",), "give --speculative-config '{\"method\": ..., \"model\": ...}'"),
    refused(("--num-speculative-tokens",), "give --speculative-config '{\"method\": ..., "
            "\"num_speculative_tokens\": k}'", _INT),
    refused(("--rope-scaling",), "overriding config.json's rope_scaling is not implemented (edit a copy of the "
            "checkpoint folder)"),
    refused(("--rope-theta",), "overriding config.json's rope_theta is not implemented (edit a copy of the "
            "checkpoint folder)"),

    # vLLM 0.26, `vllm serve --help`, by group. top-level options
    off(("--headless",), _MULTI_NODE),
    CompatFlag(("--api-server-count", "-asc"), "one HTTP server process serves all engine cores", lambda v: v == 1,
               dict(type=int)),
    off(("--grpc",), "only the HTTP (OpenAI-compatible) server is implemented"),
    off(("--aggregate-engine-logging",), "the periodic stats lines are per engine core (Engine 000, ...); one "
        "summed line is not implemented"),
    noop(("--fail-on-environ-validation",), "Kestrel reads no VLLM_* environment variables (but VLLM_API_KEY)",
         _BOOL),
    only(("--shutdown-timeout",), "a shutdown stops running requests at once; waiting for them to finish is not "
         "implemented", 0, kwargs=_INT),
    only(("--gdn-prefill-backend",), "Kestrel's linear-attention layers run its own Triton kernels", "triton"),

    # Frontend
    only(("--chat-template-content-format",), "text-only message content reaches the chat template as one string "
         "and content with images as a list of parts (auto); forcing the list form (openai) is not implemented",
         "auto", "string"),
    only(("--response-role",), "chat replies carry the role assistant", "assistant"),
    CompatFlag(("--return-tokens-as-token-ids",), "token ids as logprob tokens are not implemented",
               lambda v: not v, _BOOL),
    off(("--exclude-tools-when-tool-choice-none",), "leaving the tools out of the prompt under tool_choice none "
        "is not implemented"),
    only(("--tool-parser-plugin",), "parser plugins (Python files) are not loaded; the built-in parsers are named "
         "by --tool-call-parser", ""),
    refused(("--tool-server",), "built-in tool servers (MCP, demo tools) are not implemented"),
    refused(("--log-config-file",), "a logging configuration file is not read (see --uvicorn-log-level)"),
    CompatFlag(("--max-log-len",), "no effect: --log-requests logs prompts whole", kwargs=dict(type=int)),
    off(("--enable-per-request-metrics",), "per-request metrics are not implemented"),
    off(("--enable-server-load-tracking",), "server load tracking (/load) is not implemented"),
    off(("--enable-force-include-usage",), "usage in every streamed response is not implemented (a request asks "
        "for it with stream_options.include_usage)"),
    off(("--enable-tokenizer-info-endpoint",), "/tokenizer_info is not implemented"),
    noop(("--enable-log-outputs",), "--log-requests logs the outputs with the prompts", _BOOL),
    noop(("--enable-log-deltas",), "--log-requests logs each output whole when its request finishes", _BOOL),
    off(("--log-error-stack",), "error stacks in responses' logs are not implemented"),
    off(("--tokens-only",), "the tokens-only serving mode is not implemented"),
    only(("--fingerprint-mode",), "response fingerprints (system_fingerprint) are not implemented", "none"),
    refused(("--fingerprint-value",), "response fingerprints (system_fingerprint) are not implemented"),
    noop(("--data-parallel-supervisor-port",), "used with --data-parallel-multi-port-external-lb only (refused)",
         _INT),
    noop(("--dp-supervisor-probe-interval-s",), "used with --data-parallel-multi-port-external-lb only (refused)",
         _FLOAT),
    noop(("--dp-supervisor-probe-timeout-s",), "used with --data-parallel-multi-port-external-lb only (refused)",
         _FLOAT),
    noop(("--dp-supervisor-probe-failure-threshold",), "used with --data-parallel-multi-port-external-lb only "
         "(refused)", _INT),
    refused(("--uds",), "serving on a Unix domain socket is not implemented (use --host and --port)"),
    refused(("--disable-access-log-for-endpoints",), "per-endpoint access-log filters are not implemented (see "
            "--disable-uvicorn-access-log)"),
    CompatFlag(("--allowed-methods",), "with --allowed-origins, CORS allows every method (\'[\"*\"]\')",
               _json_equal(["*"])),
    CompatFlag(("--allowed-headers",), "with --allowed-origins, CORS allows every header (\'[\"*\"]\')",
               _json_equal(["*"])),
    refused(("--ssl-ca-certs",), "client certificates are not checked (TLS serves --ssl-keyfile and "
            "--ssl-certfile only)"),
    off(("--enable-ssl-refresh",), "reloading changed certificate files is not implemented (restart the server)"),
    only(("--ssl-cert-reqs",), "client certificates are not checked (TLS serves --ssl-keyfile and --ssl-certfile "
         "only)", 0, kwargs=_INT),
    refused(("--ssl-ciphers",), "choosing TLS ciphers is not implemented (Python's defaults apply)"),
    CompatFlag(("--middleware",), "extra ASGI middleware is not implemented", lambda v: False),
    off(("--enable-request-id-headers",), "the X-Request-Id response header is not implemented"),
    off(("--disable-fastapi-docs",), "/docs and /openapi.json are always served (behind --api-key when one is "
        "set)"),
    refused(("--h11-max-incomplete-event-size",), "HTTP parser limits are uvicorn's own (not configurable here)",
            _INT),
    refused(("--h11-max-header-count",), "HTTP parser limits are uvicorn's own (not configurable here)", _INT),
    off(("--enable-offline-docs",), "/docs loads Swagger UI from its CDN; vendored assets are not shipped"),
    noop(("--enable-flash-late-interaction",), "no late-interaction (ColBERT) models are served", _BOOL),

    # ModelConfig
    CompatFlag(("--tokenizer-mode",), "only auto (the checkpoint's fast tokenizer) is implemented",
               lambda v: v in ("auto", "hf")),
    refused(("--hf-config-path",), "config.json is read from the model folder"),
    refused(("--code-revision",), "the model's code is read from the --revision snapshot"),
    refused(("--tokenizer-revision",), "a hub tokenizer is read from the --revision snapshot"),
    refused(("--quantization-config",), "quantization is read from the checkpoint's quantization_config (or "
            "--quantization)"),
    noop(("--allow-deprecated-quantization",), "no quantization format Kestrel reads is deprecated", _BOOL),
    off(("--enable-return-routed-experts",), "returning routed experts is not implemented"),
    only(("--logprobs-mode",), "logprobs are the raw model's log-softmax (raw_logprobs)", "raw_logprobs"),
    off(("--use-fp64-gumbel",), "float64 sampling noise is not implemented"),
    off(("--disable-sliding-window",), "sliding-window layers always keep their window"),
    noop(("--disable-cascade-attn",), "Kestrel has no cascade attention", _BOOL),
    off(("--skip-tokenizer-init",), "serving without a tokenizer is not implemented"),
    off(("--enable-prompt-embeds",), "prompt_embeds inputs are not implemented"),
    only(("--config-format",), "config.json is read in the Hugging Face format (auto, hf)", "auto", "hf"),
    CompatFlag(("--hf-token",), "no effect: the hub is not reached (models come from folders or the local cache)",
               kwargs=dict(nargs="?", const="")),
    CompatFlag(("--hf-overrides",), "overriding config.json fields is not implemented (edit a copy of the "
               "checkpoint folder)", _json_equal({})),
    CompatFlag(("--model-class-overrides",), "replacing model classes is not implemented", _json_equal({})),
    refused(("--pooler-config",), "pooling follows --runner / --convert and the checkpoint's own pooling files"),
    CompatFlag(("--enable-sleep-mode",), "no effect: sleep is always available (/sleep and /wake_up, with "
               "--enable-admin-api)", kwargs=_BOOL),
    off(("--enable-cumem-allocator",), "the cumem allocator is not implemented"),
    only(("--model-impl",), "only Kestrel's own model implementations run (auto, vllm)", "auto", "vllm"),
    refused(("--override-attention-dtype",), "attention runs in the model's dtype (--dtype)"),
    refused(("--logits-processors",), "custom logits-processor classes are not loaded", _LIST),
    refused(("--io-processor-plugin",), "IO processor plugins are not loaded"),

    # LoadConfig
    only(("--safetensors-load-strategy",), "safetensors files are read memory-mapped (lazy)", "lazy", "None"),
    noop(("--safetensors-prefetch-num-threads",), "used with --safetensors-load-strategy prefetch only (refused)",
         _INT),
    noop(("--safetensors-prefetch-block-size",), "used with --safetensors-load-strategy prefetch only (refused)"),
    CompatFlag(("--model-loader-extra-config",), "loader options are not implemented", _json_equal({})),
    CompatFlag(("--ignore-patterns",), "the checkpoint's top-level *.safetensors are read (original/ is never "
               "read)", lambda v: v == ["original/**/*"], _LIST),
    noop(("--use-tqdm-on-load",), "loading shows Kestrel's own progress", _BOOL),
    noop(("--pt-load-map-location",), "PyTorch .bin checkpoints are not read (safetensors and GGUF are)"),

    # MambaConfig
    only(("--mamba-backend",), _NO_RECURRENT_OPTS, "triton"),
    off(("--enable-mamba-cache-stochastic-rounding",), _NO_RECURRENT_OPTS),
    noop(("--mamba-cache-philox-rounds",), "used with --enable-mamba-cache-stochastic-rounding only (refused)",
         _INT),

    # StructuredOutputsConfig
    only(("--reasoning-parser-plugin",), "parser plugins (Python files) are not loaded; the built-in parsers are "
         "named by --reasoning-parser", ""),

    # ParallelConfig
    CompatFlag(("--pipeline-parallel-size", "-pp"), "pipeline parallelism is not implemented (use "
               "--tensor-parallel-size or --data-parallel-size)", lambda v: v == 1, dict(type=int)),
    noop(("--master-addr",), "one node only (see --nnodes)"),
    noop(("--master-port",), "one node only (see --nnodes)", _INT),
    only(("--nnodes", "-n"), _MULTI_NODE, 1, kwargs=_INT),
    only(("--node-rank", "-r"), _MULTI_NODE, 0, kwargs=_INT),
    noop(("--distributed-timeout-seconds",), "tensor-parallel workers start within --engine-startup-timeout",
         _INT),
    noop(("--cpu-distributed-timeout-seconds",), "tensor-parallel workers start within --engine-startup-timeout",
         _INT),
    off(("--numa-bind",), "NUMA binding is not implemented (use numactl)"),
    refused(("--numa-bind-nodes",), "NUMA binding is not implemented (use numactl)", _LIST),
    refused(("--numa-bind-cpus",), "NUMA binding is not implemented (use numactl)", _LIST),
    refused(("--device-ids",), "GPUs are chosen with CUDA_VISIBLE_DEVICES"),
    only(("--decode-context-parallel-size", "-dcp"), "context parallelism is not implemented", 1, kwargs=_INT),
    noop(("--dcp-comm-backend",), "context parallelism is not used"),
    noop(("--dcp-kv-cache-interleave-size",), "context parallelism is not used", _INT),
    noop(("--cp-kv-cache-interleave-size",), "context parallelism is not used", _INT),
    only(("--prefill-context-parallel-size", "-pcp"), "context parallelism is not implemented", 1, kwargs=_INT),
    refused(("--data-parallel-rank", "-dpn"), _NO_DP_LB, _INT),
    refused(("--data-parallel-start-rank", "-dpr"), _MULTI_NODE, _INT),
    refused(("--data-parallel-size-local", "-dpl"), _MULTI_NODE + " (--data-parallel-size engine cores run here)",
            _INT),
    refused(("--data-parallel-address", "-dpa"), _MULTI_NODE),
    refused(("--data-parallel-rpc-port", "-dpp"), _MULTI_NODE, _INT),
    only(("--data-parallel-backend", "-dpb"), "data-parallel engine cores are local processes (mp)", "mp"),
    off(("--data-parallel-hybrid-lb", "-dph"), _NO_DP_LB),
    off(("--data-parallel-external-lb", "-dpe"), _NO_DP_LB),
    CompatFlag(("--data-parallel-multi-port-external-lb", "-dpm"), _NO_DP_LB, lambda v: not v, _FLAG),
    CompatFlag(("--enable-expert-parallel", "-ep"), "expert parallelism is not implemented (MoE experts are split "
               "by --tensor-parallel-size)", lambda v: not v, _BOOL),
    noop(("--enable-ep-weight-filter",), _NO_EP, _BOOL),
    noop(("--all2all-backend",), _NO_EP),
    off(("--enable-dbo",), "dual-batch overlap is not implemented"),
    only(("--ubatch-size",), "micro-batching (dual-batch overlap) is not implemented", 0, kwargs=_INT),
    off(("--enable-elastic-ep",), "elastic expert parallelism is not implemented"),
    noop(("--dbo-decode-token-threshold",), "used with --enable-dbo only (refused)", _INT),
    noop(("--dbo-prefill-token-threshold",), "used with --enable-dbo only (refused)", _INT),
    noop(("--disable-nccl-for-dp-synchronization",), "data-parallel engine cores do not synchronise their steps",
         _BOOL),
    off(("--enable-eplb",), "expert load balancing is not implemented"),
    noop(("--eplb-config",), "used with --enable-eplb only (refused)"),
    noop(("--expert-placement-strategy",), _NO_EP),
    CompatFlag(("--max-parallel-loading-workers",), "no effect: each rank reads its own shards",
               kwargs=dict(type=int)),
    off(("--ray-workers-use-nsight",), "profiling Ray workers with Nsight is not implemented"),
    CompatFlag(("--disable-custom-all-reduce",), "no effect: tensor parallelism uses torch.distributed's "
               "all-reduce", kwargs=_BOOL),
    only(("--worker-cls",), "custom worker classes are not loaded", "auto"),
    only(("--worker-extension-cls",), "worker extension classes are not loaded", ""),

    # CacheConfig
    refused(("--kv-cache-memory-bytes",), "size the GPU KV cache with --num-gpu-blocks-override or "
            "--gpu-memory-utilization"),
    noop(("--prefix-caching-hash-algo",), "the prefix cache chains Kestrel's own block hashes"),
    CompatFlag(("--kv-cache-dtype-skip-layers",), "a per-layer KV-cache dtype is not implemented",
               lambda v: v == [], _LIST),
    off(("--kv-sharing-fast-prefill",), "KV-sharing fast prefill is not implemented"),
    only(("--mamba-cache-dtype",), _NO_RECURRENT_OPTS, "auto"),
    only(("--mamba-ssm-cache-dtype",), _NO_RECURRENT_OPTS, "auto"),
    refused(("--mamba-block-size",), "recurrent states are saved at KV-block boundaries (see --num-state-snapshots)",
            _INT),
    refused(("--prefix-match-unit",), "prefix-cache hits are whole KV blocks (--block-size)", _INT),
    only(("--mamba-cache-mode",), "prefix caching of recurrent states follows --num-state-snapshots", "none"),

    # OffloadConfig
    only(("--offload-backend",), "offloading weights to host memory is not implemented", "auto"),
    CompatFlag(("--cpu-offload-gb",), "offloading weights to host memory is not implemented", lambda v: v == 0,
               dict(type=float)),
    refused(("--cpu-offload-params",), "offloading weights to host memory is not implemented", _LIST),
    only(("--offload-group-size",), "offloading weights to host memory is not implemented", 0, kwargs=_INT),
    noop(("--offload-num-in-group",), "used with --offload-group-size only (refused)", _INT),
    noop(("--offload-prefetch-step",), "used with --offload-group-size only (refused)", _INT),
    refused(("--offload-params",), "offloading weights to host memory is not implemented", _LIST),

    # MultiModalConfig
    off(("--enable-mm-embeds",), "image embeddings as inputs are not implemented"),
    noop(("--mm-processor-cache-gb",), "Kestrel keeps no cache of processed multimodal inputs of this kind",
         _FLOAT),
    noop(("--mm-processor-cache-type",), "Kestrel keeps no cache of processed multimodal inputs of this kind"),
    noop(("--mm-shm-cache-max-object-size-mb",), "Kestrel keeps no cache of processed multimodal inputs of this "
         "kind", _INT),
    off(("--mm-encoder-only",), "serving the vision encoder alone is not implemented"),
    only(("--mm-encoder-tp-mode",), "the vision encoder's weights are split like the model's (weights)",
         "weights"),
    refused(("--mm-encoder-attn-backend",), "the vision encoder's attention backend is chosen by Kestrel"),
    only(("--mm-encoder-attn-dtype",), "the vision encoder's attention runs in the model's dtype", "None"),
    refused(("--mm-encoder-fp8-scale-path",), "FP8 vision-encoder attention is not implemented"),
    refused(("--mm-encoder-fp8-scale-save-path",), "FP8 vision-encoder attention is not implemented"),
    noop(("--mm-encoder-fp8-scale-save-margin",), "FP8 vision-encoder attention is not used", _FLOAT),
    off(("--interleave-mm-strings",), "interleaved multimodal string prompts are not implemented"),
    noop(("--skip-mm-profiling",), "the KV cache is sized after a profile of text and image batches alike",
         _BOOL),
    refused(("--video-pruning-rate",), "only images are served, not video"),
    noop(("--mm-tensor-ipc",), "images reach the engine cores through Kestrel's own IPC"),
    only(("--mm-ipc-gpu-memory-gb",), "GPU memory for multimodal IPC is not implemented", 0.0, kwargs=_FLOAT),

    # LoRAConfig
    CompatFlag(("--lora-dtype",), "adapters run in the model's dtype (auto, or the dtype --dtype gives: "
               "bfloat16 by default on CUDA, float32 on the CPU)",
               fits=lambda value, args: value in ("auto", model_dtype(args))),
    off(("--enable-tower-connector-lora",), "LoRA on vision towers and connectors is not implemented"),
    noop(("--fully-sharded-loras",), "a performance option of vLLM's tensor-parallel LoRA; outputs are the "
         "same", _BOOL),
    refused(("--lora-target-modules",), "adapters apply to every module they hold weights for", _LIST),
    refused(("--default-mm-loras",), "per-modality default adapters are not implemented"),
    noop(("--specialize-active-lora",), "a CUDA-graph option of vLLM's LoRA kernels", _BOOL),
    off(("--enable-mixed-moe-lora-format",), "LoRA on MoE experts is not implemented"),
    off(("--enable-moe-shared-loras",), "LoRA on MoE experts is not implemented"),

    # ObservabilityConfig
    noop(("--show-hidden-metrics-for-version",), "no metrics are hidden as deprecated"),
    refused(("--otlp-traces-endpoint",), "OpenTelemetry tracing is not implemented"),
    refused(("--collect-detailed-traces",), "OpenTelemetry tracing is not implemented", _LIST),
    off(("--kv-cache-metrics",), "KV-cache residency metrics are not implemented"),
    noop(("--kv-cache-metrics-sample",), "used with --kv-cache-metrics only (refused)", _FLOAT),
    off(("--cudagraph-metrics",), "CUDA-graph metrics are not implemented"),
    off(("--enable-layerwise-nvtx-tracing",), "NVTX tracing is not implemented"),
    off(("--enable-mfu-metrics",), "model-FLOPs-utilisation metrics are not implemented"),
    off(("--enable-logging-iteration-details",), "per-step detail logs are not implemented"),
    noop(("--jit-monitor-mode",), "Kestrel compiles its Triton kernels before serving (--precompile)"),
    off(("--jit-monitor-verbose",), "JIT-compile monitoring is not implemented"),

    # SchedulerConfig
    refused(("--max-num-scheduled-tokens",), "a step's token budget is --max-num-batched-tokens"),
    only(("--max-num-partial-prefills",), "one prompt at a time is partly prefilled", 1, kwargs=_INT),
    only(("--max-long-partial-prefills",), "one prompt at a time is partly prefilled", 1, kwargs=_INT),
    only(("--long-prefill-token-threshold",), "long prompts are not scheduled apart", 0, kwargs=_INT),
    off(("--disable-chunked-mm-input",), "keeping image inputs in one prefill chunk is not a choice here"),
    refused(("--scheduler-cls",), "custom scheduler classes are not loaded"),
    CompatFlag(("--scheduler-reserve-full-isl",), "changing the admission rule is not implemented",
               lambda v: v, _BOOL),
    only(("--watermark",), "a KV-cache watermark for admissions is not implemented", 0.0, kwargs=_FLOAT),
    only(("--prefill-schedule-interval",), "new prompts are admitted at every step", 1, kwargs=_INT),
    off(("--disable-hybrid-kv-cache-manager",), "each kind of layer always keeps its own KV-cache group"),
    only(("--stream-interval",), "streams send every token as it comes", 1, kwargs=_INT),

    # CompilationConfig
    refused(("--max-cudagraph-capture-size",), "give the sizes to capture with --cuda-graph-sizes", _INT),

    # KernelConfig
    refused(("--ir-op-priority",), "kernels are chosen by --linear-backend / --moe-backend / --attention-backend"),
    noop(("--enable-flashinfer-autotune",), "FlashInfer is not used", _BOOL),
    off(("--enable-bf16x3-router-gemm",), "the BF16x3 router GEMM is not implemented"),

    # VllmConfig
    refused(("--diffusion-config", "-dc"), "diffusion language models are not implemented"),
    CompatFlag(("--kv-transfer-config",), "disaggregated prefill (KV transfer) is not implemented; for "
               "OffloadingConnector's host and file tiers use --kv-offloading-size and --kv-offloading-disk-path "
               "with --kv-offloading-disk-size", lambda v: False),
    refused(("--kv-events-config",), "KV-cache event publishing is not implemented"),
    refused(("--ec-transfer-config",), "encoder-cache transfer is not implemented"),
    CompatFlag(("--compilation-config", "-cc"), "no effect: Kestrel does not use torch.compile; CUDA graphs follow "
               "--enforce-eager and --cuda-graph-sizes"),
    CompatFlag(("--attention-config", "-ac"), "attention options are not implemented (see --attention-backend)",
               _json_equal({})),
    refused(("--reasoning-config",), "reasoning budgets are not implemented (see --reasoning-parser)"),
    CompatFlag(("--kernel-config",), "kernels are chosen by --linear-backend / --moe-backend / "
               "--attention-backend", _json_equal({})),
    CompatFlag(("--additional-config",), "platform-specific options are not implemented", _json_equal({})),
    CompatFlag(("--structured-outputs-config",), "structured outputs use xgrammar (backend auto or xgrammar)",
               lambda v: _backend_of(v) in ("auto", "xgrammar")),
    CompatFlag(("--profiler-config",), "the profiler is not implemented", _json_equal({})),
    noop(("--optimization-level",), "Kestrel does not use torch.compile; CUDA graphs follow --enforce-eager and "
         "--cuda-graph-sizes"),
    only(("--performance-mode",), "one scheduling mode is implemented (balanced)", "balanced"),
    refused(("--weight-transfer-config",), "weight transfer for RL training is not implemented"),
)


# vLLM 0.26's shorthands for keys of --speculative-config: flag -> (key, argparse type)
SPEC_SHORTHANDS = {"--spec-method": ("method", str), "--spec-model": ("model", str),
                   "--spec-tokens": ("num_speculative_tokens", int)}


def _shorthand_dest(flag: str) -> str:
    return "vllm_" + flag.lstrip("-").replace("-", "_")


def _language_model_only(args: argparse.Namespace) -> None:
    """--language-model-only: vLLM's spelling of --limit-mm-per-prompt 0 (the vision tower is still loaded here)."""
    if getattr(args, "vllm_language_model_only", None) and hasattr(args, "limit_mm_per_prompt"):
        args.limit_mm_per_prompt = 0


def fold_shorthands(args: argparse.Namespace) -> list[str]:
    """--spec-method/--spec-model/--spec-tokens into --speculative-config, as vLLM 0.26: a key given both ways is
    refused. Returns the shorthands given. (--language-model-only too: --limit-mm-per-prompt 0.)"""
    _language_model_only(args)
    used = []
    for flag, (key, _type) in SPEC_SHORTHANDS.items():
        value = getattr(args, _shorthand_dest(flag), None)
        if value is None or not hasattr(args, "speculative_config"):
            continue
        spec = dict(args.speculative_config or {})
        if key in spec:
            raise ConfigError(f"{flag} and --speculative-config's {key!r} are both given: give one")
        spec[key] = value
        args.speculative_config = spec
        used.append(flag)
    return used


def add_compat_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("vLLM compatibility (flags of `vllm serve` that change nothing here or are "
                                      "refused with a reason)")
    for flag in COMPAT_FLAGS:
        kw = dict(flag.kwargs) if "action" in flag.kwargs else {
            "type": str, "metavar": flag.names[0].lstrip("-").upper().replace("-", "_"), **flag.kwargs}
        help_text = flag.why if flag.why.startswith("no effect") else f"refused unless it changes nothing: {flag.why}"
        group.add_argument(*flag.names, dest=flag.dest, default=None, help=help_text, **kw)
    group.add_argument("--language-model-only", dest="vllm_language_model_only", default=None,
                       action=argparse.BooleanOptionalAction, help="images are refused, as --limit-mm-per-prompt 0 "
                       "(the vision tower is still loaded)")
    for flag, (key, type_) in SPEC_SHORTHANDS.items():
        group.add_argument(flag, dest=_shorthand_dest(flag), type=type_, default=None,
                           help=f"--speculative-config's {key!r}, as vLLM's shorthand")


def check_compat_args(args: argparse.Namespace) -> None:
    """ConfigError naming the first vLLM flag given with a value Kestrel cannot honour."""
    for flag in COMPAT_FLAGS:
        value = getattr(args, flag.dest, None)
        if value is not None and not (flag.fits(value, args) if flag.fits else flag.accepts(value)):
            name = flag.names[0] if value is not False else "--no-" + flag.names[0][2:]
            shown = "" if isinstance(value, bool) else f" {value}"
            raise ConfigError(f"{name}{shown}: {flag.why}")
