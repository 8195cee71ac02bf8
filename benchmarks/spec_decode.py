"""Speculative decoding at controlled acceptance: ms per output token with and without drafts, on random-weight
model shapes (weights cannot be downloaded on the GPU machine, and a real drafter is never right about random
weights).

The drafts come from the *replay* proposer (kestrel/spec_decode/replay.py): a run without speculation records each
prompt's greedy output, and the replay proposer then proposes those tokens, each kept with probability alpha and
otherwise replaced by a wrong one. So a verify step costs what it costs with a real drafter of that acceptance
(minus the drafter's own time: n-gram's is host-side and small; EAGLE-3/MTP add a draft forward). The measured mean
accepted length is printed beside each row: on the GPU a near-tie in bf16 may flip between the decode and the
verify kernels, and every draft after a flip is wrong, so it can fall below what alpha implies.

    python -m benchmarks.spec_decode --shape llama-8b
    python -m benchmarks.spec_decode --shape qwen3-0.6b --batches 1,8,64 --alphas 0.6,0.8,0.9 --ks 2,3,4,5
    python -m benchmarks.spec_decode --model /path/to/checkpoint --device cpu --batches 1 --ks 2 --output-len 16
    python -m benchmarks.spec_decode --ngram-smollm2      # real n-gram drafts, copy-heavy prompts, embedded SmolLM2

ms/token is per request: (generation time - time to first token) / (output tokens - 1), all requests of a batch
running together; tok/s is the batch's output tokens over its generation time. Speculation is forced on at every
batch size here (disable_by_batch_size null); the rows show where it stops paying, which is what the engine's
default disable_by_batch_size should be."""
from __future__ import annotations

import argparse
import json
import time

from benchmarks.common import SHAPES, git_commit, nano_workload, print_table, write_shape


def _sync(device: str) -> None:
    if device != "cpu":
        import torch

        torch.cuda.synchronize()


def timed_generate(llm, prompts, n_out, device, reps):
    """(time to first token, total) of generating n_out greedy tokens for every prompt at once (best of reps)."""
    from kestrel import SamplingParams

    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True)
    ttft, total, outs = float("inf"), float("inf"), None
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        llm.generate(prompts, one, use_tqdm=False)
        _sync(device)
        ttft = min(ttft, time.perf_counter() - t)
        t = time.perf_counter()
        outs = llm.generate(prompts, full, use_tqdm=False)
        _sync(device)
        total = min(total, time.perf_counter() - t)
    return ttft, total, [o.outputs[0].token_ids for o in outs]


def row_of(label, batch, k, alpha, n_out, ttft, total, mean_accepted=None):
    gen = max(total - ttft, 1e-9)
    return dict(config=label, batch=batch, k=k, alpha=alpha, ms_per_token=gen / (n_out - 1) * 1e3,
                tok_per_s=batch * (n_out - 1) / gen, mean_accepted_len="" if mean_accepted is None
                else f"{mean_accepted:.2f}")


COPY_TEXT = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\nclass Point:\n    def "
             "__init__(self, x, y):\n        self.x = x\n        self.y = y\n")
COPY_PROMPTS = [f"Rewrite this code exactly, adding a docstring to each function:\n{COPY_TEXT}",
                f"Repeat the following code unchanged:\n{COPY_TEXT}",
                "Copy this list, one item a line: apples, pears, plums, cherries, grapes, lemons, limes, figs.",
                f"Quote the code below and then explain it line by line:\n{COPY_TEXT}"]


