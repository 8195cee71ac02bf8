"""Real n-gram (prompt lookup) speculation on copy-heavy prompts: kestrel alone on the embedded SmolLM2 GGUF
(--ngram-smollm2), or kestrel and vLLM 0.26 side by side on the same weights and token ids (--ngram-peer).

The side-by-side run loads one checkpoint folder in both engines: by default the embedded SmolLM2-135M-Instruct's
dequantised copy (safetensors + config, written once under kestrel's GGUF cache; real weights, so the model really
copies the passage it is asked to repeat and prompt lookup hits). The prompts are chat-templated and tokenized once
here and reach both engines as token ids (vLLM runs with skip_tokenizer_init). vLLM runs first, in a subprocess
whose PYTHONPATH starts with --vllm-pythonpath (its site); where vllm is not importable that half is skipped with a
line saying so. Both engines get the same speculative_config keys (method, num_speculative_tokens,
prompt_lookup_min, prompt_lookup_max) and report drafts and accepted tokens the same way (vLLM's
vllm:spec_decode_num_drafts / _num_accepted_tokens counters; mean accepted length = 1 + accepted / drafts).

    python -m benchmarks.spec_decode --ngram-peer --vllm-pythonpath /tmp/vsite --batches 1,8 --ks 3,5"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.procs import stop
from benchmarks.spec_timing import kestrel_spec_counts, row_of, timed_generate, timed_with_acceptance

COPY_TEXT = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\nclass Point:\n    def "
             "__init__(self, x, y):\n        self.x = x\n        self.y = y\n")
COPY_PROMPTS = [f"Rewrite this code exactly, adding a docstring to each function:\n{COPY_TEXT}",
                f"Repeat the following code unchanged:\n{COPY_TEXT}",
                "Copy this list, one item a line: apples, pears, plums, cherries, grapes, lemons, limes, figs.",
                f"Quote the code below and then explain it line by line:\n{COPY_TEXT}"]


def ngram_config(k: int, lookup_min: int, lookup_max: int) -> dict:
    """The speculative_config both engines take (vLLM 0.26's keys)."""
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lookup_min,
            "prompt_lookup_max": lookup_max}


def ngram_smollm2(args, device) -> list[dict]:
    """Kestrel alone on the embedded SmolLM2 GGUF, chat-templated copy-heavy prompts (greedy; the outputs are
    identical with and without drafts, so the rows compare the same work)."""
    from kestrel import LLM
    from kestrel.loader import default_model_path

    common = dict(device=device, enable_prefix_caching=False, progress=False, max_model_len=2048)
    rows = []
    for k in [0] + [int(x) for x in args.ks.split(",")]:
        spec = {**ngram_config(k, args.lookup_min, args.lookup_max), "disable_by_batch_size": None} if k else None
        llm = LLM(str(default_model_path()), speculative_config=spec, **common)
        tok = llm.engine.tokenizer
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in COPY_PROMPTS]
        for b in [int(x) for x in args.batches.split(",")]:
            batch = (prompts * b)[:b]
            timed_generate(llm, batch, args.output_len, device, 1)  # warm-up
            ttft, total, _, mean_len = timed_with_acceptance(llm, batch, args.output_len, device, args.reps)
            rows.append(row_of("ngram" if k else "no speculation", b, k, "", args.output_len, ttft, total, mean_len))
        llm.shutdown()
    return rows


def smollm2_checkpoint(dtype: str) -> tuple[str, str]:
    """(weights folder, tokenizer folder) of the embedded SmolLM2's dequantised copy in `dtype`, written under
    kestrel's GGUF cache on first use."""
    import torch

    from kestrel.config import ModelConfig
    from kestrel.loader import default_model_path
    from kestrel.loader.gguf import cache_folder, load_gguf, load_gguf_tokenizer, weights_folder

    gguf, cache = Path(default_model_path()), ModelConfig().gguf_cache_dir
    torch_dtype = getattr(torch, dtype)
    for _ in load_gguf(gguf, torch_dtype, cache, progress=False)[1]:
        pass  # the first pass writes the copy as the weights stream past
    load_gguf_tokenizer(gguf, cache)
    folder = weights_folder(gguf, cache, torch_dtype)
    if not (folder / "config.json").exists():
        raise RuntimeError(f"could not write SmolLM2's dequantised copy under {cache} (see the warning above)")
    return str(folder), str(cache_folder(gguf, cache) / "tokenizer")


def copy_prompt_ids(tokenizer_dir: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    return [list(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True, add_generation_prompt=True,
                                         return_dict=False)) for p in COPY_PROMPTS]


