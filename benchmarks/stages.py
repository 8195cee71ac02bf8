"""The GPU stages `python -m benchmarks.suite` runs: one entry a stage (name, area, one help line, its commands),
each command with its timeout, the GPUs it needs and what of its output is printed.

A command's words may hold placeholders the suite fills in when it runs: {py} (this Python), {out} (results),
{run} (a fresh scratch folder for this call), {llava} (the LLaVA-NeXT-7B-shaped model folder, kept across calls),
{vsite} (vLLM's LLaVA site, staged by `vsite`), {qwenvl} (the Qwen2.5-VL-7B folder), {base} (the A/B stage's previous tree), {left} (seconds left of
the call's budget), {url} and {port} (a command's server), {pythonpath} (the children's PYTHONPATH)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

Show = Callable[[list[str]], list[str]]


def tail(n: int, drop: str | None = None) -> Show:
    """The last n lines, without those matching `drop`."""
    return lambda lines: [s for s in lines if not (drop and re.search(drop, s))][-n:]


def head(n: int) -> Show:
    return lambda lines: lines[:n]


def grep(pattern: str) -> Show:
    """Only the lines matching `pattern`."""
    return lambda lines: [s for s in lines if re.search(pattern, s)]


def quiet(lines: list[str]) -> list[str]:
    return []


def slowest_imports(n: int) -> Show:
    """`python -X importtime` output: the n imports with the largest cumulative time, slowest last."""
    def show(lines):
        rows = [s for s in lines if s.startswith("import time:") and s.split("|")[1].strip().isdigit()]
        return sorted(rows, key=lambda s: int(s.split("|")[1]))[-n:]
    return show


@dataclass(frozen=True)
class Server:
    """A server a command talks to: started before it (on a free {port}), ready when {url}/health answers,
    stopped after it. Its output goes to $OUT/<log>."""
    argv: tuple[str, ...]
    log: str
    ready_timeout: int
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Cmd:
    argv: tuple[str, ...]
    timeout: int  # seconds; the suite caps it by what is left of the call's budget
    show: Show = tail(12)
    log: str | None = None  # the whole output is also written to $OUT/<log>
    env: dict[str, str] = field(default_factory=dict)
    gpus: int = 1  # skipped, with a line saying so, on a machine with fewer
    title: str | None = None  # printed as `--- title` before it runs
    server: Server | None = None


@dataclass(frozen=True)
class Stage:
    name: str
    area: str
    help: str
    cmds: tuple[Cmd, ...]
    env: dict[str, str] = field(default_factory=dict)

    @property
    def gpus(self) -> int:
        """The GPUs the whole stage needs."""
        return max(c.gpus for c in self.cmds)

    @property
    def min_gpus(self) -> int:
        """The fewest GPUs on which some of it runs (its commands needing more are skipped one by one)."""
        return min(c.gpus for c in self.cmds)

    @property
    def timeout(self) -> int:
        """The most the stage can take: its commands' timeouts and its servers' start-up waits."""
        return sum(c.timeout + (c.server.ready_timeout if c.server else 0) for c in self.cmds)


def bench(module: str, *args: str, timeout: int, **kw) -> Cmd:
    return Cmd(("{py}", "-m", f"benchmarks.{module}", *args), timeout, **kw)


def pytest(*args: str, timeout: int, **kw) -> Cmd:
    return Cmd(("{py}", "-m", "pytest", "-q", "-p", "no:cacheprovider", *args), timeout, **kw)


NO_WARNINGS = "Warning"
VSITE = {"PYTHONPATH": "{vsite}:{pythonpath}"}  # vLLM's LLaVA path needs transformers 5.5.3 ahead of the image's
NCCL = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}  # multicast off
V2 = ("--max-model-len", "4096")  # DeepSeek-V2-Lite runs, as vLLM's peer runs
# The wheels travel installed with --no-compile: a first process would compile ~1,000 modules (3.3 s of a cold
# start-up in 2026-12-02's profile) that a user's pip install compiles at install time.
BYTECODE = Cmd(("{py}", "-c", "import compileall, os; [compileall.compile_dir(p, quiet=1, workers=0) "
                "for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]"), 120, show=quiet)
MOE_CONFIGS = Cmd(("cp", "kestrel/kernels/configs/fused_moe.json", "{out}/fused_moe.json"), 10, show=quiet)

# shared by the stages that are another stage plus more
TP_TESTS = pytest("-rs", "tests/gpu/test_gpu_tensor_parallel.py", timeout=300, show=tail(40))
MLA_DECODE = bench("mla_decode", timeout=200, log="mla_decode.txt", show=tail(14))
MLA_SWEEP16 = bench("mla_decode", "--sweep", timeout=400, log="mla_tune16.txt", show=tail(60))
WRITE_LLAVA = bench("mm_serve", "--write-model", "{llava}", timeout=120, show=quiet)  # for the GPU runs after it
VLLM_LLAVA = Server(("{py}", "-m", "vllm.entrypoints.openai.api_server", "--model", "{llava}", "--load-format",
                     "dummy", "--max-model-len", "4096", "--host", "127.0.0.1", "--port", "{port}"),
                    log="vllm_mm.log", ready_timeout=400, env=VSITE)
MM_VLLM = bench("mm_serve", "--url", "{url}", "--num-requests", "128", timeout=300, title="vLLM 0.26",
                server=VLLM_LLAVA)
MM_KESTREL = bench("mm_serve", "--model-dir", "{llava}", "--server-log", "{out}/kestrel_mm.log", timeout=300,
                   title="kestrel")

# the same image chats on a Qwen2.5-VL-7B shape (native resolution, M-RoPE; issue 52)
WRITE_QWENVL = bench("mm_serve", "--arch", "qwen2_5_vl", "--write-model", "{qwenvl}", timeout=120, show=quiet)
VLLM_QWENVL = Server(("{py}", "-m", "vllm.entrypoints.openai.api_server", "--model", "{qwenvl}", "--load-format",
                      "dummy", "--max-model-len", "4096", "--host", "127.0.0.1", "--port", "{port}"),
                     log="vllm_qwenvl.log", ready_timeout=400, env=VSITE)
MM_VLLM_QWENVL = bench("mm_serve", "--url", "{url}", "--num-requests", "128", timeout=300, title="vLLM 0.26",
                       server=VLLM_QWENVL)
MM_KESTREL_QWENVL = bench("mm_serve", "--arch", "qwen2_5_vl", "--model-dir", "{qwenvl}", "--server-log",
                          "{out}/kestrel_qwenvl.log", timeout=300, title="kestrel")


def profile_cmd(name: str, *args: str, lines: int, timeout: int) -> Cmd:
    return bench("profile_step", *args, timeout=timeout, log=f"{name}.txt", show=head(lines))


def tp_pair(shape: str, tp: int, tput_s: int, lat_s: int, *extra: str, gpus: int = 0) -> tuple[Cmd, Cmd]:
    """throughput + latency of `shape` at tensor parallel size tp, each needing max(tp, gpus) GPUs."""
    gpus = max(tp, gpus)
    name = {"llama-8b": "8b", "llama-70b": "70b"}[shape]
    common = ("--shape", shape, "--tensor-parallel-size", str(tp), *extra)
    return (bench("throughput", *common, "--hf-requests", "0", "--json", f"{{out}}/tput{name}_tp{tp}.json",
                  timeout=tput_s, log=f"tput{name}_tp{tp}.log", show=tail(26, NO_WARNINGS), gpus=gpus,
                  title=f"{shape} TP {tp}"),
            bench("latency", *common, "--hf-output-len", "0", "--json", f"{{out}}/lat{name}_tp{tp}.json",
                  timeout=lat_s, log=f"lat{name}_tp{tp}.log", show=tail(5), gpus=gpus))


def mm_kestrel_workers(n: int) -> Cmd:
    return bench("mm_serve", "--model-dir", "{llava}", "--server-log", f"{{out}}/kestrel_mm_p{n}.log",
                 "--num-requests", "128", "--server-args",
                 f"--load-format dummy --max-model-len 4096 --image-render-processes {n}",
                 timeout=200, show=tail(10), title=f"--image-render-processes {n}")


AREAS = {
    "core": "dense engine (Qwen3-0.6B, Llama-3.1-8B shapes): tests, throughput, latency, start-up, profiles",
    "kernels": "kernels alone: attention, batch-1 linear layers, FP8",
    "moe": "mixture of experts (issue 13): Qwen3-30B-A3B and DeepSeek-V2-Lite's MoE",
    "mla": "multi-head latent attention (issue 14): DeepSeek-V2-Lite",
    "lora": "multi-LoRA (issue 16)",
    "images": "images (issue 15): LLaVA-NeXT-7B shape, side by side with vLLM 0.26 (run vsite first)",
    "structured": "structured outputs (issue 18)",
    "parallel": "tensor and data parallelism (issues 19, 20); multi-GPU stages need 2, 4 or 8 GPUs",
    "wave": "sparse MLA (issue 34), Kimi Linear (30), speculative decoding (31), the 12,800-sequence flood (33)",
}

STAGES = (
    # core
    Stage("tests", "core", "GPU tests + the GEMV/skinny-GEMM kernels on CUDA, stop at the first failure",
          (pytest("-x", "tests/gpu", "tests/kernels/test_gemv_interp.py", "tests/kernels/test_skinny_gemm_interp.py",
                  timeout=240, show=tail(25)),)),
    Stage("gputests", "core", "the whole GPU suite (tests/gpu + every CUDA kernel test), 6 xdist workers, a summary",
          (bench("gpu_tests", "--workers", "6", "--budget", "{left}", "--log", "{out}/gputests.log", timeout=580,
                 show=tail(60)),)),
    Stage("attnt", "core", "attention tests on the GPU (qk-norm and gpu-marked)",
          (pytest("-x", "tests/attention", "-k", "qk_norm or gpu", timeout=300, show=tail(8)),)),
    Stage("engine", "core", "tests/gpu/test_gpu_engine.py",
          (pytest("tests/gpu/test_gpu_engine.py", timeout=300, show=tail(6)),)),
    Stage("tput", "core", "qwen3-0.6b throughput, transformers on 64 of the requests beside it",
          (bench("throughput", "--shape", "qwen3-0.6b", "--hf-requests", "64", "--json", "{out}/tput.json",
                 timeout=300, show=tail(25, NO_WARNINGS)),)),
    Stage("tput0", "core", "qwen3-0.6b throughput, Kestrel alone",
          (bench("throughput", "--shape", "qwen3-0.6b", "--hf-requests", "0", "--json", "{out}/tput.json",
                 timeout=200),)),
    Stage("tput0nopdl", "core", "tput0 with programmatic dependent launch off",
          (bench("throughput", "--no-pdl", "--shape", "qwen3-0.6b", "--hf-requests", "0", "--json",
                 "{out}/tput_nopdl.json", timeout=200, show=grep("(?i)kestrel|start")),)),
    Stage("tputsweep", "core", "tput, then throughput vs concurrency 1..256",
          (bench("throughput", "--shape", "qwen3-0.6b", "--hf-requests", "64", "--sweep", "--json", "{out}/tput.json",
                 timeout=330, show=tail(32, NO_WARNINGS)),)),
    Stage("sweep", "core", "tput0, then throughput vs concurrency 1..256",
          (bench("throughput", "--shape", "qwen3-0.6b", "--hf-requests", "0", "--sweep", "--json", "{out}/sweep.json",
                 timeout=200, show=tail(25)),)),
    Stage("lat", "core", "qwen3-0.6b batch-1 latency (TTFT, ms/token), transformers beside it",
          (bench("latency", "--shape", "qwen3-0.6b", "--json", "{out}/lat.json", timeout=150),)),
    Stage("latnopdl", "core", "lat with programmatic dependent launch off, Kestrel alone",
          (bench("latency", "--no-pdl", "--shape", "qwen3-0.6b", "--hf-output-len", "0", "--json",
                 "{out}/lat_nopdl.json", timeout=150, show=grep("kestrel")),)),
    Stage("lat8b", "core", "llama-8b batch-1 latency, transformers on 32 tokens beside it",
          (bench("latency", "--shape", "llama-8b", "--hf-output-len", "32", "--json", "{out}/lat8b.json",
                 timeout=200),)),
    Stage("servesbs", "core", "online serving, kestrel serve then vllm serve (llama-8b): saturation + 3 request rates",
          (bench("serve_side_by_side", "--out", "{out}/serve", timeout=590, show=tail(40),
                 log="serve_side_by_side.log"),)),
    Stage("tput8b", "core", "llama-8b throughput, Kestrel alone",
          (bench("throughput", "--shape", "llama-8b", "--hf-requests", "0", "--json", "{out}/tput8b.json",
                 timeout=300, show=tail(20)),)),
    Stage("awq8b", "core", "llama-8b AWQ (4-bit, group 128) on the Triton W4A16 GEMM: throughput, batch 1 (54)",
          (bench("throughput", "--shape", "llama-8b-awq", "--hf-requests", "0", "--json", "{out}/tput_awq8b.json",
                 timeout=300, show=tail(20)),
           bench("latency", "--shape", "llama-8b-awq", "--hf-output-len", "0", "--json", "{out}/lat_awq8b.json",
                 timeout=200),)),
    Stage("ab", "core", "regression A/B of throughput + latency (qwen3-0.6b, deepseek-v2-lite): --base vs this tree",
          (bench("ab", "--base", "{base}", "--budget", "{left}", "--json", "{out}/ab.json", timeout=580,
                 show=tail(40)),)),
    Stage("cpuab", "core", "host ms per decode step A/B (stub model, batch 256): --base vs this tree, 5 rounds",
          (bench("ab", "--base", "{base}", "--scripts", "new", "--benches", "cpu_overhead", "--shapes", "qwen3-0.6b",
                 "--repeat", "5", "--budget", "{left}", "--json", "{out}/cpuab.json", timeout=300, show=tail(12)),)),
    Stage("multiturn", "core", "qwen3-0.6b multi-turn chat, 64 x 5 turns, 4-8k context: host KV tier vs none (53)",
          (bench("multiturn", "--json", "{out}/multiturn.json", timeout=330, show=tail(14)),)),
    Stage("kvcopy", "core", "the host KV tier's block copies alone: Triton row copy vs per-run memcpy, both ways (53)",
          (bench("kv_copy", "--json", "{out}/kv_copy.json", timeout=120, show=tail(16)),)),
    Stage("kvsweep", "core", "the host KV tier's row copy kernel: words a program x warps, both ways (tuning, 53)",
          (bench("kv_copy", "--sweep", "--json", "{out}/kv_sweep.json", timeout=200, show=tail(70)),)),
    Stage("trace", "core", "where a qwen3-0.6b throughput run's time goes, per step (GPU and host)",
          (bench("step_trace", "--shape", "qwen3-0.6b", "--json", "{out}/trace.json", timeout=200, show=tail(14)),)),
    Stage("tracelat", "core", "the same for a batch-1 latency run",
          (bench("step_trace", "--shape", "qwen3-0.6b", "--latency", "--json", "{out}/trace_lat.json", timeout=150,
                 show=tail(8)),)),
    Stage("startup", "core", "qwen3-0.6b start-up twice: with an empty Triton cache, then with it filled",
          (BYTECODE, *(bench("startup", "--shape", "qwen3-0.6b", timeout=100, log=f"startup{i}.log",
                             show=grep("Pre-compiled|^start-up"), env={"TRITON_CACHE_DIR": "{run}/triton-cold"})
                       for i in (1, 2)))),
    Stage("startprof", "core", "start-up with an empty Triton cache under cProfile",
          (bench("startup", "--cprofile", timeout=100, log="startprof.txt", show=grep("start-up|Pre-compiled"),
                 env={"TRITON_CACHE_DIR": "{run}/triton-cold-prof"}),)),
    Stage("imports", "core", "the slowest imports of the engine's entry points (python -X importtime)",
          (Cmd(("{py}", "-X", "importtime", "-c", "from benchmarks.common import write_shape; "
                "from kestrel.loader import load_hf_config; import kestrel.entrypoints; "
                "load_hf_config(write_shape('qwen3-0.6b'))"), 60, show=slowest_imports(4), log="importtime.txt",
               gpus=0),)),
    Stage("profile", "core", "torch.profiler over qwen3-0.6b decode steps at 256 rows",
          (profile_cmd("profile", timeout=150, lines=3),)),
    Stage("profile1", "core", "the same at batch 1, greedy",
          (profile_cmd("profile1", "--batch", "1", "--greedy", timeout=150, lines=3),)),
    Stage("profile8b", "core", "the same on llama-8b at batch 1",
          (profile_cmd("profile8b", "--batch", "1", "--greedy", "--shape", "llama-8b", timeout=200, lines=3),)),
    # kernels
    Stage("b1k", "kernels", "batch-1 kernels alone: attention decode, GEMV, fused norms (CUDA-graph timed)",
          (bench("batch1_kernels", timeout=200, log="batch1_kernels.txt", show=tail(40, "^config failed")),)),
    Stage("attn", "kernels", "the Triton attention kernels against the reference, quick sections",
          (bench("gpu_attention_check", "--quick", timeout=200, show=tail(30)),)),
    Stage("fp8", "kernels", "FP8 linear kernels: correctness, GEMM and layer timings",
          (bench("gpu_fp8", timeout=200, show=tail(40)),)),
    Stage("tputfp8", "kernels", "qwen3-0.6b throughput with --quantization fp8",
          (bench("throughput", "--shape", "qwen3-0.6b", "--hf-requests", "0", "--quantization", "fp8", "--json",
                 "{out}/tputfp8.json", timeout=200),)),
    Stage("tputkv8", "kernels", "FP8 KV cache: GPU tests, then qwen3-0.6b + llama-8b throughput, fp8 vs bf16 KV",
          (pytest("tests/gpu/test_gpu_fp8_kv.py", "tests/attention/test_triton_fp8_kv.py", timeout=300,
                  show=tail(8)),)
          + tuple(bench("throughput", "--shape", shape, "--hf-requests", "0", "--kv-cache-dtype", kv, "--json",
                        f"{{out}}/tput_kv_{kv}_{shape}.json", timeout=300, log=f"tput_kv_{kv}_{shape}.log",
                        show=grep("^kestrel|KV blocks"), title=f"{shape}, KV cache {kv}")
                  for shape in ("qwen3-0.6b", "llama-8b") for kv in ("auto", "fp8"))),
    Stage("kern", "kernels", "the Triton MoE and MLA kernel tests on CUDA",
          (pytest("tests/kernels/test_moe_triton_interp.py", "tests/attention/test_triton_mla.py",
                  "tests/gpu/test_gpu_mla.py", "tests/gpu/test_gpu_moe.py", timeout=300, show=tail(8)),)),
    # moe
    Stage("moe", "moe", "MoE GPU tests, then the fused-MoE kernel table",
          (pytest("-x", "tests/gpu/test_gpu_moe.py", "tests/gpu/test_gpu_moe_models.py", timeout=330, show=tail(6)),
           bench("moe_kernel", "--json", "{out}/moe_kernel.json", timeout=230, show=tail(20)))),
    Stage("moemodels", "moe", "tests/gpu/test_gpu_moe_models.py (bf16 MoE families vs float32 transformers)",
          (pytest("tests/gpu/test_gpu_moe_models.py", timeout=300, log="moemodels.txt", show=tail(3)),)),
    Stage("moealign", "moe", "routing-layout tests, then the layout alone by slot count (both MoE shapes)",
          (pytest("tests/kernels/test_moe_triton_interp.py", "tests/gpu/test_gpu_moe.py", "-k",
                  "layout or graph or warm_up or grid", timeout=200, show=tail(4)),
           *(bench("moe_kernel", "--align", "--shape", shape, "--json", f"{{out}}/moe_align_{shape}.json",
                   timeout=120, show=tail(14)) for shape in ("qwen3-30b-a3b", "deepseek-v2-lite")))),
    Stage("moetune", "moe", "fused-MoE tile search for qwen3-30b-a3b; writes fused_moe.json (copied to $OUT)",
          (bench("moe_kernel", "--tune", "--write", "--json", "{out}/moe_tuned.json", timeout=300, show=tail(20)),
           MOE_CONFIGS)),
    Stage("moetunemla", "moe", "the same for deepseek-v2-lite's experts",
          (bench("moe_kernel", "--shape", "deepseek-v2-lite", "--tune", "--write", "--json",
                 "{out}/moe_tuned_mla.json", timeout=300, show=tail(20)), MOE_CONFIGS)),
    Stage("tputmoe", "moe", "qwen3-30b-a3b throughput",
          (bench("throughput", "--shape", "qwen3-30b-a3b", "--hf-requests", "0", "--json", "{out}/tput_moe.json",
                 timeout=480, show=tail(12, NO_WARNINGS)),)),
    Stage("latmoe", "moe", "qwen3-30b-a3b batch-1 latency",
          (bench("latency", "--shape", "qwen3-30b-a3b", "--hf-output-len", "0", "--json", "{out}/lat_moe.json",
                 timeout=300, show=tail(8)),)),
    Stage("vllmawq", "moe", "vLLM 0.26 on llama-8b-awq (its AWQ Marlin path; the peer of awq8b; vLLM staged)",
          (bench("vllm_peer", "--shape", "llama-8b-awq", "--json", "{out}/vllm_awq8b.json", timeout=560,
                 show=tail(8, NO_WARNINGS), env=VSITE),)),
    Stage("vllmmoe", "moe", "vLLM 0.26 on qwen3-30b-a3b (the peer of tputmoe/latmoe; vLLM staged in the site)",
          (bench("vllm_peer", "--shape", "qwen3-30b-a3b", "--json", "{out}/vllm_moe.json", timeout=560,
                 show=tail(8, NO_WARNINGS), env=VSITE),)),
    Stage("prof1moe", "moe", "profile of qwen3-30b-a3b decode steps at batch 1",
          (profile_cmd("profile1_moe", "--batch", "1", "--greedy", "--shape", "qwen3-30b-a3b", timeout=300,
                       lines=45),)),
    # mla
    Stage("mla", "mla", "MLA GPU tests, then mlak",
          (pytest("-x", "tests/gpu/test_gpu_mla.py", "tests/attention/test_triton_mla.py",
                  "tests/attention/test_mla.py", timeout=300, show=tail(6)), MLA_DECODE)),
    Stage("mlak", "mla", "the MLA decode kernel alone: time and bandwidth by batch x context",
          (MLA_DECODE,)),
    Stage("mlapre", "mla", "the dense MLA prefill of one layer, 16k tokens, old glue vs expand_kv",
          (bench("mla_prefill", timeout=300, log="mla_prefill.txt", show=tail(6)),)),
    Stage("mlatune16", "mla", "MLA decode tile sweep, 16 heads (V2-Lite)", (MLA_SWEEP16,)),
    Stage("mlatune", "mla", "mlatune16, then the same sweep at 128 heads (V3)",
          (MLA_SWEEP16, bench("mla_decode", "--sweep", "--heads", "128", timeout=400, log="mla_tune128.txt",
                              show=tail(60)))),
    Stage("mlasplit", "mla", "MLA decode at batch >= 64 with forced split counts",
          (bench("mla_decode", "--splits", timeout=300, log="mla_splits.txt", show=tail(90)),)),
    Stage("tputmla", "mla", "deepseek-v2-lite throughput (MLA + MoE)",
          (bench("throughput", "--shape", "deepseek-v2-lite", "--hf-requests", "0", *V2, "--json",
                 "{out}/tput_mla.json", timeout=480, show=tail(16, NO_WARNINGS)),)),
    Stage("latmla", "mla", "deepseek-v2-lite batch-1 latency",
          (bench("latency", "--shape", "deepseek-v2-lite", "--hf-output-len", "0", *V2, "--json", "{out}/lat_mla.json",
                 timeout=300, show=tail(8)),)),
    Stage("tputmlad", "mla", "throughput of deepseek-v2-lite with every layer dense (MLA without the MoE)",
          (bench("throughput", "--shape", "deepseek-v2-lite-dense", "--hf-requests", "0", *V2, "--json",
                 "{out}/tput_mla_dense.json", timeout=480, show=tail(16, NO_WARNINGS)),)),
    Stage("latmlad", "mla", "its batch-1 latency",
          (bench("latency", "--shape", "deepseek-v2-lite-dense", "--hf-output-len", "0", *V2, "--json",
                 "{out}/lat_mla_dense.json", timeout=300, show=tail(8)),)),
    Stage("vllmmla", "mla", "vLLM 0.26 on deepseek-v2-lite (the peer of tputmla/latmla)",
          (bench("vllm_peer", "--shape", "deepseek-v2-lite", "--json", "{out}/vllm_mla.json", timeout=560,
                 show=tail(8, NO_WARNINGS), env=VSITE),)),
    Stage("vllmmlad", "mla", "vLLM 0.26 on the all-dense variant",
          (bench("vllm_peer", "--shape", "deepseek-v2-lite-dense", "--json", "{out}/vllm_mla_dense.json",
                 timeout=560, show=tail(8, NO_WARNINGS), env=VSITE),)),
    Stage("profmla", "mla", "profile of deepseek-v2-lite decode steps at 256 rows",
          (profile_cmd("profile_mla", "--shape", "deepseek-v2-lite", timeout=300, lines=45),)),
    Stage("prof1mla", "mla", "the same at batch 1",
          (profile_cmd("profile1_mla", "--batch", "1", "--greedy", "--shape", "deepseek-v2-lite", timeout=300,
                   lines=45),)),
    # lora
    Stage("lora", "lora", "LoRA GPU tests and the LoRA kernel tests on CUDA",
          (pytest("-x", "tests/gpu/test_gpu_lora.py", "tests/kernels/test_lora_kernels_interp.py", timeout=300,
                  show=tail(8)),)),
    Stage("tputlora", "lora", "qwen3-0.6b throughput, 256 requests over 4 rank-16 adapters vs none",
          (bench("lora_throughput", "--shape", "qwen3-0.6b", "--json", "{out}/tput_lora.json", timeout=400,
                 show=tail(10, NO_WARNINGS)),)),
    # images
    Stage("vsite", "images", "stage vLLM's LLaVA path: .whl2's transformers 5.5.3 + 2 wheels into the vsite",
          (bench("vllm_site", "--wheels", ".whl2", "--target", "{vsite}", timeout=300, show=tail(3), gpus=0),)),
    Stage("mmv", "images", "vLLM 0.26 serving 128 image chats (one image each, concurrency 32)",
          (WRITE_LLAVA, MM_VLLM)),
    Stage("mmk", "images", "Kestrel serving the same workload", (WRITE_LLAVA, MM_KESTREL)),
    Stage("mmqvl", "images", "Qwen2.5-VL-7B shape, 128 image chats: vLLM 0.26 (vsite staged), then Kestrel (52)",
          (WRITE_QWENVL, MM_VLLM_QWENVL, MM_KESTREL_QWENVL)),
    Stage("mmvllm", "images", "mmv, then mmk", (WRITE_LLAVA, MM_VLLM, MM_KESTREL)),
    Stage("mmkw", "images", "mmk with images on the server's render threads, then on 8 render processes",
          (WRITE_LLAVA, mm_kestrel_workers(0), mm_kestrel_workers(8))),
    Stage("mmrender", "images", "the frontend alone: render threads x torch threads, cold and warm",
          (WRITE_LLAVA, bench("mm_render", "--model-dir", "{llava}", "--threads", "1,4,8", "--json",
                              "{out}/mm_render.json", timeout=300, show=tail(16)))),
    Stage("mmprof", "images", "the engine alone, offline: encoder time, prefill rates, a closed loop",
          (WRITE_LLAVA, bench("mm_profile", "--model-dir", "{llava}", timeout=300, log="mm_profile.txt",
                              show=tail(12, NO_WARNINGS)))),
    Stage("mmspy", "images", "py-spy of the frontend, engine core and client under load (benchmarks/mm_spy.sh)",
          (Cmd(("bash", "benchmarks/mm_spy.sh"), 300, show=tail(16), env={"MODEL_DIR": "{llava}", "OUT": "{out}"}),)),
    # structured
    Stage("structured", "structured", "qwen3-0.6b, 256 requests with a JSON schema each vs none",
          (bench("structured", "--shape", "qwen3-0.6b", "--json", "{out}/structured.json", timeout=400,
                 show=tail(13, NO_WARNINGS)),)),
    Stage("structthreads", "structured", "structured by fill-thread count 14, 10, 6",
          (bench("structured", "--shape", "qwen3-0.6b", "--fill-threads", "14,10,6", "--json",
                 "{out}/structured_threads.json", timeout=400, show=tail(14, NO_WARNINGS)),)),
    Stage("structfill", "structured", "the host's accept + bitmask fill per step, by fill-thread count",
          (bench("structured_fill", "--threads", "1,4,8,14", "--json", "{out}/structured_fill.json", timeout=300,
                 show=tail(10), gpus=0),)),
    Stage("structgpu", "structured", "structured-output GPU, bitmask kernel and engine tests",
          (pytest("tests/gpu/test_gpu_structured.py", "tests/structured_output/test_bitmask_triton.py",
                  "tests/structured_output/test_engine.py", timeout=300, show=tail(8)),)),
    # parallel
    Stage("tp", "parallel", "tensor-parallel tests: mp executor + NCCL at TP 1 == in-process; TP 2 == TP 1 on 2 GPUs",
          (TP_TESTS,)),
    Stage("tp1", "parallel", "the same as tp (an older name)", (TP_TESTS,)),
    Stage("multigpu1", "parallel", "TP tests, llama-8b throughput + latency at TP 1 and 2, qwen3-30b-a3b at TP 2",
          (pytest("-rs", "tests/gpu/test_gpu_tensor_parallel.py", timeout=240, log="tp_tests.log", show=tail(8),
                  gpus=2),
           *(cmd for tp in (1, 2) for cmd in tp_pair("llama-8b", tp, 150, 120, gpus=2)),
           bench("throughput", "--shape", "qwen3-30b-a3b", "--hf-requests", "0", "--tensor-parallel-size", "2", *V2,
                 "--json", "{out}/tput_moe_tp2.json", timeout=200, log="tput_moe_tp2.log",
                 show=tail(26, NO_WARNINGS), gpus=2, title="qwen3-30b-a3b TP 2")),
          env=NCCL),
    Stage("multigpu2", "parallel", "data parallel 2 vs one engine core (llama-8b), then llama-70b at TP 4",
          (bench("dp_throughput", "--shape", "llama-8b", "--data-parallel-size", "2", "--json", "{out}/dp2_8b.json",
                 timeout=200, log="dp2_8b.log", show=tail(9, "INFO|Warning"), gpus=2),
           *tp_pair("llama-70b", 4, 240, 150, *V2)),
          env=NCCL),
    Stage("multigpu3", "parallel", "llama-70b throughput + latency at TP 8",
          tp_pair("llama-70b", 8, 240, 150, *V2), env=NCCL),
    Stage("vllmtp", "parallel", "vLLM 0.26 at TP 2 on llama-8b",
          (bench("vllm_peer", "--shape", "llama-8b", "--tensor-parallel-size", "2", "--json",
                 "{out}/vllm_8b_tp2.json", timeout=560, log="vllm_8b_tp2.log", show=tail(8, NO_WARNINGS), gpus=2,
                 env=VSITE),),
          env={**NCCL, "VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}),
)
KIMI = ("--shape", "kimi-linear-48b", "--max-model-len", "4096")
QWEN36 = ("--shape", "qwen3.6-35b-a3b", "--max-model-len", "4096")


def shape_pair(tag: str, shape_args: tuple[str, ...], what: str) -> tuple[Stage, Stage]:
    """tput<tag> and lat<tag>: a random-weight shape's throughput and batch-1 latency."""
    shape = shape_args[1]
    return (Stage(f"tput{tag}", "wave", f"{shape} throughput ({what})",
                  (bench("throughput", *shape_args, "--hf-requests", "0", "--json", f"{{out}}/tput_{tag}.json",
                         timeout=560, log=f"tput_{tag}.log", show=tail(16, NO_WARNINGS)),)),
            Stage(f"lat{tag}", "wave", f"{shape} batch-1 latency",
                  (bench("latency", *shape_args, "--hf-output-len", "0", "--json", f"{{out}}/lat_{tag}.json",
                         timeout=400, show=tail(8)),)))