def ngram_smollm2(args, device) -> list[dict]:
    """Real n-gram speculation on copy-heavy chat prompts with the embedded SmolLM2-135M-Instruct (greedy; the
    outputs are identical with and without drafts, so the rows compare the same work)."""
    from kestrel import LLM
    from kestrel.loader import default_model_path

    model = str(default_model_path())
    common = dict(device=device, enable_prefix_caching=False, progress=False, max_model_len=2048)
    rows = []
    for k in [0] + [int(x) for x in args.ks.split(",")]:
        spec = {"method": "ngram", "num_speculative_tokens": k, "disable_by_batch_size": None} if k else None
        llm = LLM(model, speculative_config=spec, **common)
        tok = llm.engine.tokenizer
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in COPY_PROMPTS]
        for b in [int(x) for x in args.batches.split(",")]:
            batch = (prompts * b)[:b]
            timed_generate(llm, batch, args.output_len, device, 1)  # warm-up
            sp = llm.engine.core.speculation
            before = (sp.num_drafts, sp.num_accepted_tokens) if sp else (0, 0)
            ttft, total, _ = timed_generate(llm, batch, args.output_len, device, args.reps)
            mean_len = None
            if sp and sp.num_drafts > before[0]:
                mean_len = 1 + (sp.num_accepted_tokens - before[1]) / (sp.num_drafts - before[0])
            rows.append(row_of("ngram" if k else "no speculation", b, k, "", args.output_len, ttft, total,
                               mean_len))
        llm.engine.core.shutdown()
        del llm
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-8b", choices=sorted(SHAPES))
    ap.add_argument("--model", default=None, help="a checkpoint folder instead of a random-weight shape")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batches", default="1,8,16,32,64")
    ap.add_argument("--alphas", default="0.6,0.8,0.9")
    ap.add_argument("--ks", default="2,3,4,5")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--ngram-smollm2", action="store_true", help="n-gram drafts on copy-heavy prompts with the "
                    "embedded SmolLM2 instead of replay drafts on a shape")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from kestrel import LLM

    batches = [int(x) for x in args.batches.split(",")]
    alphas = [float(x) for x in args.alphas.split(",")]
    ks = [int(x) for x in args.ks.split(",")]
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.ngram_smollm2:
        rows = ngram_smollm2(args, device)
        print_table(f"n-gram speculation, SmolLM2-135M-Instruct (embedded), copy-heavy prompts, output "
                    f"{args.output_len}, device {device}, commit {git_commit()}", rows)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(model="smollm2", device=device, commit=git_commit(), rows=rows), f, indent=1)
        return rows, []
    if args.model:
        model, load = args.model, {}
    else:
        model, load = str(write_shape(args.shape)), dict(load_format="dummy", dtype="bfloat16")
    common = dict(device=device, max_num_seqs=max(batches), enable_prefix_caching=False, progress=False,
                  max_model_len=args.prompt_len + args.output_len + 16,
                  max_num_batched_tokens=max(2048, max(batches) * (1 + max(ks))), **load)
    rows, references = [], {}
    plain = LLM(model, **common)
    vocab = min(10000, int(plain.engine.core.model_config.vocab_size))
    prompts_all = nano_workload(max(batches), seed=3, in_range=(args.prompt_len, args.prompt_len),
                                vocab_cap=vocab)[0]
    for b in batches:
        timed_generate(plain, prompts_all[:b], args.output_len, device, 1)  # warm-up
        ttft, total, outs = timed_generate(plain, prompts_all[:b], args.output_len, device, args.reps)
        references.update({tuple(p): o for p, o in zip(prompts_all[:b], outs)})
        rows.append(row_of("no speculation", b, 0, "", args.output_len, ttft, total))
    plain.engine.core.shutdown()
    del plain

    refs = [[list(p), o] for p, o in references.items()]
    for k in ks:  # an engine per k: its verify CUDA graphs are captured for exactly k drafts a request
        spec_cfg = {"method": "replay", "num_speculative_tokens": k, "disable_by_batch_size": None,
                    "replay_references": refs}
        llm = LLM(model, speculative_config=spec_cfg, **common)
        sp = llm.engine.core.speculation
        for b in batches:
            timed_generate(llm, prompts_all[:b], args.output_len, device, 1)  # warm-up
            for alpha in alphas:
                sp.proposer.alpha = alpha  # the one engine serves every alpha
                before = (sp.num_drafts, sp.num_accepted_tokens)
                ttft, total, _ = timed_generate(llm, prompts_all[:b], args.output_len, device, args.reps)
                drafts, accepted = sp.num_drafts - before[0], sp.num_accepted_tokens - before[1]
                mean_len = 1 + accepted / drafts if drafts else None
                rows.append(row_of("replay drafts", b, k, alpha, args.output_len, ttft, total, mean_len))
        llm.engine.core.shutdown()
        del llm
    rows.sort(key=lambda r: (r["k"] > 0, r["batch"], str(r["alpha"]), r["k"]))

    name = args.model or args.shape
    print_table(f"Speculative decoding (replay proposer), {name}, prompt {args.prompt_len}, output "
                f"{args.output_len}, device {device}, commit {git_commit()}", rows)
    base = {r["batch"]: r["ms_per_token"] for r in rows if r["k"] == 0}
    best = {}
    for r in rows:
        key = (r["batch"], r["alpha"])
        if r["k"] and (key not in best or r["ms_per_token"] < best[key]["ms_per_token"]):
            best[key] = r
    summary = [dict(batch=b, alpha=a, best_k=r["k"], ms_per_token=r["ms_per_token"],
                    no_spec_ms_per_token=base[b], speedup=f"{base[b] / r['ms_per_token']:.2f}x")
               for (b, a), r in sorted(best.items())]
    print_table("Best k per batch and alpha", summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=name, device=device, commit=git_commit(), rows=rows, best=summary), f, indent=1)
    return rows, summary


if __name__ == "__main__":
    main()