def measure(llm, job: dict, k: int, counts, device: str, params_cls=None, **param_kw):
    """Rows (one per batch) and greedy outputs {batch: [ids per prompt]} of one engine, either kind."""
    rows, outs = [], {}
    for b in job["batches"]:
        batch = [{"prompt_token_ids": p} for p in (job["prompts"] * b)[:b]]
        timed_generate(llm, batch, job["output_len"], device, 1, params_cls, **param_kw)  # warm-up
        ttft, total, outs[b], mean_len = timed_with_acceptance(llm, batch, job["output_len"], device, job["reps"],
                                                               counts, params_cls, **param_kw)
        rows.append(row_of("ngram" if k else "no speculation", b, k, "", job["output_len"], ttft, total, mean_len))
    return rows, outs


def kestrel_half(job: dict, device: str) -> dict:
    from kestrel import LLM

    result = {"engine": "kestrel", "runs": []}
    for k in [0, *job["ks"]]:
        spec = {**ngram_config(k, *job["lookup"]), "disable_by_batch_size": None} if k else None
        llm = LLM(job["model"], tokenizer=job["tokenizer"], speculative_config=spec, device=device,
                  dtype=job["dtype"], enable_prefix_caching=False, progress=False, max_model_len=job["max_model_len"],
                  max_num_seqs=max(job["batches"]))
        rows, outs = measure(llm, job, k, lambda: kestrel_spec_counts(llm), device)
        result["runs"].append({"k": k, "rows": rows, "outputs": outs})
        llm.shutdown()
    return result


def vllm_half(job: dict, out: Path) -> None:
    """vLLM 0.26 on the same folder and token ids (run in its own process: `--vllm-half JOB OUT`); `out` is
    rewritten after each engine, so a run cut short by its time limit still leaves what it measured."""
    try:
        import vllm
        from vllm import LLM, SamplingParams
    except ImportError as e:
        out.write_text(json.dumps({"engine": "vllm", "skipped": f"vllm is not importable ({e})"}))
        return

    def counts():
        metrics = llm.get_metrics()
        return tuple(int(sum(m.value for m in metrics if m.name == f"vllm:spec_decode_num_{name}"))
                     for name in ("drafts", "accepted_tokens"))

    result = {"engine": f"vllm {vllm.__version__}", "runs": []}
    for k in [0, *job["ks"]]:
        llm = LLM(model=job["model"], skip_tokenizer_init=True, dtype=job["dtype"], max_model_len=job["max_model_len"],
                  max_num_seqs=max(job["batches"]), gpu_memory_utilization=0.4, enable_prefix_caching=False, seed=0,
                  disable_log_stats=False, speculative_config=ngram_config(k, *job["lookup"]) if k else None)
        rows, outs = measure(llm, job, k, counts, job["device"], SamplingParams, detokenize=False)
        result["runs"].append({"k": k, "rows": rows, "outputs": outs})
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, out)  # whole or not at all, should the run be stopped here
        close_vllm(llm)
        del llm


def close_vllm(llm) -> None:
    """Stop vLLM's engine-core process and free its GPU memory before the next engine starts."""
    import gc

    import torch

    try:
        llm.llm_engine.engine_core.shutdown()
    except AttributeError as e:  # another vLLM layout: the engine goes with the last reference
        print(f"vLLM: no engine_core.shutdown ({e}); relying on garbage collection", flush=True)
    gc.collect()
    torch.cuda.empty_cache()


def run_vllm_half(job: dict, vllm_pythonpath: str | None, timeout: float | None = None) -> dict:
    """The vLLM half in a subprocess (its site first on PYTHONPATH), stopped after `timeout` seconds so that the
    kestrel half still runs: its engines that finished by then are kept."""
    with tempfile.TemporaryDirectory(prefix="kestrel-ngram-peer-") as d:
        job_file, out_file = Path(d) / "job.json", Path(d) / "vllm.json"
        job_file.write_text(json.dumps(job))
        env = dict(os.environ)
        if vllm_pythonpath:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (vllm_pythonpath, env.get("PYTHONPATH")) if p)
        # its own process group, so that stopping it stops vLLM's engine-core process too; a SIGTERM to this
        # process (the suite's time limit) passes on to it
        proc = subprocess.Popen([sys.executable, "-m", "benchmarks.spec_ngram", "--vllm-half", str(job_file),
                                 str(out_file)], env=env, start_new_session=True)
        on_term = signal.signal(signal.SIGTERM, lambda *_: (stop(proc), sys.exit(143)))
        try:
            why = f"the vLLM process exited with {proc.wait(timeout)}"
        except subprocess.TimeoutExpired:
            stop(proc)
            why = f"the vLLM process ran past {timeout:.0f} s"
        finally:
            signal.signal(signal.SIGTERM, on_term)
        if not out_file.exists():
            return {"engine": "vllm", "skipped": f"{why} before writing its results"}
        got = json.loads(out_file.read_text())
    if "skipped" not in got:
        for run in got["runs"]:  # JSON object keys are strings: the batch sizes are ints again
            run["outputs"] = {int(b): o for b, o in run["outputs"].items()}
        if len(got["runs"]) < 1 + len(job["ks"]):
            print(f"vLLM half cut short: {why}; kept k = {[r['k'] for r in got['runs']]}", flush=True)
    return got