# issue 31's figures, both in one call (600 s): the n-gram side by side first (vLLM's half is stopped after
# --vllm-timeout, keeping the engines it finished, so kestrel's half always runs), then the replay and EAGLE-3 rows
SPEC_PEER = bench("spec_decode", "--ngram-peer", "--vllm-pythonpath", "{vsite}", "--vllm-timeout", "220",
                  "--batches", "1,8", "--ks", "5", "--json", "{out}/spec_ngram_peer.json", timeout=330,
                  log="spec_ngram_peer.txt", show=tail(24, "Warning|^row "), title="n-gram, kestrel vs vLLM 0.26")
# 32 output tokens: on the H100 (270d97e) the replay targets of batches 8 and 64 left their own bf16 references
# after 34-100 tokens of 128 (`followed`), and every draft after that point is wrong whatever alpha is.
SPEC_EAGLE = bench("spec_decode", "--eagle3-cost", "--shape", "llama-8b", "--batches", "1,8,32,64", "--ks", "3,4",
                   "--output-len", "32",
                   "--alphas", "0.6,0.8,0.9", "--json", "{out}/spec_eagle3_8b.json", timeout=400,
                   log="spec_eagle3_8b.txt", show=tail(40, "Warning|^row "), title="replay + EAGLE-3 cost, llama-8b")
