"""Structured-output cost: nano-vllm's 256-request workload with a JSON schema on every request vs the same
requests unconstrained, on a random-weight model shape (GPU).

Random weights need a tokenizer for the grammar: a byte-level BPE (like Qwen's) is trained here on the
repository's own text, and the shape's vocabulary (the logits) stays the model's. The constrained run ends each
request where its JSON is complete (or at its max_tokens); the unconstrained run then generates exactly those
lengths (ignore_eos), so both produce the same tokens and the ratio of their times is the cost of the masks.

    python -m benchmarks.structured [--shape qwen3-0.6b] [--num-requests 256] [--json out.json]"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from benchmarks.common import ROOT, SHAPES, git_commit, nano_workload, print_table

SMOKE_SHAPE = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=4096,
                   max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False)

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"}, "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
    "genre": {"enum": ["drama", "comedy", "thriller", "documentary"]},
    "tags": {"type": "array", "items": {"type": "string"}},
    "cast": {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string"}, "role": {"type": "string"}, "lead": {"type": "boolean"}},
        "required": ["name", "role", "lead"]}},
    "summary": {"type": "string"}},
    "required": ["title", "year", "genre", "tags", "cast", "summary"]}


def train_tokenizer(vocab_size: int, corpus_files: int = 4000):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    import transformers

    # a large, varied corpus that every machine with Kestrel has: this repository and the transformers sources
    files = [p for ext in ("py", "md") for p in ROOT.rglob(f"*.{ext}") if ".venv" not in p.parts]
    files += sorted(Path(transformers.__file__).parent.rglob("*.py"))[:corpus_files]
    texts = [p.read_text(errors="ignore") for p in files]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")


def model_dir(shape: str, vocab_size: int, fill_vocab: bool = False) -> Path:
    """config.json of the shape + a trained tokenizer. fill_vocab: one added token (" w<i>") for each model id
    past the trained ones, so that every id a random-weight model samples decodes to text (a streamed chunk)."""
    tok = train_tokenizer(vocab_size)
    d = Path(tempfile.mkdtemp(prefix=f"kestrel-so-{shape}-"))
    cfg = {**(SHAPES.get(shape) or SMOKE_SHAPE), "torch_dtype": "bfloat16", "bos_token_id": tok.bos_token_id,
           "eos_token_id": tok.eos_token_id}
    if fill_vocab:
        tok.add_tokens([f" w{i}" for i in range(len(tok), cfg["vocab_size"])])
    (d / "config.json").write_text(json.dumps(cfg))
    tok.save_pretrained(d)
    print(f"tokenizer: byte-level BPE, {len(tok)} tokens (model vocabulary {cfg['vocab_size']})")
    return d


class instrument:
    """Times the manager's host work per constrained step: start_step (the engine loop waits there until every
    grammar has taken its token), the fill (start to the last slice's end) and how long the engine loop then
    waits for it where the step samples."""

    def __init__(self, manager):
        self.manager, self.steps = manager, 0
        self.total = dict(advance=0.0, fill=0.0, wait=0.0)
        self._start, self._slice = manager.start_step, manager._fill_slice
        manager.start_step, manager._fill_slice = self.start_step, self.run_slice
        self._ends: list[float] = []

    def ms(self, key: str) -> float:
        return self.total[key] / max(self.steps, 1) * 1e3

    def stop(self) -> None:
        self.manager.start_step, self.manager._fill_slice = self._start, self._slice

    def run_slice(self, *args):
        self._slice(*args)
        self._ends.append(time.perf_counter())

    def start_step(self, accepts, rows):
        t0 = time.perf_counter()
        ends = self._ends = []
        job = self._start(accepts, rows)
        self.total["advance"] += time.perf_counter() - t0
        if job is None:
            return None
        self.steps += 1
        result = job.result

        def timed_result():
            t = time.perf_counter()
            out = result()
            self.total["wait"] += time.perf_counter() - t
            self.total["fill"] += max(ends) - t0
            return out

        job.result = timed_result
        return job


def timed_generate(llm, prompts, params):
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t = time.perf_counter()
    res = llm.generate(prompts, params, use_tqdm=False)
    sync()
    return time.perf_counter() - t, res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-0.6b", choices=[*SHAPES, "smoke"], help="smoke: a tiny CPU check")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--max-output", type=int, default=1024, help="output lengths are uniform in [100, this]")
    ap.add_argument("--tokenizer-vocab", type=int, default=None, help="default 100000 (smoke: 3000)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--fill-threads", default=None, help="comma-separated fill-thread counts to run the constrained "
                    "workload with (default: the engine's)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.tokenizer_vocab = args.tokenizer_vocab or (3000 if args.shape == "smoke" else 100000)

    from kestrel import LLM, SamplingParams
    from kestrel.core.sampling_params import StructuredOutputsParams

    path = model_dir(args.shape, args.tokenizer_vocab)
    llm = LLM(str(path), load_format="dummy", dtype="bfloat16", max_num_seqs=256,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False, progress=False)
    core = llm.engine.core
    print(f"pipelined decode: {core.pipelined}")
    so = StructuredOutputsParams(json=SCHEMA)
    t = time.perf_counter()
    core.grammars.manager.submit(so).result()  # the tokenizer tables and this schema, compiled once (cached after)
    compile_s = time.perf_counter() - t
    prompts, outs = nano_workload(args.num_requests, out_range=(min(100, args.max_output), args.max_output),
                                  vocab_cap=min(10000, args.tokenizer_vocab))
    warm = [p[:64] for p in prompts[:8]]
    llm.generate(warm, SamplingParams(max_tokens=16, ignore_eos=True, detokenize=False), use_tqdm=False)
    llm.generate(warm, SamplingParams(max_tokens=16, structured_outputs=so, detokenize=False), use_tqdm=False)

    by_threads = {}
    for threads in ([int(x) for x in args.fill_threads.split(",")] if args.fill_threads else [0]):
        if threads:  # a new pool of this size for the next constrained step
            mgr = core.grammars.manager
            if mgr._pool is not None:
                mgr._pool.shutdown()
                mgr._pool = None
            mgr.fill_threads = threads
        host = instrument(core.grammars.manager)
        dt_c, res = timed_generate(llm, prompts, [SamplingParams(temperature=0.6, max_tokens=o, structured_outputs=so,
                                                                 detokenize=False) for o in outs])
        host.stop()
        mgr = core.grammars.manager
        by_threads[mgr.fill_threads] = dict(seconds=dt_c, tokens=sum(len(r.outputs[0].token_ids) for r in res),
                                            **{k: host.ms(k) for k in ("advance", "fill", "wait")})
    lengths = [len(r.outputs[0].token_ids) for r in res]
    valid = 0
    for r in res:
        try:
            json.loads(llm.tokenizer.decode(r.outputs[0].token_ids, skip_special_tokens=True))
            valid += 1
        except ValueError:
            pass
    dt_u, res_u = timed_generate(llm, prompts, [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True,
                                                               detokenize=False) for n in lengths])
    assert [len(r.outputs[0].token_ids) for r in res_u] == lengths
    n_out = sum(lengths)
    ratio = dt_u / dt_c
    rows = [dict(run="unconstrained", seconds=dt_u, out_tok_s=n_out / dt_u, ratio="-", fill_ms="-", loop_wait_ms="-")]
    # each constrained run samples its own JSON (lengths differ a little between runs): compare tokens/s
    rows += [dict(run=f"JSON schema on every request, {n} fill threads", seconds=v["seconds"],
                  out_tok_s=v["tokens"] / v["seconds"], ratio=f"{v['tokens'] / v['seconds'] / (n_out / dt_u):.1%}",
                  fill_ms=f"{v['fill']:.2f}", loop_wait_ms=f"{v['wait']:.2f}") for n, v in by_threads.items()]
    print_table(f"Structured outputs, {args.shape}, {len(prompts)} requests, {n_out} output tokens, "
                f"commit {git_commit()}", rows)
    print(f"\nconstrained / unconstrained throughput: {ratio:.1%} with {core.grammars.manager.fill_threads} fill threads "
          f"(acceptance: >= 85%)")
    print(f"host, per constrained step ({host.steps} steps, {core.grammars.manager.fill_threads} fill threads): "
          f"engine loop in start_step (tokens into the grammars) {host.ms('advance'):.2f} ms, tokens + bitmask "
          f"fill {host.ms('fill'):.2f} ms (start to last row), engine loop waiting for it {host.ms('wait'):.2f} ms")
    print(f"grammar compile (first, with tokenizer tables) {compile_s:.2f} s; "
          f"{sum(1 for n, o in zip(lengths, outs) if n < o)} requests completed their JSON before max_tokens, "
          f"{valid} outputs parse as JSON")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            shape=args.shape, commit=git_commit(), requests=len(prompts), output_tokens=n_out,
            unconstrained_s=dt_u, constrained_s=dt_c, ratio=ratio, fill_threads=core.grammars.manager.fill_threads,
            host_ms_per_step={k: host.ms(k) for k in ("advance", "fill", "wait")}, fill_steps=host.steps,
            compile_s=compile_s, pipelined=core.pipelined, by_fill_threads=by_threads), indent=1))


if __name__ == "__main__":
    main()