def side_by_side(halves: list[dict]) -> tuple[list[dict], list[dict]]:
    """(a row per engine x k x batch with speed-up over that engine's own run without drafts and how many outputs
    match it, a row per k x batch with the engines side by side)."""
    rows, by = [], {}
    for half in halves:
        if "skipped" in half:
            continue
        base = {r["batch"]: r["ms_per_token"] for r in half["runs"][0]["rows"]}
        ref = half["runs"][0]["outputs"]
        for run in half["runs"]:
            for r in run["rows"]:
                b = r["batch"]
                outs = run["outputs"][b]
                same = sum(o == p for o, p in zip(outs, ref[b]))
                row = dict(engine=half["engine"], **{c: v for c, v in r.items() if c != "alpha"}, speedup=f"{base[b] / r['ms_per_token']:.2f}x",
                           same_as_no_spec=f"{same}/{len(outs)}")
                rows.append(row)
                by[(half["engine"].split()[0], r["k"], b)] = row
    summary = []
    for (engine, k, b), row in sorted(by.items(), key=lambda kv: (kv[0][2], kv[0][1])):
        if engine != "kestrel" or not k:
            continue
        peer = by.get(("vllm", k, b), {})
        summary.append(dict(batch=b, k=k, kestrel_ms=row["ms_per_token"], kestrel_speedup=row["speedup"],
                            kestrel_mean_len=row["mean_accepted_len"], vllm_ms=peer.get("ms_per_token", ""),
                            vllm_speedup=peer.get("speedup", ""), vllm_mean_len=peer.get("mean_accepted_len", "")))
    return rows, summary


def same_text(halves: list[dict]) -> str:
    """How many no-speculation outputs the two engines agree on (same weights, bf16 kernels of their own: a near-tie
    may flip a token)."""
    done = [h for h in halves if "skipped" not in h]
    if len(done) < 2:
        return "n/a"
    a, b = (h["runs"][0]["outputs"] for h in done)
    pairs = [(x, y) for batch in a if batch in b for x, y in zip(a[batch], b[batch])]
    return f"{sum(x == y for x, y in pairs)}/{len(pairs)}"


def peer_job(args, device) -> dict:
    """What both halves run: the checkpoint folder, token-id prompts, batches, ks, lookup sizes, lengths."""
    dtype = "float32" if device == "cpu" else "bfloat16"
    model, tokenizer = (args.model, args.model) if args.model else smollm2_checkpoint(dtype)
    prompts = copy_prompt_ids(tokenizer)
    return dict(model=model, tokenizer=tokenizer, device=device, dtype=dtype, prompts=prompts,
                batches=[int(x) for x in args.batches.split(",")], ks=[int(x) for x in args.ks.split(",")],
                lookup=[args.lookup_min, args.lookup_max], output_len=args.output_len, reps=args.reps,
                max_model_len=max(map(len, prompts)) + args.output_len + 16)


def report(job: dict, halves: list[dict]) -> dict:
    for half in halves:
        if "skipped" in half:
            print(f"vLLM half skipped: {half['skipped']}", flush=True)
    rows, summary = side_by_side(halves)
    outputs = {h["engine"]: {run["k"]: run["outputs"] for run in h["runs"]} for h in halves if "skipped" not in h}
    return dict(model=job["model"], lookup=job["lookup"], rows=rows, summary=summary,
                same_text_no_spec=same_text(halves), skipped=[h["skipped"] for h in halves if "skipped" in h],
                outputs=outputs)


def ngram_peer(args, device) -> dict:
    job = peer_job(args, device)
    # vLLM first, while this process holds no GPU memory
    peer = (run_vllm_half(job, args.vllm_pythonpath, args.vllm_timeout) if device != "cpu" else
            {"engine": "vllm", "skipped": "vLLM runs on the GPU only"})
    return report(job, [kestrel_half(job, device), peer])


if __name__ == "__main__" and sys.argv[1:2] == ["--vllm-half"]:
    vllm_half(json.loads(Path(sys.argv[2]).read_text()), Path(sys.argv[3]))