STAGES += (
    Stage("flood", "wave", "victims' p99 latency under a 12,800-sequence request, vs the idle server",
          (bench("flood", "--json", "{out}/flood.json", timeout=560, log="flood.txt", show=tail(24)),)),
    Stage("specd", "wave", "replay drafts at controlled acceptance: llama-8b ms/token by batch, alpha and k",
          (bench("spec_decode", "--shape", "llama-8b", "--json", "{out}/spec_8b.json", timeout=560,
                 log="spec_8b.txt", show=tail(40, NO_WARNINGS)),)),
    Stage("specng", "wave", "real n-gram drafts on copy-heavy prompts, the embedded SmolLM2",
          (bench("spec_decode", "--ngram-smollm2", "--json", "{out}/spec_ngram.json", timeout=300,
                 log="spec_ngram.txt", show=tail(20, NO_WARNINGS)),)),
    Stage("specpeer", "wave", "n-gram drafts, vLLM 0.26 then kestrel on the same SmolLM2 weights and copy-heavy prompts",
          (SPEC_PEER,)),
    Stage("speceagle", "wave", "llama-8b: replay drafts by batch/alpha/k and a random EAGLE-3 draft's cost per step",
          (SPEC_EAGLE,)),
    Stage("specall", "wave", "specpeer, then speceagle: every speculative-decoding figure of issue 31 in one call",
          (SPEC_PEER, SPEC_EAGLE)),
    Stage("dsak", "wave", "DSA decode attention vs dense MLA by kernel timing, batch 1/64, 8k/32k contexts",
          (bench("dsa_decode", timeout=300, log="dsa_decode.txt", show=tail(30)),)),
    Stage("dsae2e", "wave", "dsak, then the whole engine on the DSA shape and its dense twin at 32k contexts",
          (bench("dsa_decode", "--e2e", timeout=560, log="dsa_e2e.txt", show=tail(40)),)),
    Stage("profdsa", "wave", "torch.profiler, DSA (prefill top-k torch, radix) and dense twin, 8 x 32k (issue 47)",
          (bench("profile_dsa", "--shapes", "deepseek-v2-lite-dsa", timeout=200, log="profile_dsa.txt",
                 show=grep("#####|decode step")),
           bench("profile_dsa", "--shapes", "deepseek-v2-lite-dsa", "--eager-topk", "radix", timeout=200,
                 log="profile_dsa_radix.txt", show=grep("#####|decode step")),
           bench("profile_dsa", "--shapes", "deepseek-v2-lite-dsa-dense", timeout=200, log="profile_dsa_dense.txt",
                 show=grep("#####|decode step")))),
    Stage("dsaab", "wave", "DSA sparse prefill A/B: top-k torch/radix x scores rows a program, 2 x 32k (issue 47)",
          (bench("profile_dsa", "--prefill-ab", "torch/1,radix/1,torch/4,radix/2,radix/4", "--n", "2", timeout=300,
                 log="dsa_prefill_ab.txt", show=tail(8)),)),
    Stage("kdatests", "wave", "the KDA GPU tests: fla prefill vs the reference, tiny Kimi teacher-forced, gate",
          (pytest("-rs", "tests/gpu/test_gpu_kda_prefill.py", "tests/gpu/test_gpu_kimi_linear.py",
                  "tests/hw_platform/test_kda_gate.py", timeout=500, show=tail(30)),)),
    Stage("kdak", "wave", "the fused KDA decode vs the unfused chain: per layer, then the 48B shape at batch 1",
          (bench("kda_decode", timeout=560, log="kda_decode.txt", show=tail(40)),)),
    *shape_pair("kimi", KIMI, "KDA + MLA + MoE"),
    Stage("vllmkimi", "wave", "vLLM 0.26 on kimi-linear-48b (the peer of tputkimi/latkimi)",
          (bench("vllm_peer", "--shape", "kimi-linear-48b", "--json", "{out}/vllm_kimi.json", timeout=560,
                 log="vllm_kimi.log", show=tail(8, NO_WARNINGS), env=VSITE),)),
    Stage("gdntests", "wave", "the GDN GPU tests: fla GDN prefill, fused GDN decode, tiny Qwen3.5/Next teacher-forced",
          (pytest("-rs", "tests/gpu/test_gpu_kda_prefill.py", "tests/gpu/test_gpu_gdn_hybrids.py",
                  "tests/kernels/test_kda_decode.py", "tests/hw_platform/test_kda_gate.py", timeout=560,
                  show=tail(30)),)),
    *shape_pair("qwen36", QWEN36, "GDN + gated attention + MoE"),
    Stage("vllmqwen36", "wave", "vLLM 0.26 on qwen3.6-35b-a3b (the peer of tputqwen36/latqwen36; issue 49)",
          (bench("vllm_peer", *QWEN36, "--json", "{out}/vllm_qwen36.json", timeout=560, log="vllm_qwen36.log",
                 show=tail(8, NO_WARNINGS), env=VSITE),)),
    *shape_pair("oss", ("--shape", "gpt-oss-20b", "--max-model-len", "4096"), "sinks + MoE, bf16 experts"),
    Stage("vllmoss", "wave", "vLLM 0.26 on gpt-oss-20b (the peer of tputoss/latoss; issue 50)",
          (bench("vllm_peer", "--shape", "gpt-oss-20b", "--json", "{out}/vllm_oss.json", timeout=560,
                 log="vllm_oss.log", show=tail(8, NO_WARNINGS), env=VSITE),)),
    *shape_pair("gemma4", ("--shape", "gemma4-26b-a4b", "--max-model-len", "4096"), "per-layer heads + MoE"),
    Stage("vllmgemma4", "wave", "vLLM 0.26 on gemma4-26b-a4b (the peer of tputgemma4/latgemma4; issue 50)",
          (bench("vllm_peer", "--shape", "gemma4-26b-a4b", "--json", "{out}/vllm_gemma4.json", timeout=560,
                 log="vllm_gemma4.log", show=tail(8, NO_WARNINGS), env=VSITE),)),
)
BY_NAME = {s.name: s for s in STAGES}
DEFAULT = ("tests", "tput", "lat", "lat8b", "tput8b")  # what runs when no stage is named
